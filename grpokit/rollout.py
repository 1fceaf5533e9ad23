"""Sampling completions from the policy: a batched, KV-cached decode loop that records log-probs.

Shapes: N = B·G rows (B prompts, G completions each, consecutive), P prompt tokens (left-padded), T completion
tokens (right-padded).

Why our own loop rather than `model.generate`: we need the policy's log-prob of every sampled token (so that with
μ > 1 the first pass's old log-probs need no extra forward), we compute each prompt's prefix once per group and
share its KV cache across the G rows, and we drop finished rows from the batch. The recorded log-prob is the
*policy's*, log softmax(logits / temperature) — the distribution the trainer optimises — and not the truncated
distribution that top-k / top-p / min-p / repetition penalty sample from (TRL makes the same choice).

Sampling uses one uniform number per row and step, drawn for all N rows whatever is still running, and picks the
token by inverse CDF: the tokens are a function of the probabilities and the seed only, not of which rows share
the batch, so the fast paths give the same tokens as the plain loop.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch


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


@dataclass
class Rollout:
    """What one generation produced. N = B·G rows, P prompt tokens, T completion tokens."""

    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded with pad_token_id
    completion_mask: torch.Tensor  # [N, T] 1 up to and including the first EOS
    logprobs: torch.Tensor  # [N, T] float32 log π(token) under logits / temperature (0 on padding)
    is_truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(-1)


# ------------------------------------------------------------------------------------------------ sampling


def filter_logits(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on scores [n, V] (float32), in transformers' order."""
    scores = scores / params.temperature
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


# ------------------------------------------------------------------------------------------------ decoders


def _logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: [0 0 0 1 2] for mask [0 0 1 1 1]."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def supports_kv_cache(model: torch.nn.Module) -> bool:
    """Hugging Face causal LMs take `past_key_values`; a plain nn.Module usually does not."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "past_key_values" in params and "attention_mask" in params


def forward_accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def preallocated_cache(capacity: int):
    """A transformers DynamicCache whose layers write each step's keys and values into buffers of `capacity`
    positions (`PreallocatedLayer`) instead of concatenating: a decode loop of T steps copies the cache once, not T
    times (the concatenation was a third of the rollout's time on a small model)."""
    from transformers import DynamicCache

    layer_class = preallocated_layer_class()
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: layer_class(capacity)
    return cache


@functools.cache  # the class subclasses a transformers class: defined on first use
def preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A full-attention cache layer over buffers [B, H, capacity, D]; `keys`/`values` are views of the filled
        part. Grows (one copy) if a sequence outruns the capacity. For sampling only: the writes are in place."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = capacity, 0
            self._keys = self._values = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self._keys is None or end > self._keys.shape[-2]:
                self._keys = self._grown(self._keys, key_states, max(end, self.capacity))
                self._values = self._grown(self._values, value_states, max(end, self.capacity))
            self._keys[:, :, self.length : end].copy_(key_states)
            self._values[:, :, self.length : end].copy_(value_states)
            self.length = end
            self._refresh()
            return self.keys, self.values

        def _grown(self, buffer, states, size):
            new = states.new_empty(*states.shape[:2], size, states.shape[-1])
            if buffer is not None:
                new[:, :, : self.length].copy_(buffer[:, :, : self.length])
            return new

        def _refresh(self):
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.length:
                self._keys = self._keys.repeat_interleave(repeats, dim=0)
                self._values = self._values.repeat_interleave(repeats, dim=0)
                self._refresh()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self._keys, self._values = self._keys[indices], self._values[indices]
                self._refresh()

        def reset(self) -> None:
            self.length, self._keys, self._values = 0, None, None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("PreallocatedLayer does not crop")

    return PreallocatedLayer


ONE_TOKEN_ATTENTION = "grpokit_one_token"


def one_token_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                is_causal=None, **kwargs):  # fmt: skip
    """transformers' SDPA attention, except for one-token queries (decode steps), which take two matmuls over the
    key/value heads (grouped-query heads packed, no repeat): on CPU, torch's SDPA kernels cost more than the
    arithmetic for these shapes (bf16 especially: 1.4 ms a call where the matmuls take 0.3). Same values up to
    float rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or dropout or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)  # fmt: skip
    batch, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h attends with key/value head h // g
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :length]  # [batch, 1, 1, length]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)  # [batch, kv_heads, g, value dim]
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


@functools.cache
def _register_one_token_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ONE_TOKEN_ATTENTION, one_token_attention_forward)
    AttentionMaskInterface.register(ONE_TOKEN_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def one_token_attention(model: torch.nn.Module, device: torch.device):
    """While sampling on CPU, a transformers model that uses SDPA attention takes `one_token_attention_forward`
    (its config's attention implementation is switched for the duration, and back)."""
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", lambda: None)()  # a PeftModel: the config the layers read
    config = getattr(base, "config", config)
    multimodal = bool(getattr(config, "sub_configs", None))  # the layers may read a sub-config's setting
    if device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa" or multimodal:
        yield
        return
    _register_one_token_attention()
    config._attn_implementation = ONE_TOKEN_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


class CachedDecoder:
    """Incremental decoding with a transformers KV cache; finished rows can be dropped from it."""

    def __init__(self, model, capacity: int = 0):
        self.model = model
        self.capacity = capacity  # prompt + completion positions, for a preallocated cache
        self.cache = None
        self.mask = None  # [n, P + t]
        self.next_position = None  # [n]

    def prefill(self, ids, mask, repeats: int = 1) -> torch.Tensor:
        self.cache = preallocated_cache(max(self.capacity, ids.shape[1]))
        positions = position_ids_from_mask(mask)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        self.cache = out.past_key_values
        logits = _logits_of(out)[:, -1]
        if repeats > 1:  # one prefill per group, shared by its G rows
            self.cache.batch_repeat_interleave(repeats)
            logits, mask, positions = (x.repeat_interleave(repeats, 0) for x in (logits, mask, positions))
        self.mask, self.next_position = mask, positions[:, -1] + 1
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None], attention_mask=self.mask, position_ids=self.next_position[:, None],
            past_key_values=self.cache, use_cache=True,
        )  # fmt: skip
        self.cache = out.past_key_values
        self.next_position = self.next_position + 1
        return _logits_of(out)[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask, self.next_position = self.mask[rows], self.next_position[rows]


class FullForwardDecoder:
    """No cache: re-runs the whole sequence each step (any module whose forward(input_ids) gives logits)."""

    def __init__(self, model):
        self.model = model
        self.use_mask = forward_accepts(model, "attention_mask")
        self.ids = self.mask = None

    def _forward(self) -> torch.Tensor:
        if self.use_mask:
            out = self.model(self.ids, attention_mask=self.mask, position_ids=position_ids_from_mask(self.mask))
        else:
            if not bool(self.mask.all()):
                raise ValueError(
                    "This model's forward() takes no attention_mask, so prompts in one batch must have equal "
                    "lengths; grpokit groups prompts by length for such models — pass equal-length prompt_ids."
                )
            out = self.model(self.ids)
        return _logits_of(out)[:, -1]

    def prefill(self, ids, mask, repeats: int = 1) -> torch.Tensor:
        self.ids, self.mask = ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
        return self._forward()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        return self._forward()

    def keep(self, rows: torch.Tensor) -> None:
        self.ids, self.mask = self.ids[rows], self.mask[rows]


# ------------------------------------------------------------------------------------------------ the loop


def groups_share_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int) -> bool:
    n = prompt_ids.shape[0]
    if num_generations <= 1 or n % num_generations:
        return False
    ids = prompt_ids.view(n // num_generations, num_generations, -1)
    mask = prompt_mask.view(n // num_generations, num_generations, -1)
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


# no_grad rather than inference_mode: the rollout's tensors feed autograd graphs later (as targets).
@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    num_generations: int = 1,
    use_cache: bool | None = None,
    share_prefix: bool = True,
    drop_finished: bool = True,
    all_done: Callable[[bool], bool] | None = None,
) -> Rollout:
    """Sample one completion per row of the left-padded prompts [N, P].

    num_generations: rows come in groups of this size that repeat one prompt; with `share_prefix` the prompt is
    run once per group. `drop_finished` removes rows that reached EOS from the decode batch (compacting the cache
    when at least a quarter of the running rows have finished). `use_cache=None` picks the KV-cached decoder when
    the model supports it.

    all_done: for sharded models (FSDP2, ZeRO-3), where every forward is a collective: called once per step with whether
    this process's rows have all finished, it returns whether every process's have, and the loop runs until then
    (finished rows keep decoding, masked out), so that all processes make the same forward calls.
    """
    # Eval mode: transformers turns the KV cache off for a training-mode model with gradient checkpointing.
    was_training = model.training
    model.eval()
    try:
        with one_token_attention(model, prompt_ids.device):
            return _generate(model, prompt_ids, prompt_mask, params, generator, num_generations, use_cache,
                             share_prefix, drop_finished, all_done)  # fmt: skip
    finally:
        model.train(was_training)


def _generate(model, prompt_ids, prompt_mask, params, generator, num_generations, use_cache, share_prefix,
              drop_finished, all_done) -> Rollout:  # fmt: skip
    n, device = prompt_ids.shape[0], prompt_ids.device
    use_cache = supports_kv_cache(model) if use_cache is None else use_cache
    capacity = prompt_ids.shape[1] + params.max_new_tokens
    decoder = CachedDecoder(model, capacity) if use_cache else FullForwardDecoder(model)
    repeats = num_generations if share_prefix and groups_share_prompts(prompt_ids, prompt_mask, num_generations) else 1
    logits = decoder.prefill(prompt_ids[::repeats], prompt_mask[::repeats], repeats)

    vocab_size = logits.shape[-1]
    seen = None
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids.clamp(max=vocab_size - 1), prompt_mask.bool())
    eos = torch.tensor(list(params.eos_token_ids), dtype=torch.long, device=device)
    completion_ids = torch.full((n, params.max_new_tokens), params.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, params.max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.full((n,), params.max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    rows = torch.arange(n, device=device)  # original row of each decode-batch row

    for t in range(params.max_new_tokens):
        uniforms = torch.rand(n, generator=generator, device=device)[rows]
        tokens, token_logprobs = sample_tokens(logits, uniforms, params, None if seen is None else seen[rows])
        completion_ids[rows, t] = tokens
        logprobs[rows, t] = token_logprobs
        if seen is not None:
            seen[rows, tokens] = True
        done_now = torch.isin(tokens, eos) if eos.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        done_now &= ~finished[rows]  # a finished row still in the batch may sample EOS again
        lengths[rows[done_now]] = t + 1
        finished[rows[done_now]] = True
        if t + 1 == params.max_new_tokens:
            break
        done = bool(finished.all())
        if all_done(done) if all_done is not None else done:
            break
        running = ~finished[rows]
        if drop_finished and int(running.sum()) <= 0.75 * len(rows):
            # Under all_done a process whose rows are all finished still steps: it keeps one row to do so.
            keep = running.nonzero().squeeze(-1) if not done else running.new_zeros(1, dtype=torch.long)
            decoder.keep(keep)
            rows, tokens = rows[keep], tokens[keep]
            # Finished rows that stay in the batch keep decoding; their tokens are masked out below.
        logits = decoder.step(tokens)

    completion_mask = (torch.arange(params.max_new_tokens, device=device)[None] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, params.pad_token_id)
    logprobs = logprobs * completion_mask
    width = int(lengths.max()) if n else 0  # trim the all-padding tail
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids[:, :width],
        completion_mask=completion_mask[:, :width],
        logprobs=logprobs[:, :width],
        is_truncated=~finished,
    )
