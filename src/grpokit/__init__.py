"""grpokit: GRPO post-training for autoregressive token models.

from grpokit import GRPOConfig, GRPOTrainer     # drop-in for trl's classes of the same names
from grpokit import RLOOConfig, RLOOTrainer     # TRL's RLOO, on the same loop
from grpokit import DistillationConfig, DistillationTrainer
from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer  # trl.experimental.async_grpo's, on GRPOTrainer's producer
"""

import logging
from importlib import import_module
from typing import TYPE_CHECKING

from .version import __version__  # noqa: F401  (grpokit.__version__)


def _quiet_bitsandbytes_kernel_fetch(record: logging.LogRecord) -> bool:
    """bitsandbytes (through peft and transformers) tries, at import on CPUs with AVX-512 BF16, to fetch an optional
    4-bit matmul kernel from the Hugging Face Hub, and logs a warning on every command when that fails (offline, or
    without the `kernels` package); it then uses its own kernel, which is what grpokit's tests run. That one warning
    is dropped; everything else bitsandbytes says is kept."""
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_quiet_bitsandbytes_kernel_fetch)

if TYPE_CHECKING:  # for type checkers and the API reference; at run time __getattr__ below imports on first use
    from .advantages import group_advantages, process_advantages
    from .async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from .batch import TrainBatch
    from .config import GRPOConfig
    from .distill_trainer import DistillationTrainer
    from .distillation import chunked_distillation_loss
    from .distillation_config import DistillationConfig
    from .evaluation import pass_at_k
    from .logprobs import chunked_token_logprobs, selective_log_softmax, token_logprobs
    from .loss import distillation_loss, generalized_jsd, policy_loss
    from .optim import build_optimizer
    from .rloo import RLOOConfig, RLOOTrainer
    from .rollout import HFEngine, PromptBatch, Rollout, RolloutEngine, SamplingParams, ScriptedEngine
    from .trainer import GRPOTrainer

# Each public name and the module that defines it (the imports above), imported on first use (PEP 562): `import
# grpokit`, the command line's --help and --version, and reading GRPOConfig's fields do not import torch.
_HOMES = {
    "group_advantages": "advantages",
    "process_advantages": "advantages",
    "AsyncGRPOConfig": "async_grpo",
    "AsyncGRPOTrainer": "async_grpo",
    "TrainBatch": "batch",
    "GRPOConfig": "config",
    "DistillationTrainer": "distill_trainer",
    "chunked_distillation_loss": "distillation",
    "DistillationConfig": "distillation_config",
    "pass_at_k": "evaluation",
    "chunked_token_logprobs": "logprobs",
    "selective_log_softmax": "logprobs",
    "token_logprobs": "logprobs",
    "distillation_loss": "loss",
    "generalized_jsd": "loss",
    "policy_loss": "loss",
    "build_optimizer": "optim",
    "RLOOConfig": "rloo",
    "RLOOTrainer": "rloo",
    "HFEngine": "rollout",
    "PromptBatch": "rollout",
    "Rollout": "rollout",
    "RolloutEngine": "rollout",
    "SamplingParams": "rollout",
    "ScriptedEngine": "rollout",
    "GRPOTrainer": "trainer",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'grpokit' has no attribute {name!r}")
    value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "DistillationConfig",
    "DistillationTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "HFEngine",
    "PromptBatch",
    "RLOOConfig",
    "RLOOTrainer",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "ScriptedEngine",
    "TrainBatch",
    "build_optimizer",
    "chunked_distillation_loss",
    "chunked_token_logprobs",
    "distillation_loss",
    "generalized_jsd",
    "group_advantages",
    "pass_at_k",
    "policy_loss",
    "process_advantages",
    "selective_log_softmax",
    "token_logprobs",
]
