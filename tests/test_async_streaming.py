"""Asynchronous generation for agents and on the CPU: multi-turn rollouts streamed group by group
(grpokit.streaming), so that a hanging tool call holds back its own group and not the others; and the in-process
engine in a process of its own (grpokit.rollout.process_engine), whose death stops the run with a message and leaves
a checkpoint a resumed run continues from."""

import os
import signal
import threading
import time

import pytest
import torch
from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
from agents_helpers import lookup as agents_lookup
from datasets import Dataset
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rollout.process_engine import EngineProcessDied
from grpokit.state import TrainerCallback

RELEASE = threading.Event()
ROWS = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(6)]  # k0 first


def streaming_config(tmp_path, **overrides) -> GRPOConfig:
    """Batches of two groups of two, prompts in order, up to four groups in flight one version ahead."""
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=3,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=0,
        shuffle_dataset=False,
        max_staleness=1,
        max_inflight_tasks=8,
        tool_timeout=60,
    )
    return GRPOConfig(**{**values, **overrides})


def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up
    """
    if key == "k0":  # hangs until the test lets it go
        RELEASE.wait(60)
    return TABLE[key]


class ReleaseAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            RELEASE.set()


def test_a_hanging_tool_call_holds_back_its_own_group_not_the_batch(tmp_path):
    """Six prompts, k0 first; its tool call hangs until step 2 ends. Batches of two groups are made of the groups
    that finish first, so steps 1 and 2 train on the other prompts while k0's group waits; released, it lands in
    step 3's batch, two versions after it started: past max_staleness=1, so it is dropped and counted."""
    RELEASE.clear()
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )
    scored = []

    def found(completions, key, **kwargs):
        scored.append(list(key))
        return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]

    args = streaming_config(tmp_path)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=found,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
        callbacks=[ReleaseAt(2)],
    )
    try:
        trainer.train()
    finally:
        RELEASE.set()
    assert len(scored) >= 3
    assert all("k0" not in keys for keys in scored[:2]), scored  # steps 1 and 2 did not wait for k0's group
    trained = [k for keys in scored[:2] for k in keys]  # four whole groups of k1..k5, in the order they finished
    assert len(set(trained)) == 4 and set(trained) <= {"k1", "k2", "k3", "k4", "k5"}
    assert all(trained.count(k) == 2 for k in trained)
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 3 and steps[-1]["sample/dropped_stale_total"] == 2  # k0's two completions
    assert all(r["sample/staleness_max"] <= 1 for r in steps)
    assert all(r["rewards/found/mean"] == 1.0 for r in steps)  # every trained group looked its key up


def test_groups_in_flight_when_a_checkpoint_is_written_are_sampled_again_after_resume(tmp_path):
    """The checkpoint of step 1 records k0 (in flight, hung) as requeued: a resumed run draws it first."""
    RELEASE.clear()
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )
    values = {"max_steps": 1, "save_strategy": "steps", "save_steps": 1}
    reward = lambda completions, **kwargs: [0.0] * len(completions)  # noqa: E731
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=streaming_config(tmp_path, **values),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    try:
        trainer.train()
    finally:
        RELEASE.set()
    scored = []

    def recording(completions, key, **kwargs):
        scored.append(list(key))
        return [0.0] * len(completions)

    resumed = GRPOTrainer(
        model=tiny_agent_model()[0],
        reward_funcs=recording,
        args=streaming_config(tmp_path, **{**values, "max_steps": 2, "max_staleness": None}),
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    # Step 1 trained two of k1..k4 (the first two groups to finish); step 2 starts with k0, then what was in flight.
    assert scored[0][:2] == ["k0", "k0"], scored


class KillEngineAt(TrainerCallback):
    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(self.trainer.producer.engine.pid, signal.SIGKILL)


def test_a_killed_engine_process_stops_the_run_with_a_message_and_the_checkpoint_resumes(tmp_path):
    def trainer_for(directory, **overrides):
        model, tokenizer = tiny_letter_model()
        args = letter_config(
            directory,
            per_device_train_batch_size=16,
            num_generations=4,
            max_steps=4,
            save_strategy="steps",
            save_steps=1,
            max_staleness=1,
            report_to="none",
            **overrides,
        )
        return GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            args=args,
            train_dataset=letter_dataset(),
            processing_class=tokenizer,
        )

    trainer = trainer_for(tmp_path)
    trainer.add_callback(KillEngineAt(trainer, 2))
    with pytest.raises(
        RuntimeError,
        match=r"The generation producer failed: EngineProcessDied: The engine process "
        r"\(pid \d+\) killed by SIGKILL",
    ) as raised:
        trainer.train()
    assert isinstance(raised.value.__cause__, EngineProcessDied)
    checkpoints = sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*"))
    assert checkpoints[:2] == ["checkpoint-1", "checkpoint-2"] and not list((tmp_path / "out").glob(".tmp-*"))
    resumed = trainer_for(tmp_path)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 4 and resumed.producer is None
    steps = [r for r in resumed.state.log_history if "loss" in r]
    assert [r["step"] for r in steps][-2:] == [3, 4] and all(r["sample/staleness_max"] <= 1 for r in steps)


class Locker:
    """An environment whose tool reads the key its rollout was reset with; k0's read hangs until released. A
    rollout scores 1 when the value it read is its own row's: an instance shared by two rollouts in flight would be
    reset by the second, and the first would read the other's value."""

    built = 0

    def __init__(self):
        Locker.built += 1
        self.key, self.read_value = None, None

    def reset(self, **row):
        self.key, self.read_value = row["key"], None

    def read(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: the key to read
        """
        if self.key == "k0":
            RELEASE.wait(60)
        self.read_value = TABLE[self.key]
        return self.read_value

    def get_reward(self) -> float:
        return float(self.read_value == TABLE[self.key])


def test_environments_are_streamed_too_each_rollout_with_its_own_instance(tmp_path):
    RELEASE.clear()
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("read", {"key": key_of(user)})
        ),
    )
    args = streaming_config(tmp_path)
    Locker.built = 0
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        environment_factory=Locker,
        rollout_engine=engine,
        callbacks=[ReleaseAt(2)],
    )
    try:
        trainer.train()
    finally:
        RELEASE.set()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 3 and all(r["rewards/Locker/mean"] == 1.0 for r in steps)  # no instance shared
    assert steps[-1]["sample/dropped_stale_total"] == 2  # k0's group, released after step 2, too stale
    # Up to 8 rollouts in flight at once, each with its own instance, given back when scored and lent again.
    assert 8 <= Locker.built <= 12


# ------------------------------------------------------------------- hangs, shutdown and version labels (second pass)


class HangingEngine:
    """A user engine (a scripted tool-calling policy) whose `hang_at`-th call blocks until `release` is set (at
    most `limit` s); `hung_at` is when it began."""

    def __init__(self, engine, hang_at: int, limit: float = 40.0):
        self.engine, self.hang_at, self.limit = engine, hang_at, limit
        self.logprobs_match_training = engine.logprobs_match_training
        self.calls, self.hung_at, self.release = 0, None, threading.Event()

    def generate(self, prompts, params, seed):
        self.calls += 1
        if self.calls == self.hang_at:
            self.hung_at = time.monotonic()
            self.release.wait(self.limit)
        return self.engine.generate(prompts, params, seed)

    def sync_weights(self, model):
        self.engine.sync_weights(model)


def answer_after_lookup(tokenizer):
    return tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )


def test_a_hung_engine_call_stops_the_run_within_the_heartbeat_not_when_the_call_returns(tmp_path):
    """Item 1: the producer must never hold the trainer's step lock while it waits for the engine. An engine call
    that hangs (40 s) with heartbeat_stale_after_s=3: the TimeoutError reaches the caller a few seconds after the
    hang began, and train()'s cleanup does not wait for the call."""
    model, tokenizer = tiny_agent_model()
    engine = HangingEngine(answer_after_lookup(tokenizer), hang_at=3)
    args = streaming_config(tmp_path, max_steps=6, heartbeat_stale_after_s=3, max_inflight_tasks=4)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=args,
        train_dataset=Dataset.from_list(ROWS * 4),
        processing_class=tokenizer,
        tools=[agents_lookup],
        rollout_engine=engine,
    )
    try:
        with pytest.raises(TimeoutError, match="no progress for"):
            trainer.train()
        stopped = time.monotonic()
    finally:
        engine.release.set()
    # heartbeat 3 s, then train()'s cleanup: the producer's thread (5 s at most), the engine's lock (5 s at most)
    assert engine.hung_at is not None and stopped - engine.hung_at < 20, stopped - engine.hung_at


def test_a_pool_of_hung_groups_is_reported_within_the_heartbeat(tmp_path):
    """Item 2: the heartbeat beats on progress (an engine call returned, a group finished or started, a batch
    queued), not on every tick of the producer's loop: every group hung in its tool call is reported."""
    hang = threading.Event()

    def lookup(key: str) -> str:  # the scripted policy calls `lookup`; this one never answers in time
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        hang.wait(40)
        return TABLE[key]

    model, tokenizer = tiny_agent_model()
    args = streaming_config(tmp_path, max_steps=4, heartbeat_stale_after_s=3)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=answer_after_lookup(tokenizer),
    )
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="no progress for"):
            trainer.train()
        elapsed = time.monotonic() - started
    finally:
        hang.set()
    assert elapsed < 15, elapsed


def repeat_found(completions, key, **kwargs):
    return [float(TABLE[k] in str(c[-1]["content"])) for c, k in zip(completions, key)]


def test_copies_are_labelled_with_the_version_of_the_weights_they_copied(tmp_path):
    """Item 6: the optimizer step and the version of the weights it made change under one lock; a copy taken between
    the step and the trainer's callbacks is labelled with the new version, not the one before."""
    from grpokit.producer import Producer, WeightSync

    sync = WeightSync()
    policy, policy_copy = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    class Args:
        max_staleness, weight_sync_steps, queue_maxsize, generation_batch_per_process = 1, 1, 1, 1

    producer = Producer(
        Args(), maker=None, policy=policy, policy_copy=policy_copy, sync=sync, sampler=None, rollout_index=0
    )
    with sync.step(), torch.no_grad():  # the trainer's optimizer step
        policy.weight.add_(1.0)
    producer._take_weights(due=2)  # before the trainer's bookkeeping and callbacks end (sync.stepped())
    assert torch.equal(policy_copy.weight, policy.weight) and producer.weights_version == 1
    sync.stepped()
    assert sync.version == 1


def test_drops_do_not_switch_the_overlap_off(tmp_path, caplog):
    """Item 3: a tool call slow on every third prompt makes groups land too late and be dropped; dropped groups free
    their place in the schedule, so later steps still find groups in flight (before: after the first drops every
    later step found none, and steps came one slow call apart)."""
    slow = {f"k{i}" for i in range(0, 60, 3)}

    def lookup(key: str) -> str:  # slow on every third key
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        if key in slow:
            time.sleep(1.5)
        return TABLE[key]

    rows = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(60)]
    model, tokenizer = tiny_agent_model()
    args = streaming_config(tmp_path, max_steps=12, max_inflight_tasks=8)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=answer_after_lookup(tokenizer),
    )
    with caplog.at_level("WARNING", logger="grpokit"):
        trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert steps[-1]["sample/dropped_stale_total"] > 0  # the slow groups were dropped ...
    # ... and counted by prompt: only slow prompts (every third row) were, named with how often at the end
    report = next(r.message for r in caplog.records if "dropped as too stale" in r.message)
    named = [int(part.split(":")[0]) for part in report.split("row ")[1:]]
    assert named and all(row % 3 == 0 for row in named), report
    assert steps[-1]["sample/prompts_dropped"] >= len(named) and steps[-1]["sample/prompt_drop_rate_max"] == 1.0
    first_drop = next(i for i, r in enumerate(steps) if r["sample/dropped_stale_total"] > 0)
    later = [r["sample/groups_in_flight"] for r in steps[first_drop + 1 :]]
    assert later and sum(n > 0 for n in later) >= len(later) - 1, later  # ... and the overlap went on
    assert all(r["sample/staleness_max"] <= 1 for r in steps)


def test_a_tool_call_in_flight_when_training_ends_does_not_keep_the_process_alive(tmp_path):
    """Item 8: train() returns while one group still waits on a tool call (240 s, tool_timeout=300); the process
    exits soon after it (the producer's thread is given 5 s), not when the call or its timeout ends (123 s after
    train() returned with a 60 s call and tool_timeout=120 on the previous code)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "run.py"
    script.write_text(f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from datasets import Dataset
from agents_helpers import TABLE, call_text, key_of, tiny_agent_model, tool_call_script
from grpokit import GRPOConfig, GRPOTrainer

def lookup(key: str) -> str:
    \"\"\"Look up the value stored under a key.

    Args:
        key: the key to look up
    \"\"\"
    if key == "k5":
        time.sleep(240)
    return TABLE[key]

model, tokenizer = tiny_agent_model()
engine = tool_call_script(tokenizer, lambda user, results, index: f"{{results[-1]}}<|im_end|>" if results else
                          call_text("lookup", {{"key": key_of(user)}}))
rows = [{{"prompt": [{{"role": "user", "content": f"key k{{i}}"}}], "key": f"k{{i}}"}} for i in range(6)]
args = GRPOConfig(output_dir={str(tmp_path / "out")!r}, per_device_train_batch_size=4, num_generations=2, max_steps=2,
                  max_completion_length=64, logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none",
                  shuffle_dataset=False, max_staleness=1, max_inflight_tasks=8, tool_timeout=300)
trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer, tools=[lookup],
                      rollout_engine=engine)
trainer.train()
print("returned", time.monotonic(), flush=True)
""")
    done = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=400)
    exited = time.monotonic()
    assert done.returncode == 0 and "returned " in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    returned = float(done.stdout.split("returned ")[1].split()[0])
    assert exited - returned < 60, exited - returned  # a loaded 2-core machine: the bound the old code broke by far


class RecordingScript:
    """A scripted tool-calling policy that records, for each call, the thread that made it and the model it was last
    synced with, and how many calls ran at once."""

    def __init__(self, engine):
        self.engine, self.logprobs_match_training, self.model = engine, engine.logprobs_match_training, None
        self.active, self.most_active, self.sampled, self.count_lock = 0, 0, [], threading.Lock()

    def sync_weights(self, model):
        self.model = model

    def generate(self, prompts, params, seed):
        with self.count_lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.sampled.append((threading.current_thread().name, self.model))
        try:
            time.sleep(0.02)
            return self.engine.generate(prompts, params, seed)
        finally:
            with self.count_lock:
                self.active -= 1


def test_streamed_groups_sample_the_copy_and_evaluation_leases_the_engine(tmp_path):
    """Items 4 and 5 of the second pass, streamed: the producer pushes its copy's weights into an engine that keeps
    weights of its own (before, streamed groups never did), evaluation leases the engine (no two calls overlap) and
    samples the trained weights, and the copy goes back in before the producer's next call."""
    model, tokenizer = tiny_agent_model()
    engine = RecordingScript(answer_after_lookup(tokenizer))
    args = streaming_config(
        tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1, num_generations_eval=2, per_device_eval_batch_size=4
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_found,
        args=args,
        train_dataset=Dataset.from_list(ROWS * 3),
        eval_dataset=Dataset.from_list(ROWS[:2]),
        processing_class=tokenizer,
        tools=[agents_lookup],
        rollout_engine=engine,
    )
    trainer.train()
    live, main = trainer.unwrapped_model, threading.main_thread().name
    evaluation = [m for thread, m in engine.sampled if thread == main]
    producer = [m for thread, m in engine.sampled if thread != main]
    assert len(evaluation) >= 4 and len(producer) >= 8
    assert engine.most_active == 1
    assert all(m is live for m in evaluation)
    assert all(m is not None and m is not live for m in producer)


class BehaviourRecorder:
    """A scripted engine (it reports no log-probs) that records, at each call, the log-probs of each row's turn under
    the weights it samples with at that moment: the behaviour policy's, keyed by the row's context and turn."""

    logprobs_match_training = False

    def __init__(self, engine):
        self.engine, self.model, self.turns = engine, None, {}

    def sync_weights(self, model):
        self.model = model
        self.engine.sync_weights(model)

    def generate(self, prompts, params, seed):
        from grpokit import TrainBatch
        from grpokit.logprobs import token_logprobs

        out = self.engine.generate(prompts, params, seed)
        batch = TrainBatch.from_rollout(out, torch.zeros(len(out.lengths)))
        with torch.no_grad():
            logprobs, _ = token_logprobs(
                self.model, batch.input_ids, batch.input_mask, batch.completion_ids.shape[1], params.temperature
            )
        for row, length in enumerate(out.lengths.tolist()):
            context = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
            turn = out.completion_ids[row, :length].tolist()
            self.turns[tuple(context + turn)] = (len(context), logprobs[row, :length])
        return out


def test_streamed_turns_are_trained_with_the_log_probs_they_were_sampled_with(tmp_path):
    """Item 5: π_old of a streamed turn is the log-prob of the weights that sampled it, recorded at sampling time,
    not a forward of the copy when the batch is assembled (by then the copy may be a version newer). The engine
    reports no log-probs, so the producer computes them in the engine's call."""

    class Recording(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            self.trained.append(inputs)
            return super().training_step(model, inputs, num_items_in_batch)

    def lookup(key: str) -> str:  # slow on every other key: groups finish after the copy has moved on
        """Look up the value stored under a key.

        Args:
            key: the key to look up
        """
        time.sleep(0.4 * (int(key[1:]) % 2))
        return TABLE[key]

    def plain_answer(completions, **kwargs):  # the second of each group adds a '!': the advantages are not 0
        return [float("!" not in str(c[-1]["content"])) for c in completions]

    model, tokenizer = tiny_agent_model()
    script = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}{'!' * index}<|im_end|>" if results else call_text("lookup", {"key": key_of(user)})
        ),
    )
    engine = BehaviourRecorder(script)
    args = streaming_config(tmp_path, max_steps=6, learning_rate=1e-2)
    rows = [{"prompt": [{"role": "user", "content": f"key k{i}"}], "key": f"k{i}"} for i in range(24)]  # distinct
    trainer = Recording(
        model=model,
        reward_funcs=plain_answer,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=engine,
    )
    trainer.trained = []
    trainer.train()
    compared = 0
    for batch in trainer.trained:
        for row in range(len(batch)):
            prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
            full = prompt + batch.completion_ids[row, : int(batch.lengths[row])].tolist()
            for key, (context, expected) in engine.turns.items():
                if tuple(full[: len(key)]) == key and len(key) > context:
                    start, end = context - len(prompt), len(key) - len(prompt)
                    mask = batch.loss_mask[row, start:end].bool()
                    torch.testing.assert_close(
                        batch.old_logprobs[row, start:end][mask], expected[mask], atol=1e-5, rtol=0
                    )
                    compared += 1
    assert compared >= 2 * len(trainer.trained) * 4  # every row's two turns (a call, then the answer)


class SlowLocker(Locker):
    """Locker whose reads take longer the later the key; `reading` counts the reads in progress."""

    reading = 0

    def read(self, key: str) -> str:
        """Read the value stored under a key.

        Args:
            key: the key to read
        """
        SlowLocker.reading += 1
        try:
            time.sleep(1.5 * max(0, int(self.key[1:]) - 1))  # k2: 1.5 s ... k5: 6 s
            self.read_value = TABLE[self.key]
            return self.read_value
        finally:
            SlowLocker.reading -= 1


def test_rollouts_in_flight_when_training_ends_stop_at_their_next_turn_and_give_their_environments_back(tmp_path):
    """Item 8: train() ends while groups wait on an environment's tool; their rollouts stop at their next engine call
    (the producer's engine is closed to them) and the instances they were lent go back to the pool (before: they
    stayed lent for good, and the rollout threads waited on the closed engine forever)."""
    model, tokenizer = tiny_agent_model()
    engine = tool_call_script(
        tokenizer,
        lambda user, results, index: (
            f"{results[-1]}<|im_end|>" if results else call_text("read", {"key": key_of(user)})
        ),
    )
    args = streaming_config(tmp_path, max_steps=2)
    trainer = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
        environment_factory=SlowLocker,
        rollout_engine=engine,
    )
    trainer.train()
    assert SlowLocker.reading > 0  # a read was in progress when train() returned
    pool = trainer.runner.driver.environments
    deadline = time.monotonic() + 10
    while pool.lent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool.lent and SlowLocker.reading == 0
    alive = [t.name for t in threading.enumerate() if t.name.startswith("grpokit-rollout") and t.is_alive()]
    assert not alive, alive  # the rollout threads ended too


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(async_schedule="exact"), "async_schedule='exact' cannot hold for multi-turn rollouts streamed"),
        (dict(dynamic_sampling=True), "dynamic_sampling with multi-turn rollouts streamed group by group"),
    ],
)
def test_what_streamed_groups_cannot_do_is_refused_when_the_trainer_is_built(tmp_path, overrides, message):
    model, tokenizer = tiny_agent_model()
    with pytest.raises(NotImplementedError, match=message):
        GRPOTrainer(
            model=model,
            reward_funcs=repeat_found,
            args=streaming_config(tmp_path, **overrides),
            train_dataset=Dataset.from_list(ROWS),
            processing_class=tokenizer,
            tools=[agents_lookup],
        )
