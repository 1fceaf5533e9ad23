"""The README stays true: the quick start has two commands, every config field is documented."""

import dataclasses
import re
from pathlib import Path

from grpokit import GRPOConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_quick_start_has_exactly_two_commands():
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    assert "grpokit train" in commands[0] and "pytest" in commands[1]


def test_every_config_field_is_in_the_reference():
    documented = set(re.findall(r"^\| `(\w+)` \|", README, re.M))
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert fields - documented == set(), "run scripts/config_reference.py and paste the table into README.md"
