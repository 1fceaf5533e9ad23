"""Nothing lost: non-finite guards, exact resume (also mid-generation and after SIGKILL), early errors."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from datasets import Dataset
from test_pinned import CPU, digest

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.checkpoint import latest_checkpoint
from grpokit.state import TrainerState
from grpokit.testing import save_tiny_model

LETTERS = "abcdefgh"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=32))


def letter_dataset():
    return Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS] * 4)


def repeat_letter(completions, letter, **kwargs):
    return [1.0 if c[:1] == target else 0.0 for c, target in zip(completions, letter)]


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=3,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    return GRPOConfig(**{**values, **overrides})


class PoisonableLM(torch.nn.Module):
    """A plain token model (no transformers) whose training forward gives NaN while `poisoned` > 0."""

    def __init__(self, vocab=12, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)
        self.poisoned = 0

    def forward(self, input_ids):
        logits = self.head(torch.cumsum(self.embed(input_ids), dim=1))
        if torch.is_grad_enabled() and self.poisoned > 0:
            self.poisoned -= 1
            logits = logits * float("nan")
        return logits


def id_dataset():
    return Dataset.from_list([{"prompt_ids": [i, i + 1], "target": i} for i in range(1, 9)])


def first_token_is_target(completion_ids, target, **kwargs):
    # Dense on purpose: a reward that varies inside every group gives non-zero advantages.
    return [float(c[0] == t) + c[0] / 100 if c else 0.0 for c, t in zip(completion_ids, target)]


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    model = PoisonableLM()
    model.poisoned = 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=first_token_is_target,
        train_dataset=id_dataset(),
        args=config(tmp_path, max_steps=2, per_device_train_batch_size=8),
    )
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer.train()
    history = trainer.state.log_history[:-1]
    assert [h["nonfinite_steps"] for h in history] == [1, 1]
    # Step 1 was skipped (weights untouched by it), step 2 trained.
    assert trainer.state.nonfinite_steps == 1
    after = trainer.unwrapped_model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_repeated_nonfinite_steps_stop_training(tmp_path):
    model = PoisonableLM()
    model.poisoned = 100
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=first_token_is_target,
        train_dataset=id_dataset(),
        args=config(
            tmp_path,
            max_steps=10,
            per_device_train_batch_size=8,
            max_nonfinite_steps=3,
            save_strategy="steps",
            save_steps=1,
        ),
    )
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"), pytest.warns(RuntimeWarning):
        trainer.train()
    assert trainer.state.global_step == 2  # steps 1 and 2 skipped and checkpointed (finite weights); step 3 stops
    for checkpoint in (tmp_path / "out").glob("checkpoint-*"):
        from safetensors.torch import load_file

        assert all(torch.isfinite(v).all() for v in load_file(str(checkpoint / "model.safetensors")).values())


def test_resume_inside_a_generation_batch(model_dir, tmp_path):
    # steps_per_generation=4, GA=1: each generation feeds 4 optimizer steps; saving at step 2 falls mid-batch.
    args = dict(
        max_steps=6,
        steps_per_generation=4,
        per_device_train_batch_size=8,
        save_strategy="steps",
        save_steps=2,
        beta=0.04,
        num_iterations=1,
        lr_scheduler_type="constant",
    )
    full = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "full", **args),
    )
    full.train()
    first = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "split", **{**args, "max_steps": 2}),
    )
    first.train()
    assert first.generation.micro_index == 2  # stopped inside the generation batch
    resumed = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "split", **args),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-2"))
    a, b = full.unwrapped_model.state_dict(), resumed.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in full.state.log_history[:-1]] == [h["loss"] for h in resumed.state.log_history[:-1]]
    lines = [json.loads(x) for x in (tmp_path / "split" / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]  # nothing logged twice after the resume


CHILD = textwrap.dedent("""
    import os, sys, time, torch
    from datasets import Dataset
    import grpokit.checkpoint.atomic as checkpoint
    import grpokit.checkpoint.checkpointer as checkpointer
    from grpokit import GRPOConfig, GRPOTrainer

    model_dir, output_dir, max_steps, pause_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    original_save = torch.save

    def slow_save(obj, path, *args, **kwargs):
        # Let the parent kill us in the middle of writing checkpoint 4 (after some of its files exist).
        original_save(obj, path, *args, **kwargs)
        if pause_at == "during" and "checkpoint-4" in str(path) and str(path).endswith("optimizer.pt"):
            open(os.path.join(output_dir, "PAUSED"), "w").close()
            time.sleep(60)

    torch.save = slow_save
    original_write = checkpoint.write_checkpoint

    def write_checkpoint(directory, step, write):
        if pause_at == "start" and step == 4:
            open(os.path.join(output_dir, "PAUSED"), "w").close()
            time.sleep(60)
        return original_write(directory, step, write)

    checkpointer.write_checkpoint = write_checkpoint

    def repeat_letter(completions, letter, **kwargs):
        return [1.0 if c[:1] == t else 0.0 for c, t in zip(completions, letter)]

    data = Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in "abcdefgh"] * 4)
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=16, num_generations=4, max_completion_length=3,
                      learning_rate=1e-2, max_steps=max_steps, logging_steps=1, save_steps=2, disable_tqdm=True,
                      beta=0.04, num_iterations=2, steps_per_generation=2, use_bias_correction_kl=False,
                      enable_jit_checkpoint=pause_at == "sigterm")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=pause_at == "resume")
    trainer.save_model(os.path.join(output_dir, "final"))
""")


def _final_weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def child_script(tmp_path_factory):
    script = tmp_path_factory.mktemp("child") / "child.py"
    script.write_text(CHILD)
    return script


@pytest.fixture(scope="module")
def unbroken_weights(model_dir, child_script, tmp_path_factory):
    reference = tmp_path_factory.mktemp("unbroken")
    subprocess.run(
        [sys.executable, str(child_script), model_dir, str(reference), "6", "none"],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        timeout=300,
    )
    return _final_weights(reference)


@pytest.mark.parametrize("moment", ["between", "start", "during"])
def test_sigkill_then_resume_gives_the_same_weights(model_dir, child_script, unbroken_weights, tmp_path, moment):
    script = child_script
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    broken = tmp_path / "broken"
    broken.mkdir()
    child = subprocess.Popen(
        [sys.executable, str(script), model_dir, str(broken), "6", moment],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 240
    if moment == "between":  # after checkpoint-2 exists, before checkpoint-4 starts
        while not (broken / "checkpoint-2").exists() and time.time() < deadline:
            time.sleep(0.02)
    else:
        while not (broken / "PAUSED").exists() and time.time() < deadline:
            time.sleep(0.02)
        assert (broken / "PAUSED").exists(), "the child never reached the moment to be killed at"
    assert child.poll() is None, "the child finished before it could be killed"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert latest_checkpoint(broken) is not None
    if moment == "during":
        assert list(broken.glob(".tmp-checkpoint-4-*")), "the kill should have left a partial checkpoint"
        assert not (broken / "checkpoint-4").exists()
    subprocess.run(
        [sys.executable, str(script), model_dir, str(broken), "6", "resume"],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    a, b = unbroken_weights, _final_weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Pinned before the rollout-seam redesign (tests/test_pinned.py says how the digests were taken, per CPU).
    pinned = {"AVX512": "d0fb0deb62db5067", "AVX2": "5233aa4645e8484b"}  # AVX2: at 3ab8536, as test_pinned's
    if CPU in pinned:
        assert digest(b) == pinned[CPU], f"CPU capability {CPU}"


def test_sigterm_with_enable_jit_checkpoint_saves_the_step_under_way_and_resumes_to_the_same_weights(
    model_dir, child_script, unbroken_weights, tmp_path
):
    # A scheduler's SIGTERM arrives at any moment of a step (here: while step 3 runs, between the checkpoints of
    # steps 2 and 4): the run finishes that step, saves it, and returns; resuming ends where the unbroken run ends.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    broken = tmp_path / "broken"
    broken.mkdir()
    child = subprocess.Popen(
        [sys.executable, str(child_script), model_dir, str(broken), "6", "sigterm"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 240
    while not (broken / "checkpoint-2").exists() and time.time() < deadline:
        time.sleep(0.02)
    assert child.poll() is None, "the child finished before it could be preempted"
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=240)
    assert child.returncode == 0, err[-2000:]  # train() returned; the script went on (it saved final/)
    saved = latest_checkpoint(broken)
    # Any step after checkpoint-2 and before the end: the signal lands while a later step runs (how late depends
    # on the machine's load).
    assert saved is not None and saved.name in ("checkpoint-3", "checkpoint-4", "checkpoint-5"), saved
    assert f"SIGTERM: saved {saved.name}" in err
    subprocess.run(
        [sys.executable, str(child_script), model_dir, str(broken), "6", "resume"],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    a, b = unbroken_weights, _final_weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- bad input


def test_a_partial_checkpoint_left_by_a_kill_is_skipped_with_a_warning(tmp_path):
    """Issue 39: the warning the checkpoint module promises, also when a complete checkpoint precedes the partial."""
    from grpokit.checkpoint.atomic import begin_checkpoint, write_checkpoint

    complete = write_checkpoint(tmp_path, 2, lambda directory: (directory / "weights").write_bytes(b"w"))
    partial = begin_checkpoint(tmp_path, 4)  # a save killed before it was finished
    (partial / "weights").write_bytes(b"half")
    with pytest.warns(UserWarning, match=rf"Skipping partial checkpoint .*{partial.name}: a save was interrupted"):
        assert latest_checkpoint(tmp_path) == complete


def test_missing_prompt_column_is_named_before_loading_the_model(tmp_path):
    data = Dataset.from_list([{"question": "a"}])
    with pytest.raises(ValueError, match=r"no 'prompt' column.*question"):
        GRPOTrainer(model="/does/not/exist", reward_funcs=repeat_letter, args=config(tmp_path), train_dataset=data)


def test_empty_dataset(tmp_path):
    data = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        GRPOTrainer(model="/does/not/exist", reward_funcs=repeat_letter, args=config(tmp_path), train_dataset=data)


def test_missing_model_path_fails_fast(tmp_path):
    started = time.time()
    with pytest.raises(FileNotFoundError, match="/does/not/exist"):
        GRPOTrainer(
            model="/does/not/exist", reward_funcs=repeat_letter, args=config(tmp_path), train_dataset=letter_dataset()
        )
    assert time.time() - started < 5


def test_reward_needing_a_missing_column(tmp_path):
    def needs_answer(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"needs_answer.*answer"):
        GRPOTrainer(
            model="/does/not/exist", reward_funcs=needs_answer, args=config(tmp_path), train_dataset=letter_dataset()
        )


def test_batch_not_a_multiple_of_num_generations(model_dir, tmp_path):
    with pytest.raises(ValueError, match="multiple of num_generations"):
        GRPOTrainer(
            model=model_dir,
            reward_funcs=repeat_letter,
            train_dataset=letter_dataset(),
            args=config(tmp_path, per_device_train_batch_size=6, num_generations=4),
        )


@pytest.mark.parametrize(
    "field,value",
    [
        ("loss_type", "ppo"),
        ("scale_rewards", "median"),
        ("importance_sampling_level", "word"),
        ("max_completion_length", 0),
        ("learning_rate", -1.0),
        ("num_generations", 1),
    ],
)
def test_bad_values_name_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        config(tmp_path, **{field: value})


def test_reward_errors_name_function_and_row(model_dir, tmp_path):
    from grpokit.rewards import RewardFunctionError

    def fragile(completions, letter, **kwargs):
        if "c" in letter:
            raise KeyError("boom")
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=fragile,
        train_dataset=letter_dataset(),
        args=config(tmp_path, max_steps=1, per_device_train_batch_size=32),
    )
    with pytest.raises(RewardFunctionError, match=r"fragile.*KeyError.*row \d+ \(prompt: 'c:'\)"):
        trainer.train()

    tolerant = GRPOTrainer(
        model=model_dir,
        reward_funcs=fragile,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "b", max_steps=1, per_device_train_batch_size=32, reward_fn_errors="none"),
    )
    tolerant.train()
    assert tolerant.state.log_history[0]["rewards/fragile/errors"] == 4  # the 4 completions of prompt 'c:'


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda n: [0.0] * (n - 1), "returned 15 values for 16"),
        (lambda n: ["1"] * n, "returned '1'"),
        (lambda n: [float("nan")] * n, "must be finite"),
    ],
)
def test_bad_reward_returns_name_the_function(model_dir, tmp_path, bad, message):
    from grpokit.rewards import RewardFunctionError

    def broken_reward(completions, **kwargs):
        return bad(len(completions))

    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=broken_reward, train_dataset=letter_dataset(), args=config(tmp_path, max_steps=1)
    )
    with pytest.raises(RewardFunctionError, match=f"broken_reward.*{message}"):
        trainer.train()


def test_tokenizer_without_pad_token_uses_eos(model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = None
    with pytest.warns(UserWarning, match="no pad token"):
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=repeat_letter,
            train_dataset=letter_dataset(),
            processing_class=tokenizer,
            args=config(tmp_path, max_steps=1),
        )
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token
    trainer.train()


def test_a_trainer_state_written_before_rollouts_was_named_so_keeps_its_count(tmp_path):
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"global_step": 3, "generations": 5}))
    state = TrainerState.load(path)
    assert (state.global_step, state.rollouts) == (3, 5)
