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
from agents_helpers import TABLE, assert_sampled_logprobs_match_training, lookup, model_turn, tiny_agent_model

from grpokit import GRPOConfig, GRPOTrainer, token_logprobs
from grpokit.agents import Agents, tool_result_ids
from grpokit.rollout import HFEngine, PromptBatch, Rollout, SamplingParams, ScriptedEngine

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
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                self.model,
                torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
                torch.cat([rollout.prompt_mask, rollout.attention_mask], 1),
                rollout.completion_ids.shape[1],
            )
        rollout.sampling_logprobs = logprobs * rollout.attention_mask
        return rollout


def generation_header(tokenizer, kwargs: dict) -> str:
    """What the template adds for the generation prompt (Qwen3: "<|im_start|>assistant\\n", and with thinking off
    the empty think block too)."""
    render = lambda add: tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=add, **kwargs)  # noqa: E731
    with_header, without = render(True), render(False)
    assert with_header.startswith(without)
    return with_header[len(without) :]


def two_turn_rollout(model, tokenizer, kwargs: dict, stop_ids=None):
    """(rollout, completion as reward functions see it, the forced call's ids, the tool result's ids)."""
    call = model_turn(tokenizer, USER, CALL, [lookup], **kwargs)
    agents = Agents(tokenizer, tools=[lookup], max_completion_length=96, chat_template_kwargs=kwargs, stop_ids=stop_ids)
    engine = FirstTurnForced(model, call)
    eos = tuple(stop_ids or (tokenizer.eos_token_id,))
    params = SamplingParams(max_new_tokens=96, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id)
    rollout, completions = agents.rollout(engine, [{"prompt": USER}], params, seed=0)
    return rollout, completions[0], call, tool_result_ids(tokenizer, [RESULT], kwargs, stop_ids)


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


def test_a_grpo_step_trains_on_a_qwen3_tool_rollout(tmp_path):
    from datasets import Dataset

    model, tokenizer = tiny_agent_model(template="qwen3")
    before = {k: v.clone() for k, v in model.named_parameters()}
    calls = []

    def called(completions, **kwargs):
        calls.extend(len(c) for c in completions)
        return [float(i) for i in range(len(completions))]  # a spread, so that every step has an advantage

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=64,
        max_steps=1,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        max_tool_calling_iterations=1,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=called,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": USER}] * 4),
        tools=[lookup],
        rollout_engine=FirstTurnForced(model, model_turn(tokenizer, USER, CALL, [lookup])),
    )
    trainer.train()
    assert calls and all(n >= 3 for n in calls)  # call, tool result, answer
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert changed


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
