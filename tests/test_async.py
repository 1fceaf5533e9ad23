"""Asynchronous generation (grpokit.producer, `max_staleness`): at staleness 0 it is the synchronous loop bitwise; the
staleness bound holds on every trained batch; stale batches are dropped and counted; a failing or hung producer
stops the run with a message and leaves a checkpoint a resumed run continues from; with staleness 1 the letter task
learns as the synchronous loop does."""

import threading
import time

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model
from test_pinned import CPU, PINNED_BY_CPU, digest, run

from grpokit import GRPOConfig, GRPOTrainer, TrainBatch
from grpokit.experience import Experience
from grpokit.producer import Produced, Producer, WeightSync
from grpokit.rollout import HFEngine


def weights(trainer) -> str:
    return digest(dict(trainer.unwrapped_model.state_dict()))


@pytest.mark.parametrize("case", ["on_policy", "lora"])
def test_staleness_zero_is_the_synchronous_loop_bitwise(tmp_path, case):
    overrides = dict(peft=True, learning_rate=5e-2) if case == "lora" else {}
    trainer, asynchronous = run(tmp_path / "async", max_staleness=0, **overrides)
    pinned = PINNED_BY_CPU.get(CPU, {}).get(case)
    if pinned is not None:  # test_pinned holds the synchronous loop's same run to this digest: not run again here
        assert asynchronous == pinned
    else:
        _, synchronous = run(tmp_path / "sync", **overrides)
        assert asynchronous == synchronous
    steps = [r for r in trainer.state.log_history if "sample/staleness_max" in r]
    assert len(steps) == 3 and all(
        r["sample/staleness_max"] == 0 and r["sample/dropped_stale_total"] == 0 for r in steps
    )


@pytest.mark.parametrize("schedule", ["exact", "latest"])
def test_the_staleness_bound_holds_on_every_trained_batch(tmp_path, schedule):
    trainer, _ = run(tmp_path, max_staleness=1, weight_sync_steps=2, max_steps=6, async_schedule=schedule)
    staleness = [r["sample/staleness_max"] for r in trainer.state.log_history if "sample/staleness_max" in r]
    assert len(staleness) == 6 and max(staleness) <= 1
    assert 1 in staleness  # it ran ahead: some batch was sampled by the weights one step before those it trained
    assert trainer.state.log_history[-2]["sample/dropped_stale_total"] == 0  # the schedule keeps every batch fresh
    assert trainer.state.rollouts == 6 and trainer.producer is None  # six batches taken; the producer stopped


def batch_of(rows: int) -> TrainBatch:
    zeros = torch.zeros(rows, 2, dtype=torch.long)
    return TrainBatch(zeros, zeros + 1, zeros, zeros + 1, zeros + 1, torch.full((rows,), 2), torch.zeros(rows, 2))


def test_batches_past_the_bound_are_dropped_and_counted():
    args = GRPOConfig(max_staleness=1, per_device_train_batch_size=4, num_generations=2, report_to="none")
    model = torch.nn.Linear(2, 2)
    producer = Producer(args, None, model, torch.nn.Linear(2, 2), WeightSync(), None, 0)
    for version, rows in ((0, 4), (1, 4), (3, 4)):  # queued as a producer that lagged would have queued them
        producer.queue.put(Produced(Experience(batch_of(rows), {}, None, 10, 1), version, version, {}, 0.0))
    producer.thread.is_alive = lambda: True  # never started: the queue above is all it has
    taken, metrics = producer.take(3)  # versions 0 and 1 are 3 and 2 steps behind: dropped
    assert taken.version == 3 and metrics["sample/dropped_stale_total"] == 8 and metrics["sample/staleness_max"] == 0
    assert producer.dropped_batches == 2


class FlakyEngine:
    """The in-process engine over whatever model it is synced with, failing (or hanging) at one call."""

    logprobs_match_training = True

    def __init__(self, fail_at: int | None = None, hang: bool = False):
        self.fail_at, self.hang, self.calls, self.engine = fail_at, hang, 0, None

    def sync_weights(self, model):
        if self.engine is None or self.engine.model is not model:
            self.engine = HFEngine(model, torch.device("cpu"), logprobs_match_training=True)

    def generate(self, prompts, params, seed):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.hang:
                threading.Event().wait(15)
            raise ConnectionError("the engine went away")
        return self.engine.generate(prompts, params, seed)


def flaky_trainer(tmp_path, engine, eval_dataset=None, **overrides):
    model, tokenizer = tiny_letter_model()
    values = dict(
        per_device_train_batch_size=16,
        num_generations=4,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        max_staleness=0,
        report_to="none",
        beta=0.04,
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=letter_config(tmp_path, **{**values, **overrides}),
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=engine,
        eval_dataset=eval_dataset,
    )


@pytest.mark.parametrize("schedule", ["exact", "latest"])
def test_a_failing_producer_stops_the_run_and_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, schedule):
    uninterrupted = flaky_trainer(tmp_path / "whole", FlakyEngine(), async_schedule=schedule)
    uninterrupted.train()
    broken = flaky_trainer(tmp_path / "broken", FlakyEngine(fail_at=3), async_schedule=schedule)
    with pytest.raises(RuntimeError, match="The generation producer failed: ConnectionError: the engine went away"):
        broken.train()
    assert sorted(p.name for p in (tmp_path / "broken" / "out").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    resumed = flaky_trainer(tmp_path / "broken", FlakyEngine(), async_schedule=schedule)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and weights(resumed) == weights(uninterrupted)


def test_a_hung_producer_is_detected_within_the_heartbeat(tmp_path):
    trainer = flaky_trainer(tmp_path, FlakyEngine(fail_at=2, hang=True), heartbeat_stale_after_s=1.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"heartbeat_stale_after_s=1.0"):
        trainer.train()
    assert time.monotonic() - started < 20
    assert (tmp_path / "out" / "checkpoint-1").is_dir()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_iterations=2), "one optimizer step per generation batch"),
        (dict(steps_per_generation=2), "one optimizer step per generation batch"),
        (dict(max_staleness=2, sync_ref_model=True), "sync_ref_model"),
    ],
)
def test_what_asynchronous_generation_does_not_support_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(NotImplementedError, match=message):
        flaky_trainer(tmp_path, FlakyEngine(), **{"max_staleness": 1, **overrides})
    with pytest.raises(ValueError, match="max_staleness=-1"):
        GRPOConfig(max_staleness=-1, report_to="none")


class CountingEngine(HFEngine):
    """An HFEngine subclass that overrides generate."""

    calls = 0

    def generate(self, prompts, params, seed):
        self.calls += 1
        return super().generate(prompts, params, seed)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_an_hf_engine_subclass_the_producer_would_replace_is_refused_by_name(tmp_path, max_staleness):
    model, tokenizer = tiny_letter_model()
    engine = CountingEngine(model)
    build = dict(reward_funcs=repeat_letter, train_dataset=letter_dataset(), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"CountingEngine, a subclass of HFEngine.*holds an HFEngine"):
        GRPOTrainer(model, args=letter_config(tmp_path, max_staleness=max_staleness), rollout_engine=engine, **build)
    # HFEngine itself (the default, rebuilt over the copy) and a subclass without max_staleness are taken
    GRPOTrainer(model, args=letter_config(tmp_path, max_staleness=1), rollout_engine=HFEngine(model), **build)
    trainer = GRPOTrainer(model, args=letter_config(tmp_path, max_steps=1), rollout_engine=engine, **build)
    trainer.train()
    assert engine.calls == 1  # the subclass sampled the run's one batch


@pytest.mark.parametrize("layout", [dict(sharded=True), dict(deepspeed=3)], ids=["fsdp2", "zero3"])
def test_sharded_models_are_refused_only_where_they_cannot_run(layout):
    """ZeRO-1/2, ZeRO-3 and FSDP2 run (tests/test_async_distributed.py), but a sharded model (FSDP2, ZeRO-3) not
    with what needs its forwards in the producer (a sharded reference) or timing (the latest schedule)."""
    from grpokit.checks import check_async

    args = GRPOConfig(max_staleness=1, report_to="none")
    check_async(args, num_processes=2, deepspeed=2)
    check_async(args, num_processes=2, **layout)
    with pytest.raises(NotImplementedError, match="async_schedule='latest' with a sharded model"):
        check_async(GRPOConfig(max_staleness=1, async_schedule="latest", report_to="none"), num_processes=1, **layout)
    with_reference = GRPOConfig(max_staleness=1, beta=0.04, report_to="none")
    with pytest.raises(NotImplementedError, match="the reference model is sharded too"):
        check_async(with_reference, num_processes=2, **layout)
    check_async(with_reference, num_processes=2, lora=True, **layout)  # LoRA's reference: the adapter off
    check_async(with_reference, num_processes=2, deepspeed=2)  # ZeRO-2: the reference is whole on every process


@pytest.mark.parametrize(
    "overrides, shared_engine, message",
    [
        (dict(async_schedule="latest"), False, "async_schedule='latest' with several training processes"),
        (dict(use_vllm=True, vllm_mode="colocate"), True, "vllm_mode='colocate' and several training processes"),
        (dict(eval_strategy="steps"), True, "the run could hang. Set eval_strategy='no'"),
    ],
)
def test_what_several_processes_cannot_do_asynchronously_is_refused_by_name(overrides, shared_engine, message):
    from grpokit.checks import check_async

    args = GRPOConfig(max_staleness=1, report_to="none", **overrides)
    with pytest.raises(NotImplementedError, match=message):
        check_async(args, num_processes=2, shared_engine=shared_engine)
    check_async(args, num_processes=1, shared_engine=shared_engine)  # one process: each is supported
    check_async(GRPOConfig(max_staleness=1, report_to="none"), num_processes=2, shared_engine=True)  # the rest runs


def test_dynamic_sampling_at_staleness_zero_is_the_synchronous_loop_bitwise_and_fills_batches_ahead(tmp_path):
    _, synchronous = run(tmp_path / "sync", dynamic_sampling=True, max_steps=4)
    _, asynchronous = run(tmp_path / "async", dynamic_sampling=True, max_steps=4, max_staleness=0)
    assert asynchronous == synchronous
    trainer, ahead = run(tmp_path / "ahead", dynamic_sampling=True, max_steps=4, max_staleness=1)
    _, ahead_again = run(tmp_path / "again", dynamic_sampling=True, max_steps=4, max_staleness=1)
    assert ahead == ahead_again  # the exact schedule: the rounds each batch drew never depend on timing
    steps = [r for r in trainer.state.log_history if "dynamic_sampling/rounds" in r]
    assert len(steps) == 4 and [r["sample/staleness_max"] for r in steps] == [0, 1, 1, 1]
    # The producer drew more prompts for batches short of groups with reward spread: the seeds follow the rounds.
    assert trainer.state.rollouts == 4 + sum(r["dynamic_sampling/rounds"] for r in steps)


def test_an_iterable_dataset_at_staleness_zero_is_the_synchronous_loop_bitwise_and_resumes_exactly_at_one(tmp_path):
    from datasets import IterableDataset

    rows = list(letter_dataset())

    def stream():
        return IterableDataset.from_generator(lambda: iter(rows))

    def trainer_for(directory, **overrides):
        model, tokenizer = tiny_letter_model()
        values = dict(
            per_device_train_batch_size=16,
            num_generations=4,
            max_steps=4,
            report_to="none",
            accelerator_config={"dispatch_batches": False},
            save_strategy="steps",
            save_steps=2,
        )
        return GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            train_dataset=stream(),
            processing_class=tokenizer,
            args=letter_config(directory, **{**values, **overrides}),
        )

    synchronous, asynchronous = trainer_for(tmp_path / "sync"), trainer_for(tmp_path / "k0", max_staleness=0)
    synchronous.train()
    asynchronous.train()
    assert weights(asynchronous) == weights(synchronous)
    whole = trainer_for(tmp_path / "k1", max_staleness=1)
    whole.train()
    assert weights(whole) != weights(synchronous)  # sampled ahead: another run
    resumed = trainer_for(tmp_path / "k1", max_staleness=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "k1" / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4 and weights(resumed) == weights(whole)


def test_with_staleness_one_the_letter_task_learns_as_the_synchronous_loop_does(tmp_path):
    """Same seeds, same config; the 8-step moving average of the reward: the asynchronous run ends as high (within
    0.05) and first reaches 0.6 in no more optimizer steps."""
    curves = {}
    for name, overrides in (("sync", {}), ("async", {"max_staleness": 1})):
        model, tokenizer = tiny_letter_model()
        args = letter_config(tmp_path / name, max_steps=80, report_to="none", **overrides)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            args=args,
            train_dataset=letter_dataset(),
            processing_class=tokenizer,
        )
        trainer.train()
        rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
        curves[name] = [sum(rewards[i - 8 : i]) / 8 for i in range(8, len(rewards) + 1)]
    assert curves["sync"][0] < 0.2 and curves["sync"][-1] > 0.6, curves  # learned from chance (1/8)
    assert curves["async"][-1] >= curves["sync"][-1] - 0.05, curves
    reached = {name: next(i for i, r in enumerate(curve) if r >= 0.6) for name, curve in curves.items()}
    assert reached["async"] <= reached["sync"], reached


class RecordingEngine(FlakyEngine):
    """The in-process engine over whatever model it is synced with, recording each call: the thread that made it,
    the model it sampled with, and how many calls were running at once."""

    def __init__(self):
        super().__init__()
        self.active, self.most_active, self.sampled, self.count_lock = 0, 0, [], threading.Lock()

    def generate(self, prompts, params, seed):
        with self.count_lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.sampled.append((threading.current_thread().name, self.engine.model))
        try:
            time.sleep(0.02)  # room for another call to overlap, if anything lets it
            return self.engine.generate(prompts, params, seed)
        finally:
            with self.count_lock:
                self.active -= 1


def test_evaluation_leases_the_producers_engine(tmp_path):
    """Item 4: under max_staleness the producer and evaluate() share a user's engine. Evaluation leases it: no two
    calls overlap, the producer's calls sample its copy of the policy and evaluation's the trained weights, also
    right after an evaluation moved the engine to them."""
    engine = RecordingEngine()
    trainer = flaky_trainer(
        tmp_path,
        engine,
        max_staleness=1,
        max_steps=6,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=1,
        num_generations_eval=4,
        per_device_eval_batch_size=16,
        eval_dataset=letter_dataset(1),
    )
    trainer.train()
    live = trainer.unwrapped_model
    producer = [model for thread, model in engine.sampled if thread == "grpokit-producer"]
    evaluation = [model for thread, model in engine.sampled if thread != "grpokit-producer"]
    assert len(producer) >= 6 and len(evaluation) >= 6
    assert engine.most_active == 1
    assert all(model is not live for model in producer) and all(model is live for model in evaluation)
