"""Tools: plain Python callables (sync or async) that the model calls during a rollout.

A tool needs type hints and a Google-style docstring (transformers' `get_json_schema` turns them into the JSON schema
the chat template shows the model); that is checked when the trainer is built. A call runs with a time limit
(`tool_timeout` seconds); a tool that raises, times out, is unknown, gets arguments it does not take or returns a
result that cannot be turned into text returns `{'error': ...}` to the model as its result (TRL 1.16's form) and is
counted as a failure: it never stops training. A result longer than `max_tool_output_chars` characters is cut there
(before it is tokenized) and counted (`tools/truncated_frequency`).

The calls of one generation's turn, all rows together, run at once (`ToolRunner.run_turns`): a turn takes its
slowest call's time, not the sum of the rows' calls, and each row's results come back in its own order.

Calls are isolated, so that a hung call costs its own row and nothing else (issue 39):
- a synchronous call runs in a daemon thread of its own. Python cannot interrupt a thread: a call that times out is
  abandoned and finishes on its own, but it holds no worker another call waits for, and it does not keep the
  process from exiting. A tool that can hang should still enforce its own limit (the built-in `python` tool runs in
  a killed subprocess); a warning says when abandoned calls pile up.
- async tools share one event loop (in a daemon thread). A blocking call inside `async def` (time.sleep, a blocking
  HTTP client) stalls that loop and every async call on it: when a call times out and the loop does not answer, the
  tool running on it is named in a warning, the loop is abandoned for a new one, and that tool runs from then on
  on a loop of its own per call, off the shared one.
- an environment's tool that times out leaves its instance to the abandoned call: the agents loop retires the
  instance (`EnvironmentPool.retire`) so that it is never reset for another rollout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..rollout.batching import Abandoned


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
            raise ValueError(
                f"{where}: tool {tool_name(tool)!r} has no usable JSON schema ({error}). A tool needs "
                f"type hints on every argument and a Google-style docstring with a description and an "
                f"'Args:' section (see transformers' chat_extras#passing-tools)."
            ) from error
        names[tool_name(tool)] += 1
    doubles = [name for name, count in names.items() if count > 1]
    if doubles:
        raise ValueError(
            f"{where}: several tools are named {doubles}; the model calls tools by name, so names must be unique."
        )


@dataclass
class ToolStats:
    """Calls and failures per tool name, since the last flush."""

    calls: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    truncated: Counter = field(default_factory=Counter)  # results cut at max_tool_output_chars
    rows: int = 0  # completions sampled (the denominator of call_frequency, as in TRL)

    def add(self, other: ToolStats) -> None:
        """Count `other`'s calls too (a rollout's own counters, joined when it ends)."""
        self.calls.update(other.calls), self.failures.update(other.failures), self.truncated.update(other.truncated)
        self.rows += other.rows

    def metrics(self, accelerator, names: list[str]) -> dict[str, float]:
        """TRL's `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failures per call),
        over all processes, and the same per tool (`tools/<name>/...`, grpokit's addition); grpokit's
        `tools/truncated_frequency`: results cut at max_tool_output_chars, per call. A collective."""
        values = [float(self.rows)] + [float(x) for n in names for x in (self.calls[n], self.failures[n])]
        values += [float(sum(self.truncated.values()))]
        values += [float(sum(self.calls.values())), float(sum(self.failures.values()))]
        totals = summed_over_processes(accelerator, values)
        if not any(totals):  # no rollout ended since the last record (streamed groups end between batches)
            return {}
        rows, (calls, failures) = max(totals[0], 1.0), totals[-2:]
        out = {
            "tools/call_frequency": calls / rows,
            "tools/failure_frequency": failures / calls if calls else 0.0,
            "tools/truncated_frequency": totals[-3] / calls if calls else 0.0,
        }
        for i, name in enumerate(names):
            n_calls, n_failures = totals[1 + 2 * i], totals[2 + 2 * i]
            out[f"tools/{name}/call_frequency"] = n_calls / rows
            out[f"tools/{name}/failure_frequency"] = n_failures / n_calls if n_calls else 0.0
        self.calls.clear(), self.failures.clear(), self.truncated.clear()
        self.rows = 0
        return out


def summed_over_processes(accelerator, values: list[float]) -> list[float]:
    """Counters summed over all processes (a collective), in float64."""
    import torch

    totals = torch.tensor(values, dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, "sum")
    return totals.tolist()


TRUNCATION_NOTE = "\n[... {dropped} more characters cut: max_tool_output_chars={limit}]"
ABANDONED_WARNING_AT = 64  # timed-out calls still running: a tool that hangs every time leaks a thread per call


def in_daemon_thread(function: Callable, arguments: dict, name: str) -> concurrent.futures.Future:
    """function(**arguments) in a new daemon thread; its future. Daemon: an abandoned call never holds up exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(**arguments))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=work, name=f"grpokit-tool-{name}", daemon=True).start()
    return future


def as_text(result: Any, max_chars: int | None) -> tuple[str, bool]:
    """A tool's result as the message content the chat template renders, cut at max_chars characters (a 5 MB
    result would otherwise be tokenized whole before the completion budget drops it); whether it was cut."""
    text = result if isinstance(result, str) else str(result)
    if max_chars is None or len(text) <= max_chars:
        return text, False
    return text[:max_chars] + TRUNCATION_NOTE.format(dropped=len(text) - max_chars, limit=max_chars), True


def call_problem(name: str, arguments: Any, tools: dict[str, Callable]) -> str | None:
    """Why a tool call cannot be made (unknown tool, arguments it does not take), or None."""
    if name not in tools:
        return f"Tool {name!r} not found; available tools: {sorted(tools)}."
    if not isinstance(arguments, dict):
        return f"Arguments of {name!r} must be a JSON object, got {arguments!r}."
    try:
        inspect.signature(tools[name]).bind(**arguments)
    except TypeError as error:
        return f"Bad arguments for {name!r}: {error}."
    except ValueError:  # no signature to check (a builtin): the call itself will tell
        pass
    return None


class ToolRunner:
    """Runs the tool calls of one turn, each under a time limit: sync tools each in a daemon thread of their own,
    async tools on a shared event loop (or, once one has blocked it, that tool on a loop of its own per call)."""

    def __init__(self, timeout: float, max_output_chars: int | None = None):
        self.timeout, self.max_output_chars = timeout, max_output_chars
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running_on_loop: dict = {}  # coroutine -> tool name, to name the one that blocks the loop
        self._off_loop: set[str] = set()  # async tools that blocked the shared loop
        self._abandoned: list[concurrent.futures.Future] = []
        self._warned_abandoned = False
        self._loop_lock = threading.Lock()
        self._running: dict[concurrent.futures.Future, tuple[str, float]] = {}  # calls not done: name, start
        self._running_lock = threading.Lock()

    def calls_in_progress(self) -> list[tuple[str, float]]:
        """The calls running now that a rollout still waits for: (tool name, seconds since it started), oldest
        first (the producer names them when it finds no progress)."""
        now = time.monotonic()
        with self._running_lock:
            running = sorted(self._running.values(), key=lambda call: call[1])
        return [(name, now - started) for name, started in running]

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:  # rollouts running at once (concurrent_rollouts) share one loop
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="grpokit-tool-loop", daemon=True).start()
            return self._loop

    def submit(self, name: str, tool: Callable, arguments: dict) -> tuple[concurrent.futures.Future, bool]:
        """The call's future, and whether it runs on the shared event loop."""
        future, on_loop = self._start(name, tool, arguments)
        with self._running_lock:
            self._running[future] = (name, time.monotonic())
        future.add_done_callback(self._forget)
        return future, on_loop

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._running_lock:
            self._running.pop(future, None)

    def _start(self, name: str, tool: Callable, arguments: dict) -> tuple[concurrent.futures.Future, bool]:
        if not inspect.iscoroutinefunction(tool):
            return in_daemon_thread(tool, arguments, name), False
        if name in self._off_loop:
            return in_daemon_thread(lambda: asyncio.run(tool(**arguments)), {}, name), False
        coroutine = tool(**arguments)
        self._running_on_loop[coroutine] = name
        future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
        future.add_done_callback(lambda _: self._running_on_loop.pop(coroutine, None))
        return future, True

    def run(
        self,
        calls: list[tuple[str, Any]],
        tools: dict[str, Callable],
        stats: ToolStats,
        on_timeout: Callable[[Callable], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[dict]:
        """calls: (name, arguments) per tool call, in order; returns one tool message per call. All calls of the
        turn run concurrently, each for at most `timeout` seconds from the start of the turn. on_timeout(tool):
        told of each call that timed out (and may still be running). `stop`: see `call`."""
        return self.run_turns([(calls, tools)], stats, on_timeout, stop)[0]

    def run_turns(
        self,
        turns: list[tuple[list[tuple[str, Any]], dict[str, Callable]]],
        stats: ToolStats,
        on_timeout: Callable[[Callable], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[list[dict]]:
        """The tool calls of several transcripts' turns (each: its (name, arguments) calls and the tools it may
        call), all at once: a generation's rows wait for their slowest call, not for the sum of their calls. Returns
        each turn's tool messages, in the order of `turns` and of their calls, whatever order the calls end in."""
        flat = [
            (name, tools.get(name), arguments, call_problem(name, arguments, tools))
            for calls, tools in turns
            for name, arguments in calls
        ]
        outcomes = iter(self.call(flat, stats, on_timeout, stop))
        return [[self._message(name, *next(outcomes), stats) for name, _ in calls] for calls, _ in turns]

    def _message(self, name: str, result: Any, problem: str | None, stats: ToolStats) -> dict:
        """A call's outcome as the tool message the model sees: its result as text, or {'error': problem}."""
        content = None
        if problem is None:
            try:
                content, truncated = as_text(result, self.max_output_chars)
                stats.truncated[name] += truncated
            except Exception as error:  # a result whose __str__ raises is the tool's failure, not ours
                problem = f"Tool {name!r} returned a {type(result).__name__} that str() fails on: {error!r}."
                stats.failures[name] += 1
        if problem is not None:
            content = str({"error": problem})
        return {"role": "tool", "name": name, "content": content}

    def call(
        self,
        calls: list[tuple[str, Callable | None, Any, str | None]],
        stats: ToolStats,
        on_timeout: Callable[[Callable], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[tuple[Any, str | None]]:
        """calls: (name, callable, keyword arguments, a problem found before calling it or None) each. Runs them
        concurrently, each for at most `timeout` seconds from now; returns (result, None) or (None, problem) for
        each, in order, counting every call and every problem (a failure) under its name. Besides the tool loop,
        environments of other libraries run their sessions' calls through this (grpokit.integrations).

        `stop` set (the rollout was abandoned: grpokit.streaming) ends the wait at once: the calls still running are
        left as timed-out ones are (on_timeout told; async ones cancelled), and `Abandoned` is raised."""
        if stop is not None and stop.is_set():
            raise Abandoned("This rollout was abandoned before its tool calls.")
        pending = []
        for name, tool, arguments, problem in calls:
            stats.calls[name] += 1
            pending.append((name, tool, problem, *((None, False) if problem else self.submit(name, tool, arguments))))
        deadline = time.monotonic() + self.timeout
        self._wait_all([p[3] for p in pending if p[3] is not None], deadline, stop)
        if stop is not None and stop.is_set():
            for _, tool, _, future, on_loop in pending:
                if future is not None and not future.done():
                    self._abandon(future, on_loop)
                    if on_timeout is not None:
                        on_timeout(tool)
            raise Abandoned("This rollout was abandoned during its tool calls; those still running are left.")
        outcomes = []
        for name, tool, problem, future, on_loop in pending:
            result = None
            if future is not None:
                try:
                    result = future.result(timeout=max(deadline - time.monotonic(), 0.0))
                except concurrent.futures.TimeoutError:
                    problem = f"Tool {name!r} timed out after {self.timeout:g} s."
                    self._abandon(future, on_loop)
                    if on_timeout is not None:
                        on_timeout(tool)
                except BaseException as error:  # the model sees what went wrong, training goes on
                    if not (future.done() and future.exception() is error):  # Ctrl-C in this thread, not the tool's
                        raise
                    problem = str(error) or type(error).__name__
            if problem is not None:
                stats.failures[name] += 1
            outcomes.append((result, problem))
        return outcomes

    @staticmethod
    def _wait_all(futures: list[concurrent.futures.Future], deadline: float, stop: threading.Event | None) -> None:
        """Until every future is done, `deadline` (time.monotonic()) passes, or `stop` is set (polled every 50 ms)."""
        while futures and (remaining := deadline - time.monotonic()) > 0:
            wait = remaining if stop is None else min(remaining, 0.05)
            futures = list(concurrent.futures.wait(futures, timeout=wait).not_done)
            if stop is not None and stop.is_set():
                return

    def _abandon(self, future: concurrent.futures.Future, on_loop: bool) -> None:
        """A call past its time: an async call is cancelled (if its loop answers); a sync one runs on in its thread.
        A loop that does not answer is blocked by a tool: it is left to that tool, and the tool named."""
        if on_loop and self._loop is not None and not loop_answers(self._loop, min(self.timeout, 0.5)):
            culprit = asyncio.current_task(self._loop)
            name = self._running_on_loop.get(culprit.get_coro()) if culprit is not None else None
            shown = f"The async tool {name!r}" if name else "An async tool"
            then = f"; {name!r} runs from now on on an event loop of its own per call" if name else ""
            warnings.warn(
                f"{shown} blocked the event loop that async tools share for over {self.timeout:g} s "
                f"(tool_timeout): a blocking call inside `async def` (time.sleep, a blocking HTTP client, "
                f"a long computation) stalls every async tool. grpokit leaves that loop to it and starts "
                f"another{then}. Make the tool await (asyncio.sleep, an async client, asyncio.to_thread) "
                f"or make it a plain def.",
                stacklevel=3,
            )
            if name:
                self._off_loop.add(name)
            self._loop, self._running_on_loop = None, {}
        future.cancel()
        self._forget(future)  # no rollout waits for it any more
        self._abandoned = [f for f in self._abandoned if not f.done()] + [future]
        if len(self._abandoned) >= ABANDONED_WARNING_AT and not self._warned_abandoned:
            self._warned_abandoned = True
            warnings.warn(
                f"{len(self._abandoned)} tool calls that timed out are still running in abandoned threads "
                f"(Python cannot stop a thread): a tool that hangs should enforce its own time limit, e.g. "
                f"run its work in a subprocess it kills, as grpokit.agents.python_tool does.",
                stacklevel=3,
            )


def loop_answers(loop: asyncio.AbstractEventLoop, wait: float) -> bool:
    """Whether the event loop runs a callback within `wait` seconds (False: something blocks it)."""
    answered = threading.Event()
    loop.call_soon_threadsafe(answered.set)
    return answered.wait(wait)
