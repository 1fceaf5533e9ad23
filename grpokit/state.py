"""The trainer's progress that outlives a process: saved in every checkpoint as trainer_state.json."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_tokens: int = 0
    generations: int = 0  # generation batches produced so far (seeds each rollout)
    nonfinite_steps: int = 0  # updates skipped for a NaN/inf loss or gradient
    nonfinite_in_a_row: int = 0
    log_history: list[dict] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "TrainerState":
        return cls(**json.loads(path.read_text()))
