"""The optimizer a run asks for: `optim` (with `optim_args`, `optim_target_modules`), `learning_rate`, `adam_beta1`,
`adam_beta2`, `adam_epsilon` and `weight_decay`, built through transformers' own optimizer registry
(`transformers.Trainer.get_optimizer_cls_and_kwargs`), so each name means what it means in TRL: `adamw_torch`,
`adamw_torch_fused` (torch's fused kernel, which also runs on CPU), `adafactor`, `sgd`, `adagrad`, `rmsprop`, the
bitsandbytes 8-bit and paged ones (`adamw_8bit`, `paged_adamw_32bit`, ...), torchao's 8-bit and 4-bit AdamW
(`adamw_torch_8bit`, `adamw_torch_4bit`), GaLore, schedule-free, ... The low-precision ones (`pip install
'grpokit[lowmem]'`) run on the CPU too; tests/test_memory.py checks that they learn and resume bitwise.

Weight decay skips biases and norm weights, as transformers' Trainer does (`Trainer.get_decay_parameter_names`).
With `weight_decay=0` (the default) that split changes nothing, so there is one parameter group, and
`optim='adamw_torch'` gives exactly `torch.optim.AdamW(trainable, lr, betas, eps, weight_decay=0)`: the same numbers
and the same state-dict layout as grpokit's optimizer before this module (which decayed every parameter).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import torch


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters weight decay applies to: all but biases and norm weights (transformers' rule)."""
    from transformers import Trainer

    # An instance method that does not read `self` (transformers 4.x-5.x); tests/test_optim.py pins its answer.
    return set(Trainer.get_decay_parameter_names(None, model))


def _transformers_args(args) -> SimpleNamespace:
    """What transformers' optimizer handlers read from TrainingArguments, from a GRPOConfig (or TrainingArguments)."""
    from transformers.training_args import OptimizerNames, ParallelMode

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values["optim"] = OptimizerNames(values["optim"])  # the registry is keyed by the enum
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    values["parallel_mode"] = ParallelMode.DISTRIBUTED if distributed else ParallelMode.NOT_PARALLEL
    return SimpleNamespace(**values)


def build_optimizer(params_or_model, args) -> torch.optim.Optimizer:
    """The optimizer of `args.optim` over the trainable parameters of a model, or over the parameters given.

    Given a model, weight decay skips biases and norm weights; given bare parameters there are no names to tell
    them apart, so weight decay applies to all of them. Optimizers that need the model itself (GaLore, LOMO) need a
    model. A missing package (bitsandbytes for the 8-bit and paged optimizers) raises an ImportError naming it.
    """
    from transformers import Trainer

    model = params_or_model if isinstance(params_or_model, torch.nn.Module) else None
    if model is not None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    else:
        named = [(None, p) for p in params_or_model if p.requires_grad]
    decayed = decay_parameter_names(model) if model is not None and args.weight_decay else None
    if decayed is None:
        groups = [{"params": [p for _, p in named], "weight_decay": args.weight_decay}]
    else:
        groups = [{"params": [p for name, p in named if name in decayed], "weight_decay": args.weight_decay},
                  {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0}]  # fmt: skip
        groups = [group for group in groups if group["params"]]
    try:
        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(_transformers_args(args), model)
    except ImportError as error:
        raise ImportError(f"optim={args.optim!r} needs a package that is not installed: {error}") from error
    kwargs = dict(kwargs)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        return optimizer_cls()(model, **kwargs)  # a factory that splits the model's parameters itself (Muon, Dion)
    for key in ("params", "model", "optimizer_dict"):  # handlers that choose the parameters (GaLore, LOMO, layer-wise)
        if key in kwargs:
            groups = kwargs.pop(key)
    optimizer = optimizer_cls(groups, **kwargs)
    if "bitsandbytes" in optimizer_cls.__module__ and kwargs.get("optim_bits") == 8 and model is not None:
        # As transformers' Trainer: embeddings keep 32-bit optimizer states (8-bit ones destabilise them).
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer
