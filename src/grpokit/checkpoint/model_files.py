"""A model directory as transformers and peft read it: the weights (a LoRA adapter alone, and the merged model when
asked), the config, the tokenizer or processor, and the model card; `ModelWriter` writes a run's."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..compat import models_written_by_this_process
from ..distributed import full_state_dict, trainable_parameters
from ..model_card import model_card_writable, write_model_card
from ..models import is_peft_model, load_model_weights, save_merged


def write_model_files(
    output_dir: Path,
    model,
    processing_class,
    weights: dict[str, torch.Tensor] | None = None,
    *,
    with_weights: bool = True,
    save_merged_model: bool = False,
    model_card: Callable[[], str] | None = None,
) -> None:
    """Write `model` (its `weights` instead, when a sharded model's were gathered) into output_dir. Without weights
    (a sharded checkpoint keeps them in its own format), the config and processing class only, which make the
    directory legible. `model_card` renders the README.md, written unless the user keeps one of their own there."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if not with_weights:
        if hasattr(getattr(model, "config", None), "save_pretrained"):
            model.config.save_pretrained(output_dir)
        if hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(output_dir)
        return
    card = model_card is not None and model_card_writable(output_dir)  # first: peft writes a README.md of its own
    if hasattr(model, "save_pretrained"):
        # With LoRA: the adapter only. A sharded model saves the gathered weights. Without transformers' "Writing
        # model shards" bar, which every checkpoint would print between the training logs.
        with without_progress_bars():
            model.save_pretrained(
                output_dir, safe_serialization=True, **({"state_dict": weights} if weights is not None else {})
            )
            if save_merged_model and is_peft_model(model):
                save_merged(model, output_dir / "merged", processing_class, weights)
    else:
        from safetensors.torch import save_file

        weights = model.state_dict() if weights is None else weights
        save_file({k: v.contiguous() for k, v in weights.items()}, str(output_dir / "model.safetensors"))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    if card:
        write_model_card(output_dir, model_card())


def gathered_weights(model, save_merged_model: bool) -> dict[str, torch.Tensor]:
    """What `write_model_files` needs of a sharded model, gathered (a collective): with LoRA the adapter only (the
    base is never gathered), unless the merged model is written too."""
    adapter_only = is_peft_model(model) and not save_merged_model
    return trainable_parameters(model) if adapter_only else full_state_dict(model)


@dataclass
class ModelWriter:
    """A run's model directories (`GRPOTrainer.save_model`'s, and each checkpoint's model files): `write_model_files`
    with the run's model (unwrapped), processing class, save_merged and model card (`model_card()` renders it)."""

    model: Any
    processing_class: Any
    save_merged_model: bool
    model_card: Callable[[], str] | None = None
    # Not the main process, and writes all the same: each node's main process under save_on_each_node
    # (transformers would leave it to rank 0 alone).
    replica: bool = False

    def __call__(self, output_dir: Path, weights: dict[str, torch.Tensor] | None = None, with_weights: bool = True):
        """Write the model (its gathered `weights` when sharded) into output_dir; see `write_model_files`."""
        with models_written_by_this_process(self.replica):
            write_model_files(
                output_dir,
                self.model,
                self.processing_class,
                weights,
                with_weights=with_weights,
                save_merged_model=self.save_merged_model,
                model_card=self.model_card,
            )

    def gather(self, model) -> dict[str, torch.Tensor]:
        """`gathered_weights` of a sharded `model`, as this writer writes them (a collective)."""
        return gathered_weights(model, self.save_merged_model)


def load_best_checkpoint(model, state, metric_name: str, announce: bool = True) -> None:
    """load_best_model_at_end: the best checkpoint's weights (the adapter with LoRA) into the model."""
    path = Path(state.best_model_checkpoint)
    if not path.is_dir():
        warnings.warn(
            f"load_best_model_at_end: the best checkpoint {path} is gone; the model keeps its last weights.",
            UserWarning,
            stacklevel=3,
        )
        return
    load_model_weights(model, path)
    if announce:
        print(
            f"Loaded the best checkpoint, {path.name} ({metric_name} = {state.best_metric:.6g}).",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def without_progress_bars():
    """transformers' progress bars off (and back as they were after)."""
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()
