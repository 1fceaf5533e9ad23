"""The shipped examples' `--tiny` runs, as a user runs them (a subprocess started in an empty folder): each one
exercises the feature it shows (the tool, the environment, the agent endpoint, images), and the trend its last line
prints is what its metrics.jsonl holds: the mean reward over the first and over the last fifth of the run, every
step logged (one step's reward, or a record averaging ten steps set beside one of a single step, says nothing).
Every run also checks (`run_tiny_example`) that the example writes its output under the temporary directory and
nothing into the folder it was started in."""

import json
import re

import pytest
from examples_helpers import read_metrics, run_tiny_example, tiny_output

TREND = re.compile(r"mean reward ([\d.]+) over steps? (\d+)(?:-(\d+))? -> ([\d.]+) over steps? (\d+)(?:-(\d+))?")


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def step_records(records: list[dict]) -> list[dict]:
    """The records of the training steps (not the end-of-training summary)."""
    return [r for r in records if "train_runtime" not in r]


def check_honest_trend(out: str, records: list[dict], steps: int) -> None:
    """The printed trend: every one of the run's `steps` logged, and the two means those of the rewards of steps
    1 to steps/5 and of the last steps/5 steps."""
    rewards = {r["step"]: r["reward"] for r in step_records(records)}
    assert sorted(rewards) == list(range(1, steps + 1))
    (match,) = TREND.findall(out)
    first, start, end, last, last_start, last_end = match
    fifth = max(1, steps // 5)
    assert (int(start), int(end or start)) == (1, fifth), out
    assert (int(last_start), int(last_end or last_start)) == (steps - fifth + 1, steps), out
    assert first == f"{mean(rewards[s] for s in range(1, fifth + 1)):.3f}", out
    assert last == f"{mean(rewards[s] for s in range(steps - fifth + 1, steps + 1)):.3f}", out


# example: (the metric its summary averages, the words after that number, the feature's own metrics)
SCRIPTED = {
    "tools_grpo": ("tools/call_frequency", "tool calls per completion", ["tools/multiply/call_frequency"]),
    "environment_grpo": ("tools/call_frequency", "increment calls per completion", ["tools/increment/call_frequency"]),
    "agent_endpoint_grpo": ("endpoint/calls_per_rollout", "endpoint calls per rollout", ["rewards/agent_reward/mean"]),
}


@pytest.mark.parametrize("example", sorted(SCRIPTED))
def test_a_tiny_agent_example_runs_its_tool_path_and_says_so(example, tmp_path):
    """tools_grpo, environment_grpo and agent_endpoint_grpo with --tiny (10 steps): the scripted policy calls the
    tool, the tool's results reach the rewards, and the summary's numbers are the run's."""
    key, words, own = SCRIPTED[example]
    out = run_tiny_example(example, tmp_path, max_steps=None).stdout
    output_dir = tiny_output(example, tmp_path)
    records = step_records(read_metrics(output_dir))
    check_honest_trend(out, records, steps=10)
    calls = mean(r[key] for r in records)
    assert f"; {calls:.2f} {words}; output in {output_dir}" in out, out
    assert "(a scripted policy: it does not learn)" in out
    assert all(r[name] is not None for r in records for name in own)
    assert max(r["reward"] for r in records) > 0  # the tool's results made right answers
    if key == "endpoint/calls_per_rollout":  # a second call: the agent sent a tool result back
        assert calls > 1.0
        assert all(r["endpoint/error_frequency"] == r["endpoint/timeout_frequency"] == 0.0 for r in records)
    else:
        assert calls > 0.2 and mean(r[own[0]] for r in records) == pytest.approx(calls)
        assert all(r["tools/failure_frequency"] == 0.0 for r in records)


def test_train_grpo_tiny_logs_every_step_and_prints_the_fifths_trend(tmp_path):
    out = run_tiny_example("train_grpo", tmp_path, max_steps=20).stdout
    output_dir = tiny_output("train_grpo", tmp_path)
    check_honest_trend(out, read_metrics(output_dir), steps=20)
    assert f"; model saved to {output_dir}" in out and (output_dir / "model.safetensors").is_file()


def test_ar_image_tiny_writes_into_the_temporary_folder_and_prints_the_fifths_trend(tmp_path):
    out = run_tiny_example("ar_image_grpo", tmp_path, max_steps=5).stdout
    output_dir = tiny_output("ar_image_grpo", tmp_path)
    check_honest_trend(out, read_metrics(output_dir), steps=5)
    assert f"; output in {output_dir}" in out


def test_grpo_vlm_tiny_says_where_it_saved_and_shows_its_questions(tmp_path):
    out = run_tiny_example("grpo_vlm", tmp_path, max_steps=5).stdout
    output_dir = tiny_output("grpo_vlm", tmp_path)
    assert f"Model saved to {output_dir}" in out and (output_dir / "model.safetensors").is_file()
    logged = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 4 + [5] * 4  # logging_steps 5: steps 1 and 5, 4 completions each
    assert all(r["prompt"][0]["content"][-1] == {"type": "text", "text": "what colour is the image?"} for r in logged)
    shown = [line for line in out.splitlines() if line.startswith("  '[image] what colour is the image?' -> ")]
    assert len(shown) == 4, out
    for line, record in zip(shown, logged[4:]):
        assert line.endswith(f" -> {record['completion'][0]['content']!r}  reward {record['reward']}")
