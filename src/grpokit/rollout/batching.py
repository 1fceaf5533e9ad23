"""Concurrent requests to one engine merged into one engine call: `BatchingEngine`.

Asynchronous generation streams multi-turn rollouts group by group (grpokit.streaming): several groups are in flight
at once, and each asks the engine for its rows' next turn on its own. An engine that samples a batch in one call
(grpokit's in-process engine, colocated vLLM) is not known to take calls from several threads at once, so the calls
must wait for each other; and one call of 32 rows costs about what one of 4 does on such an engine (a decode step
reads every weight whatever the rows; vLLM schedules the rows together). So rather than queue them one after the
other, the requests that arrived while the engine was busy go into its next call together: a form of continuous
batching at the granularity of engine calls (a row does not join a call already running).

Requests merge when their sampling parameters agree except `max_new_tokens`: the call samples up to the largest, and
each request's rows are cut to its own limit afterwards (a row cut there is truncated, as it would have been). The
merged call is seeded with the first request's seed: a request alone gets exactly what the engine gives it, while a
merged one depends on which requests it met (as any sample under asynchronous generation depends on timing).
Weights move between calls: `lock` is held while the engine samples, and `sync_weights` takes it.

Each row's sampling log-probs are its behaviour policy's, recorded at sampling time: the engine's own, or, from an
engine that reports none (a scripted engine, a user's), `behaviour`'s forward of the weights it sampled with, taken in
the same call, under the lock, before any weights move (streamed turns are trained with them as π_old).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from .engine import PromptBatch, Rollout, SamplingParams, engine_logprobs_match_training


class EngineClosed(RuntimeError):
    """The engine was closed (training ended): a rollout still in flight stops at its next call."""


@dataclasses.dataclass(eq=False)
class Request:
    prompts: PromptBatch
    params: SamplingParams
    seed: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    rollout: Rollout | None = None
    error: BaseException | None = None


class BatchingEngine:
    """`engine` for several threads at once: each call waits while the engine is busy, and the requests that
    waited go into the engine's next call together (see the module docstring). `calls` counts the engine's calls,
    `requests` the requests served."""

    def __init__(self, engine, behaviour=None):
        self.engine = engine
        self.behaviour = behaviour  # Rollout -> [N, T] log-probs of its completions under the sampling weights
        self.logprobs_match_training = engine_logprobs_match_training(engine)
        self.lock = threading.Lock()  # held while the engine samples or takes weights
        self.waiting: list[Request] = []
        self.waiting_lock = threading.Lock()
        self.calls = self.requests = 0
        self.returned_at = 0.0  # time.monotonic() when the engine last returned (the producer's heartbeat reads it)
        self.closed = False

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        request = Request(prompts, params, seed)
        with self.waiting_lock:
            self._check_open()
            self.waiting.append(request)
        while not request.done.is_set():
            # Whoever holds the lock serves the oldest waiting requests, its own or others'; a closed engine
            # answers the waiting ones at once (its lock stays held: see close).
            if not self.lock.acquire(timeout=0.1):
                self._check_open()
                continue
            try:
                self._check_open()
                if not request.done.is_set():
                    self._serve(self._take_compatible())
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

    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosed("The producer's engine is closed (training ended): this rollout stops here.")

    def sync_weights(self, model: torch.nn.Module) -> None:
        with self.lock:
            self.engine.sync_weights(model)

    def _take_compatible(self) -> list[Request]:
        """The oldest waiting request and every other waiting one whose parameters it can share."""
        with self.waiting_lock:
            keys = [merge_key(r.params) for r in self.waiting]
            taken = [r for r, key in zip(self.waiting, keys) if key == keys[0]]
            self.waiting = [r for r, key in zip(self.waiting, keys) if key != keys[0]]
        return taken

    def _serve(self, requests: list[Request]) -> None:
        params = dataclasses.replace(requests[0].params, max_new_tokens=max(r.params.max_new_tokens for r in requests))
        try:
            merged = self.engine.generate(PromptBatch.concat([r.prompts for r in requests]), params, requests[0].seed)
            if merged.sampling_logprobs is None and self.behaviour is not None:
                merged.sampling_logprobs = self.behaviour(merged)
            self.calls, self.requests = self.calls + 1, self.requests + len(requests)
            start = 0
            for request in requests:
                rows = request.prompts.num_rows
                part = merged if len(requests) == 1 else merged.select(list(range(start, start + rows))).trimmed()
                request.rollout = part.cut_to(request.params.max_new_tokens)
                start += rows
        except BaseException as error:
            for request in requests:
                request.error = error
        self.returned_at = time.monotonic()
        for request in requests:
            request.done.set()


def merge_key(params: SamplingParams) -> SamplingParams:
    """What two requests must share to be sampled in one call: every parameter but max_new_tokens."""
    return dataclasses.replace(params, max_new_tokens=0)
