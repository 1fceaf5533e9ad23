"""Static-shape decoding, `cache_implementation="static"` (TRL's field: the KV-cache class it asks generate() for).

On a GPU the decode loop of a small or medium model is bound by Python, not by the GPU: each token runs the model's
forward in eager mode, about ten kernel launches per layer from Python, for a few hundred microseconds of GPU work.
CUDA graphs replay a recorded forward with one launch, but they need every decode step to have the same shapes and
the same memory addresses. This module gives the decode steps exactly that:

- a transformers `StaticCache` of [rows, capacity] positions, kept by the engine from one rollout to the next (as
  transformers' generate keeps its own), so that its buffers keep their addresses;
- one attention mask of [rows, capacity] for the whole rollout: the prompts' padding, then ones. Positions not yet
  written are hidden by the causal mask, which reads the query's position from the cache;
- no rows dropped: finished rows keep decoding, masked out afterwards (the loop's rule under `all_done`).

The step is compiled with `torch.compile(mode="reduce-overhead")` on CUDA (CUDA graphs); elsewhere it runs eagerly
unless compilation is asked for (transformers' rule for generate(): static caches compile on CUDA only). The
prefill runs eagerly, each group's prompt once, into a dynamic cache whose keys and values are then copied into
the static buffers. Attention over the whole capacity with the unwritten positions masked gives the dynamic
decoder's values up to float rounding (tested: the same tokens, log-probs within float32 rounding).
"""

from __future__ import annotations

import functools

import torch

from ..compat import replace_cache_layer
from ..forward import logits_of, model_cache, model_config
from .decoders import CachedDecoder

# A rollout's positions (prompt + completion) are rounded up to a multiple of this, so that prompt batches of
# slightly different widths reuse one cache and one compiled step.
CAPACITY_MULTIPLE = 64


def check_static_decoding(model: torch.nn.Module) -> None:
    """Refuse, with the reason and the fix, a model whose decode steps cannot take a static cache here: no
    transformers config, or layers that do not attend to every position (sliding windows, Mamba / linear
    attention, attention-free blocks), whose static layers keep other layouts than the one the prefill is copied
    into."""
    from transformers import PretrainedConfig
    from transformers.cache_utils import DynamicLayer

    config = model_config(model)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(
            f"cache_implementation='static' needs a transformers model with a KV cache; "
            f"{type(model).__name__} has no transformers config. Leave cache_implementation unset."
        )
    kinds = {type(layer).__name__ for layer in model_cache(config).layers}
    if not kinds or kinds != {DynamicLayer.__name__}:
        raise ValueError(
            f"cache_implementation='static' supports models whose layers all use full attention; "
            f"{getattr(config, 'model_type', type(model).__name__)} has cache layers {sorted(kinds)} "
            f"(sliding windows, Mamba or linear attention). Leave cache_implementation unset: the "
            f"default sampler keeps each layer's own cache."
        )


class StaticDecoding:
    """What the engine keeps between rollouts for static decoding: the cache and the (compiled) step.

    compile: None compiles on CUDA only (CUDA graphs: mode 'reduce-overhead'); True compiles on any device (on CPU
    with inductor's default mode: tests use it to check the compiled step), False never."""

    def __init__(self, model: torch.nn.Module, compile: bool | None = None):
        check_static_decoding(model)
        self.model, self.compile = model, compile
        self.cache = None
        self._step = None  # (model, device type, callable)

    def step_function(self, device: torch.device):
        if self._step is None or self._step[0] is not self.model or self._step[1] != device.type:
            compile = device.type == "cuda" if self.compile is None else self.compile
            function = self.model
            if compile:
                mode = "reduce-overhead" if device.type == "cuda" else None
                function = torch.compile(self.model, mode=mode, dynamic=False)
            self._step = (self.model, device.type, function)
        return self._step[2]

    @property
    def uses_cuda_graphs(self) -> bool:
        return self._step is not None and self._step[2] is not self.model and self._step[1] == "cuda"

    def cache_for(self, prefilled, rows: int, capacity: int):
        """A StaticCache of `rows` × at least `capacity` positions with the prefill's head counts and dtypes (its
        `PreallocatedLayer`s already hold keys and values in the dtype the decode steps store, `fast.sampling_cache`):
        the one kept from the last rollout when it fits, else a new one (its positions rounded up to
        CAPACITY_MULTIPLE)."""
        from transformers import StaticCache

        def fits(cache) -> bool:
            return all(
                static.batch_size == rows
                and static.max_cache_len >= capacity
                and static.keys.dtype == dynamic.keys.dtype
                and static.values.dtype == dynamic.values.dtype
                and static.keys.device == dynamic.keys.device
                and static.keys.shape[1] == dynamic.keys.shape[1]
                and static.values.shape[1] == dynamic.values.shape[1]
                for static, dynamic in zip(cache.layers, prefilled.layers, strict=True)
            )

        if self.cache is None or not fits(self.cache):
            self.cache = None  # the old buffers go before the new ones are made
            size = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
            cache = StaticCache(model_config(self.model), max_cache_len=size)
            layer_class = casting_static_layer_class()
            for index, dynamic in enumerate(prefilled.layers):
                layer = layer_class(max_cache_len=size)
                layer.lazy_initialization(
                    dynamic.keys.new_empty(rows, *dynamic.keys.shape[1:]),
                    dynamic.values.new_empty(rows, *dynamic.values.shape[1:]),
                )
                replace_cache_layer(cache, index, layer)
            self.cache = cache
        return self.cache


@functools.cache  # the class subclasses a transformers class: defined on first use
def casting_static_layer_class():
    from transformers.cache_utils import StaticLayer

    class CastingStaticLayer(StaticLayer):
        """transformers' StaticLayer, writing new keys and values in its buffers' dtype: under autocast with SDPA the
        decode steps make float32 keys (RoPE's float32 cos/sin) that the buffers hold in bf16, as the default
        decoder's cache does (`fast.sampling_cache`)."""

        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            if self.values.dtype != value_states.dtype:  # transformers < 5.20 holds the values in the keys' dtype
                self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
                torch._dynamo.mark_static_address(self.values)

        def update(self, key_states, value_states, *args, **kwargs):
            return super().update(key_states.to(self.keys.dtype), value_states.to(self.values.dtype), *args, **kwargs)

    return CastingStaticLayer


class StaticDecoder(CachedDecoder):
    """The decode loop's decoder over `StaticDecoding`'s cache and step. The prefill is `CachedDecoder`'s (each
    group's prompt once, its cache repeated for the G rows, M-RoPE offsets), into a cache of the prompts' width,
    whose keys and values are then copied into the static buffers."""

    def __init__(self, model: torch.nn.Module, decoding: StaticDecoding, capacity: int):
        super().__init__(model)  # capacity 0: the prefill's own cache holds the prompts only
        self.decoding, self.static_capacity = decoding, capacity
        self.step_function = None

    def prefill(
        self, ids, mask, repeats: int = 1, prompt_inputs: dict | None = None, rope_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = super().prefill(ids, mask, repeats, prompt_inputs, rope_positions)
        prefilled, (rows, width) = self.cache, self.mask.shape
        self.cache = self.decoding.cache_for(prefilled, rows, max(self.static_capacity, width))
        for static, dynamic in zip(self.cache.layers, prefilled.layers, strict=True):
            static.keys[:, :, :width].copy_(dynamic.keys)
            static.values[:, :, :width].copy_(dynamic.values)
            static.cumulative_length.fill_(width)
        self.mask = torch.cat([self.mask, self.mask.new_ones(rows, self.cache.layers[0].max_cache_len - width)], dim=1)
        self.step_function = self.decoding.step_function(ids.device)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.next_position[:, None]
        if self.rope_offset is not None:  # a text token: its three M-RoPE positions are equal
            positions = (positions + self.rope_offset[:, None])[None].expand(3, -1, -1)
        if self.decoding.uses_cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: replay over them
        out = self.step_function(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_argument: self.cache},
            **self.forward_kwargs,
        )
        self.next_position = self.next_position + 1
        logits = logits_of(out)[:, -1]
        # A CUDA graph's outputs live in its pool and are overwritten by the next replay.
        return logits.clone() if self.decoding.uses_cuda_graphs else logits

    def keep(self, rows: torch.Tensor) -> None:
        raise RuntimeError(
            "static decoding keeps every row in the batch (fixed shapes); call generate with drop_finished=False"
        )
