"""Concurrent model calls answered together: the one mechanism by which grpokit batches the turns its rollouts ask
for.

Rollouts ask the engine for their next turn on their own: the rows of a classic verifiers environment (asyncio
coroutines), the groups streamed under asynchronous generation (threads), the sessions of the policy endpoint (HTTP
threads), the rows of grpokit's own tool loop (all at once, synchronously). An engine samples a batch in one call
for about the cost of one row (a decode step reads every weight whatever the rows; vLLM schedules the rows
together), and it is not known to take calls from several threads at once. So the requests waiting for the engine
are answered by one engine call (`answer`), and a flush policy (`Flush`) says when the waiting requests go and
which of them together:

- `EVERY_CALLER_WAITS`: when every caller still running waits on the model (the others are in an environment's code,
  or done), in the callers' order. The engine calls, and so the samples, are a function of the seed: the k-th call
  of a rollout is seeded `seed + SEED_STRIDE * k`, however the callers' turns interleave in time. The callers must
  be known (a generation's rows). grpokit's tool loop holds all its rows at once and calls `answer` itself
  (`agents.loop.sample_turns`); a classic verifiers environment's rows are coroutines (`AsyncBatcher`), where a row
  that waited `straggler_wait` seconds on one still in an environment's code goes without it, at the price of that
  determinism.
- `ARRIVED_WHILE_BUSY`: whatever arrived while the engine was busy goes into its next call: continuous batching at
  the granularity of engine calls (a request does not join a call already running). For callers that come and go
  (streamed groups: `BatchingEngine`), whose samples depend on timing anyway. The merged call is seeded with its
  first request's seed: a request alone gets exactly what the engine gives it.
- `ONE_AT_A_TIME`: each request its own call, oldest first, seeded with its own seed: what a caller that seeds each
  call (the endpoint's sessions) needs from an engine shared with others.

Requests merge when their sampling parameters agree except `max_new_tokens` (`merge_key`): the call samples up to
the largest, and each request's rows are cut to its own limit afterwards (a row cut there is truncated, as it would
have been). Equal consecutive prompts of the merged requests (a group's rows asking for their turn) are one prompt
sampled several times, so that an engine shares their prefix.

Each row's sampling log-probs are its behaviour policy's, recorded at sampling time: the engine's own, or, from an
engine that reports none (a scripted engine, a user's), `behaviour`'s forward of the weights it sampled with, taken in
the same call, before any weights move (streamed turns are trained with them as π_old). An engine's error reaches
every request of its call.

Callers that ask concurrently go through an adapter: `BatchingEngine` for threads (a `RolloutEngine` itself),
`AsyncBatcher` for coroutines of one event loop. Both keep their waiting requests in a `Waiting`, which applies the
policy, and both call `answer`. A caller that may be given up (a streamed group too stale to train) asks through its
own view, `BatchingEngine.caller(stop)`: once `stop` is set its waiting request leaves the queue and its calls raise
`Abandoned`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterable

import torch

from .engine import PromptBatch, Rollout, SamplingParams, engine_logprobs_match_training

SEED_STRIDE = 7919  # the seed of a rollout's k-th engine call is seed + SEED_STRIDE * k


class Flush(enum.Enum):
    """When the waiting requests go to the engine, and which of them together (see the module docstring)."""

    EVERY_CALLER_WAITS = "every caller waits"
    ARRIVED_WHILE_BUSY = "arrived while busy"
    ONE_AT_A_TIME = "one at a time"


@dataclasses.dataclass(eq=False)
class Request:
    """One caller's request for completions, answered with its rollout or the engine's error."""

    prompts: PromptBatch
    params: SamplingParams
    seed: int | None = None  # the seed it asks for; an adapter that seeds its calls itself (AsyncBatcher) has none
    caller: int = 0  # under EVERY_CALLER_WAITS: which caller asks (a row), in whose order requests are merged
    rollout: Rollout | None = None
    error: BaseException | None = None

    @property
    def answered(self) -> bool:
        return self.rollout is not None or self.error is not None


def merge_key(params: SamplingParams) -> SamplingParams:
    """What two requests must share to be sampled in one call: every parameter but max_new_tokens."""
    return dataclasses.replace(params, max_new_tokens=0)


class Waiting:
    """The requests waiting for the engine, and which of them its next call takes under `flush`. Not thread-safe:
    its adapter owns it (under a lock, or on its event loop)."""

    def __init__(self, flush: Flush, callers: Iterable[int] = ()):
        self.flush = flush
        self.requests: list[Request] = []  # in order of arrival
        self.running = set(callers)  # EVERY_CALLER_WAITS: the callers not finished

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests.append(request)

    def finished(self, caller: int) -> None:
        """The caller asks no more (its rollout ended, a request it left waiting included)."""
        self.running.discard(caller)
        self.requests = [r for r in self.requests if r.caller != caller]

    def ready(self) -> bool:
        """Whether the policy calls the engine now, were it free."""
        if self.flush is Flush.EVERY_CALLER_WAITS:
            return bool(self.requests) and {r.caller for r in self.requests} == self.running
        return bool(self.requests)

    def take(self) -> list[Request]:
        """The next call's requests, no longer waiting: the first (in the callers' order under EVERY_CALLER_WAITS,
        the oldest otherwise) and, unless ONE_AT_A_TIME, every other one whose parameters it can share."""
        if not self.requests:
            return []
        if self.flush is Flush.ONE_AT_A_TIME:
            taken = self.requests[:1]
        else:
            ordered = self.requests
            if self.flush is Flush.EVERY_CALLER_WAITS:  # a prompt's G rows stay consecutive, so the engine shares them
                ordered = sorted(self.requests, key=lambda r: r.caller)
            key = merge_key(ordered[0].params)
            taken = [r for r in ordered if merge_key(r.params) == key]
        self.requests = [r for r in self.requests if r not in taken]
        return taken


def answer(engine, requests: list[Request], seed: int, behaviour: Callable[[Rollout], torch.Tensor] | None = None):
    """One engine call for `requests` (parameters that share `merge_key`), seeded `seed`: every request gets its own
    rows, cut to its own max_new_tokens, or the engine's error (see the module docstring)."""
    params = dataclasses.replace(requests[0].params, max_new_tokens=max(r.params.max_new_tokens for r in requests))
    try:
        merged = engine.generate(merged_prompts(requests), params, seed)
        if merged.sampling_logprobs is None and behaviour is not None:
            merged.sampling_logprobs = behaviour(merged)
        rollouts, start = [], 0
        for request in requests:
            rows = request.prompts.num_rows
            part = merged if len(requests) == 1 else merged.select(list(range(start, start + rows))).trimmed()
            rollouts.append(part.cut_to(request.params.max_new_tokens))
            start += rows
    except BaseException as error:  # every caller of the call hears of it, and decides what it stops
        for request in requests:
            request.error = error
        return
    for request, rollout in zip(requests, rollouts):
        request.rollout = rollout


def merged_prompts(requests: list[Request]) -> PromptBatch:
    """The requests' prompts as one batch, in order, equal consecutive text prompts as one (their counts added); a
    request alone keeps its own batch as it is."""
    if len(requests) == 1:
        return requests[0].prompts
    merged = PromptBatch.concat([r.prompts for r in requests])
    if any(x is not None for x in (merged.images, merged.processed, merged.unexpanded_ids)):
        return merged
    ids, counts, raw = [], [], []
    for prompt, count, given in zip(merged.ids, merged.counts, merged.raw):
        if ids and ids[-1] == prompt and same_raw(raw[-1], given):
            counts[-1] += count
        else:
            ids.append(prompt)
            counts.append(count)
            raw.append(given)
    return PromptBatch(ids=ids, counts=counts, raw=raw)


def same_raw(a, b) -> bool:
    """Whether two prompts as the dataset gave them are the same (an engine may sample from the text)."""
    return a is b or (isinstance(a, (str, list)) and type(a) is type(b) and a == b)


class EngineClosed(RuntimeError):
    """The engine was closed (training ended): a rollout still in flight stops at its next call."""


class Abandoned(RuntimeError):
    """The rollout's caller gave it up (a streamed group too stale to train: grpokit.streaming): it stops at its next
    engine call or tool call, and gives back what it was lent."""


class BatchingEngine:
    """`engine` for several threads at once, under `flush` (ARRIVED_WHILE_BUSY or ONE_AT_A_TIME): each call waits
    while the engine is busy, and whoever gets the engine answers the waiting requests the policy takes, its own or
    others'. Weights move between calls: `lock` is held while the engine samples, and `sync_weights` takes it.
    `calls` counts the engine's calls, `requests` the requests answered."""

    def __init__(self, engine, behaviour=None, flush: Flush = Flush.ARRIVED_WHILE_BUSY):
        if flush is Flush.EVERY_CALLER_WAITS:
            raise ValueError(
                "BatchingEngine serves threads that come and go, so it cannot wait for every caller; "
                "AsyncBatcher flushes when every caller waits."
            )
        self.engine = engine
        self.behaviour = behaviour  # Rollout -> [N, T] log-probs of its completions under the sampling weights
        self.logprobs_match_training = engine_logprobs_match_training(engine)
        self.lock = threading.Lock()  # held while the engine samples or takes weights
        self.waiting = Waiting(flush)
        self.waiting_lock = threading.Lock()
        self.calls = self.requests = 0
        self.returned_at = 0.0  # time.monotonic() when the engine last returned (the producer's heartbeat reads it)
        self.busy_since: float | None = None  # time.monotonic() when the call in progress began; None: idle
        self.closed = False

    def caller(self, stop: threading.Event) -> CallerEngine:
        """This engine as one caller (a streamed group) sees it: once `stop` is set, its requests leave the queue
        and its next call raises `Abandoned`."""
        return CallerEngine(self, stop)

    def generate(
        self, prompts: PromptBatch, params: SamplingParams, seed: int, stop: threading.Event | None = None
    ) -> Rollout:
        request = Request(prompts, params, seed)
        with self.waiting_lock:
            self._check_open(stop)
            self.waiting.add(request)
        while not request.answered:
            # A closed engine answers the waiting requests at once (its lock stays held: see close).
            if not self.lock.acquire(timeout=0.1):
                self._check_open(stop, request)
                continue
            try:
                self._check_open(stop, request)
                if not request.answered:
                    with self.waiting_lock:
                        requests = self.waiting.take()
                    self._serve(requests)
            finally:
                self.lock.release()
        if request.error is not None:
            raise request.error
        return request.rollout

    def close(self, timeout: float = 5.0) -> bool:
        """No more calls: requests waiting or to come raise EngineClosed (a rollout in flight stops at its next
        turn). The call in progress, if any, is waited for `timeout` seconds at most, and the lock is then kept for
        good, so that no thread is inside the engine (torch) when the interpreter exits. False if the call in
        progress did not end in time."""
        self.closed = True
        return self.lock.acquire(timeout=timeout)

    def _check_open(self, stop: threading.Event | None = None, request: Request | None = None) -> None:
        if self.closed:
            raise EngineClosed("The producer's engine is closed (training ended): this rollout stops here.")
        if stop is not None and stop.is_set():
            if request is not None:
                with self.waiting_lock:
                    self.waiting.requests = [r for r in self.waiting.requests if r is not request]
            raise Abandoned("This rollout was abandoned (too stale to train): its next turn is not sampled.")

    def sync_weights(self, model: torch.nn.Module) -> None:
        with self.lock:
            self.engine.sync_weights(model)

    def _serve(self, requests: list[Request]) -> None:
        self.busy_since = time.monotonic()
        try:
            answer(self.engine, requests, requests[0].seed, self.behaviour)
        finally:
            self.busy_since = None
        self.calls, self.requests = self.calls + 1, self.requests + len(requests)
        self.returned_at = time.monotonic()


class CallerEngine:
    """One caller's view of a `BatchingEngine` (`BatchingEngine.caller`): its calls go to the shared engine until
    `stop` is set, then raise `Abandoned` (a request waiting leaves the queue). A multi-turn driver may read `stop`
    to end its own waits too (grpokit's tool loop does)."""

    def __init__(self, engine: BatchingEngine, stop: threading.Event):
        self.engine, self.stop = engine, stop
        self.logprobs_match_training = engine.logprobs_match_training

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        return self.engine.generate(prompts, params, seed, self.stop)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)


class AsyncBatcher:
    """`callers` coroutines of one event loop (a generation's rows) asking `engine` for their turns, under
    EVERY_CALLER_WAITS: `await generate(request)` (its `caller` one of range(callers)) returns once every caller
    still running waits, or once it has waited `straggler_wait` seconds on callers still in an environment's code
    (so that a slow environment reply does not spend the other rows' time; the samples are then no longer a function
    of the seed alone). A caller whose rollout ends calls `finished`. `failure` is the engine's error, if any."""

    def __init__(self, engine, callers: int, seed: int, straggler_wait: float = 0.5):
        self.engine, self.seed, self.straggler_wait = engine, seed, straggler_wait
        self.waiting = Waiting(Flush.EVERY_CALLER_WAITS, range(callers))
        self.answers: dict[int, asyncio.Future] = {}  # each waiting caller's
        self.timer: asyncio.TimerHandle | None = None
        self.calls = 0
        self.failure: BaseException | None = None

    async def generate(self, request: Request) -> Rollout:
        answered = self.answers[request.caller] = asyncio.get_running_loop().create_future()
        self.waiting.add(request)
        self._flush_when_ready()  # may answer it at once: the last caller to wait completes the call
        return await answered

    def finished(self, caller: int) -> None:
        """The caller's rollout ended (one that timed out while it waited on the model ends too)."""
        self.waiting.finished(caller)
        self.answers.pop(caller, None)
        self._flush_when_ready()

    def _flush_when_ready(self) -> None:
        if not self.waiting:
            return
        if self.waiting.ready():
            self._flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.straggler_wait, self._flush)

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        requests = [r for r in self.waiting.take() if not self.answers[r.caller].done()]  # not cancelled meanwhile
        if requests:
            seed, self.calls = self.seed + SEED_STRIDE * self.calls, self.calls + 1
            answer(self.engine, requests, seed)
            for request in requests:
                future = self.answers.pop(request.caller)
                if request.error is not None:
                    self.failure = request.error
                    future.set_exception(request.error)
                else:
                    future.set_result(request.rollout)
        self._flush_when_ready()  # requests another call must take (other sampling parameters)
