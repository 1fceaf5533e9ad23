"""grpokit.generation: the micro-batches the loop trains on, in order, and the cursor a checkpoint saves."""

import torch

from grpokit.batch import TrainBatch
from grpokit.data import PromptSampler
from grpokit.generation import Generation


def numbered_batch(first: int, rows: int = 6) -> TrainBatch:
    """A generation batch whose row i has the prompt id first + i (what the tests read back)."""
    ids = torch.arange(first, first + rows)[:, None]
    ones = torch.ones(rows, 2, dtype=torch.long)
    inputs = {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "completion_ids": ones}
    return TrainBatch.from_trl_inputs({**inputs, "completion_mask": ones, "advantages": torch.zeros(rows)})


def counting_generation(first: int = 0) -> tuple[Generation, list[TrainBatch]]:
    """μ = 2 passes over generation batches of 6 rows (first, first + 10, ...), in micro-batches of 4 rows."""
    made = []

    def make_batch():
        made.append(numbered_batch(first + 10 * len(made)))
        return made[-1]

    return Generation(make_batch, PromptSampler(8, seed=0), micro_batch_size=4, passes=2), made


def rows(micro_batches: list[TrainBatch]) -> list[list[int]]:
    return [b.prompt_ids[:, 0].tolist() for b in micro_batches]


def test_for_each_generation_batch_for_each_pass_its_micro_batches_in_order():
    generation, made = counting_generation()
    assert rows(generation.take(3)) == [[0, 1, 2, 3], [4, 5], [0, 1, 2, 3]]
    # A window may end inside the next generation batch, which is sampled only when needed.
    assert len(made) == 1
    assert rows(generation.take(3)) == [[4, 5], [10, 11, 12, 13], [14, 15]]
    assert len(made) == 2 and (generation.pass_index, generation.micro_index) == (1, 0)


def test_a_resumed_cursor_takes_the_micro_batches_the_interrupted_one_would_have_taken_next():
    generation, _ = counting_generation()
    generation.sampler.draw(3)
    generation.take(3)  # inside the second pass over the first batch
    resumed, made = counting_generation(first=100)
    resumed.load_state_dict(generation.state_dict(), "cpu")
    assert resumed.sampler.state_dict() == generation.sampler.state_dict()
    assert rows(resumed.take(2)) == [[4, 5], [100, 101, 102, 103]] and len(made) == 1
    # Between generation batches nothing is held: the resumed run samples the next one.
    generation.take(1)
    assert generation.state_dict()["batch"] is None


def test_a_checkpoint_of_the_older_cursor_at_the_end_of_a_pass_resumes_at_the_next_one():
    state = {"sampler": PromptSampler(8, seed=0).state_dict(), "batch": numbered_batch(0).state_dict()}
    generation, made = counting_generation(first=100)
    generation.load_state_dict({**state, "pass_index": 0, "micro_index": 2}, "cpu")
    assert rows(generation.take(2)) == [[0, 1, 2, 3], [4, 5]] and not made
    generation.load_state_dict({**state, "pass_index": 1, "micro_index": 2}, "cpu")
    assert generation.batch is None and rows(generation.take(1)) == [[100, 101, 102, 103]]
