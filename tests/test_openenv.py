"""OpenEnv environments (grpokit.integrations.openenv): a guessing game written as an openenv `Environment`, served
on 127.0.0.1 by openenv's own server and played over its WebSocket client, one session per rollout, by a tiny
Qwen2 with Qwen2.5's chat template. The policy is scripted where the numbers must be hand-computable."""

import re
import threading
import time

import pytest

# Without openenv-core these tests skip (with GRPOKIT_REQUIRE_OPENENV=1, CI's, conftest makes that a failure).
pytest.importorskip("openenv.core", reason='needs openenv-core: pip install "grpokit[openenv]"')

from agents_helpers import assert_sampled_logprobs_match_training, tiny_agent_model
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.integrations import adapt_environment
from grpokit.integrations.openenv import REWARDS_COLUMN, OpenEnvEnvironment
from grpokit.rollout import ScriptedEngine
from grpokit.rollout.engine import SamplingParams

pytestmark = pytest.mark.openenv

RAISES, SLEEPS = 7, 8  # guesses that make the environment's step raise, or take longer than the step timeout
WRONG = -0.25  # the reward of a wrong guess; a right one gets 1 and ends the episode


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""


class GuessingGame(Environment):
    """Guess the episode's number (the reset seed); each wrong guess is told 'higher' or 'lower'."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    sessions = 0  # instances the server built: one per WebSocket session
    in_flight = max_in_flight = 0  # steps running at once, across sessions
    lock = threading.Lock()

    def __init__(self):
        super().__init__()
        self.target, self._state = 0, State()
        with GuessingGame.lock:
            GuessingGame.sessions += 1

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = seed or 0
        return GuessObservation(feedback=f"Episode {self.target}: guess a digit.")

    def step(self, action, timeout_s=None, **kwargs):
        with GuessingGame.lock:
            GuessingGame.in_flight += 1
            GuessingGame.max_in_flight = max(GuessingGame.max_in_flight, GuessingGame.in_flight)
        try:
            time.sleep(0.2)  # long enough that the sessions' steps overlap when they run in parallel
            if action.guess == RAISES:
                raise RuntimeError("the game crashed")
            if action.guess == SLEEPS:
                time.sleep(3.0)
            if action.guess == self.target:
                return GuessObservation(feedback="Correct!", reward=1.0, done=True)
            return GuessObservation(feedback="higher" if action.guess < self.target else "lower", reward=WRONG)
        finally:
            with GuessingGame.lock:
                GuessingGame.in_flight -= 1

    @property
    def state(self):
        return self._state


def parse_guess(text: str) -> dict | None:
    match = re.fullmatch(r"\s*guess (\d)\s*", text)
    return {"guess": int(match.group(1))} if match else None  # None: not an action (a bad one)


def guessing_policy(tokenizer, first_guess):
    """A ScriptedEngine: the first turn says first_guess(target, index) (a text), later turns follow the feedback."""

    def script(prompt_ids, index):
        text = tokenizer.decode(prompt_ids)
        target = int(re.search(r"Episode (\d)", text).group(1))
        guesses = [int(g) for g in re.findall(r"guess (\d)<\|im_end\|>", text)]
        feedback = re.findall(r"\b(higher|lower)\b", text)  # as a user message or a tool result
        if not guesses:
            reply = first_guess(target, index)
        else:
            reply = f"guess {guesses[-1] + (1 if feedback[-1] == 'higher' else -1)}"
        return tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]

    return ScriptedEngine(script)


def one_low(target, index):
    """Even rows guess right at once; odd rows one too low, then right."""
    return f"guess {target if index % 2 == 0 else target - 1}"


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=96,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


@pytest.fixture
def game():
    GuessingGame.sessions = GuessingGame.max_in_flight = 0
    environment = OpenEnvEnvironment.serve(
        GuessingGame,
        GuessAction,
        GuessObservation,
        prompt="Play.",
        seeds=[3, 5],
        parse_action=parse_guess,
        step_timeout=1.0,
    )
    yield environment
    environment.close()


def test_observations_are_continuation_tokens_and_the_model_turns_trained(game):
    _, tokenizer = tiny_agent_model()
    driver = game.driver(tokenizer, config("unused"), max_prompt_length=None)
    rows = [dict(row) for row in game.train_dataset()][:1] * 2  # seed 3, twice (a group of G = 2)
    params = SamplingParams(
        max_new_tokens=96, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
    )
    rollout, completions = driver.rollout(guessing_policy(tokenizer, one_low), rows, params, seed=0)
    assert rollout.extra[REWARDS_COLUMN] == [[1.0], [WRONG, 1.0]]
    # The second row as the chat template renders the whole conversation: the reset observation appended to the
    # prompt's user message, the model's turns as assistant messages, the feedback as a user message.
    messages = [
        {"role": "user", "content": "Play.\n\nEpisode 3: guess a digit."},
        {"role": "assistant", "content": "guess 2"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "guess 3"},
    ]
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    length = int(rollout.lengths[1])
    ids, loss_mask = rollout.completion_ids[1, :length].tolist(), rollout.loss_mask[1, :length].tolist()
    assert tokenizer.decode(rollout.prompt_ids[1][rollout.prompt_mask[1].bool()]) == prompt
    assert tokenizer.decode(ids) == whole[len(prompt) :].removesuffix("\n")
    trained = [token for token, flag in zip(ids, loss_mask) if flag]
    inserted = [token for token, flag in zip(ids, loss_mask) if not flag]
    assert tokenizer.decode(trained) == "guess 2<|im_end|>guess 3<|im_end|>"
    assert tokenizer.decode(inserted) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert rollout.extra["turn_ends"][1] == [len(tokenizer("guess 2<|im_end|>")["input_ids"]), length]
    assert completions[1][1:] == [{"role": "user", "content": "higher"}, {"role": "assistant", "content": "guess 3"}]


@pytest.mark.parametrize("rewards", ["sum", "turns"])
def test_a_training_step_logs_the_environments_rewards(tmp_path, rewards):
    model, tokenizer = tiny_agent_model()
    with OpenEnvEnvironment.serve(
        GuessingGame,
        GuessAction,
        GuessObservation,
        prompt="Play.",
        seeds=[3, 5],
        parse_action=parse_guess,
        rewards=rewards,
    ) as environment:
        trainer = GRPOTrainer(
            model=model,
            args=config(tmp_path),
            processing_class=tokenizer,
            environment=environment,
            rollout_engine=guessing_policy(tokenizer, one_low),
        )
        trainer.train()
    log = trainer.state.log_history[0]
    # Per seed: one rollout right at once (rewards [1]), one a step too low ([-0.25, 1]).
    if rewards == "sum":  # one reward per rollout: 1 and 0.75
        assert log["rewards/openenv/mean"] == pytest.approx((1.0 + 0.75) / 2)
        assert log["reward"] == pytest.approx(0.875)
    else:  # each turn credited its step's reward; the metric is the mean step reward per rollout: 1 and 0.375
        assert log["rewards/openenv/mean"] == pytest.approx((1.0 + 0.375) / 2)
    assert log["openenv/step/call_frequency"] == pytest.approx(1.5)
    assert log["openenv/done_frequency"] == 1.0 and log["openenv/step/failure_frequency"] == 0.0


def test_groups_play_at_once_under_asynchronous_generation(tmp_path):
    """With max_staleness > 0 the streaming producer plays each prompt's group in a thread of its own (sessions are
    per rollout, so groups may overlap); the logged rewards are those of the synchronous run."""
    model, tokenizer = tiny_agent_model()
    with OpenEnvEnvironment.serve(
        GuessingGame,
        GuessAction,
        GuessObservation,
        prompt="Play.",
        seeds=[3, 5],
        parse_action=parse_guess,
        rewards="sum",
    ) as environment:
        trainer = GRPOTrainer(
            model=model,
            args=config(tmp_path, max_steps=2, max_staleness=1),
            processing_class=tokenizer,
            environment=environment,
            rollout_engine=guessing_policy(tokenizer, one_low),
        )
        trainer.train()
    for log in trainer.state.log_history[:2]:
        assert log["rewards/openenv/mean"] == pytest.approx(0.875)
        assert log["openenv/step/call_frequency"] == pytest.approx(1.5) and log["openenv/done_frequency"] == 1.0


def test_turn_credit_gives_each_turn_the_rewards_from_it_on(game):
    """Process credit: a token's advantage is the sum of the group-normalised rewards of the steps that end at or
    after its turn (grpokit.process_advantages), so the too-low first guess is credited less than the right one."""
    import torch

    from grpokit import process_advantages

    _, tokenizer = tiny_agent_model()
    driver = game.driver(tokenizer, config("unused"), max_prompt_length=None)
    rows = [dict(row) for row in game.train_dataset()][:1] * 2
    params = SamplingParams(
        max_new_tokens=96, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
    )
    rollout, _ = driver.rollout(guessing_policy(tokenizer, one_low), rows, params, seed=0)
    steps = game.reward_funcs()[0](openenv_rewards=rollout.extra[REWARDS_COLUMN])
    assert steps == [[1.0], [WRONG, 1.0]]
    advantages = process_advantages(steps, rollout.extra["turn_ends"], 2, rollout.completion_ids.shape[1])
    # The group's step rewards {1, -0.25, 1}: mean 0.5833, std 0.7217 (Bessel); normalised 0.5774 and -1.1547.
    high, low = (
        (1.0 - 7 / 12) / (torch.tensor([1.0, WRONG, 1.0]).std().item() + 1e-4),
        (WRONG - 7 / 12) / (torch.tensor([1.0, WRONG, 1.0]).std().item() + 1e-4),
    )
    first_end, _ = rollout.extra["turn_ends"][1]
    assert advantages[0, 0].item() == pytest.approx(high, rel=1e-4)
    assert advantages[1, 0].item() == pytest.approx(low + high, rel=1e-4)  # the first turn: both steps after it
    assert advantages[1, first_end].item() == pytest.approx(high, rel=1e-4)  # the second turn: its own step


def test_a_raising_a_hanging_step_and_a_bad_action_are_counted_and_training_goes_on(tmp_path):
    model, tokenizer = tiny_agent_model()
    GuessingGame.sessions = GuessingGame.max_in_flight = 0
    # One prompt, 4 rollouts: right at once; a guess that crashes the game; one that hangs past the 1 s timeout;
    # one that is not a guess.
    turns = {
        0: lambda t: f"guess {t}",
        1: lambda t: f"guess {RAISES}",
        2: lambda t: f"guess {SLEEPS}",
        3: lambda t: "I give up",
    }
    engine = guessing_policy(tokenizer, lambda target, index: turns[index](target))
    with OpenEnvEnvironment.serve(
        GuessingGame,
        GuessAction,
        GuessObservation,
        prompt="Play.",
        seeds=[3],
        parse_action=parse_guess,
        rewards="sum",
        step_timeout=1.0,
        invalid_action_reward=-1.0,
    ) as environment:
        trainer = GRPOTrainer(
            model=model,
            args=config(tmp_path, num_generations=4, max_steps=2),
            processing_class=tokenizer,
            environment=environment,
            rollout_engine=engine,
        )
        trainer.train()
    first, second = trainer.state.log_history[:2]
    for log in (first, second):
        # Scored: the right guess (1) and the bad action (-1); the crashed and the hung session are unscored.
        assert log["rewards/openenv/mean"] == pytest.approx(0.0)
        assert log["openenv/step/failure_frequency"] == pytest.approx(2 / 3)  # 3 steps sent, 2 failed
        assert log["environment/error_frequency"] == log["environment/timeout_frequency"] == pytest.approx(1 / 4)
        assert log["openenv/action/failure_frequency"] == pytest.approx(1 / 4)
        assert log["openenv/done_frequency"] == pytest.approx(1 / 4)
    # One session per rollout (4 a step, 2 steps), and their steps ran at once.
    assert GuessingGame.sessions == 8 and GuessingGame.max_in_flight >= 3


def test_an_unreachable_server_leaves_rollouts_unscored(tmp_path):
    _, tokenizer = tiny_agent_model()
    environment = OpenEnvEnvironment("http://127.0.0.1:9", parse_action=parse_guess, step_timeout=1.0)
    driver = environment.driver(tokenizer, config(tmp_path), max_prompt_length=None)
    rows = [{"prompt": [{"role": "user", "content": "Episode 1"}], "seed": 1}] * 2
    params = SamplingParams(
        max_new_tokens=16, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
    )
    rollout, _ = driver.rollout(guessing_policy(tokenizer, one_low), rows, params, seed=0)
    assert rollout.extra[REWARDS_COLUMN] == [None, None]
    assert rollout.loss_mask.sum(1).tolist() == [len(tokenizer("guess 1<|im_end|>")["input_ids"])] * 2


def test_a_typed_client_and_observations_as_tool_results(game):
    """An environment's own typed client (openenv's template: typed actions and observations) and the observation
    rendered as a tool result."""
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult

    class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
        def _step_payload(self, action):
            return {"guess": action.guess}

        def _parse_result(self, payload):
            observation = GuessObservation(
                **payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward")
            )
            return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

        def _parse_state(self, payload):
            return State(**payload)

    _, tokenizer = tiny_agent_model()
    typed = OpenEnvEnvironment(
        game.url,
        client_class=GuessClient,
        observation_role="tool",
        prompt="Play.",
        parse_action=lambda text: GuessAction(**parse_guess(text)),
    )
    driver = typed.driver(tokenizer, config("unused"), max_prompt_length=None)
    rows = [{"prompt": typed.prompt, "seed": 3}] * 2
    params = SamplingParams(
        max_new_tokens=96, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
    )
    rollout, completions = driver.rollout(guessing_policy(tokenizer, one_low), rows, params, seed=0)
    assert rollout.extra[REWARDS_COLUMN] == [[1.0], [WRONG, 1.0]]
    inserted = [
        t
        for t, flag in zip(rollout.completion_ids[1].tolist(), rollout.loss_mask[1].tolist())
        if not flag and t != tokenizer.pad_token_id
    ]
    assert tokenizer.decode(inserted) == (
        "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert completions[1][1] == {"role": "tool", "name": "step", "content": "higher"}


def test_an_openenv_client_is_adapted_and_bad_options_refused(game):
    from openenv.core import GenericEnvClient

    adapter = adapt_environment(GenericEnvClient(base_url=game.url))
    assert isinstance(adapter, OpenEnvEnvironment) and adapter.url == game.url.replace("http://", "ws://")
    assert adapter.client_class is GenericEnvClient
    with pytest.raises(ValueError, match="rewards='mean'"):
        OpenEnvEnvironment(game.url, rewards="mean")
    one_at_a_time = type("OneAtATime", (GuessingGame,), {"SUPPORTS_CONCURRENT_SESSIONS": False})
    with pytest.raises(ValueError, match="OneAtATime does not set SUPPORTS_CONCURRENT_SESSIONS = True"):
        OpenEnvEnvironment.serve(one_at_a_time, GuessAction, GuessObservation)


def load_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "openenv_grpo.py"
    spec = importlib.util.spec_from_file_location("openenv_grpo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_runs_tiny(tmp_path):
    """examples/openenv_grpo.py --tiny, as docs/guides/openenv.md runs it; its sessions end without server errors."""
    from examples_helpers import run_tiny_example

    assert "Exception in ASGI application" not in run_tiny_example("openenv_grpo", tmp_path).stderr


def test_sampling_logprobs_of_every_turn_equal_the_training_forward_of_the_whole_transcript():
    """The in-process engine plays the example's game (a model warmed up on its format, so that it makes moves):
    each turn is sampled on the token ids of the transcript so far, observations included, so the training forward
    over prompt + completion gives the sampled tokens the log-probs they were drawn with."""
    from grpokit.rollout import HFEngine

    example = load_example()
    model, tokenizer = example.tiny_model()
    example.warm_up(model, tokenizer, steps=15)
    with example.environment(seeds=[7]) as game:
        driver = game.driver(tokenizer, config("unused", max_completion_length=48), max_prompt_length=None)
        params = SamplingParams(
            max_new_tokens=48, pad_token_id=tokenizer.pad_token_id, eos_token_ids=(tokenizer.eos_token_id,)
        )
        rows = [dict(row) for row in game.train_dataset()] * 8
        rollout, _ = driver.rollout(HFEngine(model), rows, params, seed=0)
    turns = [len(ends) for ends in rollout.extra["turn_ends"]]
    assert max(turns) >= 2  # observations between turns, in context
    assert_sampled_logprobs_match_training(model, rollout)


@pytest.mark.slow
@pytest.mark.parametrize("rewards", ["sum", "turns"])
def test_a_tiny_model_learns_the_guessing_game(tmp_path, rewards):
    """The example's game with the digit always 7: after a warm-up on the format (random guesses), GRPO finds the
    digit from the environment's rewards alone. Measured on CPU (2 shared cores, 10-40 s each): sum -0.13 over the
    first 5 steps -> 0.97 over the last 5; turns (the mean step reward) 0.02 -> 0.94."""
    example = load_example()
    model, tokenizer = example.tiny_model()
    assert example.warm_up(model, tokenizer) < 0.7  # the format learned: the digit alone is uncertain (ln 10 / 4)
    args = config(
        tmp_path,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=40,
        max_steps=30,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
    )
    with example.environment(seeds=[7, 17, 27, 37], rewards=rewards) as game:
        trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, environment=game)
        trainer.train()
    rewards_seen = [log["rewards/openenv/mean"] for log in trainer.state.log_history if "rewards/openenv/mean" in log]
    first, last = sum(rewards_seen[:5]) / 5, sum(rewards_seen[-5:]) / 5
    assert first < 0.3 and last > 0.75, rewards_seen
