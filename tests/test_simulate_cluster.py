"""grpokit.simulate: the real scheduler (producer.Producer) on a virtual clock reproduces cases computed by hand."""

import threading
import time

import pytest

from grpokit.simulate import Costs, VirtualClock, Workload, simulate

# 4 prompts × 4 completions of exactly 96 tokens after 3 prompt tokens: 16 × 99 = 1584 tokens a batch.
FIXED = Workload(
    prompts=4, num_generations=4, prompt_tokens=3, completion_median=96, completion_sigma=0, max_completion_length=96
)
# Sampling a batch: 96 decode steps of 1/192 s = 0.5 s. Training it: 1584 tokens × 0.2/1584 s + 0.1 s = 0.3 s.
GENERATION_BOUND = Costs(decode_step_s=1 / 192, decode_token_s=0.0, train_token_s=0.2 / 1584, train_step_s=0.1)
# Sampling 0.25 s (96 × 1/384), training 0.5 s.
TRAINING_BOUND = Costs(decode_step_s=1 / 384, decode_token_s=0.0, train_token_s=0.5 / 1584)


def test_the_clock_moves_only_when_every_thread_is_blocked_and_then_to_the_next_wake_up():
    clock, woke_at = VirtualClock(), []
    clock.spawn()  # this thread
    clock.spawn()  # the other, before it starts

    def other():
        clock.sleep(2.0)
        woke_at.append(clock.now)
        clock.sleep(100.0)  # blocked again (a thread that ended would count as running)

    thread = threading.Thread(target=other)
    thread.start()
    time.sleep(0.2)  # real time, this thread running: simulated time stays put while the other sleeps
    assert clock.now == 0.0 and woke_at == []
    clock.sleep(1.0)  # both blocked: time jumps to the earlier wake-up, this one
    assert clock.now == 1.0 and woke_at == []
    clock.sleep(5.0)  # the other wakes at 2 and sleeps again; this one wakes at 6
    assert woke_at == [2.0] and clock.now == 6.0
    clock.close()  # every sleep ends
    thread.join(timeout=10)
    assert not thread.is_alive() and clock.now == 6.0
    with pytest.raises(ValueError):
        clock.sleep(-1.0)


@pytest.mark.parametrize("max_staleness", [None, 0])
def test_at_max_staleness_0_a_run_takes_the_sum_of_its_generation_and_training(max_staleness):
    result = simulate(FIXED, GENERATION_BOUND, steps=20, max_staleness=max_staleness)
    assert result.time_s == pytest.approx(20 * (0.5 + 0.3), abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([0.5] * 20, abs=1e-9)
    assert result.trainer_idle_fraction == pytest.approx(0.5 / 0.8, abs=1e-9)
    assert result.staleness == [0] * 20
    assert result.tokens == 20 * 1584


def test_at_max_staleness_0_long_tailed_batches_add_up_one_by_one():
    # Every batch's lengths differ; each batch costs 0.01 s a decode step of its longest completion, 1 ms a token
    # decoded and 2 ms a token trained, one after the other.
    workload = Workload(
        prompts=3,
        num_generations=2,
        prompt_tokens=5,
        completion_median=40,
        completion_sigma=1.0,
        max_completion_length=300,
        seed=7,
    )
    costs = Costs(decode_step_s=0.01, decode_token_s=0.001, train_token_s=0.002)
    expected = 0.0
    for n in range(12):
        lengths = workload.completion_lengths(workload.draws(n), 6)
        expected += 0.01 * max(lengths) + 0.001 * sum(lengths) + 0.002 * (sum(lengths) + 5 * 6)
        assert len(set(lengths)) > 1 and max(lengths) <= 300
    result = simulate(workload, costs, steps=12, max_staleness=0)
    assert result.time_s == pytest.approx(expected, rel=1e-12)


def test_replayed_lengths_are_sampled_and_trained_batch_by_batch():
    # A measured run's lengths, replayed in order (and again from the start past the last): at max_staleness=0 each
    # batch costs 0.01 s a decode step of its longest row, 1 ms a row a step, and 2 ms a token trained, plus 0.05 s
    # a call and 0.1 s a step (prompts of 3 tokens: 0.05 / 6 s a prefill token over a call's 2 rows).
    batches = ((5, 1), (2, 2), (9, 3))
    workload = Workload(
        prompts=1,
        num_generations=2,
        prompt_tokens=3,
        completion_median=0,
        completion_sigma=0,
        max_completion_length=9,
        replayed=batches,
    )
    costs = Costs(
        decode_step_s=0.01, decode_token_s=0.001, prefill_token_s=0.05 / 6, train_token_s=0.002, train_step_s=0.1
    )
    result = simulate(workload, costs, steps=4, max_staleness=0)
    expected = [0.05 + 0.01 * max(b) + 0.001 * sum(b) + 0.1 + 0.002 * (sum(b) + 6) for b in (*batches, batches[0])]
    assert result.time_s == pytest.approx(sum(expected), rel=1e-12)
    assert result.tokens == sum(sum(b) + 6 for b in (*batches, batches[0]))


@pytest.mark.parametrize("schedule", ["exact", "latest"])
def test_when_generation_is_slower_the_trainer_idles_1_minus_train_over_generate(schedule):
    result = simulate(FIXED, GENERATION_BOUND, steps=20, max_staleness=1, schedule=schedule)
    # Batches end every 0.5 s; the last one trains 0.3 s more. The trainer waits 0.5 s for the first, then
    # 0.5 - 0.3 = 0.2 s for each of the others: in a long run, 1 - 0.3/0.5 = 40% of the time.
    assert result.time_s == pytest.approx(20 * 0.5 + 0.3, abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([0.5] + [0.2] * 19, abs=1e-9)
    assert result.trainer_idle_fraction == pytest.approx((0.5 + 19 * 0.2) / 10.3, abs=1e-9)
    assert sum(result.trainer_wait_s[1:]) / sum(result.step_time_s[1:]) == pytest.approx(1 - 0.3 / 0.5, abs=1e-9)


def test_when_training_is_slower_the_trainer_waits_only_for_the_first_batch():
    result = simulate(FIXED, TRAINING_BOUND, steps=20, max_staleness=1)
    assert result.time_s == pytest.approx(0.25 + 20 * 0.5, abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([0.25] + [0.0] * 19, abs=1e-9)
    # benchmarks/async_overlap.py's figure: the mean of the steps' wait fractions (the first waits all its time).
    assert result.rollout_wait_fraction_mean == pytest.approx(1 / 20, abs=1e-9)


@pytest.mark.parametrize("schedule", ["exact", "latest"])
@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_staleness_never_exceeds_the_bound_and_the_exact_schedule_reaches_it(max_staleness, schedule):
    workload = Workload(
        prompts=4,
        num_generations=4,
        prompt_tokens=8,
        completion_median=60,
        completion_sigma=0.8,
        max_completion_length=400,
        seed=3,
    )
    costs = Costs(decode_step_s=0.004, decode_token_s=0.0005, train_token_s=0.0002, servers=2)
    result = simulate(workload, costs, steps=16, max_staleness=max_staleness, schedule=schedule)
    assert max(result.staleness) <= max_staleness and result.dropped_samples == 0
    if schedule == "exact":  # batch n is sampled by version max(0, n - k): exactly that stale
        assert result.staleness == [min(n, max_staleness) for n in range(16)]
    # With k >= 1 the run is never slower than the synchronous one, and exactly as fast when k does not matter.
    assert result.time_s <= simulate(workload, costs, steps=16, max_staleness=None).time_s


def test_a_batch_takes_its_slowest_servers_share():
    lengths = [10, 20, 30, 5, 7, 7, 1, 100]  # four groups of two
    costs = Costs(decode_step_s=0.01, decode_token_s=0.001, train_token_s=0.0, prefill_token_s=0.0001)
    # One server: 8 × 10 prompt tokens, 100 steps, 180 tokens.
    assert costs.generation_s(10, lengths, 2) == pytest.approx(0.008 + 1.0 + 0.180, abs=1e-12)
    # Two servers: groups 1-2 (longest 30, 65 tokens) and 3-4 (longest 100, 115 tokens): the second sets the time.
    costs.servers = 2
    assert costs.generation_s(10, lengths, 2) == pytest.approx(0.004 + 1.0 + 0.115, abs=1e-12)
    # Three: groups 1-2, 3, 4; four or more: one group each, the last alone.
    costs.servers = 3
    assert costs.generation_s(10, lengths, 2) == pytest.approx(0.002 + 1.0 + 0.101, abs=1e-12)
    costs.servers = 8
    assert costs.generation_s(10, lengths, 2) == pytest.approx(0.002 + 1.0 + 0.101, abs=1e-12)


def test_a_weight_push_is_paid_once_per_new_version_of_the_sampling_weights():
    costs = Costs(
        decode_step_s=1 / 192, decode_token_s=0.0, train_token_s=0.2 / 1584, train_step_s=0.1, weight_sync_s=0.05
    )
    # Synchronous: every batch is sampled by new weights.
    assert simulate(FIXED, costs, steps=10, max_staleness=0).time_s == pytest.approx(10 * 0.85, abs=1e-9)
    # max_staleness=2, exact: batches 0-2 share version 0 (one push); each later batch has new weights. Sampling,
    # the slower side, then takes 0.55 s a batch but the first two: 0.55 + 0.5 + 0.5 + 7 × 0.55, and the last trains.
    result = simulate(FIXED, costs, steps=10, max_staleness=2)
    assert result.time_s == pytest.approx(0.55 + 2 * 0.5 + 7 * 0.55 + 0.3, abs=1e-9)


# Agents: 4 prompts × 2 completions a batch, each completion with one tool call of exactly 1 s (a group's two run at
# once: 1 s); the turns cost nothing on the engine. Training a batch takes 0.5 s.
AGENT = Workload(
    prompts=4,
    num_generations=2,
    prompt_tokens=10,
    completion_median=2,
    completion_sigma=0,
    max_completion_length=2,
    tool_calls=1,
    tool_latency_median_s=1.0,
)
FREE_ENGINE = Costs(decode_step_s=0.0, decode_token_s=0.0, train_token_s=0.0, train_step_s=0.5)


def test_synchronously_an_agents_tool_calls_run_at_once():
    # grpokit's agent loop calls the batch's 8 tools at once (TRL's, one after another: 8 s): 1 s, then 0.5 s of
    # training.
    result = simulate(AGENT, FREE_ENGINE, steps=5, max_staleness=None)
    assert result.time_s == pytest.approx(5 * 1.5, abs=1e-9)


def test_streamed_groups_run_their_tool_calls_at_once_within_the_bound():
    # max_staleness=1: 4 groups in flight (max_inflight_tasks -1: one generation batch). Each batch's groups run
    # together, 1 s; the next batch's start when this one's end (no free slot before): sampling, 1 s a batch, is the
    # slower side, and the last batch trains 0.5 s more.
    result = simulate(AGENT, FREE_ENGINE, steps=6, max_staleness=1)
    assert result.time_s == pytest.approx(6 * 1.0 + 0.5, abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([1.0] + [0.5] * 5, abs=1e-9)
    assert result.staleness == [0, 1, 1, 1, 1, 1] and result.drop_rate == 0
    # max_staleness=2: 8 groups in flight. Batches 0 and 1 end at 1 s; batch n >= 2 starts when the trainer reaches
    # version n - 2, so sampling keeps ahead and training (0.5 s a batch) sets the pace.
    result = simulate(AGENT, FREE_ENGINE, steps=6, max_staleness=2)
    assert result.time_s == pytest.approx(1.0 + 6 * 0.5, abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([1.0] + [0.0] * 5, abs=1e-9)
    assert max(result.staleness) == 2


def test_long_tailed_tools_make_groups_too_stale_and_the_producer_drops_them():
    workload = Workload(
        prompts=8,
        num_generations=4,
        prompt_tokens=100,
        completion_median=300,
        completion_sigma=0.8,
        max_completion_length=2000,
        tool_calls=2,
        tool_latency_median_s=0.5,
        tool_latency_sigma=1.0,
        tool_result_tokens=50,
    )
    costs = Costs(
        decode_step_s=0.005,
        decode_token_s=0.0002,
        prefill_token_s=1e-5,
        train_token_s=1e-4,
        servers=2,
        weight_sync_s=0.2,
    )
    synchronous = simulate(workload, costs, steps=20, max_staleness=None)
    for k in (1, 2):
        result = simulate(workload, costs, steps=20, max_staleness=k)
        assert max(result.staleness) <= k
        assert result.dropped_samples > 0 and result.trained_samples == 20 * 32
        # The synchronous loop runs a batch's calls at once too: streaming adds the overlap with training, and
        # other batches' groups while a slow call holds one (0.76× the synchronous time at k=1, 0.53× at k=2).
        assert result.time_s < synchronous.time_s * (0.85 if k == 1 else 0.65)


def test_simulated_hours_never_trip_the_schedulers_heartbeat():
    # Tool calls of 1,000 simulated seconds, far past heartbeat_stale_after_s (300 s): the heartbeat runs on real time,
    # in which the whole run is short, so the producer is never taken for hung.
    workload = Workload(
        prompts=4,
        num_generations=2,
        prompt_tokens=10,
        completion_median=2,
        completion_sigma=0,
        max_completion_length=2,
        tool_calls=1,
        tool_latency_median_s=1000.0,
    )
    started = time.monotonic()
    result = simulate(workload, FREE_ENGINE, steps=3, max_staleness=1)
    assert result.time_s == pytest.approx(3 * 1000.0 + 0.5, abs=1e-6)  # each batch's groups: 1,000 s calls at once
    assert time.monotonic() - started < 60


def test_a_streamed_weight_push_holds_back_the_groups_that_sample_with_the_new_weights():
    costs = Costs(decode_step_s=0.0, decode_token_s=0.0, train_token_s=0.0, train_step_s=0.5, weight_sync_s=0.1)
    result = simulate(AGENT, costs, steps=4, max_staleness=1)
    # Batch 0: the first push (0.1 s), then its groups (1 s). Batch 1 still samples with version 0 (one step stale):
    # its groups run 1.1-2.1 s. Batch 2 samples with version 1, pushed when batch 1's first group ends (2.1 s), and
    # the producer's loop starts groups before it assembles the finished ones: batch 1 reaches the trainer after the
    # push, at 2.2 s, and batch 2's groups run 2.2-3.2 s. Likewise batch 2 at 3.3 s and batch 3 at 4.4 s, trained
    # until 4.9 s: after the first batch the trainer waits 1 - 0.5 + 0.1 s a step.
    assert result.time_s == pytest.approx(4.9, abs=1e-9)
    assert result.trainer_wait_s == pytest.approx([1.1, 0.6, 0.6, 0.6], abs=1e-9)
