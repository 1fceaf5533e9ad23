"""Concurrent engine requests merged into one engine call (grpokit.rollout.batching), as asynchronous generation does
for the turns of multi-turn groups in flight at once, and the flush policies that say which requests go together."""

import asyncio
import threading
import time
from dataclasses import replace

import torch
from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
from datasets import Dataset
from letters import tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.agents.loop import Transcript, add_turn, sample_turns, turn_request
from grpokit.rollout import HFEngine, ScriptedEngine
from grpokit.rollout.batching import SEED_STRIDE, AsyncBatcher, BatchingEngine, Flush, Request
from grpokit.rollout.engine import PromptBatch, SamplingParams


def letter_prompts(tokenizer, letters: str, count: int) -> PromptBatch:
    return PromptBatch(
        ids=[tokenizer(f"{c}:")["input_ids"] for c in letters], counts=[count] * len(letters), raw=list(letters)
    )


def independent_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log π(completion | prompt), token by token, from one plain forward of the whole unpadded sequence."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def merged_requests(engine: BatchingEngine, requests: list[tuple]) -> list:
    """Start every request in a thread of its own while the engine is busy, so that all of them wait; then free it."""
    results = [None] * len(requests)

    def ask(i, prompts, params, seed):
        try:
            results[i] = engine.generate(prompts, params, seed)
        except Exception as error:
            results[i] = error

    with engine.lock:  # busy: as if sampling for someone else
        threads = [threading.Thread(target=ask, args=(i, *r)) for i, r in enumerate(requests)]
        for thread in threads:
            thread.start()
        while len(engine.waiting) < len(requests):
            time.sleep(0.01)
    for thread in threads:
        thread.join(30)
    return results


def test_a_request_alone_gets_exactly_what_the_engine_gives():
    model, tokenizer = tiny_letter_model()
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    prompts = letter_prompts(tokenizer, "abc", 2)
    direct = HFEngine(model).generate(prompts, params, seed=5)
    batching = BatchingEngine(HFEngine(model))
    alone = batching.generate(prompts, params, seed=5)
    assert torch.equal(alone.completion_ids, direct.completion_ids)
    assert torch.equal(alone.sampling_logprobs, direct.sampling_logprobs)
    assert (batching.calls, batching.requests) == (1, 1)


def test_requests_that_wait_together_are_sampled_in_one_call_and_each_gets_its_own_rows():
    """Three requests (prompts of different lengths, max_new_tokens 4, 16 and 9) queued while the engine is busy go
    into one engine call. Each gets its own rows: its prompts, left-padded to its own width; completions within its
    own max_new_tokens, truncated where cut; every recorded log-prob equal to an independent forward of that row's own
    prompt and completion (a row matched to another request's prompt would not be)."""
    model, tokenizer = tiny_letter_model()
    model.eval()
    eos = tokenizer.eos_token_id
    base = SamplingParams(max_new_tokens=16, eos_token_ids=(eos,), pad_token_id=0)
    longer = PromptBatch(ids=[tokenizer("abcabc:")["input_ids"]], counts=[3], raw=["abcabc:"])
    requests = [
        (letter_prompts(tokenizer, "ab", 2), replace(base, max_new_tokens=4), 1),
        (longer, base, 2),
        (letter_prompts(tokenizer, "h", 2), replace(base, max_new_tokens=9), 3),
    ]
    engine = BatchingEngine(HFEngine(model))
    results = merged_requests(engine, requests)
    assert (engine.calls, engine.requests) == (1, 3)
    truncated_by_cut = 0
    for (prompts, params, _), rollout in zip(requests, results):
        assert len(rollout) == prompts.num_rows
        expected_ids, expected_mask = prompts.padded(0)
        assert torch.equal(rollout.prompt_ids, expected_ids) and torch.equal(rollout.prompt_mask, expected_mask)
        assert rollout.completion_ids.shape[1] <= params.max_new_tokens
        for row, completion in enumerate(rollout.completion_id_lists()):
            prompt = prompts.ids[prompts.rows()[row]]
            assert len(completion) == int(rollout.lengths[row]) <= params.max_new_tokens
            ended = completion[-1:] == [eos]
            assert bool(rollout.is_truncated[row]) == (not ended)
            truncated_by_cut += (not ended) and params.max_new_tokens < 16
            torch.testing.assert_close(
                rollout.sampling_logprobs[row, : len(completion)],
                independent_logprobs(model, prompt, completion),
                atol=1e-5,
                rtol=0,
            )
            assert not rollout.sampling_logprobs[row, len(completion) :].any()
    assert truncated_by_cut > 0  # the 4-token request had rows cut at its own limit


def test_requests_with_other_sampling_parameters_wait_for_a_call_of_their_own_and_errors_reach_every_request():
    model, tokenizer = tiny_letter_model()
    params = SamplingParams(max_new_tokens=6, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    hotter = replace(params, temperature=2.0)
    engine = BatchingEngine(HFEngine(model))
    requests = [
        (letter_prompts(tokenizer, "a", 2), params, 0),
        (letter_prompts(tokenizer, "b", 2), hotter, 1),
        (letter_prompts(tokenizer, "c", 2), params, 2),
    ]
    results = merged_requests(engine, requests)
    assert (engine.calls, engine.requests) == (2, 3)  # a and c together, b alone
    assert all(len(r) == 2 for r in results)

    class Failing:
        def generate(self, prompts, params, seed):
            raise RuntimeError("engine broke")

        def sync_weights(self, model):
            pass

    failing = BatchingEngine(Failing())
    results = merged_requests(failing, requests[::2])
    assert [str(r) for r in results] == ["engine broke", "engine broke"]


class SlowEngine:
    """A scripted engine whose every call takes 50 ms whatever its rows (as a decode step reads every weight),
    recording how many rows each call had."""

    logprobs_match_training = False

    def __init__(self, engine):
        self.engine, self.rows = engine, []

    def generate(self, prompts, params, seed):
        time.sleep(0.05)
        self.rows.append(prompts.num_rows)
        return self.engine.generate(prompts, params, seed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)


def test_streamed_groups_share_engine_calls_and_each_group_gets_its_own_turns(tmp_path):
    """Agents under max_staleness=1: up to four groups of two in flight, each turn its own request. Requests that
    arrive while the engine samples go into its next call together (calls with more rows than one group's), and
    every group still gets its own turns: each completion looked up its own key and answered it (reward 1)."""
    model, tokenizer = tiny_agent_model()
    scripted = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )
    engine = SlowEngine(scripted)

    def lookup(key: str) -> str:
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        return TABLE[key]

    def found(completions, key, **kwargs):
        return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]

    rows = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(6)]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=4,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
        max_staleness=1,
        max_inflight_tasks=8,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=found,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 4 and all(r["rewards/found/mean"] == 1.0 for r in steps)
    assert max(engine.rows) > 2, engine.rows  # some call sampled turns of several groups
    assert sum(engine.rows) >= 2 * 2 * 2 * 4  # two turns of every completion trained on (4 steps of 2 groups)
    assert len(engine.rows) < sum(engine.rows) // 2  # fewer calls than one per group's turn


class RecordingEngine:
    """`engine` recording each call's prompts and seed; with `gate`, its first call waits for the gate to open."""

    def __init__(self, engine, gate: threading.Event | None = None):
        self.engine, self.gate = engine, gate
        self.prompts, self.seeds, self.entered = [], [], threading.Event()

    def generate(self, prompts, params, seed):
        self.prompts.append(prompts)
        self.seeds.append(seed)
        self.entered.set()
        if self.gate is not None and len(self.seeds) == 1:
            assert self.gate.wait(30)
        return self.engine.generate(prompts, params, seed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)

    @property
    def rows(self) -> list[int]:
        return [p.num_rows for p in self.prompts]


def test_every_caller_waits_makes_one_engine_call_per_turn_with_the_samples_of_the_synchronous_loop():
    """Three rows (prompts a, a, b) play two turns each as coroutines that reach each turn in a different order (the
    environment's code between them takes longer for row 0 than for row 2). Under EVERY_CALLER_WAITS each turn is one
    engine call of all three rows, in row order, the two equal prompts of the first turn sampled as one prompt twice;
    seeded seed, then seed + SEED_STRIDE. So every token and log-prob is the synchronous loop's (`sample_turns`)."""
    model, tokenizer = tiny_letter_model()
    model.eval()
    params = SamplingParams(max_new_tokens=0, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0)
    prompts = [tokenizer(f"{c}:")["input_ids"] for c in "aab"]
    budgets = (6, 12)  # max_completion_length at each turn: the second turn samples within what the first left

    synchronous = [Transcript(p, {}) for p in prompts]
    for turn, budget in enumerate(budgets):
        sample_turns(HFEngine(model), tokenizer, None, synchronous, [0, 1, 2], params, 7 + SEED_STRIDE * turn, budget)

    engine = RecordingEngine(HFEngine(model))
    batcher = AsyncBatcher(engine, callers=3, seed=7, straggler_wait=60.0)
    batched = [Transcript(p, {}) for p in prompts]

    async def play(row: int):
        for budget in budgets:
            await asyncio.sleep(0.01 * (3 - row))  # the environment's code: row 2 asks first
            rollout = await batcher.generate(turn_request(batched[row], params, budget, caller=row))
            add_turn(tokenizer, None, batched[row], rollout)
        batcher.finished(row)

    async def play_all():
        await asyncio.gather(*(play(row) for row in range(3)))

    asyncio.run(play_all())
    assert engine.rows == [3, 3] and engine.seeds == [7, 7 + SEED_STRIDE]
    assert engine.prompts[0].ids == [prompts[0], prompts[2]] and engine.prompts[0].counts == [2, 1]
    for mine, theirs in zip(batched, synchronous):
        assert mine.ids == theirs.ids and mine.logprobs == theirs.logprobs and mine.truncated == theirs.truncated
    assert any(t.ids for t in batched)


def test_a_straggler_is_left_behind_after_straggler_wait_and_later_sampled_alone():
    """Rows 0 and 1 ask for their second turn at once; row 2's environment takes 0.5 s. After straggler_wait
    (0.05 s) rows 0 and 1 are sampled without it; row 2, alone running when it asks, is sampled at once: calls of
    3, 2 and 1 rows, seeded seed + SEED_STRIDE * k."""
    engine = RecordingEngine(ScriptedEngine(lambda prompt, index: [1, 2]))
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(2,), pad_token_id=0)
    batcher = AsyncBatcher(engine, callers=3, seed=3, straggler_wait=0.05)

    async def play(row: int):
        for turn in range(2):
            if row == 2 and turn == 1:
                await asyncio.sleep(0.5)
            prompts = PromptBatch(ids=[[5 + row, 6 + turn]], counts=[1], raw=[None])
            await batcher.generate(Request(prompts, params, caller=row))
        batcher.finished(row)

    async def play_all():
        await asyncio.gather(*(play(row) for row in range(3)))

    asyncio.run(play_all())
    assert engine.rows == [3, 2, 1]
    assert engine.seeds == [3, 3 + SEED_STRIDE, 3 + 2 * SEED_STRIDE]


def requests_while_busy(flush: Flush) -> RecordingEngine:
    """Request 0 starts an engine call that waits at a gate; requests 1, 2 and 3 arrive, in that order, while it
    waits; then the gate opens."""
    gate = threading.Event()
    engine = RecordingEngine(ScriptedEngine(lambda prompt, index: [1, 2]), gate)
    batching = BatchingEngine(engine, flush=flush)
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(2,), pad_token_id=0)

    def ask(seed: int):
        rollout = batching.generate(PromptBatch(ids=[[5, seed]], counts=[1], raw=[None]), params, seed)
        assert rollout.prompt_ids.tolist() == [[5, seed]] and rollout.completion_id_lists() == [[1, 2]]

    threads = [threading.Thread(target=ask, args=(seed,)) for seed in range(4)]
    threads[0].start()
    assert engine.entered.wait(30)
    for waiting, thread in enumerate(threads[1:], start=1):
        thread.start()
        while len(batching.waiting) < waiting:
            time.sleep(0.01)
    gate.set()
    for thread in threads:
        thread.join(30)
    assert (batching.calls, batching.requests) == (len(engine.seeds), 4)
    return engine


def test_requests_that_arrive_while_the_engine_is_busy_go_into_its_next_call_together():
    engine = requests_while_busy(Flush.ARRIVED_WHILE_BUSY)
    assert engine.rows == [1, 3] and engine.seeds == [0, 1]  # the merged call: its first request's seed
    assert engine.prompts[1].ids == [[5, 1], [5, 2], [5, 3]]


def test_one_at_a_time_answers_each_request_alone_in_the_order_they_came_with_its_own_seed():
    engine = requests_while_busy(Flush.ONE_AT_A_TIME)
    assert engine.rows == [1, 1, 1, 1] and engine.seeds == [0, 1, 2, 3]
