"""What the chat template has to do for an agent: render tools into the prompt, parse the tool calls out of a
completion, and render tool results as the tokens that continue a transcript.

Tool calls are parsed with transformers' `tokenizer.parse_response` (TRL 1.16 does the same through its
`parse_response` helper): with the tokenizer's own `response_template` when it ships one, otherwise with the
template of its chat family, recognised from the chat template text (`response_templates.py`). A tokenizer whose chat
template cannot render a tool-calling conversation is refused up front (`check_tool_calling`), as TRL does with
`supports_tool_calling`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .response_templates import family


def response_template(tokenizer) -> dict:
    """The template that parses this tokenizer's completions: its own `response_template`, or its family's."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    return family(getattr(tokenizer, "chat_template", None) or "")[1]


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


def tool_result_ids(tokenizer, tool_messages: list[dict], chat_template_kwargs: dict) -> list[int]:
    """The tokens that follow an assistant turn that called tools when their results come back (see
    `appended_message_ids`)."""
    return appended_message_ids(tokenizer, tool_messages, chat_template_kwargs)


def appended_message_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict) -> list[int]:
    """The tokens that follow an assistant turn (ended by its EOS) when `messages` come next (tool results, or an
    environment's reply as a user turn), up to the next assistant header: the chat template's rendering of the
    messages, read off as the difference between a transcript with and without them (TRL's `_get_tool_suffix_ids`).
    The template must be prefix-preserving."""
    if messages[0].get("role") == "tool":  # tool results follow an assistant turn that called the tool
        call = [{"type": "function", "function": {"name": messages[0].get("name", "tool"), "arguments": {}}}]
        assistant = {"role": "assistant", "content": "", "tool_calls": call}
    else:
        assistant = {"role": "assistant", "content": "dummy"}
    before = [{"role": "user", "content": "dummy"}, assistant]
    prefix = tokenizer.apply_chat_template(before, tokenize=True, return_dict=True, **chat_template_kwargs)["input_ids"]
    full = tokenizer.apply_chat_template(
        before + messages, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
    )["input_ids"]
    # The sampled turn ends at EOS; Qwen's template writes "<|im_end|>\n": cut the prefix at its last EOS.
    eos = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if list(full[: len(prefix)]) != list(prefix):
        raise ValueError(
            "This chat template is not prefix-preserving: appending messages re-renders the earlier "
            "turns, so they cannot be appended to a sampled transcript. Use a template that renders "
            "earlier messages the same whatever follows."
        )
    return list(full[len(prefix) :])
