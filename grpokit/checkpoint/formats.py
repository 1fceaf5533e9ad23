"""Checkpoint formats that are not a plain directory of full tensors: FSDP2 shards written by every process
(torch.distributed.checkpoint) and DeepSpeed's own engine format."""

from __future__ import annotations

from pathlib import Path

SHARDED_DIR = "sharded"  # inside a checkpoint: torch.distributed.checkpoint files, one per process, + .metadata
DEEPSPEED_DIR = "deepspeed"  # inside a checkpoint: the DeepSpeed engine's own (weights + optimizer partitions)


def wants_sharded_checkpoints(accelerator) -> bool:
    """FSDP2 with accelerate's `fsdp_state_dict_type: SHARDED_STATE_DICT` (its default for FSDP2)."""
    if not accelerator.is_fsdp2:
        return False
    kind = getattr(accelerator.state.fsdp_plugin, "state_dict_type", None)
    return getattr(kind, "name", str(kind)).upper().endswith("SHARDED_STATE_DICT")


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper skips steps it thinks are partial


def save_sharded(directory: Path, model, optimizer, reference=None) -> None:
    """Every process writes its own shards of the weights, the optimizer state and the moving reference (a
    collective; `torch.distributed.checkpoint`). Loadable under any number of processes, or in one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer))
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(directory: Path, model, optimizer, reference=None) -> None:
    """Load what `save_sharded` wrote into this layout (sharded or not); every process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model_state, optimizer_state = get_state_dict(model, _inner(optimizer))  # creates the optimizer's state
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, _inner(optimizer), model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference is not None:
        set_model_state_dict(reference, state["reference"])
