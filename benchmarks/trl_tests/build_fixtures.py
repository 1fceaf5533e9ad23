"""Offline stand-ins for the Hub models and datasets TRL's trainer tests load.

Models: tiny random-weight models of the real architectures (transformers configurations), each with a tokenizer
built by `tokenizers` around its family's real chat template (the copy TRL ships in `trl/chat_templates/`), saved
into a Hugging Face hub cache (`models--org--name/snapshots/<rev>/` and `refs/main`) so that
`from_pretrained("trl-internal-testing/tiny-...")` resolves with HF_HUB_OFFLINE=1.

Datasets: TRL's own generators (`scripts/generate_zen*_dataset.py` of the TRL checkout the tests come from) run with
`push_to_hub` redirected to local parquet files under `<datasets_root>/trl-internal-testing/<name>/`, with a README
whose `configs:` name each subset, so `load_dataset("trl-internal-testing/zen", "standard_prompt_only")` run from
`<datasets_root>` loads the same rows as the Hub copy.

    python build_fixtures.py --hub-cache DIR --datasets-root DIR --trl-scripts DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
import warnings
from pathlib import Path

import torch

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


def build_chat_tokenizer(chat_template, special_tokens, eos_token, pad_token, added_tokens=(), first_id=0):
    """grpokit.testing.build_chat_tokenizer's tokenizer with its special tokens from id `first_id` on (the ids
    below are fillers no text maps to, as a large vocabulary's other tokens for a random-weight model)."""
    import re
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    known = sorted(set(re.findall(r"[A-Za-z_]{2,}", chat_template)), key=lambda w: (-len(w), w))
    vocab = {f"<|filler_{i}|>": i for i in range(first_id)}
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


def build_tokenizer(model_type: str, template_name: str | None, eos: str, pad: str | None):
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
    tokenizer = build_chat_tokenizer(
        template, special, eos, pad or eos, added_tokens=ADDED.get(model_type, []), first_id=first_id
    )
    if bos:
        tokenizer.bos_token = bos
    if pad is None:
        tokenizer.pad_token = None
    return tokenizer


def build_text_model(hub_cache: Path, repo_id: str, spec: tuple) -> None:
    from transformers import AutoModelForSequenceClassification

    from grpokit.testing import build_tiny_model_of_type

    model_type, head, template, eos, pad = spec
    tokenizer = build_tokenizer(model_type, template, eos, pad)
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
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for repo_id, spec in TEXT_MODELS.items():
        build_text_model(args.hub_cache, repo_id, spec)
        print("built", repo_id)
    for repo_id, model_type in VLMS.items():
        build_vlm(args.hub_cache, repo_id, model_type)
        print("built", repo_id)
    build_remote_model(args.hub_cache, args.trl_scripts)
    print("built trl-internal-testing/tiny-RemoteForCausalLM")
    build_datasets(args.datasets_root, args.trl_scripts)
    print("built datasets", sorted(DATASET_SCRIPTS))


if __name__ == "__main__":
    main()
