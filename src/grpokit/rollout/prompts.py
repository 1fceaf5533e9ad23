"""Between dataset rows and token ids: the one place where prompts are encoded, completions decoded, and the EOS
and padding ids resolved. The trainer's generations and `evaluate()` both go through a `PromptCodec`, whatever the
engine."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..compat import output_embeddings
from ..data import PromptLimit, is_conversational, render_prompt
from ..multimodal import (
    is_processor,
    load_image,
    load_row_images,
    message_images,
    prepare_multimodal_messages,
    process_prompt,
    tokenizer_of,
)
from .engine import PromptBatch, Rollout, SamplingParams


def eos_token_ids(tokenizer, model) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's EOS and every EOS of the model's generation_config (a chat
    model often ends its turns with a token other than the tokenizer's EOS), as TRL does; `model` may also be a
    model's configuration (its `eos_token_id`)."""
    found: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        # a model's generation_config; a model's configuration (read before the weights load) has its own
        getattr(generation_config, "eos_token_id", None) if generation_config else getattr(model, "eos_token_id", None),
    ):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and token not in found:
                found.append(int(token))
    return tuple(found)


def model_vocab_size(model) -> int | None:
    """Rows of the model's output embedding (the tokens it can sample), where it has one."""
    head = output_embeddings(model)
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None


def image_token_ids(model) -> tuple[int, ...]:
    """A VLM's image placeholder token (config `image_token_id`, or `image_token_index`), which sampling must not
    draw: the forward would look for image features to put there (TRL suppresses it too)."""
    config = getattr(model, "config", None)
    if hasattr(model, "get_base_model"):
        config = getattr(model.get_base_model(), "config", config)
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    return () if token is None else (int(token),)


class PromptCodec:
    """Encodes prompts (text, chat messages or `prompt_ids`) and decodes completions for reward functions.

    tokenizer: None for token models, whose rows carry `prompt_ids` and whose completions stay token ids; or a
    vision-language model's processor, which renders and encodes prompts with their images (`multimodal`).
    """

    def __init__(
        self,
        tokenizer,
        model: torch.nn.Module,
        max_prompt_length: int | None = None,
        chat_template_kwargs: dict | None = None,
        stop_token_ids: tuple[int, ...] = (),
        suppress_token_ids: tuple[int, ...] = (),
    ):
        self.processor = tokenizer if is_processor(tokenizer) else None
        self._warned_long_image_prompt = False
        tokenizer = tokenizer_of(tokenizer)
        self.tokenizer, self.max_prompt_length = tokenizer, PromptLimit.of(max_prompt_length)
        self.chat_template_kwargs = chat_template_kwargs
        # stop_token_ids / suppress_token_ids: the user's own (TRL's generation_kwargs), on top of the model's.
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids(tokenizer, model) + tuple(stop_token_ids)))
        vocab_size = model_vocab_size(model)
        outside = [t for t in suppress_token_ids if vocab_size is not None and t >= vocab_size]
        if outside:
            raise ValueError(
                f"generation_kwargs suppress_tokens {outside} are not in the model's vocabulary ({vocab_size} tokens)."
            )
        model_suppressed = image_token_ids(model) if self.processor is not None else ()
        self.suppress_token_ids = tuple(dict.fromkeys(model_suppressed + tuple(suppress_token_ids)))
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)

    def sampling_params(self, max_new_tokens: int, **sampling) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            suppress_token_ids=self.suppress_token_ids,
            **sampling,
        )

    def encode(self, rows: list[dict], counts: list[int]) -> PromptBatch:
        """A PromptBatch of rows (one per distinct prompt), sampled counts[i] times each. Prompts longer than
        max_prompt_length keep their last tokens."""
        if "prompt_ids" in rows[0]:
            raw = [list(r["prompt_ids"]) for r in rows]
            ids = raw
        elif self.processor is not None:
            return self._encode_multimodal(rows, counts)
        else:
            raw = [r["prompt"] for r in rows]
            texts = [render_prompt(p, self.tokenizer, self.chat_template_kwargs) for p in raw]
            add_special = not any(is_conversational(p) for p in raw)  # a chat template wrote its special tokens
            ids = [self.tokenizer(t, add_special_tokens=add_special)["input_ids"] for t in texts]
        if self.max_prompt_length is not None:
            ids = self.max_prompt_length.cut(ids)
        return PromptBatch(ids=ids, counts=list(counts), raw=raw)

    def _encode_multimodal(self, rows: list[dict], counts: list[int]) -> PromptBatch:
        """A processor's encoding, TRL's way: a row's images (`image` / `images` column, PIL or paths) join its
        conversational prompt as image parts (`prepare_multimodal_messages`); the processor renders the chat
        template and encodes the text with the images. `raw` holds the prepared messages (reward functions receive
        those, as in TRL)."""
        raw, ids, images, processed, unexpanded, cut = [], [], [], [], [], 0
        for index, row in enumerate(rows):
            prompt, row_imgs = row["prompt"], load_row_images(row, index)
            if not is_conversational(prompt):
                if row_imgs:
                    raise ValueError(
                        "Multimodal training needs conversational prompts (a list of messages): this "
                        "row has images and a text prompt. Give the raw messages and let the trainer "
                        "apply the chat template, as in TRL."
                    )
                text = prompt
            else:
                prompt = prepare_multimodal_messages(prompt, row_imgs)
                row_imgs = [
                    load_image(image, f"row {index} of this batch, column 'prompt' (image part {item})")
                    for item, image in enumerate(message_images(prompt))
                ]
                text = render_prompt(prompt, self.processor, self.chat_template_kwargs)
            if row_imgs:
                prompt_ids, tensors = process_prompt(self.processor, text, row_imgs)
                # As the processor tokenizes the text before it expands the image placeholders.
                unexpanded.append(self.tokenizer(text)["input_ids"])
            else:
                add_special = not is_conversational(prompt)
                prompt_ids, tensors = self.tokenizer(text, add_special_tokens=add_special)["input_ids"], {}
            if self.max_prompt_length is not None and len(prompt_ids) > self.max_prompt_length:
                if row_imgs:  # kept whole, as TRL 1.16 keeps every prompt: a cut would split the image tokens
                    if not self._warned_long_image_prompt:
                        warnings.warn(
                            f"A prompt with images has {len(prompt_ids)} tokens, more than the "
                            f"{int(self.max_prompt_length)} kept ({self.max_prompt_length.reason}): "
                            "prompts with images are not cut (that would cut image tokens); they are kept "
                            "whole.",
                            UserWarning,
                            stacklevel=3,
                        )
                        self._warned_long_image_prompt = True
                else:
                    prompt_ids, cut = prompt_ids[-self.max_prompt_length :], cut + 1
            if not row_imgs:
                unexpanded.append(prompt_ids)
            raw.append(prompt)
            ids.append(prompt_ids)
            images.append(row_imgs)
            processed.append(tensors)
        if cut:
            self.max_prompt_length.warn(cut, len(rows))
        return PromptBatch(
            ids=ids, counts=list(counts), raw=raw, images=images, processed=processed, unexpanded_ids=unexpanded
        )

    def decode(self, rollout: Rollout, raw_prompts: list[Any]) -> tuple[list[Any], list[list[int]]]:
        """(completions as reward functions receive them, completion token ids) for each row: text (a list with
        one assistant message for conversational prompts), or the ids themselves for token models."""
        ids = rollout.completion_id_lists()
        if self.tokenizer is None:
            return ids, ids
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if raw_prompts and is_conversational(raw_prompts[0]):
            return [[{"role": "assistant", "content": t}] for t in texts], ids
        return texts, ids


def group_counts(num_rows: int, num_generations: int, offset: int) -> list[int]:
    """Sizes of the runs of consecutive rows in one group, for rows offset .. offset + num_rows - 1 of a global
    batch whose groups are num_generations rows each: [4, 2] for 6 rows from offset 0 with G = 4."""
    counts: list[int] = []
    for i in range(num_rows):
        if i == 0 or (offset + i) % num_generations == 0:
            counts.append(0)
        counts[-1] += 1
    return counts
