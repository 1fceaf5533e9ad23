"""Slow groups never hold the schedule (issue 59): the completions of one generation call their tools at once, a
streamed group that can no longer be trained within max_staleness is abandoned at once (its place goes to the next
group), and a hung engine or tool call is named within twice the heartbeat."""

import time

from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.state import TrainerCallback


def streaming_config(tmp_path, **overrides) -> GRPOConfig:
    """Batches of two groups of two, prompts in order, up to four groups in flight one version ahead."""
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=3,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
        shuffle_dataset=False,
        max_staleness=1,
        max_inflight_tasks=8,
        tool_timeout=60,
    )
    return GRPOConfig(**{**values, **overrides})


def answer_after_lookup(tokenizer):
    return tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )


def repeat_found(completions, key, **kwargs):
    return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]


class StepClock(TrainerCallback):
    """When each optimizer step ended (time.monotonic())."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.monotonic())


def test_slow_groups_never_hold_the_gaps_between_steps(tmp_path):
    """Every third prompt's tool call takes 2 s. Its group starts at some version and can be trained at most one
    version later; the fast groups fill two batches long before the call ends, so the slow group is abandoned then
    and the next group takes its place: after the first steps the trainer never waits for samples, and the gap
    between two optimizer steps is the step's own training time (each gap minus the time it waited) plus a margin,
    far below the slow call."""
    slow = {f"k{i}" for i in range(0, 100, 3)}

    def lookup(key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        if key in slow:
            time.sleep(2.0)
        return TABLE[key]

    rows = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(100)]
    model, tokenizer = tiny_agent_model()
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=streaming_config(tmp_path, max_steps=12),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=answer_after_lookup(tokenizer),
        callbacks=[clock],
    )
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 12 and steps[-1]["sample/dropped_stale_total"] > 0  # slow groups were dropped
    gaps = [later - earlier for earlier, later in zip(clock.ends, clock.ends[1:])]
    waits = [r["perf/rollout_wait_s"] for r in steps[1:]]
    training = [gap - wait for gap, wait in zip(gaps, waits)]
    print("gaps", [round(g, 2) for g in gaps], "waits", [round(w, 2) for w in waits])
    for step, (gap, own) in enumerate(zip(gaps[2:], training[2:]), start=4):
        assert gap <= own + 0.6, (step, gaps, training)
    assert max(gaps[2:]) < 1.5, gaps
