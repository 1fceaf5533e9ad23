"""Checkpoints: atomic directories (`atomic.py`), formats per backend (`formats.py`) and the `Checkpointer` that
saves and resumes a run (`checkpointer.py`)."""

from .atomic import is_complete, latest_checkpoint, list_checkpoints, rotate_checkpoints, write_checkpoint
from .checkpointer import Checkpointer, Resumed, TrainingParts

__all__ = [
    "Checkpointer",
    "Resumed",
    "TrainingParts",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "rotate_checkpoints",
    "write_checkpoint",
]
