"""The real command line, in a subprocess, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from grpokit.testing import save_tiny_model


def run_cli(*args, cwd, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "grpokit.cli", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_demo_through_the_cli_shortened(tmp_path):
    out = run_cli("train", "--max_steps", "4", "--output_dir", str(tmp_path / "demo"), "--logging_steps", "2",
                  cwd=tmp_path)  # fmt: skip
    assert "Held-out accuracy before GRPO" in out and "Supervised warm-up" in out
    assert f"Model and tokenizer saved to {tmp_path / 'demo'}" in out
    metrics = read_metrics(tmp_path / "demo")
    assert [m["step"] for m in metrics] == [1, 2, 4]
    assert "rewards/exact_match/mean" in metrics[-1]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "demo")


def test_train_with_model_dataset_and_reward_file(tmp_path):
    model = save_tiny_model(tmp_path / "model", chars="abcd:")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}:", "letter": c}) + "\n" for c in "abcd"))
    (tmp_path / "my_rewards.py").write_text(
        "def same_letter(completions, letter, **kwargs):\n"
        "    return [float(c[:1] == l) for c, l in zip(completions, letter)]\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {model}\nnum_generations: 4\nper_device_train_batch_size: 8\nmax_steps: 3\n"
                      f"max_completion_length: 3\nlogging_steps: 1\nlearning_rate: 1.0e-3\n")  # fmt: skip
    run_cli("train", str(config), "--dataset", str(data), "--reward", f"{tmp_path / 'my_rewards.py'}:same_letter",
            "--reward", "length", "--output_dir", str(tmp_path / "out"), "--beta", "0.04", cwd=tmp_path)  # fmt: skip
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert {"rewards/same_letter/mean", "rewards/length_reward/mean", "kl"} <= set(metrics[-1])
    saved = json.loads((tmp_path / "out" / "grpo_config.json").read_text())
    assert saved["beta"] == 0.04 and saved["learning_rate"] == 1e-3 and saved["num_generations"] == 4
    assert (tmp_path / "out" / "model.safetensors").is_file()

    run_cli("report", str(tmp_path / "out"), cwd=tmp_path)
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "GRPO report" in html and "data:image/png;base64," in html
    assert (tmp_path / "out" / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flag_value_fails_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", "--max_steps", "2", "--loss_type",
                             "ppo"], cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert "loss_type='ppo'" in result.stderr


@pytest.mark.slow
def test_full_demo_turns_failure_into_success(tmp_path):
    """The built-in demo as `grpokit train` runs it: held-out accuracy <= 30% before, >= 80% after, < 5 min."""
    from grpokit.demo import run_demo

    result = run_demo(str(tmp_path / "demo"), disable_tqdm=True)
    assert result["accuracy_before"] <= 0.30
    assert result["accuracy_after"] >= 0.80
    assert result["seconds"] < 300


def test_processes_the_tests_start_import_this_checkout(tmp_path):
    # conftest puts the checkout first on PYTHONPATH: a torchrun rank or a CLI run started elsewhere would otherwise
    # import whatever grpokit is installed, which may be older than the code under test.
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", "import grpokit; print(grpokit.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, check=True)  # fmt: skip
    checkout = Path(__file__).resolve().parents[1]
    assert Path(out.stdout.strip().splitlines()[-1]).resolve().is_relative_to(checkout)
