"""Multi-turn agents with TRL 1.16's API: `GRPOTrainer(tools=[...])`, `environment_factory=...` and
`rollout_func=...`, on any rollout engine (`loop.py`); tools and their time limits (`tools.py`); environments and
their pool (`environments.py`); the chat template's part: tool schemas, tool-call parsing, tool results as tokens
(`chat.py`)."""

from __future__ import annotations

from ..multimodal import tokenizer_of
from ..rollout.prompts import eos_token_ids
from .chat import check_chat_template, check_tool_calling, parse_completion, response_template, tool_result_ids
from .environments import EnvironmentPool, placeholder_dataset, public_methods
from .loop import Agents, with_observation
from .python_tool import python_tool
from .tools import ToolRunner, ToolStats, check_tools

__all__ = [
    "Agents",
    "EnvironmentPool",
    "ToolRunner",
    "ToolStats",
    "build_agents",
    "check_agents",
    "check_chat_template",
    "check_tool_calling",
    "check_tools",
    "parse_completion",
    "placeholder_dataset",
    "public_methods",
    "python_tool",
    "response_template",
    "tool_result_ids",
    "with_observation",
]


def check_agents(tools, rollout_func, environment_factory, rollout_engine) -> None:
    """The trainer's agent arguments, checked before the model is loaded."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}: GRPOTrainer(tools=[f, g]).")
    if tools:
        check_tools(list(tools))
    if rollout_func is not None and not callable(rollout_func):
        raise TypeError(
            f"rollout_func must be a callable rollout_func(prompts, trainer) -> dict, got {rollout_func!r}."
        )
    if rollout_func is not None and (tools or environment_factory is not None):
        raise NotImplementedError(
            "rollout_func with tools or environment_factory: grpokit runs either its own "
            "multi-turn loop (tools / environments) or your rollout_func, not both; do the tool "
            "calls inside rollout_func (its env_mask marks the inserted tokens)."
        )


def build_agents(tokenizer, model, args, max_prompt_length, tools, environments, rollout_func) -> Agents | None:
    """The trainer's multi-turn rollouts, or None for single-turn training."""
    if not tools and environments is None and rollout_func is None:
        return None
    config = getattr(model, "config", None)
    return Agents(
        tokenizer,
        tools=list(tools or []),
        environments=environments,
        rollout_func=rollout_func,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        max_completion_length=args.max_completion_length,
        max_prompt_length=max_prompt_length,
        chat_template_kwargs=args.chat_template_kwargs,
        tool_timeout=args.tool_timeout,
        max_tool_output_chars=args.max_tool_output_chars,
        max_model_length=getattr(config, "max_position_embeddings", None),
        stop_ids=eos_token_ids(tokenizer_of(tokenizer), model),
    )
