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
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, moe_intermediate_size=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
    "gemma2": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4, query_pre_attn_scalar=8),
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                        query_pre_attn_scalar=8),
    "glm4_moe": dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1),
    "gpt2": dict(n_embd=32, n_layer=1, n_head=4, n_positions=64),
    # YaRN with its default factor expects the full context length (the RoPE tables are not preallocated).
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=4, max_position_embeddings=131072),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Mamba-2, attention and MoE blocks; the torch path of the Mamba mixer (no mamba-ssm / causal-conv1d kernels).
    "nemotron_h": dict(layers_block_type=["mamba", "attention", "moe"], ssm_state_size=8, mamba_num_heads=4,
                       mamba_head_dim=8, n_groups=1, chunk_size=8, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}  # fmt: skip


def build_tiny_model_of_type(model_type: str, num_layers: int = 1, vocab_size: int = 1024, *, seed: int = 0,
                             **overrides):  # fmt: skip
    """A random-weight transformers causal LM of `model_type` (hidden size 32, 4 query and 2 key/value heads of
    size 8), float32, in eval mode (no dropout draws), with the attention transformers picks by default (SDPA where
    the architecture supports it; Gemma 2 and GPT-OSS get eager). pad/eos/bos are ids 0/1/2, as in
    `build_char_tokenizer`. `overrides` are config fields; a `layer_types` (or NemotronH's `layers_block_type`)
    override sets the number of layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
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


# Qwen2.5-Instruct's chat template (public, as its tokenizer_config.json ships it): it renders tools into the system
# message and tool calls as <tool_call>{json}</tool_call>, so that agent tests run the real format.
QWEN2_5_CHAT_TEMPLATE = '{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- messages[0][\'content\'] }}\n    {%- else %}\n        {{- \'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- \'<|im_start|>system\\n\' + messages[0][\'content\'] + \'<|im_end|>\\n\' }}\n    {%- else %}\n        {{- \'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n        {{- \'<|im_start|>\' + message.role + \'\\n\' + message.content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}\n        {%- if message.content %}\n            {{- \'\\n\' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- \'}\\n</tool_call>\' }}\n        {%- endfor %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- \'<|im_start|>user\' }}\n        {%- endif %}\n        {{- \'\\n<tool_response>\\n\' }}\n        {{- message.content }}\n        {{- \'\\n</tool_response>\' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n            {{- \'<|im_end|>\\n\' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n{%- endif %}\n'
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
    return build_chat_tokenizer(QWEN2_5_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, eos_token="<|im_end|>",
                                pad_token="<|endoftext|>", added_tokens=QWEN_ADDED_TOKENS,
                                words=tuple(words) + QWEN_TOOL_PROMPT_PHRASES)  # fmt: skip


def build_chat_tokenizer(chat_template: str, special_tokens: list[str], eos_token: str, pad_token: str,
                         added_tokens: list[str] = (), words: tuple[str, ...] = ()):  # fmt: skip
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
