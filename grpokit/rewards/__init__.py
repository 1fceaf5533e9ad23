"""Reward functions: the calling protocol, built-ins, and the sandboxed code-execution reward."""

from .base import RewardFunction, RewardFunctionError, compute_rewards
from .builtin import BUILTIN_REWARDS, accuracy_reward, length_reward, resolve_reward, think_format_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardFunctionError",
    "accuracy_reward",
    "code_execution_reward",
    "compute_rewards",
    "length_reward",
    "resolve_reward",
    "think_format_reward",
]


def __getattr__(name):
    # The sandbox module is imported on first use only.
    if name == "code_execution_reward":
        from .code import code_execution_reward

        return code_execution_reward
    raise AttributeError(name)
