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

# --------------------------------------------------------------------------------------------- log-probabilities


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 1024, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """log_softmax(logits)[..., index] without materialising the full log-softmax.

    logits: [..., V]; index: [...] (int). Returns [...] in `dtype` (default: logits' dtype).

    Each chunk of rows is cast to `dtype` on its own, so asking for float32 from bf16 logits never builds a
    float32 copy of all N·T·V logits. In float32/float64 the result is `logit[index] - logsumexp(logits)`, per
    chunk; half precision loses too much in that subtraction, so half dtypes take `log_softmax` per chunk.
    """
    dtype = logits.dtype if dtype is None else dtype
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1)
    out = torch.empty(flat_index.shape, dtype=dtype, device=logits.device)
    for start in range(0, flat_logits.shape[0], chunk_rows):
        rows = flat_logits[start : start + chunk_rows].to(dtype)
        idx = flat_index[start : start + chunk_rows, None]
        if dtype in (torch.float32, torch.float64):
            out[start : start + chunk_rows] = rows.gather(-1, idx).squeeze(-1) - torch.logsumexp(rows, dim=-1)
        else:
            out[start : start + chunk_rows] = rows.log_softmax(-1).gather(-1, idx).squeeze(-1)
    return out.view(index.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, in chunks of rows: [..., V] -> [...] (float32)."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start : start + chunk_rows].float()
        logp = rows.log_softmax(-1)
        out[start : start + chunk_rows] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Autograd for `chunked_token_logprobs` on flat rows: hidden [M, H], targets [M] -> logprobs, entropies [M].

    The forward keeps only the log-sum-exp of each row; the backward recomputes each chunk's logits from the saved
    hidden states and weight, so no [M, V] tensor lives across the two passes (nor within either of them).

    A frozen head (LoRA, whose adapters sit in the decoder) needs only d/d hidden = g / temperature · (W[target] -
    softmax @ W). The forward then computes softmax @ W [M, H] while it has the softmax, and the backward is a
    gather: no recomputed logits and no matmul over V.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_rows, compute_dtype, with_entropy):
        rows, out_dtype = hidden.shape[0], _softmax_dtype(compute_dtype)
        logprobs = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        entropies = torch.empty(rows if with_entropy else 0, dtype=out_dtype, device=hidden.device)
        lse = torch.empty(rows, dtype=out_dtype, device=hidden.device)
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        frozen_head = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        expected_rows = torch.empty(hidden.shape, dtype=out_dtype, device=hidden.device) if frozen_head else None
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = _chunk_logits(hidden[chunk], weight_c, bias_c, temperature, compute_dtype)  # [c, V]
            target_logits = logits.gather(-1, targets[chunk, None]).squeeze(-1)
            if with_entropy or frozen_head:
                # entropy = lse - sum(softmax · logits), from the same exp pass that gives the log-sum-exp.
                row_max = logits.amax(-1, keepdim=True)
                shifted = logits - row_max
                exp = shifted.exp()
                total = exp.sum(-1)
                lse[chunk] = row_max.squeeze(-1) + total.log()
                if with_entropy:
                    entropies[chunk] = total.log() - torch.linalg.vecdot(exp, shifted) / total
                if frozen_head:  # softmax @ W, the expected output embedding of each row
                    expected_rows[chunk] = (exp.to(compute_dtype) @ weight_c).to(out_dtype) / total[:, None]
            else:
                lse[chunk] = torch.logsumexp(logits, dim=-1)
            logprobs[chunk] = target_logits - lse[chunk]
        if frozen_head:
            ctx.save_for_backward(None, weight, None, targets, None, expected_rows)
        else:
            ctx.save_for_backward(hidden, weight, bias, targets, lse, None)
        ctx.temperature, ctx.chunk_rows, ctx.compute_dtype = temperature, chunk_rows, compute_dtype
        ctx.hidden_dtype, ctx.frozen_head = hidden.dtype, frozen_head
        ctx.mark_non_differentiable(entropies)
        return logprobs, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropies):
        hidden, weight, bias, targets, lse, expected_rows = ctx.saved_tensors
        temperature, chunk_rows, compute_dtype = ctx.temperature, ctx.chunk_rows, ctx.compute_dtype
        accumulate_dtype = _softmax_dtype(compute_dtype)
        grad_logprobs = grad_logprobs.to(accumulate_dtype) / temperature
        if ctx.frozen_head:
            target_rows = weight[targets].to(accumulate_dtype)  # W[target], [M, H]
            grad_hidden = grad_logprobs[:, None] * (target_rows - expected_rows)
            return (grad_hidden.to(ctx.hidden_dtype), None, None, None, None, None, None, None)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=accumulate_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=accumulate_dtype, device=weight.device) if need_bias else None
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                chunk = slice(start, start + chunk_rows)
                hidden_chunk = hidden[chunk]
                logits = _chunk_logits(hidden_chunk, weight_c, bias_c, temperature, compute_dtype)
                # d logprob / d logits = onehot(target) - softmax, times the upstream gradient and 1/temperature
                # (the logits were divided by it); computed in place in the chunk's logits buffer.
                grad_logits = logits.sub_(lse[chunk, None]).exp_().mul_(-grad_logprobs[chunk, None])
                grad_logits.scatter_add_(-1, targets[chunk, None], grad_logprobs[chunk, None])
                if need_bias:
                    grad_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(compute_dtype)
                if need_hidden:
                    grad_hidden[chunk] = (grad_logits @ weight_c).to(hidden.dtype)
                if need_weight:
                    if compute_dtype == accumulate_dtype:
                        grad_weight.addmm_(grad_logits.t(), hidden_chunk.to(compute_dtype))
                    else:
                        grad_weight += (grad_logits.t() @ hidden_chunk.to(compute_dtype)).to(accumulate_dtype)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def _softmax_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and half-precision matmuls, float64 for float64."""
    return torch.promote_types(compute_dtype, torch.float32)


def _chunk_logits(hidden_chunk, weight, bias, temperature, compute_dtype) -> torch.Tensor:
    """(hidden_chunk @ weight.T + bias) / temperature, [c, V] in float32 (float64 for float64), the matmul in
    `compute_dtype`."""
    hidden_chunk = hidden_chunk.to(compute_dtype)
    logits = hidden_chunk @ weight.t() if bias is None else torch.addmm(bias, hidden_chunk, weight.t())
    logits = logits.to(_softmax_dtype(compute_dtype))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


# Logits per chunk (chunk_rows × V float32 values). On CPU a chunk that fits in the last-level cache is fastest
# (measured on a 32 MiB-L3 EPYC with V = 32k, H = 256: 64–256-row chunks take ~35 % less time in the forward than
# 512–2048-row ones, and the same in the backward); an accelerator wants large matmuls and few launches, and has
# the memory for 256 MiB of them.
CHUNK_ELEMENTS = {"cpu": 2**22, "default": 2**26}


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` under softmax((hidden @ weight.T + bias) / temperature), never holding all logits.

    hidden:  [..., H] final hidden states (the LM head's input), e.g. [N, T, H]
    weight:  [V, H] the LM head's weight; bias: [V] or None
    targets: [...] token ids, the same leading shape as hidden
    Returns (logprobs [...], entropies [...] or None), float32 (float64 for float64 inputs).

    Equal to `log_softmax((hidden @ weight.T + bias) / temperature).gather(-1, targets)` and to the entropy of that
    softmax, computed `chunk_rows` rows at a time in forward and backward: the forward saves hidden, weight and one
    log-sum-exp per row; the backward recomputes each chunk's logits and accumulates the gradients of hidden,
    weight and bias (each only when it requires grad). With a frozen weight and bias (LoRA) the forward saves
    softmax @ weight per row instead and the backward needs no logits. The entropies carry no gradient (a metric;
    an entropy bonus needs the plain path).

    Precision: the matmul runs in the dtype the plain `nn.Linear` head would use — the autocast dtype under
    autocast, else the inputs' dtype — and everything after it (log-sum-exp, softmax, entropy, the logits'
    gradient) in float32. In float32 this is the plain computation, chunk by chunk.
    """
    vocab_size = weight.shape[0]
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["default"]) // vocab_size)
    leading = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    with torch.autocast(device_type, enabled=False):
        logprobs, entropies = _ChunkedTokenLogprobs.apply(
            flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_rows), compute_dtype, with_entropy
        )
    return logprobs.view(leading), entropies.view(leading) if with_entropy else None


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
