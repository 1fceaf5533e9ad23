"""Shared by the agent tests: a tiny Qwen2 model with Qwen2.5's real chat template, a lookup tool, and scripted
policies that call tools (ScriptedEngine scripts that read the transcript so far)."""

import json
import re

from grpokit.rollout import ScriptedEngine
from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model

WORDS = ("lookup", "key", "value", "slow", "broken", "answer")
TABLE = {f"k{i}": f"v{(7 * i + 3) % 10}{(3 * i + 1) % 10}" for i in range(40)}


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up
    """
    return TABLE[key]


def tiny_agent_model(hidden_size: int = 32, seed: int = 0, num_layers: int = 2):
    tokenizer = build_qwen_chat_tokenizer(WORDS)
    model = build_tiny_model(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, seed=seed,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=None)  # fmt: skip
    return model, tokenizer


def call_text(name: str, arguments) -> str:
    body = json.dumps({"name": name, "arguments": arguments}) if not isinstance(arguments, str) else arguments
    return f"<tool_call>\n{body}\n</tool_call><|im_end|>"


def tool_call_script(tokenizer, turns):
    """A ScriptedEngine whose completion for a context is turns(user_text, tool_results_so_far, index): a text."""

    def script(prompt_ids, index):
        text = tokenizer.decode(prompt_ids)
        user = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)[0]  # the first user turn
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        return tokenizer(turns(user, results, index), add_special_tokens=False)["input_ids"]

    return ScriptedEngine(script)


def key_of(user_text: str) -> str:
    return re.search(r"k\d+", user_text).group(0)
