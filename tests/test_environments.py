"""environment_factory (TRL 1.16): pooled instances reset with each row, their public methods as tools, get_reward as
a reward source, reward functions receiving `environments`; train_dataset=None; and rollout_func's contract."""

import pytest
import torch
from datasets import Dataset

from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
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
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=2,
                  max_completion_length=64, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                  disable_tqdm=True, report_to="none", seed=0)  # fmt: skip
    return GRPOConfig(**{**values, **overrides})


def vault_rows(*keys):
    return [{"prompt": [{"role": "user", "content": f"key {k}"}], "vault": i} for i, k in enumerate(keys)]


def test_environments_are_pooled_reset_with_their_row_and_score_through_get_reward(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: call_text("read", {"key": key_of(user)})
                              if not results else f"{results[-1]}<|im_end|>")  # fmt: skip
    seen_environments = []

    def uses_environments(completions, environments, vault, **kwargs):
        seen_environments.append(list(environments))
        assert [e.resets[-1]["vault"] for e in environments] == list(vault)  # each row's own instance
        return [0.0] * len(completions)

    Vault.built = 0
    trainer = GRPOTrainer(model=model, reward_funcs=uses_environments, args=config(tmp_path),
                          train_dataset=Dataset.from_list(vault_rows("k1", "k2", "k3", "k4")),
                          processing_class=tokenizer, environment_factory=Vault, rollout_engine=engine)  # fmt: skip
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
    rows = [{"prompt": [{"role": "user", "content": "key k1"}], "environment": "vault", "vault": 0},
            {"prompt": [{"role": "user", "content": "key k2"}], "environment": "counter", "vault": 1}]
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          args=config(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, environment_factory={"vault": Vault, "counter": Counter},
                          rollout_engine=engine)  # fmt: skip
    trainer.train()
    prompts = [tokenizer.decode(ids) for ids in engine.calls[0].ids]
    for text in prompts:
        is_vault = "(vault" in text
        assert ('"name": "read"' in text) == is_vault and ('"name": "increment"' in text) == (not is_vault)
    counters = trainer.agents.environments.pool["counter"]
    assert all("environment" not in c.row for c in counters)  # the routing column is not passed to reset
    # Vault's get_reward scores only Vault's rollouts (None for the Counter's): the mean is over its own rows.
    assert trainer.state.log_history[0]["rewards/Vault/mean"] == 0.0


def test_environment_errors_are_clear(tmp_path):
    model, tokenizer = tiny_agent_model()
    reward = lambda completions, **k: [0.0] * len(completions)  # noqa: E731

    class NoReset:
        pass

    with pytest.raises(ValueError, match="has no callable reset"):
        GRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path), train_dataset=None,
                    processing_class=tokenizer, environment_factory=NoReset)  # fmt: skip
    with pytest.raises(ValueError, match="set max_steps > 0"):
        GRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path, max_steps=-1), train_dataset=None,
                    processing_class=tokenizer, environment_factory=Vault)  # fmt: skip
    with pytest.raises(ValueError, match="needs a train_dataset with an 'environment' column"):
        GRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path), train_dataset=None,
                    processing_class=tokenizer, environment_factory={"a": Vault})  # fmt: skip
    with pytest.raises(ValueError, match="No reward source"):
        GRPOTrainer(model=model, reward_funcs=None, args=config(tmp_path), train_dataset=None,
                    processing_class=tokenizer, environment_factory=Counter)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}],
                                                            "environment": "b"}] * 2),
                          processing_class=tokenizer, environment_factory={"a": Counter})  # fmt: skip
    with pytest.raises(ValueError, match="environment='b', which is not among the environments"):
        trainer.train()


def test_without_a_dataset_the_environment_supplies_the_prompts(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: "ok<|im_end|>")

    class Riddles:
        def reset(self, **row):
            assert row == {"prompt": [{"role": "user", "content": ""}]}
            return "key k7"

    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          args=config(tmp_path, max_steps=3), train_dataset=None, processing_class=tokenizer,
                          environment_factory=Riddles, rollout_engine=engine)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 3 and len(engine.calls) == 3
    assert all(tokenizer.decode(ids).endswith("<|im_start|>user\nkey k7<|im_end|>\n<|im_start|>assistant\n")
               for call in engine.calls for ids in call.ids)


# --------------------------------------------------------------------------------------------- rollout_func


def test_rollout_func_output_is_trained_on_with_its_env_mask_and_extra_columns(tmp_path):
    model, tokenizer = tiny_agent_model()
    received = {}

    def rollout_func(prompts, trainer):
        received["prompts"] = prompts
        ids = [tokenizer(p if isinstance(p, str) else p[0]["content"], add_special_tokens=False)["input_ids"]
               for p in prompts]
        completion = tokenizer("v1 v2<|im_end|>", add_special_tokens=False)["input_ids"]
        return {"prompt_ids": ids, "completion_ids": [completion] * len(prompts),
                "logprobs": [[-1.0] * len(completion)] * len(prompts),
                "env_mask": [[1, 1, 0, 0, 0, 1]] * len(prompts), "judge": [i % 2 for i in range(len(prompts))]}

    scores = []

    def judged(completions, judge, **kwargs):
        scores.append((list(completions), list(judge)))
        return [float(j) for j in judge]

    trainer = GRPOTrainer(model=model, reward_funcs=judged, args=config(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
                          processing_class=tokenizer, rollout_func=rollout_func)  # fmt: skip
    batch = trainer.generate_batch()
    assert received["prompts"] == ["a", "a", "b", "b"]  # one per completion: each prompt num_generations times
    assert scores[0] == (["v1 v2"] * 4, [0, 1, 0, 1])
    assert (batch.loss_mask == torch.tensor([1, 1, 0, 0, 0, 1])).all() and batch.attention_mask.all()
    assert torch.equal(batch.sampling_logprobs, torch.full((4, 6), -1.0))
    assert batch.old_logprobs is None  # on-policy: the rollout_func's log-probs are never taken for π_old


@pytest.mark.parametrize("output, message", [
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4}, r"must return keys \['logprobs'\]"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 3, "logprobs": [[0.0]] * 4},
     "'completion_ids' must be a list with one entry per prompt"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2, 3]] * 4, "logprobs": [[0.0]] * 4},
     r"logprobs\[0\] has 1 entries for 2 completion tokens"),
    ({"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4, "env_mask": [[1, 1]] * 4},
     r"env_mask\[0\] has 2 entries"),
    ([1, 2], "must return a dict"),
])  # fmt: skip
def test_rollout_func_contract_errors_name_the_problem(tmp_path, output, message):
    model, tokenizer = tiny_agent_model()
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                          args=config(tmp_path, max_steps=1),
                          train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
                          processing_class=tokenizer, rollout_func=lambda prompts, trainer: output)  # fmt: skip
    with pytest.raises((ValueError, TypeError), match=message):
        trainer.train()
