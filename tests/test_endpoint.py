"""The policy endpoint for agent harnesses (grpokit.integrations.endpoint) and the OpenAI-SDK agent adapter: an agent
written with `openai.OpenAI(base_url=...)` trains through it; its sampled tokens are trained with the engine's
log-probs, what it inserts (tool results) is attention-only, its rewards are the logged rewards; a harness that never
calls back or raises is counted and training goes on."""

import itertools
import json
import threading

import pytest
import torch
from agents_helpers import (
    TABLE,
    ForcedCallsEngine,
    assert_sampled_logprobs_match_training,
    call_text,
    key_of,
    lookup,
    tiny_agent_model,
    tool_call_script,
)
from datasets import Dataset
from test_environments import config as environments_config
from transformers.utils import get_json_schema

from grpokit import GRPOTrainer
from grpokit.integrations import EnvironmentAdapter
from grpokit.integrations.endpoint import Call, stitch
from grpokit.integrations.openai_agent import OpenAIAgentEnvironment
from grpokit.rollout import SamplingParams

openai = pytest.importorskip("openai")

LOOKUP_SCHEMA = get_json_schema(lookup)


def config(tmp_path, **overrides):
    return environments_config(tmp_path, **{"max_steps": 1, "max_completion_length": 48, **overrides})


def dataset(*keys):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"key {k}"}], "key": k} for k in keys])


def lookup_agent(rewards: dict):
    """A plain OpenAI-SDK agent: ask with the lookup tool, run the tool calls it gets, ask again; the reward is
    whether the final answer holds the value. rewards[key] collects what it returned."""

    def agent(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"key {row['key']}"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_SCHEMA])
        message = first.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            result = lookup(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        second = client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_SCHEMA])
        reward = float(TABLE[row["key"]] in (second.choices[0].message.content or "")) + 0.25 * len(messages)
        rewards.setdefault(row["key"], []).append(reward)
        return reward

    return agent


def test_an_openai_sdk_agent_trains_on_the_tokens_the_policy_sampled_with_their_logprobs(tmp_path):
    model, tokenizer = tiny_agent_model(seed=1)
    model.eval()
    # The first turn is a forced lookup call (a random model makes none), the second is sampled by the in-process
    # engine (float32) after the tool result.
    engine = ForcedCallsEngine(model, tokenizer, calls=1)
    rewards = {}
    environment = OpenAIAgentEnvironment(lookup_agent(rewards), dataset("k3", "k17", "k5"), timeout=60)
    assert isinstance(environment, EnvironmentAdapter)
    driver = environment.driver(tokenizer, config(tmp_path), None)
    params = SamplingParams(
        max_new_tokens=48, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )
    rows = list(dataset("k3", "k17", "k5"))
    rollout, _ = driver.rollout(engine, rows, params, seed=3, host=None)
    assert rollout.extra["agent_reward"] == [rewards[k][0] for k in ("k3", "k17", "k5")]
    for row in range(3):  # call, tool result, answer: one sequence, the tool result attention-only
        trained = rollout.loss_mask[row][rollout.attention_mask[row].bool()].tolist()
        runs = [trained[0]] + [b for a, b in itertools.pairwise(trained) if a != b]
        assert runs == [1, 0, 1]
        inserted = rollout.completion_ids[row][(rollout.attention_mask[row] == 1) & (rollout.loss_mask[row] == 0)]
        assert f"<tool_response>\n{TABLE[rows[row]['key']]}\n</tool_response>" in tokenizer.decode(inserted)
    assert_sampled_logprobs_match_training(model, rollout)
    assert driver.metrics(type("Accelerator", (), {"device": "cpu", "num_processes": 1})) == {
        "endpoint/timeout_frequency": 0.0,
        "endpoint/error_frequency": 0.0,
        "endpoint/calls_per_rollout": 2.0,
        "endpoint/prefix_break_frequency": 0.0,
    }

    # The same agent trained a step: the logged reward is the mean of what the agents returned.
    rewards.clear()
    trainer = GRPOTrainer(
        model=model,
        args=config(tmp_path, per_device_train_batch_size=4),
        processing_class=tokenizer,
        environment=OpenAIAgentEnvironment(lookup_agent(rewards), dataset("k3", "k17"), timeout=60),
        rollout_engine=engine,
    )
    trainer.train()
    log = trainer.state.log_history[0]
    returned = [r for values in rewards.values() for r in values]
    assert len(returned) == 4
    assert log["reward"] == pytest.approx(sum(returned) / 4)
    assert log["rewards/agent_reward/mean"] == pytest.approx(sum(returned) / 4)
    assert log["endpoint/calls_per_rollout"] == 2.0


def test_harnesses_that_never_call_back_or_raise_are_counted_and_training_goes_on(tmp_path):
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(tokenizer, lambda user, results, index: f"answer {TABLE[key_of(user)]}<|im_end|>")
    release, late = threading.Event(), []

    def agent(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"key {row['key']}"}]
        if row["key"] == "k2":
            raise RuntimeError("the harness crashed")
        if row["key"] == "k3":  # hangs past the timeout, then calls: its rollout is over
            release.wait()
            try:
                client.chat.completions.create(model="policy", messages=messages)
            except openai.NotFoundError as error:
                late.append(error.status_code)
            return 1.0
        reply = client.chat.completions.create(model="policy", messages=messages)
        return float(TABLE[row["key"]] in reply.choices[0].message.content)

    environment = OpenAIAgentEnvironment(agent, dataset("k1", "k2", "k3", "k4"), timeout=3)
    trainer = GRPOTrainer(
        model=model,
        args=config(tmp_path, per_device_train_batch_size=8, num_generations=2),
        processing_class=tokenizer,
        environment=environment,
        rollout_engine=engine,
    )
    with pytest.warns(UserWarning, match="did not return within 3 s"):
        trainer.train()
    release.set()
    log = trainer.state.log_history[0]
    # 8 rollouts: k2's two raised, k3's two timed out (None: not scored), k1's and k4's four answered right.
    assert log["endpoint/error_frequency"] == 0.25 and log["endpoint/timeout_frequency"] == 0.25
    assert log["rewards/agent_reward/mean"] == 1.0
    assert torch.isfinite(torch.tensor(log["loss"]))
    for _ in range(100):
        if len(late) == 2:
            break
        threading.Event().wait(0.05)
    assert late == [404, 404]


def test_a_harness_that_rewrites_its_history_starts_a_new_segment():
    """Calls whose prompt extends the previous prompt + completion join one sequence (the difference
    attention-only); a call that does not starts a new segment, the last one is kept, and the break counted."""
    first = Call([1, 2], [3, 4], [-0.1, -0.2], 0, False)
    second = Call([1, 2, 3, 4, 5], [6], [-0.3], 0, False)
    transcript, breaks = stitch([9], [first, second], max_completion_length=16)
    assert (transcript.prompt_ids, transcript.ids, transcript.trained) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1])
    assert breaks == 0
    assert transcript.logprobs == [-0.1, -0.2, 0.0, -0.3]
    rewritten = Call([1, 7, 5], [8], [-0.4], 1, True)
    transcript, breaks = stitch([9], [first, second, rewritten], max_completion_length=16)
    assert (transcript.prompt_ids, transcript.ids, transcript.truncated, breaks) == ([1, 7, 5], [8], True, 1)
    assert stitch([9], [], max_completion_length=16)[0].prompt_ids == [9]


def post(url, body, headers=None):
    """(status, JSON reply) of a POST with the standard library, as any harness's HTTP client sends it."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_generate_route_speaks_vllms_token_format_and_sessions_come_from_a_header():
    """/inference/v1/generate as verifiers' TrainClient (renderers.client.generate) reads it; the bare routes take the
    session from X-Session-ID; /v1/models gives the card; nothing samples outside `serving`."""
    import urllib.request

    from grpokit.integrations.endpoint import PolicyEndpoint
    from grpokit.rollout import ScriptedEngine

    _, tokenizer = tiny_agent_model()
    endpoint = PolicyEndpoint(tokenizer, max_completion_length=6, model_name="policy", max_model_length=64).start()
    engine = ScriptedEngine(lambda prompt, index: [5, 6, 7, tokenizer.eos_token_id])
    params = SamplingParams(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    try:
        assert post(f"{endpoint.url}/inference/v1/generate", {"token_ids": [1, 2]})[0] == 400  # no session
        with endpoint.serving(engine, params, seed=0, version=3) as window:
            session = endpoint.open_session(0, window)
            request = {"model": "policy", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "logprobs": 1}}
            status, reply = post(f"{endpoint.url}/inference/v1/generate", request, {"X-Session-ID": session})
            assert status == 200 and reply["prompt_token_ids"] == [1, 2]
            (choice,) = reply["choices"]
            assert choice["token_ids"] == [5, 6] and choice["finish_reason"] == "length"  # max_tokens cut it
            assert [c["token"] for c in choice["logprobs"]["content"]] == ["token_id:5", "token_id:6"]
            status, reply = post(
                f"{endpoint.base_url(session).removesuffix('/v1')}/inference/v1/generate",
                {"token_ids": [1, 2, 5, 6, 9]},
            )
            # The session's budget: 6 completion tokens, 3 spent (2 sampled, 1 inserted).
            assert reply["choices"][0]["token_ids"] == [5, 6, 7] and reply["choices"][0]["finish_reason"] == "length"
            assert post(f"{endpoint.url}/s/unknown/v1/chat/completions", {"messages": []})[0] == 404
            with urllib.request.urlopen(f"{endpoint.base_url(session)}/models", timeout=30) as card:
                assert json.loads(card.read())["data"][0] == {
                    "id": "policy",
                    "object": "model",
                    "owned_by": "grpokit",
                    "max_model_len": 64,
                }
            calls = endpoint.close_session(session)
        assert [(c.prompt_ids, c.completion_ids, c.version) for c in calls] == [
            ([1, 2], [5, 6], 3),
            ([1, 2, 5, 6, 9], [5, 6, 7], 3),
        ]
        transcript, breaks = stitch([1], calls, max_completion_length=6)
        assert (transcript.ids, transcript.trained, breaks) == ([5, 6, 9, 5, 6, 7], [1, 1, 0, 1, 1, 1], 0)
    finally:
        endpoint.stop()


class SlowEngine:
    """A scripted engine whose every call takes 50 ms whatever its rows, recording how many rows each call had."""

    logprobs_match_training = False

    def __init__(self, engine):
        self.engine, self.rows = engine, []

    def generate(self, prompts, params, seed):
        threading.Event().wait(0.05)
        self.rows.append(prompts.num_rows)
        return self.engine.generate(prompts, params, seed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)


def test_harnesses_are_streamed_group_by_group_under_max_staleness_and_their_calls_share_engine_calls(tmp_path):
    """max_staleness=1: each group of harnesses is a serving window of its own, several open at once; harness calls
    that arrive while the engine samples go into its next call together (calls of more than one row: each harness
    call is one), and every harness still gets its own answers (reward 1.75: the value found, three messages)."""
    model, tokenizer = tiny_agent_model()
    scripted = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )
    engine, rewards = SlowEngine(scripted), {}
    keys = [f"k{i}" for i in range(6)]
    environment = OpenAIAgentEnvironment(lookup_agent(rewards), dataset(*keys), timeout=60)
    args = config(
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=4,
        max_staleness=1,
        max_inflight_tasks=8,
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, environment=environment, rollout_engine=engine
    )
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 4 and all(r["rewards/agent_reward/mean"] == 1.75 for r in steps)
    assert all(r["sample/staleness_max"] <= 1 for r in steps)
    # Counted as groups end, which is not batch by batch: a record holds the groups that ended since the last one.
    counted = [r["endpoint/calls_per_rollout"] for r in steps if "endpoint/calls_per_rollout" in r]
    assert counted and all(value == 2.0 for value in counted), counted
    assert max(engine.rows) > 2, engine.rows  # harness calls of more than one group in one engine call
    assert len(engine.rows) < sum(engine.rows)
