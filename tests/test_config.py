"""GRPOConfig (`grpokit.config`) and the CLI's YAML/flag parsing (`grpokit.cli.parse_train_args`)."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest

from grpokit.cli import parse_train_args
from grpokit.config import GRPOConfig
from grpokit.logs import TRACKERS

# ------------------------------------------------------------------------------------------------- defaults


def test_defaults_match_trl():
    config = GRPOConfig()
    assert config.loss_type == "dapo"
    assert config.beta == 0.0
    assert config.epsilon == 0.2
    assert config.epsilon_high is None
    assert config.num_generations == 8
    assert config.scale_rewards == "group"
    assert config.importance_sampling_level == "token"
    assert config.num_iterations == 1
    assert config.temperature == 1.0 and config.top_p == 1.0 and config.top_k is None
    assert config.max_completion_length == 512
    assert config.output_dir == "trainer_output" and config.disable_tqdm is False and config.top_k is None
    assert config.learning_rate == 1e-6
    assert config.mask_truncated_completions is False
    assert config.report_to == []


@pytest.mark.parametrize("batch_size, accumulation", [(8, 1), (6, 4), (3, 2)])
def test_steps_per_generation_defaults_to_gradient_accumulation(batch_size, accumulation):
    config = GRPOConfig(
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation, num_generations=2
    )
    assert config.steps_per_generation == accumulation
    assert config.generation_batch_size == batch_size * accumulation


def test_generation_batch_size_sets_steps_per_generation():
    config = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=16, num_generations=4)
    assert config.steps_per_generation == 4
    assert config.generation_batch_size == 16
    with pytest.raises(ValueError, match=r"generation_batch_size \(10\).*per_device_train_batch_size \(4\)"):
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=10)


def test_top_k_zero_means_no_top_k():
    assert GRPOConfig(top_k=0).top_k is None


def test_report_to_is_normalised_to_a_list():
    assert GRPOConfig(report_to="tensorboard").report_to == ["tensorboard"]
    assert GRPOConfig(report_to="none").report_to == []
    # 'all': every supported tracker that is installed (transformers' meaning), metrics.jsonl always.
    installed = [name for name in TRACKERS if importlib.util.find_spec(TRACKERS[name].module)]
    assert GRPOConfig(report_to="all").report_to == installed


def test_unsupported_report_to_fails_naming_the_supported_trackers():
    with pytest.raises(ValueError) as error:
        GRPOConfig(report_to=["tensorboard", "comet_ml"])
    message = str(error.value)
    assert "['comet_ml']" in message and all(name in message for name in TRACKERS)


# ------------------------------------------------------------------------------------------------ validation

# (overrides, words the message must contain: the field's name, and how to fix it where there is a choice)
INVALID = {
    "loss_type": ({"loss_type": "ppo"}, ["loss_type", "'ppo'", "dapo", "grpo"]),
    "scale_rewards": ({"scale_rewards": "std"}, ["scale_rewards", "'group'", "'none'"]),
    "importance_sampling_level": ({"importance_sampling_level": "seq"}, ["importance_sampling_level", "'sequence'"]),
    "lr_scheduler_type": ({"lr_scheduler_type": "exponential"}, ["lr_scheduler_type", "cosine"]),
    "save_strategy": ({"save_strategy": "sometimes"}, ["save_strategy", "'epoch'"]),
    "reward_fn_errors": ({"reward_fn_errors": "skip"}, ["reward_fn_errors", "'none'"]),
    "num_generations=1": ({"num_generations": 1}, ["num_generations", "at least 2"]),
    "max_completion_length=0": ({"max_completion_length": 0}, ["max_completion_length", ">= 1"]),
    "max_completion_length<0": ({"max_completion_length": -4}, ["max_completion_length", ">= 1"]),
    "max_completion_length float": ({"max_completion_length": 2.5}, ["max_completion_length", "integer"]),
    "per_device_train_batch_size=0": ({"per_device_train_batch_size": 0}, ["per_device_train_batch_size"]),
    "num_iterations=0": ({"num_iterations": 0}, ["num_iterations"]),
    "max_prompt_length=0": ({"max_prompt_length": 0}, ["max_prompt_length", "None"]),
    "learning_rate<0": ({"learning_rate": -1e-5}, ["learning_rate", ">= 0"]),
    "learning_rate nan": ({"learning_rate": float("nan")}, ["learning_rate", "finite"]),
    "beta<0": ({"beta": -0.1}, ["beta", ">= 0"]),
    "epsilon=0": ({"epsilon": 0.0}, ["epsilon", "> 0"]),
    "epsilon_high<0": ({"epsilon_high": -0.1}, ["epsilon_high", "> 0"]),
    "delta=1+epsilon": ({"delta": 1.2}, ["delta", "1 + epsilon"]),
    "delta<1+epsilon": ({"delta": 1.1, "epsilon": 0.2}, ["delta", "1 + epsilon"]),
    "temperature=0": ({"temperature": 0.0}, ["temperature", "> 0"]),
    "temperature<0": ({"temperature": -1.0}, ["temperature", "> 0"]),
    "top_p=0": ({"top_p": 0.0}, ["top_p", "(0, 1]"]),
    "top_p>1": ({"top_p": 1.5}, ["top_p", "(0, 1]"]),
    "min_p>1": ({"min_p": 1.5}, ["min_p", "[0, 1]"]),
    "repetition_penalty=0": ({"repetition_penalty": 0.0}, ["repetition_penalty", "1.0 disables"]),
    "top_entropy_quantile<0": ({"top_entropy_quantile": -0.1}, ["top_entropy_quantile", "[0, 1]"]),
    "ref_model_mixup_alpha>1": ({"ref_model_mixup_alpha": 1.5}, ["ref_model_mixup_alpha", "[0, 1]"]),
    "ref_model_sync_steps=0": ({"ref_model_sync_steps": 0}, ["ref_model_sync_steps", ">= 1"]),
    "warmup_ratio>1": ({"warmup_ratio": 1.5}, ["warmup_ratio", "[0, 1]"]),
    "bf16+fp16": ({"bf16": True, "fp16": True}, ["bf16", "fp16", "choose one"]),
    "nothing to train": ({"max_steps": 0, "num_train_epochs": 0}, ["max_steps", "num_train_epochs"]),
    "save_total_limit=0": ({"save_total_limit": 0}, ["save_total_limit", "None"]),
}


@pytest.mark.parametrize("overrides, words", list(INVALID.values()), ids=list(INVALID))
def test_invalid_values_raise_naming_the_field(overrides, words):
    with pytest.raises(ValueError) as error:
        GRPOConfig(**overrides)
    message = str(error.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


@pytest.mark.parametrize(
    "overrides",
    [
        {"scale_rewards": "batch"},
        {"scale_rewards": "none"},
        {"scale_rewards": True},  # TRL's legacy spelling
        {"scale_rewards": False},
        {"delta": 1.21, "epsilon": 0.2},
        {"top_p": 1.0, "min_p": 0.0, "temperature": 0.01},
        {"steps_per_generation": 4, "gradient_accumulation_steps": 2},
        {"importance_sampling_level": "sequence", "loss_type": "grpo"},
        {"max_prompt_length": None},
    ],
)
def test_valid_edge_values_are_accepted(overrides):
    config = GRPOConfig(**overrides)
    for name, value in overrides.items():
        assert getattr(config, name) == value


def test_check_batch_lists_valid_num_generations():
    config = GRPOConfig(per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ValueError) as error:
        config.check_batch(num_processes=1)
    message = str(error.value)
    assert "num_generations (4)" in message
    assert "6 completions" in message
    assert "[2, 3, 6]" in message
    config.check_batch(num_processes=2)  # 12 completions: three groups of 4


def test_check_batch_counts_steps_per_generation():
    config = GRPOConfig(per_device_train_batch_size=2, steps_per_generation=3, num_generations=4)
    with pytest.raises(ValueError, match=r"\[2, 3, 6\]"):
        config.check_batch(num_processes=1)
    config.check_batch(num_processes=2)


# -------------------------------------------------------------------------------- accepted, not implemented


@pytest.mark.parametrize(
    "name, value",
    [("use_liger_kernel", True), ("neftune_noise_alpha", 5.0), ("use_transformers_continuous_batching", True)],
)
def test_not_implemented_fields_warn_by_name(name, value):
    with pytest.warns(UserWarning) as record:
        GRPOConfig(**{name: value})
    messages = [str(w.message) for w in record]
    assert any(f"GRPOConfig.{name}=" in m and "not implemented" in m for m in messages), messages
    # The warning points at the line that built the config, not at grpokit's internals.
    assert all(w.filename == __file__ for w in record), [w.filename for w in record]


def test_defaults_and_implemented_fields_do_not_warn():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        GRPOConfig()
        GRPOConfig(learning_rate=1e-5, num_generations=4, per_device_train_batch_size=4, bf16=True, beta=0.04)
        GRPOConfig(use_vllm=False, optim="adamw_torch")  # set explicitly, but to the default
    assert [str(w.message) for w in record] == []


# ------------------------------------------------------------------------------------------- dict round trip


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError) as error:
        GRPOConfig.from_dict({"learning_rat": 1e-3, "num_generations": 4, "kl_coef": 0.1})
    message = str(error.value)
    assert "'kl_coef'" in message and "'learning_rat'" in message
    assert "'num_generations'" not in message


def test_to_dict_from_dict_round_trip(tmp_path):
    config = GRPOConfig(
        learning_rate=3e-4,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        loss_type="grpo",
        report_to="tensorboard",
        reward_weights=[1.0, 0.5],
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        epsilon_high=0.28,
        top_k=20,
        beta=0.04,
    )
    values = config.to_dict()
    assert values["learning_rate"] == 3e-4 and values["reward_weights"] == [1.0, 0.5]
    assert values["steps_per_generation"] == 2 and values["generation_batch_size"] == 16
    assert GRPOConfig.from_dict(values) == config
    # Through the JSON file the trainer writes next to checkpoints.
    config.save(tmp_path / "config.json")
    assert GRPOConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == config
    assert GRPOConfig.from_dict(values) != GRPOConfig()


# ------------------------------------------------------------------------------------------------------ CLI


def write_yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_flags_override_the_yaml_file(tmp_path):
    path = write_yaml(
        tmp_path,
        "model: ./tiny\ndataset: data.jsonl\nreward: accuracy\n"
        "learning_rate: 5e-6\nnum_generations: 4\nmax_steps: 20\nloss_type: grpo\n",
    )
    run, values = parse_train_args([path, "--learning_rate", "1e-3", "--max_steps", "5", "--model", "other"])
    assert run == {
        "model": "other",
        "dataset": "data.jsonl",
        "dataset_split": None,
        "reward": ["accuracy"],
        "eval_dataset": None,
        "eval_dataset_split": None,
        "rename_column": {},
        "peft_config": None,  # TRL's ModelConfig names (--use_peft, --lora_r, ...) or a YAML peft_config mapping
        "model_options": {},
        "overwrite_output_dir": False,
    }
    path = write_yaml(tmp_path, "model: m\nrename_column: {question: prompt}\n")
    assert parse_train_args([path, "--rename_column", "answer=target"])[0]["rename_column"] == {"answer": "target"}
    assert parse_train_args([path])[0]["rename_column"] == {"question": "prompt"}
    assert values["learning_rate"] == 1e-3 and type(values["learning_rate"]) is float
    assert values["max_steps"] == 5 and type(values["max_steps"]) is int
    assert values["num_generations"] == 4 and values["loss_type"] == "grpo"  # from the file
    config = GRPOConfig(**values)
    assert (config.learning_rate, config.max_steps, config.num_generations) == (1e-3, 5, 4)


def test_yaml_exponent_floats_are_coerced(tmp_path):
    # PyYAML reads `5e-6` (no dot) as a string; a float field must still get a float.
    _, values = parse_train_args([write_yaml(tmp_path, "learning_rate: 5e-6\nbeta: 4e-2\n")])
    assert values == {"learning_rate": 5e-6, "beta": 0.04}
    assert all(type(v) is float for v in values.values())


@pytest.mark.parametrize(
    "argv, name, expected",
    [
        (["--learning_rate", "1e-3"], "learning_rate", 1e-3),
        (["--bf16"], "bf16", True),
        (["--bf16", "false"], "bf16", False),
        (["--bf16", "true"], "bf16", True),
        (["--top_k", "null"], "top_k", None),
        (["--top_k", "none"], "top_k", None),
        (["--top_k", "20"], "top_k", 20),
        (["--reward_weights", "[1, 0.5]"], "reward_weights", [1, 0.5]),
        (["--max_steps", "5"], "max_steps", 5),
        (["--num_train_epochs", "2"], "num_train_epochs", 2.0),
        (["--loss_type", "dr_grpo"], "loss_type", "dr_grpo"),
        (["--lr_scheduler_kwargs", "{min_lr_rate: 0.1}"], "lr_scheduler_kwargs", {"min_lr_rate": 0.1}),
        (["--save_strategy", "no"], "save_strategy", "no"),  # not YAML's False
        (["--logging_steps", "5"], "logging_steps", 5.0),
        (["--run_name", "2024"], "run_name", "2024"),
        (["--warmup_steps", "0.1"], "warmup_steps", 0.1),
    ],
)
def test_flag_values_are_parsed_and_coerced(argv, name, expected):
    _, values = parse_train_args(argv)
    assert values == {name: expected}
    assert type(values[name]) is type(expected)


@pytest.mark.parametrize("name, raw, expected", [("min_p", "5e-2", 0.05), ("epsilon_high", "3e-1", 0.3)])
def test_exponent_floats_are_coerced_for_fields_that_default_to_none(tmp_path, name, raw, expected):
    # A float field whose default is None gets a float from `5e-2` too, from a flag or from the file; a string
    # would make validation fail with a TypeError.
    from_flag = parse_train_args([f"--{name}", raw])[1]
    from_file = parse_train_args([write_yaml(tmp_path, f"{name}: {raw}\n")])[1]
    for values in (from_flag, from_file):
        assert values == {name: expected} and type(values[name]) is float
        assert getattr(GRPOConfig(**values), name) == expected


def test_yaml_no_is_the_word_for_string_fields(tmp_path):
    _, values = parse_train_args([write_yaml(tmp_path, "save_strategy: no\neval_strategy: no\n")])
    assert values == {"save_strategy": "no", "eval_strategy": "no"}


def test_number_flag_rejects_words():
    with pytest.raises(ValueError, match="--max_steps takes a number, not 'many'"):
        parse_train_args(["--max_steps", "many"])


def test_scale_rewards_none_flag_stays_the_string_none():
    # 'none' is one of scale_rewards' values (no scaling), not YAML's null.
    _, values = parse_train_args(["--scale_rewards", "none"])
    assert values == {"scale_rewards": "none"}
    assert GRPOConfig(**values).scale_rewards == "none"


def test_bool_flag_rejects_other_words():
    with pytest.raises(ValueError, match="--bf16 takes true or false"):
        parse_train_args(["--bf16", "maybe"])


def test_repeated_reward_flags_collect_into_a_list(tmp_path):
    run, _ = parse_train_args(["--reward", "accuracy", "--reward", "mymod:score", "--reward", "think_format"])
    assert run["reward"] == ["accuracy", "mymod:score", "think_format"]
    # Flags replace the file's list; the file alone gives its list (TRL's `reward_funcs` spelling too).
    path = write_yaml(tmp_path, "reward_funcs: [length, accuracy]\n")
    assert parse_train_args([path])[0]["reward"] == ["length", "accuracy"]
    assert parse_train_args([path, "--reward", "think_format"])[0]["reward"] == ["think_format"]


def test_unknown_yaml_keys_raise_by_name(tmp_path):
    path = write_yaml(tmp_path, "learning_rate: 1e-5\nlearnig_rate: 1e-5\nkl_coef: 0.1\n")
    with pytest.raises(ValueError) as error:
        parse_train_args([path])
    message = str(error.value)
    assert "kl_coef, learnig_rate." in message  # both unknown keys, not the known one
    assert "Did you mean learning_rate?" in message


def test_unknown_flag_is_an_error_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown option --learnig_rate. Did you mean --learning_rate"):
        parse_train_args(["--learnig_rate", "1e-5"])
    with pytest.raises(ValueError, match="unknown option --learning_rat"):  # no argparse prefix matching
        parse_train_args(["--learning_rat", "1e-5"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope.yaml not found"):
        parse_train_args([str(tmp_path / "nope.yaml")])


def test_the_config_is_saved_as_written(tmp_path):
    import json

    config = GRPOConfig(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, report_to="none", top_k=0
    )
    assert config.steps_per_generation == 2 and config.generation_batch_size == 8  # derived
    config.save(tmp_path / "grpo_config.json")
    saved = json.loads((tmp_path / "grpo_config.json").read_text())
    assert saved["steps_per_generation"] is None and saved["generation_batch_size"] is None  # as written
    assert saved["report_to"] == "none" and saved["top_k"] == 0
    assert GRPOConfig.from_dict(saved).to_dict() == config.to_dict()  # derived again, the same
