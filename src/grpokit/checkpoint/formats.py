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


def save_sharded(directory: Path, model, optimizer, reference=None, trainable_only: bool = False) -> None:
    """Every process writes its own shards of the weights, the optimizer state and the moving reference (a
    collective; `torch.distributed.checkpoint`). Loadable under any number of processes, or in one.
    `trainable_only`: leave the frozen parameters out (a LoRA model's base, which never changes; torch keeps a
    frozen LM head tied to the embeddings, sharded like the rest)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, _inner(optimizer), options=StateDictOptions(ignore_frozen_params=trainable_only)
    )
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    dcp.save(state, checkpoint_id=str(directory))


def load_sharded(directory: Path, model, optimizer, reference=None, trainable_only: bool = False) -> None:
    """Load what `save_sharded` wrote (with the same `trainable_only`) into this layout (sharded or not); every
    process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    # (get_state_dict creates the optimizer's state, which the checkpoint's then fills.)
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_state, optimizer_state = get_state_dict(model, _inner(optimizer), options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    dcp.load(state, checkpoint_id=str(directory))
    # Without the frozen parameters the model's state is partial, hence not strict (dcp.load has already failed if
    # the checkpoint lacks any parameter asked for).
    set_state_dict(
        model,
        _inner(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only),
    )
    if reference is not None:
        set_model_state_dict(reference, state["reference"])
