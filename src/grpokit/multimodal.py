"""Images in prompts: vision-language models (VLMs) trained with the same loop, with TRL 1.16's conventions.

A dataset row gives its images in an `image` column (one image) or an `images` column (a list), as PIL images or
paths; a conversational prompt then gets an image content part per image before its first user text
(`prepare_multimodal_messages`, TRL's rule), or already holds `{"type": "image", "image": ...}` parts. The processor
(a `ProcessorMixin`) turns each distinct prompt into token ids and the tensors its model needs besides them
(`pixel_values`, and per architecture `image_grid_thw`, `image_sizes`, `token_type_ids`, `pixel_attention_mask`,
...). Those tensors travel with the rows as `MultimodalInputs`: one dict per distinct prompt and the prompt of each
row, so that a prompt's images are stored once for its G rows and go through the vision encoder once per group
(the sampling prefill runs once per group, the training forward once per distinct prompt where it shares prompts).

Shapes: U distinct prompts, N rows, P prompt tokens (left-padded), T completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .compat import output_embeddings

IMAGE_COLUMNS = ("image", "images")
# Processor outputs with one value per prompt token (left-padded with the prompt, zero over the completion);
# every other tensor is per image (or per patch / per row), concatenated along its first dimension.
TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")


# ------------------------------------------------------------------------------------------------- dataset rows


def row_images(row: dict) -> list | None:
    """The images of a dataset row (TRL's columns: `images`, a list, or `image`, one), None for a row without."""
    if "images" in row and row["images"] is not None:
        images = list(row["images"])
    elif "image" in row and row["image"] is not None:
        images = [row["image"]]
    else:
        return None
    return images or None


def load_image(image, where: str | None = None):
    """A PIL image from a PIL image, a path, encoded bytes, or an undecoded `datasets` Image value ({"bytes",
    "path"}); files are opened and converted to RGB. where: the image's place in the dataset ("row 3, column
    'images' (item 1)"), named when it cannot be read."""
    import io

    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    source = image
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):
        image = source = image["bytes"] or image["path"]
    if isinstance(image, bytes):
        image, source = io.BytesIO(image), f"{len(image)} bytes"
    elif not (isinstance(image, str) or hasattr(image, "__fspath__")):
        raise TypeError(
            f"An image must be a PIL image or a path; got {type(image).__name__}{f' ({where})' if where else ''}."
        )
    try:
        with Image.open(image) as opened:
            return opened.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:  # PIL's UnidentifiedImageError: an OSError
        if where is None:
            raise
        raise ValueError(
            f"The image at {where} cannot be read ({source!s:.80}: {error}); fix or drop that row "
            f"(e.g. dataset.filter)."
        ) from error


def load_row_images(row: dict, index: int) -> list:
    """The images of a dataset row (`row_images`), loaded; one that cannot be read is named by its row (`index`, in
    its batch, with the prompt's start) and column."""
    column = "images" if row.get("images") is not None else "image"
    prompt = str(row.get("prompt", ""))[:60]
    return [
        load_image(
            image,
            f"row {index} of this batch (prompt {prompt!r}), column {column!r}"
            + (f" (item {item})" if column == "images" else ""),
        )
        for item, image in enumerate(row_images(row) or [])
    ]


def prepare_multimodal_messages(messages: list[dict], images: list | None = None) -> list[dict]:
    """Messages with every content a list of parts, and the images placed (TRL 1.16's data_utils rule).

    String contents become `[{"type": "text", "text": ...}]`; the first user message with string content gets one
    `{"type": "image"}` part per image before its text. Image parts without an image are then filled with `images`
    in order; their number must equal the number of images. New dicts: the dataset's rows are not modified.
    """
    images = list(images or [])
    prepared, placed = [], False
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
            if message["role"] == "user" and not placed:
                parts = [{"type": "image"} for _ in images] + parts
                placed = True
            message = {**message, "content": parts}
        elif isinstance(content, list):
            message = {**message, "content": [dict(part) for part in content]}
        prepared.append(message)
    empty = [
        part
        for m in prepared
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image" and part.get("image") is None
    ]
    if len(empty) != len(images):
        raise ValueError(
            f"A prompt has {len(empty)} image placeholder(s) for {len(images)} image(s) in its row: give "
            f"one {{'type': 'image'}} part per image of the 'image'/'images' column."
        )
    for part, image in zip(empty, images):
        part["image"] = image
    return prepared


def message_images(messages: list[dict]) -> list:
    """The images held by the image parts of prepared messages, in order."""
    return [
        part["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image" and part.get("image") is not None
    ]


def without_images(value: Any) -> Any:
    """A prompt (messages) with each image part's image replaced by a placeholder: for logs and JSON."""
    if isinstance(value, list):
        return [without_images(v) for v in value]
    if isinstance(value, dict):
        if value.get("type") == "image":
            return {k: v for k, v in value.items() if k != "image"}
        return {k: without_images(v) for k, v in value.items()}
    return value


def loggable_prompt(prompt: Any, with_images: bool) -> dict:
    """A prompt for the completions log: {"prompt": without its images} and, with_images (log_multimodal), its
    images under "images" (PIL; the log writes them as PNG files)."""
    images = (
        message_images(prompt)
        if with_images and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        else []
    )
    return {"prompt": without_images(prompt), **({"images": images} if images else {})}


def is_processor(processing_class) -> bool:
    """A multimodal processor (`transformers.ProcessorMixin`), as opposed to a tokenizer."""
    try:
        from transformers import ProcessorMixin
    except ImportError:
        return False
    return isinstance(processing_class, ProcessorMixin)


def tokenizer_of(processing_class):
    """The tokenizer inside a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def check_images_supported(processing_class, columns: list[str], name: str = "train_dataset") -> None:
    """A dataset with image columns needs a vision-language model's processor."""
    found = [c for c in IMAGE_COLUMNS if c in columns]
    if found and not is_processor(processing_class):
        raise ValueError(
            f"{name} has an image column ({found[0]!r}), but the processing class is a text tokenizer: "
            f"images need a vision-language model and its processor. Pass a VLM checkpoint (e.g. "
            f"Qwen2.5-VL, Gemma 3) or processing_class=AutoProcessor.from_pretrained(...), or drop the "
            f"image column for a text-only model."
        )


# ---------------------------------------------------------------------------------------------- processor outputs


def process_prompt(processor, text: str, images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of one rendered prompt with its images, and the processor's other outputs (without the batch
    dimension removed: what the model's forward takes for this one prompt)."""
    out = processor(text=[text], images=[images], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask") and torch.is_tensor(v)}
    for key in TOKEN_FIELDS:
        if key in extra and extra[key].shape[-1] != len(ids):
            raise ValueError(f"The processor's {key} has {extra[key].shape[-1]} entries for {len(ids)} tokens.")
    return ids, extra


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the first dimension, zero-padding the others to the largest (as processors pad a batch:
    LLaVA-NeXT's patches, Idefics3's images per prompt and their pixel masks)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    padded = []
    for t in tensors:
        pads = []
        for d in reversed(range(1, t.dim())):
            pads += [0, shape[d - 1] - t.shape[d]]
        padded.append(torch.nn.functional.pad(t, pads) if any(pads) else t)
    return torch.cat(padded)


@dataclass
class MultimodalInputs:
    """The processor's tensors of a batch's prompts: `prompts[u]` is distinct prompt u's (as `process_prompt`
    returns them) and `index[n]` the prompt of row n. Rows select, split and shuffle by `index` alone; a prompt's
    tensors are stored once for all its rows."""

    prompts: list[dict[str, torch.Tensor]]  # [U] the processor's outputs besides input_ids / attention_mask
    index: torch.Tensor  # [N] long: the prompt of each row

    def __len__(self) -> int:
        return len(self.index)

    def select(self, rows: torch.Tensor | slice | list[int]) -> MultimodalInputs:
        if isinstance(rows, slice):
            return MultimodalInputs(self.prompts, self.index[rows])
        rows = torch.as_tensor(rows, dtype=torch.long)
        return MultimodalInputs(self.prompts, self.index[rows.to(self.index.device)])

    def to(self, device) -> MultimodalInputs:
        return MultimodalInputs([{k: v.to(device) for k, v in p.items()} for p in self.prompts], self.index.to(device))

    @staticmethod
    def concat(parts: list[MultimodalInputs]) -> MultimodalInputs:
        prompts, indices = [], []
        for part in parts:
            indices.append(part.index + len(prompts))
            prompts += part.prompts
        return MultimodalInputs(prompts, torch.cat(indices))

    def state_dict(self) -> dict:
        return {"prompts": self.prompts, "index": self.index}

    @classmethod
    def from_state_dict(cls, state: dict) -> MultimodalInputs:
        return cls(state["prompts"], state["index"])

    def model_inputs(
        self,
        rows: torch.Tensor | None,
        prompt_width: int,
        total_width: int | None = None,
        dtype: torch.dtype | None = None,
        keys: tuple[str, ...] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The forward's keyword arguments for `rows` (default: every row), whose prompts are left-padded to
        `prompt_width` tokens: per-image tensors concatenated in row order, per-token ones (TOKEN_FIELDS)
        left-padded to the prompt and zero over the completion up to `total_width`. Floating tensors (pixels) are
        cast to `dtype` when given; `keys` keeps only those fields."""
        index = self.index if rows is None else self.index[torch.as_tensor(rows).to(self.index.device)]
        chosen = [self.prompts[i] for i in index.tolist()]
        keys = sorted({k for p in chosen for k in p if keys is None or k in keys})
        out: dict[str, torch.Tensor] = {}
        total_width = prompt_width if total_width is None else total_width
        for key in keys:
            if key in TOKEN_FIELDS:
                values = [p.get(key) for p in chosen]
                like = next(v for v in values if v is not None)
                rows_out = like.new_zeros(len(chosen), total_width)
                for n, value in enumerate(values):
                    if value is not None:
                        value = value.reshape(-1)
                        rows_out[n, prompt_width - len(value) : prompt_width] = value
                out[key] = rows_out
            else:
                tensors = [p[key] for p in chosen if key in p]
                value = _cat_padded(tensors)
                if dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                out[key] = value
        return out


def batch_model_inputs(
    multimodal: MultimodalInputs | None,
    rows,
    prompt_width: int,
    total_width: int | None = None,
    model: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """`multimodal.model_inputs(...)` with pixels in the model's floating dtype, or {} for a text-only batch."""
    if multimodal is None:
        return {}
    dtype = None
    if model is not None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return multimodal.model_inputs(rows, prompt_width, total_width, dtype)


# Fields the M-RoPE position computation reads (not the pixels).
ROPE_FIELDS = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def rope_index_owner(model: torch.nn.Module):
    """The module whose `get_rope_index` computes a VLM's multimodal (3D) rotary positions from its image grids
    (the Qwen2-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL), or None for a model with ordinary positions."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for candidate in (base, getattr(base, "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


def rope_position_ids(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multimodal: MultimodalInputs | None,
    rows=None,
    prompt_width: int | None = None,
):
    """M-RoPE positions [3, N, L] of input_ids [N, L] (prompts left-padded to prompt_width, then completions), from
    the model's own `get_rope_index`; None for a model without one or rows without image grids (whose positions
    are the usual ones, from the mask)."""
    owner = rope_index_owner(model) if multimodal is not None else None
    if owner is None:
        return None
    prompt_width = input_ids.shape[1] if prompt_width is None else prompt_width
    fields = multimodal.model_inputs(rows, prompt_width, input_ids.shape[1], keys=ROPE_FIELDS)
    if "image_grid_thw" not in fields and "video_grid_thw" not in fields:
        return None
    if "mm_token_type_ids" not in fields:
        raise ValueError(
            "This model computes its positions from mm_token_type_ids, which the processor did not "
            "return; upgrade transformers (5.x processors return it)."
        )
    positions, _ = owner.get_rope_index(input_ids, attention_mask=attention_mask, **fields)
    return positions


# ------------------------------------------------------------------------------------------------------- models


def is_vision_language_model(model_or_config) -> bool:
    """A transformers model (or config) with a vision encoder: its config has a `vision_config`."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(model_or_config, "get_base_model"):  # a PeftModel: its base model's config
        config = getattr(model_or_config.get_base_model(), "config", config)
    return getattr(config, "vision_config", None) is not None


def text_config_of(config):
    """A vision-language model's text config (`get_text_config`); a text model's config is its own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def ties_word_embeddings(config) -> bool:
    """Whether the LM head is tied to the input embeddings: the text config's setting, else the top level's."""
    return bool(getattr(text_config_of(config), "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def language_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The text decoder inside a VLM: `language_model` (LLaVA, Gemma 3, Qwen-VL) or `text_model` (Idefics3,
    SmolVLM) of its base model, else its decoder."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "base_model", base)
    for name in ("language_model", "text_model"):
        found = getattr(inner, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if not isinstance(decoder, torch.nn.Module):
        raise ValueError(f"Cannot find the language model inside {type(base).__name__}.")
    return decoder


def vision_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters that are neither the language model's nor the LM head's: the vision encoder and the
    projector into the language model (and e.g. LLaVA-NeXT's `image_newline`). Tied weights count once."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    language = {id(p) for p in language_model_of(base).parameters()}
    head = output_embeddings(base)
    language |= {id(p) for p in (head.parameters() if head is not None else ())}
    return [name for name, p in base.named_parameters() if id(p) not in language]


def vision_module_prefixes(model: torch.nn.Module) -> list[str]:
    """The largest modules (by name) holding only vision parameters: e.g. ['model.vision_tower',
    'model.multi_modal_projector']."""
    names = vision_parameter_names(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    vision = set(names)
    prefixes: list[str] = []
    for name, module in base.named_modules():
        if not name or any(name.startswith(p + ".") for p in prefixes):
            continue
        own = [f"{name}.{n}" for n, _ in module.named_parameters()]
        if own and all(n in vision for n in own):
            prefixes.append(name)
    return prefixes


def freeze_vision(model: torch.nn.Module) -> None:
    """The vision encoder and projector stop training (requires_grad False)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    frozen = set(vision_parameter_names(base))
    for name, parameter in base.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)


def language_only_lora(peft_config, model: torch.nn.Module):
    """A copy of `peft_config` whose adapters skip the vision encoder and projector (`exclude_modules`), so that
    e.g. target_modules='all-linear' adapts the language model only; unchanged when it excludes modules already."""
    import copy
    import re

    if getattr(peft_config, "exclude_modules", None) or not hasattr(peft_config, "target_modules"):
        return peft_config
    prefixes = vision_module_prefixes(model)
    if not prefixes:
        return peft_config
    peft_config = copy.copy(peft_config)
    peft_config.exclude_modules = "(" + "|".join(re.escape(p) for p in prefixes) + r")(\..*)?"
    return peft_config
