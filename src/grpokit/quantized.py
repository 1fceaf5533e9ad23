"""An int8 reference: the frozen reference's linear layers with int8 weights (`ref_model_dtype="int8"`).

Each weight row gets one float32 scale, absmax / 127 (symmetric, per output channel: the weight-only int8 scheme of
LLM.int8's vector-wise quantization without its outlier columns, and of torchao's `Int8WeightOnlyConfig`), so a
weight moves by at most half a step, |w - w_int8 · scale| <= scale / 2. The forward dequantizes one layer's weight
at a time into the reference's compute dtype (bfloat16) and runs the bfloat16 linear (on CPUs without bfloat16
hardware the float32 route of `cpu_matmul`, as the policy's layers). The embeddings and the LM head stay in
bfloat16: a tied head is the embedding matrix, and the chunked head reads it directly.

What it costs in exactness is measured by `benchmarks/reference_dtype.py` (README, "Real sizes").
"""

from __future__ import annotations

import torch

from .compat import output_embeddings
from .cpu_matmul import float32_linear, float32_scratch


class Int8Linear(torch.nn.Module):
    """A frozen `nn.Linear` with int8 weights and a float32 scale per output row; `dtype` is the dtype its weight
    is dequantized to for each forward."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16, float32_gemm: bool = False):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight_int8", torch.round(weight / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype, copy=True))
        self.in_features, self.out_features, self.dtype = linear.in_features, linear.out_features, dtype
        self.float32_gemm = float32_gemm

    def dequantized_weight(self) -> torch.Tensor:
        """weight_int8 · scale (in float32) in `dtype`; the float32 product in a reused buffer on the weight's device
        (`float32_scratch`)."""
        product = torch.mul(
            self.weight_int8,
            self.scale[:, None],
            out=float32_scratch("dequantized", self.weight_int8.shape, self.weight_int8.device),
        )
        return product.to(self.dtype, copy=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = float32_linear if self.float32_gemm else torch.nn.functional.linear
        return linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}"


def quantize_linears(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace `model`'s `nn.Linear` layers, all but its output embedding, by `Int8Linear` in place; returns how
    many. A layer routed through `cpu_matmul` keeps the route."""
    head = output_embeddings(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child is not head:
                setattr(parent, name, Int8Linear(child, dtype, float32_gemm="forward" in vars(child)))
                replaced += 1
    return replaced
