"""Kept sets replayed on the trainer's logits, for an engine that draws from a processed distribution and reports
its log-probs but not its kept sets: vLLM where it returns no sampling mask (on CPU, whose model runner builds none;
in server mode).

vLLM's `processed_logprobs` are log-softmax over the tokens that survived its truncation. To put π_old and π_θ on
the same support, the trainer applies vLLM's processing to the logits of the policy that sampled (π_old: the same
weights at staleness 0, its own kernels) — the repetition penalty on every token before the position, the
temperature, min-p, then top-k and top-p (`sampling.filter_logits_as_vllm`) — and keeps the result as the batch's
`SamplingMask`. This approximates vLLM's kept sets: a token within float rounding of a cut-off (vLLM's logits and
the trainer's differ by ~1e-5 in float32, more in bfloat16) may fall on the other side of it, and the sampled token
is added to its kept set where the replay dropped it (a token vLLM drew was in vLLM's set). Suppressed tokens, a
logit bias of -100 in vLLM, are dropped from the replayed sets outright.
"""

from __future__ import annotations

import torch

from .batch import TrainBatch
from .logprobs import completion_logits
from .rollout.engine import SamplingParams
from .rollout.sampling import apply_repetition_penalty, filter_logits_as_vllm, processes, truncates
from .sampling_mask import PADDING, SamplingMask, first_seen_positions, kept_ids_of


def needs_replay(batch: TrainBatch, params: SamplingParams) -> bool:
    """Whether the batch's sampling log-probs are of a processed distribution whose kept sets did not come with it."""
    return params.keep_sampling_mask and processes(params) and batch.sampling_mask is None


@torch.no_grad()
def replayed_sampling_mask(model, batch: TrainBatch, params: SamplingParams, rows: int, autocast) -> SamplingMask:
    """The batch's kept sets [N, T, K], replayed on `model`'s logits `rows` rows at a time (under `autocast`).
    Without truncation every position keeps the whole vocabulary but the suppressed tokens: no forward runs."""
    width = batch.completion_ids.shape[1]
    if not truncates(params):
        kept_ids = torch.full((len(batch), width, 1), PADDING, dtype=torch.int32, device=batch.completion_ids.device)
        return SamplingMask(kept_ids, params.repetition_penalty, tuple(params.suppress_token_ids))
    parts = []
    for part in batch.split(rows):
        with autocast():
            logits = completion_logits(model, part.input_ids, part.input_mask, None, width, multimodal=part.multimodal)
        parts.append(_kept_sets(logits.float(), part, params))
    kept_width = max(p.shape[-1] for p in parts)
    pad = lambda t: torch.nn.functional.pad(t, (0, kept_width - t.shape[-1]), value=PADDING)  # noqa: E731
    kept_ids = torch.cat([pad(p) for p in parts])
    return SamplingMask(kept_ids, params.repetition_penalty, tuple(params.suppress_token_ids)).trimmed()


def _kept_sets(logits: torch.Tensor, part: TrainBatch, params: SamplingParams) -> torch.Tensor:
    """[n, T, K] kept ids of logits [n, T, V], with the sampled token added where the replay dropped it."""
    n, width, vocab_size = logits.shape
    if params.repetition_penalty != 1.0:
        first_seen = first_seen_positions(part.input_ids, part.input_mask, vocab_size)  # [n, V]
        positions = part.prompt_ids.shape[1] + torch.arange(width, device=logits.device)  # [T]
        seen = first_seen[:, None, :] < positions[None, :, None]  # [n, T, V]
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.suppress_token_ids:
        suppressed = torch.tensor(params.suppress_token_ids, device=logits.device)
        logits = logits.index_fill(-1, suppressed, float("-inf"))
    flat = filter_logits_as_vllm(logits.reshape(n * width, vocab_size), params)
    bound = min(params.top_k or vocab_size, params.sampling_mask_max_tokens, vocab_size)
    kept = kept_ids_of(flat, bound)  # [n·T, K]
    targets = part.completion_ids.reshape(-1, 1).int()
    missing = ~(kept == targets).any(-1, keepdim=True)
    kept = torch.cat([kept, torch.where(missing, targets, PADDING)], -1)
    kept = kept.view(n, width, -1)
    return kept.masked_fill(part.attention_mask[:, :, None] == 0, PADDING)
