"""GRPOTrainer(environment=<classic verifiers environment>) (grpokit.integrations.verifiers_classic): a
SingleTurnEnv's dataset and weighted rubric, a MultiTurnEnv's reply trained on as context only (the gradient against
a plain forward of the whole transcript), a ToolEnv with a tool of the test, and environments that raise, hang or
refuse an action. Environments are defined here (no hub); runs in verifiers' environment (`pytest -m verifiers`)."""

import asyncio
import time

import pytest
import torch
from agents_helpers import (
    TABLE,
    call_text,
    dapo_update,
    key_of,
    lookup,
    relative_error,
    tiny_agent_model,
    tool_call_script,
)
from conftest import has_verifiers_v1
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer, group_advantages
from grpokit.integrations import adapt_environment
from grpokit.rollout import SamplingParams

if has_verifiers_v1():  # verifiers 0.4 has no classic API at its top level: its own tests are -m verifiers_v1
    pytest.skip("classic verifiers tests need verifiers < 0.4; 0.4 is installed", allow_module_level=True)
vf = pytest.importorskip("verifiers", reason="needs verifiers 0.3 (pip install 'grpokit[verifiers]')")
pytestmark = pytest.mark.verifiers

REPLY = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # a user turn after an assistant turn (Qwen2.5)


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=2,
        max_steps=1,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def questions(n=4):
    return Dataset.from_list([{"question": f"key k{i}", "answer": TABLE[f"k{i}"]} for i in range(n)])


def exact(completion, answer) -> float:
    return float(completion[-1]["content"] == answer)


SCORING = []  # (start, end) of each call of `slow_length`


async def slow_length(completion) -> float:
    start = time.monotonic()
    await asyncio.sleep(0.2)
    SCORING.append((start, time.monotonic()))
    return float(len(completion[-1]["content"]))


class Recording:
    """An engine that keeps the prompts it is given."""

    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def sync_weights(self, model):
        self.inner.sync_weights(model)

    def generate(self, batch, params, seed):
        self.prompts += batch.ids
        return self.inner.generate(batch, params, seed)


def test_a_single_turn_env_supplies_its_prompts_and_its_weighted_rubric(tmp_path):
    model, tokenizer = tiny_agent_model()
    few_shot = [{"role": "user", "content": "key k99"}, {"role": "assistant", "content": TABLE["k99"]}]
    rubric = vf.Rubric(funcs=[exact, slow_length], weights=[1.0, 0.5])
    env = vf.SingleTurnEnv(
        dataset=questions(), system_prompt="Answer with the value.", few_shot=few_shot, rubric=rubric
    )
    engine = Recording(tool_call_script(tokenizer, lambda user, results, index: "v??<|im_end|>"))
    SCORING.clear()
    trainer = GRPOTrainer(
        model=model, args=config(tmp_path), processing_class=tokenizer, environment=env, rollout_engine=engine
    )
    assert trainer.args.reward_weights == [1.0, 0.5, 0.0]  # the rubric's, its num_turns metric included
    trainer.train()
    # The environment's formatting: system prompt, few-shot, question, as the chat template renders them.
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer with the value."}, *few_shot, {"role": "user", "content": "key k0"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert expected in [tokenizer.decode(p) for p in engine.prompts]
    log = trainer.state.log_history[0]
    # Every row answered "v??": exact 0, length 3 — logged unweighted, `reward` weighted (1·0 + 0.5·3 + 0·1).
    assert log["rewards/exact/mean"] == 0.0 and log["rewards/slow_length/mean"] == 3.0
    assert log["rewards/num_turns/mean"] == 1.0
    assert log["reward"] == pytest.approx(1.5)
    # The async function scored the 8 rows concurrently (one group of 2 at a time would take 4 × 0.2 s).
    assert len(SCORING) == 8 and max(s for s, _ in SCORING) < min(e for _, e in SCORING)


def test_single_turn_rewards_follow_the_answers(tmp_path):
    model, tokenizer = tiny_agent_model()
    env = vf.SingleTurnEnv(dataset=questions(), rubric=vf.Rubric(funcs=[exact], weights=[2.0]))
    # k0 and k2 answered right, k1 and k3 wrong: exact = 0.5, reward = 2 · 0.5.
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (TABLE[key_of(user)] if key_of(user) in ("k0", "k2") else "no") + "<|im_end|>",
    )
    trainer = GRPOTrainer(
        model=model, args=config(tmp_path), processing_class=tokenizer, environment=env, rollout_engine=engine
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["rewards/exact/mean"] == 0.5 and log["reward"] == pytest.approx(1.0)


class Guess(vf.MultiTurnEnv):
    """The model answers; the environment replies "again" once; the model answers again."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=2, **kwargs)

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def second_answer_right(completion, answer) -> float:
    return float(completion[-1]["content"] == answer)


def guess_engine(tokenizer):
    from grpokit.rollout import ScriptedEngine

    def script(prompt_ids, index):
        text = tokenizer.decode(prompt_ids)
        if "again" not in text:
            return ids(tokenizer, "v??<|im_end|>")
        return ids(tokenizer, (TABLE[key_of(text)] if index % 2 == 0 else "value") + "<|im_end|>")

    return ScriptedEngine(script)


def test_a_multi_turn_env_reply_is_context_without_loss_the_transcript_is_sampled_on_ids():
    _, tokenizer = tiny_agent_model()
    env = Guess(dataset=questions(2), rubric=vf.Rubric(funcs=[second_answer_right]))
    driver = adapt_environment(env).driver(tokenizer, config("/tmp/unused"), None)
    rows = [row for row in env.get_dataset() for _ in range(2)]
    params = SamplingParams(
        max_new_tokens=64, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )
    rollout, completions = driver.rollout(guess_engine(tokenizer), rows, params, seed=0)
    for row in range(4):
        key = f"k{row // 2}"
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"key {key}"}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompt
        second = (TABLE[key] if row % 2 == 0 else "value") + "<|im_end|>"
        parts = [
            (ids(tokenizer, "v??<|im_end|>"), 1),
            (ids(tokenizer, REPLY.format("again")), 0),
            (ids(tokenizer, second), 1),
        ]
        length = int(rollout.attention_mask[row].sum())
        assert rollout.completion_ids[row, :length].tolist() == [t for part, _ in parts for t in part]
        assert rollout.loss_mask[row, :length].tolist() == [m for part, m in parts for _ in part]
        assert [m["role"] for m in completions[row]] == ["assistant", "user", "assistant"]
    states = rollout.extra["verifiers_state"]
    assert [s["metrics"]["second_answer_right"] for s in states] == [1.0, 0.0, 1.0, 0.0]
    assert [s["metrics"]["num_turns"] for s in states] == [2.0] * 4


def test_the_trainer_update_equals_a_plain_forward_of_the_transcript_with_the_reply_masked(tmp_path):
    """One step on the scripted two-turn transcripts; with AdamW at a huge epsilon the update reads off the
    trainer's gradient, compared with autograd of a plain forward of prompt + answer + reply + answer, the DAPO loss
    over the model's two answers only."""
    model, tokenizer = tiny_agent_model()
    reference_model, _ = tiny_agent_model()
    env = Guess(dataset=questions(2), rubric=vf.Rubric(funcs=[second_answer_right]))
    lr, eps = 1e6, 1e6
    args = config(
        tmp_path,
        per_device_train_batch_size=4,
        learning_rate=lr,
        adam_epsilon=eps,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        loss_type="dapo",
    )
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, environment=env, rollout_engine=guess_engine(tokenizer)
    )
    initial = {k: v.detach().clone() for k, v in trainer.unwrapped_model.named_parameters()}
    transcripts, masks = [], []
    for row in range(4):
        key = f"k{row // 2}"
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"key {key}"}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        second = (TABLE[key] if row % 2 == 0 else "value") + "<|im_end|>"
        parts = [
            (prompt, 0),
            (ids(tokenizer, "v??<|im_end|>"), 1),
            (ids(tokenizer, REPLY.format("again")), 0),
            (ids(tokenizer, second), 1),
        ]
        transcripts.append([t for part, _ in parts for t in part])
        masks.append([m for part, m in parts for _ in part])
    width = max(map(len, transcripts))
    input_ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x in transcripts])
    attention = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in transcripts])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)
    expected = dapo_update(reference_model, input_ids, attention, loss_mask, advantages, lr, eps)
    trainer.train()
    update = {k: v.detach() - initial[k] for k, v in trainer.unwrapped_model.named_parameters()}
    assert relative_error(update, expected) < 1e-3
    # The test can fail: training on the environment's reply too is another update.
    reply_too = attention[:, 1:].float()
    reply_too[:, : int(masks[0].index(1)) - 1] = 0
    assert (
        relative_error(dapo_update(reference_model, input_ids, attention, reply_too, advantages, lr, eps), expected)
        > 0.1
    )
    assert trainer.state.log_history[0]["rewards/second_answer_right/mean"] == 0.5


def found(completion, answer) -> float:
    return float(completion[-1]["content"] == answer)


def test_a_tool_env_calls_the_tests_tool_and_counts_calls_and_unknown_tools(tmp_path):
    model, tokenizer = tiny_agent_model()
    env = vf.ToolEnv(tools=[lookup], dataset=questions(), rubric=vf.Rubric(funcs=[found]), max_turns=3)

    def turn(user, results, index):
        key = key_of(user)
        if results:
            return f"{results[-1]}<|im_end|>"
        if key == "k3":  # a call of a tool the environment does not have: it answers with the error
            return call_text("nosuch", {"key": key})
        return call_text("lookup", {"key": key}) if key in ("k0", "k1") else "v??<|im_end|>"

    trainer = GRPOTrainer(
        model=model,
        args=config(tmp_path),
        processing_class=tokenizer,
        environment=env,
        rollout_engine=tool_call_script(tokenizer, turn),
    )
    trainer.train()
    log = trainer.state.log_history[0]
    # k0, k1 look the value up and answer it; k2 answers at once (wrong); k3 calls an unknown tool, then answers
    # with the error the environment returned (wrong).
    assert log["rewards/found/mean"] == 0.5
    assert log["tools/call_frequency"] == 0.75 and log["tools/failure_frequency"] == pytest.approx(1 / 3)
    assert log["tools/lookup/call_frequency"] == 0.5 and log["rewards/total_tool_calls/mean"] == 0.75
    assert log["environment/error_frequency"] == 0.0


class Moody(vf.MultiTurnEnv):
    """Replies to k0 by raising, to k1 by hanging past timeout_seconds, to k2 by refusing the action (vf.Error, as
    verifiers environments reject a move they cannot parse); to k3 normally."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=2, timeout_seconds=2.0, **kwargs)

    async def env_response(self, messages, state, **kwargs):
        key = state["answer"]
        if key == TABLE["k0"]:
            raise RuntimeError("the environment broke")
        if key == TABLE["k1"]:
            await asyncio.sleep(30)
        if key == TABLE["k2"]:
            raise vf.Error(f"cannot parse the move {messages[-1]['content']!r}")
        return [{"role": "user", "content": "again"}]


def test_environment_errors_timeouts_and_refused_actions_are_counted_excluded_and_training_goes_on(tmp_path):
    model, tokenizer = tiny_agent_model()
    env = Moody(dataset=questions(), rubric=vf.Rubric(funcs=[second_answer_right]))
    trainer = GRPOTrainer(
        model=model,
        args=config(tmp_path, max_steps=2),
        processing_class=tokenizer,
        environment=env,
        rollout_engine=guess_engine(tokenizer),
    )
    start = time.monotonic()
    trainer.train()
    assert time.monotonic() - start < 20  # the hanging reply cost its timeout, not its 30 s
    assert trainer.state.global_step == 2
    for log in trainer.state.log_history[:2]:
        # Of 4 prompts (2 rows each): k0 raised, k2 refused (errors), k1 timed out; k3 played its two turns. The
        # failed rows score None (excluded): the means are k3's two rows'.
        assert log["environment/error_frequency"] == 0.5 and log["environment/timeout_frequency"] == 0.25
        assert log["rewards/num_turns/mean"] == 2.0
        assert log["rewards/second_answer_right/mean"] == 1 / 2  # k3's first row answers right the second time


def test_only_classic_environments_are_adapted_so_a_v1_adapter_can_sit_beside_this_one():
    from grpokit.integrations.verifiers_classic import ClassicEnvironment, adapt

    v1_like = type("Env", (), {"__module__": "verifiers.v1.env"})()
    assert adapt(v1_like) is None and adapt(object()) is None
    assert isinstance(adapt_environment(Guess(dataset=questions(1))), ClassicEnvironment)


def answers_again(completion) -> float:
    """The model ended its first turn, so the environment could reply and the model answer again."""
    return float(len(completion) == 3)


async def says_value_again(completion) -> float:
    return float(len(completion) == 3 and "value" in completion[-1]["content"])


@pytest.mark.slow
def test_a_tiny_model_learns_to_play_both_turns_of_a_classic_multi_turn_env(tmp_path):
    """A random tiny model rarely ends its first turn within 16 tokens (the budget ends the rollout first): GRPO on
    the environment's rubric teaches it to, so that the environment replies and a second turn follows. Measured
    on CPU: reward 0.0 -> 0.5, turns 1.0 -> 2.0 in 20 steps (about 30 s for 30 steps)."""
    model, tokenizer = tiny_agent_model(hidden_size=64)
    data = Dataset.from_list([{"question": f"key k{i}", "answer": "value"} for i in range(32)])
    env = Guess(dataset=data, rubric=vf.Rubric(funcs=[answers_again, says_value_again], weights=[0.5, 1.0]))
    args = config(
        tmp_path,
        per_device_train_batch_size=32,
        num_generations=8,
        max_steps=30,
        max_completion_length=16,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
    )
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, environment=env)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    first, last = logs[:5], logs[-5:]

    def mean(logs, name):
        return sum(log[name] for log in logs) / len(logs)

    assert mean(last, "reward") > mean(first, "reward") + 0.3
    assert mean(last, "rewards/num_turns/mean") > mean(first, "rewards/num_turns/mean") + 0.5


def test_the_example_runs_tiny_offline(tmp_path):
    from examples_helpers import run_tiny_example

    run_tiny_example("verifiers_grpo", tmp_path)
