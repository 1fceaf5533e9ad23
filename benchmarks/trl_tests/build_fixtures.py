"""Offline stand-ins for the Hub models and datasets TRL's trainer tests load.

Models: tiny random-weight models of the real architectures (transformers configurations), each with a tokenizer
built by `tokenizers` around its family's real chat template (the copy TRL ships in `trl/chat_templates/`), saved
into a Hugging Face hub cache (`models--org--name/snapshots/<rev>/` and `refs/main`) so that
`from_pretrained("trl-internal-testing/tiny-...")` resolves with HF_HUB_OFFLINE=1.

Datasets: TRL's own generators (`scripts/generate_zen*_dataset.py` of the TRL checkout the tests come from) run with
`push_to_hub` redirected to local parquet files under `<datasets_root>/trl-internal-testing/<name>/`, with a README
whose `configs:` name each subset, so `load_dataset("trl-internal-testing/zen", "standard_prompt_only")` run from
`<datasets_root>` loads the same rows as the Hub copy.

    PYTHONPATH=tests/vllm_env python build_fixtures.py --hub-cache DIR --datasets-root DIR --trl-scripts DIR

The Qwen-VL family's, Qwen 3.5's and Gemma 4's processors need torchvision (run_trl_tests.py installs it where it
does not import).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import warnings
from pathlib import Path

import torch
import torchvision_cpu_shim  # noqa: F401  (run_trl_tests puts it on the path: torchvision imports beside a CPU torch)

# model id -> (model_type, head, TRL chat template file, eos, pad, bos, extra special tokens)
TEXT_MODELS = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", "qwen2_5", "<|im_end|>", "<|endoftext|>"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": (
        "qwen2",
        "classification",
        "qwen2_5",
        "<|im_end|>",
        "<|endoftext|>",
    ),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal", "qwen3", "<|im_end|>", "<|endoftext|>"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": (
        "qwen3",
        "classification",
        "qwen3",
        "<|im_end|>",
        "<|endoftext|>",
    ),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", "qwen3", "<|im_end|>", "<|endoftext|>"),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("llama", "causal", "llama3_2", "<|eot_id|>", None),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": (
        "llama",
        "classification",
        "llama3_2",
        "<|eot_id|>",
        None,
    ),
    "trl-internal-testing/tiny-MistralForCausalLM-0.2": ("mistral", "causal", None, "</s>", None),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("gemma2", "causal", "gemma", "<eos>", "<pad>"),
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("cohere2", "causal", "cohere2", "<|END_OF_TURN_TOKEN|>", "<PAD>"),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal", "glm4moe", "<|endoftext|>", "<|endoftext|>"),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("gpt_oss", "causal", "gptoss", "<|return|>", "<|endoftext|>"),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": (
        "nemotron_h",
        "causal",
        "nemotron_3_nano",
        "<|im_end|>",
        "<|endoftext|>",
    ),
}
BOS = {"llama": "<|begin_of_text|>", "mistral": "<s>", "gemma2": "<bos>", "cohere2": "<BOS_TOKEN>"}
# Special tokens of the family's tokenizer that its template does not name (TRL's tests use Llama's pad token).
SPECIAL = {"llama": ["<|end_of_text|>", "<|finetune_right_pad_id|>", "<|eom_id|>", "<|python_tag|>"]}
# Tokens the families' tokenizers hold as added tokens (tool calls, thinking).
ADDED = {"qwen2": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]}
ADDED["qwen3"] = ADDED["qwen3_moe"] = ADDED["qwen2"] + ["<think>", "</think>"]
ADDED["nemotron_h"] = ADDED["qwen3"]
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The stand-ins whose tokenizers hold Qwen's ids for the tokens TRL's tool and environment tests write into a mocked
# generate (QWEN_IDS): decoded, those completions are the text their comments give, as with Qwen's tokenizer.
QWEN_IDS_MODELS = {"trl-internal-testing/tiny-Qwen3MoeForCausalLM"}
# Qwen2.5's and Qwen3's added tokens, at their ids.
QWEN_ADDED_IDS = dict(
    enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ],
        start=151643,
    )
)
# Qwen's byte-level BPE pieces of TRL's tests' tool calls and replies (besides single characters), at their ids.
QWEN_PIECES = {
    293: " b",
    314: " {",
    330: ' "',
    397: ">\n",
    411: "out",
    450: "dec",
    497: '",',
    522: "</",
    606: "name",
    788: '":',
    894: " any",
    927: "sh",
    944: "'t",
    1318: "text",
    1414: " know",
    1513: " don",
    2765: " won",
    4913: '{"',
    5212: ' {"',
    5392: " tool",
    6023: "hi",
    6659: "call",
    7692: "async",
    9520: "step",
    11248: "}}\n",
    13477: "rement",
    14172: "tool",
    16252: " increment",
    16370: "arguments",
    17453: "Done",
    22785: "_tool",
    35744: "increment",
    64648: "multiply",
    93054: "_multiply",
    95642: '"}}\n',
}
# A tool call of TRL's test_train_with_tools and the text its comment gives: the build checks the stand-in decodes it.
QWEN_IDS_CHECK = (
    [
        *(151657, 198, 4913, 606, 788, 330, 64648, 22785, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11, 330, 65),
        *(788, 220, 19, 11248, 151658, 151645),
    ],
    '<tool_call>\n{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
)


def qwen_character_ids() -> dict[int, str]:
    """Qwen's (GPT-2's byte-level) ids of the printable ASCII characters: '!'..'~' from 0, the whitespace bytes
    from 188 (the bytes without a printable form follow the 188 that have one, in byte order)."""
    ids = {code - 33: chr(code) for code in range(33, 127)}
    ids.update({188 + code: chr(code) for code in (9, 10, 11, 12, 13, 32)})
    return ids


# Mistral-7B-Instruct-v0.2's template (TRL ships none for it).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
# model id -> grpokit.testing.build_tiny_vlm model_type (the VLMs whose processors need no torchvision).
VLMS = {
    "trl-internal-testing/tiny-Gemma3ForConditionalGeneration": "gemma3",
    "trl-internal-testing/tiny-LlavaForConditionalGeneration": "llava",
    "trl-internal-testing/tiny-LlavaNextForConditionalGeneration": "llava_next",
    "trl-internal-testing/tiny-SmolVLMForConditionalGeneration": "idefics3",
}
# model id -> (model_type, TRL chat template file): the Qwen-VL family, whose processors need torchvision (their video
# processor), built only where it imports. Sizes as TRL's generator scripts (scripts/generate_tiny_models/
# for_conditional_generation/), on transformers' default configurations (the Hub's are not reachable here).
QWEN_VLMS = {
    "trl-internal-testing/tiny-Qwen2VLForConditionalGeneration": ("qwen2_vl", "qwen2_5_vl"),
    "trl-internal-testing/tiny-Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "qwen2_5_vl"),
    "trl-internal-testing/tiny-Qwen3_5ForConditionalGeneration-NoThink": ("qwen3_5", "qwen3_5_nothink"),
    "trl-internal-testing/tiny-Qwen3_5MoeForConditionalGeneration-3.6": ("qwen3_5_moe", "qwen3_6"),
}
GEMMA4 = "trl-internal-testing/tiny-Gemma4ForConditionalGeneration"
# Gemma 4's media tokens: begin / placeholder / end of an image and of an audio clip, a video's placeholder.
GEMMA4_MEDIA = ("<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>")
# Qwen's special tokens after <|im_end|>, in their tokenizer's order (151646-151656 in Qwen2-VL's vocabulary).
QWEN_VISION_SPECIAL = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
DATASET_SCRIPTS = {
    "trl-internal-testing/zen": "generate_zen_dataset.py",
    "trl-internal-testing/zen-image": "generate_zen_image_dataset.py",
    "trl-internal-testing/zen-multi-image": "generate_zen_multi_image_dataset.py",
}


def snapshot_dir(hub_cache: Path, repo_id: str) -> Path:
    """The hub cache's snapshot folder for `repo_id`, with refs/main pointing at it."""
    revision = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    path = repo / "snapshots" / revision
    path.mkdir(parents=True, exist_ok=True)
    return path


# Qwen's special tokens start at id 151643 (<|endoftext|>, <|im_start|>, <|im_end|> = 151643-151645) in a vocabulary of
# 151,665: TRL's tests write those ids (a mocked generate's completions) and rely on EOS being one token in 150k.
QWEN_FIRST_SPECIAL_ID = 151643


def build_chat_tokenizer(
    chat_template, special_tokens, eos_token, pad_token, added_tokens=(), first_id=0, fixed: dict | None = None
):
    """grpokit.testing.build_chat_tokenizer's tokenizer with its special tokens from id `first_id` on (the ids
    below are fillers no text maps to, as a large vocabulary's other tokens for a random-weight model), except the
    tokens `fixed` places (id -> token)."""
    import re
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    known = sorted(set(re.findall(r"[A-Za-z_]{2,}", chat_template)), key=lambda w: (-len(w), w))
    fixed = fixed or {}
    vocab = {fixed.get(i, f"<|filler_{i}|>"): i for i in range(max([first_id, *(i + 1 for i in fixed)]))}
    for token in list(special_tokens) + list(added_tokens) + known + list(string.printable):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=pad_token))
    pattern = "|".join(re.escape(w) for w in known) + "|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"(?m:{pattern})"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special_tokens))
    tok.add_tokens(list(added_tokens))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad_token, eos_token=eos_token)
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tokenizer(model_type: str, template_name: str | None, eos: str, pad: str | None, qwen_ids: bool = False):
    import re

    import trl

    if template_name is None:
        template = MISTRAL_TEMPLATE
    else:
        template = (Path(trl.__file__).parent / "chat_templates" / f"{template_name}.jinja").read_text()
    bos = BOS.get(model_type)
    special = sorted(set(re.findall(r"<\|[A-Za-z_]+\|>|<(?:start|end)_of_turn>", template)))
    special += SPECIAL.get(model_type, [])
    first_id = 0
    if model_type in (
        "qwen2",
        "qwen3",
        "qwen3_moe",
    ):  # the Qwen families: <|endoftext|>, <|im_start|>, <|im_end|> at 151643-151645
        first_id = QWEN_FIRST_SPECIAL_ID
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [t for t in special if t not in QWEN_SPECIAL]
    else:
        special = [token for token in [eos, pad, bos] if token] + [t for t in special if t not in (eos, pad, bos)]
    fixed = {**qwen_character_ids(), **QWEN_PIECES, **QWEN_ADDED_IDS} if qwen_ids else None
    tokenizer = build_chat_tokenizer(
        template, special, eos, pad or eos, added_tokens=ADDED.get(model_type, []), first_id=first_id, fixed=fixed
    )
    if qwen_ids and tokenizer.decode(QWEN_IDS_CHECK[0]) != QWEN_IDS_CHECK[1]:
        raise RuntimeError(f"the stand-in with Qwen's ids decodes {tokenizer.decode(QWEN_IDS_CHECK[0])!r}")
    if bos:
        tokenizer.bos_token = bos
    if pad is None:
        tokenizer.pad_token = None
    return tokenizer


def build_text_model(hub_cache: Path, repo_id: str, spec: tuple) -> None:
    from transformers import AutoModelForSequenceClassification

    from grpokit.testing import build_tiny_model_of_type

    model_type, head, template, eos, pad = spec
    tokenizer = build_tokenizer(model_type, template, eos, pad, qwen_ids=repo_id in QWEN_IDS_MODELS)
    ids = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        max_position_embeddings=131072 if model_type == "gpt_oss" else 2048,
    )
    model = build_tiny_model_of_type(model_type, num_layers=2, seed=0, **ids)
    if head == "classification":
        config = model.config
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForSequenceClassification.from_config(config)
    model = model.to(torch.bfloat16)  # TRL's tiny models are stored in bfloat16
    path = snapshot_dir(hub_cache, repo_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_vlm(hub_cache: Path, repo_id: str, model_type: str) -> None:
    from grpokit.testing import build_tiny_vlm

    model, processor = build_tiny_vlm(model_type, seed=0)
    if model_type == "gemma3":  # Gemma 3's SigLIP has no pooling head (vision_use_head=False): it would never train
        for module in model.modules():
            if getattr(module, "use_head", False):
                module.use_head = False
                del module.head
        model.config.vision_config.vision_use_head = False
    path = snapshot_dir(hub_cache, repo_id)
    model.to(torch.bfloat16).save_pretrained(path)
    processor.save_pretrained(path)


def build_byte_level_qwen_tokenizer(chat_template: str, special_tokens: list[str], added_tokens: list[str]):
    """Qwen 3.5's tokenizer class (byte-level BPE; transformers loads a qwen3_5 checkpoint's tokenizer with it
    whatever tokenizer_config.json names) with the 256 byte symbols and no merges, so every text round-trips one
    byte a token; the special tokens from Qwen's id 151643 on."""
    from tokenizers import AddedToken
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen3_5Tokenizer

    vocab = {f"<|filler_{i}|>": i for i in range(QWEN_FIRST_SPECIAL_ID)}
    for token in [*special_tokens, *added_tokens, *sorted(ByteLevel.alphabet())]:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen3_5Tokenizer(
        vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    tokenizer.chat_template = chat_template
    return tokenizer


def build_qwen_vlm(hub_cache: Path, repo_id: str, model_type: str, template_name: str) -> None:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3.5 / Qwen3.5-MoE (Qwen 3.6) of TRL's tiny sizes (2 decoder layers of width 16,
    a 2-block vision tower; Qwen 3.5: one linear-attention and one full-attention layer), with the family's processor
    (transformers' classes at their defaults; Qwen 3.5: 16-pixel patches and its 0.5 normalisation) around a
    tokenizer with TRL's copy of the family's chat template and Qwen's special-token ids."""
    import re

    import transformers
    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / f"{template_name}.jinja").read_text()
    special = [*QWEN_SPECIAL, *QWEN_VISION_SPECIAL]
    special += sorted(set(re.findall(r"<\|[A-Za-z_]+\|>", template)) - set(special))
    if model_type.startswith("qwen3_5"):
        tokenizer = build_byte_level_qwen_tokenizer(template, special, ADDED["qwen3"])
    else:
        tokenizer = build_chat_tokenizer(
            template, special, "<|im_end|>", "<|endoftext|>", ADDED["qwen3"], first_id=QWEN_FIRST_SPECIAL_ID
        )
    token_id = tokenizer.convert_tokens_to_ids
    text = dict(
        vocab_size=len(tokenizer),
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=token_id("<|endoftext|>"),
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=token_id("<|im_end|>"),
    )
    vision_tokens = dict(
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    image_processor = transformers.Qwen2VLImageProcessor()
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        text.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1]})
        vision = dict(hidden_size=16, num_heads=4, depth=2)
        if model_type == "qwen2_vl":
            vision.update(embed_dim=64)
        else:
            vision.update(fullatt_block_indexes=[1], out_hidden_size=16)
        prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[model_type]
        video_processor = transformers.Qwen2VLVideoProcessor()
    else:
        text.update(layer_types=["linear_attention", "full_attention"])
        if model_type == "qwen3_5_moe":
            text.update(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
            )
        vision = dict(hidden_size=16, depth=2, num_heads=4, intermediate_size=32, out_hidden_size=16)
        prefix = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[model_type]
        half = [0.5, 0.5, 0.5]
        image_processor = transformers.Qwen2VLImageProcessor(
            patch_size=16, image_mean=half, image_std=half, size={"shortest_edge": 65536, "longest_edge": 16777216}
        )
        video_processor = transformers.Qwen3VLVideoProcessor()
    processor_class = transformers.Qwen3VLProcessor if model_type.startswith("qwen3") else None
    processor_class = processor_class or getattr(transformers, f"{prefix}Processor")
    processor = processor_class(
        image_processor=image_processor, video_processor=video_processor, tokenizer=tokenizer, chat_template=template
    )
    config = getattr(transformers, f"{prefix}Config")(
        text_config=getattr(transformers, f"{prefix}TextConfig")(**text).to_dict(),
        vision_config=getattr(transformers, f"{prefix}VisionConfig")(**vision).to_dict(),
        **vision_tokens,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).to(torch.bfloat16)
    if model_type == "qwen3_5":  # Qwen 3.5 keeps its linear attention's A_log and norm in float32 (TRL's script)
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.data = layer.linear_attn.A_log.data.float()
                layer.linear_attn.norm.weight.data = layer.linear_attn.norm.weight.data.float()
    model.generation_config.eos_token_id = [token_id("<|im_end|>"), token_id("<|endoftext|>")]
    model.generation_config.pad_token_id = token_id("<|endoftext|>")
    path = snapshot_dir(hub_cache, repo_id)
    model.save_pretrained(path)
    processor.save_pretrained(path)


def build_gemma4_vlm(hub_cache: Path) -> None:
    """Gemma 4 (google/gemma-4-E2B-it's architecture) of TRL's tiny sizes (2 decoder layers of width 16, one sliding
    and one full attention layer, no audio tower; a 2-layer vision tower of 70 soft tokens an image, TRL's smallest),
    with Gemma4Processor (its image, video and audio processors at transformers' defaults, 70 tokens an image as TRL
    sets them) around a tokenizer with TRL's copy of the current Gemma 4 chat template and its special tokens."""
    import re

    import transformers
    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / "gemma4_v5.jinja").read_text()
    special = ["<pad>", "<eos>", "<bos>", *GEMMA4_MEDIA]
    special += sorted(set(re.findall(r"<\|[a-z_\"]+\|?>|<[a-z_]+\|>", template)) - set(special))
    words = build_chat_tokenizer(template, special, "<eos>", "<pad>")
    names = dict(image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>")
    names.update(audio_token="<|audio|>", boa_token="<|audio>", eoa_token="<audio|>")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words._tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        extra_special_tokens=names,
    )
    tokenizer.chat_template = template
    token_id = tokenizer.convert_tokens_to_ids
    image_tokens = 70  # TRL's: the smallest max_soft_tokens Gemma 4 supports; 630 patches (3 x 3 pooled) an image
    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=transformers.Gemma4ImageProcessor(max_soft_tokens=image_tokens, image_seq_length=image_tokens),
        tokenizer=tokenizer,
        video_processor=transformers.Gemma4VideoProcessor(),
        chat_template=template,
        image_seq_length=image_tokens,
    )
    text = transformers.Gemma4TextConfig(
        vocab_size=len(tokenizer),
        vocab_size_per_layer_input=len(tokenizer),
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0,
        global_head_dim=8,
        hidden_size_per_layer_input=16,
        pad_token_id=token_id("<pad>"),
        eos_token_id=token_id("<eos>"),
        bos_token_id=token_id("<bos>"),
    )
    vision = transformers.Gemma4VisionConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        position_embedding_size=image_tokens * 9,
        default_output_length=image_tokens,
    )
    config = transformers.Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=None,
        boi_token_id=token_id("<|image>"),
        eoi_token_id=token_id("<image|>"),
        image_token_id=token_id("<|image|>"),
        video_token_id=token_id("<|video|>"),
        boa_token_id=token_id("<|audio>"),
        eoa_token_index=token_id("<audio|>"),
        audio_token_id=token_id("<|audio|>"),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Gemma4ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = [token_id("<eos>"), token_id("<turn|>")]  # as Gemma's: a turn's end too
    path = snapshot_dir(hub_cache, GEMMA4)
    model.save_pretrained(path)
    processor.save_pretrained(path)


def build_remote_model(hub_cache: Path, scripts: Path) -> None:
    """tiny-RemoteForCausalLM: a Llama under another model_type whose code travels with the checkpoint
    (trust_remote_code), from the modules of TRL's generator (scripts/.../_remote_code)."""
    import importlib
    import sys

    sys.path.insert(0, str(scripts))
    configuration = importlib.import_module("remote_code.configuration_remote")
    modeling = importlib.import_module("remote_code.modeling_remote")
    configuration.RemoteConfig.register_for_auto_class()
    modeling.RemoteModel.register_for_auto_class("AutoModel")
    modeling.RemoteForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    modeling.RemoteForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
    tokenizer = build_tokenizer("llama", "llama3_2", "<|eot_id|>", None)
    config = configuration.RemoteConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config.auto_map = {
        "AutoModel": "modeling_remote.RemoteModel",
        "AutoModelForSequenceClassification": "modeling_remote.RemoteForSequenceClassification",
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = modeling.RemoteForCausalLM(config).to(torch.bfloat16)
    path = snapshot_dir(hub_cache, "trl-internal-testing/tiny-RemoteForCausalLM")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_datasets(root: Path, scripts: Path) -> None:
    """Run TRL's dataset generators with push_to_hub writing parquet files and a README with `configs:`."""
    import datasets

    configs: dict[str, list] = {}

    def push_to_hub(self, repo_id, config_name="default", **kwargs):
        folder = root / repo_id / config_name
        folder.mkdir(parents=True, exist_ok=True)
        for split, dataset in self.items():
            dataset.to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
        files = [{"split": split, "path": f"{config_name}/{split}-*.parquet"} for split in self]
        configs.setdefault(repo_id, []).append({"config_name": config_name, "data_files": files})

    original = datasets.DatasetDict.push_to_hub
    datasets.DatasetDict.push_to_hub = push_to_hub
    try:
        for repo_id, script in DATASET_SCRIPTS.items():
            module = runpy.run_path(str(scripts / script))
            module["main"](0.1, True, repo_id)
    finally:
        datasets.DatasetDict.push_to_hub = original
    for repo_id, entries in configs.items():
        # YAML is a superset of JSON: one JSON line per config keeps the README free of a yaml dependency.
        lines = ["---", "configs:"] + [f"- {json.dumps(entry)}" for entry in entries] + ["---", ""]
        (root / repo_id / "README.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hub-cache", type=Path, required=True)
    parser.add_argument("--datasets-root", type=Path, required=True)
    parser.add_argument("--trl-scripts", type=Path, required=True, help="TRL's scripts/ folder")
    parser.add_argument("--only", nargs="+", metavar="MODEL_ID", help="build only these models (no datasets)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.only:
        for repo_id in args.only:
            if repo_id in QWEN_VLMS:
                build_qwen_vlm(args.hub_cache, repo_id, *QWEN_VLMS[repo_id])
            elif repo_id == GEMMA4:
                build_gemma4_vlm(args.hub_cache)
            elif repo_id in VLMS:
                build_vlm(args.hub_cache, repo_id, VLMS[repo_id])
            else:
                build_text_model(args.hub_cache, repo_id, TEXT_MODELS[repo_id])
            print("built", repo_id)
        return
    for repo_id, spec in TEXT_MODELS.items():
        build_text_model(args.hub_cache, repo_id, spec)
        print("built", repo_id)
    for repo_id, model_type in VLMS.items():
        build_vlm(args.hub_cache, repo_id, model_type)
        print("built", repo_id)
    for repo_id, (model_type, template) in QWEN_VLMS.items():
        build_qwen_vlm(args.hub_cache, repo_id, model_type, template)
        print("built", repo_id)
    build_gemma4_vlm(args.hub_cache)
    print("built", GEMMA4)
    build_remote_model(args.hub_cache, args.trl_scripts)
    print("built trl-internal-testing/tiny-RemoteForCausalLM")
    build_datasets(args.datasets_root, args.trl_scripts)
    print("built datasets", sorted(DATASET_SCRIPTS))


if __name__ == "__main__":
    main()
