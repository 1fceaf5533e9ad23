"""Keep sampling mask (DeepSeek-V3.2, arXiv 2512.02556 §3.1): the distribution each token was drawn from, recorded
by the sampler and replayed by the trainer.

With top-k / top-p / min-p, a repetition penalty or suppressed tokens the sampler draws from a processed
distribution: the logits / temperature, the penalty on tokens already seen, and a softmax over the tokens that
survive truncation (the *kept set*). Its log-probs differ from the policy's full-vocabulary ones by the log of the
kept mass, so a trainer that compares full-vocabulary log-probs with the sampler's multiplies every importance ratio
by that mass. The sampler records each token's kept set (`SamplingMask`) and reports the processed log-prob; the
trainer's log-probs of π_θ and π_old are renormalised over the same set with the same penalty
(`replayed_token_logprobs`), so the ratio of an unchanged policy is exactly 1.

Shared by the sampler (`rollout/`) and the training forward (`logprobs.py`): it imports nothing from the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

# What a kept-id entry holds where it keeps nothing (padding to the widest kept set). A row of PADDING only means
# the whole vocabulary but the suppressed tokens (a repetition penalty or suppression without truncation).
PADDING = -1


@dataclasses.dataclass
class SamplingMask:
    """Each sampled token's kept set, and the logit processing the trainer replays over it.

    Memory: kept_ids holds K int32 ids per completion token (4·N·T·K bytes), K the largest kept set of the batch,
    at most the sampler's bound (top_k, else `sampling_mask_max_tokens`); 1 without truncation.
    """

    kept_ids: torch.Tensor  # [N, T, K] int32 kept token ids of each position, PADDING after them
    repetition_penalty: float = 1.0  # CTRL penalty on every token before the position (prompt and completion)
    suppressed_ids: tuple[int, ...] = ()  # never kept (rows of PADDING: every other token)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingMask:
        return dataclasses.replace(self, kept_ids=fn(self.kept_ids))

    def columns(self, width: int) -> SamplingMask:
        """The first `width` completion positions, padded with whole-vocabulary rows past the recorded ones."""
        kept = self.kept_ids[:, :width]
        if kept.shape[1] < width:
            kept = torch.nn.functional.pad(kept, (0, 0, 0, width - kept.shape[1]), value=PADDING)
        return self.map(lambda _: kept)

    @staticmethod
    def concat(parts: list[SamplingMask], widths: list[int]) -> SamplingMask:
        """Masks of row blocks joined (each first cut or padded to its block's completion width, then all to the
        widest block and kept set); they must share the penalty and the suppressed tokens."""
        settings = {(p.repetition_penalty, p.suppressed_ids) for p in parts}
        if len(settings) > 1:
            raise ValueError(f"SamplingMask.concat: the parts were sampled with different settings {settings}.")
        width = max(widths)
        kept_width = max(p.kept_ids.shape[2] for p in parts)
        pad = lambda t: torch.nn.functional.pad(t, (0, kept_width - t.shape[2]), value=PADDING)  # noqa: E731
        kept = torch.cat([pad(p.columns(w).columns(width).kept_ids) for p, w in zip(parts, widths)])
        return dataclasses.replace(parts[0], kept_ids=kept)

    def trimmed(self) -> SamplingMask:
        """Without kept-id columns that no position uses."""
        used = int((self.kept_ids >= 0).sum(-1).max()) if self.kept_ids.numel() else 0
        return self.map(lambda t: t[..., : max(used, 1)])

    def state_dict(self) -> dict:
        return {
            "kept_ids": self.kept_ids,
            "repetition_penalty": self.repetition_penalty,
            "suppressed_ids": self.suppressed_ids,
        }


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL penalty (Keskar et al. 2019) on tokens already seen: positive logits / penalty, negative · penalty.
    Commutes with a division by a positive temperature, so the trainer applies it to logits / temperature."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def kept_ids_of(filtered: torch.Tensor, width: int) -> torch.Tensor:
    """The kept set of each row of processed scores [n, V] (-inf outside it): [n, width] int32 ids, most likely
    first, PADDING after them. `width` must be at least the largest kept set."""
    values, ids = filtered.topk(width, dim=-1)
    return ids.int().masked_fill_(values == float("-inf"), PADDING)


def first_seen_positions(input_ids: torch.Tensor, input_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] int32: where each token first occurs among the real tokens of input_ids [N, L] (L where it does not).
    A position p has seen token v when first_seen[v] < p. Ids past the vocabulary count as its last token, as the
    sampler counts them."""
    n, length = input_ids.shape
    positions = torch.arange(length, dtype=torch.int32, device=input_ids.device).expand(n, -1)
    positions = positions.masked_fill(input_mask == 0, length)
    first = torch.full((n, vocab_size), length, dtype=torch.int32, device=input_ids.device)
    return first.scatter_reduce_(1, input_ids.clamp(max=vocab_size - 1), positions, reduce="amin")


def replayed_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    seen: torch.Tensor | None = None,
    repetition_penalty: float = 1.0,
    suppressed_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """Log-probs of targets [M] under the distribution the sampler drew from, replayed on logits [M, V] (already
    divided by the temperature): the penalty on seen [M, V] tokens, then log-softmax over the kept ids [M, K]
    (a row of PADDING: over every token but the suppressed ones). Differentiable; float32 (float64 for float64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if seen is not None and repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    target_logits = logits.gather(-1, targets[:, None]).squeeze(-1)
    kept = kept_ids.long()
    explicit = kept[:, 0] >= 0
    # A whole-vocabulary row keeps one finite entry, so that its (unused) kept-set log-sum-exp has no NaN gradient.
    outside = (kept < 0) & explicit[:, None]
    kept_logits = logits.gather(-1, kept.clamp(min=0)).masked_fill(outside, float("-inf"))
    normaliser = torch.logsumexp(kept_logits, dim=-1)
    if not bool(explicit.all()):
        if suppressed_ids:
            index = torch.tensor(suppressed_ids, device=logits.device)
            logits = logits.index_fill(-1, index, float("-inf"))
        normaliser = torch.where(explicit, normaliser, torch.logsumexp(logits, dim=-1))
    return target_logits - normaliser
