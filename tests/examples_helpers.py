"""Running a shipped example as a user does: `python examples/<name>.py --tiny --max_steps 1`."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_tiny_example(example: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run it offline from an empty folder with TMPDIR inside tmp_path; check that it succeeds, writes its output
    (grpo_config.json) under TMPDIR and nothing into the current folder (no Hub-named folders). Its process."""
    cwd, temporary = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(), temporary.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(temporary)}
    result = subprocess.run([sys.executable, str(EXAMPLES / f"{example}.py"), "--tiny", "--max_steps", "1"],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert list(cwd.iterdir()) == []
    assert (temporary / "grpokit-examples" / example / "grpo_config.json").is_file()
    return result
