"""Saving and resuming a GRPOTrainer: the final model, atomic checkpoints (unsharded, FSDP2-sharded or DeepSpeed's
own), and exact resume. A mixin of GRPOTrainer; it reads the trainer's model, optimizer, scheduler, sampler and
state."""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import (
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    rng_state,
    rotate_checkpoints,
    set_rng_state,
    write_checkpoint,
)
from .distributed import (
    DEEPSPEED_DIR,
    SHARDED_DIR,
    full_optimizer_state,
    full_state_dict,
    is_sharded,
    load_full_state_dict,
    load_optimizer_state,
    load_sharded,
    local_shard,
    save_sharded,
    wants_sharded_checkpoints,
)
from .model_card import describe_dataset, model_card_writable, render_model_card, write_model_card
from .policy import is_peft_model, load_model_weights, save_merged


@dataclass
class TrainerState:
    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_tokens: int = 0
    generations: int = 0  # generation batches produced so far (seeds each rollout)
    nonfinite_steps: int = 0  # updates skipped for a NaN/inf loss or gradient
    nonfinite_in_a_row: int = 0
    log_history: list[dict] = field(default_factory=list)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "TrainerState":
        return cls(**json.loads(path.read_text()))


class Checkpointing:

    def save_model(self, output_dir: str | None = None) -> None:
        """Every process calls it; the main process writes (under FSDP2 all of them gather the weights first)."""
        self.accelerator.wait_for_everyone()
        weights = self._gathered_weights()
        if self.accelerator.is_main_process:
            self._write_model(Path(output_dir or self.args.output_dir), weights)

    def _gathered_weights(self) -> dict[str, torch.Tensor] | None:
        """Under FSDP2 or ZeRO-3 the full weights, gathered (a collective; the main process gets them, and under
        ZeRO-3 the others too); otherwise None: the model's own state dict is whole."""
        return full_state_dict(self.unwrapped_model) if is_sharded(self.unwrapped_model) else None

    def _write_model(self, output_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        card = model_card_writable(output_dir)  # asked first: peft's save_pretrained writes a README.md of its own
        model = self.unwrapped_model
        if hasattr(model, "save_pretrained"):
            # With LoRA: the adapter only. A sharded model saves the gathered weights.
            model.save_pretrained(output_dir, safe_serialization=True,
                                  **({"state_dict": weights} if weights is not None else {}))  # fmt: skip
            if self.args.save_merged and is_peft_model(model):
                save_merged(model, output_dir / "merged", self.processing_class)
        else:
            from safetensors.torch import save_file

            weights = model.state_dict() if weights is None else weights
            save_file({k: v.contiguous() for k, v in weights.items()}, str(output_dir / "model.safetensors"))
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        if card:
            write_model_card(output_dir, self._model_card())

    def _model_card(self) -> str:
        history = self.state.log_history
        base_model = getattr(getattr(self.unwrapped_model, "config", None), "name_or_path", "") or "(a model object)"
        return render_model_card(
            self.args.run_name or Path(self.args.output_dir).name, base_model,
            describe_dataset(self.train_dataset),
            [(f.name, w) for f, w in zip(self.reward_functions, self.reward_weights.tolist())],
            {**self.args.to_dict(), "max_steps": self.state.max_steps},
            final_metrics=next((r for r in reversed(history) if "reward" in r), None),
            final_eval=next((r for r in reversed(history) if "eval/reward" in r), None),
        )  # fmt: skip

    def _save_checkpoint(self) -> Path | None:
        """Every process calls it: each hands its own RNG state and half-used generation batch to the main
        process, which writes the one checkpoint while the others wait. Under FSDP2 the weights and optimizer
        state are gathered into it, or (SHARDED_STATE_DICT) each process writes its shards into it first."""
        from accelerate.utils import broadcast_object_list, gather_object

        args, acc, model = self.args, self.accelerator, self.unwrapped_model
        # Checked on every process so that all of them stop together (FSDP2: each checks its shards, then they
        # agree).
        bad = [name for name, p in model.named_parameters() if not torch.isfinite(local_shard(p)).all()]
        if is_sharded(model) and acc.reduce(torch.tensor(float(len(bad)), device=acc.device), "sum").item() > 0:
            bad = bad or ["(on another process)"]
        if bad:
            raise FloatingPointError(f"Refusing to checkpoint non-finite weights ({bad[:3]}...) at step "
                                     f"{self.state.global_step}; the last complete checkpoint is kept.")  # fmt: skip
        keep_reference = args.sync_ref_model and self.reference is not None and not args.save_only_model
        sharded = (wants_sharded_checkpoints(acc) or self._deepspeed) and not args.save_only_model
        weights = optimizer_state = reference_weights = tmp = None
        if sharded:  # every process writes its shards into the checkpoint's temporary directory
            tmp = broadcast_object_list([begin_checkpoint(args.output_dir, self.state.global_step)
                                         if acc.is_main_process else None])[0]  # fmt: skip
        if sharded and self._deepspeed:  # the engine's own format: weights and each process's optimizer partition
            self.model.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag="state")
            reference_weights = full_state_dict(self.reference) if keep_reference else None
        elif sharded:
            save_sharded(tmp / SHARDED_DIR, model, self.optimizer, self.reference if keep_reference else None)
        else:  # collectives under FSDP2: every process takes part, the main process gets the full tensors
            weights = self._gathered_weights()
            optimizer_state = (full_optimizer_state(model, self.optimizer)
                               if is_sharded(model) and not args.save_only_model else None)  # fmt: skip
            reference_weights = full_state_dict(self.reference) if keep_reference else None
        per_process = [] if args.save_only_model else gather_object([{
            "rng": rng_state(),
            "generation": _batch_to(self._generation, "cpu"),
        }])  # fmt: skip
        if not acc.is_main_process:
            acc.wait_for_everyone()
            return None

        def write(directory: Path) -> None:
            if sharded:  # the weights are in SHARDED_DIR; the config and tokenizer make the directory legible
                if hasattr(getattr(model, "config", None), "save_pretrained"):
                    model.config.save_pretrained(directory)
                if hasattr(self.processing_class, "save_pretrained"):
                    self.processing_class.save_pretrained(directory)
            else:
                self._write_model(directory, weights)
            if args.save_only_model:
                return
            if not sharded:
                torch.save(self.optimizer.state_dict() if optimizer_state is None else optimizer_state,
                           directory / "optimizer.pt")  # fmt: skip
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
            for rank, state in enumerate(per_process):  # Transformers' names: rng_state.pth in one process
                torch.save(state["rng"], directory / (f"rng_state_{rank}.pth" if len(per_process) > 1
                                                      else "rng_state.pth"))  # fmt: skip
            torch.save({"sampler": self.sampler.state_dict(), "window": self.window.state_dict(),
                        "generations": [state["generation"] for state in per_process], "micro_step": self._micro_step},
                       directory / "generation_state.pt")  # fmt: skip
            self.state.save(directory / "trainer_state.json")
            if keep_reference and reference_weights is not None:  # the reference has moved: keep it too
                from safetensors.torch import save_file

                save_file(_untied(reference_weights), str(directory / "reference.safetensors"))

        if sharded:
            write(tmp)
            path = finish_checkpoint(args.output_dir, self.state.global_step, tmp)
        else:
            path = write_checkpoint(args.output_dir, self.state.global_step, write)
        rotate_checkpoints(args.output_dir, args.save_total_limit)
        acc.wait_for_everyone()  # once any process goes on, the checkpoint is complete
        return path

    def _load_deepspeed_checkpoint(self, path: Path) -> None:
        if not self._deepspeed:
            raise ValueError(f"{path} was written under DeepSpeed (its optimizer state is in DeepSpeed's partitioned "
                             f"format): resume it under DeepSpeed with the same number of processes.")  # fmt: skip
        loaded, _ = self.model.load_checkpoint(str(path / DEEPSPEED_DIR), tag="state", load_optimizer_states=True,
                                               load_lr_scheduler_states=False)  # fmt: skip
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path / DEEPSPEED_DIR} (was it written by as many processes?).")
        if (path / "reference.safetensors").exists() and self.reference is not None:
            from safetensors.torch import load_file

            load_full_state_dict(self.reference, load_file(str(path / "reference.safetensors")), strict=False)

    def _resume(self, resume: bool | str) -> None:
        path = latest_checkpoint(self.args.output_dir) if resume is True else Path(resume)
        if path is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint=True but {self.args.output_dir} holds no complete checkpoint; "
                f"start without resume_from_checkpoint or pass a checkpoint directory."
            )
        if not (path / "trainer_state.json").exists():
            raise FileNotFoundError(f"{path} is not a resumable checkpoint (no trainer_state.json).")
        from safetensors.torch import load_file

        if (path / DEEPSPEED_DIR).is_dir():
            self._load_deepspeed_checkpoint(path)
        elif self._deepspeed:
            raise ValueError(f"{path} was not written under DeepSpeed, and DeepSpeed's engine resumes only from its "
                             f"own checkpoints: resume it without DeepSpeed (DDP, FSDP2 or one process), or start "
                             f"this DeepSpeed run from its weights as the model.")  # fmt: skip
        elif (path / SHARDED_DIR).is_dir():  # written by FSDP2 processes, each its shards: resharded to this layout
            keep_reference = self.args.sync_ref_model and self.reference is not None
            load_sharded(path / SHARDED_DIR, self.unwrapped_model, self.optimizer,
                         self.reference if keep_reference else None)  # fmt: skip
        else:
            load_model_weights(self.unwrapped_model, path)
            if (path / "reference.safetensors").exists() and self.reference is not None:
                load_full_state_dict(self.reference, load_file(str(path / "reference.safetensors")), strict=False)
            # Loaded on the CPU: the state was saved from the main process's device, and loading moves it to each
            # parameter's device (and, under FSDP2, keeps this process's shard of it).
            load_optimizer_state(self.unwrapped_model, self.optimizer,
                                 torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu"))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        acc = self.accelerator
        own_rng = path / f"rng_state_{acc.process_index}.pth"
        if not own_rng.exists() and (path / "rng_state.pth").exists():  # written by a single process
            own_rng = path / "rng_state.pth"
        if own_rng.exists():
            set_rng_state(torch.load(own_rng, weights_only=False))
        else:
            warnings.warn(f"{path} holds no RNG state for process {acc.process_index}: it keeps its seeded RNG.",
                          stacklevel=3)  # fmt: skip
        extra = torch.load(path / "generation_state.pt", weights_only=False, map_location="cpu")
        self.sampler.load_state_dict(extra["sampler"])
        self.window.load_state_dict(extra["window"])
        generations = extra.get("generations", [extra.get("generation")])
        if len(generations) == acc.num_processes:
            self._generation = _batch_to(generations[acc.process_index], acc.device)
            self._micro_step = extra["micro_step"]
        else:
            # Each process's half-used generation batch is its slice of a global batch laid out for another
            # number of processes: the next step samples a fresh batch instead (those prompts are skipped).
            self._generation, self._micro_step = None, 0
            passes = self.args.steps_per_generation * self.args.num_iterations
            if generations[0] is not None and extra["micro_step"] < passes:
                warnings.warn(f"{path} was written by {len(generations)} process(es), this run has "
                              f"{acc.num_processes}: its half-used generation batch is dropped and a new one is "
                              f"sampled.", stacklevel=3)  # fmt: skip
        self.state = TrainerState.load(path / "trainer_state.json")
        self.state.max_steps = self._total_steps()  # the run's length is this config's, not the checkpoint's


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


def _batch_to(batch: dict | None, device) -> dict | None:
    return None if batch is None else {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
