"""environment_factory (TRL 1.16): pooled instances reset with each row, their public methods as tools, get_reward as
a reward source, reward functions receiving `environments`; train_dataset=None; and rollout_func's contract."""

import pytest
import torch
from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer


class Vault:
    """A key-value store the model reads through its tool; it scores the rollout by whether the tool was used."""

    built = 0

    def __init__(self):
        Vault.built += 1
        self.resets, self.reads = [], 0

    def reset(self, **row):
        self.resets.append(row)
        self.reads = 0
        return f" (vault {row['vault']})"

    def read(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: the key to read
        """
        self.reads += 1
        return TABLE[key]

    def get_reward(self) -> float:
        return float(self.reads)

    def _private(self, key: str) -> str:  # not a tool: private
        return "secret"


class Counter:
    """A second environment, for routing."""

    def reset(self, **row):
        self.row, self.count = row, 0

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


def vault_rows(*keys):
    return [{"prompt": [{"role": "user", "content": f"key {k}"}], "vault": i} for i, k in enumerate(keys)]


def test_environments_are_pooled_reset_with_their_row_and_score_through_get_reward(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            call_text("read", {"key": key_of(user)}) if not results else f"{results[-1]}<|im_end|>"
        ),
    )
    seen_environments = []

    def uses_environments(completions, environments, vault, **kwargs):
        seen_environments.append(list(environments))
        assert [e.resets[-1]["vault"] for e in environments] == list(vault)  # each row's own instance
        return [0.0] * len(completions)

    Vault.built = 0
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=uses_environments,
        args=config(tmp_path),
        train_dataset=Dataset.from_list(vault_rows("k1", "k2", "k3", "k4")),
        processing_class=tokenizer,
        environment_factory=Vault,
        rollout_engine=engine,
    )
    assert Vault.built == 1  # one probe instance, which becomes the pool's first
    trainer.train()
    # Two generations of 4 rows: 4 instances built once, reset every generation.
    assert Vault.built == 4
    first, second = seen_environments
    assert [id(e) for e in first] == [id(e) for e in second] and len({id(e) for e in first}) == 4
    assert all(len(e.resets) == 2 for e in first)
    row = first[0].resets[0]
    assert set(row) == {"prompt", "vault"} and row["prompt"] == [{"role": "user", "content": f"key {key_of(str(row))}"}]
    # The observation joined the prompt's last message; the tool's schema is in the prompt; the private method not.
    prompt_text = tokenizer.decode(engine.calls[0].ids[0])
    assert f"(vault {row['vault']})<|im_end|>" in prompt_text and '"name": "read"' in prompt_text
    assert "_private" not in prompt_text and '"name": "reset"' not in prompt_text
    # get_reward is a reward function named after the class (weight 1): every rollout read once.
    log = trainer.state.log_history[0]
    assert log["rewards/Vault/mean"] == 1.0 and log["tools/read/call_frequency"] == 1.0
    assert log["rewards/uses_environments/mean"] == 0.0 and log["reward"] == 1.0


def test_a_dict_of_environments_routes_each_row_and_shows_only_its_tools(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: "done<|im_end|>")
    rows = [
        {"prompt": [{"role": "user", "content": "key k1"}], "environment": "vault", "vault": 0},
        {"prompt": [{"role": "user", "content": "key k2"}], "environment": "counter", "vault": 1},
    ]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory={"vault": Vault, "counter": Counter},
        rollout_engine=engine,
    )
    trainer.train()
    prompts = [tokenizer.decode(ids) for ids in engine.calls[0].ids]
    for text in prompts:
        is_vault = "(vault" in text
        assert ('"name": "read"' in text) == is_vault and ('"name": "increment"' in text) == (not is_vault)
    counters = trainer.agents.environments.pool["counter"]
    assert all("environment" not in c.row for c in counters)  # the routing column is not passed to reset
    # Vault's get_reward scores only Vault's rollouts (None for the Counter's): the mean is over its own rows.
    assert trainer.state.log_history[0]["rewards/Vault/mean"] == 0.0


def test_environment_errors_are_clear_in_trls_words(tmp_path):
    model, tokenizer = tiny_agent_model()
    reward = lambda completions, **k: [0.0] * len(completions)  # noqa: E731

    class NoReset:
        pass

    with pytest.raises(
        ValueError,
        match=r"Each environment instance returned by `environment_factory` must define a "
        "callable `reset`. The environment NoReset",
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config(tmp_path),
            train_dataset=None,
            processing_class=tokenizer,
            environment_factory=NoReset,
        )
    with pytest.raises(
        ValueError,
        match=r"When training without a `train_dataset` \(the environment owns the data "
        r"and returns the prompt from `reset\(\)`\), `max_steps` must be set to a "
        r"positive value",
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config(tmp_path, max_steps=-1),
            train_dataset=None,
            processing_class=tokenizer,
            environment_factory=Vault,
        )
    with pytest.raises(
        ValueError,
        match=r"A `dict` `environment_factory` \(multiple environments\) requires a "
        r"`train_dataset` with an `environment` column",
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config(tmp_path),
            train_dataset=None,
            processing_class=tokenizer,
            environment_factory={"a": Vault},
        )
    with pytest.raises(
        ValueError,
        match=r"No reward source provided. Pass `reward_funcs`, or an "
        "`environment_factory` whose environment defines a `get_reward` method.",
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=None,
            args=config(tmp_path),
            train_dataset=None,
            processing_class=tokenizer,
            environment_factory=Counter,
        )
    with pytest.raises(ValueError, match=r"`train_dataset` is required unless an `environment_factory` is provided."):
        GRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path), processing_class=tokenizer)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}], "environment": "b"}] * 2),
        processing_class=tokenizer,
        environment_factory={"a": Counter},
    )
    with pytest.raises(
        ValueError,
        match=r"Example has `environment='b'`, which is not among the environments passed "
        r"to `environment_factory`. Expected one of: \['a'\].",
    ):
        trainer.train()


def test_without_a_dataset_the_environment_supplies_the_prompts(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: "ok<|im_end|>")

    class Riddles:
        def reset(self, **row):
            assert row == {"prompt": [{"role": "user", "content": ""}]}
            return "key k7"

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(tmp_path, max_steps=3),
        train_dataset=None,
        processing_class=tokenizer,
        environment_factory=Riddles,
        rollout_engine=engine,
    )
    trainer.train()
    assert trainer.state.global_step == 3 and len(engine.calls) == 3
    assert all(
        tokenizer.decode(ids).endswith("<|im_start|>user\nkey k7<|im_end|>\n<|im_start|>assistant\n")
        for call in engine.calls
        for ids in call.ids
    )


# --------------------------------------------------------------------------------------------- rollout_func


def test_rollout_func_output_is_trained_on_with_its_env_mask_and_extra_columns(tmp_path):
    model, tokenizer = tiny_agent_model()
    received = {}

    def rollout_func(prompts, trainer):
        received["prompts"] = prompts
        ids = [
            tokenizer(p if isinstance(p, str) else p[0]["content"], add_special_tokens=False)["input_ids"]
            for p in prompts
        ]
        completion = tokenizer("v1 v2<|im_end|>", add_special_tokens=False)["input_ids"]
        return {
            "prompt_ids": ids,
            "completion_ids": [completion] * len(prompts),
            "logprobs": [[-1.0] * len(completion)] * len(prompts),
            "env_mask": [[1, 1, 0, 0, 0, 1]] * len(prompts),
            "judge": [i % 2 for i in range(len(prompts))],
        }

    scores = []

    def judged(completions, judge, **kwargs):
        scores.append((list(completions), list(judge)))
        return [float(j) for j in judge]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=judged,
        args=config(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
        processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    batch = trainer.generate_batch()
    assert received["prompts"] == ["a", "a", "b", "b"]  # one per completion: each prompt num_generations times
    assert scores[0] == (["v1 v2"] * 4, [0, 1, 0, 1])
    assert (batch.loss_mask == torch.tensor([1, 1, 0, 0, 0, 1])).all() and batch.attention_mask.all()
    assert torch.equal(batch.sampling_logprobs, torch.full((4, 6), -1.0))
    assert batch.old_logprobs is None  # on-policy: the rollout_func's log-probs are never taken for π_old


@pytest.mark.parametrize(
    "output, message",
    [
        ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4}, r"must return keys \['logprobs'\]"),
        (
            {"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 3, "logprobs": [[0.0]] * 4},
            "'completion_ids' must be a list with one entry per prompt",
        ),
        (
            {"prompt_ids": [[1]] * 4, "completion_ids": [[2, 3]] * 4, "logprobs": [[0.0]] * 4},
            r"logprobs\[0\] has 1 entries for 2 completion tokens",
        ),
        (
            {"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4, "env_mask": [[1, 1]] * 4},
            r"env_mask\[0\] has 2 entries",
        ),
        ([1, 2], "must return a dict"),
    ],
)
def test_rollout_func_contract_errors_name_the_problem(tmp_path, output, message):
    model, tokenizer = tiny_agent_model()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(tmp_path, max_steps=1),
        train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
        processing_class=tokenizer,
        rollout_func=lambda prompts, trainer: output,
    )
    with pytest.raises((ValueError, TypeError), match=message):
        trainer.train()


# ------------------------------------------------------------- TRL's environment-owned rewards and data


class Tally:
    """TRL's DummyEnvironment: a counter the model increments through its tool; it owns the reward (the count)."""

    def reset(self, **row):
        self.count = 0

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def tally_script(tokenizer):
    """Per group of 3: a valid call of increment, a call of a tool that does not exist, no call (TRL's script)."""
    first = [call_text("increment", {"step": 1}), call_text("decrement", {"step": 2}), "I won't increment<|im_end|>"]
    return tool_call_script(tokenizer, lambda user, results, index: first[index] if not results else "Done!<|im_end|>")


def test_an_environment_owning_its_reward_and_data_trains_without_reward_funcs_or_dataset(tmp_path):
    # TRL 1.16's test_train_with_environment_owned_reward: no reward_funcs, no train_dataset; the environment's
    # get_reward is the only reward source (named after its class, weight 1) and is no tool; reset() supplies the
    # (empty) prompts for max_steps steps.
    model, tokenizer = tiny_agent_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(
        model=model,
        args=config(tmp_path, per_device_train_batch_size=3, num_generations=3, learning_rate=0.1),
        processing_class=tokenizer,
        environment_factory=Tally,
        rollout_engine=tally_script(tokenizer),
    )
    assert trainer.reward_func_names == ["Tally"] and trainer.reward_weights.tolist() == [1.0]
    assert [tool.__name__ for tool in trainer.tools] == ["increment"]  # not get_reward, not reset
    trainer.train()
    assert trainer.state.global_step == 2
    record = trainer.state.log_history[-2]
    assert record["rewards/Tally/mean"] == pytest.approx(1 / 3)  # counts 1, 0, 0
    assert record["tools/call_frequency"] == pytest.approx(2 / 3)
    assert record["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


def test_an_environment_owned_reward_comes_after_the_reward_functions_with_weight_one(tmp_path):
    # TRL's test_environment_owned_reward_coexists_with_reward_funcs: reward_weights weigh the trainer's own
    # reward functions; the environment's reward is appended with weight 1.
    model, tokenizer = tiny_agent_model()

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=format_reward,
        args=config(tmp_path, per_device_train_batch_size=3, num_generations=3, reward_weights=[0.5]),
        processing_class=tokenizer,
        environment_factory=Tally,
    )
    assert trainer.reward_func_names == ["format_reward", "Tally"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0] and len(trainer.reward_funcs) == 2
    assert [tool.__name__ for tool in trainer.tools] == ["increment"]


def test_standalone_tools_and_each_environments_tools_are_the_trainers_tools(tmp_path):
    from agents_helpers import lookup

    model, tokenizer = tiny_agent_model()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(tmp_path),
        train_dataset=Dataset.from_list(vault_rows("k1", "k2")),
        processing_class=tokenizer,
        tools=[lookup],
        environment_factory={"vault": Vault, "counter": Counter},
    )
    assert [tool.__name__ for tool in trainer.tools] == ["lookup", "read", "increment"]
    assert trainer.tools[1].__self__ is trainer.agents.environments.pool["vault"][0]  # the probe instance's method
    # What each environment's rows are shown, and the pooled instances, the probe first.
    assert {name: [t.__name__ for t in tools] for name, tools in trainer.environment_tools.items()} == {
        "vault": ["lookup", "read"],
        "counter": ["lookup", "increment"],
    }
    assert trainer.environment_tools["counter"][1].__self__ is trainer.environment_pool["counter"][0]
    assert {name: [type(e) for e in pool] for name, pool in trainer.environment_pool.items()} == {
        "vault": [Vault],
        "counter": [Counter],
    }
    plain = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=config(tmp_path),
        train_dataset=Dataset.from_list(vault_rows("k1", "k2")),
        processing_class=tokenizer,
    )
    assert plain.tools == [] and plain.environment_tools == {} and plain.environment_pool == {}


def test_several_environments_in_one_run_each_rollout_calls_its_own_tools(tmp_path):
    # TRL's test_train_with_multiple_environments: a dataset of environment names only; with shuffle_dataset=False
    # and num_generations=2 each generation is [counter, counter, echo, echo]; each rollout sees and calls only its
    # own environment's tool, and reset() never receives the routing column.
    model, tokenizer = tiny_agent_model()
    resets, calls = {"counter": [], "echo": []}, {"increment": [], "shout": []}

    class CounterEnvironment:
        def reset(self, **row):
            resets["counter"].append(row)
            return "Count."

        def increment(self, step: int) -> int:
            """Increment the internal counter.

            Args:
                step: Value to add to the counter.
            """
            calls["increment"].append(step)
            return step

    class EchoEnvironment:
        def reset(self, **row):
            resets["echo"].append(row)
            return "Echo."

        def shout(self, text: str) -> str:
            """Shout the given text.

            Args:
                text: Text to shout.
            """
            calls["shout"].append(text)
            return text.upper()

    def turns(user, results, index):
        if results:
            return "Done!<|im_end|>"
        if index == 1:
            return "I won't<|im_end|>"
        return call_text("increment", {"step": 1}) if user == "Count." else call_text("shout", {"text": "hi"})

    rewarded_prompts = []

    def reward(prompts, completions, **kwargs):
        rewarded_prompts.extend(prompts)
        return [float(len(c)) for c in completions]

    engine = tool_call_script(tokenizer, turns)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config(tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=2, shuffle_dataset=False),
        train_dataset=Dataset.from_dict({"environment": ["counter", "echo"] * 8}),
        processing_class=tokenizer,
        environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment},
        rollout_engine=engine,
    )
    assert [tool.__name__ for tool in trainer.tools] == ["increment", "shout"]
    # TRL's test_train_with_multiple_environments checks these under its private names, which name the same.
    assert trainer._env_tools == trainer.environment_tools and trainer._environment_pool is trainer.environment_pool
    assert [tool.__name__ for tool in trainer.environment_tools["counter"]] == ["increment"]
    assert [tool.__name__ for tool in trainer.environment_tools["echo"]] == ["shout"]
    assert len(trainer.environment_pool["counter"]) == len(trainer.environment_pool["echo"]) == 1
    trainer.train()
    assert calls == {"increment": [1, 1], "shout": ["hi", "hi"]}  # one call of each per generation
    for record in [r for r in trainer.state.log_history if "loss" in r]:
        assert record["tools/call_frequency"] == pytest.approx(2 / 4)
        assert record["tools/failure_frequency"] == 0.0
    assert len(resets["counter"]) == len(resets["echo"]) == 4  # 2 rows each per generation, 2 generations
    assert all("environment" not in row for row in resets["counter"] + resets["echo"])
    # The rows have no prompt: as in TRL, the reward functions receive the one the model saw, an empty user turn
    # with the environment's observation appended (a reward model needs it).
    count, echo = [{"role": "user", "content": "Count."}], [{"role": "user", "content": "Echo."}]
    assert rewarded_prompts == [count, count, echo, echo] * 2
    first_prompts = [tokenizer.decode(ids) for ids in engine.calls[0].ids]  # one per group: counter, echo
    assert ['"name": "increment"' in p for p in first_prompts] == [True, False]
    assert ['"name": "shout"' in p for p in first_prompts] == [False, True]


def test_a_mocked_generate_samples_as_in_trls_environment_factory_test(tmp_path):
    # TRL's test_train_with_environment_factory patches the model's generate (TRL samples with it): the first call
    # returns a valid tool call, a call of an unknown tool and no call; the second, for the two rows that called,
    # 'Done!'. grpokit's in-process engine then samples with that generate too; trainer.environments holds the
    # rollouts' instances, as TRL's.
    from unittest.mock import patch

    model, tokenizer = tiny_agent_model()

    class Incrementer(Tally):
        get_reward = None  # TRL's DummyEnvironment has none: scored by reward_funcs

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first = [
        ids(call_text("increment", {"step": 1})),
        ids(call_text("decrement", {"step": 2})),
        ids("I won't increment<|im_end|>"),
    ]
    calls = []

    def fake_generate(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        rows = first if input_ids.shape[0] == 3 else [ids("Done!<|im_end|>")] * input_ids.shape[0]
        width = max(map(len, rows))
        completion = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        return torch.cat([input_ids, completion], dim=-1)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [float(len(str(c))) for c in completions],
        args=config(
            tmp_path, per_device_train_batch_size=3, num_generations=3, learning_rate=0.1, max_completion_length=256
        ),  # TRL's default: room for the unknown tool's error
        processing_class=tokenizer,
        environment_factory=Incrementer,
    )
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()
    assert calls == [3, 2, 3, 2]  # two steps: three rows, then the two that called a tool
    record = trainer.state.log_history[-2]
    assert record["tools/call_frequency"] == pytest.approx(2 / 3)
    assert record["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert [environment.count for environment in trainer.environments] == [1, 0, 0]
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
