"""Shared by the agent tests: a tiny Qwen2 model with Qwen2.5's real chat template, a lookup tool, and scripted
policies that call tools (ScriptedEngine scripts that read the transcript so far)."""

import json
import random
import re

import torch

from grpokit import token_logprobs
from grpokit.agents import tool_result_ids
from grpokit.agents.chat import render_conversation
from grpokit.rollout import HFEngine, PromptBatch, Rollout, SamplingParams, ScriptedEngine
from grpokit.testing import (
    QWEN_ADDED_TOKENS,
    QWEN_SPECIAL_TOKENS,
    QWEN_TOOL_PROMPT_PHRASES,
    build_chat_tokenizer,
    build_qwen_chat_tokenizer,
    build_tiny_model,
)

# Whole tokens of the test tokenizer besides the template's own: tool names, the lookup tool's schema line and the
# fixed parts of a call, so that prompts and calls are a few tokens (a fast CPU test; the format is unchanged).
WORDS = (
    "lookup",
    "key",
    "value",
    "slow",
    "broken",
    "answer",
    '\n{"name": "',
    '", "arguments": {"key": "',
    '"}}\n',
    '{"type": "function", "function": {"name": "lookup", "description": "Look up the value stored under a key.", '
    '"parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "the key to look '
    'up"}}, "required": ["key"]}, "return": {"type": "string"}}}',
)
_draw = random.Random(0)
TABLE = {f"k{i}": f"v{_draw.randrange(10)}{_draw.randrange(10)}" for i in range(100)}  # only readable through lookup


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up
    """
    return TABLE[key]


def tiny_agent_model(hidden_size: int = 32, seed: int = 0, num_layers: int = 2, template: str = "qwen2_5", **shape):
    """template: "qwen2_5" (grpokit.testing's copy of Qwen2.5's chat template) or the name of a chat template TRL
    ships (trl/chat_templates/<name>.jinja) of the Qwen family, e.g. "qwen3". shape: more of build_tiny_model's
    arguments (vLLM's CPU attention needs num_heads=2 at hidden size 64)."""
    tokenizer = build_qwen_chat_tokenizer(WORDS) if template == "qwen2_5" else qwen_family_tokenizer(template)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **shape,
    )
    return model, tokenizer


def qwen_family_tokenizer(template: str):
    """A tokenizer with Qwen's special tokens and the chat template TRL ships as `template`."""
    from pathlib import Path

    import trl

    chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    return build_chat_tokenizer(
        chat_template,
        QWEN_SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        added_tokens=QWEN_ADDED_TOKENS,
        # Qwen3's tool prompt opens its system turn with the phrase Qwen2.5's writes after its default system text
        words=WORDS + QWEN_TOOL_PROMPT_PHRASES + ("\n" + QWEN_TOOL_PROMPT_PHRASES[1].lstrip("\n"),),
    )


def model_turn(
    tokenizer, before: list[dict], message: dict, tools, stop_ids=None, after=(), **chat_template_kwargs
) -> list[int]:
    """The tokens a model writes for `message` after `before` and the generation prompt, as the chat template
    renders that message last (Qwen3: with its think block), up to and including the first stop token (default:
    the EOS) that ends the turn. Where the template's generation prompt opens a block the rendered turn does not
    (DeepSeek-V3 and Nemotron 3 prefill "<think>\n"), the turn closes that block, then goes on with the tokens after
    what the two have in common; where the template writes a turn's stop token only when more follows (GLM-4's
    <|observation|>), `after` is rendered after the message too."""
    options = dict(tools=tools, tokenize=False, **chat_template_kwargs)
    render = lambda messages, **kw: render_conversation(tokenizer, messages, **options, **kw)  # noqa: E731
    tokens = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = tokens(render(before, add_generation_prompt=True))
    stops = set(stop_ids or (tokenizer.eos_token_id,))
    for following in ((), tuple(after)):
        full = tokens(render([*before, message, *following]))
        common = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), len(prompt))
        ends = [i for i, token in enumerate(full[common:]) if token in stops]
        if ends:
            # A model continuing a prefilled "<think>\n" closes the block before it writes the turn.
            opened = tokens("</think>\n") if render(before, add_generation_prompt=True).endswith("<think>\n") else []
            return opened + full[common : common + ends[0] + 1]
    raise AssertionError(f"no stop token ends the turn: {tokenizer.decode(full[common:])!r}")


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


def transcript_ids(tokenizer, key: str, tools) -> tuple[list[int], list[int], int]:
    """The ideal rollout for a key: (prompt + call + tool result + answer ids, loss mask, prompt length). The
    model's turns are the chat template's own rendering of them; the tool result is what grpokit inserts."""
    user = [{"role": "user", "content": f"key {key}"}]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}],
    }
    result = {"role": "tool", "name": "lookup", "content": TABLE[key]}
    prompt = tokenizer.apply_chat_template(
        user, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    ids, mask = list(prompt), [0] * len(prompt)
    for part, trained in (
        (model_turn(tokenizer, user, call, tools), 1),
        (tool_result_ids(tokenizer, [result], {}), 0),
        (model_turn(tokenizer, [*user, call, result], {"role": "assistant", "content": TABLE[key]}, tools), 1),
    ):
        ids, mask = ids + part, mask + [trained] * len(part)
    return ids, mask, len(prompt)


def warm_up(model, tokenizer, keys, steps: int, lr: float = 3e-3, batch_size: int = 16, seed: int = 0):
    """A short supervised warm-up on ideal transcripts (loss on the policy's tokens only), as the demo does: a
    random-weight model has no tool use for GRPO to sharpen."""
    import torch

    examples = [transcript_ids(tokenizer, key, [lookup]) for key in keys]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    draw = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = [examples[draw.randrange(len(examples))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _, _ in batch)
        ids = torch.tensor([x + [tokenizer.pad_token_id] * (width - len(x)) for x, _, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m, _ in batch], dtype=torch.float32)
        logits = model(ids).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (losses * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def assert_sampled_logprobs_match_training(model, rollout) -> torch.Tensor:
    """Every trained token's sampling log-prob equals a plain training forward over prompt + completion (float32,
    1e-5), and inserted tokens carry 0: the turns were sampled on exactly the context the trainer sees. Returns the
    training log-probs [N, T]."""
    with torch.no_grad():
        training, _ = token_logprobs(
            model,
            torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
            torch.cat([rollout.prompt_mask, rollout.attention_mask], 1),
            rollout.completion_ids.shape[1],
        )
    trained = rollout.loss_mask.bool()
    torch.testing.assert_close(rollout.sampling_logprobs[trained], training[trained], rtol=0, atol=1e-5)
    assert (rollout.sampling_logprobs[~trained] == 0).all()
    return training


def dapo_update(model, input_ids, attention, loss_mask, advantages, lr: float, eps: float) -> dict:
    """The first AdamW update of a plain forward of whole transcripts with the DAPO loss over loss_mask (the
    policy's tokens), at an epsilon so large that the update is -lr·g/(|g| + eps): a trainer's first update under
    the same lr and eps reads off its gradient. input_ids, attention: [N, L]; loss_mask: [N, L-1] (next tokens)."""
    model.zero_grad()
    logits = model(input_ids, attention_mask=attention).logits[:, :-1]
    logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ratio = (logprobs - logprobs.detach()).exp()
    (-(ratio * advantages[:, None]) * loss_mask).sum().div(loss_mask.sum()).backward()
    return {k: -lr * p.grad / (p.grad.abs() + eps) for k, p in model.named_parameters()}


def relative_error(a: dict, b: dict) -> float:
    """The largest error of a against b, per tensor relative to b's largest entry."""
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)


def with_forward_logprobs(model, rollout: Rollout) -> Rollout:
    """A scripted rollout given the sampling log-probs a plain forward of the model assigns its tokens (0 on
    padding), as if the model had sampled them."""
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            model,
            torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
            torch.cat([rollout.prompt_mask, rollout.attention_mask], 1),
            rollout.completion_ids.shape[1],
        )
    rollout.sampling_logprobs = logprobs * rollout.attention_mask
    return rollout


class ForcedCallsEngine:
    """The real in-process engine, except that while a transcript holds fewer than `calls` tool results its turn
    is a forced tool call (with log-probs from a plain forward): so that a random tiny model makes calls, and the
    turns the engine samples come after tool results of different lengths."""

    logprobs_match_training = True

    def __init__(self, model, tokenizer, calls=2):
        self.inner, self.model, self.tokenizer, self.calls = HFEngine(model), model, tokenizer, calls

    def sync_weights(self, model):
        self.inner.sync_weights(model)

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        text = self.tokenizer.decode(prompts.ids[0])
        if text.count("<tool_response>") >= self.calls:
            return self.inner.generate(prompts, params, seed)
        from grpokit.rollout import ScriptedEngine

        forced = ScriptedEngine(
            lambda ids, index: self.tokenizer(
                call_text("lookup", {"key": key_of(self.tokenizer.decode(ids))}), add_special_tokens=False
            )["input_ids"]
        )
        rollout = forced.generate(prompts, params, seed)
        return with_forward_logprobs(self.model, rollout)
