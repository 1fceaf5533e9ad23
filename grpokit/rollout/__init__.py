"""Sampling completions: the engine seam (`engine.py`), the in-process engine (`hf.py`, its token draws in
`sampling.py` and CPU fast paths in `fast.py`), a scripted engine for tests (`scripted.py`), and the prompt codec
every engine's inputs and outputs pass through (`prompts.py`)."""

from .engine import EVAL_SEED_OFFSET, PromptBatch, Rollout, RolloutEngine, SamplingParams, rollout_seed
from .hf import HFEngine, generate
from .prompts import PromptCodec, eos_token_ids, group_counts
from .scripted import ScriptedCompletion, ScriptedEngine

__all__ = [
    "EVAL_SEED_OFFSET",
    "HFEngine",
    "PromptBatch",
    "PromptCodec",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "ScriptedCompletion",
    "ScriptedEngine",
    "eos_token_ids",
    "generate",
    "group_counts",
    "rollout_seed",
]
