"""Datasets, prompt rendering and the order in which prompts are drawn."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
PROMPT_COLUMNS = ("prompt", "prompt_ids")
# The prompt of a row without one when an environment supplies it through reset() (TRL 1.16's default).
EMPTY_PROMPT = [{"role": "user", "content": ""}]


def with_prompt(row: dict) -> dict:
    """The row, with TRL's empty user message as its prompt when it has none (an environment's reset() fills it)."""
    return row if any(c in row for c in PROMPT_COLUMNS) else {**row, "prompt": EMPTY_PROMPT}


class PromptLimit(int):
    """How many prompt tokens are kept (the last ones), an int, with the reason for the limit. `cut` applies it and
    says so once per run, the first time a prompt is actually longer: how many of that batch's prompts were cut.

    >>> limit = PromptLimit(3, "max_prompt_length=3")
    >>> limit.cut([[1, 2, 3, 4, 5], [6, 7]])
    [[3, 4, 5], [6, 7]]
    """

    reason: str

    def __new__(cls, length: int, reason: str) -> PromptLimit:
        limit = super().__new__(cls, length)
        limit.reason, limit._warned, limit._lock = reason, False, threading.Lock()
        return limit

    @classmethod
    def of(cls, limit: int | None) -> PromptLimit | None:
        """A limit given as a plain number is max_prompt_length's."""
        return limit if limit is None or isinstance(limit, PromptLimit) else cls(limit, f"max_prompt_length={limit}")

    def cut(self, prompts: list[list[int]]) -> list[list[int]]:
        longer = sum(len(prompt) > self for prompt in prompts)
        if longer:
            self.warn(longer, len(prompts))
        return [prompt[-self:] if len(prompt) > self else prompt for prompt in prompts]

    def warn(self, longer: int, total: int) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        logger.warning(
            f"{longer} of {total} prompts in a batch are longer than {int(self)} tokens and keep only "
            f"their last {int(self)} ({self.reason}); reward functions still see the whole prompt. "
            "Filter long prompts out of the dataset to train on whole prompts. (Said once per run.)"
        )

    def __reduce__(self):  # pickled (the engine's process) as the number and its reason
        return PromptLimit, (int(self), self.reason)


def load_dataset_source(spec: str, split: str = "train"):
    """A `datasets.Dataset` from a jsonl/json/csv/parquet file, a local directory, or a Hub id."""
    import datasets

    path = Path(spec).expanduser()
    suffix_to_builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
    if path.is_file():
        builder = suffix_to_builder.get(path.suffix)
        if builder is None:
            raise ValueError(f"Dataset file {spec!r}: unsupported extension; use .jsonl, .json, .csv or .parquet.")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "state.json").exists():
            loaded = datasets.load_from_disk(str(path))
            return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(str(path), split=split)
    if spec.startswith(("/", "./", "../", "~")) or path.suffix in suffix_to_builder:
        # a path, or a file name (`trian.jsonl`): never ask the Hub for it
        raise FileNotFoundError(f"Dataset {spec!r} not found: no such file or directory.{_nearby_files(path)}")
    return datasets.load_dataset(spec, split=split)


def _nearby_files(path: Path) -> str:
    """' Did you mean X?' for a file of the same kind next to where `path` points, or ''."""
    import difflib

    folder = path.parent if path.parent.is_dir() else None
    if folder is None:
        return ""
    candidates = [
        str(folder / entry.name) if str(path.parent) != "." else entry.name
        for entry in folder.iterdir()
        if entry.suffix == path.suffix
    ]
    close = difflib.get_close_matches(str(path), candidates, n=1, cutoff=0.6)
    return f" Did you mean {close[0]}?" if close else f" (looked in {folder.resolve()})"


def is_iterable_dataset(dataset) -> bool:
    """A stream without len() or indexing (datasets.IterableDataset, a torch IterableDataset, a generator-backed
    iterable)."""
    return not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__")


def is_empty(dataset) -> bool:
    if is_iterable_dataset(dataset):
        return next(iter(dataset), None) is None
    return len(dataset) == 0


def check_dataset(dataset, name: str = "train_dataset", prompt_optional: bool = False) -> None:
    """The errors a user can fix before any model is loaded. `prompt_optional`: an environment supplies the prompt
    through reset() (TRL: a row without one starts from an empty user message), so no prompt column is needed."""
    if dataset is None:
        unless = " unless an `environment_factory` is provided" if name == "train_dataset" else ""  # TRL's words
        raise ValueError(f"`{name}` is required{unless}. Pass a dataset with a 'prompt' column (or 'prompt_ids').")
    if is_empty(dataset):
        raise ValueError(f"{name} is empty: it has no rows to draw prompts from. Check the split and any filtering.")
    columns = dataset_columns(dataset)
    if not prompt_optional and not any(c in columns for c in PROMPT_COLUMNS):
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {sorted(columns)}). Rename the column holding the prompts to "
            f"'prompt' (e.g. dataset.rename_column('question', 'prompt')), or give token ids in 'prompt_ids'."
        )


def dataset_columns(dataset) -> list[str]:
    if getattr(dataset, "column_names", None) is not None:
        return list(dataset.column_names)
    if isinstance(dataset, list) and dataset:
        return list(dataset[0].keys())
    if is_iterable_dataset(dataset):  # a stream whose features are unknown: its first row's keys
        first = next(iter(dataset), None)
        return list(first.keys()) if isinstance(first, dict) else []
    return []


def named_eval_datasets(eval_dataset) -> dict[str | None, Any]:
    """{None: dataset} for one eval set; {name: dataset} for a dict or DatasetDict of named sets (metrics are then
    prefixed with the name, as transformers' Trainer does)."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):  # DatasetDict and IterableDatasetDict are dicts
        return dict(eval_dataset)
    return {None: eval_dataset}


def dataset_rows(dataset) -> list[dict]:
    """Every row of a finite dataset (an evaluation set), map-style or a stream."""
    return list(dataset) if is_iterable_dataset(dataset) else [dataset[i] for i in range(len(dataset))]


def is_conversational(prompt: Any) -> bool:
    """A prompt given as a list of chat messages ({"role": ..., "content": ...})."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def render_prompt(prompt: Any, tokenizer, chat_template_kwargs: dict | None = None) -> str:
    if not is_conversational(prompt):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "A conversational prompt (a list of messages) needs a tokenizer with a chat template; this tokenizer "
            "has none. Set tokenizer.chat_template or give plain-text prompts."
        )
    continue_final = prompt[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(
        prompt,
        tokenize=False,
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        **(chat_template_kwargs or {}),
    )


def unreadable_share(dataset, tokenizer, max_rows: int = 64) -> tuple[float, int]:
    """(share of the characters of the first `max_rows` text prompts that the tokenizer cannot represent, characters
    counted): those it encodes as its unknown token, or drops, are missing from the decoded text. (0.0, 0) for
    token-id prompts or a stream. Spaces are not counted (tokenizers may normalise them)."""
    if is_iterable_dataset(dataset) or "prompt" not in dataset_columns(dataset):
        return 0.0, 0
    rows = [dataset[i]["prompt"] for i in range(min(max_rows, len(dataset)))]
    texts = [
        " ".join(m["content"] for m in p if isinstance(m.get("content"), str)) if is_conversational(p) else p
        for p in rows
    ]
    total = lost = 0
    for text in (t for t in texts if isinstance(t, str)):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        decoded = tokenizer.decode(ids, skip_special_tokens=True)  # an unknown token is a special token
        chars, kept = len("".join(text.split())), len("".join(decoded.split()))
        total, lost = total + chars, lost + max(chars - kept, 0)
    return (lost / total if total else 0.0), total


def pad_left(sequences: list[list[int]], pad_token_id: int, max_length: int | None = None):
    if max_length is not None:
        sequences = [s[-max_length:] for s in sequences]
    if any(len(s) == 0 for s in sequences):
        raise ValueError("A prompt is empty after tokenization; every prompt needs at least one token.")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def prompts_per_epoch(num_rows: int, prompts_per_generation: int) -> int:
    """The prompts an epoch draws: as TRL's RepeatSampler, whole generation batches only (the rows left over, fewer
    than a batch, wait for a later epoch's order); a dataset smaller than one batch is drawn whole, its generation
    batches then spanning epochs."""
    if num_rows < prompts_per_generation:
        return num_rows
    return num_rows - num_rows % prompts_per_generation


class PromptSampler:
    """Draws prompt indices in a seeded order, epoch after epoch; its state is two integers, so resuming is exact.

    Every process builds the same order (same seed) and takes its own slice of each draw. An epoch draws
    `prompts_per_epoch` of its order: whole generation batches of `prompts_per_generation` prompts, as TRL's.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, prompts_per_generation: int = 1):
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.epoch_rows = prompts_per_epoch(num_rows, prompts_per_generation)
        self.epoch, self.position = 0, 0
        # Indices drawn before but never trained on (a streaming producer's groups in flight when a checkpoint was
        # written): drawn again first, in order.
        self.requeued: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """The indices epoch `epoch` draws, in order."""
        if not self.shuffle:
            return list(range(self.epoch_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator)[: self.epoch_rows].tolist()

    def draw(self, count: int) -> list[int]:
        out, self.requeued = self.requeued[:count], self.requeued[count:]
        while len(out) < count:
            order = self.epoch_order(self.epoch)
            take = order[self.position : self.position + count - len(out)]
            out.extend(take)
            self.position += len(take)
            if self.position >= self.epoch_rows:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def rows(self, dataset, count: int) -> list[dict]:
        return [dataset[i] for i in self.draw(count)]

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.position / self.epoch_rows

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            **({"requeued": self.requeued} if self.requeued else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.requeued = list(state.get("requeued", []))


class StreamSampler:
    """Draws prompts from a stream (an IterableDataset) in its order, epoch after epoch: each epoch iterates it
    anew (calling its `set_epoch`, which reshuffles a shuffled datasets.IterableDataset). The state is two integers;
    resuming iterates the epoch again and skips the rows already drawn, so it is exact for a deterministic stream.
    The run's length must be given by max_steps (a stream has no len())."""

    def __init__(self, dataset):
        self.dataset, self.epoch, self.position = dataset, 0, 0
        self._iterator = None

    def _rows(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        iterator = iter(self.dataset)
        for _ in range(self.position):
            next(iterator, None)
        return iterator

    def rows(self, dataset, count: int) -> list[dict]:
        out: list[dict] = []
        while len(out) < count:
            if self._iterator is None:
                self._iterator = self._rows()
            row = next(self._iterator, None)
            if row is None:
                if self.position == 0:
                    raise ValueError("train_dataset yielded no rows in a whole epoch.")
                self.epoch, self.position, self._iterator = self.epoch + 1, 0, None
                continue
            out.append(row)
            self.position += 1
        return out

    @property
    def epochs_done(self) -> float:
        return float(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position, self._iterator = state["epoch"], state["position"], None

    def __deepcopy__(self, memo) -> StreamSampler:
        """A sampler at the same position over the same stream (an asynchronous producer's copy): it iterates the
        stream anew, skipping the rows already drawn; the stream itself is not copied (a generator cannot be)."""
        copied = StreamSampler(self.dataset)
        copied.load_state_dict(self.state_dict())
        return copied
