"""GRPOTrainer(environment=...): an environment of another library supplies the prompts, the rewards and their
weights, and the multi-turn driver (grpokit.integrations). Here an adapter written in the test, as a user would for
a library grpokit does not know, playing its turns with grpokit's own tool loop."""

import pytest
from agents_helpers import TABLE, call_text, key_of, lookup, tiny_agent_model, tool_call_script
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.agents import Agents
from grpokit.integrations import EnvironmentAdapter, adapt_environment


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
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


def found(completions, key, **kwargs):
    return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]


def called(completions, **kwargs):
    return [float(any(m.get("tool_calls") for m in c)) for c in completions]


class LookupEnvironment:
    """An environment of an imaginary library: prompts asking for a key, a lookup tool, two weighted rewards."""

    def __init__(self):
        self.drivers = 0

    def train_dataset(self):
        return Dataset.from_list(
            [{"prompt": [{"role": "user", "content": f"key {k}"}], "key": k} for k in ("k1", "k2", "k3", "k4")]
        )

    def reward_funcs(self):
        return [found, called]

    def reward_weights(self):
        return [1.0, 0.5]

    def driver(self, tokenizer, args, max_prompt_length):
        self.drivers += 1
        return Agents(
            tokenizer,
            tools=[lookup],
            max_completion_length=args.max_completion_length,
            max_prompt_length=max_prompt_length,
        )


def test_an_adapter_supplies_prompts_weighted_rewards_and_turns(tmp_path):
    model, tokenizer = tiny_agent_model()
    # Rows asking for k1/k2 look the key up and answer; the others answer at once, wrongly.
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>"
            if results
            else call_text("lookup", {"key": key_of(user)})
            if key_of(user) in ("k1", "k2")
            else "v??<|im_end|>"
        ),
    )
    environment = LookupEnvironment()
    assert isinstance(environment, EnvironmentAdapter) and adapt_environment(environment) is environment
    args = config(tmp_path, per_device_train_batch_size=8)  # all 4 keys, twice
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, environment=environment, rollout_engine=engine
    )
    assert environment.drivers == 1 and args.reward_weights == [1.0, 0.5]
    trainer.train()
    log = trainer.state.log_history[0]
    # 4 rows of which 2 found the value through the tool: each function logged unweighted, `reward` weighted.
    assert log["rewards/found/mean"] == 0.5 and log["rewards/called/mean"] == 0.5
    assert log["reward"] == pytest.approx(0.5 * 1.0 + 0.5 * 0.5)
    assert log["tools/call_frequency"] == 0.5


def test_environments_grpokit_cannot_train_on_are_refused_by_name(tmp_path):
    model, tokenizer = tiny_agent_model()
    with pytest.raises(TypeError, match=r"builtins.object, which grpokit cannot train on.*EnvironmentAdapter"):
        GRPOTrainer(model=model, args=config(tmp_path), processing_class=tokenizer, environment=object())
    with pytest.raises(ValueError, match="tools cannot be given beside it"):
        GRPOTrainer(
            model=model,
            args=config(tmp_path),
            processing_class=tokenizer,
            environment=LookupEnvironment(),
            tools=[lookup],
        )
