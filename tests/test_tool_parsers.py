"""Tool-call parsing for every chat template the installed TRL ships (`trl/chat_templates/*.jinja`): each one that
can render a tool-calling conversation (TRL's `supports_tool_calling`) writes tool calls, and grpokit must read them
back from exactly the tokens a model would have sampled; the others are refused with grpokit's clear error.

Templates grpokit parses and TRL 1.16 does not (`add_response_schema` refuses them): DeepSeek-V3 (deepseekv3,
deepseekv3_training), DiffusionGemma (Gemma 4's syntax), Muse Glimmer (whose checkpoints ship their own
`response_template`), and every `_training` variant (TRL recognises a template only by exact equality with its
original copy).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest

trl_utils = pytest.importorskip("trl.chat_template_utils")

from grpokit.agents import chat  # noqa: E402
from grpokit.agents.response_templates import family  # noqa: E402
from grpokit.testing import build_family_tokenizer  # noqa: E402

TEMPLATE_NAMES = sorted(path.stem for path in (Path(trl_utils.__file__).parent / "chat_templates").glob("*.jinja"))


@functools.cache
def supports_tools(name: str) -> bool:
    return trl_utils.supports_tool_calling(build_family_tokenizer(name))


def trl_parses(name: str) -> bool:
    try:
        trl_utils.add_response_schema(build_family_tokenizer(name))
    except ValueError:  # "Unrecognized chat template"
        return False
    return True


TOOL_TEMPLATES = [name for name in TEMPLATE_NAMES if supports_tools(name)]
TRL_PARSED = [name for name in TOOL_TEMPLATES if trl_parses(name)]
OTHER_TEMPLATES = [name for name in TEMPLATE_NAMES if not supports_tools(name)]
# The family each template is recognised as (by the longest matching prefix of its name).
FAMILY_OF = {
    "deepseekv3": "DeepSeek-V3",
    "diffusion_gemma": "Gemma 4",
    "gemma4": "Gemma 4",
    "glm4moe": "GLM-4-MoE",
    "gptoss": "GPT-OSS",
    "lfm2_2_5": "LFM2.5",
    "lfm2_2_5_vl": "LFM2 v2 / LFM2.5-VL",
    "lfm2_v2": "LFM2 v2 / LFM2.5-VL",
    "llama3": "Llama 3.1/3.2",
    "muse_glimmer": "Muse Glimmer",
    "nemotron_3": "Qwen3.5/3.6/3.8, Nemotron 3",
    "qwen2_5": "Qwen2.5/Qwen3",
    "qwen3": "Qwen2.5/Qwen3",
    "qwen3_5": "Qwen3.5/3.6/3.8, Nemotron 3",
    "qwen3_6": "Qwen3.5/3.6/3.8, Nemotron 3",
    "qwen3_8": "Qwen3.5/3.6/3.8, Nemotron 3",
}


def get_weather(city: str, zip_code: str, days: int) -> str:
    """The forecast.

    Args:
        city: The city.
        zip_code: Its postal code.
        days: How many days ahead.
    """
    return "sunny"


def ping() -> str:
    """Checks the connection."""
    return "pong"


def search(query: dict, tags: list[str], note: str, flag: bool, n: int) -> str:
    """Searches the index.

    Args:
        query: The filters.
        tags: Tags to match.
        note: A note to log.
        flag: Whether to be strict.
        n: How many results.
    """
    return "none"


TOOLS = [get_weather, ping, search]
WEATHER = ("get_weather", {"city": "Paris", "zip_code": "75001", "days": 3})  # "75001" stays a string
NESTED = (
    "search",
    {
        "query": {"filters": {"tags": ["a", "b"], "min": 2.5}, "limit": 10},
        "tags": ["x y", "z"],
        "note": 'He said "hi"\nthen left',
        "flag": True,
        "n": -3,
    },
)
# Templates that render one call per assistant turn, so that two calls cannot be tested.
ONE_CALL_PER_TURN = {
    "llama3": "Llama 3.1/3.2's template refuses two calls in one turn",
    "gptoss": "GPT-OSS's template renders only the first call of a turn (harmony: one call per message)",
}
CASES = {"one call": [WEATHER], "two calls": [WEATHER, ("ping", {})], "nested arguments": [NESTED], "text": []}


def token_ids(tokenizer, messages, **kwargs) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    )


def sampled_turn(tokenizer, calls: list[tuple[str, dict]]) -> tuple[list[int], list[int], list[dict]]:
    """(prompt, completion, expected calls): the template's rendering of an assistant turn that makes `calls` (or
    answers in text), cut where a model's sampling would have started (where the rendering leaves the prompt with
    its generation prompt) and stopped (its last stop token in the turn, or the first one after it: GLM-4 stops on
    the token that opens the next message)."""
    user = [{"role": "user", "content": "What is the weather?"}]
    expected = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
    assistant = {"role": "assistant", "content": "" if calls else "The answer is 42."}
    following = (
        {"role": "tool", "name": calls[0][0], "content": "sunny"} if calls else {"role": "user", "content": "ok"}
    )
    if calls:
        assistant["tool_calls"] = [{**call, "function": dict(call["function"])} for call in expected]
    try:
        turn = token_ids(tokenizer, [*user, assistant])
    except TypeError:  # DeepSeek-V3's original template takes arguments as a JSON string only
        for call in assistant["tool_calls"]:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        turn = token_ids(tokenizer, [*user, assistant])
    prompt = token_ids(tokenizer, user, add_generation_prompt=True)
    start = next((i for i, (a, b) in enumerate(zip(prompt, turn)) if a != b), min(len(prompt), len(turn)))
    stops = [i for i in range(start, len(turn)) if turn[i] in tokenizer.stop_token_ids]
    if stops:
        return turn[:start], turn[start : stops[-1] + 1], expected
    after = token_ids(tokenizer, [*user, assistant, following])
    assert after[: len(turn)] == turn, "the template re-renders the turn when a message follows"
    end = next(i for i in range(len(turn), len(after)) if after[i] in tokenizer.stop_token_ids)
    return turn[:start], after[start : end + 1], expected


def skip_one_call_families(name: str, case: str) -> None:
    for prefix, reason in ONE_CALL_PER_TURN.items():
        if case == "two calls" and name.startswith(prefix):
            pytest.skip(reason)


def parse(tokenizer, prompt, completion) -> dict:
    return chat.parse_completion(tokenizer, chat.response_template(tokenizer), completion, prompt, TOOLS)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_tool_calls_parse_from_the_templates_own_rendering(name, case):
    """The calls (names and arguments, equal as Python objects: nested objects, floats, negative numbers, a string
    of digits, quotes and a line break) and the content come back from the sampled tokens, and nothing else."""
    tokenizer = build_family_tokenizer(name)
    skip_one_call_families(name, case)
    prompt, completion, expected = sampled_turn(tokenizer, CASES[case])
    message = parse(tokenizer, prompt, completion)
    assert message == {"role": "assistant", "content": "" if expected else "The answer is 42."} | (
        {"tool_calls": expected} if expected else {}
    ), tokenizer.decode(completion)


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_family_is_recognised_by_markers(name):
    """Each template is its expected family's, and so is a local edit of it (a comment, changed whitespace), which
    TRL's exact comparison no longer recognises."""
    expected = FAMILY_OF[max((prefix for prefix in FAMILY_OF if name.startswith(prefix)), key=len)]
    tokenizer = build_family_tokenizer(name)
    assert family(tokenizer.chat_template)[0] == expected
    edited = "{#- a local edit -#}\n" + tokenizer.chat_template.replace("{%- ", "{%-  ")
    assert family(edited)[0] == expected
    tokenizer.chat_template = edited
    with pytest.raises(ValueError, match="Unrecognized chat template"):
        trl_utils.add_response_schema(tokenizer)


def as_trl_reads_it(name: str, case: str, message: dict) -> dict:
    """grpokit's reading of a turn as TRL 1.16 reads it, with TRL's two known mistakes: after GLM-4's calls it keeps
    the stop token <|observation|> as the content (its content ends only at <|user|>), and in LFM2 v2 / LFM2.5-VL
    it reads the escaped line break of a string ('a\\nb', as the template writes it) as a backslash and an "n"."""
    message = copy.deepcopy(message)
    if name.startswith("glm4moe") and message.get("tool_calls"):
        message["content"] = "<|observation|>"
    if name.startswith(("lfm2_v2", "lfm2_2_5_vl")) and case == "nested arguments":
        arguments = message["tool_calls"][0]["function"]["arguments"]
        arguments["note"] = arguments["note"].replace("\n", "\\n")
    return message


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", TRL_PARSED)
def test_grpokit_and_trl_parse_alike(name, case):
    """Where TRL 1.16 parses the family, its `add_response_schema` + `parse_response` reads the same message from
    the same ids, but for its known mistakes (`as_trl_reads_it`)."""
    reference = trl_utils.add_response_schema(build_family_tokenizer(name))
    skip_one_call_families(name, case)
    tokenizer = build_family_tokenizer(name)
    prompt, completion, _ = sampled_turn(tokenizer, CASES[case])
    theirs = trl_utils.parse_response(reference, completion, prefix=prompt, tools=TOOLS)
    assert as_trl_reads_it(name, case, parse(tokenizer, prompt, completion)) == theirs


def test_templates_without_tool_calling_are_refused():
    """The templates TRL's `supports_tool_calling` rejects (they drop the calls or the tool results) are refused by
    grpokit with the error that says why and what to use instead."""
    assert OTHER_TEMPLATES, "every template TRL ships supports tools: nothing left to refuse"
    for name in OTHER_TEMPLATES:
        with pytest.raises(ValueError, match="cannot render a tool-calling conversation"):
            chat.check_tool_calling(build_family_tokenizer(name))


def test_an_unknown_family_is_named_with_the_way_out():
    tokenizer = build_family_tokenizer("qwen2_5_vl")  # ChatML without tool calls: no family's markers
    with pytest.raises(ValueError, match=r"none of the families grpokit knows \(Muse Glimmer, GPT-OSS, .*response_"):
        chat.response_template(tokenizer)
    tokenizer.response_template = family(build_family_tokenizer("qwen3").chat_template)[1]
    assert chat.response_template(tokenizer) is tokenizer.response_template


def test_check_tool_calling_accepts_every_tool_template():
    """grpokit's check passes every template TRL's `supports_tool_calling` passes, and returns its family's response
    template; DeepSeek-V3's original, which cannot take a call's arguments as an object, gets them as JSON text
    (`chat.render_conversation`, as TRL's check retries)."""
    for name in TOOL_TEMPLATES:
        tokenizer = build_family_tokenizer(name)
        assert chat.check_tool_calling(tokenizer) is family(tokenizer.chat_template)[1], name


@pytest.mark.parametrize(
    "name, text, expected",
    [
        # GPT-OSS models also write the recipient after the channel, with a <|constrain|> hint.
        (
            "gptoss",
            '<|channel|>commentary to=functions.ping <|constrain|>json<|message|>{"a": [1, {"b": null}]}<|call|>',
            [("ping", {"a": [1, {"b": None}]})],
        ),
        # GLM-4.7 writes no line break after the name.
        (
            "glm4moe",
            "<tool_call>ping<arg_key>a</arg_key><arg_value>x</arg_value></tool_call><|observation|>",
            [("ping", {"a": "x"})],
        ),
        # A comma and a parenthesis in LFM2.5's text are no call; a call's list and mapping nest to any depth.
        ("lfm2_2_5", "Hi, see(this)<|im_end|>", []),
        (
            "lfm2_2_5",
            "<|tool_call_start|>[ping(a=[[['x', {'k': [1, [2, [3]]]}]]], b='y')]<|tool_call_end|><|im_end|>",
            [("ping", {"a": [[["x", {"k": [1, [2, [3]]]}]]], "b": "y"})],
        ),
    ],
)
def test_formats_the_models_write_beyond_their_templates_rendering(name, text, expected):
    tokenizer = build_family_tokenizer(name)
    prompt = token_ids(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    message = parse(tokenizer, prompt, tokenizer(text, add_special_tokens=False)["input_ids"])
    calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in expected]
    assert message.get("tool_calls", []) == calls
    assert message["content"] == ("" if calls else "Hi, see(this)")
