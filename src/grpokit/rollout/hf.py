"""The in-process engine: a batched, KV-cached decode loop over the policy being trained.

Why our own loop rather than `model.generate`: we record the log-prob of every sampled token under the distribution
it was drawn from, with its kept set under truncation (`grpokit.sampling_mask`; so that with μ > 1 in float32 the
first pass's old log-probs need no extra forward), we compute each prompt's prefix once per group and share its KV
cache across its rows, and we drop finished rows from the batch. Token draws are in `sampling.py`, the fast paths
(preallocated cache, one-token attention on CPU) in `fast.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable

import torch

from ..compat import cache_argument
from ..config import CACHE_IMPLEMENTATIONS
from ..distributed import is_sharded
from ..multimodal import MultimodalInputs, batch_model_inputs, rope_position_ids
from ..sampling_mask import PADDING, SamplingMask
from .decoders import CachedDecoder, FullForwardDecoder
from .engine import PromptBatch, Rollout, SamplingParams
from .fast import one_token_attention, packed_linears
from .sampling import sample_tokens
from .static import StaticDecoder, StaticDecoding


def generates_otherwise(model: torch.nn.Module) -> bool:
    """Whether `model.generate` is something other than transformers' own `GenerationMixin.generate`, which this
    engine's sampler stands in for: replaced on the instance or the class (a Hub `custom_generate`, a subclass's
    own, a mock of TRL's generate call). A peft model's generate calls its base model's, which decides."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    generate = getattr(base, "generate", None)
    if generate is None:  # a plain module: nothing else to call
        return False
    function = getattr(generate, "__func__", generate)
    return (getattr(function, "__module__", None), getattr(function, "__qualname__", None)) != (
        "transformers.generation.utils",
        "GenerationMixin.generate",
    )


class HFEngine:
    """Samples from the model being trained, in this process (`RolloutEngine`).

    autocast: a context factory the forwards run under (the trainer's mixed precision); all_done: see `generate`.
    Its log-probs are the training forward's (to float rounding) when no autocast is given: `logprobs_match_training`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str = "cpu",
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
        all_done: Callable[[bool], bool] | None = None,
        logprobs_match_training: bool | None = None,
        cache_implementation: str | None = None,
        compile: bool | None = None,
    ):
        self.model, self.device = model, torch.device(device)
        self.autocast, self.all_done = autocast or contextlib.nullcontext, all_done
        self.logprobs_match_training = autocast is None if logprobs_match_training is None else logprobs_match_training
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation={cache_implementation!r} is not supported by the in-process "
                f"sampler; use None or 'dynamic' (its preallocated cache) or 'static' (fixed shapes, "
                f"compiled with CUDA graphs on a GPU)."
            )
        self.static = None
        if cache_implementation == "static":
            if all_done is not None or is_sharded(model):
                raise ValueError(
                    "cache_implementation='static' is not supported with sharded models (FSDP2, "
                    "ZeRO-3), whose every forward is a collective; leave it unset."
                )
            self.static = StaticDecoding(model, compile=compile)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # the very weights being trained: nothing to copy
        if self.static is not None:
            self.static.model = model

    def __getstate__(self) -> dict:
        """Pickled (to an engine process: grpokit.rollout.process_engine) with its autocast as the autocast state it
        sets: the trainer's is the accelerator's, which reads accelerate's per-process state, absent from a new
        process."""
        return {**self.__dict__, "autocast": AutocastSettings.of(self.autocast, self.device.type)}

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        if prompts.processed is None and generates_otherwise(self.model):  # TRL calls it: so does grpokit then
            from .hf_generate import TransformersGenerateEngine

            generate_engine = TransformersGenerateEngine(self.model, self.device, autocast=self.autocast)
            return generate_engine.generate(prompts, params, seed)
        ids, mask = (t.to(self.device) for t in prompts.padded(params.pad_token_id))
        generator = torch.Generator(device=self.device).manual_seed(seed)
        counts = set(prompts.counts)
        # A sharded model's parameters belong to FSDP2 / ZeRO-3, which gather them per forward: their flags stay.
        casts_kept = contextlib.nullcontext() if is_sharded(self.model) else autocast_keeps_frozen_casts(self.model)
        with self.autocast(), casts_kept:
            return generate(
                self.model,
                ids,
                mask,
                params,
                generator=generator,
                num_generations=counts.pop() if len(counts) == 1 else 1,
                all_done=self.all_done,
                multimodal=prompts.multimodal(),
                static=self.static,
            )


@dataclasses.dataclass(frozen=True)
class AutocastSettings:
    """What an autocast context factory (the accelerator's) sets on one device type, as data that pickles; called,
    the same context again."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def of(cls, autocast: Callable[[], contextlib.AbstractContextManager], device_type: str) -> AutocastSettings:
        with autocast():
            return cls(
                device_type,
                torch.is_autocast_enabled(device_type),
                torch.get_autocast_dtype(device_type),
                torch.is_autocast_cache_enabled(),
            )

    def __call__(self) -> contextlib.AbstractContextManager:
        if not self.enabled:  # as accelerate: no context at all, not one that turns an outer autocast off
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache_enabled)


@contextlib.contextmanager
def autocast_keeps_frozen_casts(model: torch.nn.Module):
    """For the duration of a rollout, the model's frozen float32 parameters count as requiring grad, so that
    autocast casts each of them once and reuses the copy at every decode step. torch caches its casts only of leaf
    tensors that require grad: a frozen weight (a LoRA base loaded in float32, a frozen vision tower) would be cast
    again at every step. The rollout runs under no_grad, so no graph is built; the flags are restored after. Not
    for sharded models (FSDP2, ZeRO-3), whose parameters the sharding library manages."""
    frozen = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)


# ------------------------------------------------------------------------------------------------ decoders


def supports_kv_cache(model: torch.nn.Module) -> bool:
    """Hugging Face causal LMs take a KV cache (`compat.cache_argument`); a plain nn.Module usually does not."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return cache_argument(model) in params and "attention_mask" in params


def adapter_wraps_kv_cache_model(model: torch.nn.Module) -> bool:
    """A LoRA-style PeftModel (any task type) around a model that takes a KV cache. Its forward names no
    `past_key_values` (PeftModelForCausalLM passes it on through **kwargs, PeftModel takes only *args/**kwargs), so
    `supports_kv_cache` alone would send it to the no-cache decoder, which re-runs the whole sequence at every step.
    Prompt-learning adapters (prefix tuning...) manage the cache themselves: not these."""
    if not hasattr(model, "get_base_model"):
        return False
    config = getattr(model, "active_peft_config", None)
    if config is None or getattr(config, "is_prompt_learning", False):
        return False
    return supports_kv_cache(model.get_base_model())


# ------------------------------------------------------------------------------------------------ the loop


def groups_share_prompts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    num_generations: int,
    multimodal: MultimodalInputs | None = None,
) -> bool:
    """Whether rows come in groups of num_generations with one prompt each (the same ids, mask and images)."""
    n = prompt_ids.shape[0]
    if num_generations <= 1 or n % num_generations:
        return False
    ids = prompt_ids.view(n // num_generations, num_generations, -1)
    mask = prompt_mask.view(n // num_generations, num_generations, -1)
    same = bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())
    if multimodal is not None:
        index = multimodal.index.view(n // num_generations, num_generations)
        same = same and bool((index == index[:, :1]).all())
    return same


# On an accelerator, every read of a device value by the host (`bool(...)`, `int(...)`, boolean indexing) waits for
# all the work queued before it, so the host cannot queue the next step meanwhile. The loop keeps its bookkeeping in
# index writes, and asks whether rows have finished (to stop, or to drop them) every FINISHED_CHECK_EVERY steps
# only: until then finished rows keep decoding and are masked out afterwards, so the tokens are the same. On a CPU
# nothing is queued: every step.
FINISHED_CHECK_EVERY = 8


def finished_check_interval(device: torch.device) -> int:
    return 1 if device.type == "cpu" else FINISHED_CHECK_EVERY


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
    multimodal: MultimodalInputs | None = None,
    static: StaticDecoding | None = None,
) -> Rollout:
    """Sample one completion per row of the left-padded prompts [N, P].

    multimodal: the prompts' images (one entry per row); the prefill takes them (once per group when the group's
    rows share their prompt and images), the decode steps read them from the KV cache.

    num_generations: rows come in groups of this size that repeat one prompt; with `share_prefix` the prompt is
    run once per group. `drop_finished` removes rows that reached EOS from the decode batch (compacting the cache
    when at least a quarter of the running rows have finished). `use_cache=None` picks the KV-cached decoder when
    the model supports it.

    all_done: for sharded models (FSDP2, ZeRO-3), where every forward is a collective: called once per step with whether
    this process's rows have all finished, it returns whether every process's have, and the loop runs until then
    (finished rows keep decoding, masked out), so that all processes make the same forward calls.

    static: decode with fixed shapes into its cache, with its (compiled) step (`static.py`); no row is dropped.
    """
    # Eval mode: transformers turns the KV cache off for a training-mode model with gradient checkpointing.
    was_training = model.training
    model.eval()
    try:
        packed = contextlib.nullcontext() if static is not None else packed_linears(model, prompt_ids.device)
        with one_token_attention(model, prompt_ids.device, static=static is not None), packed:
            return _generate(
                model,
                prompt_ids,
                prompt_mask,
                params,
                generator,
                num_generations,
                use_cache,
                share_prefix,
                drop_finished,
                all_done,
                multimodal,
                static,
            )
    finally:
        model.train(was_training)


def _generate(
    model,
    prompt_ids,
    prompt_mask,
    params,
    generator,
    num_generations,
    use_cache,
    share_prefix,
    drop_finished,
    all_done,
    multimodal=None,
    static=None,
) -> Rollout:
    """`generate`'s phases: pick the decoder, prefill the prompts, decode step by step, assemble the Rollout."""
    if use_cache is None:
        use_cache = supports_kv_cache(model) or adapter_wraps_kv_cache_model(model)
        if multimodal is not None and hasattr(model, "get_base_model"):  # a PeftModel without a task type
            use_cache = supports_kv_cache(model.get_base_model())
    capacity = prompt_ids.shape[1] + params.max_new_tokens
    if static is not None:
        if not use_cache:
            raise ValueError("cache_implementation='static' needs a model that takes a KV cache.")
        decoder, drop_finished = StaticDecoder(model, static, capacity), False
    else:
        decoder = CachedDecoder(model, capacity) if use_cache else FullForwardDecoder(model)
    multimodal = None if multimodal is None else multimodal.to(prompt_ids.device)
    logits = _prefill(model, decoder, prompt_ids, prompt_mask, num_generations, share_prefix, multimodal)
    state = DecodeState.start(prompt_ids, prompt_mask, params, logits.shape[-1])
    _decode(decoder, logits, state, params, generator, drop_finished, all_done)
    return state.rollout(prompt_ids, prompt_mask, params, multimodal)


def _prefill(model, decoder, prompt_ids, prompt_mask, num_generations, share_prefix, multimodal) -> torch.Tensor:
    """The prompts' forward (once per group when its rows share their prompt): the first step's logits [N, V]."""
    repeats = (
        num_generations
        if share_prefix and groups_share_prompts(prompt_ids, prompt_mask, num_generations, multimodal)
        else 1
    )
    prefill_rows = torch.arange(0, prompt_ids.shape[0], repeats, device=prompt_ids.device)
    prompt_inputs = batch_model_inputs(multimodal, prefill_rows, prompt_ids.shape[1], model=model)
    if prompt_inputs:
        rope = rope_position_ids(model, prompt_ids[::repeats], prompt_mask[::repeats], multimodal, prefill_rows)
        return decoder.prefill(prompt_ids[::repeats], prompt_mask[::repeats], repeats, prompt_inputs, rope)
    return decoder.prefill(prompt_ids[::repeats], prompt_mask[::repeats], repeats)


@dataclasses.dataclass
class DecodeState:
    """What the decode loop writes, one row per completion: N rows, T = max_new_tokens, V the vocabulary."""

    completion_ids: torch.Tensor  # [N, T] sampled tokens (pad after a row's end)
    logprobs: torch.Tensor  # [N, T] float32 their sampling log-probs
    kept_ids: list  # per step: (rows [n], kept ids [n, K]) where the engine records a sampling mask
    lengths: torch.Tensor  # [N] tokens up to and including EOS (T for a row that did not finish)
    finished: torch.Tensor  # [N] bool: sampled an EOS
    seen: torch.Tensor | None  # [N, V] bool: tokens in the prompt or sampled so far (for the repetition penalty)
    rows: torch.Tensor  # [n] the original row of each row of the decode batch

    @classmethod
    def start(cls, prompt_ids, prompt_mask, params: SamplingParams, vocab_size: int) -> DecodeState:
        n, device = prompt_ids.shape[0], prompt_ids.device
        seen = None
        if params.repetition_penalty != 1.0:
            # Padding points at the row's first real token (already seen), so that a pad id is not marked seen.
            real = prompt_mask.bool()
            first_real = prompt_ids.gather(1, real.long().argmax(1, keepdim=True))
            ids = torch.where(real, prompt_ids, first_real).clamp(max=vocab_size - 1)
            seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device).scatter_(1, ids, True)
        return cls(
            completion_ids=torch.full((n, params.max_new_tokens), params.pad_token_id, dtype=torch.long, device=device),
            logprobs=torch.zeros(n, params.max_new_tokens, dtype=torch.float32, device=device),
            kept_ids=[],
            lengths=torch.full((n,), params.max_new_tokens, dtype=torch.long, device=device),
            finished=torch.zeros(n, dtype=torch.bool, device=device),
            seen=seen,
            rows=torch.arange(n, device=device),
        )

    def record(self, t: int, tokens, token_logprobs, kept, eos: torch.Tensor) -> None:
        """Step t's draws of the decode batch's rows."""
        rows = self.rows
        self.completion_ids[rows, t] = tokens
        self.logprobs[rows, t] = token_logprobs
        if kept is not None:
            self.kept_ids.append((rows, kept))
        if self.seen is not None:
            self.seen[rows, tokens] = True
        done_now = torch.isin(tokens, eos) if eos.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        done_now &= ~self.finished[rows]  # a finished row still in the batch may sample EOS again
        self.lengths[rows] = torch.where(done_now, t + 1, self.lengths[rows])  # index writes: no wait for the device
        self.finished[rows] = self.finished[rows] | done_now

    def sampling_mask(self, params: SamplingParams, completion_mask: torch.Tensor) -> SamplingMask | None:
        """The steps' kept sets as one [N, T', K] tensor (T' = completion_mask's width, K: the widest kept set of a
        real token), or None where none was kept."""
        if not self.kept_ids:
            return None
        (n, width), kept_width = completion_mask.shape, max(kept.shape[1] for _, kept in self.kept_ids)
        kept_ids = torch.full((n, width, kept_width), PADDING, dtype=torch.int32, device=self.rows.device)
        for t, (rows, kept) in enumerate(self.kept_ids[:width]):
            kept_ids[rows, t, : kept.shape[1]] = kept
        kept_ids.masked_fill_(completion_mask[:, :, None] == 0, PADDING)  # rows decoding on past their end
        mask = SamplingMask(kept_ids, params.repetition_penalty, tuple(params.suppress_token_ids))
        return mask.trimmed()

    def rollout(self, prompt_ids, prompt_mask, params: SamplingParams, multimodal) -> Rollout:
        n, device = prompt_ids.shape[0], prompt_ids.device
        completion_mask = (torch.arange(params.max_new_tokens, device=device)[None] < self.lengths[:, None]).long()
        completion_ids = self.completion_ids.masked_fill(completion_mask == 0, params.pad_token_id)
        logprobs = self.logprobs * completion_mask
        width = int(self.lengths.max()) if n else 0  # trim the all-padding tail
        mask = completion_mask[:, :width]
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids[:, :width],
            attention_mask=mask,
            loss_mask=mask.clone(),
            lengths=self.lengths,
            is_truncated=~self.finished,
            sampling_logprobs=logprobs[:, :width],
            multimodal=multimodal,
            sampling_mask=self.sampling_mask(params, mask),
        )


def _decode(decoder, logits, state: DecodeState, params, generator, drop_finished, all_done) -> None:
    """Sample a token per running row and step the decoder, until every row has finished or max_new_tokens."""
    n, device = state.completion_ids.shape[0], state.rows.device
    eos = torch.tensor(list(params.eos_token_ids), dtype=torch.long, device=device)
    check_every = finished_check_interval(device)
    for t in range(params.max_new_tokens):
        uniforms = torch.rand(n, generator=generator, device=device)[state.rows]
        seen = None if state.seen is None else state.seen[state.rows]
        tokens, token_logprobs, kept = sample_tokens(logits, uniforms, params, seen)
        state.record(t, tokens, token_logprobs, kept, eos)
        if t + 1 == params.max_new_tokens:
            break
        if (t + 1) % check_every == 0:
            done = bool(state.finished.all())
            if all_done(done) if all_done is not None else done:
                break
            running = ~state.finished[state.rows]
            if drop_finished and int(running.sum()) <= 0.75 * len(state.rows):
                # Under all_done a process whose rows are all finished still steps: it keeps one row to do so.
                keep = running.nonzero().squeeze(-1) if not done else running.new_zeros(1, dtype=torch.long)
                decoder.keep(keep)
                state.rows, tokens = state.rows[keep], tokens[keep]
        # Finished rows that stay in the batch keep decoding; `DecodeState.rollout` masks their tokens out.
        logits = decoder.step(tokens)
