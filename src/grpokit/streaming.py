"""Multi-turn rollouts streamed group by group: the asynchronous producer for agents (tools, environments of other
libraries), where a rollout waits on tool calls as much as on the engine.

Each prompt's group of G rollouts is a task of its own, run in a thread pool (`Agents.rollout` on G rows): up to
`max_inflight_tasks` completions are in generation at once, so while one group waits for a slow tool call the engine
samples the turns of others; the turns that groups ask for at once go into one engine call
(`rollout.batching.BatchingEngine`). A generation batch is assembled from the first groups to finish, in the order
they finish: a slow tool call delays its own group, not the batch. Rewards, advantages and π_old/π_ref are computed
when the batch is assembled (`ExperienceMaker.make(sampled=...)`; scale_rewards="batch" sees the whole batch); π_old
is not: it is each token's log-prob recorded when it was sampled (see below).

Staleness is kept as by `Producer`'s latest schedule (streamed groups cannot follow the exact one: which groups
share an engine call, under one seed, and which weights sample a group's later turns depend on when tools
return): group g belongs nominally to batch b = g // (groups per batch), trained at
version c(b) = first_step + b; it starts only once the trainer's version is at least c(b) - max_staleness, with
weights no older than that. A group that finishes so late that the batch it lands in is trained past its version +
max_staleness is dropped and counted (`sample/dropped_stale_total`, and by prompt: `sample/prompts_dropped`,
`sample/prompt_drop_rate_max`, and a warning naming the most-dropped prompts when generation stops). Weights move
between engine calls: a group's later turns may be sampled by newer weights than its first; its version is the one
it started with (the oldest), and every token's π_old is the log-prob it was sampled with, recorded in the engine
call (the engine's, or BatchingEngine's forward of the sampling weights for an engine that reports none).

Shutdown: `close` closes the batching engine: groups in flight stop at their next engine call (EngineClosed) and
give back the environments they were lent; one inside a tool call ends when the call does, in a daemon thread.

Resume: a checkpoint records the prompt sampler's position after the latest draw and, as `requeued`, the prompts of
the groups drawn but not yet trained (in flight, or finished and waiting for a batch): a resumed run samples those
first. Their completions are sampled again, with new seeds; nothing drawn is skipped.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from .producer import Failure, Produced, Producer

logger = logging.getLogger("grpokit")
from .rollout import Generation, rollout_seed


@dataclass
class GroupTask:
    index: int  # the prompt's dataset index
    generation: int  # its rollout seed's generation number
    version: int  # the weights' version when it started


class DaemonPool:
    """`workers` daemon threads running submitted calls, each with its future. concurrent.futures' pool joins its
    threads at interpreter exit, so one rollout still waiting on a tool call when training ends kept the process
    alive for the tool's whole timeout; a daemon thread never holds up exit. `shutdown` cancels what has not
    started and lets idle threads end."""

    def __init__(self, workers: int, name: str):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.workers = workers
        for number in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{number}", daemon=True).start()

    def submit(self, function, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.tasks.put((future, function, args))
        return future

    def shutdown(self) -> None:
        while True:
            try:
                item = self.tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(self.workers):
            self.tasks.put(None)

    def _work(self) -> None:
        while (item := self.tasks.get()) is not None:
            future, function, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 - the producer raises it from future.result()
                future.set_exception(error)


class StreamingProducer(Producer):
    """`Producer` for multi-turn rollouts: groups in a thread pool, batches assembled as groups finish (see the
    module docstring). `runner` is the producer's own `RolloutRunner`; `dataset` the training rows."""

    def __init__(self, *args, runner, dataset, **kwargs):
        super().__init__(*args, **kwargs)
        self.runner, self.dataset = runner, dataset
        config = self.args
        self.group_size = config.num_generations
        self.groups_per_batch = config.generation_batch_size // config.num_generations
        inflight = config.max_inflight_tasks if config.max_inflight_tasks > 0 else \
            max(config.max_staleness, 1) * config.generation_batch_size  # fmt: skip
        self.max_groups = max(1, inflight // config.num_generations)
        self.pool = DaemonPool(self.max_groups, "grpokit-rollout")
        self.running: dict[concurrent.futures.Future, GroupTask] = {}
        self.finished: list[tuple[GroupTask, Generation]] = []  # in the order they finished
        self.started = 0  # groups started
        self.pushed: int | None = None  # the version of the copy's weights the engine holds (None: not the copy's)
        self.dropped_groups = 0  # started groups dropped as too stale: they free their place in the schedule
        # By prompt (dataset index): groups started, and dropped as too stale. A prompt whose tools are slow lands
        # late again and again: its drop rate says it is being starved.
        self.started_by_prompt: collections.Counter = collections.Counter()
        self.dropped_by_prompt: collections.Counter = collections.Counter()

    def close(self) -> None:
        report = self.drop_report()
        if report is not None:
            logger.warning(report)
        self.pool.shutdown()
        super().close()
        # Rollouts still running stop at their next engine call (EngineClosed), and the environments they were
        # lent go back. The engine's lock is kept once its call in progress ends, so that no thread is inside torch
        # when the interpreter exits (a daemon thread in C++ code then aborts the process: "terminate called
        # without an active exception"). A call hung for good is not waited for past a few seconds.
        idle = self.engine.close(timeout=5)
        # A rollout inside a tool call ends when the call does: it is a daemon thread, named here.
        deadline = time.monotonic() + 1.0
        while self.running and time.monotonic() < deadline:
            self.running = {f: t for f, t in self.running.items() if not f.done()}
            time.sleep(0.02)
        if self.running or not idle:
            logger.warning(f"Asynchronous generation stopped with {len(self.running)} rollout group(s) still in a "
                           f"tool call or environment step{'' if idle else ' and an engine call that did not return'}"
                           f": they are abandoned in daemon threads (grpokit-rollout-*), which end when their "
                           f"call does and never keep the process alive.")  # fmt: skip

    def _run(self) -> None:
        try:
            batches = 0
            while not self.stop.is_set():
                self._start_groups()
                done, _ = concurrent.futures.wait(list(self.running), timeout=0.05,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)  # fmt: skip
                for future in done:
                    task = self.running.pop(future)
                    self.finished.append((task, future.result()))  # a rollout's exception stops the producer
                if done:
                    self.beat()  # progress only: groups that all hang in a tool call are a hang
                if len(self.finished) >= self.groups_per_batch and self._queue_batch(batches):
                    batches += 1
        except BaseException as error:  # noqa: BLE001 - the trainer re-raises it with its traceback
            self.queue.put(Failure(error))

    def _due(self, group: int) -> int:
        """The version the `group`-th group started is trained at, nominally: groups dropped before it do not count
        (a drop must not push later groups' versions ahead, which would leave nothing in flight), and batches the
        trainer dropped shift it earlier."""
        return self.first_step + (group - self.dropped_groups) // self.groups_per_batch - self.dropped_batches

    def in_flight(self) -> int:
        return len(self.running)

    def take(self, version: int) -> tuple[Produced, dict[str, float]]:
        item, metrics = super().take(version)
        rates = [n / self.started_by_prompt[i] for i, n in self.dropped_by_prompt.items()]
        metrics.update({"sample/prompts_dropped": len(rates), "sample/prompt_drop_rate_max": max(rates, default=0.0)})
        return item, metrics

    def drop_report(self, most: int = 5) -> str | None:
        """The prompts dropped most often as too stale, with how often: None if none was."""
        if not self.dropped_by_prompt:
            return None
        worst = sorted(self.dropped_by_prompt.items(), key=lambda item: (-item[1], item[0]))[:most]
        shown = ", ".join(f"row {i}: {n} of {self.started_by_prompt[i]}" for i, n in worst)
        return (f"{len(self.dropped_by_prompt)} prompt(s) had groups dropped as too stale (they finished after "
                f"max_staleness={self.args.max_staleness} steps), most often {shown}. Slow tools or environments "
                f"starve these prompts: raise max_staleness, or make their calls faster.")  # fmt: skip

    @contextlib.contextmanager
    def lease(self):
        """The engine between calls, for the trainer's evaluation (BatchingEngine's lock); on the way out the copy's
        weights go back into it before any waiting request is served."""
        with self.engine.lock:
            try:
                yield
            finally:
                if self.pushed is not None:
                    self.engine.engine.sync_weights(self.copy)

    def _start_groups(self) -> None:
        """Start groups while fewer than max_groups run and the next one's version is within reach."""
        while len(self.running) < self.max_groups and not self.stop.is_set():
            due = self._due(self.started)
            if self.sync.version < due - self.args.max_staleness:
                return
            self._take_weights(due)
            if self.pushed != self.weights_version:  # an engine that keeps weights of its own (vLLM, a user's)
                self.runner.sync_weights(self.copy)  # between engine calls (BatchingEngine's lock)
                self.pushed = self.weights_version
            index = self.sampler.draw(1)[0]
            self.started_by_prompt[index] += 1
            task = GroupTask(index, self.generation, self.weights_version)
            self.generation += 1
            row = self.dataset[index]
            seed = rollout_seed(self.args.seed, task.generation, 0)
            future = self.pool.submit(self.runner.run, [row] * self.group_size, [self.group_size], seed)
            self.running[future] = task
            self.started += 1
            self.beat()

    def _queue_batch(self, batch: int) -> bool:
        """The first groups to finish as generation batch `batch` (groups too stale for it are dropped); False when
        too few fresh ones are left to fill it."""
        trained_at = self.first_step + batch - self.dropped_batches
        taken, kept = self.finished[: self.groups_per_batch], []
        self.finished = self.finished[self.groups_per_batch :]
        for task, generation in taken:
            if trained_at - task.version > self.args.max_staleness:
                self.dropped += len(generation.rows)
                self.dropped_groups += 1
                self.dropped_by_prompt[task.index] += 1
                self.runner.scored(generation)  # never scored: its environments go back to the pool
            else:
                kept.append((task, generation))
        if len(kept) < self.groups_per_batch:  # wait for fresher groups to fill it
            self.finished = kept + self.finished
            return False
        tasks = [task for task, _ in kept]
        experience = self.maker.make(tasks[0].generation, self.trainer_state,
                                     sampled=Generation.concat([g for _, g in kept]))  # fmt: skip
        # Drawn but not in this or an earlier batch: sampled again first after a resume from this batch's checkpoint.
        pending = [t.index for t in self.running.values()] + [t.index for t, _ in self.finished]
        state = {**self.sampler.state_dict(), "requeued": pending + list(self.sampler.requeued)}
        item = Produced(experience, min(t.version for t in tasks), self.generation - experience.rollouts, state,
                        time.perf_counter())  # fmt: skip
        self._put(item)
        return True
