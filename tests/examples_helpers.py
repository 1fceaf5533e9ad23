"""Running a shipped example as a user does: `python examples/<name>.py --tiny` (here with `--max_steps 1` unless
told otherwise)."""

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def tiny_output(example: str, tmp_path: Path) -> Path:
    """Where `run_tiny_example(example, tmp_path)` had the example write (grpokit.testing.tiny_output_dir under the
    TMPDIR it set)."""
    return tmp_path / "tmp" / "grpokit-examples" / example


def run_tiny_example(example: str, tmp_path: Path, max_steps: int | None = 1) -> subprocess.CompletedProcess:
    """Run it offline from an empty folder with TMPDIR inside tmp_path (`--max_steps max_steps`; None: the
    example's own number of steps); check that it succeeds, writes its output (grpo_config.json) under TMPDIR and
    nothing into the current folder (no Hub-named folders). Its process."""
    cwd, temporary = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(), temporary.mkdir()
    # One thread, as the distributed tests' processes: on a CPU shared with other jobs, two threads wait on each
    # other for most of a step (an example's printed numbers are the same either way).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temporary), "OMP_NUM_THREADS": "1"}
    steps = [] if max_steps is None else ["--max_steps", str(max_steps)]
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{example}.py"), "--tiny", *steps],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(cwd.iterdir()) == []
    assert (tiny_output(example, tmp_path) / "grpo_config.json").is_file()
    return result


def read_metrics(output_dir: Path) -> list[dict]:
    """metrics.jsonl's records: one per logged step, then the end-of-training summary where it has metrics."""
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
