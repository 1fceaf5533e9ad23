"""A decode step that runs a Llama-family model's layers directly, for the in-process engine on CPU in float32.

A decode step of a small model is mostly the Python around its arithmetic: transformers' forward builds the
attention mask, dispatches the attention interface, updates the cache through its classes and returns output
objects, around a few dozen small tensor operations a layer. `DirectStep` computes the same step with the
model's own parameters and the same tensor operations in the same order (RMSNorm, rotary embedding, the one-token
attention of `fast.one_token_attention_forward`, SwiGLU, residuals), writing keys and values into the rollout's
`PreallocatedLayer` buffers; its only other change is that the query/key/value products run as one product and
the gate/up products as one, each over the layers' weights concatenated and packed for oneDNN once per rollout
(`fast.packed_linears` packs the others). The logits equal the model's own forward's on the same cache
(tests/test_rollout_direct.py checks them bitwise, and the sampled tokens, for every family below). On the
`small` benchmark's 4M-parameter Qwen2 the rollout went from 0.58-0.61 s to 0.46-0.50 s a step
(`benchmarks/profile_step.py --config small`).

It applies only where that holds (`direct_step_for`): a model of exactly one of the classes in `FAMILIES` (not a
subclass, not an adapter-wrapped or quantized one), whose modules are the family's own classes with no hooks and
no replaced forward, plain float32 `nn.Linear` layers packed by `fast.packed_linears` (CPU, no autocast), SDPA
attention (switched to the one-token attention while sampling) and a cache whose every layer is a
`PreallocatedLayer`. Anything else decodes through the model's forward, as before.
"""

from __future__ import annotations

import torch

from ..models import _contiguous_input
from .fast import (
    ONE_TOKEN_ATTENTION,
    PACKED_BATCH_HINT,
    is_packed,
    one_token_attention_products,
    preallocated_layer_class,
)

# model class -> (its transformers module, its classes' prefix, whether attention normalises queries and keys per
# head: Qwen3's q_norm / k_norm)
FAMILIES = {
    "LlamaForCausalLM": ("llama", "Llama", False),
    "MistralForCausalLM": ("mistral", "Mistral", False),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3", True),
}


def _family(model: torch.nn.Module) -> tuple[str, str, bool] | None:
    entry = FAMILIES.get(type(model).__name__)
    if entry is None or type(model).__module__ != f"transformers.models.{entry[0]}.modeling_{entry[0]}":
        return None
    return entry


def _no_hooks(module: torch.nn.Module) -> bool:
    """No forward hooks, except grpokit's own `models.contiguous_head_input`, which leaves the contiguous inputs
    the direct step gives alone."""
    pre_hooks = [hook for hook in module._forward_pre_hooks.values() if hook is not _contiguous_input]
    return not (
        module._forward_hooks
        or pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or getattr(module, "_forward_pre_hooks_with_kwargs", None)
    )


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def direct_step_for(model: torch.nn.Module, cache) -> DirectStep | None:
    """A `DirectStep` over `model` and the rollout's `cache`, or None where it would not equal the model's forward."""
    family = _family(model)
    if family is None or _global_hooks():
        return None
    _, prefix, per_head_norms = family
    inner = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if inner is None or config is None or getattr(config, "_attn_implementation", None) != ONE_TOKEN_ATTENTION:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "pretraining_tp", 1) != 1:
        return None
    if torch.is_autocast_enabled("cpu"):
        return None
    for module in model.modules():
        if not _no_hooks(module):
            return None
        if isinstance(module, torch.nn.Linear):
            if not is_packed(module):
                return None
        elif "forward" in module.__dict__:
            return None
    layer_class = preallocated_layer_class()
    layers = list(inner.layers)
    if len(cache.layers) != len(layers) or any(type(layer) is not layer_class for layer in cache.layers):
        return None
    expected = {
        "layer": f"{prefix}DecoderLayer",
        "attention": f"{prefix}Attention",
        "mlp": f"{prefix}MLP",
        "norm": f"{prefix}RMSNorm",
    }
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        kinds = (
            (layer, "layer"),
            (attention, "attention"),
            (mlp, "mlp"),
            (layer.input_layernorm, "norm"),
            (layer.post_attention_layernorm, "norm"),
        )
        if any(type(module).__name__ != expected[kind] for module, kind in kinds):
            return None
        if per_head_norms and any(
            type(getattr(attention, norm, None)).__name__ != expected["norm"] for norm in ("q_norm", "k_norm")
        ):
            return None
    if type(inner.norm).__name__ != expected["norm"] or type(inner.embed_tokens) is not torch.nn.Embedding:
        return None
    if type(model.lm_head) is not torch.nn.Linear:
        return None
    return DirectStep(model, cache, per_head_norms)


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' Llama-family RMSNorm (float32 input): the same operations in the same order."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _pack(weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
    """Layers that read the same input as one product: their weights concatenated and packed for oneDNN, and their
    biases concatenated (zeros for a layer without one), or None when none has a bias."""
    weight = torch.cat([w.detach() for w in weights])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_BATCH_HINT)
    if all(b is None for b in biases):
        return packed, None
    bias = torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
    return packed, bias


class _Layer:
    """One decoder layer's parameters, fused weights and cache buffers, read once per rollout."""

    def __init__(self, layer, cache_layer, per_head_norms: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = attention.q_norm if per_head_norms else None
        self.k_norm = attention.k_norm if per_head_norms else None
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.qkv = _pack([p.weight for p in projections], [p.bias for p in projections])
        self.split = [p.out_features for p in projections]
        self.o_proj = attention.o_proj.forward  # packed by fast.packed_linears
        self.gate_up = _pack([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias])
        self.intermediate = mlp.gate_proj.out_features
        self.act_fn = mlp.act_fn
        self.down_proj = mlp.down_proj.forward
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.cache = cache_layer

    def __call__(self, hidden: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        n, d = hidden.shape[0], self.head_dim
        x = _rms_norm(hidden, self.input_norm)
        q, k, v = linear(x, *self.qkv, "none", [], "").split(self.split, dim=-1)
        q, k, v = q.view(n, 1, -1, d), k.view(n, 1, -1, d), v.view(n, 1, -1, d)
        if self.q_norm is not None:
            q, k = _rms_norm(q, self.q_norm), _rms_norm(k, self.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, 1, d]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = self.cache.update(k, v)
        attended = one_token_attention_products(q, keys, values, mask, self.scaling)
        hidden = hidden + self.o_proj(attended.reshape(n, 1, -1))
        x = _rms_norm(hidden, self.post_norm)
        gate, up = linear(x, *self.gate_up, "none", [], "").split(self.intermediate, dim=-1)
        return hidden + self.down_proj(self.act_fn(gate) * up)


class DirectStep:
    """`step(tokens [n], mask [n, L] or None, positions [n, 1])` -> logits [n, V] of the tokens' next position."""

    def __init__(self, model, cache, per_head_norms: bool):
        inner = model.model
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.lm_head = model.lm_head.forward
        with torch.no_grad():
            self.layers = [_Layer(layer, cache.layers[i], per_head_norms) for i, layer in enumerate(inner.layers)]

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens[:, None])
        cos, sin = self.rotary(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = None if mask is None else mask.bool()[:, None, None, :]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, mask)
        return self.lm_head(_rms_norm(hidden, self.norm))[:, -1]
