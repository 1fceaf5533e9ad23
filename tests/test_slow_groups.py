"""Slow groups never hold the schedule (issue 59): the completions of one generation call their tools at once, a
streamed group that can no longer be trained within max_staleness is abandoned at once (its place goes to the next
group), and a hung engine or tool call is named within twice the heartbeat."""

import asyncio
import hashlib
import threading
import time

import pytest
from agents_helpers import TABLE, ForcedCallsEngine, call_text, key_of, tiny_agent_model, tool_call_script
from datasets import Dataset
from test_async_streaming import streaming_config  # the same streamed-groups run

from grpokit import GRPOTrainer
from grpokit.agents import Agents
from grpokit.rollout import SamplingParams
from grpokit.state import TrainerCallback

ROWS = [{"prompt": [{"role": "user", "content": f"key k{i}"}]} for i in range(6)]


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up
    """
    return TABLE[key]


def answer_after_lookup(tokenizer):
    return tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )


def repeat_found(completions, key, **kwargs):
    return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]


def sampling(tokenizer, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )


def prompts(*keys) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"key {k}"}]} for k in keys]


# ---------------------------------------------------------------------------- the tool calls of one generation


def wait_sync(key: str) -> str:
    """Wait a second, then look up a key.

    Args:
        key: the key to look up
    """
    time.sleep(1.0)
    return TABLE[key]


async def wait_async(key: str) -> str:
    """Wait a second without blocking, then look up a key.

    Args:
        key: the key to look up
    """
    await asyncio.sleep(1.0)
    return TABLE[key]


def test_the_tool_calls_of_one_generation_run_at_once():
    """A group of two completions, each calling a tool that takes 1 s, and another group of two calling an async one:
    the four calls run at once (about 1 s; one after another they took 4 s), and each row gets its own result."""
    _, tokenizer = tiny_agent_model()
    tool_of = {"k1": "wait_sync", "k2": "wait_async"}
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text(tool_of[key_of(user)], {"key": key_of(user)})
        ),
    )
    agents = Agents(tokenizer, tools=[wait_sync, wait_async], max_completion_length=64, tool_timeout=10)
    started = time.perf_counter()
    _, completions = agents.rollout(engine, prompts("k1", "k1", "k2", "k2"), sampling(tokenizer, 64), seed=0)
    elapsed = time.perf_counter() - started
    assert 1.0 <= elapsed < 1.8, elapsed
    assert [c[1]["content"] for c in completions] == [TABLE["k1"]] * 2 + [TABLE["k2"]] * 2
    assert [c[-1]["content"] for c in completions] == [TABLE["k1"]] * 2 + [TABLE["k2"]] * 2


DELAYS = {"k1": 0.2, "k2": 0.15, "k3": 0.0, "k4": 0.05}  # the rows' calls end in another order than the rows'


def delayed_lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up
    """
    time.sleep(DELAYS[key])
    return TABLE[key]


delayed_lookup.__name__ = "lookup"  # the name ForcedCallsEngine calls


def test_concurrent_tool_calls_leave_the_transcripts_of_a_seeded_rollout_as_they_were():
    """Two forced lookups per row (their results of different lengths), then turns the tiny model samples, on six
    rows whose calls end in an order other than the rows': token ids and log-probs are those the sequential loop
    gave (recorded from it: the ids' digest and each row's log-prob sum)."""
    model, tokenizer = tiny_agent_model()
    rows = prompts("k1", "k1", "k2", "k3", "k4", "k4")
    agents = Agents(tokenizer, tools=[delayed_lookup], max_completion_length=56)
    rollout, _ = agents.rollout(ForcedCallsEngine(model, tokenizer, calls=2), rows, sampling(tokenizer, 56), seed=3)
    ids = rollout.completion_id_lists()
    assert [len(x) for x in ids] == [56] * 6 and int(rollout.loss_mask.sum()) == 6 * (2 * 9 + 6)
    assert hashlib.sha256(str(ids).encode()).hexdigest()[:16] == "51655f6bc8dba64f"
    sums = rollout.sampling_logprobs.double().sum(1).tolist()
    recorded = [-126.229572, -125.980593, -126.933164, -126.15484, -126.12299, -126.143262]
    assert sums == pytest.approx(recorded, abs=2e-5)


# ---------------------------------------------------------------------------- streamed groups after drops


class StepClock(TrainerCallback):
    """When each optimizer step ended (time.monotonic())."""

    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.monotonic())


def streamed_lookup_trainer(tmp_path, prompts: int, max_steps: int, tool, callback) -> GRPOTrainer:
    """Streamed tool groups (`streaming_config`) on `prompts` lookup prompts, the scripted policy that calls `tool`
    once and answers, and `callback` watching the steps."""
    rows = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(prompts)]
    model, tokenizer = tiny_agent_model()
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=streaming_config(tmp_path, max_steps=max_steps),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[tool],
        rollout_engine=answer_after_lookup(tokenizer),
        callbacks=[callback],
    )


def test_slow_groups_never_hold_the_gaps_between_steps(tmp_path):
    """Every third prompt's tool call takes 3 s. Its group starts at some version and can be trained at most one
    version later; the fast groups fill two batches long before the call ends, so the slow group is abandoned then
    and the next group takes its place: after the first steps the trainer never waits for samples, and the gap
    between two optimizer steps is the step's own training time (each gap minus the time it waited) plus a margin,
    far below the slow call."""
    slow = {f"k{i}" for i in range(0, 100, 3)}

    def lookup(key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        if key in slow:
            time.sleep(3.0)
        return TABLE[key]

    clock = StepClock()
    trainer = streamed_lookup_trainer(tmp_path, 100, 8, lookup, clock)
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 8 and steps[-1]["sample/dropped_stale_total"] > 0  # slow groups were dropped
    gaps = [later - earlier for earlier, later in zip(clock.ends, clock.ends[1:])]
    waits = [r["perf/rollout_wait_s"] for r in steps[1:]]
    training = [gap - wait for gap, wait in zip(gaps, waits)]
    # A group's two slow calls one after the other (6 s), or a group too stale keeping its place until its calls end
    # (3 s), made gaps of seconds every few steps. Now the trainer waits at most the producer's own work (scoring and
    # assembling a batch: 0.1-0.4 s on a loaded 2-core machine). A step's own time (the gap less the wait for its
    # batch) varies with the machine's load, and is not what this checks.
    for step, (gap, own) in enumerate(zip(gaps[2:], training[2:]), start=4):
        assert gap <= own + 1.0, (step, gaps, training)


class SlowTrainer(TrainerCallback):
    """Each optimizer step from the second on is followed by `pause` seconds of sleep (a slow trainer: the streamed
    groups a version may start are soon all done); records the producer thread's CPU time across those pauses."""

    def __init__(self, pause: float):
        self.pause, self.trainer, self.cpu, self.slept = pause, None, [], 0.0

    def on_step_end(self, args, state, control, **kwargs):
        producer_thread = self.trainer.producer.thread
        self.cpu.append(time.clock_gettime(time.pthread_getcpuclockid(producer_thread.ident)))
        if state.global_step < args.max_steps:
            time.sleep(self.pause)
            self.slept += self.pause


def test_a_producer_with_no_group_to_start_waits_without_using_the_cpu(tmp_path):
    """Streamed groups may run one version ahead; the trainer then sleeps 1 s after each step, so the producer soon
    has finished every group it may start and none in flight. It waits for the trainer's next version: its thread uses
    next to no CPU across those seconds (scoring and assembling a batch of the tiny model takes milliseconds). It used
    to poll for finished groups in a loop that returned at once when none was running, a core's worth of Python
    holding the GIL the trainer's own steps wait for (streamed tool groups trained at a third of the synchronous
    loop's speed: benchmarks/async_overlap.py --tool-delay)."""
    slow = SlowTrainer(pause=1.0)
    trainer = streamed_lookup_trainer(tmp_path, 40, 4, lookup, slow)
    slow.trainer = trainer
    trainer.train()
    assert len(slow.cpu) >= 3 and slow.slept >= 2.0, (slow.cpu, slow.slept)
    spent = slow.cpu[-1] - slow.cpu[0]
    assert spent < 0.1 * slow.slept, (spent, slow.slept)


# ---------------------------------------------------------------------------- hangs, named within twice the heartbeat


class HangingEngine:
    """A scripted tool-calling policy whose `hang_at`-th call blocks until `release` is set (at most 40 s);
    `hung_at` is when it began."""

    def __init__(self, engine, hang_at: int):
        self.engine, self.hang_at = engine, hang_at
        self.logprobs_match_training = engine.logprobs_match_training
        self.calls, self.hung_at, self.release = 0, None, threading.Event()

    def generate(self, prompts, params, seed):
        self.calls += 1
        if self.calls == self.hang_at:
            self.hung_at = time.monotonic()
            self.release.wait(40)
        return self.engine.generate(prompts, params, seed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)


def test_a_hung_engine_call_is_named_within_twice_the_heartbeat(tmp_path):
    """heartbeat_stale_after_s=3: the TimeoutError reaches the caller, naming the engine call, within 6 s of the
    hang's start (before: 3-4 s to find it, then up to 5 s waiting for the hung call while the producer closed, and 1 s
    more for its groups)."""
    model, tokenizer = tiny_agent_model()
    engine = HangingEngine(answer_after_lookup(tokenizer), hang_at=3)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=streaming_config(tmp_path, max_steps=6, heartbeat_stale_after_s=3, max_inflight_tasks=4),
        train_dataset=Dataset.from_list([{**row, "key": key_of(row["prompt"][0]["content"])} for row in ROWS]),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    try:
        with pytest.raises(TimeoutError, match=r"hung in an engine call \(running for [3-9]\.\d s\)"):
            trainer.train()
        stopped = time.monotonic()
    finally:
        engine.release.set()
    assert engine.hung_at is not None and stopped - engine.hung_at < 2 * 3, stopped - engine.hung_at


def test_a_hung_tool_call_is_named_within_twice_the_heartbeat(tmp_path):
    """Every group's tool call hangs: the TimeoutError names the tool, with how long its oldest call has run."""
    hang, first_call = threading.Event(), []

    def lookup(key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        first_call.append(time.monotonic())
        hang.wait(40)
        return TABLE[key]

    model, tokenizer = tiny_agent_model()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=streaming_config(tmp_path, max_steps=4, heartbeat_stale_after_s=3),
        train_dataset=Dataset.from_list([{**row, "key": key_of(row["prompt"][0]["content"])} for row in ROWS]),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=answer_after_lookup(tokenizer),
    )
    try:
        with pytest.raises(TimeoutError, match=r"hung in \d+ tool calls: 'lookup' \(running for [3-9]\.\d s\)"):
            trainer.train()
        stopped = time.monotonic()
    finally:
        hang.set()
    assert stopped - first_call[0] < 2 * 3, stopped - first_call[0]


# ---------------------------------------------------------------------------- an abandoned group


class Shelf:
    """An environment whose `read` takes 2 s for key k1 and no time for the others."""

    def reset(self, **row):
        self.key = row["key"]

    def read(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: the key to read
        """
        if self.key == "k1":
            time.sleep(2.0)
        return TABLE[self.key]

    def get_reward(self) -> float:
        return 1.0


def test_an_abandoned_rollout_stops_during_its_tool_calls_and_gives_its_environments_back():
    """Two rows of a group in their tool calls (k1's takes 2 s); the group is abandoned 0.3 s in: the rollout stops at
    once with Abandoned, k2's instance goes back to the pool, k1's (its call still running, left to its timeout) is
    retired and let go, and nothing stays lent."""
    from grpokit.agents.environments import EnvironmentPool
    from grpokit.rollout.batching import Abandoned, BatchingEngine

    _, tokenizer = tiny_agent_model()
    script = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("read", {"key": key_of(user)})
        ),
    )
    pool = EnvironmentPool(Shelf)
    agents = Agents(tokenizer, environments=pool, max_completion_length=64, tool_timeout=10)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    rows = [{**row, "key": key} for row, key in zip(prompts("k1", "k2"), ("k1", "k2"))]
    started = time.perf_counter()
    with pytest.raises(Abandoned, match="during its tool calls"):
        agents.rollout(BatchingEngine(script).caller(stop), rows, sampling(tokenizer, 64), seed=0)
    assert time.perf_counter() - started < 1.2
    assert not pool.lent
    kept = [environment.key for environment in pool.pool[None]]
    assert kept == ["k2"]  # the probe instance is not pooled; k1's instance was retired
    assert not pool.retired  # let go with its rollout, which is never scored


def test_an_abandoned_callers_waiting_request_leaves_the_engine_queue():
    """One caller's call holds the engine; another's request waits behind it through its view (`caller(stop)`).
    The waiting caller is abandoned: it raises Abandoned at once, its request is never sampled, and the engine's next
    call takes only a third caller's request."""
    from grpokit.rollout import ScriptedEngine
    from grpokit.rollout.batching import Abandoned, BatchingEngine
    from grpokit.rollout.engine import PromptBatch

    release, asked = threading.Event(), []

    def script(prompt_ids, index):
        asked.append(prompt_ids[0])
        if prompt_ids[0] == 1:
            release.wait(10)
        return [7, 0]

    engine = BatchingEngine(ScriptedEngine(script))
    params = SamplingParams(max_new_tokens=2, eos_token_ids=(0,), pad_token_id=0)
    batch = lambda token: PromptBatch(ids=[[token]], counts=[1], raw=[None])  # noqa: E731
    first = threading.Thread(target=engine.generate, args=(batch(1), params, 0))
    first.start()
    while engine.busy_since is None:
        time.sleep(0.01)
    stop, raised = threading.Event(), []

    def abandoned_caller():
        try:
            engine.caller(stop).generate(batch(2), params, 0)
        except Abandoned as error:
            raised.append((time.monotonic(), error))

    second = threading.Thread(target=abandoned_caller)
    second.start()
    time.sleep(0.2)
    assert len(engine.waiting) == 1
    stop.set()
    stopped = time.monotonic()
    second.join(timeout=2)
    assert raised and raised[0][0] - stopped < 0.5 and len(engine.waiting) == 0
    third = threading.Thread(target=engine.generate, args=(batch(3), params, 0))
    third.start()
    release.set()
    first.join(timeout=5)
    third.join(timeout=5)
    assert asked == [1, 3] and engine.calls == 2
