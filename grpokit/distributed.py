"""Setting up accelerate for one process or many (torchrun / accelerate launch); DDP only for now."""

from __future__ import annotations

import os

import torch

from .config import GRPOConfig


def build_accelerator(args: GRPOConfig):
    """An Accelerator with the run's precision. In a single process (a notebook, a test session) accelerate's
    process-wide state may hold an earlier trainer's precision; it is reset rather than refusing the new run."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    mixed_precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    # Under torchrun on a machine without an accelerator device, accelerate only forms a (gloo) process group when
    # told `cpu=True`; otherwise every process silently trains alone on the whole run.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = args.use_cpu or (world_size > 1 and not _has_accelerator_device())
    try:
        accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
    except ValueError:
        if PartialState().num_processes > 1:
            raise
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
    if world_size > 1 and accelerator.num_processes == 1:
        # The script created accelerate's state earlier without a process group (e.g. `PartialState()` on a CPU-only
        # machine, where it needs cpu=True): none was formed, so nothing is torn down by creating it again.
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
    # Fail at once rather than hang or train wrongly later (README.md, "Scaling out").
    unsupported = {
        "FSDP": "with sharded parameters every forward is a collective, but each process's sampler stops when its "
                "own completions end, so the processes fall out of step and hang; checkpoints are written by the "
                "main process from unsharded state",
        "DEEPSPEED": "accelerate's DeepSpeed engine steps inside backward() (grpokit accumulates micro-batches, "
                     "clips and skips non-finite updates around optimizer.step()), and ZeRO-3 shards parameters as "
                     "FSDP does",
    }.get(accelerator.distributed_type.value)  # fmt: skip
    if unsupported:
        raise NotImplementedError(f"grpokit does not support {accelerator.distributed_type.value} yet: {unsupported}. "
                                  f"Use DDP (plain torchrun, or examples/accelerate/ddp.yaml).")  # fmt: skip
    return accelerator


def _has_accelerator_device() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6 knows CUDA, XPU, MPS, ...
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()
