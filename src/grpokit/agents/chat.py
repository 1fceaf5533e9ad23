"""What the chat template has to do for an agent: render tools into the prompt, parse the tool calls out of a
completion, and render tool results as the tokens that continue a transcript.

Tool calls are parsed with transformers' `tokenizer.parse_response` (TRL 1.16 does the same through its
`parse_response` helper): with the tokenizer's own `response_template` when it ships one, otherwise with the
template of its chat family (`RESPONSE_TEMPLATES`), recognised from the chat template text. A tokenizer whose chat
template cannot render a tool-calling conversation is refused up front (`check_tool_calling`), as TRL does with
`supports_tool_calling`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..multimodal import tokenizer_of

# Response templates in transformers' `parse_response` format (transformers >= 5.13), one per chat family.
QWEN_RESPONSE_TEMPLATE = {  # Qwen2.5 / Qwen3 / QwQ: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
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
LLAMA3_RESPONSE_TEMPLATE = {  # Llama 3.1 / 3.2: {"name": ..., "parameters": {...}}<|eot_id|>
    "defaults": {"role": "assistant"},
    "start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|eot_id\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|eot_id\|>\s*", "content": "text"},
    },
}
# (family, markers that must all appear in the chat template, markers that must not, response template). Qwen3.5
# writes its calls as XML (<function=name>): not this JSON family.
RESPONSE_TEMPLATES = [
    ("Qwen2.5/Qwen3", ("<|im_start|>", "<tool_call>", "tool_call.arguments"), ("<function=",), QWEN_RESPONSE_TEMPLATE),
    ("Llama 3.1/3.2", ("<|start_header_id|>", '"parameters": '), (), LLAMA3_RESPONSE_TEMPLATE),
]


def response_template(tokenizer) -> dict:
    """The template that parses this tokenizer's completions: its own `response_template`, or its family's."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    chat_template = getattr(tokenizer, "chat_template", None) or ""
    for _, markers, excluded, template in RESPONSE_TEMPLATES:
        if all(m in chat_template for m in markers) and not any(m in chat_template for m in excluded):
            return template
    families = ", ".join(name for name, *_ in RESPONSE_TEMPLATES)
    raise ValueError(
        f"Cannot parse tool calls for this tokenizer: its chat template is none of the families grpokit "
        f"knows ({families}) and it has no `response_template`. Set tokenizer.response_template (see "
        f"transformers' chat response parsing docs) to the format your model writes tool calls in."
    )


def check_tool_calling(tokenizer) -> dict:
    """Refuse a tokenizer that cannot do tools (TRL's `supports_tool_calling`: a user → assistant tool call → tool
    conversation must render every part of the exchange); returns the response template."""
    from jinja2.exceptions import TemplateError

    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "Tools and environments need a tokenizer with a chat template that renders tool calls (e.g. "
            "Qwen2.5/Qwen3 or Llama 3.1); this processing_class has no chat template."
        )
    sentinels = ("tool_name_a8f3", "arg_key_b9d4", "arg_value_d6e7", "tool_content_c4f9")
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": sentinels[0], "arguments": {sentinels[1]: sentinels[2]}}}
            ],
        },
        {"role": "tool", "name": sentinels[0], "content": sentinels[3]},
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, TypeError) as error:
        rendered = f"<error: {error}>"
    if not all(s in rendered for s in sentinels):
        raise ValueError(
            "This tokenizer's chat template cannot render a tool-calling conversation (an assistant "
            "message with tool_calls, then a tool message), so the model could not see its tool calls "
            "or their results. Use a model whose chat template supports tools (Qwen2.5/Qwen3, Llama "
            "3.1), or set processing_class.chat_template to one that does."
        )
    return response_template(tokenizer)


def check_chat_template(tokenizer, chat_template_kwargs: dict | None, stop_ids: tuple[int, ...] | None) -> dict:
    """Everything the multi-turn loop reads off the chat template, checked before the model is loaded: it renders
    tool calls and their results (`check_tool_calling`), the tokens after a sampled turn can be read off it
    (`appended_message_ids`, which names the template's problem when they cannot) and they carry the tool's
    result. Returns the response template that parses tool calls."""
    template = check_tool_calling(tokenizer)
    content = "grpokit_result_5b1e"
    ids = appended_message_ids(
        tokenizer, [{"role": "tool", "name": "probe", "content": content}], dict(chat_template_kwargs or {}), stop_ids
    )
    if content not in tokenizer_of(tokenizer).decode(ids):
        raise ValueError(
            "This chat template does not render a tool's result after the assistant turn that called it, so the "
            "model would never see its tools' results. Set processing_class.chat_template to one that does."
        )
    return template


def parse_completion(tokenizer, template: dict, ids: list[int], prefix: list[int], tools: list) -> dict:
    """One assistant turn as a message, with its `tool_calls` when it made any; a turn that does not parse (a
    malformed call) is its decoded text, as in TRL's `parse_response`; so is every turn without a template (no
    tools)."""
    if template is None:
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    try:
        message = tokenizer.parse_response(ids, template, prefix=prefix, tools=tools or None)
        if message is None:
            raise ValueError("nothing parsed")
        if not isinstance(message.get("content"), str) or not message["content"]:
            message["content"] = ""
        message["content"] = message["content"].removesuffix(tokenizer.eos_token or "\0")
        if "tool_calls" in message:
            message["tool_calls"] = [valid_call(call) for call in message["tool_calls"]]
        return message
    except (ValueError, TypeError, KeyError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def valid_call(call: Any) -> dict:
    """A parsed tool call in the nested form {"type": "function", "function": {"name", "arguments"}}; one whose
    name is not a string raises ValueError (the turn is then kept as text)."""
    if not isinstance(call, dict):
        raise ValueError("a tool call is not an object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError("a tool call has no name")
    arguments = function.get("arguments")
    return {
        "type": call.get("type", "function"),
        "function": {"name": function["name"], "arguments": {} if arguments is None else arguments},
    }


def render_prompt(tokenizer, messages: list[dict], tools: list[Callable], chat_template_kwargs: dict) -> list[int]:
    """A conversational prompt with the tools' schemas, ready for the assistant's turn."""
    return list(
        tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **chat_template_kwargs,
        )["input_ids"]
    )


def tool_result_ids(
    tokenizer, tool_messages: list[dict], chat_template_kwargs: dict, stop_ids: tuple[int, ...] | None = None
) -> list[int]:
    """The tokens that follow an assistant turn that called tools when their results come back (see
    `appended_message_ids`)."""
    return appended_message_ids(tokenizer, tool_messages, chat_template_kwargs, stop_ids)


# Sentinels that mark the dummy assistant turn in a rendering (they tokenize to anything: only their place in the
# text is read).
_TURN_SENTINEL = "grpokit_turn_7f3a9c"
_TURN_ARGUMENT = "grpokit_argument_2d8e"


def appended_message_ids(
    tokenizer, messages: list[dict], chat_template_kwargs: dict, stop_ids: tuple[int, ...] | None = None
) -> list[int]:
    """The tokens that follow a sampled assistant turn when `messages` come next (tool results, or an
    environment's reply as a user turn), up to and including the next assistant header.

    The sampled turn itself is never re-rendered: the transcript keeps its tokens verbatim, up to the stop token
    the model sampled. What is read off the chat template is only what follows that stop token. The template
    renders a conversation with a dummy assistant turn (marked by a sentinel in its text or tool call), then
    `messages`, then the generation prompt; the answer is every token after the first stop token (`stop_ids`:
    the engine's EOS tokens, by default the tokenizer's EOS) that follows the sentinel. So a template that
    renders earlier turns differently once more turns follow (Qwen3 drops the empty think block of an earlier
    assistant turn; DeepSeek-R1 and GPT-OSS drop earlier reasoning) gives the same tokens as one that does not:
    nothing before the stop token is compared. A template that ends an assistant turn with none of the stop
    tokens (the model could never end its turn the way the template continues it) is refused with the fix.
    """
    text_tokenizer = tokenizer_of(tokenizer)
    stops = set(stop_ids) if stop_ids else {text_tokenizer.eos_token_id}
    text = _render_after_dummy_turn(tokenizer, messages, chat_template_kwargs)
    encoded = text_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    marker = text.find(_TURN_ARGUMENT if messages[0].get("role") == "tool" else _TURN_SENTINEL)
    if marker < 0:
        raise ValueError(
            "This chat template drops an assistant turn once a tool result or another message follows it, so "
            "what the model sees after its turn cannot be read off the template. Use the model family's "
            "training template (TRL ships them: trl.chat_template_utils.get_training_chat_template) or set "
            "processing_class.chat_template to one that keeps the assistant turns."
        )
    for index, (token, (start, _)) in enumerate(zip(ids, offsets)):
        if token in stops and start >= marker:
            return ids[index + 1 :]
    names = ", ".join(
        repr(text_tokenizer.convert_ids_to_tokens(int(t))) for t in sorted(s for s in stops if s is not None)
    )
    raise ValueError(
        f"This chat template ends an assistant turn with none of the tokens generation stops at ({names}), so a "
        f"sampled turn cannot be continued the way the template continues it: the template writes "
        f"{text[marker : marker + 120]!r} after the turn's text. Add the token that ends an assistant turn in this "
        f"template to the model's generation_config.eos_token_id (or the tokenizer's eos_token)."
    )


def _render_after_dummy_turn(tokenizer, messages: list[dict], chat_template_kwargs: dict) -> str:
    """The template's text of: a user turn, a dummy assistant turn (a call of the first tool message's tool,
    with the real tool name: GPT-OSS writes it in the result's header; or plain text), `messages`, and the
    generation prompt."""
    from jinja2.exceptions import TemplateError

    if messages[0].get("role") == "tool":  # tool results follow an assistant turn that called the tool
        arguments: Any = {"input": _TURN_ARGUMENT}
        name = messages[0].get("name", "tool")
        assistant = {"role": "assistant", "content": "", "tool_calls": [_call(name, arguments)]}
    else:
        assistant = {"role": "assistant", "content": _TURN_SENTINEL}
    conversation = [{"role": "user", "content": "hello"}, assistant, *messages]
    render = dict(add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
    try:
        return tokenizer.apply_chat_template(conversation, **render)
    except (TypeError, TemplateError):
        if "tool_calls" not in assistant:
            raise
        # DeepSeek-V3's template concatenates the arguments as a string (transformers#45419): give them as JSON.
        assistant["tool_calls"] = [_call(assistant["tool_calls"][0]["function"]["name"], json.dumps(arguments))]
        return tokenizer.apply_chat_template(conversation, **render)


def _call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}
