"""The training forward: token log-probs (and entropies) of completions under a policy or reference.

`token_logprobs` is what the trainer calls. It runs either the model's own forward and takes log-probs of its
logits (`selective_log_softmax`, chunked so that float32 upcasts stay small), or, for the architectures in
`CHUNKED_HEAD_MODEL_TYPES`, the decoder alone with the LM head applied in chunks of rows
(`chunked_token_logprobs`), so that the [N, T, V] logits never exist; with repeated prompts (G completions per
prompt) each prompt runs through the decoder once (`shared_prompt_hidden`). Every fast path equals the plain
forward up to float rounding (tests/test_chunked.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from .compat import cache_argument, cache_from_layers, is_activation_checkpointing, output_cache, output_embeddings
from .cpu_matmul import FLOAT32_HEAD, Float32Head
from .cpu_memory import return_free_memory
from .distributed import is_sharded
from .forward import forward_accepts, logits_of, model_cache, model_config, position_ids_from_mask
from .head_autograd import (
    add_weight_grad,
    frozen_head_grad,
    head_grad_accumulators,
    head_input_grads,
    save_for_logprobs_backward,
)
from .models import is_peft_model
from .multimodal import MultimodalInputs, batch_model_inputs, is_vision_language_model, rope_position_ids
from .packing import pack_rows
from .sampling_mask import SamplingMask, first_seen_positions, replayed_token_logprobs

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
        scratch = _ChunkScratch(
            min(chunk_rows, rows), weight.shape[0], compute_dtype, hidden.device, exp=with_entropy or frozen_head
        )
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, start + chunk_rows)
            logits = scratch.logits_of(hidden[chunk], weight_c, bias_c, temperature)  # [c, V]
            target_logits = logits.gather(-1, targets[chunk, None]).squeeze(-1)
            # In place from here on: the logits become logits - max (torch.logsumexp's order of operations).
            row_max = logits.amax(-1, keepdim=True)
            row_max.masked_fill_(row_max.abs() == float("inf"), 0)
            shifted = logits.sub_(row_max)
            if with_entropy or frozen_head:
                # entropy = lse - sum(softmax · logits), from the same exp pass that gives the log-sum-exp.
                exp = torch.exp(shifted, out=scratch.exp[: len(shifted)])
                total = exp.sum(-1)
                lse[chunk] = total.log() + row_max.squeeze(-1)
                if frozen_head:  # softmax @ W, the expected output embedding of each row
                    expected_rows[chunk] = (scratch.cast(exp) @ weight_c).to(out_dtype) / total[:, None]
                if with_entropy:
                    entropies[chunk] = total.log() - shifted.mul_(exp).sum(-1) / total
            else:
                lse[chunk] = shifted.exp_().sum(-1).log_() + row_max.squeeze(-1)
            logprobs[chunk] = target_logits - lse[chunk]
        save_for_logprobs_backward(
            ctx,
            frozen_head,
            hidden,
            weight,
            bias,
            targets,
            lse,
            expected_rows,
            entropies,
            temperature=temperature,
            chunk_rows=chunk_rows,
            compute_dtype=compute_dtype,
        )
        return logprobs, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropies):
        hidden, weight, bias, targets, lse, expected_rows = ctx.saved_tensors
        temperature, chunk_rows, compute_dtype = ctx.temperature, ctx.chunk_rows, ctx.compute_dtype
        accumulate_dtype = _softmax_dtype(compute_dtype)
        grad_logprobs = grad_logprobs.to(accumulate_dtype) / temperature
        if ctx.frozen_head:
            grad_hidden = frozen_head_grad(grad_logprobs, weight, targets, expected_rows)
            return (grad_hidden.to(ctx.hidden_dtype), None, None, None, None, None, None, None)
        (need_hidden, need_weight, need_bias), grad_hidden, grad_weight, grad_bias = head_grad_accumulators(
            ctx, hidden, weight, accumulate_dtype
        )
        weight_c = weight.to(compute_dtype)
        bias_c = None if bias is None else bias.to(compute_dtype)
        scratch = _ChunkScratch(
            min(chunk_rows, hidden.shape[0]), weight.shape[0], compute_dtype, hidden.device, exp=False
        )
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                chunk = slice(start, start + chunk_rows)
                hidden_chunk = hidden[chunk]
                logits = scratch.logits_of(hidden_chunk, weight_c, bias_c, temperature)
                # d logprob / d logits = onehot(target) - softmax, times the upstream gradient and 1/temperature
                # (the logits were divided by it); computed in place in the chunk's logits buffer.
                grad_logits = logits.sub_(lse[chunk, None]).exp_().mul_(-grad_logprobs[chunk, None])
                grad_logits.scatter_add_(-1, targets[chunk, None], grad_logprobs[chunk, None])
                if need_bias:
                    grad_bias += grad_logits.sum(0)
                grad_logits = scratch.cast(grad_logits)
                if need_hidden:
                    grad_hidden[chunk] = (grad_logits @ weight_c).to(hidden.dtype)
                if need_weight:
                    add_weight_grad(grad_weight, grad_logits, hidden_chunk.to(compute_dtype))
        return head_input_grads(grad_hidden, grad_weight, grad_bias, weight, bias, num_other_inputs=5)


def _head_compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, fp32_head: bool) -> torch.dtype:
    """The dtype of the LM head's matmul, as the plain `nn.Linear` head would run it: float32 with fp32_head, else
    the autocast dtype under autocast, else the inputs'."""
    device_type = hidden.device.type
    if fp32_head:
        return torch.float32
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _softmax_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and half-precision matmuls, float64 for float64."""
    return torch.promote_types(compute_dtype, torch.float32)


class _ChunkScratch:
    """The [c, V] tensors of one chunk, allocated once per pass and reused by every chunk (views of the first
    rows for a shorter last chunk): `product` (hidden @ weight.T in the matmul's dtype, and the cast of a float32
    chunk back to it), `logits` (its float32 copy, in place from there on) and `exp` (exp of the shifted logits,
    for the entropy and softmax @ W). Fresh tensors per chunk would hold the previous chunk's until their names are
    rebound (one [c, V] float32 more at the peak) and, on a CPU, fault in every page again (each is far above
    glibc's mmap threshold)."""

    def __init__(self, rows: int, vocab_size: int, compute_dtype, device, exp: bool = True):
        softmax_dtype = _softmax_dtype(compute_dtype)
        self.logits = torch.empty(rows, vocab_size, dtype=softmax_dtype, device=device)
        self.product = (
            self.logits
            if compute_dtype == softmax_dtype
            else torch.empty(rows, vocab_size, dtype=compute_dtype, device=device)
        )
        self.exp = torch.empty(rows, vocab_size, dtype=softmax_dtype, device=device) if exp else None

    def logits_of(self, hidden_chunk, weight, bias, temperature) -> torch.Tensor:
        """(hidden_chunk @ weight.T + bias) / temperature, [c, V] in float32 (float64 for float64), the matmul in
        `product`'s dtype."""
        rows = hidden_chunk.shape[0]
        product, logits = self.product[:rows], self.logits[:rows]
        hidden_chunk = hidden_chunk.to(product.dtype)
        if bias is None:
            torch.mm(hidden_chunk, weight.t(), out=product)
        else:
            torch.addmm(bias, hidden_chunk, weight.t(), out=product)
        if logits is not product:
            logits.copy_(product)
        if temperature != 1.0:
            logits.div_(temperature)
        return logits

    def cast(self, chunk: torch.Tensor) -> torch.Tensor:
        """A float32 chunk in the matmul's dtype, in `product` (free once the logits are copied out of it)."""
        if chunk.dtype == self.product.dtype:
            return chunk
        return self.product[: len(chunk)].copy_(chunk)


# Logits per chunk (chunk_rows × V float32 values). On CPU a chunk that fits in the last-level cache is fastest
# (measured on a 32 MiB-L3 EPYC with V = 32k, H = 256: 64–256-row chunks take ~35 % less time in the forward than
# 512–2048-row ones, and the same in the backward); an accelerator wants large matmuls and few launches, and has
# the memory for 256 MiB of them.
CHUNK_ELEMENTS = {"cpu": 2**22, "default": 2**26}
# But at least this many rows: each chunk of the backward adds a [V, H] product into the weight's gradient, and
# with a large vocabulary few-row chunks make that pass dominate. Forward + backward of 512 rows through a
# Qwen2.5-0.5B head (V = 151,936, H = 896, bf16 autocast, 1 thread; benchmarks/chunk_rows.py): 27-row chunks (the
# element budget alone) 11.1 s, 128 rows 4.5 s, 256 rows 3.5 s, 512 rows 3.1 s, the plain head 2.3 s.
MIN_CHUNK_ROWS = 256
# A head without a weight gradient (LoRA, the reference, π_old) has no such pass: its backward is a gather. Its
# chunks trade the forward's speed for memory alone: 512 rows forward + backward through a frozen bf16 Qwen2.5-0.5B
# head with entropies (`benchmarks/chunk_rows.py --frozen`, 1 thread, AVX-512 BF16 EPYC): 64-row chunks 2.13 s and
# +88 MiB at the peak, 128 rows 1.84 s and +185 MiB, 256 rows 1.74 s and +371 MiB, 512 rows 1.95 s and +742 MiB.
MIN_FROZEN_CHUNK_ROWS = 128


# The chunked head gives the heap's free pages back first (`chunked_token_logprobs`) only where one chunk's float32
# logits take at least this many bytes: the trim lowers the peak by at most what the head then allocates (its [c, V]
# tensors), and costs a page fault per 4 KiB of the free pages that the next tensors reuse. A 53-token vocabulary's
# chunk is under 1 MiB, and its two trims per step took 30-60 ms of a 2 s step, besides the faults
# (`benchmarks/profile_step.py --config small`).
HEAD_TRIM_MIN_BYTES = 16 << 20


def head_trims_heap(chunk_rows: int, vocab_size: int) -> bool:
    """Whether the chunked head's chunks (chunk_rows × vocab_size float32 logits) are large enough to trim the heap
    for before they are allocated (HEAD_TRIM_MIN_BYTES)."""
    return chunk_rows * vocab_size * 4 >= HEAD_TRIM_MIN_BYTES


def default_chunk_rows(weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """Rows per chunk of a chunked LM head [V, H]: the device's element budget over V, but at least
    `MIN_CHUNK_ROWS` when the head's weight (or bias) gets a gradient, `MIN_FROZEN_CHUNK_ROWS` otherwise."""
    weight_grad = torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad))
    budget = CHUNK_ELEMENTS.get(weight.device.type, CHUNK_ELEMENTS["default"])
    return max(MIN_CHUNK_ROWS if weight_grad else MIN_FROZEN_CHUNK_ROWS, budget // weight.shape[0])


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    with_entropy: bool = False,
    fp32_head: bool = False,
    float32_gemm: bool = False,
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
    an entropy bonus needs the plain path). On a CPU the heap's free pages are first given back to the OS
    (`cpu_memory.return_free_memory`) where a chunk is large (`head_trims_heap`): the decoder's forward leaves ~250
    MiB of them at the Qwen2.5-0.5B shape (glibc keeps what the layers freed), and the head's peak would stack on
    them.

    Precision: the matmul runs in the dtype the plain `nn.Linear` head would use — the autocast dtype under
    autocast, else the inputs' dtype — and everything after it (log-sum-exp, softmax, entropy, the logits'
    gradient) in float32. In float32 this is the plain computation, chunk by chunk. `fp32_head` runs the matmul in
    float32 too (ScaleRL's / TRL's cast_lm_head_to_fp32). `float32_gemm` (set by `cpu_matmul.float32_matmuls` on
    CPUs without bfloat16 hardware) runs bfloat16 matmuls through float32 gemms (`cpu_matmul.Float32Head`), in
    blocks of the vocabulary; `chunk_rows` does not apply then.
    """
    device_type = hidden.device.type
    compute_dtype = _head_compute_dtype(hidden, weight, fp32_head)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight, bias)
    leading = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if device_type == "cpu" and head_trims_heap(min(chunk_rows, flat_hidden.shape[0]), weight.shape[0]):
        return_free_memory()  # the decoder's freed activations, which the [c, V] tensors would stack on
    if float32_gemm and compute_dtype == torch.bfloat16 and device_type == "cpu":
        with torch.autocast(device_type, enabled=False):
            logprobs, entropies = Float32Head.apply(
                flat_hidden, weight, bias, flat_targets, float(temperature), with_entropy
            )
        return logprobs.view(leading), entropies.view(leading) if with_entropy else None
    with torch.autocast(device_type, enabled=False):
        logprobs, entropies = _ChunkedTokenLogprobs.apply(
            flat_hidden, weight, bias, flat_targets, float(temperature), int(chunk_rows), compute_dtype, with_entropy
        )
    return logprobs.view(leading), entropies.view(leading) if with_entropy else None


# ------------------------------------------------------------------------------------------ the training forward

# The chunked LM head (`loss.chunked_token_logprobs`) replaces `logits = lm_head(hidden_states)` only where that
# line is the whole head. These architectures' transformers implementations apply a plain Linear to the decoder's
# last hidden state and nothing after it but, for NemotronH, a cast to float32, which the chunked head's float32
# softmax matches (read in transformers 5.23; tests/test_chunked.py compares the two paths on a tiny model of each).
# Gemma 3 soft-caps only where its config sets `final_logit_softcapping` (refused below, as for every Gemma 2);
# others scale (Cohere, Cohere 2, Granite) or slice the logits.
CHUNKED_HEAD_MODEL_TYPES = frozenset(
    {
        "deepseek_v3",
        "ernie4_5",
        "gemma",
        "gemma3_text",
        "glm",
        "glm4",
        "glm4_moe",
        "gpt2",
        "gpt_neox",
        "gpt_oss",
        "llama",
        "mistral",
        "mixtral",
        "nemotron_h",
        "olmo",
        "olmo2",
        "olmo3",
        "phi",
        "phi3",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "seed_oss",
        "smollm3",
        "stablelm",
        "starcoder2",
    }
)
# Vision-language models whose conditional-generation forward is `lm_head(base model's last hidden state)` with
# nothing after it (read in transformers 5.23; Gemma 3's multimodal forward applies no soft-capping): the chunked
# head runs on the base model (`decoder_of`), which takes the images. tests/test_vision.py compares the paths.
CHUNKED_HEAD_VLM_TYPES = frozenset({"gemma3", "idefics3", "llava", "llava_next", "qwen2_vl", "qwen2_5_vl"})
# Config fields that, where an architecture has them, change the logits after the LM head: refuse the chunked head
# when any is set, whatever the model type claims.
LOGIT_TRANSFORM_FIELDS = (
    "final_logit_softcapping",
    "logit_softcapping",
    "logits_soft_cap",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
    "unpadded_vocab_size",
)
# False forces the plain logits path everywhere (tests compare the two; also a switch for debugging).
USE_CHUNKED_HEAD = True


def _is_set(value) -> bool:
    """A logit transform is off when absent, None, False or 1 (a scale of one)."""
    return value is not None and value is not False and not (isinstance(value, (int, float)) and value == 1)


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside a LoRA-style PeftModel (its adapter layers live in it), else the model."""
    if is_peft_model(model) and not model.active_peft_config.is_prompt_learning:
        return model.get_base_model()
    return model


def supports_chunked_head(model: torch.nn.Module) -> bool:
    """Whether `token_logprobs` may run the decoder and `chunked_token_logprobs` instead of the model's forward.

    True for a transformers causal LM of a type in CHUNKED_HEAD_MODEL_TYPES (or a LoRA PeftModel of one) whose
    output embedding is exactly an `nn.Linear` (not a quantised or adapter-wrapped head) and whose config has no
    logit soft-capping or scaling. A wrapper such as DistributedDataParallel gets False: its forward must run for
    gradient synchronisation, and the decoder call would bypass it; so does a sharded model (FSDP2, ZeRO-3), whose
    head weight is a shard outside the model's forward.
    """
    if not USE_CHUNKED_HEAD or is_sharded(model):
        return False
    if is_peft_model(model) and model.active_peft_config.is_prompt_learning:
        return False  # virtual tokens are added by the PeftModel's forward
    lm = causal_lm_of(model)
    config = getattr(lm, "config", None)
    if config is None or getattr(config, "model_type", None) not in CHUNKED_HEAD_MODEL_TYPES | CHUNKED_HEAD_VLM_TYPES:
        return False
    if not type(lm).__module__.startswith("transformers.models."):
        return False  # remote code with a familiar model_type may still change the head
    if any(_is_set(getattr(source, field, None)) for source in (config, lm) for field in LOGIT_TRANSFORM_FIELDS):
        return False  # on the config (Gemma 2, Granite) or on the model itself (Cohere's `logit_scale`)
    head = output_embeddings(lm)
    if type(head) is not torch.nn.Linear or not head.weight.is_floating_point():
        return False
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    return isinstance(decoder, torch.nn.Module) and decoder is not lm


def completion_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    multimodal: MultimodalInputs | None = None,
    share_prompts: bool = True,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final hidden states (the LM head's input) that predict the real completion tokens of input_ids
    [N, P + T]: (hidden [M, H], rows [M], columns [M]), hidden[m] predicting token columns[m] of row rows[m]'s
    completion, for the M positions where attention_mask's last T columns are 1. The first half of
    `token_logprobs`' chunked path (`supports_chunked_head` models): the decoder runs, the head does not, so a caller
    projects the rows itself (the log-probs; on-policy distillation's divergence against a teacher's head).

    Rows sharing a prompt run it once (`shared_prompt_hidden`, when `share_prompts` and `can_share_prompts`); the
    rows then come in that path's order, not row-major. position_ids: as `token_logprobs` computes them (None:
    computed here)."""
    prompt_length = input_ids.shape[1] - completion_length
    if position_ids is None:
        position_ids = rope_position_ids(model, input_ids, attention_mask, multimodal, prompt_width=prompt_length)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
    lm = causal_lm_of(model)
    decoder = decoder_of(lm)
    if share_prompts and can_share_prompts(lm):
        shared = shared_prompt_hidden(decoder, input_ids, attention_mask, position_ids, completion_length, multimodal)
        if shared is not None:
            return shared
    images = batch_model_inputs(multimodal, None, prompt_length, input_ids.shape[1], decoder)
    out = decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **images
    )
    hidden = _last_hidden(out)[:, -completion_length - 1 : -1]  # position t predicts token t + 1
    real = attention_mask[:, -completion_length:].bool()
    if bool(real.all()):  # the same rows, in the same order, without an index (a copy the reshape makes anyway)
        rows = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(completion_length)
        columns = torch.arange(completion_length, device=hidden.device).repeat(hidden.shape[0])
        return hidden.reshape(-1, hidden.shape[-1]), rows, columns
    rows, columns = real.nonzero(as_tuple=True)
    return hidden[rows, columns], rows, columns


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunked: bool | None = None,
    share_prompts: bool = True,
    router_logits: list | None = None,
    fp32_head: bool = False,
    multimodal: MultimodalInputs | None = None,
    padding_free: bool = False,
    sampling_mask: SamplingMask | None = None,
    full_vocabulary: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N, T] (and entropies [N, T]) of the last T tokens of input_ids [N, P + T] under the model.

    Position ids skip left padding exactly as the rollout's do, so the values match the sampling log-probs. Three
    paths give the same numbers up to float rounding (tests/test_chunked.py, tests/test_packing.py):
    - chunked (`chunked=None` picks it where `supports_chunked_head`): the decoder runs, the LM head is applied to
      the hidden states of real completion tokens in chunks of rows (`chunked_token_logprobs`), so the [N, T, V]
      logits never exist; rows that repeat a prompt (`share_prompts`) run it once and share its KV cache
      (`shared_prompt_hidden`). Log-probs and entropies are 0 on padding.
    - padding_free: the real tokens only, packed (`packed_token_logprobs`), each distinct prompt once per packed
      segment, no KV cache (so also under gradient checkpointing); a model it cannot run exactly, an entropy with a
      gradient or router logits raise ValueError (`packing_refusal` says why).
    - plain: the model's own logits (`completion_logits`). Taken for an entropy with a gradient (`entropy_grad`,
      an entropy bonus: the chunked entropies are a metric) and for `router_logits` (a list to receive an MoE
      model's router logits, with their graph, for a load-balancing loss).

    fp32_head: the LM head (matmul included) in float32 under autocast, on every path (cast_lm_head_to_fp32).
    multimodal: the rows' images (a vision-language model); a shared prompt's images are encoded once.
    sampling_mask: the sampler's kept sets [N, T, K] (`grpokit.sampling_mask`): the log-probs are then those of the
    distribution the tokens were drawn from, renormalised over each kept set with the repetition penalty replayed
    (`SamplingReplay`); the entropies stay the full vocabulary's. full_vocabulary: a list to receive, with a
    sampling mask, the full-vocabulary log-probs [N, T] too (with their graph: the KL term's).
    """
    # What every path takes alike.
    common = dict(
        temperature=temperature,
        with_entropy=with_entropy,
        fp32_head=fp32_head,
        sampling_mask=sampling_mask,
        full_vocabulary=full_vocabulary,
    )
    if padding_free:
        _check_padding_free_call(model, with_entropy, entropy_grad, router_logits)
        return packed_token_logprobs(model, input_ids, attention_mask, completion_length, **common)
    use_chunked = _takes_chunked_head(model, chunked, with_entropy, entropy_grad, router_logits)
    prompt_length = input_ids.shape[1] - completion_length
    position_ids = rope_position_ids(model, input_ids, attention_mask, multimodal, prompt_width=prompt_length)
    if position_ids is None:  # [N, P + T], or a Qwen-VL model's [3, N, P + T]
        position_ids = position_ids_from_mask(attention_mask)
    if use_chunked:
        hidden, rows, columns = completion_hidden_states(
            model, input_ids, attention_mask, completion_length, multimodal, share_prompts, position_ids
        )
        head = causal_lm_of(model).get_output_embeddings()
        return _head_logprobs(head, hidden, rows, columns, input_ids, attention_mask, completion_length, **common)
    return _plain_logprobs(
        model,
        input_ids,
        attention_mask,
        position_ids,
        completion_length,
        entropy_grad,
        router_logits,
        multimodal,
        **common,
    )


def _check_padding_free_call(model, with_entropy: bool, entropy_grad: bool, router_logits) -> None:
    """Raise ValueError where `token_logprobs(..., padding_free=True)` cannot run this call exactly."""
    reason = packing_refusal(model)
    if reason is None and with_entropy and entropy_grad and torch.is_grad_enabled():
        reason = "its entropies carry no gradient (an entropy bonus, entropy_coef != 0, needs the padded forward)"
    if reason is None and router_logits is not None:
        reason = "it does not return the router logits of an MoE load-balancing loss (router_aux_loss_coef)"
    if reason is not None:
        raise ValueError(f"padding_free=True cannot run here: {reason}. Set padding_free=False.")


def _takes_chunked_head(model, chunked: bool | None, with_entropy: bool, entropy_grad: bool, router_logits) -> bool:
    """Whether `token_logprobs` runs the chunked head: where the model supports it (or `chunked` says so), unless an
    MoE aux loss needs the model's own forward or an entropy needs a gradient."""
    use_chunked = supports_chunked_head(model) if chunked is None else chunked
    if router_logits is not None:  # an MoE aux loss needs the router logits of the model's own forward
        use_chunked = False
    if use_chunked and with_entropy and entropy_grad and torch.is_grad_enabled():
        if chunked:
            raise ValueError(
                "token_logprobs: the chunked head gives entropies without a gradient; "
                "an entropy bonus needs chunked=False."
            )
        use_chunked = False
    return use_chunked


def _head_logprobs(
    head,
    hidden,
    rows,
    columns,
    input_ids,
    attention_mask,
    completion_length,
    *,
    temperature,
    with_entropy,
    fp32_head,
    sampling_mask=None,
    full_vocabulary=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked head on the hidden states [M, H] that predict completion tokens (rows[m], columns[m]): log-probs
    and entropies scattered to [N, T] (0 on padding). With a sampling mask the log-probs are the kept sets'
    (`replayed_head_logprobs`); the chunked head then runs for the entropies (without a gradient) and for the
    full-vocabulary log-probs `full_vocabulary` asks for (appended, with their gradient)."""
    replay = None
    if sampling_mask is not None:
        vocab_size = head.weight.shape[0]
        replay = SamplingReplay.of(sampling_mask, input_ids, attention_mask, completion_length, vocab_size)
    targets = input_ids[:, -completion_length:][rows, columns]
    shape = (input_ids.shape[0], completion_length)
    entropies = None
    wants_full = replay is not None and full_vocabulary is not None
    if replay is None or with_entropy or wants_full:
        with torch.no_grad() if replay is not None and not wants_full else contextlib.nullcontext():
            logprobs, entropies = chunked_token_logprobs(
                hidden,
                head.weight,
                targets,
                temperature,
                bias=head.bias,
                with_entropy=with_entropy,
                fp32_head=fp32_head,
                float32_gemm=getattr(head, FLOAT32_HEAD, False),
            )
    if replay is not None:
        if wants_full:
            full_vocabulary.append(_scatter(logprobs, rows, columns, shape))
        logprobs = replayed_head_logprobs(
            hidden, head.weight, head.bias, targets, temperature, replay, rows, columns, fp32_head
        )
    return (
        _scatter(logprobs, rows, columns, shape),
        None if entropies is None else _scatter(entropies, rows, columns, shape),
    )


def _plain_logprobs(
    model,
    input_ids,
    attention_mask,
    position_ids,
    completion_length,
    entropy_grad,
    router_logits,
    multimodal,
    *,
    temperature,
    with_entropy,
    fp32_head,
    sampling_mask=None,
    full_vocabulary=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs`' plain path: the model's own forward, and log-probs of its logits (of the kept sets with a
    sampling mask, the full vocabulary's then appended to `full_vocabulary` where given)."""
    logits = completion_logits(
        model, input_ids, attention_mask, position_ids, completion_length, router_logits, fp32_head, multimodal
    )
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, -completion_length:]
    if sampling_mask is None:
        logprobs = selective_log_softmax(logits, targets, dtype=torch.float32)  # upcast chunk by chunk
    else:
        if full_vocabulary is not None:
            full_vocabulary.append(selective_log_softmax(logits, targets, dtype=torch.float32))
        replay = SamplingReplay.of(sampling_mask, input_ids, attention_mask, completion_length, logits.shape[-1])
        logprobs = replayed_logits_logprobs(logits, targets, replay)
    entropies = None
    if with_entropy:
        # The entropy keeps a graph (another softmax over V per token) only when the loss needs its gradient.
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(logits)
    return logprobs, entropies


def completion_logits(
    model,
    input_ids,
    attention_mask,
    position_ids=None,
    completion_length: int = 1,
    router_logits: list | None = None,
    fp32_head: bool = False,
    multimodal: MultimodalInputs | None = None,
) -> torch.Tensor:
    """The model's logits [N, T, V] at the positions that predict the last T tokens of input_ids [N, P + T] (its own
    forward; of the T + 1 last positions only where it takes `logits_to_keep`). router_logits: a list to receive an
    MoE model's router logits."""
    prompt_length = input_ids.shape[1] - completion_length
    if position_ids is None:
        position_ids = rope_position_ids(model, input_ids, attention_mask, multimodal, prompt_width=prompt_length)
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    kwargs = {}
    if forward_accepts(model, "attention_mask"):
        kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
    if forward_accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = completion_length + 1
    if router_logits is not None:
        kwargs["output_router_logits"] = True
    kwargs.update(batch_model_inputs(multimodal, None, prompt_length, input_ids.shape[1], model))
    with float32_head(model) if fp32_head else contextlib.nullcontext():
        output = model(input_ids, **kwargs)
    if router_logits is not None:
        router_logits.extend(output.router_logits or ())
    return logits_of(output)[:, -completion_length - 1 : -1]  # position t predicts token t + 1


# ------------------------------------------------------------------------------------ keep sampling mask, replayed


@dataclasses.dataclass
class SamplingReplay:
    """A `SamplingMask` made ready for the training forward of one batch [N, P + T]."""

    mask: SamplingMask
    first_seen: torch.Tensor | None  # [N, V] int32 `sampling_mask.first_seen_positions`, with a repetition penalty
    prompt_length: int
    vocab_size: int

    @classmethod
    def of(cls, mask: SamplingMask, input_ids, attention_mask, completion_length: int, vocab_size: int):
        if mask.kept_ids.shape[:2] != (input_ids.shape[0], completion_length):
            raise ValueError(
                f"sampling_mask has kept sets for {tuple(mask.kept_ids.shape[:2])} (rows, completion tokens), the "
                f"batch {(input_ids.shape[0], completion_length)}: pass the mask of the rollout these rows came from."
            )
        mask = mask.map(lambda kept: kept.to(input_ids.device))
        first_seen = None
        if mask.repetition_penalty != 1.0:
            first_seen = first_seen_positions(input_ids, attention_mask, vocab_size)
        return cls(mask, first_seen, input_ids.shape[1] - completion_length, vocab_size)

    def logprobs(self, logits: torch.Tensor, targets, rows, columns) -> torch.Tensor:
        """Kept-set log-probs of targets [c] under logits / temperature [c, V] at completion positions (rows,
        columns)."""
        seen = None
        if self.first_seen is not None:  # tokens before the position: the prompt's and the completion's so far
            seen = self.first_seen[rows] < (self.prompt_length + columns)[:, None]
        kept = self.mask.kept_ids[rows, columns]
        mask = self.mask
        return replayed_token_logprobs(logits, targets, kept, seen, mask.repetition_penalty, mask.suppressed_ids)


def _replayed_in_chunks(
    logits_of, sources, targets, replay: SamplingReplay, rows, columns, chunk_rows: int | None = None
) -> torch.Tensor:
    """Kept-set log-probs [M] of targets [M] at (rows, columns), `logits_of(sources[chunk])` giving a chunk's
    logits / temperature [c, V], `chunk_rows` rows at a time (default: the device's element budget over V). Under
    autograd each chunk is checkpointed (recomputed in the backward), so that no [c, V] tensor outlives its
    chunk."""
    if chunk_rows is None:
        budget = CHUNK_ELEMENTS.get(sources.device.type, CHUNK_ELEMENTS["default"])
        chunk_rows = max(1, budget // replay.vocab_size)

    def one_chunk(source, target, row, column):
        return replay.logprobs(logits_of(source), target, row, column)

    out = []
    for start in range(0, len(targets), chunk_rows):
        chunk = slice(start, start + chunk_rows)
        arguments = (sources[chunk], targets[chunk], rows[chunk], columns[chunk])
        if torch.is_grad_enabled():
            out.append(checkpoint(one_chunk, *arguments, use_reentrant=False))
        else:
            out.append(one_chunk(*arguments))
    return torch.cat(out) if out else torch.zeros(0, device=sources.device)


def replayed_head_logprobs(
    hidden, weight, bias, targets, temperature, replay: SamplingReplay, rows, columns, fp32_head=False
) -> torch.Tensor:
    """`chunked_token_logprobs`' log-probs renormalised over the sampler's kept sets: hidden [M, H] through the head
    weight [V, H] (and bias), the matmul in the dtype the chunked head uses, the replay in float32."""
    device_type = hidden.device.type
    compute_dtype = _head_compute_dtype(hidden, weight, fp32_head)

    def logits_of(hidden_chunk):
        with torch.autocast(device_type, enabled=False):
            weight_c = weight.to(compute_dtype)
            logits = hidden_chunk.to(compute_dtype) @ weight_c.t()
            if bias is not None:
                logits = logits + bias.to(compute_dtype)
            return logits.to(_softmax_dtype(compute_dtype)) / temperature

    # As the chunked head's: at least MIN_CHUNK_ROWS rows where the head's weight gets a gradient
    chunk_rows = default_chunk_rows(weight, bias)
    return _replayed_in_chunks(logits_of, hidden, targets, replay, rows, columns, chunk_rows)


def replayed_logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, replay: SamplingReplay) -> torch.Tensor:
    """The plain path's kept-set log-probs: logits / temperature [N, T, V], targets [N, T] -> [N, T] float32."""
    n, width = targets.shape
    rows = torch.arange(n, device=targets.device).repeat_interleave(width)
    columns = torch.arange(width, device=targets.device).repeat(n)
    flat = _replayed_in_chunks(
        lambda chunk: chunk, logits.reshape(n * width, -1), targets.reshape(-1), replay, rows, columns
    )
    return flat.view(n, width)


# ------------------------------------------------------------------------------------------ padding-free forward

# Every architecture of CHUNKED_HEAD_MODEL_TYPES whose layers are all full attention takes a 4D attention mask as
# given (transformers 5's `create_causal_mask` returns a 4D mask as-is: masking_utils._preprocess_mask_arguments,
# read in 5.24) and packs exactly: tests/test_packing.py compares the packed and padded forwards, values and
# gradients, on a tiny model of each.
# Attention implementations that read a 4D mask (flash attention reads none: its varlen form is not done here).
PACKED_ATTENTION = ("sdpa", "eager")


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why `token_logprobs(..., padding_free=True)` cannot run `model` exactly, or None when it can."""
    if not supports_chunked_head(model):
        return (
            "the packed forward runs the decoder and grpokit's chunked LM head, which this model does not take "
            "(a wrapped model (DistributedDataParallel, FSDP2, ZeRO-3), prompt-learning PEFT, a quantised or "
            "adapted LM head, a head with soft-capping or scaling, or an architecture outside "
            "CHUNKED_HEAD_MODEL_TYPES)"
        )
    lm = causal_lm_of(model)
    if is_vision_language_model(lm):
        return "vision-language models are not packed (their image tokens and multimodal position ids)"
    implementation = getattr(lm.config, "_attn_implementation", None)
    if implementation not in PACKED_ATTENTION:
        return (
            f"attn_implementation={implementation!r} takes no 4D attention mask; load the model with "
            f"attn_implementation='sdpa' or 'eager'"
        )
    if not has_only_full_attention(lm):
        return "some layers are not full attention (a sliding window or a recurrent state), which a 4D mask bypasses"
    return None


def check_padding_free(policy: torch.nn.Module, reference: torch.nn.Module | None, router_aux_loss_coef: float):
    """Raise ValueError, at setup, where padding_free=True cannot run: a model it cannot pack exactly, or an MoE
    load-balancing loss (which needs the router logits of the padded forward)."""
    for name, model in (("the policy", policy), ("the reference model", reference)):
        reason = None if model is None else packing_refusal(model)
        if reason is not None:
            raise ValueError(f"padding_free=True cannot run {name}: {reason}. Set padding_free=False.")
    if router_aux_loss_coef:
        raise ValueError(
            f"padding_free=True does not return the router logits that the MoE load-balancing loss "
            f"needs (router_aux_loss_coef={router_aux_loss_coef}, the config's own when None): set "
            f"router_aux_loss_coef=0 or padding_free=False."
        )


def packed_token_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_length: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fp32_head: bool = False,
    row_tokens: int | None = None,
    sampling_mask: SamplingMask | None = None,
    full_vocabulary: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` through a packed forward (`packing.pack_rows`): the decoder runs only the real tokens, each
    distinct prompt once per segment, with a 4D mask that lets a token see what it sees in the padded forward;
    the chunked head runs on the hidden states that predict real completion tokens. Log-probs and entropies are
    0 on padding, as on the chunked path. row_tokens: `pack_rows`' bound on a packed row (default: PACKED_ROW_WIDTH
    times the padded row). sampling_mask, full_vocabulary: as `token_logprobs`'."""
    lm = causal_lm_of(model)
    head, decoder = lm.get_output_embeddings(), decoder_of(lm)
    shape = (input_ids.shape[0], completion_length)
    position_ids = position_ids_from_mask(attention_mask)
    if row_tokens is None:
        row_tokens = PACKED_ROW_WIDTH * input_ids.shape[1]
    packed = pack_rows(input_ids, attention_mask, position_ids, completion_length, row_tokens)
    if packed is None:  # no real completion token: every log-prob is 0 (the chunked path's value on padding)
        zeros = torch.zeros(shape, device=input_ids.device)
        return zeros, zeros.clone() if with_entropy else None
    mask = packed.attention_mask(lm.config._attn_implementation, decoder.get_input_embeddings().weight.dtype)
    out = decoder(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, use_cache=False)
    hidden = _last_hidden(out).flatten(0, 1)[packed.hidden_index]  # [K, H]
    return _head_logprobs(
        head,
        hidden,
        packed.rows,
        packed.columns,
        input_ids,
        attention_mask,
        completion_length,
        temperature=temperature,
        with_entropy=with_entropy,
        fp32_head=fp32_head,
        sampling_mask=sampling_mask,
        full_vocabulary=full_vocabulary,
    )


# A packed row holds at most this many times the padded row's positions: a wider row shares a prompt among more
# completions, but SDPA's work per token grows with the row (it computes masked pairs too); benchmarks/packing.py.
PACKED_ROW_WIDTH = 2


@contextlib.contextmanager
def float32_head(model: torch.nn.Module):
    """The model's LM head computes in float32 (input, weight and matmul) for the duration, also under autocast."""
    lm = causal_lm_of(model)
    head = output_embeddings(lm)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError("cast_lm_head_to_fp32 needs a model whose output embedding is an nn.Linear.")

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = None if head.bias is None else head.bias.float()
            return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward  # an instance attribute: nn.Module.__call__ reads it before the class's forward
    try:
        yield
    finally:
        del head.forward


def _scatter(values: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, shape) -> torch.Tensor:
    """values [M] placed at (rows, columns) of a zero tensor of `shape` (differentiable)."""
    return values.new_zeros(shape).index_put((rows, columns), values)


def _last_hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_of(lm: torch.nn.Module) -> torch.nn.Module:
    """The module whose last hidden state the LM head reads: the decoder, or for a vision-language model its base
    model (vision encoder, projector and decoder), which takes the images."""
    return lm.base_model if is_vision_language_model(lm) else lm.get_decoder()


def can_share_prompts(lm: torch.nn.Module) -> bool:
    """Whether the decoder can run prompts and completions in two calls through a KV cache with the same result:
    full attention in every layer, i.e. transformers lays out a plain key/value layer for each (no sliding window,
    whose mask the cache would change; no Mamba state, as in NemotronH, which a per-row index of the prompts' keys
    and values does not carry; no attention-free block), and no gradient checkpointing (under which transformers
    turns the cache off)."""
    return not is_activation_checkpointing(lm) and has_only_full_attention(lm)


def has_only_full_attention(lm: torch.nn.Module) -> bool:
    """Whether every layer is full attention: transformers lays out a plain key/value cache layer for each (no
    sliding window, no Mamba state as in NemotronH, no attention-free block)."""
    from transformers.cache_utils import DynamicLayer

    layers = model_cache(model_config(lm)).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


# Share a prompt when at most this fraction of the rows have distinct prompts (a second decoder call costs more
# than it saves when few rows share one).
SHARE_PROMPTS_MAX_DISTINCT = 0.5
# Completions run in at most this many groups of similar length; a row joins the current group while its length
# is at least this fraction of the group's longest.
LENGTH_GROUPS, LENGTH_GROUP_RATIO = 4, 0.75


def length_groups(lengths: torch.Tensor) -> list[torch.Tensor]:
    """Row indices in groups of similar length, longest first (the padding each group needs is to its longest)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    groups, start = [], 0
    values = lengths[order].tolist()
    for i in range(1, len(values) + 1):
        ends_group = i == len(values) or (
            values[i] < LENGTH_GROUP_RATIO * values[start] and len(groups) < LENGTH_GROUPS - 1
        )
        if ends_group:
            groups.append(order[start:i])
            start = i
    return groups


def shared_prompt_hidden(
    decoder, input_ids, attention_mask, position_ids, completion_length: int, multimodal: MultimodalInputs | None = None
):
    """Hidden states of the real completion tokens of input_ids [N, P + T], each distinct prompt (first P tokens
    and mask, and its images) run once: (hidden [M, H], rows [M], columns [M]), where hidden[m] predicts token
    columns[m] of the completion of row rows[m]; None when too few rows share a prompt to gain from it. A prompt's
    images go through the vision encoder in that one run; the completions read them from the KV cache.

    Each distinct prompt's KV cache is indexed out to its rows (an index: the gradient flows back through it), and
    the completions run against it in groups of similar length (`length_groups`), each padded to its longest; the
    completion's last token predicts nothing and is not run."""
    from transformers import DynamicCache

    n, prompt_length = input_ids.shape[0], input_ids.shape[1] - completion_length
    if prompt_length < 1 or completion_length < 1:
        return None
    prompts = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length].long()], 1)
    if multimodal is not None:  # the same text with other images is another prompt
        prompts = torch.cat([prompts, multimodal.index.to(prompts.device)[:, None]], 1)
    distinct, row_of = torch.unique(prompts, dim=0, return_inverse=True)
    if len(distinct) > SHARE_PROMPTS_MAX_DISTINCT * n:
        return None
    device = input_ids.device
    cache_name = cache_argument(decoder) or "past_key_values"
    first = torch.full((len(distinct),), n, dtype=torch.long, device=device)
    first = first.scatter_reduce(0, row_of, torch.arange(n, device=device), reduce="amin")
    images = batch_model_inputs(multimodal, first, prompt_length, model=decoder)
    out = decoder(
        input_ids=input_ids[first, :prompt_length],
        attention_mask=attention_mask[first, :prompt_length],
        position_ids=position_ids[..., first, :prompt_length],
        use_cache=True,
        **{cache_name: DynamicCache()},
        **images,
    )
    prompt_cache = [(layer.keys, layer.values) for layer in output_cache(out).layers]
    prompt_end = _last_hidden(out)[:, -1]  # [U, H]: a prompt's last position predicts its first completion token

    real = attention_mask[:, prompt_length:].bool()
    positions = torch.arange(1, completion_length + 1, device=device)
    lengths = torch.where(real, positions, 0).amax(-1)  # up to the last real completion token
    hidden, rows, columns = [], [], []
    for group in length_groups(lengths):
        longest = int(lengths[group].max())
        if longest == 0:
            continue
        prompt_rows = row_of[group]
        states = prompt_end[prompt_rows][:, None]
        if longest > 1:
            cache = cache_from_layers([(keys[prompt_rows], values[prompt_rows]) for keys, values in prompt_cache])
            end = prompt_length + longest - 1
            rest = decoder(
                input_ids=input_ids[group, prompt_length:end],
                attention_mask=attention_mask[group, :end],
                position_ids=position_ids[..., group, prompt_length:end],
                use_cache=True,
                **{cache_name: cache},
            )
            states = torch.cat([states, _last_hidden(rest)], 1)  # [rows, longest, H]
        group_rows, group_columns = real[group, :longest].nonzero(as_tuple=True)
        hidden.append(states[group_rows, group_columns])
        rows.append(group[group_rows])
        columns.append(group_columns)
    if not hidden:  # no real completion token anywhere: the plain forward handles that edge
        return None
    return torch.cat(hidden), torch.cat(rows), torch.cat(columns)
