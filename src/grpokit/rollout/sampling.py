"""Drawing tokens: temperature, top-k, top-p, min-p, suppressed tokens and the repetition penalty, by inverse CDF.

Sampling uses one uniform number per row and step and picks the token by inverse CDF: the tokens are a function of
the probabilities and the seed only, not of which rows share the batch, so the in-process engine's fast paths give
the same tokens as its plain loop.

The log-prob recorded with each token is that of the distribution it was drawn from (`keep_sampling_mask`, the
default): log-softmax over the kept tokens of the processed logits, with the kept set returned for the trainer to
renormalise over (`grpokit.sampling_mask`). With keep_sampling_mask=False it is the *policy's*,
log softmax(logits / temperature), as TRL 1.16 records it.
"""

from __future__ import annotations

import dataclasses

import torch

from ..sampling_mask import PADDING, apply_repetition_penalty, kept_ids_of
from .engine import SamplingParams

__all__ = ["apply_repetition_penalty", "filter_logits", "filter_logits_as_vllm", "is_filtered", "sample_tokens"]


def truncates(params: SamplingParams) -> bool:
    """Whether top-k, top-p or min-p drop tokens (suppression and the penalty keep the rest of the vocabulary)."""
    return (
        (params.top_k is not None and params.top_k > 0)
        or params.top_p < 1.0
        or (params.min_p is not None and params.min_p > 0)
    )


def processes(params: SamplingParams) -> bool:
    """Whether the engine draws from a processed distribution: truncation, a repetition penalty or suppressed
    tokens (with keep_sampling_mask, the one whose log-probs it reports and whose kept sets the trainer replays)."""
    return truncates(params) or params.repetition_penalty != 1.0 or bool(params.suppress_token_ids)


def kept_set_bound(params: SamplingParams, vocab_size: int) -> int | None:
    """The top-k the sampler applies: the user's, and with keep_sampling_mask under truncation at most
    sampling_mask_max_tokens (it bounds the recorded kept sets; prime-rl bounds them the same way); None: none."""
    top_k = params.top_k if params.top_k is not None and params.top_k > 0 else None
    if params.keep_sampling_mask and truncates(params):
        top_k = min(top_k or vocab_size, params.sampling_mask_max_tokens)
    return top_k if top_k is not None and top_k < vocab_size else None


def filter_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on scores [n, V] (float32), in transformers' order. With
    keep_sampling_mask top-k keeps exactly k tokens (ties at the k-th broken by index), so that a kept set never
    outgrows the bound it is recorded in; without, ties at the k-th are all kept, as transformers keeps them."""
    scores = scores / params.temperature
    if params.suppress_token_ids:
        scores = scores.index_fill(-1, torch.tensor(params.suppress_token_ids, device=scores.device), float("-inf"))
    top_k = kept_set_bound(params, scores.shape[-1])
    if top_k is not None and params.keep_sampling_mask:
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, torch.topk(scores, top_k, dim=-1).indices, True)
        scores = scores.masked_fill(~kept, float("-inf"))
    elif top_k is not None:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token always stays.
        drop_sorted = (cumulative - sorted_scores.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    if params.min_p is not None and params.min_p > 0:
        probs = scores.softmax(-1)
        threshold = params.min_p * probs.max(-1, keepdim=True).values
        scores = scores.masked_fill(probs < threshold, float("-inf"))
    return scores


def filter_logits_as_vllm(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`filter_logits` in vLLM's order (its v1 sampler: temperature, then min-p, then top-k and top-p together), which
    differs from transformers' where min-p and top-p are both set: top-p then sees the min-p survivors."""
    if params.min_p is not None and params.min_p > 0:
        probs = (scores / params.temperature).softmax(-1)
        threshold = params.min_p * probs.max(-1, keepdim=True).values
        scores = scores.masked_fill(probs < threshold, float("-inf"))
    return filter_logits(scores, dataclasses.replace(params, min_p=None))


def is_filtered(params: SamplingParams, seen: torch.Tensor | None = None) -> bool:
    """Whether tokens are drawn from something other than softmax(logits / temperature)."""
    return (
        (params.repetition_penalty != 1.0 and seen is not None) or truncates(params) or bool(params.suppress_token_ids)
    )


def _sample_unfiltered(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` when the sampling distribution is the policy's: one exp pass serves both the draw and the
    log-prob (the CDF needs no normalisation, the draw scales the uniform by the total), instead of a softmax for
    the draw and a second log-softmax for the log-prob."""
    scaled = logits if temperature == 1.0 else logits / temperature
    row_max = scaled.amax(-1, keepdim=True)
    exp = (scaled - row_max).exp_()
    log_total = exp.sum(-1).log()
    cdf = exp.cumsum_(-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    # A token of zero probability has a flat CDF step; searchsorted(right=True) skips those, except past the last
    # positive one (rounding at the edge): step back to the last token whose CDF step is positive.
    previous = torch.where(tokens > 0, cdf.gather(-1, (tokens - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    bad = cdf.gather(-1, tokens[:, None]).squeeze(-1) <= previous
    if bad.any():
        steps = torch.diff(cdf[bad], dim=-1, prepend=torch.zeros_like(cdf[bad][:, :1])) > 0
        positions = torch.arange(cdf.shape[-1], device=cdf.device).expand_as(steps)
        tokens[bad] = torch.where(steps & (positions <= tokens[bad, None]), positions, -1).max(-1).values
    logprobs = scaled.gather(-1, tokens[:, None]).squeeze(-1) - row_max.squeeze(-1) - log_total
    return tokens, logprobs


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draw one token per row of logits [n, V] by inverse CDF with uniforms [n] in [0, 1).

    Returns (tokens [n], log-probs [n], kept ids [n, K] or None). The log-probs are those of the distribution drawn
    from, and the kept ids its kept set (`sampling_mask.kept_ids_of`; one PADDING column where nothing is truncated),
    where keep_sampling_mask and some processing apply; otherwise the policy's, under logits / temperature, and
    None.
    """
    logits = logits.float()
    if not is_filtered(params, seen):
        return *_sample_unfiltered(logits, uniforms, params.temperature), None
    return _sample_filtered(logits, uniforms, params, seen)


def _sample_filtered(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The general `sample_tokens`: draw from the filtered distribution, score under it (keep_sampling_mask) or
    under the policy's."""
    scores = logits
    if params.repetition_penalty != 1.0 and seen is not None:
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    filtered = filter_logits(scores, params)
    probs = filtered.softmax(-1)
    cdf = probs.cumsum(-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    # Rounding in the cumulative sum can land on a zero-probability token at the edge: step back to one that is
    # allowed (the last token with non-zero probability at or before the drawn index).
    bad = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bad.any():
        allowed = probs[bad] > 0
        positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(allowed)
        before = positions <= tokens[bad, None]
        fallback = torch.where(allowed & before, positions, -1).max(-1).values
        first_allowed = allowed.float().argmax(-1)
        tokens[bad] = torch.where(fallback >= 0, fallback, first_allowed)
    if not params.keep_sampling_mask:
        policy_logprobs = (logits / params.temperature).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, policy_logprobs, None
    sampled_logprobs = filtered.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    if truncates(params):
        kept = kept_ids_of(filtered, kept_set_bound(params, filtered.shape[-1]) or filtered.shape[-1])
    else:
        kept = torch.full((len(tokens), 1), PADDING, dtype=torch.int32, device=tokens.device)
    return tokens, sampled_logprobs, kept
