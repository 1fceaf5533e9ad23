"""Tools: plain Python callables (sync or async) that the model calls during a rollout.

A tool needs type hints and a Google-style docstring (transformers' `get_json_schema` turns them into the JSON schema
the chat template shows the model); that is checked when the trainer is built. A call runs with a time limit
(`tool_timeout` seconds); a tool that raises, times out, is unknown or gets arguments it does not take returns
`{'error': ...}` to the model as its result (TRL 1.16's form) and is counted as a failure: it never stops training.
A timed-out synchronous call cannot be interrupted from Python: its thread is abandoned and finishes on its own, so
a tool that can hang should enforce its own limit (the built-in `python` tool runs in a killed subprocess).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable


def tool_name(tool: Callable) -> str:
    return getattr(tool, "__name__", type(tool).__name__)


def check_tools(tools: list[Callable], where: str = "tools") -> None:
    """Every tool must be callable and have a JSON schema (type hints and a docstring with an Args section)."""
    from transformers.utils import get_json_schema

    names = Counter()
    for tool in tools:
        if not callable(tool):
            raise TypeError(f"{where}: {tool!r} is not callable; a tool is a Python function (sync or async).")
        try:
            get_json_schema(tool)
        except Exception as error:
            raise ValueError(f"{where}: tool {tool_name(tool)!r} has no usable JSON schema ({error}). A tool needs "
                             f"type hints on every argument and a Google-style docstring with a description and an "
                             f"'Args:' section (see transformers' chat_extras#passing-tools).") from error
        names[tool_name(tool)] += 1
    doubles = [name for name, count in names.items() if count > 1]
    if doubles:
        raise ValueError(f"{where}: several tools are named {doubles}; the model calls tools by name, so names must be "
                         f"unique.")  # fmt: skip


@dataclass
class ToolStats:
    """Calls and failures per tool name, since the last flush."""

    calls: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    rows: int = 0  # completions sampled (the denominator of call_frequency, as in TRL)

    def metrics(self, accelerator, names: list[str]) -> dict[str, float]:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failures per call),
        over all processes, and the same per tool (`tools/<name>/...`, grpokit's addition). A collective."""
        import torch

        values = [float(self.rows)] + [float(x) for n in names for x in (self.calls[n], self.failures[n])]
        values += [float(sum(self.calls.values())), float(sum(self.failures.values()))]
        totals = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, "sum")
        totals = totals.tolist()
        rows, (calls, failures) = max(totals[0], 1.0), totals[-2:]
        out = {"tools/call_frequency": calls / rows, "tools/failure_frequency": failures / calls if calls else 0.0}
        for i, name in enumerate(names):
            n_calls, n_failures = totals[1 + 2 * i], totals[2 + 2 * i]
            out[f"tools/{name}/call_frequency"] = n_calls / rows
            out[f"tools/{name}/failure_frequency"] = n_failures / n_calls if n_calls else 0.0
        self.calls.clear(), self.failures.clear()
        self.rows = 0
        return out


class ToolRunner:
    """Runs the tool calls of one turn, each under a time limit; async tools on one event loop of their own."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="grpokit-tool")
        self._loop: asyncio.AbstractEventLoop | None = None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="grpokit-tool-loop", daemon=True).start()
        return self._loop

    def submit(self, tool: Callable, arguments: dict) -> concurrent.futures.Future:
        if inspect.iscoroutinefunction(tool):
            return asyncio.run_coroutine_threadsafe(tool(**arguments), self._event_loop())
        return self._pool.submit(tool, **arguments)

    def run(self, calls: list[tuple[str, Any]], tools: dict[str, Callable], stats: ToolStats) -> list[dict]:
        """calls: (name, arguments) per tool call, in order; returns one tool message per call. All calls of the
        turn run concurrently."""
        pending = []
        for name, arguments in calls:
            stats.calls[name] += 1
            problem = None
            if name not in tools:
                problem = f"Tool {name!r} not found; available tools: {sorted(tools)}."
            elif not isinstance(arguments, dict):
                problem = f"Arguments of {name!r} must be a JSON object, got {arguments!r}."
            else:
                try:
                    inspect.signature(tools[name]).bind(**arguments)
                except TypeError as error:
                    problem = f"Bad arguments for {name!r}: {error}."
                except ValueError:  # no signature to check (a builtin): the call itself will tell
                    pass
            pending.append((name, problem, None if problem else self.submit(tools[name], arguments)))
        messages = []
        for name, problem, future in pending:
            if future is not None:
                try:
                    result = future.result(timeout=self.timeout)
                except concurrent.futures.TimeoutError:
                    future.cancel()
                    problem = f"Tool {name!r} timed out after {self.timeout:g} s."
                except Exception as error:  # the model sees what went wrong, training goes on
                    problem = str(error) or type(error).__name__
            if problem is not None:
                stats.failures[name] += 1
                result = {"error": problem}
            messages.append({"role": "tool", "name": name, "content": str(result)})
        return messages
