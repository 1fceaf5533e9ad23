"""Every touch of another library's private or version-dependent internals, in one place.

Each function names what it reaches into and why no public API does the job; tests/test_compat.py checks each
against the installed versions, so that an upgrade that moves one fails there, by name, rather than deep in a run.
"""

from __future__ import annotations

import contextlib

import torch

# ---------------------------------------------------------------------------------------------------- accelerate


def set_accumulation_boundary(accelerator, is_boundary: bool) -> None:
    """Tell accelerate (and through it DeepSpeed, which steps inside backward) whether this micro-batch ends an
    optimizer step. `GradientState._set_sync_gradients` is private; the public `accumulate()` context counts
    steps itself, and grpokit's windows need not line up with that count."""
    accelerator.gradient_state._set_sync_gradients(is_boundary)


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide state (an earlier trainer's precision in the same Python process).
    `AcceleratorState._reset_state` is private; accelerate's own tests use it for the same purpose."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def deepspeed_config_of(engine) -> dict:
    """The resolved configuration dict of a DeepSpeed engine (`engine.config` in recent versions, the private
    `_config._param_dict` before)."""
    return engine.config if isinstance(engine.config, dict) else engine._config._param_dict


# --------------------------------------------------------------------------------------------------- transformers


def output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's LM head (`get_output_embeddings()`), or None for a module that has no such method."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def is_activation_checkpointing(model: torch.nn.Module) -> bool:
    """Whether gradient (activation) checkpointing is on: transformers 5 renamed `is_gradient_checkpointing`."""
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, name, False))


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name under which a model's forward takes its KV cache: `cache` (transformers >= 5.24 renamed it),
    `past_key_values` (earlier versions, and most hand-written modules), or None when it names neither. A forward
    that takes only **kwargs (a PeftModel) is judged by the model it wraps (`get_base_model`)."""
    import inspect

    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        if candidate is None:
            continue
        try:
            params = inspect.signature(candidate.forward).parameters
        except (TypeError, ValueError):
            continue
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return None


def output_cache(output):
    """The KV cache a transformers forward returned: `output.cache` from 5.24 on (`past_key_values` before; the old
    name still reads, with a deprecation warning, until 5.40)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding given (keys, values) per layer. The `ddp_cache_data` constructor argument is the
    only way to build one from tensors that keeps them in the autograd graph (`update` would too, but appends)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=layers)


def replicate_layers_with(cache, make_layer) -> None:
    """Make `cache` create its layers with `make_layer()` (a DynamicLayer subclass) as the model first writes
    them: transformers' `layer_class_to_replicate` hook, set after construction."""
    cache.layer_class_to_replicate = make_layer


def replace_cache_layer(cache, index: int, layer) -> None:
    """Put `layer` (a DynamicLayer subclass) in place of a cache's layer `index` before the model writes it. The
    Cache reads its per-layer properties (`is_sliding`, `is_linear`, ...) from `cache.layers` at each call, so a
    swapped entry is seen everywhere; there is no constructor that takes a config's layout with some layers of
    one's own."""
    cache.layers[index] = layer


def select_cache_rows(cache, rows: torch.Tensor) -> None:
    """Make row i of every layer of a transformers cache its row rows[i], in place: rows kept, dropped or repeated.

    Every cache layer class implements `reorder_cache(index)` (beam search's reordering), over all of its state.
    `Cache.batch_select_indices` and `batch_repeat_interleave` do not: in transformers 5 a LinearAttentionLayer
    (Mamba, NemotronH) has neither, and the hybrid Mamba-and-attention layers inherit DynamicLayer's, which move the
    keys and values but leave the convolution and SSM states behind."""
    for layer in cache.layers:
        layer.reorder_cache(rows)


def attention_implementation(config) -> str | None:
    return getattr(config, "_attn_implementation", None)


@contextlib.contextmanager
def attention_implementation_set_to(config, name: str):
    """Switch a loaded model's attention implementation for a while: `config._attn_implementation` is what the
    attention layers read at every call (`set_attn_implementation` would also re-check and re-load kernels)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def tied_weight_keys(model: torch.nn.Module) -> set[str]:
    """Names of parameters tied to another one (a saved checkpoint may hold them once): `_tied_weights_keys`, a
    list in transformers 4 and a dict {tied name: source name} in transformers 5."""
    keys = getattr(model, "_tied_weights_keys", None) or []
    return set(keys.keys() if isinstance(keys, dict) else keys)


# --------------------------------------------------------------------------------------------------------- torch


def is_peft_model(model) -> bool:
    """Whether `model` is a peft model (a base with an adapter); False where peft is not installed."""
    try:
        from peft import PeftModel  # peft is optional
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def parameter_versions(model: torch.nn.Module) -> tuple[tuple[int, int], ...] | None:
    """A fingerprint of the model's weights that changes whenever one is written: each parameter's storage address
    and in-place version counter (`Tensor._version`, private; every in-place write, an optimizer step's included,
    bumps it). Reading the weights themselves to compare them would cost a pass over the whole model. None where
    no fingerprint is kept: DeepSpeed ZeRO-3 writes its partitions through `.data`, which bumps no counter, so
    the weights must be taken as changed every time."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


@contextlib.contextmanager
def models_written_by_this_process(writes: bool = True):
    """transformers 5's `save_pretrained` writes a model's files from global rank 0 only when torch.distributed is
    initialized, whatever its `is_main_process` says (`PreTrainedModel.should_save_on_this_rank`). A process that
    must write them although it is not rank 0 (each node's main process under save_on_each_node) lifts that rule
    for the duration; `writes=False` leaves it alone."""
    from transformers import PreTrainedModel

    if not writes or not hasattr(PreTrainedModel, "should_save_on_this_rank"):
        yield
        return
    PreTrainedModel.should_save_on_this_rank = lambda self, is_main_process: is_main_process  # shadows the mixin's
    try:
        yield
    finally:
        del PreTrainedModel.should_save_on_this_rank
