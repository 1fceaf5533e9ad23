"""Drawing tokens: temperature, top-k, top-p, min-p, suppressed tokens and the repetition penalty, by inverse CDF.

Sampling uses one uniform number per row and step and picks the token by inverse CDF: the tokens are a function of
the probabilities and the seed only, not of which rows share the batch, so the in-process engine's fast paths give
the same tokens as its plain loop. The log-prob recorded with each token is the *policy's*,
log softmax(logits / temperature), and not that of the truncated distribution top-k / top-p / min-p / repetition
penalty sample from (TRL makes the same choice).
"""

from __future__ import annotations

import torch

from .engine import SamplingParams


def filter_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on scores [n, V] (float32), in transformers' order."""
    scores = scores / params.temperature
    if params.suppress_token_ids:
        scores = scores.index_fill(-1, torch.tensor(params.suppress_token_ids, device=scores.device), float("-inf"))
    if params.top_k is not None and 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
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


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL penalty (Keskar et al. 2019) on tokens already seen: positive logits / penalty, negative · penalty."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def is_filtered(params: SamplingParams, seen: torch.Tensor | None = None) -> bool:
    """Whether tokens are drawn from something other than softmax(logits / temperature)."""
    return (
        (params.repetition_penalty != 1.0 and seen is not None)
        or (params.top_k is not None and params.top_k > 0)
        or params.top_p < 1.0
        or (params.min_p is not None and params.min_p > 0)
        or bool(params.suppress_token_ids)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [n, V] by inverse CDF with uniforms [n] in [0, 1).

    Returns (tokens [n], policy log-probs [n] of those tokens under logits / temperature).
    """
    logits = logits.float()
    if not is_filtered(params, seen):
        return _sample_unfiltered(logits, uniforms, params.temperature)
    return _sample_filtered(logits, uniforms, params, seen)


def _sample_filtered(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general `sample_tokens`: draw from the filtered distribution, score under the policy's."""
    scores = logits
    if params.repetition_penalty != 1.0 and seen is not None:
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    probs = filter_logits(scores, params).softmax(-1)
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
    policy_logprobs = (logits / params.temperature).log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, policy_logprobs
