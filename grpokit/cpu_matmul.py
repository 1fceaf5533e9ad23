"""bfloat16 linear layers on CPUs without bfloat16 instructions, computed by the float32 kernels.

On an x86 CPU without AVX512-BF16 or AMX (e.g. the AVX2 machine of our benchmarks), torch has no fast kernel for a
bfloat16 matrix product: its fallback gemm takes 7-10x the float32 one at training shapes (960 rows through a
Qwen2.5-0.5B MLP projection, `benchmarks/cpu_matmul.py`). That fallback multiplies bfloat16 values and sums the
products in float32, then rounds the result to bfloat16. Upcasting both operands (exact) and running the float32
gemm computes the same products and sums them in float32 too, in another order, then rounds the same way: the
result equals the bfloat16 kernel's up to float32 summation order (at most one bfloat16 ulp apart where the two
sums straddle a rounding boundary). Gradients are computed the same way, and rounded to bfloat16 where the
bfloat16 kernels would round them.

Where it applies (`float32_matmuls`): the model's `nn.Linear` layers other than its LM head (the head's
[V, H] weight would need a float32 copy; the log-prob code handles the head), on the CPU, for inputs of at least
`MIN_ROWS` rows: bfloat16 weights, or float32 weights under bfloat16 autocast (which would cast both operands to
bfloat16 first: we round them the same way). Below `MIN_ROWS` (decode steps: one row per sequence) the weight's
upcast costs about what the float32 gemm saves, so the bfloat16 kernel runs.
"""

from __future__ import annotations

import functools

import torch

MIN_ROWS = 64  # rows (tokens) of the input from which the float32 gemm is used

BF16 = torch.bfloat16


def cpu_has_bf16_matmul() -> bool:
    """Whether torch's CPU bfloat16 gemm runs on bfloat16 hardware (oneDNN with AVX512-BF16 / AMX)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
            out = torch.nn.functional.linear(x16.float(), weight16.float(), None if bias16 is None else bias16.float())
        return out.to(BF16)

    @staticmethod
    def backward(ctx, grad_out):
        x16, weight16 = ctx.saved_tensors
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = grad_out.to(BF16).float().reshape(-1, grad_out.shape[-1])  # [rows, out]
        grad_x = grad_weight = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ weight16.float()).to(BF16).to(x_dtype).reshape(x16.shape)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad.T @ x16.reshape(-1, x16.shape[-1]).float()).to(BF16).to(weight_dtype)
            if ctx.needs_input_grad[2]:
                grad_bias = grad.sum(0).to(BF16).to(bias_dtype)
        return grad_x, grad_weight, grad_bias


def linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module`'s forward: the float32 gemm for bfloat16 operands of at least MIN_ROWS rows, else F.linear."""
    if x.numel() >= MIN_ROWS * module.in_features and bf16_operands(x, module.weight):
        return Float32Linear.apply(x, module.weight, module.bias)
    return torch.nn.functional.linear(x, module.weight, module.bias)


def float32_matmuls(model: torch.nn.Module, device: torch.device | str) -> int:
    """Route `model`'s linear layers (all but its LM head) through `linear_forward` when `device` is a CPU without
    bfloat16 hardware; returns how many layers were routed (0 elsewhere). Their forward is set per instance, so a
    copy of the model (the reference) takes it too, and a gradient-checkpointed layer recomputes the same way."""
    if torch.device(device).type != "cpu" or cpu_has_bf16_matmul():
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head:
            module.forward = functools.partial(linear_forward, module)
            routed += 1
    return routed
