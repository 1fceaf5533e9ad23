"""Tiny models and tokenizers built offline, for tests, benchmarks and the built-in demo.

Nothing here downloads anything: the tokenizer is a character-level `tokenizers` model and the models are
random-weight transformers configurations (Qwen2 by default, any architecture with `build_tiny_model_of_type`), so
a test can build a real Hugging Face causal LM in milliseconds.
"""

from __future__ import annotations

import string
import warnings
from pathlib import Path

import torch

# A chat template in the ChatML shape most instruction models use; kept tiny so that conversational prompts work
# with the character-level tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
DEFAULT_CHARS = string.ascii_lowercase + string.digits + " +-=:?>.,\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS, extra_words: int = 0):
    """A character-level `PreTrainedTokenizerFast` with pad/eos/bos tokens and a chat template.

    `extra_words` appends that many dummy tokens to the vocabulary, for benchmarks that need a large vocabulary
    (e.g. 32k) without a large alphabet.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in SPECIAL_TOKENS + sorted(set(chars)) + [f"<w{i}>" for i in range(extra_words)]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # Every character is its own token; the decoder joins them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    eos_token_id: int | None = 1,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 2,
):
    """A random-weight Qwen2-shaped causal LM (GQA, RoPE, RMSNorm, SwiGLU), in float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        attention_dropout=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


# Per-architecture settings for `build_tiny_model_of_type` on top of its defaults: head sizes derived from other
# fields (DeepSeek-V3's MLA), few small experts for the MoE models, layer patterns that keep each architecture's mix
# of layer kinds in two or three layers, sliding windows (4) shorter than a test's rollout.
TINY_ARCHITECTURE_OVERRIDES = {
    "cohere2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        head_dim=None,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, query_pre_attn_scalar=8),
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, query_pre_attn_scalar=8),
    "glm4_moe": dict(
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1
    ),
    "gpt2": dict(n_embd=32, n_layer=1, n_head=4, n_positions=64),
    # YaRN with its default factor expects the full context length (the RoPE tables are not preallocated).
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        max_position_embeddings=131072,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Mamba-2, attention and MoE blocks; the torch path of the Mamba mixer (no mamba-ssm / causal-conv1d kernels).
    "nemotron_h": dict(
        layers_block_type=["mamba", "attention", "moe"],
        ssm_state_size=8,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=1,
        chunk_size=8,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}


def build_tiny_model_of_type(
    model_type: str, num_layers: int = 1, vocab_size: int = 1024, *, seed: int = 0, **overrides
):
    """A random-weight transformers causal LM of `model_type` (hidden size 32, 4 query and 2 key/value heads of
    size 8), float32, in eval mode (no dropout draws), with the attention transformers picks by default (SDPA where
    the architecture supports it; Gemma 2 and GPT-OSS get eager). pad/eos/bos are ids 0/1/2, as in
    `build_char_tokenizer`. `overrides` are config fields; a `layer_types` (or NemotronH's `layers_block_type`)
    override sets the number of layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(TINY_ARCHITECTURE_OVERRIDES.get(model_type, {}))
    kwargs.update(overrides)
    if kwargs["head_dim"] is None:  # DeepSeek-V3 derives its head sizes from the MLA ranks
        del kwargs["head_dim"]
    for pattern in ("layer_types", "layers_block_type"):
        if pattern in kwargs:
            kwargs["num_hidden_layers"] = len(kwargs[pattern])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "sliding window attention is not supported for SDPA"
        config = AutoConfig.for_model(model_type, **kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def save_tiny_model(path: str | Path, chars: str = DEFAULT_CHARS, seed: int = 0, **model_kwargs) -> Path:
    """Build a tiny model and its tokenizer and save both, loadable with `from_pretrained(path)`."""
    path = Path(path)
    tokenizer = build_char_tokenizer(chars)
    model = build_tiny_model(
        len(tokenizer),
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **model_kwargs,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------- vision-language models

# The chat template of the tiny VLMs: an image part becomes the processor's image placeholder (`{image}`), which
# the processor expands into the model's image tokens.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{image}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VLM_TYPES = ("gemma3", "llava", "llava_next", "idefics3")
# Each architecture's image tokens (added to the character tokenizer as special tokens) and the names its processor
# knows them by.
VLM_IMAGE_TOKENS = {
    "gemma3": ["<image>", "<boi>", "<eoi>"],
    "llava": ["<image>"],
    "llava_next": ["<image>"],
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
}
VLM_TOKEN_NAMES = {
    "llava": {"image_token": "<image>"},
    "llava_next": {"image_token": "<image>"},
    "gemma3": {"image_token": "<image>", "boi_token": "<boi>", "eoi_token": "<eoi>"},
    "idefics3": {
        "image_token": "<image>",
        "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>",
        "end_of_utterance_token": "<end_of_utterance>",
    },
}


def build_tiny_vlm(
    model_type: str = "gemma3",
    chars: str = DEFAULT_CHARS,
    *,
    seed: int = 0,
    image_size: int = 16,
    hidden_size: int = 32,
    num_layers: int = 2,
    vision_hidden_size: int = 16,
    vision_layers: int = 1,
    for_vllm: bool = False,
):
    """A random-weight vision-language model of a real architecture and its real processor, built offline:
    (model, processor). The tokenizer is `build_char_tokenizer`'s with the architecture's image tokens; the image
    processor is the architecture's own (PIL backend), resizing images to `image_size` pixels a side.

    gemma3: Gemma3ForConditionalGeneration (SigLIP encoder, pooled to 4 image tokens, token_type_ids), full
    attention in both layers (so the training forward shares prompts); llava: LlavaForConditionalGeneration (CLIP
    encoder, 16 image tokens, a Llama decoder); llava_next: LlavaNextForConditionalGeneration (any-resolution
    tiles, `image_sizes`, `image_newline`); idefics3: Idefics3ForConditionalGeneration (SmolVLM's architecture:
    SigLIP encoder, pixel-shuffle connector, 4 image tokens, pixel_attention_mask, a Llama decoder).

    for_vllm: what vLLM's CPU build needs of such a model: decoder heads of 32 (2 query heads, 1 key/value head;
    `hidden_size` 64 unless given), and for gemma3 the tokenizer's merged newline tokens "\n\n\n" and "\n\n\n\n"
    (vLLM's Gemma 3 processor looks them up)."""
    if model_type not in VLM_IMAGE_TOKENS:
        raise ValueError(f"build_tiny_vlm: model_type must be one of {VLM_TYPES}, not {model_type!r}.")
    tokenizer = _vlm_tokenizer(model_type, chars, for_vllm)
    heads = (
        dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        if for_vllm
        else dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    )
    if for_vllm and hidden_size == 32:
        hidden_size = 64
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        **heads,
    )
    # 4-pixel patches for tiny images, 16 x 16 patches for larger ones (benchmarks)
    vision = dict(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=max(4, image_size // 16),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor, config, model_class = TINY_VLM_BUILDERS[model_type](tokenizer, text, vision, image_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config).float().eval()
            for name, parameter in model.named_parameters():
                if name.endswith("mm_input_projection_weight"):  # Gemma 3 starts it at zero: images unseen
                    torch.nn.init.normal_(parameter, std=0.5)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model, processor


def _vlm_tokenizer(model_type: str, chars: str, for_vllm: bool):
    """`build_char_tokenizer`'s tokenizer with `model_type`'s image tokens (and "\n\n" as one token), left-padded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS + VLM_IMAGE_TOKENS[model_type]
    vocab: dict[str, int] = {}
    newlines = ["\n\n", "\n\n\n", "\n\n\n\n"] if for_vllm and model_type == "gemma3" else ["\n\n"]
    for token in special + sorted(set(chars)) + newlines:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n\n|\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<pad>",
        extra_special_tokens=VLM_TOKEN_NAMES[model_type],
        padding_side="left",
    )


# Each tiny VLM's parts: (tokenizer, text config fields, vision config fields, image size) -> (processor, config,
# model class).


def _tiny_gemma3(tokenizer, text: dict, vision: dict, image_size: int):
    import transformers

    image_processor = transformers.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=4,
        chat_template=VLM_CHAT_TEMPLATE.replace("{image}", "<boi>"),
    )
    num_layers = text["num_hidden_layers"]
    config = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(
            **text, layer_types=["full_attention"] * num_layers, query_pre_attn_scalar=text["head_dim"]
        ),
        vision_config=transformers.SiglipVisionConfig(**vision),
        mm_tokens_per_image=4,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<boi>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<eoi>"),
    )
    return processor, config, transformers.Gemma3ForConditionalGeneration


def _tiny_llava(tokenizer, text: dict, vision: dict, image_size: int):
    import transformers

    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=VLM_CHAT_TEMPLATE.replace("{image}", "<image>"),
    )
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**text),
        vision_config=transformers.CLIPVisionConfig(**vision),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return processor, config, transformers.LlavaForConditionalGeneration


def _tiny_llava_next(tokenizer, text: dict, vision: dict, image_size: int):
    """Any-resolution: a base view and up to two tiles per image."""
    import transformers

    pinpoints = [[image_size, 2 * image_size], [2 * image_size, image_size], [2 * image_size, 2 * image_size]]
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
        image_grid_pinpoints=pinpoints,
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=vision["patch_size"],
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=VLM_CHAT_TEMPLATE.replace("{image}", "<image>"),
    )
    config = transformers.LlavaNextConfig(
        text_config=transformers.LlamaConfig(**text),
        vision_config=transformers.CLIPVisionConfig(**vision),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
    )
    return processor, config, transformers.LlavaNextForConditionalGeneration


def _tiny_idefics3(tokenizer, text: dict, vision: dict, image_size: int):
    """One tile per image (no splitting), 4 tokens after the pixel shuffle (scale factor 2)."""
    import transformers

    image_processor = transformers.Idefics3ImageProcessor(
        do_image_splitting=False, size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}
    )
    patches = image_size // vision["patch_size"]
    processor = transformers.Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=patches**2 // 4,
        chat_template=VLM_CHAT_TEMPLATE.replace("{image}", "<image>"),
    )
    config = transformers.Idefics3Config(
        text_config=transformers.LlamaConfig(**text).to_dict(),
        vision_config=transformers.Idefics3VisionConfig(**vision).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    return processor, config, transformers.Idefics3ForConditionalGeneration


TINY_VLM_BUILDERS = {
    "gemma3": _tiny_gemma3,
    "llava": _tiny_llava,
    "llava_next": _tiny_llava_next,
    "idefics3": _tiny_idefics3,
}


def solid_image(colour: tuple[int, int, int], size: int = 16):
    """A PIL image of one colour."""
    from PIL import Image

    return Image.new("RGB", (size, size), colour)


QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def _qwen_vl_image_options(image_size: int) -> dict:
    """Qwen-VL image (and video) processor options: one `image_size`-pixel square, 4-pixel patches merged 2 x 2."""
    return dict(min_pixels=image_size**2, max_pixels=image_size**2, patch_size=4, merge_size=2, temporal_patch_size=2)


def _tiny_qwen_vl_model(
    model_type: str,
    seed: int,
    vocab_size: int,
    width: int,
    heads: dict,
    mrope_section: list,
    vision_width: int,
    tokens: dict,
):
    """A random-weight 2-layer Qwen2-VL / Qwen2.5-VL of decoder width `width` (MLP 2x) and vision width
    `vision_width`; `tokens`: the ids of pad, eos, bos, image, video, vision_start and vision_end."""
    import transformers

    if model_type not in QWEN_VL_TYPES:
        raise ValueError(f"model_type must be one of {QWEN_VL_TYPES}, not {model_type!r}.")
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = getattr(transformers, f"{prefix}TextConfig")(
            vocab_size=vocab_size,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            **heads,
            max_position_embeddings=512,
            pad_token_id=tokens["pad"],
            eos_token_id=tokens["eos"],
            bos_token_id=tokens["bos"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        )
        vision = dict(depth=1, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        vision.update(
            dict(hidden_size=vision_width, out_hidden_size=width, intermediate_size=2 * vision_width)
            if model_type == "qwen2_5_vl"
            else dict(embed_dim=vision_width, hidden_size=width, mlp_ratio=2)
        )
        config = getattr(transformers, f"{prefix}Config")(
            text_config=text.to_dict(),
            vision_config=getattr(transformers, f"{prefix}VisionConfig")(**vision).to_dict(),
            image_token_id=tokens["image"],
            video_token_id=tokens["video"],
            vision_start_token_id=tokens["start"],
            vision_end_token_id=tokens["end"],
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).float().eval()
    model.generation_config.eos_token_id = tokens["eos"]
    model.generation_config.pad_token_id = tokens["pad"]
    return model


def build_tiny_qwen_vl(model_type: str = "qwen2_vl", *, seed: int = 0, image_size: int = 16):
    """A random-weight Qwen2-VL / Qwen2.5-VL (M-RoPE positions from the image grids) and a function that encodes a
    prompt with images as their processor would: (model, encode), encode(text_ids, images) -> (ids, tensors) with
    `pixel_values`, `image_grid_thw` and `mm_token_type_ids`. Their processors need torchvision (a video
    processor), which the default test environment lacks (`build_tiny_qwen_vl_with_processor` where it is); the
    image processor does not."""
    import transformers

    image_token, start, end = 60, 61, 62
    model = _tiny_qwen_vl_model(
        model_type,
        seed,
        vocab_size=64,
        width=32,
        heads=dict(num_attention_heads=4, num_key_value_heads=2),
        mrope_section=[2, 1, 1],
        vision_width=16,
        tokens=dict(pad=0, eos=1, bos=2, image=image_token, video=63, start=start, end=end),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image_processor = transformers.Qwen2VLImageProcessor(**_qwen_vl_image_options(image_size))

    def encode(text_ids: list[int], images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
        """[image block per image] + text_ids, as Qwen2-VL's processor lays them out."""
        out = image_processor(images=images, return_tensors="pt")
        ids = []
        for grid in out["image_grid_thw"]:
            ids += [start] + [image_token] * (int(grid.prod()) // 4) + [end]
        ids += list(text_ids)
        mm_token_type_ids = torch.tensor([[int(i == image_token) for i in ids]])
        return ids, {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": mm_token_type_ids,
        }

    return model, encode


# Qwen2-VL / Qwen2.5-VL-Instruct's chat template (public, as their processors ship it).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen_vl_with_processor(model_type: str = "qwen2_vl", *, seed: int = 0, image_size: int = 16):
    """A random-weight Qwen2-VL / Qwen2.5-VL with its real processor and chat template: (model, processor). Decoder
    heads of 32 (2 query heads, 1 key/value head, M-RoPE sections [4, 6, 6]), which vLLM's CPU build takes; 4-pixel
    patches merged 2 x 2, so a 16-pixel image is 4 tokens. The tokenizer is character-level with Qwen's special
    tokens, and the template's system sentence one token. Needs torchvision: transformers' Qwen-VL processors build
    a video processor."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if model_type not in QWEN_VL_TYPES:
        raise ValueError(f"build_tiny_qwen_vl_with_processor: model_type must be one of {QWEN_VL_TYPES}.")
    try:
        import torchvision  # noqa: F401
    except Exception as error:
        raise ImportError(f"Qwen-VL processors need torchvision (their video processor): {error}") from error
    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    vocab: dict[str, int] = {}
    for token in [*special, "You are a helpful assistant.", *sorted(set(DEFAULT_CHARS))]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special)
    tok.add_tokens(["You are a helpful assistant."])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        padding_side="left",
    )
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = getattr(transformers, f"{prefix}Processor")(
            image_processor=transformers.Qwen2VLImageProcessor(**_qwen_vl_image_options(image_size)),
            video_processor=transformers.Qwen2VLVideoProcessor(**_qwen_vl_image_options(image_size)),
            tokenizer=tokenizer,
            chat_template=QWEN2_VL_CHAT_TEMPLATE,
        )
    model = _tiny_qwen_vl_model(
        model_type,
        seed,
        vocab_size=len(vocab),
        width=64,
        heads=dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32),
        mrope_section=[4, 6, 6],
        vision_width=64,
        tokens=dict(
            pad=ids["<|endoftext|>"],
            eos=ids["<|im_end|>"],
            bos=ids["<|endoftext|>"],
            image=ids["<|image_pad|>"],
            video=ids["<|video_pad|>"],
            start=ids["<|vision_start|>"],
            end=ids["<|vision_end|>"],
        ),
    )
    return model, processor


# Qwen2.5-Instruct's chat template (public, as its tokenizer_config.json ships it): it renders tools into the system
# message and tool calls as <tool_call>{json}</tool_call>, so that agent tests run the real format.
QWEN2_5_CHAT_TEMPLATE = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"  # noqa: E501 (verbatim)
# The fixed sentences of its tool prompt, each one token in the test tokenizer (between the added tokens).
QWEN_TOOL_PROMPT_PHRASES = (
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within ",
    " XML tags:\n",
    '\n{"name": <function-name>, "arguments": <args-json-object>}\n',
)
QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def build_qwen_chat_tokenizer(words: tuple[str, ...] = ()):
    """A `PreTrainedTokenizerFast` with Qwen2.5's special tokens (EOS <|im_end|>, pad <|endoftext|>) and chat
    template. Tokens: the fixed sentences of the tool prompt, the words of the template and `words` (any strings,
    e.g. a tool's JSON schema line) whole, any other character alone, so that the long tool-calling system prompt
    stays short in tokens and every text still round-trips."""
    return build_chat_tokenizer(
        QWEN2_5_CHAT_TEMPLATE,
        QWEN_SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        added_tokens=QWEN_ADDED_TOKENS,
        words=tuple(words) + QWEN_TOOL_PROMPT_PHRASES,
    )


def build_chat_tokenizer(
    chat_template: str,
    special_tokens: list[str],
    eos_token: str,
    pad_token: str,
    added_tokens: list[str] = (),
    words: tuple[str, ...] = (),
):
    """A `PreTrainedTokenizerFast` for a given chat template: its special and added tokens, the words of the
    template and `words` whole, any other character alone (every text round-trips)."""
    import re

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    known = set(re.findall(r"[A-Za-z_]{2,}", chat_template)) | set(words)
    known = sorted(known, key=lambda w: (-len(w), w))
    vocab: dict[str, int] = {}
    for token in list(special_tokens) + list(added_tokens) + known + list(string.printable):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad_token))
    pattern = "|".join(re.escape(w) for w in known) + "|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"(?m:{pattern})"), behavior="isolated")  # (?m): . matches \n
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special_tokens))
    tok.add_tokens(list(added_tokens))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad_token, eos_token=eos_token)
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_output_dir(example: str) -> str:
    """Where an example run with `--tiny` writes: a folder under the system's temporary directory, the same in
    every process of a launch, never a Hub-named folder in the current directory."""
    import tempfile

    return str(Path(tempfile.gettempdir()) / "grpokit-examples" / example)


# Per family of TRL's chat templates (the longest prefix of the template's name that matches): its stop tokens, the
# first being its EOS (the token that ends an assistant turn), then its pad and BOS tokens (None where the template
# writes none). A stop token is where sampling of a turn ends: a token that ends the turn, or (GLM-4, Gemma 4 after a
# tool call) the token that opens the next message.
FAMILY_TOKENS = {
    "cohere": (("<|END_OF_TURN_TOKEN|>",), "<PAD>", "<BOS_TOKEN>"),
    "deepseek": (("<｜end▁of▁sentence｜>",), "<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>"),
    "diffusion_gemma": (("<turn|>", "<|tool_response>", "<eos>"), "<pad>", "<bos>"),
    "gemma": (("<end_of_turn>", "<eos>"), "<pad>", "<bos>"),
    "gemma4": (("<turn|>", "<|tool_response>", "<eos>"), "<pad>", "<bos>"),
    "glm4moe": (("<|endoftext|>", "<|user|>", "<|observation|>"), "<|endoftext|>", None),
    "gptoss": (("<|return|>", "<|call|>"), "<|endoftext|>", None),
    "idefics3": (("<end_of_utterance>",), "<|endoftext|>", "<|begin_of_text|>"),
    "lfm2": (("<|im_end|>",), "<|pad|>", "<|startoftext|>"),
    "llama3": (("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"), "<|finetune_right_pad_id|>", "<|begin_of_text|>"),
    "llava_next": (("</s>",), "<pad>", "<s>"),
    "muse_glimmer": (("<|eot|>",), "<|pad|>", None),
    "nemotron": (("<|im_end|>",), "<pad>", None),
    "phi3": (("<|end|>", "<|endoftext|>"), "<|endoftext|>", None),
    "qwen": (("<|im_end|>", "<|endoftext|>"), "<|endoftext|>", None),
    "smolvlm": (("<end_of_utterance>",), "<|endoftext|>", None),
}
# The control tokens a template writes: <|...|>, <｜...｜>, Gemma 4's one-sided <|tool_call> / <tool_call|>, and
# XML-like tags (<tool_call>, </think>, <atem:invoke>).
_MARKER = r"<\|[^\s<>|]*\|>|<｜[^｜]*｜>|<\|[\w\"]+>|<[\w\"]+\|>|</?[a-z_:]+>"


def build_family_tokenizer(template_name: str):
    """A `PreTrainedTokenizerFast` with TRL's shipped chat template `trl/chat_templates/<template_name>.jinja`
    (e.g. "qwen3", "gemma4_v2", "glm4moe_training"), built by `build_chat_tokenizer`: every control token the
    template writes is a special token, and EOS, pad and BOS are the family's (`FAMILY_TOKENS`); the template's
    text and any printable ASCII text round-trip. `tokenizer.stop_token_ids` lists the ids sampling stops on, EOS
    first (GLM-4 stops on <|observation|> and <|user|>, GPT-OSS on <|return|> and <|call|>, Gemma 4 on <turn|>
    and <|tool_response>)."""
    import re

    import trl

    path = Path(trl.__file__).parent / "chat_templates" / f"{template_name}.jinja"
    if not path.is_file():
        raise ValueError(f"TRL {trl.__version__} ships no chat template {template_name!r} ({path} is missing).")
    chat_template = path.read_text(encoding="utf-8")
    family = max((name for name in FAMILY_TOKENS if template_name.startswith(name)), key=len, default=None)
    if family is None:
        raise ValueError(f"No tokens known for chat template {template_name!r}: add its family to FAMILY_TOKENS.")
    stop_tokens, pad_token, bos_token = FAMILY_TOKENS[family]
    extra = [*stop_tokens, pad_token] + ([bos_token] if bos_token else [])
    special_tokens = list(dict.fromkeys(extra + sorted(set(re.findall(_MARKER, chat_template)))))
    non_ascii = tuple(sorted(set(re.findall(r"[^\x00-\x7f]", chat_template))))  # (e.g. GPT-OSS's 【】)
    tokenizer = build_chat_tokenizer(
        chat_template, special_tokens, eos_token=stop_tokens[0], pad_token=pad_token, words=non_ascii
    )
    if bos_token:
        tokenizer.bos_token = bos_token
    tokenizer.stop_token_ids = tokenizer.convert_tokens_to_ids(list(stop_tokens))
    return tokenizer
