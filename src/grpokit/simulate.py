"""A cluster simulator for asynchronous generation: grpokit's own scheduler (`producer.Producer`, `WeightSync`,
`scheduled_version`) driven by inference servers and a trainer whose work is simulated time, to ask before renting a
cluster what `max_staleness`, how many servers and what batch shape keep the trainer busy.

Nothing samples or trains: a generation batch costs the time its slowest server takes (prefill, then a decode step
per token of its longest completion, each step costing a fixed part plus a part per row still decoding), and a
training step costs a fixed part plus a part per token. Completion lengths are long-tailed (log-normal, cut at the
maximum length), drawn from a seed per generation batch, so every schedule is given the same batches.

Time is a `VirtualClock`, not real sleeps scaled down: simulated time moves only when every thread of the simulation
is blocked (in a simulated cost, or waiting on the scheduler's condition variable or queue), and then jumps to the next
cost's end. A run takes milliseconds per simulated minute whatever the costs, and its figures are exact rather than
the scaled sleeps plus whatever the host's load adds. The scheduler's own clocks (heartbeat, `perf/*` fractions) stay
on real time, where the whole run takes a fraction of a second: they never see a false hang. The figures here are
taken on the virtual clock.

What the real Producer runs unchanged: its thread, the schedule (exact or latest), the waits for the trainer's
version, the weight copies and the trainer's staging of weights, the queue bound, the take and the drop accounting.
What the simulation supplies: the engine (`SimulatedMaker`), the prompt sampler, the trainer's loop (take, train,
optimizer step under `WeightSync.step`, `stepped`), and clock-aware versions of the two synchronisation objects the
scheduler blocks on (`WeightSync.changed` and the producer's queue).
"""

from __future__ import annotations

import collections
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

# ------------------------------------------------------------------------------------------------ the clock


class VirtualClock:
    """Simulated time shared by threads. `running` counts the simulation's threads that are not blocked; when it
    drops to zero, the clock jumps to the earliest pending `sleep`'s end and wakes that one thread. A thread blocked
    on a `ClockCondition` counts as blocked until notified, so a wait on the scheduler is not mistaken for work.

    Rules for code that runs on it: call `spawn()` before starting a thread that acts in simulated time, and never
    `sleep` while holding a lock another simulated thread may wait for (it would wait for real, counted as running)."""

    def __init__(self):
        self.lock = threading.Lock()  # guards everything below
        self.now = 0.0
        self.running = 0
        self.closed = False
        self._sleepers: list[tuple[float, int, threading.Lock]] = []  # heap of (wake-up time, order, gate)
        self._order = itertools.count()

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
            heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), gate))
            self._block()
        gate.acquire()

    def close(self) -> None:
        """Time stops mattering: every sleep ends now and later ones return at once (the simulation's shutdown)."""
        with self.lock:
            self.closed = True
            for _, _, gate in self._sleepers:
                gate.release()
            self._sleepers.clear()

    def _block(self) -> None:
        """Under `lock`: the calling thread stops running; if none is left running, the next sleeper wakes."""
        self.running -= 1
        if self.running == 0 and self._sleepers:
            wake_at, _, gate = heapq.heappop(self._sleepers)
            self.now = max(self.now, wake_at)
            self._wake(gate)

    def _wake(self, gate: threading.Lock) -> None:
        """Under `lock`: a blocked thread runs again."""
        self.running += 1
        gate.release()


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
    """What each generation batch asks for: `prompts` prompts × `num_generations` completions."""

    prompts: int
    num_generations: int
    prompt_tokens: int
    completion_median: float  # completion tokens: log-normal with this median...
    completion_sigma: float  # ...and this σ of its log (0: every completion is completion_median long)
    max_completion_length: int  # ...cut here
    seed: int = 0

    @property
    def completions(self) -> int:
        return self.prompts * self.num_generations

    def completion_lengths(self, generation: int) -> list[int]:
        """Generation batch `generation`'s completion lengths (prompt-major), the same whatever the schedule."""
        rng = random.Random(self.seed * 1_000_003 + generation)
        mu = math.log(self.completion_median)
        draw = (lambda: rng.lognormvariate(mu, self.completion_sigma)) if self.completion_sigma > 0 else \
            (lambda: self.completion_median)  # fmt: skip
        return [max(1, min(self.max_completion_length, round(draw()))) for _ in range(self.completions)]


@dataclass
class Costs:
    """Simulated seconds. A server's share of a batch costs prefill_token_s per prompt token, then one decode step
    per token of its longest completion, each step decode_step_s (reading the weights: memory-bound) plus
    decode_token_s per row still decoding (its FLOPs and KV-cache reads). A training step costs train_step_s plus
    train_token_s per token (prompt + completion) of its batch."""

    decode_step_s: float
    decode_token_s: float
    train_token_s: float
    prefill_token_s: float = 0.0
    train_step_s: float = 0.0
    servers: int = 1  # the groups of a batch are spread over them evenly; the batch takes the slowest share
    weight_sync_s: float = 0.0  # pushing new weights to the servers, before a batch sampled by new weights

    def generation_s(self, lengths: list[int], workload: Workload) -> float:
        """One generation batch: its groups (in order) split over the servers in near-equal counts, as a scheduler
        that cannot know the lengths in advance spreads them; the slowest share sets the time."""
        groups = [lengths[i : i + workload.num_generations] for i in range(0, len(lengths), workload.num_generations)]
        per_server, extra = divmod(len(groups), self.servers)
        slowest, start = 0.0, 0
        for server in range(min(self.servers, len(groups))):
            share = [n for group in groups[start : start + per_server + (server < extra)] for n in group]
            start += per_server + (server < extra)
            slowest = max(slowest, self.prefill_token_s * workload.prompt_tokens * len(share) +
                          self.decode_step_s * max(share) + self.decode_token_s * sum(share))  # fmt: skip
        return slowest

    def training_s(self, tokens: int) -> float:
        return self.train_step_s + self.train_token_s * tokens


# ----------------------------------------------------------------------------------- what the producer drives


@dataclass
class SimulatedExperience:
    """What the producer queues for one generation batch (the fields of experience.Experience it reads)."""

    batch: list[int]  # [B × G] completion lengths
    num_tokens: int  # prompt + completion tokens
    generation_s: float  # simulated seconds its sampling took (weight push included)
    rollouts: int = 1
    metrics: dict = field(default_factory=dict)
    samples: None = None


class Prompts:
    """The prompt sampler's interface as the producer uses it (a position it can save)."""

    def __init__(self):
        self.drawn = 0

    def draw(self, n: int) -> list[int]:
        self.drawn += n
        return list(range(self.drawn - n, self.drawn))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


class SimulatedMaker:
    """ExperienceMaker's `make` in simulated time: batch `generation` of the workload costs its generation time on
    the servers, plus a weight push when the weights that sample it are not the ones the servers hold."""

    def __init__(self, clock: VirtualClock, workload: Workload, costs: Costs, weights_version):
        self.clock, self.workload, self.costs = clock, workload, costs
        self.weights_version = weights_version  # () -> the version of the weights that sample the next batch
        self.prompts, self.pushed = Prompts(), None

    def make(self, generation: int, trainer_state=None) -> SimulatedExperience:
        self.prompts.draw(self.workload.prompts)
        lengths = self.workload.completion_lengths(generation)
        seconds = self.costs.generation_s(lengths, self.workload)
        if self.weights_version() != self.pushed:
            seconds += self.costs.weight_sync_s
            self.pushed = self.weights_version()
        self.clock.sleep(seconds)
        tokens = sum(lengths) + self.workload.prompt_tokens * len(lengths)
        return SimulatedExperience(lengths, tokens, seconds)


# ------------------------------------------------------------------------------------------------ the run


@dataclass
class SimulationResult:
    steps: int
    time_s: float  # simulated seconds from the start to the last optimizer step
    tokens: int  # prompt + completion tokens trained on
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
        return {"steps": self.steps, "time_s": self.time_s, "tokens": self.tokens, "tokens_per_s": self.tokens_per_s,
                "trainer_idle_fraction": self.trainer_idle_fraction,
                "rollout_wait_fraction_mean": self.rollout_wait_fraction_mean,
                "staleness_mean": sum(self.staleness) / self.steps, "staleness_max": max(self.staleness),
                "drop_rate": self.drop_rate}  # fmt: skip


def simulate(workload: Workload, costs: Costs, steps: int, max_staleness: int | None, schedule: str = "exact",
             weight_sync_steps: int = 1, queue_maxsize: int = 1024,
             real_timeout_s: float = 120.0) -> SimulationResult:  # fmt: skip
    """`steps` optimizer steps, one per generation batch: synchronously (max_staleness None: sample, then train) or
    with grpokit's Producer at `max_staleness` under `schedule` ('exact' or 'latest'). Raises if the run does not end
    within `real_timeout_s` seconds of real time (a stalled simulation)."""
    clock = VirtualClock()
    record = {"wait": [], "step": [], "staleness": [], "generation": [], "tokens": 0, "time": 0.0, "trained": 0}
    producer, failure = None, []

    def train(experience: SimulatedExperience) -> None:
        clock.sleep(costs.training_s(experience.num_tokens))
        record["tokens"] += experience.num_tokens
        record["trained"] += len(experience.batch)
        record["generation"].append(experience.generation_s)

    def synchronous() -> None:
        maker = SimulatedMaker(clock, workload, costs, weights_version=lambda: version)
        last_taken = 0.0
        for version in range(steps):  # the weights move every step: each batch pushes them
            started = clock.now
            experience = maker.make(version)
            record["wait"].append(clock.now - started)
            record["step"].append(clock.now - last_taken)
            last_taken = clock.now
            record["staleness"].append(0)
            train(experience)
            record["time"] = clock.now

    def asynchronous() -> None:
        last_taken = 0.0
        for version in range(steps):
            started = clock.now
            produced, metrics = producer.take(version)
            record["wait"].append(clock.now - started)
            record["step"].append(clock.now - last_taken)
            last_taken = clock.now
            record["staleness"].append(int(metrics["sample/staleness_max"]))
            train(produced.experience)
            with sync.step():  # the optimizer step: the weights and their version move under the step lock
                pass
            sync.stepped()
            record["time"] = clock.now

    def trainer() -> None:
        try:
            synchronous() if max_staleness is None else asynchronous()
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            failure.append(error)
        finally:
            clock.close()

    if max_staleness is not None:
        args = GRPOConfig(output_dir="simulate", per_device_train_batch_size=workload.completions,
                          num_generations=workload.num_generations, max_staleness=max_staleness,
                          async_schedule=schedule, weight_sync_steps=weight_sync_steps, queue_maxsize=queue_maxsize,
                          report_to="none", use_cpu=True)  # fmt: skip
        sync = ClockWeightSync(clock)
        policy, copy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
        maker = SimulatedMaker(clock, workload, costs, weights_version=lambda: producer.weights_version)
        producer = Producer(args, maker, policy, copy, sync, maker.prompts, generation=0, exact=schedule == "exact")
        producer.queue = ClockQueue(clock, producer.queue.maxsize)  # the scheduler's bound, on the clock
    # Both threads count as running before either starts, so that time cannot move before the other has begun.
    for _ in range(1 if producer is None else 2):
        clock.spawn()
    thread = threading.Thread(target=trainer, name="simulated-trainer", daemon=True)
    thread.start()
    if producer is not None:
        producer.start()
    thread.join(real_timeout_s)
    if producer is not None:
        producer.close()
    if thread.is_alive():
        raise TimeoutError(f"The simulation did not end within {real_timeout_s} s of real time (stalled at simulated "
                           f"{clock.now:.1f} s, {len(record['wait'])} steps taken).")  # fmt: skip
    if failure:
        raise failure[0]
    return SimulationResult(steps, record["time"], record["tokens"], record["wait"], record["step"],
                            record["staleness"], producer.dropped if producer else 0, record["trained"],
                            record["generation"])  # fmt: skip
