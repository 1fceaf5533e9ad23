"""Calling reward functions with TRL's contract, and checking what they return.

A reward function is called with keyword arguments `prompts`, `completions`, `completion_ids` and every dataset
column (one value per completion) and returns one `float | None` per completion; None means "does not apply".
Async functions run concurrently with each other and with the synchronous ones.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import torch

from .context import CONTEXT_ARGUMENTS

STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids", *CONTEXT_ARGUMENTS)


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the function and the row."""


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    is_async: bool = field(init=False)
    is_process: bool = field(init=False)  # returns one list of step rewards per completion

    def __post_init__(self):
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 (a callable object's `async def __call__`)
        )
        self.is_process = bool(getattr(self.fn, "is_process_reward", False))

    def required_columns(self) -> list[str]:
        """Keyword parameters the function needs that are not standard arguments (dataset columns)."""
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return []
        return [
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and p.name not in STANDARD_ARGUMENTS
        ]


def reward_name(fn) -> str:
    if hasattr(fn, "config") and hasattr(fn.config, "_name_or_path"):  # a reward model
        return str(fn.config._name_or_path).rstrip("/").split("/")[-1] or type(fn).__name__
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_required_columns(functions: list[RewardFunction], columns: list[str]) -> None:
    available = set(columns) | set(STANDARD_ARGUMENTS)
    for function in functions:
        missing = [c for c in function.required_columns() if c not in available]
        if missing:
            raise ValueError(
                f"Reward function {function.name!r} needs column(s) {missing} that the dataset lacks (columns: "
                f"{sorted(columns)}). Add the column(s) to the dataset or give the parameter a default value."
            )


def _excerpt(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_values(name: str, values: Any, expected: int) -> list[float]:
    """Turn a reward function's output into floats (NaN for None), or raise naming the function."""
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"Reward function {name!r} returned {type(values).__name__}; it must return a list with one float (or "
            f"None) per completion."
        )
    if len(values) != expected:
        raise RewardFunctionError(
            f"Reward function {name!r} returned {len(values)} values for {expected} completions; it must return "
            f"exactly one float (or None) per completion."
        )
    out = []
    for row, value in enumerate(values):
        if value is None:
            out.append(float("nan"))
            continue
        if hasattr(value, "item") and not isinstance(value, (list, tuple)):  # numpy / torch scalars
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, Real):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value!r} ({type(value).__name__}) for row {row}; rewards must "
                f"be numbers, or None for 'does not apply'."
            )
        if not math.isfinite(float(value)):
            raise RewardFunctionError(
                f"Reward function {name!r} returned {value} for row {row}; rewards must be finite (return None "
                f"for a completion the function cannot score)."
            )
        out.append(float(value))
    return out


def _call(function: RewardFunction, kwargs: dict) -> Any:
    result = function.fn(**kwargs)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable


def _row_kwargs(kwargs: dict, row: int) -> dict:
    """One row's arguments; `environments` (one per row) is cut like a column, the other context is shared."""
    shared = [name for name in CONTEXT_ARGUMENTS if name != "environments"]
    return {key: value if key in shared else value[row : row + 1] for key, value in kwargs.items()}


def _locate_failure(function: RewardFunction, kwargs: dict, error: Exception, n: int) -> RewardFunctionError:
    """Find the first row on which the function raises, to name it in the error."""
    for row in range(n):
        try:
            _call(function, _row_kwargs(kwargs, row))
        except Exception:
            prompt = kwargs["prompts"][row]
            if isinstance(error, ImportError):  # a missing package fails every row: scoring them None would train on
                return RewardFunctionError(  # nothing, so reward_fn_errors='none' is no way out
                    f"Reward function {function.name!r} raised {type(error).__name__}: {error}. Install the missing "
                    "package and run again."
                )
            return RewardFunctionError(
                f"Reward function {function.name!r} raised {type(error).__name__}: {error} — on row {row} (prompt: "
                f"{_excerpt(prompt)!r}). Fix the function, or set reward_fn_errors='none' to score such rows None."
            )
    return RewardFunctionError(f"Reward function {function.name!r} raised {type(error).__name__}: {error}")


def _score_rows_separately(function: RewardFunction, kwargs: dict, n: int) -> tuple[list[float], int]:
    """With reward_fn_errors='none': score row by row, failures become None; returns (values, failures)."""
    values, failures = [], 0
    for row in range(n):
        try:
            values.extend(_check_values(function.name, _call(function, _row_kwargs(kwargs, row)), 1))
        except Exception:
            values.append(float("nan"))
            failures += 1
    return values, failures


def _check_steps(name: str, values: Any, step_counts: list[int]) -> tuple[list[float], list[list[float]]]:
    """A process function's output: per completion a list of step rewards (or None). Returns (means, steps)."""
    if not isinstance(values, (list, tuple)) or len(values) != len(step_counts):
        raise RewardFunctionError(
            f"Process reward function {name!r} must return one list of step rewards per completion "
            f"({len(step_counts)} completions)."
        )
    means, steps = [], []
    for row, (item, count) in enumerate(zip(values, step_counts)):
        if item is None:
            means.append(float("nan"))
            steps.append([])
            continue
        rewards = _check_values(name, list(item), len(item))
        if len(rewards) != count or any(math.isnan(r) for r in rewards):
            raise RewardFunctionError(
                f"Process reward function {name!r} returned {len(rewards)} step rewards for row {row}, whose "
                f"completion has {count} step(s) (steps end at each step_separator); return one float per step."
            )
        means.append(sum(rewards) / len(rewards) if rewards else float("nan"))
        steps.append(rewards)
    return means, steps


def compute_rewards(
    functions: list[RewardFunction],
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]],
    on_error: str = "raise",
    routes: list[set[str]] | None = None,
    step_counts: list[int] | None = None,
    context: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, int], dict[int, list[list[float]]]]:
    """Score every completion with every function.

    routes: per row, the names of the functions that apply to it (None = all); a function is called only on its
    rows and the others get None. step_counts: per row, the number of steps (for process functions).
    Returns (scores [N, F] with NaN for None — a process function's column holds its mean step reward —,
    failed rows per function name, {function index: step rewards per row} for process functions).
    """
    n = len(completions)
    base_kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    rows_of = [list(range(n)) if routes is None else [i for i in range(n) if f.name in routes[i]] for f in functions]
    kwargs_of = [
        {
            **(base_kwargs if len(rows) == n else {k: [v[i] for i in rows] for k, v in base_kwargs.items()}),
            **(context or {}),
        }
        for rows in rows_of
    ]  # context (trainer_state, log_metric, ...): not per row
    results, errors = _call_functions(functions, kwargs_of, rows_of)
    scores = torch.full((n, len(functions)), float("nan"), dtype=torch.float32)
    failures: dict[str, int] = {}
    step_rewards: dict[int, list[list[float]]] = {}
    for index, function in enumerate(functions):
        rows, kwargs = rows_of[index], kwargs_of[index]
        if not rows:
            if function.is_process:
                step_rewards[index] = [[] for _ in range(n)]
            continue
        if function.is_process:
            if index in errors:
                raise _locate_failure(function, kwargs, errors[index], len(rows)) from errors[index]
            counts = [step_counts[i] for i in rows] if step_counts is not None else [0] * len(rows)
            means, steps = _check_steps(function.name, results[index], counts)
            all_steps: list[list[float]] = [[] for _ in range(n)]
            for row, mean, row_steps in zip(rows, means, steps):
                scores[row, index], all_steps[row] = mean, row_steps
            step_rewards[index] = all_steps
            continue
        if index in errors:
            if on_error != "none":
                raise _locate_failure(function, kwargs, errors[index], len(rows)) from errors[index]
            values, failures[function.name] = _score_rows_separately(function, kwargs, len(rows))
        else:
            values = _check_values(function.name, results[index], len(rows))
        scores[rows, index] = torch.tensor(values, dtype=torch.float32)
    return scores, failures, step_rewards


def _call_functions(
    functions: list[RewardFunction], kwargs_of: list[dict], rows_of: list[list[int]]
) -> tuple[dict[int, Any], dict[int, Exception]]:
    """Each function called once on its rows (none without rows): ({function index: what it returned},
    {function index: what it raised}). The async ones run together, the synchronous ones one after another."""
    results: dict[int, Any] = {}
    errors: dict[int, Exception] = {}

    async def run_async():
        async def one(index, function):
            try:
                results[index] = await function.fn(**kwargs_of[index])
            except Exception as error:  # handled by the caller, with the synchronous ones
                errors[index] = error

        await asyncio.gather(*(one(i, f) for i, f in enumerate(functions) if f.is_async and rows_of[i]))

    # Async functions run in their own event loop on a thread (this also works when the caller is inside a
    # running loop, e.g. Jupyter), while the synchronous ones run here.
    thread = None
    if any(f.is_async and rows_of[i] for i, f in enumerate(functions)):
        thread = threading.Thread(target=lambda: asyncio.run(run_async()), daemon=True)
        thread.start()
    for index, function in enumerate(functions):
        if not function.is_async and rows_of[index]:
            try:
                results[index] = function.fn(**kwargs_of[index])
            except Exception as error:
                errors[index] = error
    if thread is not None:
        thread.join()
    return results, errors


def routes_from_column(values: list[Any], names: list[str], column: str) -> list[set[str]]:
    """Per-row reward routing: each value lists the reward functions (by name) that apply to that row."""
    known = set(names)
    routes = []
    for row, value in enumerate(values):
        chosen = {value} if isinstance(value, str) else set(value or [])
        unknown = chosen - known
        if unknown:
            raise ValueError(
                f"Row {row} of column {column!r} names reward function(s) {sorted(unknown)} that are not among "
                f"the trainer's reward functions {names}."
            )
        routes.append(chosen)
    return routes


def combine_rewards(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over functions [N, F] -> [N], skipping None (NaN); NaN only where every function is None."""
    weighted = (scores * weights[None]).nansum(-1)
    return torch.where(scores.isnan().all(-1), torch.full_like(weighted, float("nan")), weighted)
