"""Tool calling on the chat templates of the model families agents are trained on.

grpokit never re-renders a sampled turn: the transcript keeps the tokens the model sampled, and what it reads off the
chat template is only what follows a turn's stop token (the tool results and the next assistant header:
`agents.chat.appended_message_ids`). So a template that renders earlier turns differently once more turns follow
(Qwen3's think block, DeepSeek-R1's and GPT-OSS's dropped reasoning) trains as it is, with no patched copy. Each test
builds a tiny random-weight model whose tokenizer carries the family's real template (TRL's shipped copies), runs a
two-turn tool-calling rollout (a first turn forced to the template's own rendering of a call, a second turn sampled
by the in-process engine) and checks the token layout; then a GRPO step trains on it."""

from __future__ import annotations

import pytest
import torch
from agents_helpers import (
    TABLE,
    assert_sampled_logprobs_match_training,
    lookup,
    model_turn,
    tiny_agent_model,
    with_forward_logprobs,
)
from test_tool_parsers import FAMILY_OF, TOOL_TEMPLATES

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.agents import Agents, chat, tool_result_ids
from grpokit.rollout import HFEngine, PromptBatch, Rollout, SamplingParams, ScriptedEngine
from grpokit.testing import build_family_tokenizer, build_tiny_model

KEY = "k3"
USER = [{"role": "user", "content": f"key {KEY}"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": KEY}}}],
}
RESULT = {"role": "tool", "name": "lookup", "content": TABLE[KEY]}


class FirstTurnForced:
    """The in-process engine, except that its first call returns `first_turn` for every row (with the log-probs
    of a plain forward), so that a random-weight model makes the template's own tool call."""

    logprobs_match_training = True

    def __init__(self, model, first_turn: list[int]):
        self.inner, self.model, self.first_turn, self.calls = HFEngine(model), model, first_turn, 0

    def sync_weights(self, model):
        self.inner.sync_weights(model)

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        self.calls += 1
        if self.calls > 1:
            return self.inner.generate(prompts, params, seed)
        rollout = ScriptedEngine(lambda ids, index: self.first_turn).generate(prompts, params, seed)
        return with_forward_logprobs(self.model, rollout)


def generation_header(tokenizer, kwargs: dict) -> str:
    """What the template adds for the generation prompt (Qwen3: "<|im_start|>assistant\\n", and with thinking off
    the empty think block too)."""
    render = lambda add: tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=add, **kwargs)  # noqa: E731
    with_header, without = render(True), render(False)
    assert with_header.startswith(without)
    return with_header[len(without) :]


def two_turn_rollout(model, tokenizer, kwargs: dict, stop_ids=None, max_new_tokens: int = 96):
    """(rollout, completion as reward functions see it, the forced call's ids, the tool result's ids)."""
    eos = tuple(stop_ids or (tokenizer.eos_token_id,))
    call = model_turn(tokenizer, USER, CALL, [lookup], stop_ids=eos, after=[RESULT], **kwargs)
    result = tool_result_ids(tokenizer, [RESULT], kwargs, eos)
    agents = Agents(
        tokenizer,
        tools=[lookup],
        max_completion_length=len(call) + len(result) + max_new_tokens,  # the second turn: up to max_new_tokens
        max_tool_calling_iterations=1,
        chat_template_kwargs=kwargs,
        stop_ids=eos,
    )
    engine = FirstTurnForced(model, call)
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    rollout, completions = agents.rollout(engine, [{"prompt": USER}], params, seed=0)
    return rollout, completions[0], call, result


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_qwen3_template_two_turn_tool_rollout_keeps_sampled_turns_verbatim(thinking):
    model, tokenizer = tiny_agent_model(template="qwen3")
    kwargs = {"enable_thinking": thinking}
    rollout, completion, call, result = two_turn_rollout(model, tokenizer, kwargs)
    ids = rollout.completion_id_lists()[0]
    # The forced call verbatim (thinking on, Qwen3 writes an empty think block in the last assistant turn and drops
    # it from that turn once a tool result follows; thinking off, the generation prompt holds it), then the
    # template's tool result and next assistant header, then the sampled turn.
    assert ids[: len(call)] == call
    assert tokenizer.decode(call).startswith(("<think>\n\n</think>\n\n" if thinking else "") + "<tool_call>")
    assert ids[len(call) : len(call) + len(result)] == result
    result_text = tokenizer.decode(result)
    assert result_text.startswith("\n<|im_start|>user\n<tool_response>\n" + TABLE[KEY])
    assert result_text.endswith(generation_header(tokenizer, kwargs))
    assert result_text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    second = len(ids) - len(call) - len(result)
    assert second > 0
    assert rollout.loss_mask[0, : len(ids)].tolist() == [1] * len(call) + [0] * len(result) + [1] * second
    assert completion[0]["tool_calls"] == CALL["tool_calls"] and completion[1] == RESULT
    # Every sampled token was drawn in the context the trainer sees: its log-prob is the training forward's.
    assert_sampled_logprobs_match_training(model, rollout)


def test_a_template_whose_turns_end_at_no_stop_token_is_refused_before_the_weights_load(tmp_path):
    """The tokenizer's EOS is not the token the template ends an assistant turn with, and the model's configuration
    names no other: the model could never end its turn the way the template continues it. The error names the
    template's text after the turn and the fix, and comes before the weights load (they are missing here)."""
    model, tokenizer = tiny_agent_model()
    tokenizer.eos_token = "<|endoftext|>"  # the template ends a turn with <|im_end|>
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tmp_path / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"ends an assistant turn with none of the tokens generation stops at"):
        GRPOTrainer(
            model=str(path),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none"),
            train_dataset=Dataset.from_list([{"prompt": USER}] * 8),
            tools=[lookup],
        )


def family_model(name: str):
    """A tiny random-weight model and a tokenizer carrying TRL's copy of the chat template `name`, whose
    generation_config stops at the family's stop tokens (as the real checkpoints' do)."""
    tokenizer = build_family_tokenizer(name)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=16,
        num_layers=1,
        eos_token_id=list(tokenizer.stop_token_ids),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return model, tokenizer


def template_result_text(tokenizer, stop_ids) -> str:
    """What the template writes between the call's stop token and the next turn, read off its rendering of the
    real conversation (the real call, its result, the generation prompt): the text after the last stop token
    before the result's content. An independent reading of what `tool_result_ids` computes with a dummy turn."""
    text = chat.render_conversation(tokenizer, [*USER, CALL, RESULT], tokenize=False, add_generation_prompt=True)
    at = text.index(TABLE[KEY])
    stops = [tokenizer.convert_ids_to_tokens(int(t)) for t in stop_ids]
    end = max(text.rfind(stop, 0, at) + len(stop) for stop in stops if text.rfind(stop, 0, at) >= 0)
    return text[end:]


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_two_turn_tool_rollout_on_each_template_trl_ships(name):
    """Every chat template the installed TRL ships that renders tool calls: the call the template itself renders is
    kept verbatim (up to its stop token), the tool result and next header are the template's own (loss mask 0),
    the second turn is sampled on exactly that context (its log-probs are the training forward's)."""
    model, tokenizer = family_model(name)
    stop_ids = tuple(tokenizer.stop_token_ids)
    rollout, completion, call, result = two_turn_rollout(model, tokenizer, {}, stop_ids, max_new_tokens=8)
    ids = rollout.completion_id_lists()[0]
    assert call[-1] in stop_ids and ids[: len(call)] == call
    assert ids[len(call) : len(call) + len(result)] == result
    assert tokenizer.decode(result) == template_result_text(tokenizer, stop_ids)
    second = len(ids) - len(call) - len(result)
    assert second > 0
    assert rollout.loss_mask[0, : len(ids)].tolist() == [1] * len(call) + [0] * len(result) + [1] * second
    assert completion[0]["tool_calls"] == CALL["tool_calls"], completion[0]
    assert completion[1] == RESULT
    assert_sampled_logprobs_match_training(model, rollout)


# One template of each model family TRL ships templates of (the families of test_tool_parsers.FAMILY_OF, by the longest
# matching name prefix): the first by name, so the original before its training copy.
def _prefix(name: str) -> str:
    return max((prefix for prefix in FAMILY_OF if name.startswith(prefix)), key=len)


FAMILY_TEMPLATES = sorted({_prefix(name): name for name in reversed(TOOL_TEMPLATES)}.values())


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_a_grpo_step_trains_on_a_tool_rollout_of_each_family(name, tmp_path):
    """A GRPO step through the trainer on two-turn tool rollouts of each family's template: every completion is a
    call, its result and an answer, the tool metrics count one call each, and the step moves the weights."""
    from datasets import Dataset

    model, tokenizer = family_model(name)
    stop_ids = tuple(tokenizer.stop_token_ids)
    before = {k: v.clone() for k, v in model.named_parameters()}
    lengths = []

    def spread(completions, **kwargs):
        lengths.extend(len(c) for c in completions)
        return [float(i) for i in range(len(completions))]  # a reward spread: every group has an advantage

    call = model_turn(tokenizer, USER, CALL, [lookup], stop_ids=stop_ids, after=[RESULT])
    result = tool_result_ids(tokenizer, [RESULT], {}, stop_ids)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=len(call) + len(result) + 8,
        max_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        max_tool_calling_iterations=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=spread,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": USER}] * 2),
        tools=[lookup],
        rollout_engine=FirstTurnForced(model, call),
    )
    trainer.train()
    assert lengths == [3, 3]  # call, tool result, answer
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in model.named_parameters())
