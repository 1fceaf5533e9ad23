"""GRPOConfig is a drop-in for TRL 1.16's: every field of `trl.GRPOConfig` (grpokit/trl_fields.json) is accepted with
TRL's default, is either implemented or listed as not implemented / of no effect, and the older grpokit names warn
and keep working. The JSON itself is checked against the installed trl where there is one."""

import dataclasses
import importlib.util
import json
import math
import re
import warnings
from importlib.resources import files
from pathlib import Path

import pytest

import grpokit
from grpokit.cli import _field_types, parse_train_args
from grpokit.config import (
    DEPRECATED,
    IMPLEMENTED,
    NO_EFFECT,
    NOT_IMPLEMENTED,
    TRL_RENAMES,
    GRPOConfig,
    _default_of,
)

ROOT = Path(__file__).resolve().parents[1]
TRL = json.loads(files("grpokit").joinpath("trl_fields.json").read_text())
TRL_FIELDS: dict = TRL["fields"]
IMPLEMENTED_TRL = [name for name in IMPLEMENTED if name in TRL_FIELDS]
# Fields whose grpokit default is not TRL's, so that passing TRL's default explicitly warns: grpokit does what
# TRL's *other* value does (its KL has no importance-ratio correction).
DEFAULTS_THAT_WARN: set[str] = set()  # TRL defaults grpokit does not implement (none today)
# Implemented fields that grpokit's own code does not read by name: transformers reads them, through grpokit.
READ_BY_TRANSFORMERS = {
    "optim_args": "Trainer.get_optimizer_cls_and_kwargs, called by grpokit.optim",
    "optim_target_modules": "GaLore/APOLLO handlers, called by grpokit.optim",
    **dict.fromkeys(
        ("adam_beta1", "adam_beta2", "adam_epsilon"),
        "the optimizer's hyperparameters, Trainer.get_optimizer_cls_and_kwargs (grpokit.optim)",
    ),
}


def build(**values):
    """GRPOConfig(**values) and the warnings it gave (DeprecationWarnings from imports left out)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = GRPOConfig(**values)
    return config, [w for w in record if not issubclass(w.category, DeprecationWarning)]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------- the TRL surface


@pytest.mark.parametrize("name", list(TRL_FIELDS))
def test_every_trl_field_is_accepted_with_trls_default(name):
    _, record = build(**{name: TRL_FIELDS[name]})
    warned = [str(w.message) for w in record]
    if name in DEFAULTS_THAT_WARN:
        assert len(warned) == 1 and f"GRPOConfig.{name}=" in warned[0], warned
    else:
        assert warned == []


def test_every_trl_field_is_implemented_or_listed():
    kinds = [set(IMPLEMENTED), set(NOT_IMPLEMENTED), set(NO_EFFECT), set(DEPRECATED)]
    assert sum(len(kind) for kind in kinds) == len(set().union(*kinds)), "a field has two kinds"
    assert set(TRL_FIELDS) <= set(IMPLEMENTED) | set(NOT_IMPLEMENTED) | set(NO_EFFECT)
    assert not set(DEPRECATED) & set(TRL_FIELDS), "a TRL 1.16 field is marked deprecated"
    assert set(GRPOConfig.__dataclass_fields__) == set().union(*kinds)
    for name, message in {**NOT_IMPLEMENTED, **NO_EFFECT, **DEPRECATED}.items():
        assert message.strip() and "\n" not in message and len(message) < 200, name


def test_implemented_fields_are_read_by_grpokit():
    # "Implemented" is a claim about the code: something outside the field's declaration reads it (the rename table
    # is read by GRPOConfig._apply_renames).
    package = Path(grpokit.__file__).parent
    source = "\n".join(path.read_text() for path in [*package.rglob("*.py"), package / "trl_renames.json"])
    unread = [
        name
        for name in IMPLEMENTED
        if name not in READ_BY_TRANSFORMERS and not re.search(rf"\.{name}\b|[\"']{name}[\"']", source)
    ]
    assert unread == []


def test_counts(capsys):
    counts = {
        "TRL fields": len(TRL_FIELDS),
        "implemented": len(IMPLEMENTED_TRL),
        "not implemented": len(NOT_IMPLEMENTED),
        "no effect needed": len(NO_EFFECT),
        "grpokit-only": len(IMPLEMENTED) - len(IMPLEMENTED_TRL),
        "deprecated": len(DEPRECATED),
    }
    with capsys.disabled():
        print("\nGRPOConfig vs trl " + TRL["versions"]["trl"] + ": " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    assert counts["implemented"] + counts["not implemented"] + counts["no effect needed"] == counts["TRL fields"]
    # The "Coming from TRL" guide states the same numbers.
    section = (ROOT / "docs" / "guides" / "from-trl.md").read_text()
    section = " ".join(section.split())
    for number, words in [
        (len(TRL_FIELDS), "fields"),
        (counts["implemented"], "implemented"),
        (counts["not implemented"], "not implemented"),
        (counts["no effect needed"], "no effect"),
        (counts["deprecated"], "deprecated"),
    ]:
        assert re.search(rf"\b{number}\b[^.;]*{words}", section), f"docs/guides/from-trl.md: {number} ... {words}"


# ------------------------------------------------------------------------------------- not implemented: warned


def other_value(name: str):
    """A value other than the field's default, of the field's type."""
    default, types = _default_of(name), _field_types(name)
    if isinstance(default, bool) or (default is None and "bool" in types):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    for kind, value in (("float", 0.5), ("int", 2), ("dict", {"key": 1}), ("list", ["x"]), ("str", "other")):
        if kind in types:
            return value
    return {"tp_size": 2}  # parallelism_config: anything but None


@pytest.mark.parametrize("name", [name for name in NOT_IMPLEMENTED if name not in {r["old"] for r in TRL_RENAMES}])
def test_not_implemented_field_warns_once_by_name(name):  # a renamed one: tests/test_trl_versions.py
    value = other_value(name)
    _, record = build(**{name: value})
    mine = [w for w in record if f"GRPOConfig.{name}=" in str(w.message)]
    assert len(mine) == 1 and len(record) == 1, [str(w.message) for w in record]
    assert mine[0].category is UserWarning
    assert "not implemented" in str(mine[0].message) and NOT_IMPLEMENTED[name] in str(mine[0].message)
    assert mine[0].filename == build.__code__.co_filename  # it points at the line that built the config


@pytest.mark.parametrize("name", list(NO_EFFECT))
def test_no_effect_field_is_accepted_silently(name):
    value = other_value(name)
    config, record = build(**{name: value})
    assert getattr(config, name) == value and record == []


# ------------------------------------------------------------------------------------- deprecated: still work


def test_deprecated_names_warn_naming_the_replacement_and_take_effect(tmp_path):
    cases = {  # name: (value, words the FutureWarning must hold, what must be true of the config)
        "max_prompt_length": (64, ["filter overlong prompts"], lambda c: c.max_prompt_length == 64),
        "warmup_ratio": (0.1, ["warmup_steps"], lambda c: c.warmup_steps or math.ceil(c.warmup_ratio * 100) == 10),
        "logging_dir": (str(tmp_path / "tb"), ["TENSORBOARD_LOGGING_DIR"], lambda c: c.logging_dir.endswith("tb")),
        "use_liger_loss": (True, ["use_liger_kernel"], lambda c: c.use_liger_kernel and not c.use_liger_loss),
        "wandb_log_unique_prompts": (True, ["log_unique_prompts"], lambda c: c.log_unique_prompts),
        "overwrite_output_dir": (True, ["nothing replaces it"], lambda c: True),
    }
    assert set(cases) == set(DEPRECATED)
    for name, (value, words, took_effect) in cases.items():
        config, record = build(**{name: value})
        (deprecation,) = [w for w in record if w.category is FutureWarning]
        assert f"GRPOConfig.{name} is deprecated" in str(deprecation.message)
        assert all(word in str(deprecation.message) for word in words), str(deprecation.message)
        assert took_effect(config), name
    # Renamed to a field grpokit does not implement either: that one warns too.
    _, record = build(use_liger_loss=True)
    assert any("GRPOConfig.use_liger_kernel=True" in str(w.message) for w in record)


def test_warmup_fraction_either_way_and_back_from_a_saved_config():
    new, record = build(warmup_steps=0.1)
    assert record == [] and (new.warmup_steps, new.warmup_ratio) == (0, 0.1)
    old, _ = build(warmup_ratio=0.1)
    assert old == new
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a saved config loads without a deprecation warning
        assert GRPOConfig.from_dict(new.to_dict()) == new
    assert build(warmup_steps=20.0)[0].warmup_steps == 20 and type(build(warmup_steps=20.0)[0].warmup_steps) is int


def test_logging_dir_still_places_the_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from grpokit.logs import MetricSink

    config, _ = build(logging_dir=str(tmp_path / "tb"), report_to="tensorboard", output_dir=str(tmp_path / "out"))
    sink = MetricSink(config.output_dir, config.report_to, None, config.logging_dir, config.to_dict())
    sink.write({"step": 1, "reward": 1.0}, console=False)
    sink.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_activation_checkpointing_is_gradient_checkpointing():
    config, record = build(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True})
    assert (
        record == []
        and config.gradient_checkpointing
        and config.gradient_checkpointing_kwargs == {"use_reentrant": True}
    )
    # A copy that changes the older name is not overruled by an unset newer one.
    assert dataclasses.replace(GRPOConfig(), gradient_checkpointing=True).gradient_checkpointing


def test_trl_spellings_of_values():
    from transformers.trainer_utils import IntervalStrategy, SchedulerType

    config, record = build(
        lr_scheduler_type=SchedulerType.COSINE,
        save_strategy=IntervalStrategy.NO,
        bf16=None,
        top_k=0,
        output_dir=None,
        model_init_kwargs='{"dtype": "float32"}',
        logging_steps=5.0,
    )
    assert record == []
    assert (config.lr_scheduler_type, config.save_strategy) == ("cosine", "no")
    assert type(config.lr_scheduler_type) is str
    assert config.bf16 is True and config.top_k is None and config.output_dir == "trainer_output"
    assert config.model_init_kwargs == {"dtype": "float32"} and type(config.logging_steps) is int
    with pytest.raises(ValueError, match="auto_find_batch_size is not supported by GRPO"):
        GRPOConfig(auto_find_batch_size=True)
    with pytest.raises(ValueError, match=r"needs num_decay_steps in lr_scheduler_kwargs"):
        GRPOConfig(lr_scheduler_type="warmup_stable_decay")


# --------------------------------------------------------------------------------------------------- the CLI


def test_every_field_annotation_is_a_type_the_cli_knows():
    known = {"int", "float", "bool", "str", "dict", "list", "None", "ParallelismConfig"}
    unknown = {
        name: spec.type for name, spec in GRPOConfig.__dataclass_fields__.items() if not _field_types(name) <= known
    }
    assert unknown == {}


@pytest.mark.parametrize(
    "name",
    [name for name, default in TRL_FIELDS.items() if default not in (None, "", []) and not isinstance(default, dict)],
)
def test_every_trl_field_is_a_flag_coerced_to_its_type(name):
    default = TRL_FIELDS[name]
    raw = str(default).lower() if isinstance(default, bool) else str(default)
    _, values = parse_train_args([f"--{name}", raw])
    assert type(values[name]).__name__ in _field_types(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = GRPOConfig(**values)
    # The flag's value, or the config's reading of it (`--include_num_input_tokens_seen no` is YAML's False).
    assert values[name] == default or getattr(config, name) == default


# ---------------------------------------------------------------------------------------------- the JSON file


@pytest.mark.parametrize(
    "config, recorded",
    [
        ("GRPOConfig", "trl_fields.json"),
        ("DistillationConfig", "trl_distillation_fields.json"),
        ("RLOOConfig", "trl_rloo_fields.json"),
        ("AsyncGRPOConfig", "trl_async_grpo_fields.json"),
    ],
)
def test_json_matches_the_installed_trl(config, recorded):
    pytest.importorskip("trl")
    script = load_script("trl_fields")
    committed = json.loads(files("grpokit").joinpath(recorded).read_text())
    installed = script.installed_fields(config)
    if installed["versions"]["trl"] != committed["versions"]["trl"]:
        pytest.skip(f"trl {installed['versions']['trl']} is installed; the JSON is of {committed['versions']['trl']}")
    assert script.drift(committed, installed) == []


def test_drift_names_added_removed_and_changed_fields():
    script = load_script("trl_fields")
    old = {"fields": {"beta": 0.0, "gone": 1, "loss_type": "dapo"}}
    new = {"fields": {"beta": 0.04, "loss_type": "dapo", "added": True}}
    assert script.drift(old, new) == [
        "added: added (default True)",
        "removed: gone",
        "default changed: beta: 0.0 -> 0.04",
    ]


# ------------------------------------------------------------------------- TRL scripts' argument parsers
def test_transformers_argument_parser_builds_grpokit_config_as_trl_scripts_do(tmp_path):
    # TRL's example scripts build GRPOConfig from the command line with TrlParser, an HfArgumentParser: every
    # field must be a flag of its annotation's type, and the flags' defaults must be GRPOConfig's own.
    from transformers import HfArgumentParser

    parser = HfArgumentParser((GRPOConfig,))
    (plain,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    expected = GRPOConfig(output_dir=str(tmp_path))
    assert {f.name: getattr(plain, f.name) for f in dataclasses.fields(GRPOConfig)} == {
        f.name: getattr(expected, f.name) for f in dataclasses.fields(GRPOConfig)
    }
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--learning_rate",
            "3e-6",
            "--num_generations",
            "4",
            "--bf16",
            "false",
            "--gradient_checkpointing",
            "--model_init_kwargs",
            '{"dtype": "bfloat16"}',
            "--reward_weights",
            "1.0",
            "0.5",
            "--report_to",
            "none",
            "--scale_rewards",
            "batch",
            "--fsdp",
            "full_shard auto_wrap",
            "--debug",
            "underflow_overflow",
            "--vllm_group_port",
            "51216",
            "--max_steps",
            "3",
        ]
    )
    assert (args.learning_rate, args.num_generations, args.bf16, args.gradient_checkpointing) == (3e-6, 4, False, True)
    assert args.model_init_kwargs == {"dtype": "bfloat16"} and args.reward_weights == [1.0, 0.5]
    assert (args.report_to, args.scale_rewards, args.debug, args.vllm_group_port) == (
        [],
        "batch",
        ["underflow_overflow"],
        51216,
    )
    assert args.fsdp_plugin_kwargs()["reshard_after_forward"] is True
    # The parser rewrites the dataclass fields' `type` in place; grpokit reads the annotations as written.
    assert GRPOConfig(output_dir=str(tmp_path), chat_template_kwargs='{"a": 1}').chat_template_kwargs == {"a": 1}
    assert parse_train_args(["--model", "m", "--learning_rate", "1e-3", "--reward_weights", "[1, 2]"])[1] == {
        "learning_rate": 1e-3,
        "reward_weights": [1, 2],
    }  # grpokit's own CLI still coerces by the annotations


def test_trl_parser_with_a_yaml_config_builds_grpokit_config(tmp_path):
    trl = pytest.importorskip("trl")
    (tmp_path / "recipe.yaml").write_text(
        "model_name_or_path: Qwen/Qwen2.5-0.5B\nlearning_rate: 2.0e-6\n"
        "num_generations: 4\nbeta: 0.0\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\n"
    )
    parser = trl.TrlParser((trl.ScriptArguments, GRPOConfig, trl.ModelConfig))
    _script, args, model = parser.parse_args_and_config(
        ["--config", str(tmp_path / "recipe.yaml"), "--output_dir", str(tmp_path / "out")]
    )
    assert isinstance(args, GRPOConfig) and model.model_name_or_path == "Qwen/Qwen2.5-0.5B"
    assert (args.learning_rate, args.num_generations, args.beta) == (2e-6, 4, 0.0)
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
