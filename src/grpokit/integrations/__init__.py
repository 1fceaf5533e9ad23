"""Environments of other libraries, trained on as they are: `GRPOTrainer(environment=env)`.

An adapter turns such an environment into what the trainer already runs: the prompt rows (its dataset), its reward
functions and their weights, and a `MultiTurnDriver` (grpokit.rollout.runner) that plays its turns on any
`RolloutEngine` — the policy's sampled tokens trained, everything the environment inserts attention-only.

`adapt_environment` recognises the environments of the libraries grpokit speaks; an object that already has the
`EnvironmentAdapter` shape is used as it is, so a user can plug in an environment of any library:
- `verifiers_classic`: verifiers < 0.4 (`vf.SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`), in this process;
- `verifiers_v1`: verifiers 0.4's `verifiers.v1` environments, whose harness calls the policy over HTTP;
- `openenv`: OpenEnv environments served over HTTP/WebSocket, one session per rollout;
- `openai_agent`: any agent written against the OpenAI SDK (`OpenAIAgentEnvironment`);
- `endpoint`: the policy served on 127.0.0.1 (OpenAI chat completions, vLLM-style generate) for the two above, with
  every call's tokens and log-probs recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..rollout.runner import MultiTurnDriver


@runtime_checkable
class EnvironmentAdapter(Protocol):
    """What the trainer needs from an environment of another library."""

    def train_dataset(self) -> Any:
        """The rows to train on (a `datasets.Dataset` with a `prompt` column), or None when the user passes one."""
        ...

    def reward_funcs(self) -> list[Callable]:
        """Reward functions with TRL's contract (`f(prompts, completions, **columns) -> list[float | None]`), named
        by `__name__` in the metrics (`rewards/<name>/mean`)."""
        ...

    def reward_weights(self) -> list[float] | None:
        """One weight per reward function, or None for all 1."""
        ...

    def driver(self, tokenizer, args, max_prompt_length: int | None) -> MultiTurnDriver:
        """The multi-turn driver that plays this environment's rollouts, built once per trainer."""
        ...


# Tried in order; each adapter function returns an adapter, or None when the environment is not of its library.
# Modules are imported only when the environment's type comes from their library.
_ADAPTERS: list[tuple[str, str, str]] = []  # (type module prefix, adapter module, adapter function)


def register_adapter(type_module_prefix: str, adapter_module: str, adapter_function: str) -> None:
    """Make `adapt_environment` hand environments whose type lives under `type_module_prefix` (e.g. "verifiers")
    to `adapter_module.adapter_function`."""
    _ADAPTERS.append((type_module_prefix, adapter_module, adapter_function))


# verifiers 0.4's v1 API first: its types live under "verifiers", which classic verifiers' adapter also claims.
register_adapter("verifiers.v1", ".verifiers_v1", "adapt")

# Classic verifiers environments: their classes live in `verifiers.legacy` (verifiers 0.3).
register_adapter("verifiers.legacy", ".verifiers_classic", "adapt")

# OpenEnv's clients (openenv.core.EnvClient) point at a server: trained on through grpokit.integrations.openenv.
register_adapter("openenv", ".openenv", "adapter")


def adapt_environment(environment, tools=None, rollout_func=None, environment_factory=None) -> EnvironmentAdapter:
    """The adapter for `environment`: one of a library grpokit speaks, or the environment itself when it already
    is an `EnvironmentAdapter`. The trainer's own multi-turn arguments are refused beside it."""
    import importlib

    given = [
        name
        for name, value in (
            ("tools", tools),
            ("rollout_func", rollout_func),
            ("environment_factory", environment_factory),
        )
        if value
    ]
    if given:
        raise ValueError(
            f"GRPOTrainer(environment=...) plays the environment's own turns; {', '.join(given)} cannot "
            "be given beside it. Give the tools to the environment, or drop environment=."
        )
    if isinstance(environment, EnvironmentAdapter):
        return environment
    modules = [cls.__module__ for cls in type(environment).__mro__]
    for prefix, module, function in _ADAPTERS:
        if any(m == prefix or m.startswith(prefix + ".") for m in modules):
            adapter = getattr(importlib.import_module(module, __package__), function)(environment)
            if adapter is not None:
                return adapter
    known = ", ".join(sorted({p for p, _, _ in _ADAPTERS})) or "none registered"
    raise TypeError(
        f"GRPOTrainer(environment=...) got a {type(environment).__module__}.{type(environment).__name__}, "
        f"which grpokit cannot train on. It takes environments of these libraries: {known}; or an object "
        "with the grpokit.integrations.EnvironmentAdapter methods (train_dataset, reward_funcs, "
        "reward_weights, driver). For TRL's environments, pass environment_factory=YourClass instead."
    )


def environment_inputs(adapter: EnvironmentAdapter, args, train_dataset, reward_funcs):
    """(train_dataset, reward_funcs) for the trainer: the environment's, unless the user passed their own; the
    environment's reward weights go into args.reward_weights when the user set none."""
    if train_dataset is None:
        train_dataset = adapter.train_dataset()
        if train_dataset is None:
            raise ValueError("The environment has no dataset: pass train_dataset=... to GRPOTrainer.")
    functions = list(adapter.reward_funcs())
    if reward_funcs is not None:  # the user's functions come first, then the environment's
        user = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        weights = adapter.reward_weights()
        if weights is not None and args.reward_weights is None:
            args.reward_weights = [1.0] * len(user) + list(weights)
        return train_dataset, user + functions
    weights = adapter.reward_weights()
    if weights is not None and args.reward_weights is None:
        args.reward_weights = list(weights)
    if not functions:
        raise ValueError("The environment gives no reward functions: pass reward_funcs=... to GRPOTrainer.")
    return train_dataset, functions


__all__ = ["EnvironmentAdapter", "adapt_environment", "environment_inputs", "register_adapter"]
