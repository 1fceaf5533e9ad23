"""Multi-turn agents (grpokit.agents): tool calls parsed from Qwen2.5's real format, tool results inserted as
context without loss, errors returned to the model, TRL's limits and metrics; and through the trainer, the gradient
of a multi-turn transcript against a plain forward of it."""

import time

import pytest
import torch
from agents_helpers import (
    TABLE,
    ForcedCallsEngine,
    assert_sampled_logprobs_match_training,
    call_text,
    dapo_update,
    key_of,
    lookup,
    relative_error,
    tiny_agent_model,
    tool_call_script,
)
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer, group_advantages, token_logprobs
from grpokit.agents import Agents
from grpokit.rollout import SamplingParams

SUFFIX = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


class FakeAccelerator:  # ToolStats.metrics needs only these in one process
    num_processes, device = 1, "cpu"


def rows(*keys):
    return [{"prompt": [{"role": "user", "content": f"key {k}"}]} for k in keys]


def params(tokenizer, max_new_tokens=64):
    return SamplingParams(
        max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )


def agents(tokenizer, tools=(lookup,), **kwargs):
    return Agents(tokenizer, tools=list(tools), **{"max_completion_length": 256, **kwargs})


def look_then_answer(user, results, index):
    return call_text("lookup", {"key": key_of(user)}) if not results else f"answer {results[-1]}<|im_end|>"


def test_a_tool_call_is_run_and_its_result_inserted_as_context_without_loss():
    _, tokenizer = tiny_agent_model()
    runner = agents(tokenizer)
    engine = tool_call_script(tokenizer, look_then_answer)
    rollout, completions = runner.rollout(engine, rows("k3", "k12"), params(tokenizer), seed=0)
    for row, key in enumerate(["k3", "k12"]):
        call, suffix, answer = (
            call_text("lookup", {"key": key}),
            SUFFIX.format(TABLE[key]),
            f"answer {TABLE[key]}<|im_end|>",
        )
        ids = rollout.completion_id_lists()[row]
        assert tokenizer.decode(ids) == call + suffix + answer
        n_call, n_suffix = (len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in (call, suffix))
        expected_mask = [1] * n_call + [0] * n_suffix + [1] * (len(ids) - n_call - n_suffix)
        assert rollout.loss_mask[row, : len(ids)].tolist() == expected_mask
        assert rollout.attention_mask[row].sum() == len(ids) == rollout.lengths[row]
        assert completions[row] == [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}],
            },
            {"role": "tool", "name": "lookup", "content": TABLE[key]},
            {"role": "assistant", "content": f"answer {TABLE[key]}"},
        ]
    assert not rollout.is_truncated.any()
    # The continuation was asked for with the whole transcript as its prompt: prompt + call + tool result.
    second = engine.calls[1]
    assert second.counts == [1, 1]
    assert tokenizer.decode(second.ids[0]).endswith(call_text("lookup", {"key": "k3"}) + SUFFIX.format(TABLE["k3"]))
    assert runner.metrics(FakeAccelerator()) == {
        "tools/call_frequency": 1.0,
        "tools/failure_frequency": 0.0,
        "tools/truncated_frequency": 0.0,
        "tools/lookup/call_frequency": 1.0,
        "tools/lookup/failure_frequency": 0.0,
    }


def broken(key: str) -> str:
    """A tool that always fails.

    Args:
        key: anything
    """
    raise RuntimeError("the database is down")


def slow(key: str) -> str:
    """A tool that takes too long.

    Args:
        key: anything
    """
    time.sleep(1.5)
    return "late"


async def async_lookup(key: str) -> str:
    """Look up a value, asynchronously.

    Args:
        key: the key to look up
    """
    return TABLE[key]


def test_tool_errors_timeouts_bad_arguments_and_unknown_tools_go_back_to_the_model_and_are_counted():
    _, tokenizer = tiny_agent_model()
    runner = agents(tokenizer, tools=(lookup, broken, slow, async_lookup), tool_timeout=0.3)
    first_turns = {
        "k1": call_text("broken", {"key": "k1"}),
        "k2": call_text("slow", {"key": "k2"}),
        "k3": call_text("lookup", {"kee": "k3"}),  # an argument the tool does not take
        "k4": call_text("search", {"key": "k4"}),  # no such tool
        "k5": call_text("async_lookup", {"key": "k5"}),
        "k6": call_text("lookup", '{"name": "lookup", "arguments": {"key": '),  # malformed: plain text, ends the row
    }
    engine = tool_call_script(
        tokenizer, lambda user, results, index: first_turns[key_of(user)] if not results else "answer<|im_end|>"
    )
    started = time.perf_counter()
    _rollout, completions = runner.rollout(engine, rows(*first_turns), params(tokenizer), seed=0)
    assert time.perf_counter() - started < 1.4  # the slow tool was not waited for
    results = {key: c[1]["content"] if len(c) > 1 else None for key, c in zip(first_turns, completions)}
    assert results == {
        "k1": "{'error': 'the database is down'}",
        "k2": "{'error': \"Tool 'slow' timed out after 0.3 s.\"}",
        "k3": "{'error': \"Bad arguments for 'lookup': missing a required argument: 'key'.\"}",
        "k4": "{'error': \"Tool 'search' not found; available tools: ['async_lookup', 'broken', 'lookup', 'slow'].\"}",
        "k5": TABLE["k5"],
        "k6": None,
    }
    assert len(completions[5]) == 1 and completions[5][0]["content"].startswith("<tool_call>")
    assert [len(c) for c in completions] == [3, 3, 3, 3, 3, 1]  # each erring row went on to answer
    metrics = runner.metrics(FakeAccelerator())
    assert metrics["tools/call_frequency"] == pytest.approx(5 / 6)
    assert metrics["tools/failure_frequency"] == pytest.approx(4 / 5)
    assert metrics["tools/broken/failure_frequency"] == 1.0 and metrics["tools/async_lookup/failure_frequency"] == 0.0


def test_max_tool_calling_iterations_and_the_completion_budget_end_a_row():
    _, tokenizer = tiny_agent_model()
    always_call = lambda user, results, index: call_text("lookup", {"key": key_of(user)})  # noqa: E731
    runner = agents(tokenizer, max_tool_calling_iterations=2)
    rollout, completions = runner.rollout(tool_call_script(tokenizer, always_call), rows("k3"), params(tokenizer), 0)
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "tool_calls" in completions[0][-1] and not rollout.is_truncated[0]  # ended by EOS, call not run
    # A budget that holds a call but not its result: the result is dropped and the row ends after the call.
    call_length = len(tokenizer(call_text("lookup", {"key": "k3"}), add_special_tokens=False)["input_ids"])
    runner = agents(tokenizer, max_completion_length=call_length + 5)
    rollout, completions = runner.rollout(
        tool_call_script(tokenizer, always_call), rows("k3"), params(tokenizer, call_length + 5), 0
    )
    assert len(completions[0]) == 1 and rollout.lengths[0] == call_length and rollout.loss_mask.all()
    assert runner.metrics(FakeAccelerator())["tools/call_frequency"] == 1.0  # run, then dropped (as TRL does)
    # The turn after a tool result is cut at what is left of the budget, and is then truncated.
    suffix_length = len(tokenizer(SUFFIX.format(TABLE["k3"]), add_special_tokens=False)["input_ids"])
    budget = call_length + suffix_length + 3
    runner = agents(tokenizer, max_completion_length=budget)
    rollout, completions = runner.rollout(
        tool_call_script(tokenizer, look_then_answer), rows("k3"), params(tokenizer, budget), 0
    )
    assert rollout.lengths[0] == budget and rollout.is_truncated[0] and rollout.loss_mask[0, -3:].tolist() == [1] * 3


def test_a_tokenizer_that_cannot_do_tools_and_a_tool_without_a_schema_are_refused(tmp_path):
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    char_tokenizer = build_char_tokenizer()
    model = build_tiny_model(len(char_tokenizer), hidden_size=16)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=1)
    data = Dataset.from_list(rows("k1", "k2"))
    with pytest.raises(ValueError, match="cannot render a tool-calling conversation"):
        GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=data,
            processing_class=char_tokenizer,
            tools=[lookup],
        )

    def no_docs(key: str) -> str:
        return key

    with pytest.raises(ValueError, match="tool 'no_docs' has no usable JSON schema"):
        GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            args=args,
            train_dataset=data,
            processing_class=char_tokenizer,
            tools=[no_docs],
        )


# ------------------------------------------------------------------------ log-probs and gradients across turns


def test_sampling_logprobs_of_every_policy_turn_equal_the_training_forward_of_the_whole_transcript():
    model, tokenizer = tiny_agent_model(seed=1)
    model.eval()
    runner = agents(tokenizer, max_completion_length=64)
    engine = ForcedCallsEngine(model, tokenizer, calls=2)
    rollout, completions = runner.rollout(engine, rows("k3", "k3", "k17", "k5"), params(tokenizer, 64), seed=3)
    assert all([m["role"] for m in c[:4]] == ["assistant", "tool"] * 2 for c in completions)
    training = assert_sampled_logprobs_match_training(model, rollout)
    sampled_after_tools = rollout.loss_mask.bool()
    for row in range(len(rollout)):  # the engine-sampled turn: after the last tool result
        last_tool = (rollout.loss_mask[row] == 0).nonzero().max()
        sampled_after_tools[row, : last_tool + 1] = False
    assert sampled_after_tools.sum() >= 8
    # The test can fail: the same tokens scored without the tool results in context differ.
    row = 0
    keep = rollout.attention_mask[row].bool() & rollout.loss_mask[row].bool()
    ids = torch.cat([rollout.prompt_ids[row][rollout.prompt_mask[row].bool()], rollout.completion_ids[row][keep]])
    with torch.no_grad():
        without, _ = token_logprobs(model, ids[None], torch.ones_like(ids)[None], int(keep.sum()))
    assert (without[0] - training[row][keep]).abs().max() > 1e-3


def test_tool_result_tokens_get_no_loss_and_no_gradient_but_stay_in_context(tmp_path):
    """One trainer step on scripted two-turn transcripts (call, result, answer). With AdamW at a huge epsilon the
    update is -lr·g/(|g| + eps), so the trainer's gradient is read off the weights and compared with autograd of
    a plain forward of the whole transcript with the DAPO loss over the policy's tokens only."""
    model, tokenizer = tiny_agent_model()
    answers = {0: "answer {}<|im_end|>", 1: "value<|im_end|>"}
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            call_text("lookup", {"key": key_of(user)}) if not results else answers[index % 2].format(results[-1])
        ),
    )
    seen = []

    def answered(completions, **kwargs):
        seen.extend(completions)
        return [float(c[-1]["content"].startswith("answer")) for c in completions]

    lr, eps = 1e6, 1e6
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        learning_rate=lr,
        adam_epsilon=eps,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        loss_type="dapo",
        max_completion_length=64,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    data = Dataset.from_list(rows("k3", "k12"))
    reference_model, _ = tiny_agent_model()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=answered,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    initial = {k: v.detach().clone() for k, v in trainer.unwrapped_model.named_parameters()}
    # The plain computation: the rendered prompt, then call + tool result + answer, as one sequence per row.
    transcripts, masks = [], []
    for key in ("k3", "k12"):
        prompt = tokenizer.apply_chat_template(
            rows(key)[0]["prompt"], tools=[lookup], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for j in range(2):
            parts = [
                (call_text("lookup", {"key": key}), 1),
                (SUFFIX.format(TABLE[key]), 0),
                (answers[j].format(TABLE[key]), 1),
            ]
            ids, mask = list(prompt), [0] * len(prompt)
            for text, trained in parts:
                part = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids, mask = ids + part, mask + [trained] * len(part)
            transcripts.append(ids)
            masks.append(mask)
    width = max(map(len, transcripts))
    input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in transcripts])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in transcripts])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 2)

    def expected_update(mask):
        return dapo_update(reference_model, input_ids, attention, mask, advantages, lr, eps)

    expected = expected_update(loss_mask)
    trainer.train()
    update = {k: v.detach() - initial[k] for k, v in trainer.unwrapped_model.named_parameters()}

    assert relative_error(update, expected) < 1e-3
    # The test can fail: training on the tool results too would be another update.
    tool_tokens_too = (attention[:, 1:] * (loss_mask.sum(1, keepdim=True) > 0)).float()
    prompt_length = (
        len(transcripts[0])
        - sum(masks[0])
        - len(tokenizer(SUFFIX.format(TABLE["k3"]), add_special_tokens=False)["input_ids"])
    )
    tool_tokens_too[:, : prompt_length - 1] = 0
    assert relative_error(expected_update(tool_tokens_too), expected) > 0.1
    assert [c[-1]["content"] for c in seen[:2]] == [f"answer {TABLE['k3']}", "value"]
    log = trainer.state.log_history[0]
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    # Lengths count the model's tokens only (call + answer), as TRL's: the tool results are not the model's.
    assert log["completions/mean_length"] == pytest.approx(sum(map(sum, masks)) / len(masks))


def test_the_python_tool_runs_model_code_in_the_sandbox():
    from transformers.utils import get_json_schema

    from grpokit.agents import python_tool
    from grpokit.rewards.code import SandboxLimits

    tool = python_tool(SandboxLimits(cpu_seconds=1, wall_seconds=3.0))
    assert get_json_schema(tool)["function"]["name"] == "python"
    assert tool("print(6 * 7)") == "42\n"
    failed = tool("import sys\nprint('partial')\nraise ValueError('boom')")
    assert "partial" in failed and "ValueError: boom" in failed and "the program failed" in failed
    assert "the program failed, or was stopped" in tool("while True:\n    pass")
    assert "Permission denied" in tool("open('/root/x', 'w')") or "Read-only" in tool("open('/usr/x', 'w')")


def test_completions_log_and_report_show_whole_transcripts(tmp_path):
    from grpokit.report import load_run, write_report

    model, tokenizer = tiny_agent_model()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=64,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        log_completions=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list(rows("k3", "k12")),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=tool_call_script(tokenizer, look_then_answer),
    )
    trainer.train()
    sample = load_run(tmp_path).completions[0]
    key = key_of(sample["prompt"][0]["content"])
    assert sample["completion"][1] == {"role": "tool", "name": "lookup", "content": TABLE[key]}
    page = write_report([tmp_path], tmp_path / "report").read_text()
    assert f"→ lookup({{&quot;key&quot;: &quot;{key}&quot;}})" in page and f"tool (lookup): {TABLE[key]}" in page


def test_per_turn_rewards_become_token_advantages_turn_by_turn(tmp_path):
    """A process reward function scores each policy turn (its `turn_ends` column gives the turns); the advantages
    are grpokit's process advantages with the turn ends as step ends: a token is credited with the normalised
    rewards of its turn and of the turns after it, tool results included in the span of the turn they follow."""
    from grpokit import process_advantages
    from grpokit.rewards.process import process_reward

    model, tokenizer = tiny_agent_model()
    answers = ["answer {}<|im_end|>", "value<|im_end|>"]
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            call_text("lookup", {"key": key_of(user)}) if not results else answers[index % 2].format(results[-1])
        ),
    )
    seen = {}

    @process_reward
    def per_turn(completions, turn_ends, **kwargs):
        seen["turn_ends"] = [list(e) for e in turn_ends]
        return [[1.0, float(c[-1]["content"].startswith("answer"))] for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=64,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=per_turn,
        args=args,
        train_dataset=Dataset.from_list(rows("k3")),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    batch = trainer.generate_batch()
    call_length = len(tokenizer(call_text("lookup", {"key": "k3"}), add_special_tokens=False)["input_ids"])
    suffix_length = len(tokenizer(SUFFIX.format(TABLE["k3"]), add_special_tokens=False)["input_ids"])
    lengths = [
        call_length + suffix_length + len(tokenizer(a.format(TABLE["k3"]), add_special_tokens=False)["input_ids"])
        for a in answers
    ] * 2
    assert seen["turn_ends"] == [[call_length, n] for n in lengths]
    width = batch.completion_ids.shape[1]
    expected = process_advantages([[1.0, 1.0], [1.0, 0.0]] * 2, seen["turn_ends"], 2, width)
    for row in range(len(batch)):  # rows come shuffled: match each by its length
        length = int(batch.lengths[row])
        reference = expected[lengths.index(length)]
        torch.testing.assert_close(batch.advantages[row, :length], reference[:length], rtol=0, atol=1e-6)
    # Not a constant: the first turn and the answer are credited differently.
    assert batch.advantages[:, 0].abs().max() > 0 and (batch.advantages[:, 0] != batch.advantages[:, call_length]).any()


LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]


@pytest.mark.parametrize("family", ["qwen2_5", "llama3_1"])
def test_tool_calls_parse_as_trl_parses_them(family):
    """grpokit's parsing and tool-result rendering against TRL 1.16's own helpers (its shipped copies of the public
    Qwen2.5 and Llama 3.1 chat templates, and its response templates), on the same token ids."""
    trl_utils = pytest.importorskip("trl.chat_template_utils")
    from grpokit.agents import check_tool_calling, parse_completion, tool_result_ids
    from grpokit.testing import build_chat_tokenizer, build_qwen_chat_tokenizer

    if family == "qwen2_5":
        tokenizer = build_qwen_chat_tokenizer(("lookup", "key"))
        calls = [
            call_text("lookup", {"key": "k3"}),
            call_text("lookup", {"key": "k3"})[:-10] + "<|im_end|>",
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "k3"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "lookup", "arguments": {"key": "k4"}}\n</tool_call><|im_end|>',
            "the answer is v3<|im_end|>",
            "<think>\nhm\n</think>\n\nv3<|im_end|>",
        ]
    else:
        tokenizer = build_chat_tokenizer(
            trl_utils.llama3_1_chat_template,
            LLAMA3_SPECIAL_TOKENS,
            eos_token="<|eot_id|>",
            pad_token="<|finetune_right_pad_id|>",
            words=("lookup", "key"),
        )
        calls = [
            '{"name": "lookup", "parameters": {"key": "k3"}}<|eot_id|>',
            "the answer is v3<|eot_id|>",
            '{"name": "lookup", "parameters": {"key": <|eot_id|>',
        ]
    assert trl_utils.supports_tool_calling(tokenizer)
    template = check_tool_calling(tokenizer)
    reference = trl_utils.add_response_schema(
        build_qwen_chat_tokenizer(("lookup", "key")) if family == "qwen2_5" else tokenizer
    )
    prompt = tokenizer.apply_chat_template(
        rows("k3")[0]["prompt"], tools=[lookup], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    for text in calls:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = parse_completion(tokenizer, template, ids, prompt, [lookup])
        theirs = trl_utils.parse_response(reference, ids, prefix=prompt, tools=[lookup])
        assert ours == theirs, text
    assert "tool_calls" in parse_completion(
        tokenizer, template, tokenizer(calls[0], add_special_tokens=False)["input_ids"], prompt, [lookup]
    )
    # The tool result's tokens: what TRL's _get_tool_suffix_ids computes (the chat template's rendering).
    result = [{"role": "tool", "name": "lookup", "content": "v64"}]
    expected = (
        SUFFIX.format("v64")
        if family == "qwen2_5"
        else '<|start_header_id|>ipython<|end_header_id|>\n\n"v64"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    )
    # (Llama 3.1's template writes a string result as JSON: "v64".)
    assert tokenizer.decode(tool_result_ids(tokenizer, result, {})) == expected
