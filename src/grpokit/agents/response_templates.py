"""How each chat family writes its tool calls, as response templates in transformers' `parse_response` format
(transformers >= 5.13), and which family a chat template belongs to.

A family is recognised by markers its chat template text contains (`FAMILIES`, most specific first), not by
comparing the whole template with known copies (TRL's `add_response_schema` does that), so that a revision of a
template that keeps its tool-call syntax keeps its parser. Families grpokit parses and TRL 1.16 does not:
DeepSeek-V3, DiffusionGemma (Gemma 4's syntax) and Muse Glimmer (whose checkpoints ship their own template).

Argument values that a family writes as bare text (the XML-like families: a string `"3"` and a number `3` look
the same) are read as text, then typed by transformers from the tool's JSON schema (`parse_response(tools=...)`).
"""

from __future__ import annotations

# A value in one of the families that write calls as Python: a quoted string, or a bracketed list or mapping
# (balanced to any depth with the `regex` module's recursion, which transformers compiles its patterns with), or a
# bare literal up to the next "," or ")".
_PYTHON_VALUE = (
    r"'(?:\\.|[^'\\])*'"
    r"|(?P<bracketed>[\[{](?:'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"|[^\[\]{}'\"]|(?&bracketed))*[\]}])"
    r"|[^,)]*"
)
THINK = {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"}
# A call whose name the open pattern captures and whose arguments the content holds.
CALL = {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}


def _xml_calls(open_pattern: str, close_pattern: str, tag_pattern: str, strip: bool = True) -> dict:
    """Calls written as one tag per argument (values as text, typed from the tool's schema)."""
    return {
        "open_pattern": open_pattern,
        "close_pattern": close_pattern,
        "repeats": True,
        "content": "xml-inline",
        "content_args": {"tag_pattern": tag_pattern, "value_parser": {"name": "text", "args": {"strip": strip}}},
        "transform": CALL,
    }


QWEN_RESPONSE_TEMPLATE = {  # Qwen2.5 / Qwen3 / Qwen3-VL: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": THINK,
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
# Qwen3.5 / 3.6 / 3.8 and Nemotron 3: <tool_call><function=name><parameter=key>value</parameter></function></tool_call>
QWEN_XML_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": THINK,
        "tool_calls": _xml_calls(
            r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
            r"(?:</function>\s*)?</tool_call>\s*",
            r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>",
        ),
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
LLAMA3_RESPONSE_TEMPLATE = {  # Llama 3.1 / 3.2: {"name": ..., "parameters": {...}}<|eot_id|>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}\s*(?:<\|eot_id\|>|<\|eom_id\|>)\s*",
            "repeats": True,
            "content": "json",
            "transform": CALL,
        },
        "content": {"close_pattern": r"(?:<\|eot_id\|>|<\|eom_id\|>)\s*", "content": "text"},
    },
}
GLM4_RESPONSE_TEMPLATE = {  # GLM-4.5/4.6 (name then newline) and GLM-4.7 (none): <tool_call>name<arg_key>...
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": THINK,
        "tool_calls": _xml_calls(
            r"<tool_call>(?P<name>[^\n<]+)\n?",
            r"</tool_call>\s*",
            r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>",
        ),
        # No end-of-turn token: the model stops on the token that opens the next message.
        "content": {"close_pattern": r"(?:<\|observation\|>|<\|user\|>|<\|endoftext\|>)\s*", "content": "text"},
    },
}
# GPT-OSS (harmony): one message per channel; the recipient may come before or after the channel.
GPT_OSS_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "thinking": {
            "open_pattern": r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>",
            "close_pattern": r"<\|end\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"(?:<\|start\|>assistant)?\s*(?:to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary"
            r"|<\|channel\|>commentary\s+to=functions\.(?P<name>[^\s<]+))\s*(?:<\|constrain\|>)?\s*(?:json)?"
            r"<\|message\|>",
            "close_pattern": r"<\|call\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": CALL,
        },
        "content": {
            "open_pattern": r"(?:<\|start\|>assistant)?<\|channel\|>final<\|message\|>",
            "close_pattern": r"(?:<\|return\|>|<\|end\|>)\s*",
            "content": "text",
        },
    },
}
# LFM2.5: [name(key='value', n=3), other()] between <|tool_call_start|> and <|tool_call_end|>, strings quoted as
# they are (a quote or a line break inside is written raw).
LFM2_RAW_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": THINK,
        "tool_calls": {
            # The comma that separates two calls follows the first call's ")" (not a comma of the content).
            "open_pattern": r"(?:<\|tool_call_start\|>\s*\[|(?<=\)\s*),)\s*(?P<name>[\w.-]+)\(",
            "close_pattern": r"\)\s*(?:\]\s*<\|tool_call_end\|>)?\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": rf"(?P<key>\w+)\s*=\s*(?P<value>{_PYTHON_VALUE})",
                "value_parser": {"name": "json", "args": {"string_delims": [["'", "'"]], "allow_non_json": True}},
            },
            "transform": CALL,
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
# LFM2 (v2) and LFM2.5-VL: the same calls with strings escaped as Python literals, which transformers' strict
# `python-call-list` parser reads whole.
LFM2_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": THINK,
        "tool_calls": {
            "open": "<|tool_call_start|>",
            "close_pattern": r"<\|tool_call_end\|>\s*",
            "content": "python-call-list",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            "transform_each": True,
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
# Gemma 4 and DiffusionGemma: <|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>; after a tool response the
# model goes on in the same turn.
GEMMA4_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor_pattern": r"<\|turn>model\n|<tool_response\|>",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"<\|channel>thought\s*",
            "close_pattern": r"<channel\|>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>[^{\s]+)",
            "close_pattern": r"<tool_call\|>\s*",
            "repeats": True,
            "content": "json",
            "content_args": {"string_delims": [['<|"|>', '<|"|>']], "unquoted_keys": True},
            "transform": CALL,
        },
        "content": {"close_pattern": r"(?:<turn\|>|<\|tool_response>|<eos>)\s*", "content": "text"},
    },
}
# DeepSeek-V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>
DEEPSEEK_V3_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<｜Assistant｜>",
    "fields": {
        "reasoning_content": THINK,
        "tool_calls": {
            "open_pattern": r"(?:<｜tool▁calls▁begin｜>)?\s*<｜tool▁call▁begin｜>(?P<type>\w+)<｜tool▁sep｜>"
            r"(?P<name>[^\n]+)\n```(?:json)?\s*",
            "close_pattern": r"\s*```\s*<｜tool▁call▁end｜>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "{type}", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"(?:<｜tool▁calls▁end｜>|<｜end▁of▁sentence｜>)\s*", "content": "text"},
    },
}
# Muse Glimmer (ATEM): one message per recipient; a call is <atem:invoke name=...> with one <atem:parameter> per
# argument (strings as they are, other values as JSON).
MUSE_GLIMMER_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start|>assistant",
    "fields": {
        "reasoning_content": {
            "open_pattern": r"(?:<\|start\|>assistant)?\s*to=self\s*<\|message\|>",
            "close_pattern": r"(?:<\|eom\|>|<\|eot\|>)\s*",
            "content": "text",
        },
        "tool_calls": _xml_calls(
            r"(?:(?:<\|start\|>assistant)?\s*to=[^\s<]+\s*<\|message\|>\s*)?<atem:function_calls>\s*"
            r'<atem:invoke name="(?P<name>[^"]+)">',
            r"</atem:invoke>\s*</atem:function_calls>\s*(?:<\|eom\|>|<\|eot\|>)?\s*",
            r'<atem:parameter name="(?P<key>[^"]+)">(?P<value>.*?)</atem:parameter>',
            strip=False,  # its tool prompt says that spaces around string values are kept
        ),
        "content": {
            "open_pattern": r"(?:<\|start\|>assistant)?\s*(?:to=user\s*)?<\|message\|>",
            "close_pattern": r"(?:<\|eot\|>|<\|eom\|>)\s*",
            "content": "text",
        },
    },
}

# (family, markers that must all appear in its chat template, response template), most specific first: Nemotron 3
# and Qwen3.5 also write <tool_call>, and LFM2's escaping variant also writes <|tool_call_start|>.
FAMILIES = [
    ("Muse Glimmer", ("<atem:invoke",), MUSE_GLIMMER_RESPONSE_TEMPLATE),
    ("GPT-OSS", ("<|channel|>", "<|call|>"), GPT_OSS_RESPONSE_TEMPLATE),
    ("Gemma 4", ("<|tool_call>", "call:"), GEMMA4_RESPONSE_TEMPLATE),
    ("DeepSeek-V3", ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"), DEEPSEEK_V3_RESPONSE_TEMPLATE),
    ("GLM-4-MoE", ("<|assistant|>", "<arg_key>"), GLM4_RESPONSE_TEMPLATE),
    ("LFM2 v2 / LFM2.5-VL", ("<|tool_call_start|>", "\\\\'"), LFM2_RESPONSE_TEMPLATE),
    ("LFM2.5", ("<|tool_call_start|>",), LFM2_RAW_RESPONSE_TEMPLATE),
    ("Qwen3.5/3.6/3.8, Nemotron 3", ("<|im_start|>", "<function=", "<parameter="), QWEN_XML_RESPONSE_TEMPLATE),
    ("Qwen2.5/Qwen3", ("<|im_start|>", "<tool_call>"), QWEN_RESPONSE_TEMPLATE),
    ("Llama 3.1/3.2", ("<|start_header_id|>", '"parameters": '), LLAMA3_RESPONSE_TEMPLATE),
]


def family(chat_template: str) -> tuple[str, dict]:
    """The name and response template of the family whose markers `chat_template` contains; ValueError naming the
    families for any other."""
    for name, markers, template in FAMILIES:
        if all(marker in chat_template for marker in markers):
            return name, template
    families = ", ".join(name for name, *_ in FAMILIES)
    raise ValueError(
        f"Cannot parse tool calls for this tokenizer: its chat template is none of the families grpokit "
        f"knows ({families}) and it has no `response_template`. Set tokenizer.response_template (see "
        f"transformers' chat response parsing docs) to the format your model writes tool calls in."
    )
