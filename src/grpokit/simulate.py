"""A cluster simulator for asynchronous generation: grpokit's own scheduler (`producer.Producer`, `WeightSync`,
`scheduled_version`) driven by simulated inference servers and a simulated trainer, on a virtual clock, to ask before
renting a cluster what `max_staleness`, how many servers and what batch shape keep the trainer busy.

Nothing samples or trains. An engine call on a server costs its prefill, then one decode step per token of its
longest row, each step a fixed part (reading the weights) plus a part per row still decoding; a training step costs
a fixed part plus a part per token. Completion lengths and tool latencies are log-normal (lengths cut at the maximum),
drawn from a seed per generation batch (per group, when streamed), so every schedule is given the same batches.
Whole generation batches are spread over the servers by groups and take their slowest server's time. Completions with
tool calls are streamed group by group when max_staleness > 0, as grpokit streams agents: each server then runs one
engine call at a time over the turns that waited for it (grpokit's BatchingEngine), a rollout's tool calls run all
at once (grpokit's agent loop), and a group that can no longer be trained within max_staleness is abandoned.

Time is a `VirtualClock`, not real sleeps scaled down: simulated time moves only when every thread of the simulation
is blocked (in a simulated cost, or waiting on the scheduler's condition variable, queue, engine lock or rollout
pool), and then jumps to the next event. A run costs real time per event, not per simulated second, and its figures
are exact rather than scaled sleeps plus whatever the host's load adds. The scheduler's own clocks (heartbeat,
`perf/*` fractions) stay on real time, where a whole run is short: they never see a false hang. The figures here are
taken on the virtual clock.

What the real Producer runs unchanged: its thread, the schedule (exact or latest), the waits for the trainer's
version, the weight copies and the trainer's staging of weights, the queue bound, the group pool's bound, the take and
the drop accounting. What the simulation supplies: the engine (`SimulatedMaker`, `SimulatedServers`), the rollout
runner, the prompt sampler, the trainer's loop (take, train, optimizer step under `WeightSync.step`, `stepped`), and
clock-aware versions of what the scheduler blocks on (`WeightSync.changed`, the producer's queue, and its rollout
pool through the `pool` argument of Producer).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import heapq
import itertools
import math
import queue
import random
import threading
from dataclasses import dataclass, field

import torch

from .config import GRPOConfig
from .producer import Producer, WeightSync
from .rollout import DecodedRollout, Rollout
from .rollout.batching import Abandoned
from .streaming import DaemonPool

# ------------------------------------------------------------------------------------------------ the clock


class VirtualClock:
    """Simulated time shared by threads. `running` counts the simulation's threads that are not blocked; when it
    drops to zero, the clock jumps to the earliest pending event: the end of a `sleep` (that thread runs again) or a
    timer (its callback runs, under `lock`, and may wake threads). A thread blocked on a `ClockCondition` counts as
    blocked until notified, so a wait on the scheduler is not mistaken for work.

    Rules for code that runs on it: call `spawn()` before starting a thread that acts in simulated time, and never
    `sleep` while holding a lock another simulated thread may wait for (it would wait for real, counted as running)."""

    def __init__(self):
        self.lock = threading.Lock()  # guards everything below
        self.now = 0.0
        self.running = 0
        self.closed = False
        # A heap of (time, order, the gate of a sleeping thread or None, a timer's callback or None).
        self._events: list[tuple[float, int, threading.Lock | None, object]] = []
        self._order = itertools.count()
        self._closers: list = []  # run under `lock` by close(): they let go of threads blocked elsewhere on the clock

    def spawn(self) -> None:
        """A thread that will act in simulated time is about to start (or the calling thread joins)."""
        with self.lock:
            self.running += 1

    def sleep(self, seconds: float) -> None:
        """The calling thread spends `seconds` of simulated time."""
        if seconds < 0:
            raise ValueError(f"a cost of {seconds} s")
        gate = threading.Lock()
        gate.acquire()
        with self.lock:
            if self.closed:
                return
            heapq.heappush(self._events, (self.now + seconds, next(self._order), gate, None))
            self._block()
        gate.acquire()

    def close(self) -> None:
        """Time stops mattering: every sleep ends now and later ones return at once (the simulation's shutdown)."""
        with self.lock:
            self.closed = True
            for _, _, gate, _ in self._events:
                if gate is not None:
                    gate.release()
            self._events.clear()
            for closer in self._closers:
                closer()

    def _timer(self, seconds: float, callback) -> None:
        """Under `lock`: `callback()` runs, under `lock`, once `seconds` of simulated time have passed."""
        if not self.closed:
            heapq.heappush(self._events, (self.now + seconds, next(self._order), None, callback))

    def _block(self) -> None:
        """Under `lock`: the calling thread stops running; while none is left running, time moves to the next event."""
        self.running -= 1
        while self.running == 0 and self._events:
            at, _, gate, callback = heapq.heappop(self._events)
            self.now = max(self.now, at)
            if gate is not None:
                self._wake(gate)
            else:
                callback()

    def _wake(self, gate: threading.Lock) -> None:
        """Under `lock`: a blocked thread runs again."""
        self.running += 1
        gate.release()

    def _wake_in_turn(self, gate: threading.Lock) -> None:
        """Under `lock`: a blocked thread runs again at the current time, once every running thread is blocked: threads
        woken together this way run one after another, in the order they were woken, whatever the host's timing."""
        heapq.heappush(self._events, (self.now, next(self._order), gate, None))


class ClockCondition:
    """threading.Condition's interface over `lock`, with the clock told who waits: a waiter counts as blocked until a
    notify picks it (which counts it as running at once, before it has woken). A wait's timeout is real time, as the
    scheduler's polling loops mean it: one that expires only re-checks and waits again."""

    def __init__(self, clock: VirtualClock, lock=None):
        self.clock, self._lock = clock, lock if lock is not None else threading.Lock()
        self._waiters: collections.deque[threading.Lock] = collections.deque()

    def __enter__(self):
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def acquire(self, *args) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        gate = threading.Lock()
        gate.acquire()
        with self.clock.lock:
            if self.clock.closed:  # shutdown: a plain wait
                self.clock.running += 1  # balanced by the _block below
            self._waiters.append(gate)
            self.clock._block()
        self._lock.release()
        notified = gate.acquire(timeout=-1 if timeout is None else timeout)
        if not notified:
            with self.clock.lock:
                if gate in self._waiters:  # the real timeout expired first: running again, on its own
                    self._waiters.remove(gate)
                    self.clock.running += 1
                else:  # a notify picked it meanwhile, and counted it
                    notified = True
        self._lock.acquire()
        return notified

    def notify(self, n: int = 1) -> None:
        with self.clock.lock:
            for _ in range(min(n, len(self._waiters))):
                self.clock._wake(self._waiters.popleft())

    def notify_all(self) -> None:
        self.notify(len(self._waiters))


class ClockQueue(queue.Queue):
    """queue.Queue whose blocking get and put wait on the clock's conditions."""

    def __init__(self, clock: VirtualClock, maxsize: int = 0):
        super().__init__(maxsize)
        self.not_empty = ClockCondition(clock, self.mutex)
        self.not_full = ClockCondition(clock, self.mutex)
        self.all_tasks_done = ClockCondition(clock, self.mutex)


class ClockWeightSync(WeightSync):
    """grpokit's WeightSync whose condition (the producer waits on it for the trainer's version) is the clock's."""

    def __init__(self, clock: VirtualClock, version: int = 0):
        super().__init__(version)
        self.changed = ClockCondition(clock, self.lock)


# ------------------------------------------------------------------------------------- workload and costs


@dataclass
class Workload:
    """What each generation batch asks for: `prompts` prompts × `num_generations` completions. With tool calls, a
    completion's tokens are split evenly over its turns (tool_calls + 1), and each tool call inserts
    tool_result_tokens (prefilled, and trained on as part of the completion)."""

    prompts: int
    num_generations: int
    prompt_tokens: int
    completion_median: float  # completion tokens the model writes: log-normal with this median...
    completion_sigma: float  # ...and this σ of its log (0: every completion is completion_median long)
    max_completion_length: int  # ...cut here
    tool_calls: int = 0  # per completion
    tool_latency_median_s: float = 0.0  # each call's latency: log-normal with this median...
    tool_latency_sigma: float = 0.0  # ...and this σ of its log
    tool_result_tokens: int = 0
    seed: int = 0
    # Each whole generation batch's completion lengths, in order, replayed instead of drawn (a measured run's: its
    # policy's lengths, which no log-normal of one median reproduces batch by batch); empty: drawn.
    replayed: tuple[tuple[int, ...], ...] = ()

    @property
    def completions(self) -> int:
        return self.prompts * self.num_generations

    def draws(self, seed: int) -> random.Random:
        """The random draws of generation batch (or rollout seed) `seed`: the same whatever the schedule."""
        return random.Random(self.seed * 1_000_003 + seed)

    def completion_lengths(self, rng: random.Random, n: int) -> list[int]:
        draws = [self._log_normal(rng, self.completion_median, self.completion_sigma) for _ in range(n)]
        return [max(1, min(self.max_completion_length, round(length))) for length in draws]

    def batch_lengths(self, rollout_index: int, rng: random.Random) -> list[int]:
        """Whole generation batch `rollout_index`'s completion lengths: replayed, or drawn from `rng`."""
        if self.replayed:
            return list(self.replayed[rollout_index % len(self.replayed)])
        return self.completion_lengths(rng, self.completions)

    def tool_latency_s(self, rng: random.Random) -> float:
        return self._log_normal(rng, self.tool_latency_median_s, self.tool_latency_sigma)

    def tokens(self, lengths: list[int]) -> int:
        """Prompt, written and inserted tokens of completions of `lengths` (what a training step is charged for)."""
        return sum(lengths) + len(lengths) * (self.prompt_tokens + self.tool_calls * self.tool_result_tokens)

    @staticmethod
    def _log_normal(rng: random.Random, median: float, sigma: float) -> float:
        return rng.lognormvariate(math.log(median), sigma) if sigma > 0 and median > 0 else median


@dataclass
class Costs:
    """Simulated seconds. An engine call on one server costs prefill_token_s per token to prefill, then one decode
    step per token of its longest row, each step decode_step_s (reading the weights: memory-bound) plus
    decode_token_s per row still decoding (its FLOPs and KV-cache reads). A training step costs train_step_s plus
    train_token_s per token of its batch."""

    decode_step_s: float
    decode_token_s: float
    train_token_s: float
    prefill_token_s: float = 0.0
    train_step_s: float = 0.0
    servers: int = 1
    weight_sync_s: float = 0.0  # pushing new weights to the servers

    def call_s(self, prefill_tokens: int, new_tokens: list[int]) -> float:
        """One engine call on one server: `prefill_tokens` in all, then rows of `new_tokens` each."""
        return (
            self.prefill_token_s * prefill_tokens
            + self.decode_step_s * max(new_tokens, default=0)
            + self.decode_token_s * sum(new_tokens)
        )

    def generation_s(self, prompt_tokens: int, new_tokens: list[int], num_generations: int) -> float:
        """One engine call over a whole batch (`prompt_tokens` to prefill a row): its groups (in order) split over the
        servers in near-equal counts, as a scheduler that cannot know the lengths in advance spreads them; the
        slowest share sets the time."""
        groups = [new_tokens[i : i + num_generations] for i in range(0, len(new_tokens), num_generations)]
        per_server, extra = divmod(len(groups), self.servers)
        slowest, start = 0.0, 0
        for server in range(min(self.servers, len(groups))):
            share = [n for group in groups[start : start + per_server + (server < extra)] for n in group]
            start += per_server + (server < extra)
            slowest = max(slowest, self.call_s(prompt_tokens * len(share), share))
        return slowest

    def training_s(self, tokens: float) -> float:
        return self.train_step_s + self.train_token_s * tokens


def run_turns(
    clock: VirtualClock, workload: Workload, lengths: list[int], rng: random.Random, engine_call, stop=None
) -> None:
    """Rows of completions of `lengths` written turn by turn: `engine_call(prefill tokens a row, new tokens a row)`
    for each turn, then the rows' tool calls, all at once (the turn waits for the slowest), as grpokit's agent loop
    runs them. `stop` set (a streamed group abandoned as too
    stale): the next turn is not sampled (`Abandoned`), as in grpokit's agent loop."""
    turns = workload.tool_calls + 1
    for turn in range(turns):
        if stop is not None and stop.is_set():
            raise Abandoned("This simulated rollout was abandoned (too stale to train).")
        engine_call(
            workload.prompt_tokens if turn == 0 else workload.tool_result_tokens,
            [n // turns + (turn < n % turns) for n in lengths],
        )
        if turn < turns - 1:
            clock.sleep(max(workload.tool_latency_s(rng) for _ in lengths))


# ----------------------------------------------------------------------------------- what the producer drives


@dataclass
class SimulatedExperience:
    """What the producer queues for one generation batch (the fields of experience.Experience it reads)."""

    batch: list[int]  # [B × G] completion lengths
    num_tokens: int  # prompt, written and inserted tokens
    generation_s: float  # simulated seconds its sampling took (weight push included; streamed: its slowest group's)
    rollouts: int = 1
    metrics: dict = field(default_factory=dict)
    samples: None = None


class Prompts:
    """The prompt sampler's interface as the producer uses it (a position it can save)."""

    def __init__(self):
        self.drawn = 0
        self.requeued: list[int] = []

    def draw(self, n: int) -> list[int]:
        self.drawn += n
        return list(range(self.drawn - n, self.drawn))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


class PromptRows:
    """The dataset: row i is {"index": i}."""

    def __getitem__(self, index: int) -> dict:
        return {"index": index}


class SimulatedMaker:
    """ExperienceMaker's `make` in simulated time. Whole batches: batch `rollout_index` of the workload costs its engine
    calls on the servers (and its tool calls), plus a weight push when the weights that sample it are not the ones
    the servers hold. Streamed groups (`sampled`): already sampled; scoring costs nothing."""

    def __init__(self, clock: VirtualClock, workload: Workload, costs: Costs, weights_version):
        self.clock, self.workload, self.costs = clock, workload, costs
        self.weights_version = weights_version  # () -> the version of the weights that sample the next batch
        self.prompts, self.pushed = Prompts(), None

    def make(self, rollout_index: int, trainer_state=None, sampled=None) -> SimulatedExperience:
        if sampled is not None:
            lengths = [row["completion_tokens"] for row in sampled.rows]
            return SimulatedExperience(lengths, self.workload.tokens(lengths), max(r["seconds"] for r in sampled.rows))
        started, workload = self.clock.now, self.workload
        self.prompts.draw(workload.prompts)
        rng = workload.draws(rollout_index)
        lengths = workload.batch_lengths(rollout_index, rng)
        if self.weights_version() != self.pushed:
            self.clock.sleep(self.costs.weight_sync_s)
            self.pushed = self.weights_version()
        run_turns(
            self.clock,
            workload,
            lengths,
            rng,
            lambda prefill, new: self.clock.sleep(self.costs.generation_s(prefill, new, workload.num_generations)),
        )
        return SimulatedExperience(lengths, workload.tokens(lengths), self.clock.now - started)


class SimulatedServers:
    """`costs.servers` inference servers for streamed groups, each as grpokit's BatchingEngine runs one: one engine
    call at a time, over every request that waited for it (a call already running takes no new rows). A request goes
    to the server with the fewest rows waiting or running. `lock` is the engine's: while it is held (the producer
    moving weights), no call starts, and taking it waits for the calls in progress to end."""

    def __init__(self, clock: VirtualClock, costs: Costs):
        self.clock, self.costs = clock, costs
        self.waiting: list[list[tuple[int, list[int], threading.Lock]]] = [[] for _ in range(costs.servers)]
        self.calls: list[list | None] = [None] * costs.servers
        self.lock = ServersLock(self)
        clock._closers.append(self._let_go)

    def generate(self, prefill_tokens: int, new_tokens: list[int]) -> None:
        """Blocks the calling rollout until its rows are decoded."""
        gate = threading.Lock()
        gate.acquire()
        with self.clock.lock:
            if self.clock.closed:
                return
            load = [
                sum(len(request[1]) for request in [*waiting, *(call or [])])
                for waiting, call in zip(self.waiting, self.calls)
            ]  # rows waiting or decoding
            server = load.index(min(load))
            self.waiting[server].append((prefill_tokens * len(new_tokens), new_tokens, gate))
            if self.lock.free():
                self._start(server)
            self.clock._block()
        gate.acquire()

    def idle(self) -> bool:
        return all(call is None for call in self.calls)

    def close(self, timeout: float = 0.0) -> bool:
        """The producer's shutdown: idle at once (the clock is closed by then; see `_let_go`)."""
        with self.clock.lock:
            self._let_go()
        return True

    def _let_go(self) -> None:
        """Under the clock's lock, when it closes: every rollout waiting for a call, and the producer waiting for the
        lock, go on (their later costs are nothing)."""
        for requests in [*self.waiting, *(c for c in self.calls if c)]:
            for *_, gate in requests:
                gate.release()
        self.waiting, self.calls = [[] for _ in self.waiting], [None] * len(self.calls)
        self.lock.release_all()

    def _start(self, server: int) -> None:
        """Under the clock's lock: the server's next call, if it is idle and requests wait."""
        if self.calls[server] is not None or not self.waiting[server]:
            return
        call, self.waiting[server] = self.waiting[server], []
        self.calls[server] = call
        seconds = self.costs.call_s(sum(r[0] for r in call), [n for r in call for n in r[1]])
        self.clock._timer(seconds, lambda: self._finish(server))

    def _finish(self, server: int) -> None:
        """Under the clock's lock (a timer): the call's rollouts go on; then the lock, or the next calls."""
        call, self.calls[server] = self.calls[server], None
        for *_, gate in call:
            self.clock._wake_in_turn(gate)
        self._changed()

    def _changed(self) -> None:
        """Under the clock's lock: a call ended or the lock was released."""
        if self.lock.hand_over():
            return
        if self.lock.free():
            for server in range(len(self.calls)):
                self._start(server)


class ServersLock:
    """The servers' engine lock (see SimulatedServers), on the clock: a thread waiting for it counts as blocked."""

    def __init__(self, servers: SimulatedServers):
        self.servers, self.held = servers, False
        self.waiters: collections.deque[threading.Lock] = collections.deque()

    def free(self) -> bool:
        """Under the clock's lock: whether calls may start (nobody holds the lock or waits for it)."""
        return not self.held and not self.waiters

    def acquire(self) -> bool:
        clock = self.servers.clock
        gate = threading.Lock()
        gate.acquire()
        with clock.lock:
            if clock.closed or (self.free() and self.servers.idle()):
                self.held = True
                return True
            self.waiters.append(gate)
            clock._block()
        gate.acquire()  # woken holding it
        return True

    def release(self) -> None:
        with self.servers.clock.lock:
            self.held = False
            self.servers._changed()

    def hand_over(self) -> bool:
        """Under the clock's lock: the first waiter takes the lock once no call runs."""
        if self.held or not self.waiters or not self.servers.idle():
            return False
        self.held = True
        self.servers.clock._wake(self.waiters.popleft())
        return True

    def release_all(self) -> None:
        """Under the clock's lock, at shutdown."""
        while self.waiters:
            self.waiters.popleft().release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


class SimulatedRollouts:
    """The RolloutRunner the producer streams groups through: `run` is one group's multi-turn rollouts on the servers,
    in simulated time; `sync_weights` pushes the producer's weights (holding the servers' lock, as BatchingEngine's)."""

    def __init__(self, clock: VirtualClock, workload: Workload, servers: SimulatedServers, costs: Costs):
        self.clock, self.workload, self.servers, self.costs = clock, workload, servers, costs

    def run(self, rows: list[dict], counts: list[int], seed: int, stop=None) -> DecodedRollout:
        started, rng = self.clock.now, self.workload.draws(seed)
        lengths = self.workload.completion_lengths(rng, len(rows))
        run_turns(self.clock, self.workload, lengths, rng, self.servers.generate, stop)
        n, seconds = len(rows), self.clock.now - started
        ones = torch.ones(n, 1, dtype=torch.long)
        rollout = Rollout(ones, ones, ones, ones, ones, torch.tensor(lengths), torch.zeros(n, dtype=torch.bool))
        return DecodedRollout(
            rollout,
            [{**row, "completion_tokens": length, "seconds": seconds} for row, length in zip(rows, lengths)],
            [None] * n,
            [[] for _ in range(n)],
            torch.tensor(lengths),
        )

    def sync_weights(self, model) -> None:
        with self.servers.lock:
            self.clock.sleep(self.costs.weight_sync_s)

    def scored(self, decoded: DecodedRollout) -> None:
        """A dropped group: nothing to give back."""


class ClockPool(DaemonPool):
    """The producer's pool of rollout threads, on the clock: a task counts as running from its submission to its end,
    and `wait_any` blocks on the clock until a task ends or `nudge()` (the trainer's version moved: the producer may
    start groups), where the real pool polls every `timeout` seconds."""

    def __init__(self, clock: VirtualClock, workers: int, name: str):
        self.clock, self._waiter, self._nudged = clock, None, False
        super().__init__(workers, name)

    def submit(self, function, *args) -> concurrent.futures.Future:
        self.clock.spawn()
        future = super().submit(function, *args)
        future.add_done_callback(self._ended)
        return future

    def wait_any(self, futures: list[concurrent.futures.Future], timeout: float) -> set[concurrent.futures.Future]:
        gate = threading.Lock()
        gate.acquire()
        with self.clock.lock:
            done = {future for future in futures if future.done()}
            if not done and not self._nudged and not self.clock.closed:
                self._waiter = gate
                self.clock._block()
            self._nudged = False
        if self._waiter is gate and not gate.acquire(timeout=timeout):
            with self.clock.lock:
                if self._waiter is gate:  # the real timeout expired first: running again, on its own
                    self._waiter = None
                    self.clock.running += 1
        return {future for future in futures if future.done()}

    def nudge(self) -> None:
        with self.clock.lock:
            self._nudged = self._waiter is None  # seen by the next wait_any, if the producer is not waiting now
            self._wake_waiter()

    def _ended(self, future: concurrent.futures.Future) -> None:
        with self.clock.lock:
            self._wake_waiter()
            self.clock._block()  # the task's count ends

    def _wake_waiter(self) -> None:
        """Under the clock's lock."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self.clock._wake(waiter)


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class SimulationResult:
    """One simulated run, in simulated seconds: per-step waits, times and staleness, and the totals."""

    steps: int
    time_s: float  # simulated seconds from the start to the last optimizer step
    tokens: int  # tokens trained on
    trainer_wait_s: list[float]  # per step: simulated seconds the trainer waited for its batch
    step_time_s: list[float]  # per step: since the previous batch was taken (the first: since the start)
    staleness: list[int]  # per step: versions between the batch's sampling weights and the step
    dropped_samples: int
    trained_samples: int
    generation_s: list[float]  # per trained batch: its sampling time

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s

    @property
    def trainer_idle_fraction(self) -> float:
        """The share of the run's time the trainer waited for samples."""
        return sum(self.trainer_wait_s) / self.time_s

    @property
    def rollout_wait_fraction_mean(self) -> float:
        """grpokit's `perf/rollout_wait_fraction` averaged over the steps, as benchmarks/async_overlap.py reports it
        (each step's wait over the time since the previous take; the first step waits all of its time)."""
        return sum(w / max(t, 1e-12) for w, t in zip(self.trainer_wait_s, self.step_time_s)) / self.steps

    @property
    def drop_rate(self) -> float:
        return self.dropped_samples / max(self.dropped_samples + self.trained_samples, 1)

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "time_s": self.time_s,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "trainer_idle_fraction": self.trainer_idle_fraction,
            "rollout_wait_fraction_mean": self.rollout_wait_fraction_mean,
            "staleness_mean": sum(self.staleness) / self.steps,
            "staleness_max": max(self.staleness),
            "drop_rate": self.drop_rate,
        }


def simulate(
    workload: Workload,
    costs: Costs,
    steps: int,
    max_staleness: int | None,
    schedule: str | None = None,
    weight_sync_steps: int = 1,
    queue_maxsize: int = 1024,
    max_inflight_tasks: int = -1,
    real_timeout_s: float = 300.0,
) -> SimulationResult:
    """`steps` optimizer steps, one per generation batch: synchronously (max_staleness None: sample, then train) or
    with grpokit's Producer at `max_staleness`. As in grpokit, completions with tool calls are streamed group by group
    when max_staleness > 0 (always under the 'latest' schedule), and whole batches follow `schedule` ('exact' by
    default, or 'latest'). Raises if the run does not end within `real_timeout_s` seconds of real time."""
    streamed = workload.tool_calls > 0 and max_staleness is not None and max_staleness > 0
    if streamed and schedule == "exact":
        raise ValueError("streamed groups (tool calls, max_staleness > 0) follow the 'latest' schedule only")
    schedule = schedule or ("latest" if streamed else "exact")
    clock = VirtualClock()
    trainer = SimulatedTrainer(clock, costs, steps)
    producer = None
    if max_staleness is None:
        loop = functools.partial(trainer.synchronous, workload)
    else:
        args = GRPOConfig(
            output_dir="simulate",
            per_device_train_batch_size=workload.completions,
            num_generations=workload.num_generations,
            max_staleness=max_staleness,
            async_schedule=schedule,
            weight_sync_steps=weight_sync_steps,
            queue_maxsize=queue_maxsize,
            max_inflight_tasks=max_inflight_tasks,
            report_to="none",
            use_cpu=True,
        )
        sync = ClockWeightSync(clock)
        producer = simulated_producer(args, clock, sync, workload, costs, streamed)
        loop = functools.partial(trainer.asynchronous, producer, sync, streamed)
    run_on_the_clock(clock, trainer, loop, producer, real_timeout_s)
    record = trainer.record
    return SimulationResult(
        steps,
        record["time"],
        record["tokens"],
        record["wait"],
        record["step"],
        record["staleness"],
        producer.dropped if producer else 0,
        record["trained"],
        record["generation"],
    )


class SimulatedTrainer:
    """The trainer's side of a simulated run: it takes each step's batch (sampled itself, or from the producer),
    trains for the batch's simulated cost and records the waits, step times and staleness a result reports."""

    def __init__(self, clock: VirtualClock, costs: Costs, steps: int):
        self.clock, self.costs, self.steps = clock, costs, steps
        self.record = {
            "wait": [],
            "step": [],
            "staleness": [],
            "generation": [],
            "tokens": 0,
            "time": 0.0,
            "trained": 0,
        }
        self.failure: list[BaseException] = []

    def train(self, experience: SimulatedExperience) -> None:
        self.clock.sleep(self.costs.training_s(experience.num_tokens))
        self.record["tokens"] += experience.num_tokens
        self.record["trained"] += len(experience.batch)
        self.record["generation"].append(experience.generation_s)

    def synchronous(self, workload: Workload) -> None:
        clock, record = self.clock, self.record
        maker = SimulatedMaker(clock, workload, self.costs, weights_version=lambda: version)
        last_taken = 0.0
        for version in range(self.steps):  # the weights move every step: each batch pushes them
            started = clock.now
            experience = maker.make(version)
            record["wait"].append(clock.now - started)
            record["step"].append(clock.now - last_taken)
            last_taken = clock.now
            record["staleness"].append(0)
            self.train(experience)
            record["time"] = clock.now

    def asynchronous(self, producer: Producer, sync: ClockWeightSync, streamed: bool) -> None:
        clock, record = self.clock, self.record
        last_taken = 0.0
        for version in range(self.steps):
            started = clock.now
            produced, metrics = producer.take(version)
            record["wait"].append(clock.now - started)
            record["step"].append(clock.now - last_taken)
            last_taken = clock.now
            record["staleness"].append(int(metrics["sample/staleness_max"]))
            self.train(produced.experience)
            with sync.step():  # the optimizer step: the weights and their version move under the step lock
                pass
            sync.stepped()
            if streamed:  # where the real producer would see the new version at its next poll
                producer.pool.nudge()
            record["time"] = clock.now

    def run(self, loop) -> None:
        """The trainer thread's body: `loop`, then the clock closed (a failure is kept for the caller to raise)."""
        try:
            loop()
        except BaseException as error:
            self.failure.append(error)
        finally:
            self.clock.close()


def simulated_producer(
    args: GRPOConfig, clock: VirtualClock, sync: ClockWeightSync, workload: Workload, costs: Costs, streamed: bool
) -> Producer:
    """grpokit's Producer over the simulated sampler (and, for streamed groups, the simulated servers and rollouts),
    its queue on the clock."""
    policy, policy_copy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    maker = SimulatedMaker(clock, workload, costs, weights_version=lambda: producer.weights_version)
    if streamed:
        servers = SimulatedServers(clock, costs)
        producer = Producer(
            args,
            maker,
            policy,
            policy_copy,
            sync,
            maker.prompts,
            rollout_index=0,
            engine=servers,
            runner=SimulatedRollouts(clock, workload, servers, costs),
            dataset=PromptRows(),
            pool=functools.partial(ClockPool, clock),
        )
    else:
        exact = args.async_schedule == "exact"
        producer = Producer(args, maker, policy, policy_copy, sync, maker.prompts, rollout_index=0, exact=exact)
    producer.queue = ClockQueue(clock, producer.queue.maxsize)  # the scheduler's bound, on the clock
    return producer


def run_on_the_clock(
    clock: VirtualClock, trainer: SimulatedTrainer, loop, producer: Producer | None, real_timeout_s: float
) -> None:
    """Runs the trainer's `loop` in a thread of its own, beside the producer's, until it ends; raises what it raised,
    or if it has not ended within `real_timeout_s` seconds of real time."""
    # Both threads count as running before either starts, so that time cannot move before the other has begun.
    for _ in range(1 if producer is None else 2):
        clock.spawn()
    thread = threading.Thread(target=trainer.run, args=(loop,), name="simulated-trainer", daemon=True)
    thread.start()
    if producer is not None:
        producer.start()
    thread.join(real_timeout_s)
    if producer is not None:
        producer.close()
    if thread.is_alive():
        raise TimeoutError(
            f"The simulation did not end within {real_timeout_s} s of real time (stalled at simulated "
            f"{clock.now:.1f} s, {len(trainer.record['wait'])} steps taken)."
        )
    if trainer.failure:
        raise trainer.failure[0]
