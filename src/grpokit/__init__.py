"""grpokit: GRPO post-training for autoregressive token models.

    from grpokit import GRPOConfig, GRPOTrainer     # drop-in for trl's classes of the same names
    from grpokit import RLOOConfig, RLOOTrainer     # TRL's RLOO, on the same loop
    from grpokit import DistillationConfig, DistillationTrainer
    from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer  # trl.experimental.async_grpo's, on GRPOTrainer's producer
"""

from .async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from .advantages import group_advantages, process_advantages
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
from .version import __version__  # noqa: F401  (grpokit.__version__)

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
