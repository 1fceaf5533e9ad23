"""An engine that samples with transformers' own `model.generate`, for the generation options grpokit's sampler
(`hf.py`) does not implement: beam search (`num_beams`), and the logits processors and stopping rules transformers
builds from a `GenerationConfig` (`no_repeat_ngram_size`, `bad_words_ids`, `sequence_bias`, `min_new_tokens`,
`typical_p`, ...). TRL's GRPOTrainer samples this way whenever vLLM is off: `GenerationConfig(**generation_kwargs)`
passed to `generate`; the trainer picks this engine when `GRPOConfig.transformers_generate_kwargs()` is not empty
(`build.build_engine`), and the built-in sampler otherwise.

What differs from the built-in sampler: no sampling log-probs (`generate` returns scores of the processed
distribution, beam scores with beams, not the policy's log-prob of each token: the trainer recomputes π_old with
its own forward, as TRL does on this path), no shared prompt prefix across a group, and the rows are drawn from
torch's global generator seeded with the generation's seed (inside `fork_rng`, so the caller's stream is left as it
was). Completions end at the first end-of-sequence token, as TRL masks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..distributed import is_sharded
from .engine import PromptBatch, Rollout, SamplingParams


class TransformersGenerateEngine:
    """Samples from the model being trained with `model.generate(generation_config=...)` (`RolloutEngine`).

    options: generation options for `GenerationConfig` beyond `SamplingParams` (num_beams, no_repeat_ngram_size,
    ...); autocast: a context factory the generation runs under (the trainer's mixed precision)."""

    logprobs_match_training = False  # no sampling log-probs: π_old comes from the training forward

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str = "cpu",
        options: dict | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        if is_sharded(model):
            raise NotImplementedError(
                f"generation_kwargs {sorted(options or {})} need transformers' generate, which "
                f"grpokit does not run on sharded models (FSDP2, ZeRO-3); drop them, or train "
                f"without sharding."
            )
        self.model, self.device = model, torch.device(device)
        self.options = dict(options or {})
        self.autocast = autocast or contextlib.nullcontext

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # the very weights being trained: nothing to copy

    def generation_config(self, params: SamplingParams):
        """TRL's GenerationConfig for this generation: the sampling parameters, then the user's options."""
        from transformers import GenerationConfig

        return GenerationConfig(
            **{
                "max_new_tokens": params.max_new_tokens,
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k or 0,
                "min_p": params.min_p,
                "repetition_penalty": params.repetition_penalty,
                "eos_token_id": list(params.eos_token_ids),
                "pad_token_id": params.pad_token_id,
                "suppress_tokens": list(params.suppress_token_ids) or None,
                **self.options,
            }
        )

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        if prompts.processed is not None:
            raise NotImplementedError(
                f"generation_kwargs {sorted(self.options)} need transformers' generate, which "
                f"grpokit runs on text prompts only; drop them for prompts with images."
            )
        prompt_ids, prompt_mask = prompts.padded(params.pad_token_id)
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), self.autocast():
                torch.manual_seed(seed)
                output = self.model.generate(
                    input_ids=prompt_ids.to(self.device),
                    attention_mask=prompt_mask.to(self.device),
                    generation_config=self.generation_config(params),
                )
        finally:
            self.model.train(was_training)
        completion_ids = output[:, prompt_ids.shape[1] :].cpu()
        return completions_rollout(prompt_ids, prompt_mask, completion_ids, params)


def completions_rollout(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor, params: SamplingParams
) -> Rollout:
    """A Rollout of generated rows [N, T]: each completion up to and including its first end-of-sequence token
    (truncated where it has none), padded after it."""
    is_eos = torch.isin(completion_ids, torch.tensor(params.eos_token_ids or [-1], dtype=completion_ids.dtype))
    ended = is_eos.any(dim=1)
    lengths = torch.where(
        ended, is_eos.int().argmax(dim=1) + 1, torch.full_like(ended, completion_ids.shape[1], dtype=torch.long)
    )
    attention_mask = (torch.arange(completion_ids.shape[1])[None, :] < lengths[:, None]).long()
    completion_ids = completion_ids.masked_fill(attention_mask == 0, params.pad_token_id)
    width = max(int(lengths.max()), 1) if len(lengths) else 1
    completion_ids, attention_mask = completion_ids[:, :width], attention_mask[:, :width]
    return Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        attention_mask,
        attention_mask.clone(),
        lengths,
        ~ended,
        sampling_logprobs=None,
    )
