"""The real command line, in a subprocess, as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from grpokit.testing import save_tiny_model


def run_cli(*args, cwd, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "grpokit.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_demo_through_the_cli_shortened(tmp_path):
    out = run_cli(
        "train", "--max_steps", "4", "--output_dir", str(tmp_path / "demo"), "--logging_steps", "2", cwd=tmp_path
    )
    assert "Held-out accuracy before GRPO" in out and "Supervised warm-up" in out
    assert "reward = 0.2 x answer_format (a single letter) + 1.0 x exact_match (the right letter), 1.2 at best" in out
    assert f"Model and tokenizer saved to {tmp_path / 'demo'}" in out
    metrics = read_metrics(tmp_path / "demo")
    assert [m["step"] for m in metrics] == [1, 2, 4]
    assert "rewards/exact_match/mean" in metrics[-1]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "demo")
    # The held-out accuracies it prints are in the run's files, and in its report.
    results = json.loads((tmp_path / "demo" / "demo_results.json").read_text())
    printed = (
        f"Held-out accuracy: {results['accuracy_before']:.1%} before GRPO -> {results['accuracy_after']:.1%} after 4"
    )
    assert printed in out and results["grpo_steps"] == 4 and results["warmup_steps"] >= 5
    run_cli("report", str(tmp_path / "demo"), cwd=tmp_path)
    page = (tmp_path / "demo" / "report" / "report.html").read_text()
    assert (
        f'<td class="num">{results["accuracy_before"]:.0%}</td><td class="num">{results["accuracy_after"]:.0%}' in page
    )
    assert "<h2>Sample completions</h2>" not in page and "No sample completions: the run did not log them" in page
    assert (
        "Learning rate (constant at 0.001)" in page
        and not (tmp_path / "demo" / "report" / "learning_rate.png").exists()
    )


def test_train_with_model_dataset_and_reward_file(tmp_path):
    model = save_tiny_model(tmp_path / "model", chars="abcd:")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}:", "letter": c}) + "\n" for c in "abcd"))
    (tmp_path / "my_rewards.py").write_text(
        "def same_letter(completions, letter, **kwargs):\n"
        "    return [float(c[:1] == l) for c, l in zip(completions, letter)]\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {model}\nnum_generations: 4\nper_device_train_batch_size: 8\nmax_steps: 3\n"
        f"max_completion_length: 3\nlogging_steps: 1\nlearning_rate: 1.0e-3\n"
    )
    run_cli(
        "train",
        str(config),
        "--dataset",
        str(data),
        "--reward",
        f"{tmp_path / 'my_rewards.py'}:same_letter",
        "--reward",
        "length",
        "--output_dir",
        str(tmp_path / "out"),
        "--beta",
        "0.04",
        cwd=tmp_path,
    )
    metrics = read_metrics(tmp_path / "out")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert {"rewards/same_letter/mean", "rewards/length/mean", "kl"} <= set(metrics[-1])
    saved = json.loads((tmp_path / "out" / "grpo_config.json").read_text())
    assert saved["beta"] == 0.04 and saved["learning_rate"] == 1e-3 and saved["num_generations"] == 4
    assert (tmp_path / "out" / "model.safetensors").is_file()

    run_cli("report", str(tmp_path / "out"), cwd=tmp_path)
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "GRPO report" in html and "data:image/png;base64," in html
    assert (tmp_path / "out" / "report" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flag_value_fails_with_a_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "grpokit.cli", "train", "--max_steps", "2", "--loss_type", "ppo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_processes_the_tests_start_import_the_installed_package_the_tests_import(tmp_path):
    # The package lives in src/: a process started in the checkout (a torchrun rank, the CLI) imports the installed
    # grpokit, the one under test, never a copy of the tree that happens to be on sys.path.
    from pathlib import Path

    import grpokit

    checkout = Path(__file__).resolve().parents[1]
    assert not (checkout / "grpokit").exists(), "the package must stay under src/ (it would shadow the installed one)"
    for cwd in (tmp_path, checkout):
        out = subprocess.run(
            [sys.executable, "-c", "import grpokit; print(grpokit.__file__)"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        assert Path(out.stdout.strip().splitlines()[-1]).resolve() == Path(grpokit.__file__).resolve()


# ------------------------------------------------------------------------ mistakes: one or two lines, a suggestion


def run_main(capsys, *argv):
    from grpokit.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["train", "--learnig_rate", "1e-5"], ["unknown option --learnig_rate", "Did you mean --learning_rate?"]),
        (["train", "--learning_rat", "1e-5"], ["unknown option --learning_rat", "Did you mean --learning_rate?"]),
        (["train", "--max_steps", "many"], ["--max_steps takes a number, not 'many'"]),
        (["train", "--model", "m"], ["missing --dataset, --reward"]),
        (
            ["eval", "--model", "m", "--dataset", "d.jsonl", "--reward", "exact_match", "--tempreature", "0.5"],
            ["unknown option --tempreature", "Did you mean --temperature?"],
        ),
        (["report"], ["the following arguments are required: output_dirs"]),
    ],
)
def test_a_mistake_prints_one_line_with_a_suggestion(capsys, argv, words):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) <= 2, err  # not the usage of every GRPOConfig field
    for word in words:
        assert word in err, err


@pytest.fixture
def tiny_run(tmp_path, monkeypatch):
    """A saved tiny model `tiny` and two datasets in the current directory: ok.jsonl (prompt, answer) and
    questions.jsonl (question, answer)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_tiny_model(tmp_path / "tiny")
    for name, column in (("ok.jsonl", "prompt"), ("questions.jsonl", "question")):
        (tmp_path / name).write_text("\n".join(json.dumps({column: "ab", "answer": "b"}) for _ in range(8)))
    return tmp_path


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--model", "tinyy", "--dataset", "ok.jsonl", "--reward", "length"],
            "grpokit train: error: --model tinyy: no such directory. Did you mean tiny?",
        ),
        (
            ["--model", "tiny", "--dataset", "questions.jsonl", "--reward", "length"],
            "grpokit train: error: dataset questions.jsonl has no 'prompt' column (its columns: question, answer): say which "
            "column holds the prompts with --rename_column question=prompt.",
        ),
        (
            ["--model", "tiny", "--dataset", "ok.jsonl", "--reward", "exact_match"],
            "grpokit train: error: reward exact_match reads the dataset column 'target', which dataset ok.jsonl lacks (its "
            "columns: prompt, answer): name the column that holds it with --rename_column answer=target.",
        ),
        (
            ["--model", "tiny", "--dataset", "ok.jsonl", "--reward", "length", "--rename_column", "answr=target"],
            "grpokit train: error: --rename_column answr=target: dataset ok.jsonl has no column 'answr' (its columns: "
            "prompt, answer). Did you mean answer?",
        ),
        (
            ["--model", "tiny", "--dataset", "ok.jsonl", "--reward", "length", "--rename_column", "answer"],
            "grpokit train: error: --rename_column takes OLD=NEW pairs (e.g. --rename_column question=prompt), not "
            "'answer'.",
        ),
        (
            [
                "--model",
                "tiny",
                "--dataset",
                "ok.jsonl",
                "--reward",
                "length",
                "--per_device_train_batch_size",
                "4",
                "--generation_batch_size",
                "12",
                "--num_generations",
                "8",
            ],
            "grpokit train: error: generation_batch_size (12) must be divisible by num_generations (8): the global "
            "generation batch (1 process(es) x per_device_train_batch_size 4 x steps_per_generation 3 = 12 completions) "
            "must be a multiple of num_generations. Change per_device_train_batch_size or num_generations (valid "
            "num_generations here: [2, 3, 4, 6, 12]).",
        ),
    ],
)
def test_a_user_error_on_the_command_line_is_one_line_with_a_fix_the_cli_user_can_apply(tiny_run, capsys, argv, line):
    code, _out, err = run_main(capsys, "train", *argv, "--max_steps", "1", "--output_dir", "out")
    assert (code, err.strip().splitlines()[-1:]) == (2, [line]), err
    assert "Traceback" not in err and not (tiny_run / "out").exists()


def test_a_hub_id_that_cannot_be_loaded_is_one_line(tiny_run, capsys):
    code, _, err = run_main(
        capsys, "train", "--model", "org/no-such-model", "--dataset", "ok.jsonl", "--reward", "length"
    )
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "grpokit train: error: --model org/no-such-model: not a local directory, and not in the Hugging Face cache "
        "(HF_HUB_OFFLINE is set, so the Hub is not tried). Give a model directory (save_pretrained's), or a Hub id "
        "this machine can download."
    ]


def test_rename_column_fixes_what_it_names(tiny_run, capsys):
    code, _out, err = run_main(
        capsys,
        "train",
        "--model",
        "tiny",
        "--dataset",
        "questions.jsonl",
        "--reward",
        "exact_match",
        "--rename_column",
        "question=prompt",
        "answer=target",
        "--max_steps",
        "1",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        "out",
        "--disable_tqdm",
        "true",
        "--logging_steps",
        "1",
    )
    assert code == 0, err
    assert "rewards/exact_match/mean" in json.loads((tiny_run / "out" / "metrics.jsonl").read_text().splitlines()[0])


def test_no_command_prints_the_usage_and_exits_2(capsys):
    code, out, err = run_main(capsys)
    assert code == 2 and out == "" and err.startswith("usage: grpokit {train,eval,report,vllm-serve}")


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["train", "--help"], ["train", "--learnig_rate", "1"], ["eval", "--tempreature", "1"]],
)
def test_help_version_and_argument_errors_do_not_import_torch(argv):
    code = (
        "import sys; from grpokit.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'peft', 'datasets') if m in sys.modules]\n"
        "print('imported:', heavy)"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "imported: []", done.stdout + done.stderr


def test_a_yaml_typo_is_named_with_the_field_it_meant(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rat: 1.0e-5\nmodel: m\n")
    code, _, err = run_main(capsys, "train", str(config))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown key(s)" in err and "learning_rat" in err and "Did you mean learning_rate?" in err


def test_an_unknown_command_gets_a_suggestion_and_version_works(capsys):
    code, out, err = run_main(capsys, "trian")
    assert code == 2 and out == "" and "unknown command 'trian'. Did you mean train?" in err
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("grpokit ")


def test_a_missing_dataset_file_is_a_file_not_found_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(capsys, "train", "--model", "m", "--dataset", "trian.jsonl", "--reward", "length")
    assert code == 2 and "Dataset 'trian.jsonl' not found: no such file or directory" in err
    assert "Hub" not in err


def test_report_on_an_empty_folder_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_main(capsys, "report", str(tmp_path / "empty"))
    assert code == 2 and "Report written" not in out and "holds no run" in err
    assert not (tmp_path / "empty" / "report").exists()
    code, _, err = run_main(capsys, "report", str(tmp_path / "nowhere"))
    assert code == 2 and "is not a directory" in err


@pytest.mark.parametrize(
    "argv, weights",
    [
        (["--reward_weights", "1.0"], [1.0]),
        (["--reward_weights", "1"], [1.0]),
        (["--reward_weights", "1.0", "0.5"], [1.0, 0.5]),
        (["--reward_weights", "1.0,0.5"], [1.0, 0.5]),
        (["--reward_weights", "[1, 0.5]"], [1.0, 0.5]),
        (["--reward_weights", "null"], None),
    ],
)
def test_list_flags_take_the_forms_users_type(argv, weights):
    from grpokit.cli import parse_train_args

    _, values = parse_train_args(argv)
    assert values["reward_weights"] == weights
    assert all(isinstance(w, float) for w in weights or [])


def test_a_list_field_in_yaml_may_be_one_value(tmp_path):
    from grpokit.cli import parse_train_args

    config = tmp_path / "run.yaml"
    config.write_text("reward_weights: 1\n")
    assert parse_train_args([str(config)])[1]["reward_weights"] == [1.0]


def test_eval_with_other_rewards_does_not_inherit_the_runs_weights(tmp_path, capsys):
    """A run trained with two rewards (the demo's weights [0.2, 1.0]) evaluated with one: the run's weights are not
    taken over; `--reward_weights 1.0` is accepted too."""
    model = save_tiny_model(tmp_path / "run", chars="abcd:")
    (tmp_path / "run" / "grpo_config.json").write_text(
        json.dumps(
            {"reward_weights": [0.2, 1.0], "max_completion_length": 2, "num_generations_eval": 2, "temperature": 1.0}
        )
    )
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{c}:", "target": c}) + "\n" for c in "ab"))
    for extra in ([], ["--reward_weights", "1.0"]):
        out_file = tmp_path / f"eval{len(extra)}.json"
        code, _out, err = run_main(
            capsys,
            "eval",
            "--model",
            str(model),
            "--dataset",
            str(data),
            "--reward",
            "exact_match",
            "--out",
            str(out_file),
            *extra,
        )
        assert code == 0, err
        assert json.loads(out_file.read_text())["rewards"] == {"exact_match": 1.0}
    code, _, err = run_main(
        capsys,
        "eval",
        "--model",
        str(model),
        "--dataset",
        str(data),
        "--reward",
        "exact_match",
        "--reward_weights",
        "1.0",
        "0.5",
    )
    assert code == 2 and "--reward_weights has 2 value(s) for 1 --reward(s)" in err


def test_bf16_help_says_the_real_default():
    from grpokit.config import GRPOConfig

    assert GRPOConfig().bf16 is False
    assert "Off by default" in GRPOConfig.field_help("bf16")


# ------------------------------------------------------------ the second hour: your own data to a trained model


def cli(*args, cwd, env=None, timeout=300):
    """The CLI in a subprocess: (exit status, stdout, stderr, seconds)."""
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "grpokit.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - started


@pytest.fixture
def letters(tmp_path):
    """A tiny saved model reading a-d and ':', and train/test sets of its prompts with a 'target' column."""
    save_tiny_model(tmp_path / "tiny", chars="abcd:")
    for name, rows in (("train.jsonl", 8), ("test.jsonl", 4)):
        (tmp_path / name).write_text(
            "".join(json.dumps({"prompt": f"{c}{d}:", "target": c}) + "\n" for c in "abcd" for d in "abcd"[: rows // 4])
        )
    return tmp_path


TINY = ["--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "2"]
QUIET = ["--disable_tqdm", "true", "--logging_steps", "1", "--report_to", "none"]


def test_a_run_that_cannot_learn_says_so_once_with_the_numbers(letters):
    (letters / "flat.py").write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    code, _out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "train.jsonl", "--reward", "flat.py:zero", "--max_steps", "21",
        "--output_dir", "out", "--max_completion_length", "1", "--num_generations", "2",
        "--per_device_train_batch_size", "4", "--save_strategy", "no", *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    # Every group has one reward for all its completions: said once, at step 20, with the numbers and the fixes.
    assert err.count("This run may not be learning") == 1, err
    assert "in every logged step up to step 20, 100% of the groups gave every completion the same reward" in err
    assert "frac_reward_zero_std" in err and "larger groups (num_generations), a higher temperature" in err
    assert err.index("up to step 20") < err.index("[step 21]")
    assert "Skipping publisher trust check" not in err


def test_prompts_the_tokenizer_cannot_read_are_said(letters):
    (letters / "foreign.jsonl").write_text(
        "".join(json.dumps({"prompt": "ab日本語の質問", "target": "a"}) + "\n" for _ in range(4))
    )
    code, _out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "foreign.jsonl", "--reward", "exact_match", "--max_steps", "1",
        "--output_dir", "out", *TINY, *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    assert "75% of the prompts' characters (of 32 in the first prompts) are not in the tokenizer's vocabulary" in err


def test_stalled_since_start_by_hand():
    from grpokit.signals import stall_messages, stalled_since_start

    def log(*pairs):
        return [{"step": step, "frac_reward_zero_std": value} for step, value in pairs]

    assert stalled_since_start(log((10, 1.0), (20, 0.96)), "frac_reward_zero_std", 0.9, 20) == (20, 0.98)
    assert stalled_since_start(log((5, 1.0), (10, 1.0)), "frac_reward_zero_std", 0.9, 20) is None
    assert stalled_since_start(log((10, 0.5), (20, 1.0), (30, 1.0)), "frac_reward_zero_std", 0.9, 20) is None
    assert stalled_since_start([{"step": 30, "eval/reward": 1.0}], "frac_reward_zero_std", 0.9, 20) is None
    clipped = [{"step": s, "completions/clipped_ratio": 1.0, "frac_reward_zero_std": 0.5} for s in (10, 20)]
    (message,) = stall_messages(clipped).values()
    assert message.startswith(
        "This run may not be learning: in every logged step up to step 20, 100% of the completions were cut at "
        "max_completion_length (completions/clipped_ratio)"
    )
    assert "a larger max_completion_length" in message


def test_lora_from_flags_and_from_yaml(letters):
    code, _out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "train.jsonl", "--reward", "exact_match", "--max_steps", "1",
        "--output_dir", "flags", "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0",
        "--lora_target_modules", "q_proj", "v_proj", *TINY, *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    adapter = json.loads((letters / "flags" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["lora_dropout"]) == (4, 8, 0.0)
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    (letters / "lora.yaml").write_text(
        "model: tiny\ndataset: train.jsonl\nreward: exact_match\npeft_config:\n  r: 2\n  lora_alpha: 6\n"
        "  target_modules: [q_proj]\nmax_steps: 1\noutput_dir: yaml\n"
    )
    code, _out, err, _ = cli("train", "lora.yaml", *TINY, *QUIET, cwd=letters)
    assert code == 0, err
    adapter = json.loads((letters / "yaml" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["target_modules"]) == (2, 6, ["q_proj"])


def test_qlora_flags_become_trls_quantization_config(capsys):
    from grpokit.cli import model_options_into, parse_train_args

    run, values = parse_train_args(
        ["--use_peft", "--load_in_4bit", "--use_bnb_nested_quant", "--dtype", "bfloat16", "--lora_r", "8"]
    )
    lora = model_options_into(run, values)
    assert values["model_init_kwargs"] == {
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
    }
    assert (lora["r"], lora["lora_alpha"], lora["task_type"]) == (8, 32, "CAUSAL_LM")
    code, _, err = run_main(
        capsys, "train", "--model", "m", "--dataset", "d.jsonl", "--reward", "length", "--load_in_4bit"
    )
    assert code == 2 and "add --use_peft to train a LoRA adapter on it (QLoRA)" in err


def test_a_missing_tracker_is_one_line_before_anything_loads(letters):
    from grpokit.extras import install_command, is_installed

    if is_installed("wandb"):
        pytest.skip("wandb is installed here")
    fix = install_command("trackers", "wandb")
    for argv in (
        ["--max_steps", "1", "--output_dir", "demo"],  # the demo: refused before its warm-up
        ["--model", "tiny", "--dataset", "train.jsonl", "--reward", "exact_match", "--output_dir", "out"],
    ):
        code, out, err, _ = cli("train", *argv, "--report_to", "wandb", cwd=letters)
        assert code == 2 and out == "", out + err  # nothing printed: no warm-up, no data or model loaded
        assert err.strip().splitlines() == [
            f"grpokit train: error: report_to wandb needs wandb, which is not installed here: {fix}."
        ]
        assert "checkout" not in err and not (letters / "demo").exists() and not (letters / "out").exists()


def test_a_hub_model_that_cannot_be_reached_is_said_at_once(letters):
    code, _, err, seconds = cli(
        "train", "--model", "org/no-such-model", "--dataset", "train.jsonl", "--reward", "exact_match", cwd=letters,
        env={"HF_HUB_OFFLINE": "0"},
    )  # fmt: skip
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Retrying" not in err and seconds < 30, err
    assert last.startswith("grpokit train: error: --model org/no-such-model: not a local directory, and ")
    assert "the Hub cannot be reached from this machine" in last or "not found on the Hub" in last


def test_the_troubleshooting_page_quotes_what_the_cli_prints(letters):
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    code, _, err, _ = cli(
        "train", "--model", "org/no-such-model", "--dataset", "train.jsonl", "--reward", "exact_match", cwd=letters
    )
    line = err.strip().splitlines()[-1].removeprefix("grpokit train: error: ")
    assert code == 2 and line in " ".join(page.split()), line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--reward", "acuracy"], "Unknown reward 'acuracy': Did you mean accuracy?"),
        (["--reward", "exact_match", "--report_to", "wandbb"], "did you mean 'wandb'?"),
    ],
)
def test_a_misspelt_reward_or_tracker_gets_a_suggestion(capsys, argv, words):
    code, _, err = run_main(capsys, "train", "--model", "m", "--dataset", "d.jsonl", *argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_second_run_in_the_same_output_dir_is_refused_resumed_or_started_over(letters):
    common = ["--model", "tiny", "--dataset", "train.jsonl", "--reward", "exact_match", "--output_dir", "out"]
    common += [*TINY, *QUIET, "--save_steps", "1"]
    code, _, err, _ = cli("train", *common, "--max_steps", "2", cwd=letters)
    assert code == 0, err
    code, out, err, _ = cli("train", *common, "--max_steps", "1", cwd=letters)
    assert code == 2 and err.strip().splitlines() == [
        "grpokit train: error: output_dir out holds a previous run (checkpoint-1, checkpoint-2, metrics.jsonl and 1 "
        "more): continue it with --resume_from_checkpoint true, or start over with --overwrite_output_dir true "
        "(removes its checkpoints and logs), or choose another --output_dir."
    ], err
    code, _, err, _ = cli("train", *common, "--max_steps", "3", "--resume_from_checkpoint", "true", cwd=letters)
    assert code == 0, err
    assert [m["step"] for m in read_metrics(letters / "out") if "reward" in m] == [1, 2, 3]
    code, out, err, _ = cli("train", *common, "--max_steps", "1", "--overwrite_output_dir", "true", cwd=letters)
    assert code == 0, err
    assert "--overwrite_output_dir: removed the previous run's checkpoint-1, checkpoint-2, checkpoint-3" in out
    assert sorted(p.name for p in (letters / "out").glob("checkpoint-*")) == ["checkpoint-1"]
    assert [m["step"] for m in read_metrics(letters / "out") if "reward" in m] == [1]


def test_an_eval_dataset_is_evaluated_and_said(letters):
    code, out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "train.jsonl", "--eval_dataset", "test.jsonl", "--reward",
        "exact_match", "--max_steps", "2", "--output_dir", "out", *TINY, *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    assert "Evaluating on test.jsonl every 1 steps (eval_strategy=steps" in out
    assert [m["step"] for m in read_metrics(letters / "out") if "eval/reward" in m] == [1, 2]


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["--model", "m", "--dataset", "d.jsonl", "--reward", "length", "--eval_dataset", "e.jsonl",
             "--eval_strategy", "no"],
            "--eval_dataset e.jsonl with --eval_strategy no: nothing would be evaluated",
        ),
        (["--model", "m", "--dataset", "d.jsonl", "--reward", "length", "--eval_dataset_split", "x"],
         "--eval_dataset_split without --eval_dataset"),
        (["--reward", "accuracy", "--max_steps", "1"], "--reward without --model and --dataset"),
        (["--use_peft", "--max_steps", "1"], "--use_peft without --model and --dataset"),
    ],
)  # fmt: skip
def test_nothing_requested_is_silently_ignored(capsys, argv, words):
    code, _, err = run_main(capsys, "train", *argv)
    assert code == 2 and words in err, err


def test_train_help_is_grouped_by_topic():
    from grpokit.cli import TOPICS, build_train_parser, topic_of
    from grpokit.config import GRPOConfig

    text = build_train_parser().format_help()
    for topic in ("model", "data", "generation", "objective", "memory and speed", "logging", "LoRA / QLoRA"):
        assert f"\n{topic}" in text, topic
    assert text.splitlines()[0].startswith("usage: grpokit train [config.yaml]") and len(text.splitlines()[0]) < 120
    assert [t for t in ("temperature", "beta", "bf16", "report_to") if topic_of(t) == "other"] == []
    assert topic_of("vllm_server_port") == "vLLM" and len(TOPICS) >= 6
    assert "--lora_r" in text and "--overwrite_output_dir" in text
    for name in GRPOConfig.__dataclass_fields__:  # every field still a flag, hidden or shown
        assert f"--{name}" in text or name in text.split("Accepted for TRL compatibility")[1], name


def test_no_third_party_progress_noise(letters):
    code, out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "train.jsonl", "--reward", "exact_match", "--max_steps", "1",
        "--output_dir", "out", *TINY, *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    assert "Generating train split" not in out + err and "Loading weights" not in out + err


def test_the_example_yaml_runs(letters):
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "grpo_config.yaml"
    code, _, err, _ = cli(
        "train", str(example), "--model", "tiny", "--dataset", "train.jsonl", "--eval_dataset", "test.jsonl",
        "--reward", "exact_match", "--reward_weights", "1.0", "--max_steps", "1", "--output_dir", "out",
        "--per_device_train_batch_size", "8", "--bf16", "false",
        "--max_completion_length", "2", *QUIET, cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    saved = json.loads((letters / "out" / "grpo_config.json").read_text())
    written = __import__("yaml").safe_load(example.read_text())
    assert saved["num_generations"] == written["num_generations"] and saved["beta"] == written["beta"]
    assert json.loads((letters / "out" / "adapter_config.json").read_text())["r"] == written["lora_r"]


def test_eval_command_and_run_demo_are_at_most_80_lines():
    import ast
    import inspect

    from grpokit import cli as cli_module
    from grpokit.demo import task

    for module, name in ((cli_module, "eval_command"), (task, "run_demo")):
        node = next(n for n in ast.walk(ast.parse(inspect.getsource(module))) if getattr(n, "name", "") == name)
        assert node.end_lineno - node.lineno + 1 <= 80, name


@pytest.mark.parametrize(
    "source, command",
    [
        (("editable", "/src/grpokit"), "pip install -e '/src/grpokit[trackers]'"),
        (("directory", "/src/grpokit"), "pip install '/src/grpokit[trackers]'"),
        (("index", None), "pip install 'grpokit[trackers]'"),
        (("file", None), "pip install wandb"),
        (("none", None), "pip install wandb"),
    ],
)
def test_the_install_command_is_for_grpokit_as_installed(monkeypatch, source, command):
    from grpokit import extras

    monkeypatch.setattr(extras, "installed_from", lambda: source)
    assert extras.install_command("trackers", "wandb") == command


def test_unreadable_share_counts_the_characters_a_tokenizer_loses():
    from datasets import Dataset

    from grpokit.data import unreadable_share
    from grpokit.testing import build_char_tokenizer

    tokenizer = build_char_tokenizer("abcd:")
    rows = Dataset.from_list([{"prompt": "ab日本"}, {"prompt": "abcd"}, {"prompt": "a b"}])
    assert unreadable_share(rows, tokenizer) == (2 / 10, 10)  # 2 of 4 + 4 + 2 characters (spaces not counted)
    assert unreadable_share(Dataset.from_list([{"prompt_ids": [1, 2]}]), tokenizer) == (0.0, 0)


def test_qlora_from_the_command_line_trains_an_adapter_on_a_4bit_base(letters):
    pytest.importorskip("bitsandbytes")
    code, _out, err, _ = cli(
        "train", "--model", "tiny", "--dataset", "train.jsonl", "--reward", "exact_match", "--max_steps", "1",
        "--output_dir", "out", "--use_peft", "--load_in_4bit", "--lora_target_modules", "all-linear", *TINY, *QUIET,
        cwd=letters,
    )  # fmt: skip
    assert code == 0, err
    init = json.loads((letters / "out" / "grpo_config.json").read_text())["model_init_kwargs"]
    assert init["quantization_config"]["load_in_4bit"] is True
    adapter = json.loads((letters / "out" / "adapter_config.json").read_text())
    adapted = {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]}  # all-linear, resolved by peft
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
