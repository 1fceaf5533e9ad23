"""Evaluation (pass@k, eval during training, `grpokit eval`), reward-hacking signals and the model card."""

import itertools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.evaluation import evaluation_metrics, pass_at_k
from grpokit.model_card import MARKER
from grpokit.signals import duplicate_ratio, guard_alerts, guard_series, kendall_tau, sequence_keys
from grpokit.testing import save_tiny_model

LETTERS = "abcd"


def naive_pass_at_k(passes: list[bool], k: int) -> float:
    """The definition: the share of all k-subsets of the samples that hold at least one pass."""
    subsets = list(itertools.combinations(passes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def same_letter(completions, letter, **kwargs):
    return [float(c[:1] == target) for c, target in zip(completions, letter)]


def always_one(completions, **kwargs):
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":"))


def letters(copies=1):
    return Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in LETTERS] * copies)


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=2,
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return GRPOConfig(**values)


# ------------------------------------------------------------------------------------------------ pass@k


def test_pass_at_k_hand_made():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2) = 0.5
    assert pass_at_k(5, 0, 1) == pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 5, 1) == pass_at_k(5, 5, 5) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the share of passing samples
    assert pass_at_k(5, 3, 3) == 1.0  # only two fail: every three samples hold a pass
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)  # large n: exact binomials, no overflow
    for n, c, k in [(6, 2, 3), (7, 1, 4), (5, 4, 2), (4, 0, 2)]:
        assert pass_at_k(n, c, k) == pytest.approx(naive_pass_at_k([True] * c + [False] * (n - c), k), abs=1e-12)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_evaluation_metrics_worked_example_and_none():
    def record(scores, length=1):
        return {"rewards": {"acc": scores}, "reward": scores, "lengths": [length] * 4, "truncated": [False] * 4}

    metrics = evaluation_metrics([record([1.0, 0.0, 0.0, 0.0]), record([1.0, 1.0, 0.0, 1.0], length=3)], ["acc"])
    assert metrics == pytest.approx(
        {
            "eval/reward": 0.5,
            "eval/completions/mean_length": 2.0,
            "eval/completions/clipped_ratio": 0.0,
            "eval/rewards/acc/mean": 0.5,
            "eval/rewards/acc/mean@4": 0.5,
            "eval/rewards/acc/pass@1": 0.5,
            "eval/rewards/acc/pass@4": 1.0,
        }
    )
    # None = "does not apply": a prompt counts with its scored completions; with fewer than k it leaves pass@k.
    partial = evaluation_metrics([record([None, 0.5, 1.0, 1.0]), record([None] * 4)], ["acc"], threshold=0.9)
    assert partial["eval/rewards/acc/pass@1"] == pytest.approx(2 / 3)
    assert partial["eval/rewards/acc/mean"] == pytest.approx(2.5 / 3)
    assert "eval/rewards/acc/pass@4" not in partial  # no prompt has 4 scored completions


# ----------------------------------------------------------------------------------------------- signals


def test_duplicate_ratio_hand_made_groups():
    assert duplicate_ratio(["ab", "ab", "c", "d"], 4) == 0.5  # both copies of "ab" count
    assert duplicate_ratio(["x"] * 4, 4) == 1.0
    assert duplicate_ratio(list("abcd") + list("aaab"), 4) == pytest.approx((0 + 3 / 4) / 2)
    assert duplicate_ratio([(1, 2), (1, 2), (1, 2, 3)], 3) == pytest.approx(2 / 3)  # token-id tuples
    with pytest.raises(ValueError, match="groups of 4"):
        duplicate_ratio(["a"] * 6, 4)
    # The trainer's keys: equal masked token ids (padding ignored) are equal keys.
    ids = torch.tensor([[5, 6, 0], [5, 6, 9], [5, 6, 7], [5, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert duplicate_ratio(sequence_keys(ids, mask), 4) == 0.5


def test_guard_fires_on_rising_reward_and_falling_guard_not_on_flat():
    rising = [0.1, 0.2, 0.3, 0.35, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9]
    falling = [200, 190, 185, 170, 150, 140, 120, 110, 100, 90]
    # Window 5: the first full window (positions 0..4) fires, then the stretch is quiet for one window.
    assert guard_alerts(rising, falling, window=5) == [4, 9]
    assert guard_alerts(rising, [150.0] * 10, window=5) == []  # flat guard
    assert guard_alerts([0.5] * 10, falling, window=5) == []  # flat reward
    assert guard_alerts(rising, rising, window=5) == []  # both rise: no conflict
    noisy = [100, 101, 99, 100, 102, 98, 100, 101, 99, 100]
    assert guard_alerts(rising, noisy, window=5) == []  # noise is not a trend
    assert guard_alerts(rising[:4], falling[:4], window=5) == []  # not enough logging steps yet
    assert kendall_tau([1, 3, 2, 4]) == pytest.approx(4 / 6)


def test_guard_series_pairs_train_and_eval_metrics_and_rejects_unknown():
    history = [
        {"step": 1, "reward": 0.1, "completions/mean_length": 9.0},
        {"step": 1, "eval/reward": 0.0, "eval/completions/mean_length": 5.0},
        {"step": 2, "reward": 0.2, "completions/mean_length": 8.0},
    ]
    assert guard_series(history, "completions/mean_length") == ([0.1, 0.2], [9.0, 8.0], [1, 2])
    assert guard_series(history, "eval/completions/mean_length") == ([0.0], [5.0], [1])
    with pytest.raises(ValueError, match=r"completions/mean_lenght.*completions/mean_length"):
        guard_series(history, "completions/mean_lenght")


def test_trainer_guard_warning_names_both_metrics_once_per_window(model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=same_letter,
        train_dataset=letters(),
        args=config(tmp_path, guard_metric="rewards/format/mean", guard_window=3),
    )
    records = [(0.1, 1.0), (0.3, 0.8), (0.5, 0.5), (0.6, 0.4), (0.7, 0.3)]
    messages = []
    for step, (reward, format_reward) in enumerate(records, start=1):
        trainer.state.log_history.append({"step": step, "reward": reward, "rewards/format/mean": format_reward})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.check_guard()
            trainer.check_guard()  # a second check of the same record does not warn again
        messages.append([str(w.message) for w in caught])
    assert [len(m) for m in messages] == [0, 0, 1, 0, 0]  # window 3: fires at step 3, quiet at 4 and 5
    assert "'reward' rose (0.1 -> 0.5)" in messages[2][0] and "'rewards/format/mean' fell (1 -> 0.5)" in messages[2][0]


def test_duplicate_ratio_is_one_when_sampling_is_deterministic(model_dir, tmp_path):
    # top_k=1 samples the most likely token every time: the G completions of a prompt are identical.
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=same_letter, train_dataset=letters(), args=config(tmp_path, max_steps=1, top_k=1)
    )
    trainer.train()
    assert trainer.state.log_history[0]["completions/duplicate_ratio"] == 1.0


# ------------------------------------------------------------------------------------- eval during training


@pytest.fixture(scope="module")
def evaluated(model_dir, tmp_path_factory):
    """A 4-step run that evaluates every 2 steps, 6 completions per eval prompt, then saves the model."""
    tmp_path = tmp_path_factory.mktemp("evaluated")
    args = config(
        tmp_path,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        num_generations_eval=6,
        per_device_eval_batch_size=12,
        temperature=1.5,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[same_letter, always_one],
        args=args,
        train_dataset=letters(2),
        eval_dataset=letters(),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    return trainer, tmp_path


def test_eval_records_are_logged_at_eval_steps_with_recomputable_values(evaluated):
    trainer, tmp_path = evaluated
    history = trainer.state.log_history[:-1]
    eval_records = [r for r in history if "eval/reward" in r]
    assert [r["step"] for r in eval_records] == [2, 4]
    assert [r["step"] for r in history] == [1, 2, 2, 3, 4, 4]  # each eval record follows its step's training log
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert lines == history
    # The last evaluation's completions, rescored here, give the logged pass@k / mean@k.
    samples, last = trainer.eval_samples, eval_records[-1]
    assert len(samples) == len(LETTERS) and all(len(s["completions"]) == 6 for s in samples)
    passes = [[r >= 1.0 for r in same_letter(s["completions"], [s["prompt"][0]] * 6)] for s in samples]
    for k in (1, 6):
        expected = sum(naive_pass_at_k(p, k) for p in passes) / len(passes)
        assert last[f"eval/rewards/same_letter/pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert last["eval/rewards/same_letter/mean@6"] == pytest.approx(sum(map(sum, passes)) / 24)
    assert last["eval/rewards/always_one/pass@1"] == last["eval/rewards/always_one/pass@6"] == 1.0
    assert last["eval/reward"] == pytest.approx(1 + sum(map(sum, passes)) / 24)
    lengths = [n for s in samples for n in s["lengths"]]
    assert last["eval/completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths))
    # Seeded: the same weights give the same completions; the model goes back to training mode.
    assert trainer.unwrapped_model.training
    assert trainer.evaluate() == {k: v for k, v in last.items() if k.startswith("eval")}
    assert trainer.unwrapped_model.training
    assert "completions/duplicate_ratio" in history[0] and 0 <= history[0]["completions/duplicate_ratio"] <= 1


def test_model_card_lists_rewards_config_and_final_metrics(evaluated):
    trainer, tmp_path = evaluated
    card = (tmp_path / "final" / "README.md").read_text()
    final = next(r for r in reversed(trainer.state.log_history) if "reward" in r)
    assert MARKER in card and "`same_letter`" in card and "`always_one`" in card
    assert "| `loss_type` | `'dapo'` |" in card and "| `max_steps` | 4 |" in card
    assert f"| `reward` | {final['reward']:.6g} |" in card and "`eval/rewards/same_letter/pass@6`" in card
    assert "tiny" in card and "8 rows; columns: prompt, letter" in card
    # grpokit rewrites its own card, but never a README.md somebody else wrote.
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "README.md").read_text() == card
    (tmp_path / "final" / "README.md").write_text("# my notes\n")
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "README.md").read_text() == "# my notes\n"


def test_eval_setup_errors_before_loading(tmp_path):
    with pytest.raises(ValueError, match="needs an eval_dataset"):
        GRPOTrainer(
            model="/nonexistent",
            reward_funcs=same_letter,
            train_dataset=letters(),
            args=config(tmp_path, eval_strategy="steps"),
        )
    with pytest.raises(ValueError, match="eval_strategy='epoch' is not valid"):
        config(tmp_path, eval_strategy="epoch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # implemented now: no "not implemented" warning
        config(tmp_path, eval_strategy="steps", eval_steps=5, per_device_eval_batch_size=4)


# ----------------------------------------------------------------------------------------------- the CLI


def test_train_with_eval_dataset_then_grpokit_eval_reproduces_it(model_dir, tmp_path):
    from grpokit.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}:", "letter": c}) + "\n" for c in "abc"))
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def always_one(completions, **kwargs):\n    return [1.0] * len(completions)\n"
        "def same_letter(completions, letter, **kwargs):\n"
        "    return [float(c[:1] == l) for c, l in zip(completions, letter)]\n"
    )
    sampling = ["--num_generations_eval", "8", "--max_completion_length", "3", "--temperature", "2.0"]
    reward_flags = ["--reward", f"{rewards}:always_one", "--reward", f"{rewards}:same_letter"]
    # `grpokit train` (in this process) evaluates at steps 1 and 2 and checkpoints at step 2.
    assert (
        main(
            [
                "train",
                "--model",
                model_dir,
                "--dataset",
                str(data),
                "--eval_dataset",
                str(data),
                *reward_flags,
                *sampling,
                "--output_dir",
                str(tmp_path / "out"),
                "--num_generations",
                "4",
                "--per_device_train_batch_size",
                "8",
                "--max_steps",
                "2",
                "--logging_steps",
                "1",
                "--eval_strategy",
                "steps",
                "--eval_steps",
                "1",
                "--save_steps",
                "2",
                "--disable_tqdm",
            ]
        )
        == 0
    )
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "eval/reward" in r] == [1, 2]
    assert "`same_letter`" in (tmp_path / "out" / "README.md").read_text()

    # `grpokit eval` (the real command line) on the step-2 checkpoint: its sampling settings come from the run's
    # grpo_config.json, next to the checkpoint directory, without repeating the flags.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpokit.cli",
            "eval",
            "--model",
            str(tmp_path / "out" / "checkpoint-2"),
            "--dataset",
            str(data),
            *reward_flags,
            "--out",
            str(tmp_path / "results" / "eval.json"),
        ],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pass@8" in result.stdout and "always_one" in result.stdout
    assert "temperature=2.0" in result.stdout and "grpo_config.json" in result.stdout
    results = json.loads((tmp_path / "results" / "eval.json").read_text())
    metrics, samples = results["metrics"], results["samples"]
    # The same evaluation as during training: the same weights and seed give the same numbers.
    assert metrics == {k: v for k, v in logged[-1].items() if k.startswith("eval")}
    assert results["num_generations_eval"] == 8 and results["config"]["temperature"] == 2.0
    assert [s["prompt"] for s in samples] == ["a:", "b:", "c:"] and all(len(s["completions"]) == 8 for s in samples)
    assert metrics["eval/rewards/always_one/pass@1"] == metrics["eval/rewards/always_one/pass@8"] == 1.0
    passes = [[c[:1] == s["prompt"][0] for c in s["completions"]] for s in samples]
    assert [s["rewards"]["same_letter"] for s in samples] == [[float(p) for p in ps] for ps in passes]
    for k in (1, 8):
        expected = sum(naive_pass_at_k(p, k) for p in passes) / 3
        assert metrics[f"eval/rewards/same_letter/pass@{k}"] == pytest.approx(expected, abs=1e-12)
    assert all(len(c) <= 3 for s in samples for c in s["completions"])
    # A flag overrides the run's setting; the others still come from the run.
    assert (
        main(
            [
                "eval",
                "--model",
                str(tmp_path / "out" / "checkpoint-2"),
                "--dataset",
                str(data),
                *reward_flags,
                "--temperature",
                "1.0",
                "--num_generations_eval",
                "2",
                "--out",
                str(tmp_path / "two.json"),
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "two.json").read_text())["config"]
    assert config["temperature"] == 1.0 and config["num_generations_eval"] == 2
    assert config["max_completion_length"] == 3
