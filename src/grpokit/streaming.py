"""Multi-turn rollouts streamed group by group: the tasks of the asynchronous scheduler (grpokit.producer.Producer)
for agents (tools, environments of other libraries), where a rollout waits on tool calls as much as on the engine.

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
`sample/prompt_drop_rate_max`, and a warning naming the most-dropped prompts when generation stops). A group still
running when the next batch to assemble is already trained past its version + max_staleness can never be trained:
it is abandoned at once (`Producer._abandon_stale_groups`), dropped and counted the same way, and the next group
starts in its place; its `GroupTask.stop` is set, so it stops at its next engine call or tool wait (`Abandoned`) and
gives back its environments, leaving the tool calls still running to their timeout. Weights move
between engine calls: a group's later turns may be sampled by newer weights than its first; its version is the one
it started with (the oldest), and every token's π_old is the log-prob it was sampled with, recorded in the engine
call (the engine's, or BatchingEngine's forward of the sampling weights for an engine that reports none).

Shutdown: `Producer.close` closes the batching engine: groups in flight stop at their next engine call (EngineClosed)
and give back the environments they were lent; one inside a tool call ends when the call does, in a daemon thread.

Resume: a checkpoint records the prompt sampler's position after the latest draw and, as `requeued`, the prompts of
the groups drawn but not yet trained (in flight, or finished and waiting for a batch): a resumed run samples those
first. Their completions are sampled again, with new seeds; nothing drawn is skipped.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass, field


@dataclass
class GroupTask:
    index: int  # the prompt's dataset index
    rollout_index: int  # its rollout's index (its seed: `rollout_seed`)
    version: int  # the weights' version when it started
    stop: threading.Event = field(default_factory=threading.Event)  # set when the group is abandoned as too stale


class DaemonPool:
    """Daemon threads running submitted calls, each with its future: `workers` to begin with, and one more whenever a
    call is submitted while none is idle (a thread still finishing an abandoned group's engine call must not delay the
    group started in its place; the caller bounds how many calls it keeps running). concurrent.futures' pool joins
    its threads at interpreter exit, so one rollout still waiting on a tool call when training ends kept the process
    alive for the tool's whole timeout; a daemon thread never holds up exit. `shutdown` cancels what has not started
    and lets idle threads end."""

    def __init__(self, workers: int, name: str):
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.name, self.workers, self.idle = name, 0, workers
        self.lock = threading.Lock()
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name=f"{self.name}-{self.workers}", daemon=True).start()
        self.workers += 1

    def submit(self, function, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.idle > 0:
                self.idle -= 1
            else:
                self._spawn()
        self.tasks.put((future, function, args))
        return future

    @staticmethod
    def wait_any(futures: list[concurrent.futures.Future], timeout: float) -> set[concurrent.futures.Future]:
        """The futures done, after waiting up to `timeout` seconds for the first if none is."""
        return concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED).done

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
                with self.lock:
                    self.idle += 1
                continue
            result, error = None, None
            try:
                result = function(*args)
            except BaseException as raised:
                error = raised
            with self.lock:  # idle before the future is done: a caller woken by it reuses this thread
                self.idle += 1
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
