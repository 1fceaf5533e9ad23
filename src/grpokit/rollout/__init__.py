"""Sampling completions: the engine seam (`engine.py`), the in-process engine (`hf.py`, its token draws in
`sampling.py` and CPU fast paths in `fast.py`; transformers' own `generate` in `hf_generate.py`), a scripted engine
for tests (`scripted.py`), and the prompt codec every engine's inputs and outputs pass through (`prompts.py`), and
the runner that turns rows into a decoded rollout, single-turn or multi-turn (`runner.py`)."""

from .engine import (
    EVAL_SEED_OFFSET,
    PromptBatch,
    Rollout,
    RolloutEngine,
    SamplingParams,
    engine_logprobs_match_training,
    rollout_seed,
)
from .hf import HFEngine, generate
from .hf_generate import TransformersGenerateEngine
from .prompts import PromptCodec, eos_token_ids, group_counts
from .runner import DecodedRollout, MultiTurnDriver, RolloutRunner
from .scripted import ScriptedCompletion, ScriptedEngine

__all__ = [
    "EVAL_SEED_OFFSET",
    "DecodedRollout",
    "HFEngine",
    "MultiTurnDriver",
    "PromptBatch",
    "PromptCodec",
    "Rollout",
    "RolloutEngine",
    "RolloutRunner",
    "SamplingParams",
    "ScriptedCompletion",
    "ScriptedEngine",
    "TransformersGenerateEngine",
    "engine_logprobs_match_training",
    "eos_token_ids",
    "generate",
    "group_counts",
    "rollout_seed",
]
