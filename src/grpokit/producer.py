"""Asynchronous generation: an `ExperienceMaker` running ahead of training in a thread, bounded by `max_staleness`.

The policy version is the number of optimizer steps taken. The producer samples with its own copy of the policy
(its engine never sees weights that the optimizer is changing) and takes new weights from the trainer's policy
between generation batches, never during one, under the lock the trainer holds for each optimizer step
(`WeightSync`). With `weight_sync_steps = s` it takes them only at versions that are multiples of s.

Generation batch n is trained on at version c(n) (one optimizer step per generation batch: see `check_async`). The
producer starts it once the trainer's version is at least c(n) - max_staleness, with the weights it took last unless
they are older than c(n) - max_staleness (then it takes the current ones, whatever weight_sync_steps says): so a
sample of version v is trained on at version <= v + max_staleness. The trainer checks that bound on every batch it
takes, and drops and counts (`sample/dropped_stale_total`) a batch that breaks it — a safety net that the schedule
above does not reach. With max_staleness = 0 the producer waits for the current version, which makes the run the
synchronous loop, bitwise (tests/test_async.py).

π_old: with max_staleness > 0 a batch may be trained on after the policy moved, so the behaviour policy's log-probs
(the engine's, where exact, else a forward of the producer's copy at the sampling version) are its π_old, as in
TRL's asynchronous GRPO; the clip and the TIS/MIS corrections apply around them. (AReaL's decoupled PPO clips around
a proximal policy recomputed at the training weights instead; grpokit does not.)

Faults: an exception in the producer (an engine, a reward function, a tool) reaches the trainer with its traceback
at the next batch it asks for; a producer that shows no progress (its heartbeat: a batch queued, a wait for the
trainer, an engine call returned, a group started or finished) for `heartbeat_stale_after_s` seconds stops the run
with a message. Either way the last checkpoint stays good: a
checkpoint records where the *trained* batches end (the prompt sampler's position and the rollout seeds after the
last consumed batch), so a resumed run drops what was in flight and samples it again.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .build import build_engine
from .config import GRPOConfig
from .experience import Experience, ExperienceMaker
from .rollout import HFEngine, RolloutRunner
from .rollout.batching import BatchingEngine
from .rollout.process_engine import ProcessEngine


def check_async(args: GRPOConfig, num_processes: int, iterable_dataset: bool, deepspeed: bool = False) -> None:
    """What asynchronous generation supports today, refused by name otherwise."""
    if args.max_staleness is None:
        return
    if deepspeed:
        raise NotImplementedError("max_staleness (asynchronous generation) does not run under DeepSpeed yet, even in "
                                  "one process: DeepSpeed's optimizer step runs inside backward(), outside the lock "
                                  "that keeps the producer from copying half-updated weights, and under ZeRO-3 the "
                                  "producer's copy would hold partitioned, empty parameters. Set max_staleness=None "
                                  "with DeepSpeed, or train without DeepSpeed.")  # fmt: skip
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        raise NotImplementedError(
            f"max_staleness (asynchronous generation) needs one optimizer step per generation batch: "
            f"num_iterations=1 and steps_per_generation == gradient_accumulation_steps (got num_iterations="
            f"{args.num_iterations}, steps_per_generation={args.steps_per_generation}, gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}), as in TRL's AsyncGRPOTrainer. Reuse of samples (μ > 1) is "
            f"off-policy by itself; set max_staleness=None for it.")  # fmt: skip
    if num_processes > 1:
        raise NotImplementedError("max_staleness (asynchronous generation) runs in one training process for now: "
                                  "the producer's gathers would interleave with the training collectives. Set "
                                  "max_staleness=None under DDP / FSDP2 / DeepSpeed.")  # fmt: skip
    if iterable_dataset:
        raise NotImplementedError("max_staleness with an IterableDataset is not supported yet: the producer draws "
                                  "prompts from a copy of the sampler, which a stream cannot give. Use a map-style "
                                  "dataset, or max_staleness=None.")  # fmt: skip
    if args.sync_ref_model and args.max_staleness > 0:
        raise NotImplementedError("max_staleness > 0 with sync_ref_model: the producer's reference forwards would run "
                                  "while the trainer mixes the policy into the reference. Set one of them off.")
    if args.dynamic_sampling:
        raise NotImplementedError("max_staleness with dynamic_sampling is not supported yet: set one of them off.")


class WeightSync:
    """The trainer's policy version (optimizer steps) and the lock that keeps the producer from copying weights while
    an optimizer step changes them.

    Two counts: `weights`, the version of the weights as they are (bumped under the lock, with the optimizer step
    that changes them: a copy is labelled with it), and `version`, the step the trainer has finished (bumped by
    `stepped()` after the step's bookkeeping and callbacks: the schedule waits on it)."""

    def __init__(self, version: int = 0):
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.version = self.weights = version

    @contextlib.contextmanager
    def step(self):
        """Held around the trainer's optimizer step: the weights change, and their version with them."""
        with self.lock:
            yield
            self.weights += 1

    def stepped(self) -> None:
        """Called by the trainer once a step's bookkeeping is done: the producer may schedule against it."""
        with self.changed:
            self.version = self.weights
            self.changed.notify_all()

    def wake(self) -> None:
        """Wakes waiters (a producer closing) without waiting for a lock held elsewhere: they wake on their own
        within half a second otherwise."""
        if self.lock.acquire(timeout=0.1):
            try:
                self.changed.notify_all()
            finally:
                self.lock.release()


@dataclass
class Produced:
    """One generation batch as it leaves the producer."""

    experience: Experience
    version: int  # the policy version whose weights sampled it
    generation: int  # its first rollout seed
    sampler_state: dict  # the prompt sampler's position after its prompts were drawn
    produced_at: float  # time.perf_counter() when it was queued


class Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Producer:
    """Runs `maker` in a thread: batch n starts once the trainer's version is >= first_step + n - max_staleness, with
    the trainer's weights copied into `copy` (every weight_sync_steps versions)."""

    def __init__(self, args: GRPOConfig, maker: ExperienceMaker, policy: torch.nn.Module, copy: torch.nn.Module,
                 sync: WeightSync, sampler, generation: int, trainer_state=None,
                 threads: int | None = None, engine=None, process: ProcessEngine | None = None):  # fmt: skip
        self.args, self.maker, self.policy, self.copy, self.sync = args, maker, policy, copy, sync
        self.engine = engine  # what the producer samples with: its lock, if any, is held while weights move
        self.process = process  # the engine's process, if it has one of its own: closed with the producer
        self.sampler, self.generation, self.trainer_state, self.threads = sampler, generation, trainer_state, threads
        self.first_step = sync.version
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, args.queue_maxsize // args.generation_batch_size))
        self.stop = threading.Event()
        self.heartbeat = time.monotonic()
        self.weights_version: int | None = None
        self.weight_wait = 0.0  # seconds the producer waited for the trainer's version
        self.reported_weight_wait, self.last_taken = 0.0, None
        self.dropped, self.dropped_batches = 0, 0  # samples, batches the trainer found too stale
        # The trainer's own engine, driven from this thread too (vLLM, a user's): evaluation leases it (`lease`).
        self.shares_engine = False
        self._lease = threading.Lock()  # held while the producer samples a batch
        self.thread = threading.Thread(target=self._run, name="grpokit-producer", daemon=True)
        self.pairs = [(mine, theirs) for mine, theirs in zip(copy.parameters(), policy.parameters())
                      if theirs.requires_grad]  # the frozen ones never change  # fmt: skip

    def start(self) -> "Producer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.sync.wake()  # never waits for the step lock: nothing here waits on the engine or the trainer
        while True:  # unblock a put on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        # A batch in progress is not waited for past a few seconds (a hung engine or tool never ends): the thread is
        # a daemon, and it stops at its next check.
        self.thread.join(timeout=5)
        if self.process is not None:
            self.process.close()

    # ------------------------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            index = 0
            while not self.stop.is_set():
                # The version this batch will be trained at, at the latest (earlier if a batch before it is dropped)
                due = self.first_step + index - self.dropped_batches
                if not self._wait_for_version(due - self.args.max_staleness):
                    return
                self._take_weights(due)
                generation = self.generation
                with self._lease:
                    experience = self.maker.make(generation, self.trainer_state)
                self.generation += experience.rollouts
                self._put(Produced(experience, self.weights_version, generation, self.sampler.state_dict(),
                                   time.perf_counter()))  # fmt: skip
                index += 1
        except BaseException as error:  # noqa: BLE001 - the trainer re-raises it with its traceback
            self.queue.put(Failure(error))

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                self.beat()
                return
            except queue.Full:  # the trainer is behind: keep the heartbeat
                self.beat()

    def _wait_for_version(self, needed: int) -> bool:
        started = time.perf_counter()
        with self.sync.changed:
            while self.sync.version < needed and not self.stop.is_set():
                self.sync.changed.wait(timeout=0.5)
                self.beat()  # waiting for the trainer is not a hang
        self.weight_wait += time.perf_counter() - started
        return not self.stop.is_set()

    @torch.no_grad()
    def _take_weights(self, due: int) -> None:
        """The trainer's current weights into the copy: the first time, every weight_sync_steps versions, and
        whenever the copy's weights would be too stale for a batch trained at version `due`. Whether a copy is needed
        is decided under the step lock, without waiting for anything; the copy itself waits for the engine to be idle
        first (an engine shared by rollouts at once, ProcessEngine or BatchingEngine, takes weights between requests)
        and only then takes the step lock, so a hung engine call never holds the trainer's optimizer step."""
        with self.sync.lock:
            current, copied, every = self.sync.weights, self.weights_version, self.args.weight_sync_steps
            scheduled = copied is None or current // every > copied // every
            needed = (scheduled or due - copied > self.args.max_staleness) and current != copied
        if needed:
            engine_idle = getattr(self.engine, "lock", None) or contextlib.nullcontext()
            with engine_idle, self.sync.lock:
                for mine, theirs in self.pairs:
                    mine.copy_(theirs)
                self.weights_version = self.sync.weights
            self.beat()

    def lease(self):
        """The engine, for the trainer's evaluation: while held, the producer does not sample with it (it waits for
        the batch or engine call in progress first). The producer pushes its own weights again before it samples
        next (the engine then holds the trained ones)."""
        return self._lease

    def beat(self) -> None:
        """A sign of progress (see `next`)."""
        self.heartbeat = time.monotonic()

    def last_progress(self) -> float:
        """When the producer last made progress: its own beats, or an engine call that returned."""
        return max(self.heartbeat, getattr(self.engine, "returned_at", 0.0))

    # ------------------------------------------------------------------------------------------ the trainer

    def take(self, version: int) -> tuple[Produced, dict[str, float]]:
        """The next batch that is fresh enough to train on at `version`, and the metrics of taking it (TRL's
        names: sample/..., perf/rollout_wait_s; grpokit's fractions of the time since the last batch that the trainer
        waited for samples and the producer for the trainer's version)."""
        started = time.perf_counter()
        while True:
            item = self.next()
            staleness = version - item.version
            if staleness <= self.args.max_staleness:
                break
            self.dropped += len(item.experience.batch)
            self.dropped_batches += 1
        now = time.perf_counter()
        elapsed = max(now - (self.last_taken or started), 1e-9)
        weight_wait, self.reported_weight_wait = self.weight_wait - self.reported_weight_wait, self.weight_wait
        self.last_taken = now
        metrics = {"sample/staleness_mean": staleness, "sample/staleness_max": staleness,
                   "sample/dropped_stale_total": self.dropped, "sample/rollout_queue_size": self.queue.qsize(),
                   "sample/groups_in_flight": self.in_flight(),
                   "sample/time_in_queue_s": now - item.produced_at, "perf/rollout_wait_s": now - started,
                   "perf/rollout_wait_fraction": min((now - started) / elapsed, 1.0),
                   "perf/weight_wait_fraction": min(weight_wait / elapsed, 1.0)}  # fmt: skip
        return item, metrics

    def in_flight(self) -> int:
        """Groups being sampled now (streamed groups; whole batches count none)."""
        return 0

    def next(self) -> Produced:
        """The next queued batch; raises what the producer raised, or a timeout after heartbeat_stale_after_s
        seconds without a sign of life."""
        while True:
            try:
                item = self.queue.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError("The generation producer thread stopped without a result: the run cannot go "
                                       "on; resume from the last checkpoint.") from None  # fmt: skip
                silent = time.monotonic() - self.last_progress()
                if silent > self.args.heartbeat_stale_after_s:
                    raise TimeoutError(
                        f"The generation producer has shown no progress for {silent:.0f} s (heartbeat_stale_after_s="
                        f"{self.args.heartbeat_stale_after_s}): a rollout, a reward function or a tool is hung. The "
                        f"last checkpoint is good: resume from it (in-flight samples are sampled again).")
                continue
            if isinstance(item, Failure):
                raise RuntimeError(f"The generation producer failed: {type(item.error).__name__}: {item.error}. The "
                                   f"last checkpoint is good: fix the cause and resume from it.") from item.error
            return item


def start_producer(args: GRPOConfig, accelerator, policy: torch.nn.Module, engine, runner: RolloutRunner, scorer,
                   reference, sampler, dataset, sync: WeightSync, trainer_state, processing_class,
                   host=None, teacher=None) -> Producer:  # fmt: skip
    """A producer over a copy of `policy`, drawing prompts of `dataset` from a copy of `sampler` (the trainer's
    stays at the trained position). The default in-process engine gets an engine of its own over the copy; a given
    engine (vLLM, yours) is driven from the producer's thread and synced with the copy. `runner` is the trainer's:
    the producer's samples with its codec, sampling parameters and multi-turn driver."""
    copied, process = copy.deepcopy(policy), None
    if isinstance(engine, HFEngine):  # an engine of its own over the copy
        engine = build_engine(copied, args, processing_class, accelerator)
        # On the CPU, in a process of its own when it may run ahead (at max_staleness=0 it never overlaps training).
        if accelerator.device.type == "cpu" and args.max_staleness > 0:
            engine = process = ProcessEngine(engine, copied)
    shared = not isinstance(engine, HFEngine)  # the trainer's engine itself: evaluation samples with it too
    streaming = args.max_staleness > 0 and getattr(runner.driver, "concurrent_rollouts", False)
    if streaming:  # the turns that groups in flight ask for at once go into one engine call
        engine = BatchingEngine(engine)
    own_runner = RolloutRunner(engine, runner.codec, runner.params, runner.device, driver=runner.driver, host=host)
    own_sampler = copy.deepcopy(sampler)
    maker = ExperienceMaker(args, accelerator, own_runner, scorer, lambda: copied, reference,
                            lambda n: own_sampler.rows(dataset, n), off_policy=args.max_staleness > 0,
                            teacher=teacher, trim_heap=process is None)  # fmt: skip
    if streaming:  # multi-turn rollouts, group by group (grpokit.streaming)
        from .streaming import StreamingProducer

        producer = StreamingProducer(args, maker, policy, copied, sync, own_sampler, trainer_state.generations,
                                     trainer_state, threads=torch.get_num_threads(), engine=engine, process=process,
                                     runner=own_runner, dataset=dataset)  # fmt: skip
    else:
        producer = Producer(args, maker, policy, copied, sync, own_sampler, trainer_state.generations, trainer_state,
                            threads=torch.get_num_threads(), engine=engine, process=process)  # fmt: skip
    producer.shares_engine = shared
    return producer.start()
