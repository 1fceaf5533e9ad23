"""Activation offloading (`activation_offloading=True`, the name of TRL's SFTConfig field): what autograd keeps from
the training forward for the backward waits in host memory instead of on the accelerator.

Each tensor autograd saves during the policy's training forward goes through `ActivationOffload`'s pack hook: one on
the accelerator is copied into pinned host memory, and the accelerator's copy is freed as soon as nothing else holds
it; the backward's unpack hook copies it back when it needs it. With gradient checkpointing, what autograd keeps are
the checkpointed layers' inputs (the layers' insides are recomputed in the backward, outside these hooks), so those
move; without it, every saved activation moves (under autocast, so do the low-precision copies of the weights that
the backward needs). Parameters and their views (and other tensor subclasses) and tensors under `MIN_BYTES` stay
where they are: the parameters live on the device anyway, and small copies cost more than they save.

The copies run on the current stream, in order with the computation (no overlap: the forward waits for each copy
out, the backward for each copy in); they are exact, so the values and gradients are the same as without offloading.
On a CPU the activations are in host memory already: the trainer warns and leaves this off.
"""

from __future__ import annotations

import torch

# Smaller saved tensors stay on the device (TRL's and torchtune's offloading use the same 1 KiB floor).
MIN_BYTES = 1024


class _Offloaded:
    """A saved tensor waiting in host memory, and the device it goes back to."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.device, host: torch.Tensor):
        self.device, self.host = device, host


class ActivationOffload:
    """Context manager: tensors that autograd saves inside it, on `device_type`, wait in host memory until the
    backward needs them. `offloaded` / `offloaded_bytes` count what moved in the last use.

    `device_type="cpu"` copies host tensors into fresh host tensors: no memory is saved, but every hook runs (the
    tests use it to check the mechanism on a CPU)."""

    def __init__(self, device_type: str, min_bytes: int = MIN_BYTES):
        self.device_type = device_type
        self.min_bytes = min_bytes
        self.pin_memory = device_type == "cuda"  # pinned pages let the copies run asynchronously on the stream
        self.offloaded = 0
        self.offloaded_bytes = 0
        self._hooks = None

    def __enter__(self) -> ActivationOffload:
        self.offloaded = self.offloaded_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        size = tensor.numel() * tensor.element_size()
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or isinstance(tensor._base, torch.nn.Parameter)  # a view of a weight (the weight stays anyway)
            or tensor.device.type != self.device_type
            or size < self.min_bytes
        ):
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin_memory)
        host.copy_(tensor, non_blocking=self.pin_memory)
        self.offloaded += 1
        self.offloaded_bytes += size
        return _Offloaded(tensor.device, host)

    def _unpack(self, packed):
        if isinstance(packed, _Offloaded):
            return packed.host.to(packed.device, non_blocking=self.pin_memory)
        return packed
