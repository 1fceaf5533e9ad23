"""The GRPO objective as pure functions of tensors.

Shapes: N completions in the (micro-)batch, T completion tokens (padded), V vocabulary entries.

Per token t of completion i (DeepSeekMath §4.1, with TRL's extensions):

    log_ratio    = logprobs - old_logprobs                       (token level), or its masked mean over the
                                                                 sequence, broadcast to every token (GSPO,
                                                                 `importance_sampling_level="sequence"`)
    ratio        = exp(log_ratio)
    clipped      = clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    objective    = min(ratio · A, clipped · A)                   (ratio capped at `delta` first, if given)
    loss_token   = -objective + beta · KL_k3 - entropy_coef · entropy
    KL_k3        = exp(ref - logp) - (ref - logp) - 1            (Schulman's k3, unbiased and >= 0)

and the tokens are aggregated by `loss_type` (see `AGGREGATIONS`). With one update per generation the ratio is
exp(logp - logp.detach()) = 1 in value, so the loss value is the aggregate of -A + beta·KL — which is just beta·KL
when the advantages cancel (zero mean per group under `grpo`) — while its gradient is the policy gradient
(TRL PR #2565's derivation).

Nothing in this module knows about models, configs or accelerators; the trainer calls these functions and users
may call them from their own loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# ---------------------------------------------------------------------------------------------- KL


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref) from samples of π_θ: exp(r - l) - (r - l) - 1."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


# ---------------------------------------------------------------------------------------------- aggregation

# An aggregation turns a per-token loss [N, T] into a scalar. Each receives the batch-wide counts so that a
# micro-batch's loss is its share of the accumulated batch's loss: summing the micro-batch losses of one
# optimizer step then equals the loss of the whole batch in one piece (for every type but `bnpo`).
Aggregation = Callable[..., torch.Tensor]


def _aggregate_grpo(loss, mask, *, num_sequences, num_tokens, max_completion_length):
    # Mean over sequences of each sequence's token mean (DeepSeekMath eq. 3).
    per_sequence = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / num_sequences


def _aggregate_bnpo(loss, mask, *, num_sequences, num_tokens, max_completion_length):
    # Token mean over this micro-batch only: by definition it depends on how the batch is split.
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _aggregate_dr_grpo(loss, mask, *, num_sequences, num_tokens, max_completion_length):
    # Dr. GRPO (Liu et al. 2025): a constant denominator, so no length bias.
    return (loss * mask).sum() / (num_sequences * max_completion_length)


def _aggregate_dapo(loss, mask, *, num_sequences, num_tokens, max_completion_length):
    # DAPO (Yu et al. 2025): token mean over the whole accumulated batch.
    return (loss * mask).sum() / max(float(num_tokens), 1.0)


AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": _aggregate_grpo,
    "bnpo": _aggregate_bnpo,
    "dr_grpo": _aggregate_dr_grpo,
    "dapo": _aggregate_dapo,
}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Aggregate a per-token quantity [N, T] as `loss_type` does (counts default to this batch's own)."""
    if loss_type not in AGGREGATIONS:
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose one of {sorted(AGGREGATIONS)}.")
    mask = mask.to(per_token.dtype)
    return AGGREGATIONS[loss_type](
        per_token,
        mask,
        num_sequences=mask.shape[0] if num_sequences is None else num_sequences,
        num_tokens=mask.sum().item() if num_tokens is None else num_tokens,
        # The mask, not the loss, has the token width: a sequence-level loss is [N, 1] until broadcast.
        max_completion_length=mask.shape[1] if max_completion_length is None else max_completion_length,
    )


# ---------------------------------------------------------------------------------------------- the loss


@dataclass
class LossStats:
    """Detached statistics of one loss evaluation (token means over the completion mask)."""

    kl: torch.Tensor | None  # mean k3 KL, None when beta == 0 and no reference was given
    entropy: torch.Tensor | None  # mean entropy, None when no entropies were given
    clip_ratio_low: torch.Tensor  # share of tokens with ratio < 1 - epsilon and A < 0
    clip_ratio_high: torch.Tensor  # share of tokens with ratio > 1 + epsilon_high and A > 0
    clip_ratio_region: torch.Tensor  # either of the two
    ratio_mean: torch.Tensor  # mean importance ratio, 1 on-policy

    def as_dict(self) -> dict[str, float]:
        out = {
            "clip_ratio/low_mean": self.clip_ratio_low.item(),
            "clip_ratio/high_mean": self.clip_ratio_high.item(),
            "clip_ratio/region_mean": self.clip_ratio_region.item(),
        }
        if self.kl is not None:
            out["kl"] = self.kl.item()
        if self.entropy is not None:
            out["entropy"] = self.entropy.item()
        return out


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
    delta: float | None = None,
    entropies: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    loss_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The clipped GRPO surrogate plus beta·KL, aggregated by `loss_type`.

    logprobs:      [N, T] log π_θ of the chosen tokens (with grad)
    old_logprobs:  [N, T] log π_old (the policy that sampled), or None for on-policy (= logprobs.detach())
    ref_logprobs:  [N, T] log π_ref, or None (required when beta > 0)
    advantages:    [N] per completion, or [N, T] per token (process supervision)
    mask:          [N, T] 1 for completion tokens that count
    num_sequences, num_tokens: counts over the whole accumulated batch (default: this batch), so that
                   micro-batch losses add up to the full-batch loss.
    delta:         two-sided clipping: cap the unclipped ratio at delta (INTELLECT-2), None = off
    entropies:     [N, T] per-token entropies (with grad) for the entropy bonus `entropy_coef`
    loss_weights:  [N, T] optional 0/1 weights on the policy-gradient term only (e.g. top-entropy tokens)

    Returns (loss, stats).
    """
    if beta > 0 and ref_logprobs is None:
        raise ValueError("policy_loss: beta > 0 needs ref_logprobs (the reference policy's log-probs).")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"Unknown importance_sampling_level {importance_sampling_level!r}; "
            f"choose one of {list(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logprobs.dtype)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    if advantages.dim() == 1:
        advantages = advantages[:, None]

    log_ratio = logprobs - old_logprobs
    if importance_sampling_level == "sequence":
        # GSPO (Zheng et al. 2025): one length-normalised ratio per sequence.
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    unclipped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token = -torch.min(unclipped_ratio * advantages, clipped_ratio * advantages)
    if loss_weights is not None:
        per_token = per_token * loss_weights

    kl = None
    if ref_logprobs is not None:
        per_token_kl = kl_k3(logprobs, ref_logprobs)
        kl = masked_mean(per_token_kl.detach(), mask)
        if beta > 0:
            per_token = per_token + beta * per_token_kl
    if entropies is not None and entropy_coef != 0:
        per_token = per_token - entropy_coef * entropies

    loss = aggregate(
        per_token,
        mask,
        loss_type,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_completion_length=max_completion_length,
    )

    with torch.no_grad():
        ratio_tokens = ratio.expand_as(mask)
        is_low = (ratio_tokens < 1 - epsilon) & (advantages.expand_as(mask) < 0)
        is_high = (ratio_tokens > 1 + epsilon_high) & (advantages.expand_as(mask) > 0)
        stats = LossStats(
            kl=kl,
            entropy=None if entropies is None else masked_mean(entropies.detach(), mask),
            clip_ratio_low=masked_mean(is_low.to(mask.dtype), mask),
            clip_ratio_high=masked_mean(is_high.to(mask.dtype), mask),
            clip_ratio_region=masked_mean((is_low | is_high).to(mask.dtype), mask),
            ratio_mean=masked_mean(ratio_tokens.detach(), mask),
        )
    return loss, stats


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """1 for the tokens whose entropy is in the top `quantile` share of this batch's tokens (Wang et al. 2025,
    "Beyond the 80/20 rule"), else 0: only those take part in the policy-gradient term."""
    values = entropies[mask.bool()].float()
    if values.numel() == 0:
        return torch.zeros_like(entropies)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropies >= threshold) & mask.bool()).to(entropies.dtype)
