"""The tree is formatted by `ruff format` and clean under `ruff check`, with the rules chosen in pyproject.toml."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("the tests run outside a checkout: there is no tree to check")
    executable = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(executable).exists():
        pytest.skip("ruff is not installed (it is in the test extras: pip install '.[test]')")
    return subprocess.run([executable, *args], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_formatted():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, f"run `ruff format .` at the repository's root:\n{result.stdout}{result.stderr}"


def test_the_tree_passes_the_linter():
    result = ruff("check", ".")
    assert result.returncode == 0, f"fix what `ruff check .` reports:\n{result.stdout}{result.stderr}"
