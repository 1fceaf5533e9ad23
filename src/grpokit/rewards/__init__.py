"""Reward functions: the calling protocol, built-ins, and the sandboxed code-execution reward."""

from .base import RewardFunction, RewardFunctionError, compute_rewards, reward_name
from .builtin import BUILTIN_REWARDS, accuracy_reward, length_reward, resolve_reward, think_format_reward
from .model import RewardModel

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardFunctionError",
    "accuracy_reward",
    "build_reward_functions",
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


def build_reward_functions(
    reward_funcs,
    processing_classes=None,
    batch_size: int = 8,
    trust_remote_code: bool = False,
    environment_rewards=(),
    required: bool = True,
) -> list[RewardFunction]:
    """The trainer's reward functions: callables keep TRL's contract; a path / hub id or a PreTrainedModel is a
    reward model (with its processing class from `processing_classes`, one per function, None for callables).
    `environment_rewards` (the get_reward of environments, grpokit.agents) come after them. `required`: refuse a run
    with none (False for an objective that scores no completions: on-policy distillation)."""
    from transformers import PreTrainedModel

    funcs = (
        []
        if reward_funcs is None
        else list(reward_funcs)
        if isinstance(reward_funcs, (list, tuple))
        else [reward_funcs]
    )
    if not funcs and not environment_rewards and required:
        raise ValueError(
            "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
            "environment defines a `get_reward` method. `reward_funcs` is a function, a reward model "
            "(a path, hub id or model) or a list of them."
        )
    if processing_classes is None:
        classes = [None] * len(funcs)
    else:
        classes = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes]
        if len(classes) != len(funcs):
            raise ValueError(
                f"The number of reward processing classes ({len(classes)}) must match the number of "
                f"reward functions ({len(funcs)}): give one per function (None for plain "
                f"functions)."
            )
    out = []
    for f, tokenizer in zip(funcs, classes):
        if isinstance(f, (str, PreTrainedModel)):
            f = RewardModel(f, tokenizer, batch_size=batch_size, trust_remote_code=trust_remote_code)
        elif not callable(f):
            raise TypeError(f"Reward {f!r} is neither a function, a reward model nor a path to one.")
        out.append(RewardFunction(reward_name(f), f))
    out += [RewardFunction(reward_name(f), f) for f in environment_rewards]
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"Reward functions need distinct names (their metrics are keyed by name): {names}.")
    return out
