"""The rollout seam: what an engine is given and what it returns.

An engine samples completions for one generation's prompts. It is given each prompt once, with how many
completions to draw from it (G = num_generations, so that an engine can share the prompt's prefix natively), the
sampling parameters and an integer seed, and returns a typed `Rollout`. `sync_weights(model)` is called before
each generation with the policy being trained (a no-op for an engine that samples from that very model).

Shapes: B distinct prompts; N = sum of their counts (rows, one per completion; a prompt's rows are consecutive);
P prompt tokens (left-padded); T completion tokens (right-padded).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..data import pad_left
from ..multimodal import MultimodalInputs
from ..sampling_mask import SamplingMask


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # Tokens never sampled (a VLM's image token: a sampled one would have no image features, as TRL's
    # suppress_tokens); like top-k, a filter on what is drawn, not on the recorded policy log-prob.
    suppress_token_ids: tuple[int, ...] = ()
    # Keep sampling mask (`grpokit.sampling_mask`): with any of the processing above, the engine reports the
    # log-probs of the distribution it drew from and each token's kept set (`Rollout.sampling_mask`); False:
    # the policy's full-vocabulary log-probs (TRL 1.16). Truncation then keeps at most sampling_mask_max_tokens
    # tokens (an implicit top-k, which bounds the recorded kept sets).
    keep_sampling_mask: bool = True
    sampling_mask_max_tokens: int = 512


@dataclass
class PromptBatch:
    """One generation's prompts, each once, with the number of completions to sample from each."""

    ids: list[list[int]]  # [B] each prompt's token ids (truncated to max_prompt_length, unpadded)
    counts: list[int]  # [B] completions to sample per prompt: G, or fewer where a group spans processes
    raw: list[Any]  # [B] the prompts as the dataset gave them (text, chat messages or token ids)
    # Prompts with images (a vision-language model's processor): each prompt's images (PIL, in the order of its
    # image tokens; [] for a prompt without), what an engine such as vLLM takes as `multi_modal_data`...
    images: list[list] | None = None  # [B]
    # ...and the processor's tensors of each prompt besides its ids (pixel_values, image_grid_thw, token_type_ids,
    # ...: `multimodal.process_prompt`), what the in-process engine's forward takes...
    processed: list[dict[str, torch.Tensor]] | None = None  # [B]
    # ...and each prompt's ids before the processor expanded its image placeholders (what vLLM takes with
    # multi_modal_data: it expands them itself, and must arrive at `ids`).
    unexpanded_ids: list[list[int]] | None = None  # [B]

    def __post_init__(self):
        if not (len(self.ids) == len(self.counts) == len(self.raw)):
            raise ValueError("PromptBatch: ids, counts and raw need one entry per prompt.")
        if any(x is not None and len(x) != len(self.ids) for x in (self.images, self.processed, self.unexpanded_ids)):
            raise ValueError("PromptBatch: images, processed and unexpanded_ids need one entry per prompt.")
        if any(len(ids) == 0 for ids in self.ids):
            raise ValueError("A prompt is empty after tokenization; every prompt needs at least one token.")

    @property
    def num_rows(self) -> int:
        return sum(self.counts)

    def rows(self) -> list[int]:
        """The prompt index of each row: [0, 0, 0, 1, 1, 1] for counts [3, 3]."""
        return [i for i, count in enumerate(self.counts) for _ in range(count)]

    def padded(self, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ids and mask [N, P], one row per completion to sample."""
        return pad_left([self.ids[i] for i in self.rows()], pad_token_id)

    @staticmethod
    def concat(parts: list[PromptBatch]) -> PromptBatch:
        """The prompts of several batches as one, in order (images and processor tensors where every part has them)."""
        if len(parts) == 1:
            return parts[0]

        def joined(name: str) -> list | None:
            values = [getattr(part, name) for part in parts]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"PromptBatch.concat: some parts have {name} and others none.")
            return [x for v in values for x in v]

        return PromptBatch(
            [x for p in parts for x in p.ids],
            [x for p in parts for x in p.counts],
            [x for p in parts for x in p.raw],
            joined("images"),
            joined("processed"),
            joined("unexpanded_ids"),
        )

    def multimodal(self) -> MultimodalInputs | None:
        """The processor's tensors for the rows (one entry per prompt, indexed by row), None for text prompts."""
        if self.processed is None:
            return None
        return MultimodalInputs(list(self.processed), torch.tensor(self.rows(), dtype=torch.long))


@dataclass
class Rollout:
    """What one generation produced: N rows, one per completion.

    The masks are distinct on purpose: a completion may hold tokens the policy did not sample (a tool's output in
    a multi-turn episode). Those are attended to by every later token (`attention_mask`) but carry no loss
    (`loss_mask`). `lengths` is the extent of the real tokens; nothing assumes the loss mask is a run of 1s.
    """

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded
    attention_mask: torch.Tensor  # [N, T] 1 on every real completion token (sampled or inserted)
    loss_mask: torch.Tensor  # [N, T] 1 on the tokens the policy sampled and is trained on
    lengths: torch.Tensor  # [N] real completion tokens (up to and including EOS)
    is_truncated: torch.Tensor  # [N] bool: ended by max_new_tokens, not EOS
    # [N, T] float32 log-probs of the sampled tokens under the behaviour policy (the engine's), 0 elsewhere;
    # None when the engine does not report them. Distinct from π_old, which the trainer may recompute.
    sampling_logprobs: torch.Tensor | None = None
    extra: dict[str, list] = field(default_factory=dict)  # per-row fields an engine passes on to reward functions
    # The prompts' images as the model's forward takes them (`PromptBatch.multimodal()`), for the training forward;
    # None for text prompts.
    multimodal: MultimodalInputs | None = None
    # Each sampled token's kept set and processing (`SamplingMask`, kept_ids [N, T, K]) where the engine drew from a
    # processed distribution and reports its log-probs; None where sampling_logprobs are the policy's.
    sampling_mask: SamplingMask | None = None
    # [N] int64: which of the engine's samplers drew each row, an index into the engine's `samplers` (their names:
    # several inference servers, the engines of a data-parallel server), so that the served-policy check takes each
    # sampler's own gap (grpokit.served); None: the engine samples as one.
    sampler: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's real tokens (attention mask 1), as lists."""
        return [ids[mask.bool()].tolist() for ids, mask in zip(self.completion_ids, self.attention_mask)]

    def to(self, device) -> Rollout:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Rollout(
            move(self.prompt_ids),
            move(self.prompt_mask),
            move(self.completion_ids),
            move(self.attention_mask),
            move(self.loss_mask),
            move(self.lengths),
            move(self.is_truncated),
            move(self.sampling_logprobs),
            self.extra,
            None if self.multimodal is None else self.multimodal.to(device),
            None if self.sampling_mask is None else self.sampling_mask.map(move),
            move(self.sampler),
        )

    def select(self, index: list[int] | torch.Tensor) -> Rollout:
        index = torch.as_tensor(index, dtype=torch.long)
        pick = lambda t: None if t is None else t[index.to(t.device)]  # noqa: E731
        return Rollout(
            pick(self.prompt_ids),
            pick(self.prompt_mask),
            pick(self.completion_ids),
            pick(self.attention_mask),
            pick(self.loss_mask),
            pick(self.lengths),
            pick(self.is_truncated),
            pick(self.sampling_logprobs),
            {k: [v[i] for i in index.tolist()] for k, v in self.extra.items()},
            None if self.multimodal is None else self.multimodal.select(index),
            None if self.sampling_mask is None else self.sampling_mask.map(pick),
            pick(self.sampler),
        )

    def trimmed(self) -> Rollout:
        """Without the padding columns no row uses (prompt columns on the left, completion columns on the right): what
        is left over after `select` takes rows of a wider batch."""
        used = self.prompt_mask.bool().any(0).nonzero()
        first = int(used[0]) if len(used) else self.prompt_mask.shape[1]
        used = self.attention_mask.bool().any(0).nonzero()
        width = int(used[-1]) + 1 if len(used) else 0
        if first == 0 and width == self.completion_ids.shape[1]:
            return self
        return dataclasses.replace(
            self,
            prompt_ids=self.prompt_ids[:, first:],
            prompt_mask=self.prompt_mask[:, first:],
            **self._completion_columns(width),
        )

    def cut_to(self, max_new_tokens: int) -> Rollout:
        """Each completion cut to its first max_new_tokens tokens; a row cut short is truncated (as if sampled with
        that limit)."""
        if self.completion_ids.shape[1] <= max_new_tokens:
            return self
        cut = self.lengths > max_new_tokens
        return dataclasses.replace(
            self,
            lengths=self.lengths.clamp(max=max_new_tokens),
            is_truncated=self.is_truncated | cut,
            **self._completion_columns(max_new_tokens),
        )

    def _completion_columns(self, width: int) -> dict[str, torch.Tensor | None]:
        columns = {name: getattr(self, name)[:, :width] for name in ("completion_ids", "attention_mask", "loss_mask")}
        logprobs, mask = self.sampling_logprobs, self.sampling_mask
        return {
            **columns,
            "sampling_logprobs": None if logprobs is None else logprobs[:, :width],
            "sampling_mask": None if mask is None else mask.columns(width),
        }

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """Join rollouts, re-padding prompts on the left and completions on the right to a common width (the new
        padding is masked out everywhere)."""

        def pad(tensors, on_left: bool):
            width = max(t.shape[1] for t in tensors)
            sides = lambda t: (width - t.shape[1], 0) if on_left else (0, width - t.shape[1])  # noqa: E731
            return torch.cat([torch.nn.functional.pad(t, sides(t)) for t in tensors])

        logprobs = [p.sampling_logprobs for p in parts]
        multimodal = [p.multimodal for p in parts]
        if any(m is not None for m in multimodal) and any(m is None for m in multimodal):
            raise ValueError("Rollout.concat: some parts have images and others none.")
        masks = [p.sampling_mask for p in parts]
        if any(m is not None for m in masks) and any(m is None for m in masks):
            raise ValueError(
                "Rollout.concat: some parts carry a sampling mask (their log-probs are of the truncated "
                "distribution) and others none; sample every part with the same keep_sampling_mask."
            )
        widths = [p.completion_ids.shape[1] for p in parts]
        samplers = [p.sampler for p in parts]
        return Rollout(
            pad([p.prompt_ids for p in parts], True),
            pad([p.prompt_mask for p in parts], True),
            pad([p.completion_ids for p in parts], False),
            pad([p.attention_mask for p in parts], False),
            pad([p.loss_mask for p in parts], False),
            torch.cat([p.lengths for p in parts]),
            torch.cat([p.is_truncated for p in parts]),
            None if any(x is None for x in logprobs) else pad(logprobs, False),
            {k: [x for p in parts for x in p.extra[k]] for k in parts[0].extra},
            None if multimodal[0] is None else MultimodalInputs.concat(multimodal),
            None if masks[0] is None else SamplingMask.concat(masks, widths),
            None if any(x is None for x in samplers) else torch.cat(samplers),
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples completions for the trainer (`GRPOTrainer(rollout_engine=...)`).

    What an engine guarantees about its log-probs is declared by a class attribute, `logprobs_match_training: bool`
    (optional; absent means False): True only where `Rollout.sampling_logprobs` equal the training forward's
    log-probs of the same weights (grpokit's in-process engine in float32, tested to 1e-5). Then they serve as π_old
    without another forward; otherwise they only feed the sampling corrections. Read it with
    `engine_logprobs_match_training(engine)`. It is not a protocol member, so that an engine without it still is one.
    An engine that spreads each batch over several samplers holding weights of their own (several inference servers)
    names them in a `samplers` attribute (a list of str, the same on every training process) and says which drew
    each row in `Rollout.sampler`: the served-policy check then takes each one's gap (grpokit.served).
    """

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        """Sample prompts.counts[b] completions of each prompt b (rows in prompt order), reproducibly from seed."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights (called before each generation)."""
        ...


def engine_logprobs_match_training(engine: RolloutEngine) -> bool:
    """The engine's declared `logprobs_match_training` (see `RolloutEngine`); False where it declares nothing. An
    engine that declares it under its former name, `exact_logprobs`, is read, with a DeprecationWarning."""
    name = "logprobs_match_training"
    if not hasattr(engine, name) and hasattr(engine, "exact_logprobs"):
        warnings.warn(
            f"{type(engine).__name__}.exact_logprobs is now named logprobs_match_training: rename the attribute.",
            DeprecationWarning,
            stacklevel=2,
        )
        name = "exact_logprobs"
    declared = getattr(engine, name, False)
    if not isinstance(declared, bool):
        raise TypeError(
            f"{type(engine).__name__}.logprobs_match_training must be a bool (whether its sampling log-probs equal "
            f"the training forward's), got {declared!r}."
        )
    return declared


def rollout_seed(seed: int, rollout_index: int, process_index: int) -> int:
    """The seed of rollout `rollout_index` on one process (training counts its rollouts in `TrainerState.rollouts`;
    an evaluation batch's index is its number): every engine and every evaluation batch gets its seed here."""
    return seed * 1_000_003 + rollout_index * 1009 + process_index


# Evaluation batches draw from their own seeds (rollout_seed(seed + EVAL_SEED_OFFSET, batch, process)): the same
# weights always give the same evaluation, whatever the training has sampled.
EVAL_SEED_OFFSET = 1_000_000_007
