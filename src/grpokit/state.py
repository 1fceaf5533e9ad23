"""The trainer's progress that outlives a process (trainer_state.json in every checkpoint), and the callbacks
that watch it.

`TrainerState` is transformers' own, with grpokit's counters added, so a `TrainerCallback` written for the HF
Trainer or TRL reads the fields it knows (global_step, max_steps, epoch, log_history, is_world_process_zero, ...).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from transformers import TrainerCallback, TrainerControl
from transformers import TrainerState as HFTrainerState


@dataclass
class TrainerState(HFTrainerState):
    num_tokens: int = 0  # prompt + completion tokens sampled so far (TRL's `num_tokens`)
    rollouts: int = 0  # rollouts drawn so far: the next one's index (its seed: rollout.rollout_seed)
    nonfinite_steps: int = 0  # updates skipped for a NaN/inf loss or gradient
    nonfinite_in_a_row: int = 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        values = json.loads(path.read_text())
        if "generations" in values:  # an older checkpoint's name for `rollouts`
            values["rollouts"] = values.pop("generations")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


class Callbacks:
    """The user's `TrainerCallback`s, called with transformers' arguments: (args, state, control, model=...,
    processing_class=..., optimizer=..., lr_scheduler=..., train_dataloader=None, eval_dataloader=None, **extra).
    A callback may return a `TrainerControl` or change the one it is given; the trainer acts on its flags."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None):
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks or []:
            self.add(callback)
        self.model, self.processing_class = model, processing_class
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.control = TrainerControl()

    def add(self, callback) -> None:
        callback = callback() if isinstance(callback, type) else callback
        if not isinstance(callback, TrainerCallback):
            raise TypeError(f"callbacks take transformers.TrainerCallback instances or classes, not {callback!r}.")
        self.callbacks.append(callback)

    def pop(self, callback):
        for existing in self.callbacks:
            if existing is callback or (isinstance(callback, type) and isinstance(existing, callback)):
                self.callbacks.remove(existing)
                return existing
        return None

    def __call__(self, event: str, args, state, **extra) -> TrainerControl:
        for callback in self.callbacks:
            result = getattr(callback, event)(
                args,
                state,
                self.control,
                model=self.model,
                processing_class=self.processing_class,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                train_dataloader=None,
                eval_dataloader=None,
                **extra,
            )
            if result is not None:
                self.control = result
        return self.control
