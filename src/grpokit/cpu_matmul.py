"""bfloat16 linear layers on CPUs without bfloat16 instructions, computed by the float32 kernels.

On an x86 CPU without AVX512-BF16 or AMX (e.g. the AVX2 machine of our benchmarks), torch has no fast kernel for a
bfloat16 matrix product: its fallback gemm takes 7-10x the float32 one at training shapes (960 rows through a
Qwen2.5-0.5B MLP projection, `benchmarks/cpu_matmul.py`). That fallback multiplies bfloat16 values and sums the
products in float32, then rounds the result to bfloat16. Upcasting both operands (exact) and running the float32
gemm computes the same products and sums them in float32 too, in another order, then rounds the same way: the
result equals the bfloat16 kernel's up to float32 summation order (at most one bfloat16 ulp apart where the two
sums straddle a rounding boundary). Gradients are computed the same way, and rounded to bfloat16 where the
bfloat16 kernels would round them.

Where it applies (`float32_matmuls`): the model's `nn.Linear` layers other than its LM head, on the CPU, for
inputs of at least `MIN_ROWS` rows (a decode step has one row per sequence): bfloat16 weights, or float32 weights
under bfloat16 autocast (which would cast both operands to bfloat16 first: we round them the same way). Below
`MIN_ROWS` the weight's upcast costs about what the float32 gemm saves, so the bfloat16 kernel runs (one thread,
4864 x 896: 8 rows 7.3 ms bfloat16 against 8.4 routed; 16 rows 15.5 against 9.7; 64 rows 55.7 against 16.4).
bitsandbytes' 4-bit layers take `Float32Linear4bit` at any number of rows (both dequantize the weight).

The LM head is routed apart. The training forward's chunked head (`logprobs.chunked_token_logprobs`) runs
`Float32Head`, which upcasts the [V, H] weight block by block (a float32 copy of a 151,936 x 896 head is 545 MB,
at the step's memory peak); the sampler's logits take `head_forward`, the same in smaller blocks, from
`HEAD_MIN_ROWS` rows.

The float32 copies are written into reused buffers (`float32_scratch`), not allocated per call: see there.
"""

from __future__ import annotations

import copy
import math
import sys
import threading
import weakref

import torch

from .compat import output_embeddings
from .head_autograd import frozen_head_grad, save_for_logprobs_backward

FLOAT32_HEAD = "_grpokit_float32_gemm"  # set on the LM head module: `logprobs.chunked_token_logprobs` routes it

MIN_ROWS = 16  # rows (tokens) of the input from which the float32 gemm is used (`benchmarks/cpu_matmul.py --rows`)
HEAD_MIN_ROWS = 4  # the same for the LM head's sampling logits (`head_forward`)

BF16 = torch.bfloat16


def cpu_has_bf16_matmul() -> bool:
    """Whether torch's CPU bfloat16 gemm runs on bfloat16 hardware (oneDNN with AVX512-BF16 / AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


# ------------------------------------------------------------------------------------------ reused float32 copies

# The float32 copies these routes make of weights (and of inputs) are written into buffers kept per thread and
# reused, rather than allocated at every call: grpokit maps every allocation of 1 MiB and up afresh
# (`cpu_memory.keep_large_allocations_mapped`, so that freed tensors return to the OS), and a fresh mapping costs a
# page fault per 4 KiB on first write. Upcasting a 4864 x 896 bfloat16 weight took 14.9 ms into a fresh tensor and
# 2.0 ms into a reused one, with one thread (the float32 gemm of 16 rows through it: 6.8 ms).
_SCRATCH = threading.local()


def float32_scratch(slot: str, shape, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised float32 tensor of `shape` on `device` from this thread's buffer `slot` (one per device),
    grown when too small (never shrunk; `release_scratch` frees them). Valid until the next request of the same slot:
    a caller uses it within one computation and never returns it."""
    numel = math.prod(shape)
    device = torch.device(device)
    key = slot if device.type == "cpu" else f"{slot}@{device}"
    buffers = _SCRATCH.__dict__
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffers[key] = None  # the old buffer goes before the larger one is mapped
        buffer = buffers[key] = torch.empty(numel, device=device)
    return buffer[:numel].view(shape)


def float32_copy(tensor: torch.Tensor, slot: str) -> torch.Tensor:
    """`tensor.float()` (exact from bfloat16), written into this thread's buffer `slot` (`float32_scratch`)."""
    return float32_scratch(slot, tensor.shape).copy_(tensor)


def release_scratch() -> None:
    """Free this thread's buffers (they are allocated again on the next request)."""
    _SCRATCH.__dict__.clear()


def bf16_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether F.linear(x, weight) on the CPU would run a bfloat16 gemm: bfloat16 tensors, or float32 ones under
    CPU bfloat16 autocast."""
    if x.device.type != "cpu" or not x.is_floating_point():
        return False
    if x.dtype == BF16 and weight.dtype == BF16:
        return True
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16
    return autocast and weight.dtype in (torch.float32, BF16) and x.dtype in (torch.float32, BF16)


class Float32Linear(torch.autograd.Function):
    """F.linear with bfloat16 operands, computed by float32 gemms (see the module docstring). Inputs may be float32
    (autocast's case): they are rounded to bfloat16 first, as autocast would; gradients come back in each input's
    dtype, rounded through bfloat16 as autocast's casts would round them."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x16, weight16 = x.to(BF16), weight.to(BF16)
        bias16 = None if bias is None else bias.to(BF16)
        ctx.save_for_backward(x16, weight16)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        with torch.autocast("cpu", enabled=False):
            out = torch.nn.functional.linear(
                float32_copy(x16, "input"), float32_copy(weight16, "weight"), None if bias16 is None else bias16.float()
            )
        return out.to(BF16)

    @staticmethod
    def backward(ctx, grad_out):
        x16, weight16 = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = grad_out.to(BF16).float().reshape(-1, grad_out.shape[-1])  # [rows, out]
        grad_x = grad_weight = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ float32_copy(weight16, "weight")).to(BF16).to(x_dtype).reshape(x16.shape)
            if ctx.needs_input_grad[1]:
                inputs = float32_copy(x16.reshape(-1, x16.shape[-1]), "input")
                grad_weight = (grad.T @ inputs).to(BF16).to(weight_dtype)
            if ctx.needs_input_grad[2]:
                grad_bias = grad.sum(0).to(BF16).to(bias_dtype)
        return grad_x, grad_weight, grad_bias


def float32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias): the float32 gemm for bfloat16 operands of at least MIN_ROWS rows, else F.linear."""
    if x.numel() >= MIN_ROWS * weight.shape[1] and bf16_operands(x, weight):
        return Float32Linear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A routed `nn.Linear`'s forward (`float32_linear` of its weight and bias)."""
    return float32_linear(x, module.weight, module.bias)


def is_linear4bit(module: torch.nn.Module) -> bool:
    """A bitsandbytes 4-bit linear layer (QLoRA's frozen base)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def _dequantized(module) -> torch.Tensor:
    """A 4-bit layer's weight [out, in] in bfloat16, as bitsandbytes dequantizes it for its bfloat16 matmul."""
    import bitsandbytes

    return bitsandbytes.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).to(BF16)


DEQUANT_PIECE = 1 << 18  # elements of a 4-bit weight dequantized at a time (512 KiB in bfloat16: never mapped)


def dequantized_float32(module) -> torch.Tensor:
    """`_dequantized(module).float()`, in the "weight" scratch buffer: bitsandbytes dequantizes a few rows at a time
    (the same kernel on a slice of the packed weight and of its block scales, so the same values), and each piece
    is upcast into the buffer. Whole, the bfloat16 weight would be a fresh mapping at every call. Falls back to the
    whole weight where rows do not all start on a quantization block (bitsandbytes' AVX-512 kernel then gives a
    piece other values than the whole weight's rows: 96 inputs per row, blocks of 64) or bitsandbytes repacked the
    weight."""
    import bitsandbytes.functional as bnb

    weight, state = module.weight, module.weight.quant_state
    out_features, in_features = state.shape
    block = state.blocksize
    rows = max(1, DEQUANT_PIECE // in_features)
    if in_features % block or getattr(state, "packing_format_for_cpu", False):
        return float32_copy(_dequantized(module), "weight")
    absmax = state.absmax
    if state.nested:  # double quantization: the block scales are themselves quantized; dequantize them once
        absmax = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset
    packed = weight.data.view(torch.uint8).reshape(-1)
    out = float32_scratch("weight", (out_features, in_features))
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        first, last = start * in_features, stop * in_features  # elements
        piece = bnb.QuantState(
            absmax=absmax[first // block : -(-last // block)].float(),
            shape=torch.Size([stop - start, in_features]),
            code=state.code,
            blocksize=block,
            quant_type=state.quant_type,
            dtype=state.dtype,
        )
        out[start:stop].copy_(bnb.dequantize_4bit(packed[first // 2 : last // 2], piece).to(BF16))
    return out


class Float32Linear4bit(torch.autograd.Function):
    """A bitsandbytes `Linear4bit` with bfloat16 compute, by float32 gemms: the weight dequantized to bfloat16 (as
    bitsandbytes does), then `Float32Linear`'s arithmetic. The weight is frozen and 4-bit: the backward dequantizes
    it again (nothing of weight size is saved) and returns the input's and the bias's gradients."""

    @staticmethod
    def forward(ctx, x, bias, module):
        ctx.module, ctx.dtypes = module, (x.dtype, None if bias is None else bias.dtype)
        with torch.autocast("cpu", enabled=False):
            weight = dequantized_float32(module)
            bias32 = None if bias is None else bias.to(BF16).float()
            out = torch.nn.functional.linear(float32_copy(x.to(BF16), "input"), weight, bias32)
        return out.to(BF16).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_dtype, bias_dtype = ctx.dtypes
        grad = grad_out.to(BF16).float()
        grad_x = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ dequantized_float32(ctx.module)).to(BF16).to(x_dtype)
            if ctx.needs_input_grad[1]:
                grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0).to(BF16).to(bias_dtype)
        return grad_x, grad_bias, None


def linear4bit_forward(module, x: torch.Tensor) -> torch.Tensor:
    """A `Linear4bit`'s forward: `Float32Linear4bit` where bitsandbytes would run a bfloat16 matmul on the CPU
    (compute dtype bfloat16, or unset with bfloat16 inputs), else its own. Decode steps too: both dequantize the
    weight, and the float32 gemm of a few rows beats the bfloat16 one (16 rows through 896 x 4864: 45 against 62
    ms, one thread)."""
    compute_dtype = module.compute_dtype or x.dtype
    if x.device.type == "cpu" and compute_dtype == BF16:
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

        fix_4bit_weight_quant_state_from_module(module)
        return Float32Linear4bit.apply(x, module.bias, module)
    return type(module).forward(module, x)


class RoutedForward:
    """A routed layer's forward, `function(layer, *args)`. It holds the layer weakly: a layer whose own attribute
    refers back to it is a reference cycle, so a layer dropped later (the bf16 layers an int8 reference replaces, a
    discarded model) would keep its weights until the garbage collector's next full pass (672 MiB after building
    the int8 reference at the Qwen2.5-0.5B shape). A deep copy (the reference policy) calls the copied layer."""

    def __init__(self, function, layer: torch.nn.Module):
        self.function, self.layer = function, weakref.ref(layer)

    def __call__(self, *args, **kwargs):
        return self.function(self.layer(), *args, **kwargs)

    def __deepcopy__(self, memo):
        return RoutedForward(self.function, copy.deepcopy(self.layer(), memo))

    def __reduce__(self):  # pickled with its layer (an engine process: grpokit.rollout.process_engine)
        return RoutedForward, (self.function, self.layer())


def float32_matmuls(model: torch.nn.Module, device: torch.device | str) -> int:
    """Route `model`'s linear layers (all but its LM head) through `linear_forward` (bitsandbytes 4-bit ones through
    `linear4bit_forward`) when `device` is a CPU without bfloat16 hardware; returns how many layers were routed (0
    elsewhere). Their forward is set per instance, so a copy of the model (the reference) takes it too, and a
    gradient-checkpointed layer recomputes the same way."""
    if torch.device(device).type != "cpu" or cpu_has_bf16_matmul():
        return 0
    head = output_embeddings(model)
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head:
            module.forward = RoutedForward(linear_forward, module)
            routed += 1
        elif is_linear4bit(module):
            module.forward = RoutedForward(linear4bit_forward, module)
            routed += 1
    if head is not None:  # the training forward's chunked head takes `Float32Head`
        setattr(head, FLOAT32_HEAD, True)
        if type(head) is torch.nn.Linear:  # the sampler's logits: `head_forward`
            head.forward = RoutedForward(head_forward, head)
    return routed


HEAD_BLOCK = 1024  # vocabulary rows of the head upcast at a time by `head_forward` (3.5 MiB at hidden size 896)


def head_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A routed LM head's forward: where no gradient is needed (the sampler's decode steps, a few rows each) and the
    operands are bfloat16, the float32 gemm over blocks of the vocabulary, each upcast into a reused buffer; the
    same values as the bfloat16 kernel up to float32 summation order (`Float32Linear`). Else the module's own
    forward. A Qwen2.5-0.5B head (151,936 x 896) at 16 rows, one thread: 0.13 s against the bfloat16 kernel's 0.55
    (upcasting the whole weight afresh instead: 0.65)."""
    weight, bias = module.weight, module.bias
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if needs_grad or x.numel() < HEAD_MIN_ROWS * x.shape[-1] or not bf16_operands(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    x32 = x.to(BF16).float().reshape(-1, x.shape[-1])
    out = torch.empty(x32.shape[0], weight.shape[0], dtype=BF16)
    with torch.autocast("cpu", enabled=False):
        for start in range(0, weight.shape[0], HEAD_BLOCK):
            block = slice(start, start + HEAD_BLOCK)
            out[:, block] = _block_logits(x32, float32_copy(weight[block].to(BF16), "weight"), bias, block, 1.0)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------------------------------------- the LM head

# The head in blocks: VOCAB_BLOCK rows of the weight at a time, upcast once per pass (a float32 copy of the whole
# [V, H] weight would cost 4·V·H bytes at the step's memory peak), against ROWS hidden states at a time. A
# [ROWS, VOCAB_BLOCK] float32 block of logits is 32 MiB; the forward's [M, VOCAB_BLOCK] block, 32 KiB per row.
ROWS = 1024
VOCAB_BLOCK = 8192


def _blocks(vocab_size: int):
    return [slice(start, min(start + VOCAB_BLOCK, vocab_size)) for start in range(0, vocab_size, VOCAB_BLOCK)]


def _row_chunks(rows: int):
    return [slice(start, start + ROWS) for start in range(0, rows, ROWS)]


def _block_logits(hidden32, weight32, bias, block, temperature):
    """(hidden @ weight[block].T + bias[block]) / temperature, [R, B] float32, as the bfloat16 kernel computes it:
    bfloat16 operands, float32 sums, the result rounded to bfloat16; then the division in float32."""
    if bias is None:
        logits = hidden32 @ weight32.t()
    else:
        logits = torch.addmm(bias[block].to(BF16).float(), hidden32, weight32.t())
    logits = logits.to(BF16).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class Float32Head(torch.autograd.Function):
    """`logprobs._ChunkedTokenLogprobs` with bfloat16 matmuls, for CPUs without bfloat16 hardware: the same values
    up to float32 summation order (products of bfloat16 operands summed in float32, logits and gradients rounded to
    bfloat16 where the bfloat16 kernels round them), with float32 gemms over blocks of the vocabulary.

    hidden [M, H], weight [V, H], bias [V] or None, targets [M] -> (logprobs [M], entropies [M] or [0]) float32.
    Both passes loop over vocabulary blocks outside and chunks of ROWS rows inside, so each weight block is upcast
    once per pass. The forward keeps an online log-sum-exp per row (running max, rescaled sums) and saves it; with a
    frozen head (LoRA) it saves softmax @ weight per row instead, so that the backward is a gather, as in the
    chunked head (here the softmax is not rounded to bfloat16 before that product). The backward writes each block
    of the weight's gradient once, in the weight's dtype: no float32 [V, H] accumulator."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy):
        frozen_head = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        hidden32 = hidden.to(BF16).float()  # what autocast would give the bfloat16 kernel
        target_logits = torch.empty(hidden.shape[0])
        row_max = total = shifted_dot = expected = None  # running over the blocks, relative to row_max
        for block in _blocks(weight.shape[0]):
            weight32 = float32_copy(weight[block].to(BF16), "weight")
            logits = torch.cat(
                [
                    _block_logits(hidden32[rows], weight32, bias, block, temperature)
                    for rows in _row_chunks(hidden.shape[0])
                ]
            )
            inside = (targets >= block.start) & (targets < block.stop)
            index = (targets - block.start).clamp(0, logits.shape[1] - 1)
            target_logits = torch.where(inside, logits.gather(1, index[:, None]).squeeze(1), target_logits)
            block_max = logits.amax(1)
            new_max = block_max if row_max is None else torch.maximum(row_max, block_max)
            shifted = logits.sub_(new_max[:, None])
            exp = shifted.exp()
            block_total = exp.sum(1)
            if row_max is None:
                total = block_total
                shifted_dot = torch.linalg.vecdot(exp, shifted) if with_entropy else None
                expected = exp @ weight32 if frozen_head else None
            else:
                delta = row_max - new_max
                scale = delta.exp()
                if with_entropy:  # sum exp(l - m') (l - m') over the earlier blocks, from their m: rescaled
                    shifted_dot = scale * (shifted_dot + delta * total) + torch.linalg.vecdot(exp, shifted)
                if frozen_head:
                    expected = expected.mul_(scale[:, None]).addmm_(exp, weight32)
                total = total * scale + block_total
            row_max = new_max
        lse = row_max + total.log()
        logprobs = target_logits - lse
        entropies = total.log() - shifted_dot / total if with_entropy else torch.empty(0)
        expected_rows = expected / total[:, None] if frozen_head else None
        save_for_logprobs_backward(
            ctx, frozen_head, hidden, weight, bias, targets, lse, expected_rows, entropies, temperature=temperature
        )
        return logprobs, entropies

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropies):
        hidden, weight, bias, targets, lse, expected_rows = ctx.saved_tensors
        grad_logprobs = grad_logprobs.float() / ctx.temperature
        if ctx.frozen_head:
            grad_hidden = frozen_head_grad(grad_logprobs, weight, targets, expected_rows)
            return grad_hidden.to(ctx.hidden_dtype), None, None, None, None, None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        hidden32 = hidden.to(BF16).float()
        grad_hidden = torch.zeros(hidden32.shape) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if need_bias else None
        for block in _blocks(weight.shape[0]):
            weight32 = float32_copy(weight[block].to(BF16), "weight")
            block_grad = torch.zeros(weight32.shape) if need_weight else None
            block_bias = torch.zeros(weight32.shape[0]) if need_bias else None
            for rows in _row_chunks(hidden.shape[0]):
                logits = _block_logits(hidden32[rows], weight32, bias, block, ctx.temperature)
                upstream, chunk_targets = grad_logprobs[rows], targets[rows]
                # d logprob / d logits = onehot(target) - softmax, times the upstream gradient and 1/temperature
                grad_logits = logits.sub_(lse[rows, None]).exp_().mul_(-upstream[:, None])
                inside = ((chunk_targets >= block.start) & (chunk_targets < block.stop)).nonzero().squeeze(1)
                grad_logits[inside, chunk_targets[inside] - block.start] += upstream[inside]
                if need_bias:
                    block_bias += grad_logits.sum(0)
                grad_logits = grad_logits.to(BF16).float()  # the bfloat16 kernel's operand
                if need_hidden:
                    grad_hidden[rows].addmm_(grad_logits, weight32)
                if need_weight:  # each chunk's product rounded as the bfloat16 kernel rounds it, summed in float32
                    block_grad += (grad_logits.t() @ hidden32[rows]).to(BF16).float()
            if need_weight:
                grad_weight[block] = block_grad
            if need_bias:
                grad_bias[block] = block_bias
        if need_hidden:
            grad_hidden = grad_hidden.to(BF16).to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None
