"""float32 linear layers on AMD CPUs with AVX-512, computed by oneDNN instead of MKL.

torch's CPU float32 matrix product (`F.linear`, `mm`) is MKL's sgemm. MKL picks its AVX-512 kernels on Intel CPUs
only: on an AMD CPU with AVX-512 (Zen 4 and later) it runs its AVX2 kernels, at about half the machine's rate.
oneDNN, which torch ships too (`torch.ops.mkldnn._linear_pointwise`, the kernel inductor's CPU linear layers call),
generates AVX-512 code for any vendor: on the project's 2-core AMD EPYC the `small` benchmark's training products
(4,296 rows through its 256 -> 256, 256 -> 128, 256 -> 1024 and 1024 -> 256 layers) ran 2.0-2.5x faster forward,
and 1.2-1.6x forward + backward, whose weight gradient stays MKL's (`python benchmarks/onednn_linear.py`).

Where it applies (`onednn_linears`, set up by the trainer): the policy's (and so the reference's) plain
`nn.Linear` layers other than the LM head, for float32 operands on the CPU outside autocast, from `MIN_MACS`
multiply-adds a call (rows x in x out; below that oneDNN's fixed cost per call is the larger: 256 rows x 32 x 64
took 11 us with MKL and 21 with oneDNN, 256 x 128 x 128 48 and 37). The forward and the input's gradient run
oneDNN; the weight's gradient and the bias's stay torch's own `mm` and `sum`, bitwise F.linear's backward.

The numbers: the same products summed in another order. A layer's output differs from MKL's by float32 rounding
(its error against the float64 product is MKL's size: `tests/test_onednn_linear.py`), so a training run's
log-probs, loss and update move at that level against TRL's on the same machine, as they move between two CPU
kernel sets (the pinned digests of `tests/test_pinned.py` differ per CPU for the same reason). The tiny models of
the pinned runs stay below `MIN_MACS`: their digests did not move. `GRPOKIT_ONEDNN_LINEARS=0` keeps MKL
everywhere (TRL's arithmetic, bitwise); `=1` takes oneDNN on any CPU torch built it for (not measured elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from .compat import output_embeddings
from .cpu_matmul import RoutedForward

MIN_MACS = 1 << 22  # rows x in x out from which a call runs oneDNN (`benchmarks/onednn_linear.py`)
ENV = "GRPOKIT_ONEDNN_LINEARS"  # "0": never; "1": on any CPU with oneDNN; unset: where measured faster


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def _onednn_works() -> bool:
    """Whether this torch's oneDNN runs a float32 linear product (checked once, on a tiny layer, against F.linear)."""
    if not torch.backends.mkldnn.is_available() or getattr(torch.ops, "mkldnn", None) is None:
        return False
    weight, bias, x = torch.randn(8, 4), torch.randn(8), torch.randn(3, 4)
    try:
        out = _onednn_linear(x, weight, bias)
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5))


def cpu_vendor() -> str:
    """The CPU's vendor string as Linux reports it ("AuthenticAMD", "GenuineIntel"), "unknown" elsewhere."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return "unknown"


@functools.cache
def onednn_is_faster() -> bool:
    """Whether float32 linear layers take oneDNN on this machine: `GRPOKIT_ONEDNN_LINEARS` when set ("0" or "1"),
    else on an AMD CPU whose torch CPU capability is AVX-512 and whose torch gemm is MKL's (the case measured)."""
    setting = os.environ.get(ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{ENV}={setting!r}: set it to 0 (MKL, torch's own kernel) or 1 (oneDNN), or unset it.")
    if setting == "0" or not _onednn_works():
        return False
    if setting == "1":
        return True
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return avx512 and torch.backends.mkl.is_available() and cpu_vendor() == "AuthenticAMD"


class OnednnLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) for float32 CPU tensors: oneDNN's product forward and for the input's gradient
    (grad_out @ weight, the weight read transposed in place), torch's `mm` and `sum` for the weight's and the bias's
    gradients, as F.linear's own backward computes them."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad_out, weight.t(), None)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.needs_input_grad[2]:  # False for a bias of None
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def takes_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether F.linear(x, weight, bias) runs `OnednnLinear`: float32 CPU operands outside autocast, at least
    MIN_MACS multiply-adds."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
        and x.numel() // max(weight.shape[1], 1) * weight.numel() >= MIN_MACS
    )


def onednn_linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A routed `nn.Linear`'s forward: `OnednnLinear` where `takes_onednn`, else the layer's own F.linear."""
    if takes_onednn(x, module.weight, module.bias):
        return OnednnLinear.apply(x, module.weight, module.bias)
    return torch.nn.functional.linear(x, module.weight, module.bias)


def is_onednn_routed(module: torch.nn.Module) -> bool:
    """Whether `onednn_linears` set this layer's forward."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, RoutedForward) and forward.function is onednn_linear_forward


def onednn_linears(model: torch.nn.Module, device: torch.device | str) -> int:
    """Route `model`'s plain float32 `nn.Linear` layers (not its LM head, whose training forward is the chunked
    head, nor a layer whose forward something else replaced) through `onednn_linear_forward` on a CPU where
    `onednn_is_faster`; returns how many were routed (0 elsewhere). Set per instance: a copy of the model (the
    reference) takes it too, and a gradient-checkpointed layer recomputes the same way."""
    if torch.device(device).type != "cpu" or not onednn_is_faster():
        return 0
    head = output_embeddings(model)
    routed = 0
    for module in model.modules():
        if (
            type(module) is torch.nn.Linear
            and module is not head
            and "forward" not in module.__dict__
            and module.weight.dtype == torch.float32
        ):
            module.forward = RoutedForward(onednn_linear_forward, module)
            routed += 1
    return routed


def takes_onednn_linears(args, accelerator) -> bool:
    """Whether a run routes its float32 policy through `onednn_linears`: not under half-precision autocast (the
    caller takes float32 weights only), not with torch.compile (inductor picks its own CPU kernels), and not
    sharded by FSDP or DeepSpeed, whose ZeRO-3 swaps each weight's storage around F.linear calls that it patches."""
    sharded = accelerator.distributed_type.value in ("FSDP", "DEEPSPEED")
    return not (args.bf16 or args.fp16 or args.torch_compile or sharded)
