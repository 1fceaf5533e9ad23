"""TRL's `get_train_dataloader()` / `get_eval_dataloader()`: torch DataLoaders over the rows the loop trains and
evaluates on, for scripts and tests that inspect batching (`num_workers`, `batch_size`, persistent workers) or read
the rows. The loop itself draws prompts in the main process (`data.PromptSampler`); these loaders replay the same
draws from a copy of its sampler, in the layout of TRL's: a DataLoader batch is one process's generation batch
(each prompt `num_generations` times in a row), repeated steps_per_generation × num_iterations times, one batch
per micro-batch the loop trains (TRL calls `training_step` once per batch)."""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from .config import GRPOConfig
from .data import PromptSampler, StreamSampler, dataset_rows, is_iterable_dataset


def identity(rows):
    """TRL's collator: a batch is its list of rows."""
    return rows


def generation_share(prompts: list, num_generations: int, process_index: int, per_process: int) -> list:
    """One process's rows of a generation batch drawn as `prompts` (every process draws the same): each prompt
    num_generations times in a row, and this process's `per_process` of them (a prompt's group may span processes).

    >>> generation_share(["a", "b", "c"], 2, 1, 3)
    ['b', 'c', 'c']
    """
    rows = [prompt for prompt in prompts for _ in range(num_generations)]
    return rows[process_index * per_process : (process_index + 1) * per_process]


def evaluation_share(num_rows: int, process_index: int, num_processes: int) -> list[int]:
    """The indices of an evaluation set one process samples: every num_processes-th, from its own."""
    return list(range(process_index, num_rows, num_processes))


class _EpochDraws:
    """A copy of the loop's prompt sampler, reset to its first epoch, that gives one epoch's generation batches per
    pass, epoch after epoch, as the loop draws them (TRL's RepeatSampler, too, reshuffles at every pass)."""

    def __init__(
        self, sampler: PromptSampler | StreamSampler, args: GRPOConfig, process_index: int, num_processes: int
    ):
        self.sampler = copy.copy(sampler)
        self.sampler.load_state_dict({"epoch": 0, "position": 0})
        self.args, self.process_index = args, process_index
        self.per_process = args.generation_batch_per_process
        self.prompts = args.generation_batch_size // args.num_generations
        self.next_epochs = None  # a batch drawn, of the next epoch's prompts (a stream's end found late)

    def one_epoch(self, draw) -> list:
        """This process's share of the epoch's generation batches, each repeated as TRL's sampler repeats it;
        `draw(count)` draws from the sampler (indices or rows). A batch belongs to the epoch of its first prompt."""
        args, epoch, out = self.args, self.sampler.epoch, []
        while self.sampler.epoch == epoch:
            prompts, self.next_epochs = self.next_epochs or draw(self.prompts), None
            if self.sampler.epoch > epoch and self.sampler.position >= len(prompts):
                self.next_epochs = prompts  # a stream tells its end only when read past it: the next epoch's
                break
            share = generation_share(prompts, args.num_generations, self.process_index, self.per_process)
            out += share * (args.steps_per_generation * args.num_iterations)
        return out


class TrainIndexSampler(Sampler):
    """The dataset indices one process's loop trains on, an epoch per pass (`_EpochDraws`)."""

    def __init__(self, draws: _EpochDraws):
        self.draws = draws

    def __iter__(self):
        return iter(self.draws.one_epoch(self.draws.sampler.draw))

    def __len__(self) -> int:
        draws = copy.deepcopy(self.draws)  # the next pass's, without drawing it
        return len(draws.one_epoch(draws.sampler.draw))

    def set_epoch(self, epoch: int) -> None:
        self.draws.sampler.load_state_dict({"epoch": epoch, "position": 0})
        self.draws.next_epochs = None


class StreamRows(torch.utils.data.IterableDataset):
    """The rows of a stream one process's loop trains on, an epoch per pass (`_EpochDraws`)."""

    def __init__(self, dataset, draws: _EpochDraws):
        self.dataset, self.draws = dataset, draws

    def __iter__(self):
        return iter(self.draws.one_epoch(lambda count: self.draws.sampler.rows(self.dataset, count)))


def _loader_options(args: GRPOConfig, one_process: bool = False) -> dict:
    """The DataLoader options transformers' Trainer takes from TrainingArguments; `one_process`: a stream's loader,
    read in the main process whatever dataloader_num_workers says (the worker options then do not apply)."""
    workers = (
        {"num_workers": 0, "persistent_workers": False, "prefetch_factor": None}
        if one_process
        else {
            "num_workers": args.dataloader_num_workers,
            "persistent_workers": args.dataloader_persistent_workers,
            "prefetch_factor": args.dataloader_prefetch_factor,
        }
    )
    return {
        "collate_fn": identity,
        "pin_memory": args.dataloader_pin_memory,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        **workers,
    }


def train_dataloader(
    dataset, sampler: PromptSampler | StreamSampler, args: GRPOConfig, process_index: int, num_processes: int
) -> DataLoader:
    """This process's training rows as TRL's train DataLoader gives them: batches of per_device_train_batch_size ×
    steps_per_generation rows, made by a `batch_sampler` (as accelerate's prepared loader: `batch_size` None, the
    count in `batch_sampler.batch_size`), a stream's read by one worker. `sampler` is the loop's, left as it is."""
    from transformers.trainer_utils import seed_worker

    draws = _EpochDraws(sampler, args, process_index, num_processes)
    batch_size = args.per_device_train_batch_size * args.steps_per_generation
    if is_iterable_dataset(dataset):
        return DataLoader(StreamRows(dataset, draws), batch_size=batch_size, **_loader_options(args, one_process=True))
    batches = BatchSampler(TrainIndexSampler(draws), batch_size, drop_last=args.dataloader_drop_last)
    return DataLoader(
        dataset,
        batch_sampler=batches,
        worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=process_index),
        **_loader_options(args),
    )


def eval_dataloader(dataset, args: GRPOConfig, process_index: int, num_processes: int) -> DataLoader:
    """This process's evaluation rows as `GRPOTrainer.evaluate` samples them: its share of the prompts, in order,
    each num_generations_eval times, per_device_eval_batch_size rows a batch (whole groups); a stream is read by one
    worker, as in TRL."""
    n, stream = args.num_generations_eval, is_iterable_dataset(dataset)
    if stream:
        dataset = dataset_rows(dataset)
    indices = [i for i in evaluation_share(len(dataset), process_index, num_processes) for _ in range(n)]
    batches = BatchSampler(indices, max(1, args.per_device_eval_batch_size // n) * n, drop_last=False)
    return DataLoader(dataset, batch_sampler=batches, **_loader_options(args, one_process=stream))
