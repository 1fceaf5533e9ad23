"""Asynchronous generation: an `ExperienceMaker` running ahead of training in a thread, bounded by `max_staleness`.

The policy version is the number of optimizer steps taken. The producer samples with its own copy of the policy
(its engine never sees weights that the optimizer is changing) and takes new weights from the trainer's policy
between generation batches, never during one, under the lock the trainer holds for each optimizer step
(`WeightSync`; the version of the weights moves under it too, with the step that changes them).

Generation batch n is trained at version n (one optimizer step per generation batch: see `checks.check_async`).

- The exact schedule (`async_schedule` 'exact', the default for whole batches): batch n is sampled by the weights of
  exactly version `scheduled_version(n)` = max(0, n - max_staleness), raised to a multiple of weight_sync_steps
  where that keeps it before n. The producer waits for the trainer to reach that version; if the trainer has moved
  past it, the weights are where the trainer staged them: before each optimizer step, under the step lock, it
  copies aside the weights of a version that a batch not yet started is scheduled on (`Producer.stage`). Which
  weights sample a batch never depends on timing, so seeded runs end on the same weights (tests/test_async_exact.py).
- The latest schedule ('latest'; always for groups streamed one by one, grpokit.streaming): batch n starts once the
  trainer's version is at least n - max_staleness, with the newest weights then (taken every weight_sync_steps
  versions, or when the copy would be too stale). The trainer checks the bound on every batch it takes and drops
  and counts (`sample/dropped_stale_total`) one that breaks it.

With max_staleness = 0 either schedule is the synchronous loop, bitwise (tests/test_async.py).

π_old: with max_staleness > 0 a batch may be trained on after the policy moved, so the behaviour policy's log-probs
(the engine's, where exact, else a forward of the producer's copy at the sampling version) are its π_old, as in
TRL's asynchronous GRPO; the clip and the TIS/MIS corrections apply around them (`off_policy_correction`
'decoupled': AReaL's proximal policy instead).

Faults: an exception in the producer (an engine, a reward function, a tool) reaches the trainer with its traceback
at the next batch it asks for; a producer that shows no progress (its heartbeat: a batch queued, a wait for the
trainer, an engine call returned, a group started, finished or was abandoned) for `heartbeat_stale_after_s` seconds
stops the run with a message that names the engine call or the tool calls in progress, within twice the heartbeat
of the hang's start. Either way the last checkpoint stays good. A checkpoint records where the *trained* batches end
(the prompt sampler's position and the rollout seeds after the last consumed batch) and, under the exact schedule,
the queued batches sampled by weights older than the checkpoint's (`checkpoint_state`): a resumed run trains them,
then samples on as the unbroken run did, and ends on its weights bitwise. Under the latest schedule a resumed run
samples what was in flight again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from .batch import TrainBatch
from .build import build_engine, samples_in_engine_process
from .checks import streams_groups
from .config import GRPOConfig
from .distributed import ProducerCollectives, collectives_on, gathered_parameters, is_sharded, new_producer_group
from .experience import Experience, ExperienceMaker, logprobs_in_chunks
from .rollout import DecodedRollout, HFEngine, RolloutRunner, rollout_seed
from .rollout.batching import Abandoned, BatchingEngine, EngineClosed
from .rollout.process_engine import ProcessEngine
from .streaming import DaemonPool, GroupTask

logger = logging.getLogger("grpokit")


def scheduled_version(batch: int, max_staleness: int, weight_sync_steps: int = 1) -> int:
    """The policy version whose weights sample generation batch `batch` (trained at version `batch`) under the exact
    schedule: the oldest the bound allows, max(0, batch - max_staleness), raised to the next multiple of
    weight_sync_steps where that is still an earlier version than the batch's own (so a copy is taken every
    weight_sync_steps versions when weight_sync_steps <= max_staleness, and wherever the bound forces one
    otherwise). Non-decreasing in `batch`; it never depends on timing."""
    oldest = max(0, batch - max_staleness)
    synced = -(-oldest // weight_sync_steps) * weight_sync_steps
    return synced if synced < batch else oldest


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
        # Called under the lock just before the weights of version `weights` change: a producer that will still
        # sample with them stages a copy (the exact schedule). And just after (sharded models): the new version's
        # weights gathered, where the schedule samples a batch with them.
        self.before_step = None
        self.after_step = None

    @contextlib.contextmanager
    def step(self):
        """Held around the trainer's optimizer step: the weights change, and their version with them."""
        with self.changed:
            if self.before_step is not None:
                self.before_step(self.weights)
            yield
            self.weights += 1
            if self.after_step is not None:
                self.after_step(self.weights)
            self.changed.notify_all()

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
    rollout_index: int  # its first rollout's index
    sampler_state: dict  # the prompt sampler's position after its prompts were drawn
    produced_at: float  # time.perf_counter() when it was queued
    index: int | None = None  # the batch's number in the run: the version it is trained at (exact schedule)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it (tensors on the CPU): ids, masks, log-probs, advantages, metrics."""
        e = self.experience
        return {
            "batch": e.batch.to("cpu").state_dict(),
            "metrics": e.metrics,
            "samples": e.samples,
            "num_tokens": e.num_tokens,
            "rollouts": e.rollouts,
            "version": self.version,
            "rollout_index": self.rollout_index,
            "sampler_state": self.sampler_state,
            "index": self.index,
        }

    @classmethod
    def from_state_dict(cls, state: dict, device) -> Produced:
        experience = Experience(
            TrainBatch.from_state_dict(state["batch"]).to(device),
            state["metrics"],
            state["samples"],
            state["num_tokens"],
            state["rollouts"],
        )
        return cls(
            experience,
            state["version"],
            state.get("rollout_index", state.get("generation")),  # "generation": an older checkpoint's
            state["sampler_state"],
            time.perf_counter(),
            state["index"],
        )


class Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Producer:
    """The generation scheduler: runs ahead of the trainer in a thread, under one schedule, one weight discipline and
    one drop accounting, with two kinds of task:

    - whole generation batches (`runner` None): one at a time, each sampled and scored by `maker.make` in this
      thread. Batch n (trained at version n) is sampled by the weights of version `scheduled_version(n)` when
      `exact`, else by the newest weights when it starts;
    - groups (`runner` given: multi-turn rollouts whose driver allows several at once, grpokit.streaming): each
      prompt's G rollouts are a task in a pool of daemon threads, up to max_inflight_tasks completions at once, and a
      generation batch is assembled from the first groups to finish (`_queue_batch`). Always the latest weights.

    A unit of the schedule is a batch or a group (units_per_batch of them make a batch). Unit u (counted from the
    producer's start) is trained at version `_due(u)`, at the latest; it starts once the trainer's version is at
    least that minus max_staleness. A dropped unit never shifts the schedule: groups dropped as too stale do not
    count, and batches the trainer dropped shift it earlier. `restored`: batches a checkpoint held (exact
    schedule), queued first; the producer goes on after them. `dataset`: the training rows (groups)."""

    def __init__(
        self,
        args: GRPOConfig,
        maker: ExperienceMaker,
        policy: torch.nn.Module,
        policy_copy: torch.nn.Module,
        sync: WeightSync,
        sampler,
        rollout_index: int,
        trainer_state=None,
        threads: int | None = None,
        engine=None,
        process: ProcessEngine | None = None,
        exact: bool = False,
        restored: list[Produced] = (),
        runner: RolloutRunner | None = None,
        dataset=None,
        group=None,
        sharded: bool = False,
        pool=DaemonPool,
    ):
        self.args, self.maker, self.policy, self.policy_copy, self.sync = args, maker, policy, policy_copy, sync
        self.engine = engine  # what the producer samples with: its lock, if any, is held while weights move
        self.process = process  # the engine's process, if it has one of its own: closed with the producer
        self.sampler, self.trainer_state, self.threads = sampler, trainer_state, threads
        self.rollout_index = rollout_index  # the next rollout's index (its seed: rollout_seed)
        self.first_step = sync.version
        self.exact = exact
        self.group = group  # several processes: the producers' own process group (distributed.ProducerCollectives)
        # A sharded policy (FSDP2, ZeRO-3): the producer never reads its parameters (local shards); the trainer
        # gathers each scheduled version's weights when it reaches it (`gather_scheduled`), the producer copies them
        # from there.
        self.sharded = sharded
        # In the exact schedule a checkpoint waits for the batches sampled by weights it does not hold (up to
        # max_staleness of them): the queue must have room for them.
        batches = max(1, args.queue_maxsize // args.generation_batch_per_process)
        self.queue: queue.Queue = queue.Queue(maxsize=max(batches, args.max_staleness + 1) if exact else batches)
        self.stop = threading.Event()
        self.heartbeat = time.monotonic()
        self.weights_version: int | None = None
        self.next_index = self.first_step  # the first batch whose weights are not taken yet (exact schedule)
        self.queued = self.first_step  # batches queued so far (their indices: below this)
        self.snapshots: dict[int, list[torch.Tensor]] = {}  # versions the trainer staged for the exact schedule
        self.weight_wait = 0.0  # seconds the producer waited for the trainer's version
        self.reported_weight_wait, self.last_taken = 0.0, None
        # The schedule: units started, groups dropped as too stale (they free their place), batches the trainer
        # dropped; samples dropped in all.
        self.started, self.dropped_units, self.dropped_batches, self.dropped = 0, 0, 0, 0
        # The trainer's own engine, driven from this thread too (vLLM, a user's): evaluation leases it (`lease`).
        self.shares_engine = False
        self._lease = threading.Lock()  # held while the producer samples a whole batch
        self.thread = threading.Thread(target=self._run, name="grpokit-producer", daemon=True)
        self.pairs = [
            (mine, theirs)
            for mine, theirs in zip(policy_copy.parameters(), policy.parameters())
            if theirs.requires_grad
        ]  # the frozen ones never change
        self.runner, self.dataset, self.groups = runner, dataset, runner is not None
        self.units_per_batch = args.generation_batch_per_process // args.num_generations if self.groups else 1
        self.hung = False  # the heartbeat ran out (see `_check_alive`)
        if self.groups:
            self._init_groups(pool)
        self._restore(restored)
        if exact and sharded:
            sync.after_step = self.gather_scheduled
            self.gather_scheduled(sync.weights, first=True)  # the weights the first batches are sampled by
        elif exact:
            sync.before_step = self.stage

    def _init_groups(self, pool) -> None:
        """The state of streamed groups: the pool of rollout threads and its bound, the groups running and
        finished, the version the engine holds, and the counts by prompt."""
        args = self.args
        inflight = (
            args.max_inflight_tasks
            if args.max_inflight_tasks > 0
            else max(args.max_staleness, 1) * args.generation_batch_per_process
        )
        self.max_groups = max(1, inflight // args.num_generations)
        self.pool = pool(self.max_groups, "grpokit-rollout")  # grpokit.simulate's runs on its virtual clock
        self.running: dict[concurrent.futures.Future, GroupTask] = {}
        self.finished: list[tuple[GroupTask, DecodedRollout]] = []  # in the order they finished
        self.pushed: int | None = None  # the version of the copy's weights the engine holds (None: not the copy's)
        # By prompt (dataset index): groups started, and dropped as too stale. A prompt whose tools are slow lands
        # late again and again: its drop rate says it is being starved.
        self.started_by_prompt: collections.Counter = collections.Counter()
        self.dropped_by_prompt: collections.Counter = collections.Counter()

    def _restore(self, restored: list[Produced]) -> None:
        """Batches a checkpoint held (exact schedule) queued first; the producer goes on after the last."""
        for item in restored:
            self.queue.put_nowait(item)
        if restored:
            last = restored[-1]
            self.next_index = self.queued = last.index + 1
            self.started = self.next_index - self.first_step
            self.sampler.load_state_dict(last.sampler_state)
            self.rollout_index = last.rollout_index + last.experience.rollouts

    def start(self) -> Producer:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.sync.before_step == self.stage:
            self.sync.before_step = None
        if self.sync.after_step == self.gather_scheduled:
            self.sync.after_step = None
        if self.groups:
            report = self.drop_report()
            if report is not None:
                logger.warning(report)
            self.pool.shutdown()
        self.sync.wake()  # never waits for the step lock: nothing here waits on the engine or the trainer
        while True:  # unblock a put on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        # A batch in progress is not waited for past a few seconds (a hung engine or tool never ends), nor at all once
        # the producer was found hung: the thread is a daemon, and it stops at its next check.
        self.thread.join(timeout=self._close_wait())
        if self.thread.is_alive():
            logger.warning(
                f"The generation producer thread (grpokit-producer) is still in an engine call, a reward "
                f"function or a tool {self._close_wait():g} s after training stopped: it is abandoned as a daemon "
                f"thread, which never keeps the process alive."
            )
        if self.groups:
            self._close_groups()
        if self.process is not None:
            self.process.close()

    def _close_wait(self) -> float:
        """Seconds close() waits for a call in progress to end: a few, or a moment once the producer was found hung
        (the hang is named when the heartbeat runs out: the cleanup must not delay the error by seconds more)."""
        return 0.2 if self.hung else 5.0

    def _close_groups(self) -> None:
        """Groups still running stop at their next engine call (EngineClosed), and the environments they were lent
        go back. The engine's lock is kept once its call in progress ends, so that no thread is inside torch when the
        interpreter exits (a daemon thread in C++ code then aborts the process: "terminate called without an active
        exception"); a call hung for good is not waited for past a few seconds. A rollout inside a tool call ends
        when the call does, in its daemon thread: named in a warning."""
        idle = self.engine.close(timeout=self._close_wait())
        deadline = time.monotonic() + min(1.0, self._close_wait())
        while self.running and time.monotonic() < deadline:
            self.running = {f: t for f, t in self.running.items() if not f.done()}
            time.sleep(0.02)
        if self.running or not idle:
            logger.warning(
                f"Asynchronous generation stopped with {len(self.running)} rollout group(s) still in a "
                f"tool call or environment step{'' if idle else ' and an engine call that did not return'}"
                f": they are abandoned in daemon threads (grpokit-rollout-*), which end when their "
                f"call does and never keep the process alive."
            )

    # ------------------------------------------------------------------------------------------- the schedule

    def _due(self, unit: int) -> int:
        """The version the `unit`-th unit started (a batch or a group) is trained at, at the latest: groups dropped
        before it do not count (a drop must not push later units' versions ahead, which would leave nothing in
        flight), and batches the trainer dropped shift it earlier."""
        return self.first_step + (unit - self.dropped_units) // self.units_per_batch - self.dropped_batches

    def _run(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            with collectives_on(self.group):
                self._run_groups() if self.groups else self._run_batches()
        except BaseException as error:
            self.queue.put(Failure(error))

    def _run_batches(self) -> None:
        while not self.stop.is_set():
            index = self.first_step + self.started  # the batch's number in the run
            if self.exact:
                if not self._take_scheduled_weights(index):
                    return
            else:
                due = self._due(self.started)
                if not self._wait_for_trainer(lambda due=due: self.sync.version >= due - self.args.max_staleness):
                    return
                self._take_weights(due)
            rollout_index = self.rollout_index
            with self._lease:
                experience = self.maker.make(rollout_index, self._state_at(index))
            self.rollout_index += experience.rollouts
            self._put(
                Produced(
                    experience,
                    self.weights_version,
                    rollout_index,
                    self.sampler.state_dict(),
                    time.perf_counter(),
                    index,
                )
            )
            self.started += 1
            self.queued = index + 1

    def _run_groups(self) -> None:
        batches = 0
        while not self.stop.is_set():
            self._start_groups()
            done = self.pool.wait_any(list(self.running), timeout=0.05)
            for future in done:
                task = self.running.pop(future)
                self.finished.append((task, future.result()))  # a rollout's exception stops the producer
            if done:
                self.beat()  # progress only: groups that all hang in a tool call are a hang
            if len(self.finished) >= self.units_per_batch and self._queue_batch(batches):
                batches += 1
            self._abandon_stale_groups(batches)
            # Nothing in flight and no batch to assemble: wait for the trainer's next version. (Polling an empty
            # list of groups returns at once: a loop of Python holding the GIL that the trainer's steps wait for.)
            if (
                not self.running
                and len(self.finished) < self.units_per_batch
                and not self._wait_for_trainer(self._may_start_group)
            ):
                return

    def _abandon_stale_groups(self, batch: int) -> None:
        """Groups running that can no longer be trained within max_staleness (the next batch to queue, `batch`, and
        every later one are trained past their version + max_staleness) are dropped and counted now, and their
        places go to the next groups. Each stops at its next engine or tool call (`Abandoned`) and gives back its
        environments; its tool calls still running are left to their timeout (async ones are cancelled)."""
        trained_at = self.first_step + batch - self.dropped_batches
        for future, task in list(self.running.items()):
            if trained_at - task.version > self.args.max_staleness:
                del self.running[future]
                task.stop.set()
                self._count_dropped(task, self.args.num_generations)
                future.add_done_callback(self._discard_abandoned)
                self.beat()  # a place freed: progress

    def _count_dropped(self, task: GroupTask, samples: int) -> None:
        """A group dropped as too stale: its samples, and its place in the schedule freed (see `_due`)."""
        self.dropped += samples
        self.dropped_units += 1
        self.dropped_by_prompt[task.index] += 1

    def _discard_abandoned(self, future: concurrent.futures.Future) -> None:
        """An abandoned group's rollout ended (in its thread): one that finished before it saw the stop gives back
        its environments here; one that stopped gave them back itself."""
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            self.runner.scored(future.result())
        elif not isinstance(error, (Abandoned, EngineClosed)):
            logger.warning(f"A rollout group abandoned as too stale failed afterwards: {type(error).__name__}: {error}")

    def _may_start_group(self) -> bool:
        """Whether the next group's version is within reach of the trainer's (see `_start_groups`)."""
        return self.sync.version >= self._due(self.started) - self.args.max_staleness

    def _start_groups(self) -> None:
        """Start groups while fewer than max_groups run and the next one's version is within reach."""
        while len(self.running) < self.max_groups and not self.stop.is_set():
            if not self._may_start_group():
                return
            self._take_weights(self._due(self.started))
            if self.pushed != self.weights_version:  # an engine that keeps weights of its own (vLLM, a user's)
                self.runner.sync_weights(self.policy_copy)  # between engine calls (BatchingEngine's lock)
                self.pushed = self.weights_version
            index = self.sampler.draw(1)[0]
            self.started_by_prompt[index] += 1
            task = GroupTask(index, self.rollout_index, self.weights_version)
            self.rollout_index += 1
            seed = rollout_seed(self.args.seed, task.rollout_index, 0)
            size = self.args.num_generations
            future = self.pool.submit(self.runner.run, [self.dataset[index]] * size, [size], seed, task.stop)
            self.running[future] = task
            self.started += 1
            self.beat()

    def _queue_batch(self, batch: int) -> bool:
        """The first groups to finish as generation batch `batch` (groups too stale for it are dropped); False when
        too few fresh ones are left to fill it."""
        trained_at = self.first_step + batch - self.dropped_batches
        taken, kept = self.finished[: self.units_per_batch], []
        self.finished = self.finished[self.units_per_batch :]
        for task, decoded in taken:
            if trained_at - task.version > self.args.max_staleness:
                self._count_dropped(task, len(decoded.rows))
                self.runner.scored(decoded)  # never scored: its environments go back to the pool
            else:
                kept.append((task, decoded))
        if len(kept) < self.units_per_batch:  # wait for fresher groups to fill it
            self.finished = kept + self.finished
            return False
        tasks = [task for task, _ in kept]
        experience = self.maker.make(
            tasks[0].rollout_index, self.trainer_state, sampled=DecodedRollout.concat([d for _, d in kept])
        )
        # Drawn but not in this or an earlier batch: sampled again first after a resume from this batch's checkpoint.
        pending = [t.index for t in self.running.values()] + [t.index for t, _ in self.finished]
        state = {**self.sampler.state_dict(), "requeued": pending + list(self.sampler.requeued)}
        item = Produced(
            experience,
            min(t.version for t in tasks),
            self.rollout_index - experience.rollouts,
            state,
            time.perf_counter(),
        )
        self._put(item)
        return True

    def _state_at(self, index: int):
        """What reward functions get as `trainer_state`: in the exact schedule, the trainer's state as the batch's
        own step will see it (global_step = index), whatever step the trainer is at now."""
        if not self.exact or self.trainer_state is None:
            return self.trainer_state
        state = copy.copy(self.trainer_state)
        state.global_step = index
        return state

    def _put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                self.beat()
                return
            except queue.Full:  # the trainer is behind: keep the heartbeat
                self.beat()

    # -------------------------------------------------------------------------------------------- the weights

    def _wait_for_trainer(self, reached) -> bool:
        """Waits (with the heartbeat) until `reached()` holds under the step lock, counting the wait in weight_wait;
        False when the producer is stopping."""
        started = time.perf_counter()
        with self.sync.changed:
            while not reached() and not self.stop.is_set():
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
            current, copy_version, every = self.sync.weights, self.weights_version, self.args.weight_sync_steps
            scheduled = copy_version is None or current // every > copy_version // every
            needed = (scheduled or due - copy_version > self.args.max_staleness) and current != copy_version
        if needed:
            engine_idle = getattr(self.engine, "lock", None) or contextlib.nullcontext()
            with engine_idle, self.sync.lock:
                for mine, theirs in self.pairs:
                    mine.copy_(theirs)
                self.weights_version = self.sync.weights
            self.beat()

    @torch.no_grad()
    def _take_scheduled_weights(self, index: int) -> bool:
        """The exact schedule: the weights of version scheduled_version(index) into the copy, from the trainer's
        policy if it is at that version, else from the copy the trainer staged before moving past it. Waits (with
        the heartbeat) while the trainer has not reached it. False when the producer is stopping."""
        # Never older than the weights the producer started from: a run resumed from a checkpoint that holds no
        # batches in flight (see checkpoint_state) samples the first ones with the checkpoint's weights.
        version = max(scheduled_version(index, self.args.max_staleness, self.args.weight_sync_steps), self.first_step)
        reached = (
            (lambda: version in self.snapshots or version == self.weights_version)
            if self.sharded
            else (lambda: self.sync.weights >= version)
        )
        if not self._wait_for_trainer(reached):
            return False
        if version != self.weights_version:
            engine_idle = getattr(self.engine, "lock", None) or contextlib.nullcontext()
            with engine_idle:
                with self.sync.lock:
                    staged = self.snapshots.pop(version, None)
                    if staged is None:
                        if self.sync.weights != version:
                            raise RuntimeError(
                                f"internal error: batch {index} is scheduled on the weights of "
                                f"version {version}, which the trainer moved past (now "
                                f"{self.sync.weights}) without staging them."
                            )
                        for mine, theirs in self.pairs:
                            mine.copy_(theirs)
                    self.weights_version, self.next_index = version, index + 1
                    for older in [v for v in self.snapshots if v < version]:
                        del self.snapshots[older]
                if staged is not None:  # outside the step lock: the copy is the producer's alone
                    for (mine, _), saved in zip(self.pairs, staged):
                        mine.copy_(saved)
            self.beat()
        else:
            with self.sync.lock:
                self.next_index = index + 1
        return True

    @torch.no_grad()
    def stage(self, version: int) -> None:
        """WeightSync.before_step, under the step lock: the trainer is about to move past the weights of
        `version`; if a batch not started yet is scheduled on them, they are copied aside for it."""
        if self.stop.is_set() or (self.weights_version is not None and version <= self.weights_version):
            return
        k, every = self.args.max_staleness, self.args.weight_sync_steps
        upcoming = {scheduled_version(b, k, every) for b in range(self.next_index, self.next_index + k + every + 2)}
        if version in upcoming and version not in self.snapshots:
            self.snapshots[version] = [theirs.detach().clone() for _, theirs in self.pairs]

    @torch.no_grad()
    def gather_scheduled(self, version: int, first: bool = False) -> None:
        """WeightSync.after_step for a sharded policy (FSDP2, ZeRO-3), under the step lock, on every process at the same
        step: if a batch is scheduled on the weights of `version` (they just came out of the optimizer step, or the
        producer starts on them), they are gathered whole (a collective of the trainer's thread) and kept for the
        producer. The decision depends on the schedule alone, never on where the producer is, so every process
        takes part in the same gathers."""
        k, every = self.args.max_staleness, self.args.weight_sync_steps
        # The producer's first version: batches scheduled before it are sampled by it (`_take_scheduled_weights`).
        scheduled = first or version in {
            scheduled_version(b, k, every) for b in range(version, version + k + every + 2)
        }
        if scheduled:
            self.snapshots[version] = gathered_parameters([theirs for _, theirs in self.pairs])

    def lease(self):
        """The engine, for the trainer's evaluation: while held, the producer does not sample with it. Whole batches:
        the batch in progress ends first, and the producer pushes its own weights again before its next batch.
        Groups: the engine between calls (BatchingEngine's lock); on the way out the copy's weights go back into it
        before any waiting request is served."""
        return self._lease_groups() if self.groups else self._lease

    @contextlib.contextmanager
    def _lease_groups(self):
        with self.engine.lock:
            try:
                yield
            finally:
                if self.pushed is not None:
                    self.engine.engine.sync_weights(self.policy_copy)

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
            if self.exact and item.index != version:
                raise RuntimeError(f"internal error: the trainer at step {version} got generation batch {item.index}.")
            if staleness <= self.args.max_staleness:
                break
            self.dropped += len(item.experience.batch)
            self.dropped_batches += 1
        now = time.perf_counter()
        elapsed = max(now - (self.last_taken or started), 1e-9)
        weight_wait, self.reported_weight_wait = self.weight_wait - self.reported_weight_wait, self.weight_wait
        self.last_taken = now
        metrics = {
            "sample/staleness_mean": staleness,
            "sample/staleness_max": staleness,
            "sample/dropped_stale_total": self.dropped,
            "sample/rollout_queue_size": self.queue.qsize(),
            "sample/groups_in_flight": self.in_flight(),
            "sample/time_in_queue_s": now - item.produced_at,
            "perf/rollout_wait_s": now - started,
            "perf/rollout_wait_fraction": min((now - started) / elapsed, 1.0),
            "perf/weight_wait_fraction": min(weight_wait / elapsed, 1.0),
        }
        if self.groups:  # drops by prompt: a prompt whose groups keep landing late is being starved
            rates = [n / self.started_by_prompt[i] for i, n in self.dropped_by_prompt.items()]
            metrics.update(
                {"sample/prompts_dropped": len(rates), "sample/prompt_drop_rate_max": max(rates, default=0.0)}
            )
        return item, metrics

    def checkpoint_state(self, version: int) -> list[dict] | None:
        """For a checkpoint at `version` (the trainer's step): the queued batches sampled by weights older than
        `version`, which a resumed run could not sample again — waited for first (with the heartbeat: they need no
        newer weights). None where the schedule is not exact: a resumed run samples what was in flight again."""
        if not self.exact:
            return None
        k, every = self.args.max_staleness, self.args.weight_sync_steps
        end = version  # the batches version..end-1 are scheduled on weights older than version
        while scheduled_version(end, k, every) < version:
            end += 1
        while self.queued < end:
            self._check_alive(waiting_for=f"the batches a checkpoint at step {version} holds")
            time.sleep(0.01)
        with self.queue.mutex:
            items = [item for item in self.queue.queue if isinstance(item, Produced)]
        return [item.state_dict() for item in items if item.index < end]

    def in_flight(self) -> int:
        """Groups being sampled now (whole batches count none)."""
        return len(self.running) if self.groups else 0

    def drop_report(self, most: int = 5) -> str | None:
        """The prompts whose groups were dropped most often as too stale, with how often: None if none was."""
        if not self.groups or not self.dropped_by_prompt:
            return None
        worst = sorted(self.dropped_by_prompt.items(), key=lambda item: (-item[1], item[0]))[:most]
        shown = ", ".join(f"row {i}: {n} of {self.started_by_prompt[i]}" for i, n in worst)
        return (
            f"{len(self.dropped_by_prompt)} prompt(s) had groups dropped as too stale (they finished after "
            f"max_staleness={self.args.max_staleness} steps), most often {shown}. Slow tools or environments "
            f"starve these prompts: raise max_staleness, or make their calls faster."
        )

    def next(self) -> Produced:
        """The next queued batch; raises what the producer raised, or a timeout after heartbeat_stale_after_s
        seconds without a sign of life."""
        while True:
            try:  # a hang is named within the heartbeat plus a quarter of it (at most a second) of its start
                item = self.queue.get(timeout=min(1.0, self.args.heartbeat_stale_after_s / 4))
            except queue.Empty:
                self._check_alive(waiting_for="a generation batch")
                continue
            if isinstance(item, Failure):
                raise self._failed(item)
            return item

    def _check_alive(self, waiting_for: str) -> None:
        """Raises when the producer failed, stopped, or shows no progress for heartbeat_stale_after_s."""
        with self.queue.mutex:
            failure = next((item for item in self.queue.queue if isinstance(item, Failure)), None)
        if failure is not None:
            raise self._failed(failure)
        if not self.thread.is_alive():
            raise RuntimeError(
                f"The generation producer thread stopped without a result while the trainer waited "
                f"for {waiting_for}: the run cannot go on; resume from the last checkpoint."
            )
        silent = time.monotonic() - self.last_progress()
        if silent > self.args.heartbeat_stale_after_s:
            self.hung = True  # close() then waits for nothing that is hung
            raise TimeoutError(
                f"The generation producer has shown no progress for {silent:.0f} s (heartbeat_stale_after_s="
                f"{self.args.heartbeat_stale_after_s}): hung in {self._hung_calls()}. The last checkpoint "
                f"is good: resume from it (in-flight samples are sampled again)."
            )

    def _hung_calls(self) -> str:
        """What the producer waits on, named where it is known: the engine call in progress, the tool calls that
        rollouts wait for (oldest first); else the kinds of call that can hang."""
        named = []
        since = getattr(self.engine, "busy_since", None)
        if since is not None:
            named.append(f"an engine call (running for {time.monotonic() - since:.1f} s)")
        driver = self.maker.runner.driver if self.maker is not None else None
        in_progress = getattr(driver, "calls_in_progress", None)
        calls = in_progress() if in_progress is not None else []
        if calls:
            shown = ", ".join(f"{name!r} (running for {seconds:.1f} s)" for name, seconds in calls[:3])
            more = f" and {len(calls) - 3} more" if len(calls) > 3 else ""
            named.append(f"{'a tool call' if len(calls) == 1 else f'{len(calls)} tool calls'}: {shown}{more}")
        return " and ".join(named) if named else "a rollout, a reward function or a tool"

    def _failed(self, item: Failure) -> RuntimeError:
        if self.group is not None and isinstance(item.error, RuntimeError) and "gloo" in str(item.error):
            # The producers' gathers broke because another process went away: its own error is the cause.
            error = RuntimeError(
                f"The generation producer lost the other training processes' producers "
                f"({item.error}): another process stopped, and its error above is the cause. The "
                f"last checkpoint is good: fix the cause and resume from it."
            )
            error.__cause__ = item.error
            return error
        error = RuntimeError(
            f"The generation producer failed: {type(item.error).__name__}: {item.error}. The last "
            f"checkpoint is good: fix the cause and resume from it."
        )
        error.__cause__ = item.error
        return error


def start_producer(
    args: GRPOConfig,
    accelerator,
    policy: torch.nn.Module,
    experience: ExperienceMaker,
    sampler,
    dataset,
    sync: WeightSync,
    trainer_state,
    processing_class,
    restored: list[dict] = (),
    unwrapped_copy: torch.nn.Module | None = None,
) -> Producer:
    """A producer over a copy of `policy`, drawing prompts of `dataset` from a copy of `sampler` (the trainer's
    stays at the trained position), at the trainer's step (`sync`'s version). `experience` is the trainer's maker:
    the producer's samples with its runner's codec, sampling parameters and multi-turn driver, scores with a fresh
    copy of its scorer, with its reference and teacher. The default in-process engine gets an engine of its own over
    the copy; a given engine (vLLM, yours) is driven from the producer's thread and synced with the copy.
    `restored`: the state dicts of the batches in flight that a checkpoint held."""
    sync.version = sync.weights = trainer_state.global_step
    restored = [Produced.from_state_dict(state, accelerator.device) for state in restored]
    runner, scorer = experience.runner, experience.scorer.fresh()
    # Under FSDP2 or DeepSpeed the copy was taken before they wrapped the policy (`unwrapped_copy`: whole, without
    # their hooks); a sharded policy's weights come gathered.
    sharded = is_sharded(policy)
    if sharded and unwrapped_copy is None:
        raise RuntimeError("internal error: a sharded policy's producer needs the copy taken before sharding.")
    policy_copy = unwrapped_copy if unwrapped_copy is not None else copy.deepcopy(policy)
    streaming = streams_groups(args, runner, accelerator.num_processes)
    if streaming and sharded:
        raise NotImplementedError(
            "Multi-turn rollouts streamed group by group (max_staleness) with a sharded model "
            "(FSDP2, ZeRO-3) in one process: streamed groups take the newest weights at any time, "
            "which a sharded model gives only in a collective. Use DDP, or max_staleness=None."
        )
    engine, process, shared = producer_engine(
        args, accelerator, runner.engine, policy_copy, processing_class, streaming
    )
    exact = not streaming and args.async_schedule != "latest"
    own_runner = RolloutRunner(
        engine, runner.codec, runner.params, runner.device, driver=runner.driver, host=runner.host
    )
    own_sampler = copy.deepcopy(sampler)
    group = new_producer_group() if accelerator.num_processes > 1 else None
    if group is not None:
        accelerator = ProducerCollectives(accelerator, group)
    maker = ExperienceMaker(
        args,
        accelerator,
        own_runner,
        scorer,
        lambda: policy_copy,
        experience.reference,
        lambda n: own_sampler.rows(dataset, n),
        off_policy=args.max_staleness > 0,
        teacher=experience.teacher,
        trim_heap=process is None,
    )
    producer = Producer(
        args,
        maker,
        policy,
        policy_copy,
        sync,
        own_sampler,
        trainer_state.rollouts,
        trainer_state,
        threads=torch.get_num_threads(),
        engine=engine,
        process=process,
        exact=exact,
        restored=restored,
        runner=own_runner if streaming else None,
        dataset=dataset,
        group=group,
        sharded=sharded,
    )
    producer.shares_engine = shared
    maker.weights_version = lambda: producer.weights_version  # the served-policy check names the push it checks
    return producer.start()


def producer_engine(args: GRPOConfig, accelerator, engine, policy_copy, processing_class, streaming: bool):
    """What the producer samples with: (the engine, its process if it has one of its own, whether it is the
    trainer's own engine). The default in-process engine becomes one of the producer's over the copy (on the CPU, in
    a process of its own when it may run ahead: at max_staleness=0 it never overlaps training); streamed groups go
    through a BatchingEngine, so the turns that groups in flight ask for at once go into one engine call."""
    process = None
    if isinstance(engine, HFEngine):
        engine = build_engine(policy_copy, args, processing_class, accelerator)
        if samples_in_engine_process(args, accelerator.device, engine):
            engine = process = ProcessEngine(engine, policy_copy, request_timeout_s=args.heartbeat_stale_after_s)
    shared = not isinstance(engine, HFEngine)  # the trainer's engine itself: evaluation samples with it too
    if streaming:

        def behaviour(rollout):  # π_old of a turn from an engine that reports no log-probs: the copy's, at once
            return logprobs_in_chunks(
                policy_copy,
                TrainBatch.from_rollout(rollout, torch.zeros(len(rollout.lengths))),
                args,
                accelerator.autocast,
            )

        engine = BatchingEngine(engine, behaviour)
    return engine, process, shared
