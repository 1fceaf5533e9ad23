"""Fast paths of the in-process engine, each equal to the plain computation it replaces (tests/test_rollout.py,
tests/test_architectures.py): a KV cache that writes into preallocated buffers, one-token decode attention as two
matmuls on CPU, and float32 linear layers through oneDNN with weights packed once per rollout on CPU (the last two
equal to float rounding). Each applies only where it is exact; elsewhere the model's own computation runs:

- preallocated buffers: layers that attend to every position a rollout holds (full attention, or a sliding window
  at least as long as prompt + completion). A shorter window, Mamba/linear-attention states (NemotronH) and
  attention-free blocks keep transformers' own cache layer.
- one-token attention: models that run SDPA (not eager ones such as Gemma 2's soft-capped or GPT-OSS's attention
  with sinks), and never for attention sinks.
- packed linear layers: plain `nn.Linear` modules with float32 weights, outside autocast, on a CPU whose torch has
  oneDNN, for models whose linear weights take at most PACKED_LINEARS_MAX_BYTES (the packed copies are extra memory).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..compat import (
    attention_implementation,
    attention_implementation_set_to,
    replace_cache_layer,
    replicate_layers_with,
)
from ..forward import model_cache, model_config
from ..onednn_linear import is_onednn_routed


def keeps_whole_rollout(layers, capacity: int) -> list[bool]:
    """Which cache layers keep every key a rollout of `capacity` positions writes: the full-attention layers, and
    the sliding-window ones when every window is at least `capacity` (so none ever drops a position). All sliding
    layers or none: transformers builds one sliding-window mask for them all, sized by the first of them."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    sliding = [type(layer) is DynamicSlidingWindowLayer for layer in layers]
    windows_hold_it = all(capacity <= layer.sliding_window for layer, slides in zip(layers, sliding) if slides)
    return [type(layer) is DynamicLayer or (slides and windows_hold_it) for layer, slides in zip(layers, sliding)]


def sampling_cache(model: torch.nn.Module, capacity: int):
    """The decode loop's KV cache: the model's own layout (`model_cache`), each layer that keeps every key of the
    rollout (`keeps_whole_rollout`) writing into buffers of `capacity` positions (`PreallocatedLayer`) instead of
    concatenating: a decode loop of T steps copies those layers once, not T times (the concatenation was a third
    of the rollout's time on a small model). The other layers (windows shorter than the rollout, Mamba states,
    attention-free blocks) keep transformers' class, so the cache holds what the model's own cache would.

    Under autocast, with attention that casts its inputs to the autocast dtype (`CASTING_ATTENTION`), the buffers
    hold keys and values in that dtype: float32 weights under bf16 autocast make float32 keys (RoPE's float32
    cos/sin promote them), which SDPA would round to bf16 at every decode step anyway. Same attention inputs, so
    the same tokens and log-probs, in two thirds of the memory."""
    config = model_config(model)
    layer_class = preallocated_layer_class()
    store_in_autocast_dtype = attention_implementation(config) in CASTING_ATTENTION
    make_layer = functools.partial(layer_class, capacity, store_in_autocast_dtype=store_in_autocast_dtype)
    cache = model_cache(config)
    if not cache.layers:  # no config: layers are made as the model writes them
        replicate_layers_with(cache, make_layer)
    for index, whole in enumerate(keeps_whole_rollout(cache.layers, capacity)):
        if whole:
            replace_cache_layer(cache, index, make_layer())
    return cache


@functools.cache  # the class subclasses a transformers class: defined on first use
def preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A full-attention cache layer over buffers [B, H, capacity, D]; `keys`/`values` are views of the filled
        part. Grows (one copy) if a sequence outruns the capacity. For sampling only: the writes are in place."""

        def __init__(self, capacity: int, store_in_autocast_dtype: bool = False):
            super().__init__()
            self.capacity, self.length = capacity, 0
            self.store_in_autocast_dtype = store_in_autocast_dtype  # see `sampling_cache`
            self._keys = self._values = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self._keys is None or end > self._keys.shape[-2]:
                self._keys = self._grown(self._keys, key_states, max(end, self.capacity))
                self._values = self._grown(self._values, value_states, max(end, self.capacity))
            self._keys[:, :, self.length : end].copy_(key_states)
            self._values[:, :, self.length : end].copy_(value_states)
            self.length = end
            self._refresh()
            return self.keys, self.values

        def _grown(self, buffer, states, size):
            dtype, device_type = states.dtype, states.device.type
            if self.store_in_autocast_dtype and dtype in AUTOCAST_CASTS and torch.is_autocast_enabled(device_type):
                dtype = torch.get_autocast_dtype(device_type)
            new = states.new_empty(*states.shape[:2], size, states.shape[-1], dtype=dtype)
            if buffer is not None:
                new[:, :, : self.length].copy_(buffer[:, :, : self.length])
            return new

        def _refresh(self):
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            """Row i becomes row beam_idx[i] (rows kept, dropped or repeated; `compat.select_cache_rows`)."""
            if self.length:
                self._keys, self._values = self._keys[beam_idx], self._values[beam_idx]
                self._refresh()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.length:
                rows = torch.arange(self._keys.shape[0], device=self._keys.device)
                self.reorder_cache(rows.repeat_interleave(repeats))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self.reorder_cache(indices)

        def reset(self) -> None:
            self.length, self._keys, self._values = 0, None, None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("PreallocatedLayer does not crop")

    return PreallocatedLayer


ONE_TOKEN_ATTENTION = "grpokit_one_token"
# Attention implementations that run their matmuls on autocast-cast inputs (SDPA is on autocast's lower-precision
# list; the flash kernels take the autocast dtype; ONE_TOKEN_ATTENTION is two autocast matmuls). Eager attention is
# left out: some models' eager functions upcast the keys to float32 with autocast turned off.
CASTING_ATTENTION = frozenset({"sdpa", ONE_TOKEN_ATTENTION, "flash_attention_2", "flash_attention_3"})
AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (float64 it leaves alone)


def one_token_attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' SDPA attention, except for one-token queries (decode steps), which take two matmuls over the
    key/value heads (grouped-query heads packed, no repeat): on CPU, torch's SDPA kernels cost more than the
    arithmetic for these shapes (bf16 especially: 1.4 ms a call where the matmuls take 0.3). Same values up to
    float rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or dropout or kwargs.get("sinks") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    batch, heads, _, dim = query.shape
    mask = None if attention_mask is None else attention_mask[:, :, -1:, : key.shape[2]]  # [batch, 1, 1, length]
    out = one_token_attention_products(query, key, value, mask, dim**-0.5 if scaling is None else scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def one_token_attention_products(query, key, value, mask, scaling: float) -> torch.Tensor:
    """The one-token attention's arithmetic: query [batch, heads, 1, dim] against key/value [batch, kv_heads,
    length, dim], mask [batch, 1, 1, length] (bool: True attends; or additive) or None -> [batch, kv_heads, g,
    value dim] (g = heads // kv_heads). Shared by `one_token_attention_forward` and the direct decode step
    (`direct.py`), whose logits are bitwise the model forward's."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h attends with key/value head h // g
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


@functools.cache
def _register_one_token_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ONE_TOKEN_ATTENTION, one_token_attention_forward)
    AttentionMaskInterface.register(ONE_TOKEN_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def one_token_attention(model: torch.nn.Module, device: torch.device, static: bool = False):
    """While sampling on CPU, or with static decoding (`static.py`) on any device, a transformers model that uses
    SDPA attention takes `one_token_attention_forward` (its config's attention implementation is switched for the
    duration, and back). On an accelerator the static step is compiled: there transformers' SDPA path would copy
    the keys and values over the whole static capacity once per query head of a group (`repeat_kv`; transformers
    packs the heads in eager mode only, from 5.2x), 7 copies of 1.7 GB of cache per token at the Qwen2.5-0.5B
    shape, where the packed matmuls read the cache once and the compiler fuses the masked softmax."""
    config = model_config(model)
    if getattr(config, "sub_configs", None):  # multimodal: the language layers read the text config
        # Static decoding switches the text config alone (the vision tower keeps its own); the default decoder
        # leaves multimodal models on SDPA, and so does a text config that still holds sub-configs.
        text = config.get_text_config() if static else config
        config = None if getattr(text, "sub_configs", None) else text
    if config is None or (device.type != "cpu" and not static) or attention_implementation(config) != "sdpa":
        yield
        return
    _register_one_token_attention()
    with attention_implementation_set_to(config, ONE_TOKEN_ATTENTION):
        yield


# The decode's linear layers take oneDNN's float32 kernel with weights packed for it (`packed_linears`) where their
# weights take at most this many bytes: the packed copies live while the rollout runs.
PACKED_LINEARS_MAX_BYTES = 256 << 20
PACKED_BATCH_HINT = 64  # rows the packed layout is chosen for (any number of rows runs with it)


@functools.cache
def _can_pack_linears() -> bool:
    """Whether this torch's CPU build packs float32 linear weights for oneDNN (`torch.ops.mkldnn`), checked once on
    a tiny layer against `F.linear`."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        weight, bias, x = torch.randn(8, 4), torch.randn(8), torch.randn(3, 4)
        packed = ops._reorder_linear_weight(weight, PACKED_BATCH_HINT)
        out = ops._linear_pointwise(x, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5))


def _packed_linear_forward(
    layer: torch.nn.Linear, packed: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    if x.dtype != torch.float32 or torch.is_grad_enabled():  # not what was packed for: the layer's own forward
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packable_linears(model: torch.nn.Module, device: torch.device) -> list[torch.nn.Linear]:
    """The layers `packed_linears` packs: plain `nn.Linear` modules (not subclasses: quantized and adapter layers
    compute otherwise) with float32 weights and biases, whose forward is the class's (not one a hook library such
    as accelerate replaced on the instance) or `onednn_linear`'s route (given back on exit); none on an
    accelerator, under autocast, for a sharded model, without oneDNN, or when their weights take more than
    PACKED_LINEARS_MAX_BYTES."""
    from ..distributed import is_sharded

    if device.type != "cpu" or torch.is_autocast_enabled("cpu") or not _can_pack_linears() or is_sharded(model):
        return []
    layers = [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and ("forward" not in module.__dict__ or is_onednn_routed(module))
        and type(module.weight.data) is torch.Tensor
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and (module.bias is None or module.bias.dtype == torch.float32)
    ]
    if sum(layer.weight.numel() * 4 for layer in layers) > PACKED_LINEARS_MAX_BYTES:
        return []
    return layers


def is_packed(layer: torch.nn.Module) -> bool:
    """Whether `packed_linears` gave this layer its packed forward (for the rollout under way)."""
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _packed_linear_forward


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, device: torch.device):
    """While sampling on CPU in float32, the model's linear layers (`packable_linears`) run oneDNN's kernel with
    their weights packed once for it (per rollout: the weights change between rollouts) instead of torch's MKL
    gemm: the `small` benchmark's rollout (64 rows x 64 tokens through a 4M-parameter Qwen2) ran 1.08-1.25x faster
    on two threads over four invocations (0.56-0.67 s against 0.61-0.83 s; `benchmarks/decode_linears.py`). The
    same products summed in another order: the same tokens there, log-probs within 1.2e-6 (the training forward's
    1e-5 of `logprobs_match_training` holds). The layers get their own forward back on exit."""
    layers = packable_linears(model, device)
    routed = {id(layer): layer.__dict__["forward"] for layer in layers if "forward" in layer.__dict__}
    try:
        with torch.no_grad():
            for layer in layers:
                packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACKED_BATCH_HINT)
                bias = None if layer.bias is None else layer.bias.detach()
                layer.forward = functools.partial(_packed_linear_forward, layer, packed, bias)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
            if id(layer) in routed:  # `onednn_linear.onednn_linears`' route, for the training passes
                layer.forward = routed[id(layer)]
