"""Tiny models and tokenizers built offline, for tests, benchmarks and the built-in demo.

Nothing here downloads anything: the tokenizer is a character-level `tokenizers` model and the model is a
random-weight Qwen2 configuration, so a test can build a real Hugging Face causal LM in milliseconds.
"""

from __future__ import annotations

import string
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
