"""The loop's generation: which micro-batches the optimizer steps train on, in order, and where the loop is among them.

For each generation batch (`make_batch`: the trainer's `generate_batch`), for each of the μ = num_iterations passes
over it, its micro-batches of per_device_train_batch_size rows, in order. An optimizer step takes the next
gradient_accumulation_steps of them (`take`); its window may end inside the next generation batch (TRL's
steps_per_generation need not be a multiple of gradient_accumulation_steps).

The position (the prompt sampler's, the generation batch being trained on, the pass, the micro-batches of the pass
already taken) is what a checkpoint saves (`state_dict`), so that a resumed run takes exactly the micro-batches the
interrupted one would have taken next.
"""

from __future__ import annotations

from collections.abc import Callable

from .batch import TrainBatch


class Generation:
    """The micro-batches to train on, one generation batch at a time, with the cursor into the current one.

    make_batch: this process's next generation batch (sampled, scored, with advantages); sampler: the prompt sampler
    it draws from (its position is saved with the cursor); micro_batch_size: rows per micro-batch; passes: μ, the
    passes over each generation batch."""

    def __init__(self, make_batch: Callable[[], TrainBatch], sampler, micro_batch_size: int, passes: int):
        self.make_batch, self.sampler = make_batch, sampler
        self.micro_batch_size, self.passes = micro_batch_size, passes
        self.batch: TrainBatch | None = None  # the generation batch being trained on; None: sample the next
        self.micro_batches: list[TrainBatch] = []  # its micro-batches
        self.pass_index = 0  # which of the μ passes over it
        self.micro_index = 0  # micro-batches of this pass already taken

    def take(self, count: int) -> list[TrainBatch]:
        """The next `count` micro-batches (an optimizer step's window), sampling generation batches as needed."""
        return [self.next_micro_batch() for _ in range(count)]

    def next_micro_batch(self) -> TrainBatch:
        if self.batch is None:
            self._start(self.make_batch(), 0, 0)
        micro_batch = self.micro_batches[self.micro_index]
        self.micro_index += 1
        self._skip_finished()
        return micro_batch

    def _start(self, batch: TrainBatch | None, pass_index: int, micro_index: int) -> None:
        self.batch, self.pass_index, self.micro_index = batch, pass_index, micro_index
        self.micro_batches = [] if batch is None else batch.split(self.micro_batch_size)

    def _skip_finished(self) -> None:
        """Past a finished pass to the next one, and past a finished batch (the next micro-batch samples a new one).
        Also for a checkpoint of an older version, which could hold a cursor at the end of a pass."""
        if self.batch is not None and self.micro_index == len(self.micro_batches):
            self.pass_index, self.micro_index = self.pass_index + 1, 0
        if self.pass_index == self.passes:
            self._start(None, 0, 0)

    def state_dict(self) -> dict:
        """The position: the sampler's, and the cursor (`batch`: this process's generation batch on the CPU, or None
        between generation batches; the other entries are the same on every process)."""
        return {
            "sampler": self.sampler.state_dict(),
            "pass_index": self.pass_index,
            "micro_index": self.micro_index,
            "batch": None if self.batch is None else self.batch.to("cpu").state_dict(),
        }

    def load_state_dict(self, state: dict, device) -> None:
        self.sampler.load_state_dict(state["sampler"])
        batch = state.get("batch")
        if batch is None:
            self._start(None, 0, 0)
        else:
            self._start(TrainBatch.from_state_dict(batch).to(device), state["pass_index"], state["micro_index"])
            self._skip_finished()
