"""Saving and resuming a run: one `Checkpointer` with an explicit interface, three formats.

A checkpoint holds the weights, the optimizer and scheduler state, the reference when it moves (sync_ref_model),
every process's RNG state and half-used generation batch, the loop's position and the trainer state. It is written
atomically (`atomic.py`): a directory `checkpoint-<step>` exists only once complete. The weights and optimizer go
in one of three formats, chosen by the backend:

- plain: full tensors written by the main process (gathered first under FSDP2 and ZeRO-3), loadable by
  `from_pretrained`, resumable under DDP, FSDP2 or one process (the optimizer state keyed by parameter name when
  gathered);
- sharded (FSDP2 with SHARDED_STATE_DICT): every process writes its shards with torch.distributed.checkpoint;
- deepspeed: the engine's own format (resumable under DeepSpeed with the same number of processes).

With LoRA (a PeftModel) the frozen base never changes: the plain format holds the adapter (peft's files), and the
sharded and DeepSpeed formats leave the frozen parameters out.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..distributed import (
    full_optimizer_state,
    full_state_dict,
    is_sharded,
    load_full_state_dict,
    load_optimizer_state,
    local_shard,
    unwrap_model,
)
from ..models import is_peft_model, load_model_weights
from ..state import TrainerState
from .atomic import (
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    rng_state,
    rotate_checkpoints,
    set_rng_state,
    write_checkpoint,
)
from .formats import DEEPSPEED_DIR, SHARDED_DIR, load_sharded, save_sharded, wants_sharded_checkpoints


@dataclass
class TrainingParts:
    """What a checkpoint holds the state of. `model` is as accelerate prepared it (a DeepSpeed engine saves
    itself); `reference` is given only when it moves during training and must be saved."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    reference: torch.nn.Module | None = None


@dataclass
class Resumed:
    """What `Checkpointer.load` gives back besides the weights and optimizer state it loaded in place."""

    state: TrainerState
    loop: dict  # the loop's shared position (the same on every process)
    process: dict | None  # this process's own part (its generation batch), None if written by another layout


class Checkpointer:
    """write_model(directory, weights, with_weights) writes the model's files: its gathered `weights` (None: its
    own state dict), or only its config and tokenizer when with_weights is False. gather_weights(model) gathers
    what write_model needs of a sharded model (a collective; default: the full state dict)."""

    def __init__(
        self,
        accelerator,
        output_dir: str | Path,
        write_model: Callable[..., None],
        *,
        save_total_limit: int | None = None,
        save_only_model: bool = False,
        deepspeed: bool = False,
        gather_weights: Callable[[torch.nn.Module], dict] = full_state_dict,
        save_on_each_node: bool = False,
    ):
        """save_on_each_node: each node's local main process writes the whole checkpoint into its own output_dir
        (nodes that share no storage; transformers' option), rather than the main process alone. Plain
        checkpoints only: in the sharded and DeepSpeed formats every process writes its part into one directory."""
        self.accelerator, self.output_dir, self.write_model = accelerator, Path(output_dir), write_model
        self.save_total_limit, self.save_only_model, self.deepspeed = save_total_limit, save_only_model, deepspeed
        self.gather_weights, self.save_on_each_node = gather_weights, save_on_each_node

    @property
    def writes(self) -> bool:
        """Whether this process writes checkpoints (and the final model): the main process, or with
        save_on_each_node the main process of each node."""
        acc = self.accelerator
        return acc.is_local_main_process if self.save_on_each_node else acc.is_main_process

    @property
    def format(self) -> str:
        if self.deepspeed and not self.save_only_model:
            return "deepspeed"
        if wants_sharded_checkpoints(self.accelerator) and not self.save_only_model:
            return "sharded"
        return "plain"

    # --------------------------------------------------------------------------------------------------- saving

    def save(self, parts: TrainingParts, state: TrainerState, loop: dict, process: dict) -> Path | None:
        """Every process calls it, each with its own `process` part; returns the checkpoint's path on the process
        that wrote it (`writes`). Refuses (FloatingPointError) to checkpoint non-finite weights: the last good
        checkpoint stays. save_total_limit never removes state.best_model_checkpoint."""
        from accelerate.utils import broadcast_object_list, gather_object

        acc, model = self.accelerator, unwrap_model(self.accelerator, parts.model)
        self._check_finite(model, state.global_step)
        fmt, step = self.format, state.global_step
        reference = None if self.save_only_model else parts.reference
        weights = optimizer_state = reference_weights = tmp = None
        if fmt != "plain":  # every process writes its shards into the checkpoint's temporary directory
            tmp = broadcast_object_list([begin_checkpoint(self.output_dir, step) if acc.is_main_process else None])[0]
        if fmt == "deepspeed":
            # A LoRA model's frozen base never changes: left out, as transformers' Trainer saves PEFT models.
            parts.model.save_checkpoint(
                str(tmp / DEEPSPEED_DIR),
                tag="state",
                **({"exclude_frozen_parameters": True} if is_peft_model(model) else {}),
            )
            reference_weights = full_state_dict(reference) if reference is not None else None
        elif fmt == "sharded":
            save_sharded(tmp / SHARDED_DIR, model, parts.optimizer, reference, trainable_only=is_peft_model(model))
        else:  # collectives under FSDP2 / ZeRO-3: every process takes part, the main process gets full tensors
            weights = self.gather_weights(model) if is_sharded(model) else None
            optimizer_state = (
                full_optimizer_state(model, parts.optimizer) if is_sharded(model) and not self.save_only_model else None
            )
            reference_weights = full_state_dict(reference) if reference is not None else None
        processes = [] if self.save_only_model else gather_object([{"rng": rng_state(), **process}])
        if not self.writes:
            acc.wait_for_everyone()
            return None

        def write(directory: Path) -> None:
            # In the other formats the weights are in the shards; config and tokenizer make the directory legible.
            self.write_model(directory, weights, with_weights=fmt == "plain")
            if self.save_only_model:
                return
            if fmt == "plain":
                torch.save(
                    parts.optimizer.state_dict() if optimizer_state is None else optimizer_state,
                    directory / "optimizer.pt",
                )
            torch.save(parts.scheduler.state_dict(), directory / "scheduler.pt")
            for rank, part in enumerate(processes):  # transformers' names: rng_state.pth in one process
                torch.save(
                    part.pop("rng"), directory / (f"rng_state_{rank}.pth" if len(processes) > 1 else "rng_state.pth")
                )
            torch.save({"loop": loop, "processes": processes}, directory / "generation_state.pt")
            state.save(directory / "trainer_state.json")
            if reference_weights is not None:
                from safetensors.torch import save_file

                save_file(_untied(reference_weights), str(directory / "reference.safetensors"))

        if fmt == "plain":
            path = write_checkpoint(self.output_dir, step, write)
        else:
            write(tmp)
            path = finish_checkpoint(self.output_dir, step, tmp)
        rotate_checkpoints(self.output_dir, self.save_total_limit, protect=state.best_model_checkpoint)
        acc.wait_for_everyone()  # once any process goes on, the checkpoint is complete
        return path

    def _check_finite(self, model, step: int) -> None:
        # Checked on every process so that all of them stop together (FSDP2: each checks its shards, then they
        # agree).
        acc = self.accelerator
        bad = [name for name, p in model.named_parameters() if not torch.isfinite(local_shard(p)).all()]
        if is_sharded(model) and acc.reduce(torch.tensor(float(len(bad)), device=acc.device), "sum").item() > 0:
            bad = bad or ["(on another process)"]
        if bad:
            raise FloatingPointError(
                f"Refusing to checkpoint non-finite weights ({bad[:3]}...) at step {step}; "
                f"the last complete checkpoint is kept."
            )

    # -------------------------------------------------------------------------------------------------- loading

    def find(self, resume: bool | str) -> Path:
        """The checkpoint `resume_from_checkpoint` names: True = the newest complete one in output_dir."""
        path = latest_checkpoint(self.output_dir) if resume is True else Path(resume)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {self.output_dir} holds no complete checkpoint; start without "
                f"resume_from_checkpoint or pass a checkpoint directory."
            )
        if not (path / "trainer_state.json").exists():
            raise FileNotFoundError(f"{path} is not a resumable checkpoint (no trainer_state.json).")
        return path

    def load(self, path: Path, parts: TrainingParts) -> Resumed:
        """Load the checkpoint at `path` into parts (in place, every process) and return the rest."""
        from safetensors.torch import load_file

        acc, model = self.accelerator, unwrap_model(self.accelerator, parts.model)
        if (path / DEEPSPEED_DIR).is_dir():
            if not self.deepspeed:
                raise ValueError(
                    f"{path} was written under DeepSpeed (its optimizer state is in DeepSpeed's "
                    f"partitioned format): resume it under DeepSpeed with the same number of "
                    f"processes."
                )
            # A LoRA model's checkpoint holds no frozen parameters (see save): they are not asked for.
            loaded, _ = parts.model.load_checkpoint(
                str(path / DEEPSPEED_DIR),
                tag="state",
                load_optimizer_states=True,
                load_lr_scheduler_states=False,
                load_module_strict=not is_peft_model(model),
            )
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path / DEEPSPEED_DIR} (written by as many processes?).")
        elif self.deepspeed:
            raise ValueError(
                f"{path} was not written under DeepSpeed, and DeepSpeed's engine resumes only from its "
                f"own checkpoints: resume it without DeepSpeed (DDP, FSDP2 or one process), or start "
                f"this DeepSpeed run from its weights as the model."
            )
        elif (path / SHARDED_DIR).is_dir():  # written by FSDP2 processes, each its shards: resharded to this layout
            load_sharded(
                path / SHARDED_DIR, model, parts.optimizer, parts.reference, trainable_only=is_peft_model(model)
            )
        else:
            load_model_weights(model, path)
            # Loaded on the CPU: the state was saved from the main process's device, and loading moves it to each
            # parameter's device (and, under FSDP2, keeps this process's shard of it).
            load_optimizer_state(
                model, parts.optimizer, torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu")
            )
        if (path / "reference.safetensors").exists() and parts.reference is not None:
            load_full_state_dict(parts.reference, load_file(str(path / "reference.safetensors")), strict=False)
        parts.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        own_rng = path / f"rng_state_{acc.process_index}.pth"
        if not own_rng.exists() and (path / "rng_state.pth").exists():  # written by a single process
            own_rng = path / "rng_state.pth"
        if own_rng.exists():
            set_rng_state(torch.load(own_rng, weights_only=False))
        else:
            warnings.warn(
                f"{path} holds no RNG state for process {acc.process_index}: it keeps its seeded RNG.", stacklevel=3
            )
        saved = torch.load(path / "generation_state.pt", weights_only=False, map_location="cpu")
        processes = saved["processes"]
        process = processes[acc.process_index] if len(processes) == acc.num_processes else None
        if process is None and any(p.get("batch") is not None for p in processes):
            # Each process's half-used generation batch is its slice of a global batch laid out for another
            # number of processes: the next step samples a fresh batch instead (those prompts are skipped).
            warnings.warn(
                f"{path} was written by {len(processes)} process(es), this run has {acc.num_processes}: "
                f"its half-used generation batch is dropped and a new one is sampled.",
                stacklevel=3,
            )
        if process is None and any(p.get("in_flight") for p in processes):
            # Likewise the batches asynchronous generation had sampled ahead (max_staleness): sampled again, by the
            # checkpoint's weights, so the run no longer follows the unbroken one's schedule exactly.
            warnings.warn(
                f"{path} was written by {len(processes)} process(es), this run has {acc.num_processes}: "
                f"the generation batches it held in flight (max_staleness) are dropped and sampled again "
                f"with the checkpoint's weights.",
                stacklevel=3,
            )
        return Resumed(TrainerState.load(path / "trainer_state.json"), saved["loop"], process)


def _untied(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors to save with safetensors: a tied weight (embeddings = LM head) once, under its first name (loading
    with strict=False fills the tie)."""
    seen, out = set(), {}
    for name, value in weights.items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key not in seen:
            seen.add(key)
            out[name] = value.contiguous()
    return out
