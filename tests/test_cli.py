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
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "grpokit train: error: --model org/no-such-model: not a local directory, and not loadable from the Hub ("
        )
    )


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
