"""What every forward of a model needs, shared by the sampler (`rollout/`) and the training forward
(`logprobs.py`): the config its layers read, an empty cache laid out for it, position ids that skip left padding,
whether its forward takes an argument, and its logits."""

from __future__ import annotations

import inspect

import torch


def model_config(model: torch.nn.Module):
    """The config a transformers model's layers read (through a PeftModel, its base model's), or None."""
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", lambda: None)()
    return getattr(base, "config", config)


def model_cache(config):
    """An empty DynamicCache laid out for `config` as the model would lay out its own: one cache layer per decoder
    layer, of transformers' class for its kind (full attention, sliding window, linear attention / Mamba, none for
    attention-free MoE or MLP blocks). Without a transformers config, full-attention layers made as they are
    written."""
    from transformers import DynamicCache, PretrainedConfig

    return DynamicCache(config=config) if isinstance(config, PretrainedConfig) else DynamicCache()


def logits_of(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: [0 0 0 1 2] for mask [0 0 1 1 1]."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_accepts(model: torch.nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
