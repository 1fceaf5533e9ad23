"""The decoders of the in-process decode loop (`hf.generate`): one prefill of the prompts, then one step per token,
with the rows of finished completions dropped. `CachedDecoder` keeps a transformers KV cache; `FullForwardDecoder`
re-runs the whole sequence for a model without one; `static.StaticDecoder` is `CachedDecoder` over a static cache.
"""

from __future__ import annotations

import torch

from ..compat import cache_argument, output_cache, select_cache_rows
from ..forward import forward_accepts, logits_of, model_config, position_ids_from_mask
from .direct import direct_step_for
from .fast import sampling_cache


def sampling_forward_kwargs(model: torch.nn.Module) -> dict:
    """Extra arguments of the sampling forwards. A MoE model configured to return its router logits (for a
    load-balancing loss in training) would record them at every decode step, and Qwen3-MoE's or GPT-OSS's forward
    would then compute that loss from one step's logits against the whole attention mask, and fail on the shapes;
    sampling needs neither, so it asks for no router logits."""
    return {"output_router_logits": False} if getattr(model_config(model), "output_router_logits", False) else {}


DIRECT_STEP = True  # tests turn it off to compare with the model's forward


class CachedDecoder:
    """Incremental decoding with a transformers KV cache (`fast.sampling_cache`); finished rows can be dropped."""

    def __init__(self, model, capacity: int = 0):
        self.model = model
        self.capacity = capacity  # prompt + completion positions, for a preallocated cache
        self.forward_kwargs = sampling_forward_kwargs(model)
        self.cache_argument = cache_argument(model) or "past_key_values"  # a PeftModel passes it on by name
        self.cache = None
        self.mask = None  # [n, P + t]
        self.next_position = None  # [n]
        self.rope_offset = None  # [n] M-RoPE models: 3D position of a text token minus its 1D one
        self.direct = None  # a DirectStep where one equals the model's forward (direct.py)
        self.padded = False  # whether any prompt has left padding (the direct step then masks it out)
        self.use_direct = DIRECT_STEP

    def prefill(
        self, ids, mask, repeats: int = 1, prompt_inputs: dict | None = None, rope_positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """prompt_inputs: the processor's tensors of these rows' images (`MultimodalInputs.model_inputs`);
        rope_positions: a Qwen-VL model's 3D positions of the prompts [3, n, P] (`rope_position_ids`)."""
        self.cache = sampling_cache(self.model, max(self.capacity, ids.shape[1]))
        positions = position_ids_from_mask(mask)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            position_ids=positions if rope_positions is None else rope_positions,
            **{self.cache_argument: self.cache},
            **self.forward_kwargs,
            **(prompt_inputs or {}),
        )
        self.cache = output_cache(out)
        logits = logits_of(out)[:, -1]
        # Text after the images continues from the largest 3D position: a per-row offset to the 1D position.
        offset = (
            torch.zeros_like(positions[:, -1])
            if rope_positions is None
            else rope_positions[..., -1].amax(0) - positions[:, -1]
        )
        if repeats > 1:  # one prefill per group, shared by its G rows
            select_cache_rows(self.cache, torch.arange(len(ids), device=ids.device).repeat_interleave(repeats))
            logits, mask, positions, offset = (
                x.repeat_interleave(repeats, 0) for x in (logits, mask, positions, offset)
            )
        self.mask, self.next_position = mask, positions[:, -1] + 1
        self.rope_offset = None if rope_positions is None else offset
        if self.use_direct and rope_positions is None and not prompt_inputs:
            self.direct, self.padded = direct_step_for(self.model, self.cache), not bool(mask.all())
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        positions = self.next_position[:, None]
        if self.rope_offset is not None:  # a text token: its three M-RoPE positions are equal
            positions = (positions + self.rope_offset[:, None])[None].expand(3, -1, -1)
        if self.direct is not None:
            self.next_position = self.next_position + 1
            return self.direct(tokens, self.mask if self.padded else None, positions)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_argument: self.cache},
            **self.forward_kwargs,
        )
        self.cache = output_cache(out)
        self.next_position = self.next_position + 1
        return logits_of(out)[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        select_cache_rows(self.cache, rows)
        self.mask, self.next_position = self.mask[rows], self.next_position[rows]
        if self.rope_offset is not None:
            self.rope_offset = self.rope_offset[rows]


class FullForwardDecoder:
    """No cache: re-runs the whole sequence each step (any module whose forward(input_ids) gives logits)."""

    def __init__(self, model):
        self.model = model
        self.use_mask = forward_accepts(model, "attention_mask")
        self.forward_kwargs = sampling_forward_kwargs(model)
        self.ids = self.mask = None

    def _forward(self) -> torch.Tensor:
        if self.use_mask:
            out = self.model(
                self.ids,
                attention_mask=self.mask,
                position_ids=position_ids_from_mask(self.mask),
                **self.forward_kwargs,
            )
        else:
            if not bool(self.mask.all()):
                raise ValueError(
                    "This model's forward() takes no attention_mask, so prompts in one batch must have equal "
                    "lengths; grpokit groups prompts by length for such models — pass equal-length prompt_ids."
                )
            out = self.model(self.ids)
        return logits_of(out)[:, -1]

    def prefill(self, ids, mask, repeats: int = 1, prompt_inputs: dict | None = None) -> torch.Tensor:
        if prompt_inputs:
            raise ValueError("Images need a model with a KV cache (a transformers vision-language model).")
        self.ids, self.mask = ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0)
        return self._forward()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=1)
        return self._forward()

    def keep(self, rows: torch.Tensor) -> None:
        self.ids, self.mask = self.ids[rows], self.mask[rows]
