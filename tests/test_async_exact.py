"""Exact asynchronous generation (grpokit.producer): generation batch n is sampled by the weights of exactly the
version the schedule names, whatever the timing of the producer and the trainer, so seeded runs end on the same
weights; a checkpoint holds the batches in flight that a resumed run could not sample again, so a run killed
(SIGKILL) after a checkpoint and resumed ends on bitwise the unbroken run's weights."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model
from test_pinned import digest
from transformers import TrainerCallback

from grpokit import GRPOTrainer
from grpokit.producer import scheduled_version
from grpokit.rollout import HFEngine


def weights(trainer) -> str:
    return digest(dict(trainer.unwrapped_model.state_dict()))


@pytest.mark.parametrize(
    "every, staleness, expected",
    [
        (1, 0, [0, 1, 2, 3, 4, 5]),  # the synchronous loop
        (1, 1, [0, 0, 1, 2, 3, 4]),
        (1, 2, [0, 0, 0, 1, 2, 3]),
        (2, 2, [0, 0, 0, 2, 2, 4]),  # copies every weight_sync_steps versions, within the bound
        (2, 3, [0, 0, 0, 0, 2, 2]),
        (2, 1, [0, 0, 1, 2, 3, 4]),  # every 2 steps cannot keep a bound of 1 without waits: the bound wins
        (3, 1, [0, 0, 1, 2, 3, 4]),
    ],
)
def test_the_schedule_names_each_batchs_version(every, staleness, expected):
    versions = [scheduled_version(batch, staleness, every) for batch in range(6)]
    assert versions == expected
    assert all(0 <= batch - v <= staleness for batch, v in enumerate(versions))


class SlowEngine:
    """The in-process engine over whatever model it is synced with; each call first sleeps `delay` seconds."""

    logprobs_match_training = True

    def __init__(self, delay: float = 0.0):
        self.delay, self.engine = delay, None

    def sync_weights(self, model):
        if self.engine is None or self.engine.model is not model:
            self.engine = HFEngine(model, torch.device("cpu"), logprobs_match_training=True)

    def generate(self, prompts, params, seed):
        time.sleep(self.delay)
        return self.engine.generate(prompts, params, seed)


class SlowSteps(TrainerCallback):
    def __init__(self, delay: float):
        self.delay = delay

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.delay)


def timed_run(tmp_path, engine_delay: float, step_delay: float, **overrides):
    model, tokenizer = tiny_letter_model()
    values = dict(
        per_device_train_batch_size=16, num_generations=4, max_steps=6, max_staleness=2, report_to="none", beta=0.04
    )
    args = letter_config(tmp_path, **{**values, **overrides})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=SlowEngine(engine_delay),
        callbacks=[SlowSteps(step_delay)],
    )
    trainer.train()
    staleness = [r["sample/staleness_max"] for r in trainer.state.log_history if "sample/staleness_max" in r]
    return trainer, staleness


def test_each_batch_is_sampled_by_the_scheduled_version_whatever_the_timing(tmp_path):
    # A slow engine: the trainer waits for samples and is at the newest version whenever a batch starts. A slow
    # trainer: the producer waits for the trainer. Each batch is sampled by the same version either way.
    slow_engine, staleness_a = timed_run(tmp_path / "a", engine_delay=0.4, step_delay=0.0)
    slow_trainer, staleness_b = timed_run(tmp_path / "b", engine_delay=0.0, step_delay=0.4)
    assert staleness_a == staleness_b == [0, 1, 2, 2, 2, 2]
    assert weights(slow_engine) == weights(slow_trainer)


CHILD = """
import sys
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model
from grpokit import GRPOTrainer

model, tokenizer = tiny_letter_model()
args = letter_config(__import__("pathlib").Path(sys.argv[1]), per_device_train_batch_size=16, num_generations=4,
                     max_steps=12, max_staleness=int(sys.argv[2]), save_strategy="steps", save_steps=4,
                     report_to="none", beta=0.04)
trainer = GRPOTrainer(model=model, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset(),
                      processing_class=tokenizer)
trainer.train(resume_from_checkpoint=len(sys.argv) > 3)
"""


def child(tmp_path: Path, staleness: int, *resume: str) -> subprocess.Popen:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(staleness), *resume],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def final_weights(output_dir: Path) -> str:
    from safetensors.torch import load_file

    return digest(load_file(output_dir / "checkpoint-12" / "model.safetensors"))


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_run_killed_after_a_checkpoint_and_resumed_ends_on_the_unbroken_runs_weights(tmp_path, staleness):
    unbroken = child(tmp_path / "unbroken", staleness)
    broken = child(tmp_path / "broken", staleness)
    checkpoint = tmp_path / "broken" / "out" / "checkpoint-8"
    deadline = time.monotonic() + 240
    while not checkpoint.is_dir() and broken.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert checkpoint.is_dir(), broken.communicate()[0].decode()[-3000:]
    broken.send_signal(signal.SIGKILL)  # with batches in flight: sampled by weights the checkpoint does not hold
    broken.wait()
    assert not (tmp_path / "broken" / "out" / "checkpoint-12").exists()
    resumed = child(tmp_path / "broken", staleness, "resume")
    for process in (unbroken, resumed):
        output = process.communicate(timeout=300)[0].decode()
        assert process.returncode == 0, output[-3000:]
    assert final_weights(tmp_path / "broken" / "out") == final_weights(tmp_path / "unbroken" / "out")
