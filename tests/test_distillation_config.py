"""DistillationConfig has TRL 1.16's `trl.DistillationConfig` fields, in TRL's order, with TRL's defaults; its
shared fields are grpokit's GRPOConfig's (help and kind); `beta` is the divergence's and is checked."""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files
from pathlib import Path

import pytest

from grpokit.config import GRPOConfig
from grpokit.distillation_config import DISTILLATION_FIELDS, DistillationConfig

ROOT = Path(__file__).resolve().parents[1]
TRL = json.loads(files("grpokit").joinpath("trl_distillation_fields.json").read_text())


def defaults(config_class) -> dict:
    """{name: default} of a dataclass's init fields, in declaration order (factories called)."""
    out = {}
    for spec in dataclasses.fields(config_class):
        if spec.init:
            has_factory = spec.default_factory is not dataclasses.MISSING
            out[spec.name] = spec.default_factory() if has_factory else spec.default
    return out


def test_fields_and_defaults_are_the_recorded_trl_ones():
    assert defaults(DistillationConfig) == TRL["fields"]
    assert list(defaults(DistillationConfig)) == list(TRL["fields"])  # and in TRL's order


def test_fields_and_defaults_are_the_installed_trls():
    trl = pytest.importorskip("trl")
    if trl.__version__ != TRL["versions"]["trl"]:
        pytest.skip(f"trl {trl.__version__} is installed; grpokit follows {TRL['versions']['trl']}")
    expected = defaults(trl.DistillationConfig)
    actual = defaults(DistillationConfig)
    assert list(actual) == list(expected)
    assert {name: value for name, value in actual.items() if value != expected[name]} == {}
    assert DistillationConfig().beta == trl.DistillationConfig(output_dir="unused", use_cpu=True).beta == 1.0


def test_shared_fields_are_grpoconfigs_and_the_rest_are_declared_here():
    grpo = {spec.name: spec for spec in dataclasses.fields(GRPOConfig)}
    for spec in dataclasses.fields(DistillationConfig):
        if spec.name in DISTILLATION_FIELDS:
            assert spec.metadata["help"] == DISTILLATION_FIELDS[spec.name][1]
        else:
            assert dict(spec.metadata) == dict(grpo[spec.name].metadata), spec.name
    assert set(DISTILLATION_FIELDS) == {
        "teacher_model_name_or_path",
        "teacher_model_revision",
        "teacher_model_init_kwargs",
        "beta",
    }


def test_values_and_beta_check():
    config = DistillationConfig(
        teacher_model_name_or_path="teacher", beta=0.5, temperature=0.7, teacher_model_init_kwargs={"dtype": "bfloat16"}
    )
    assert (config.teacher_model_name_or_path, config.beta, config.temperature) == ("teacher", 0.5, 0.7)
    assert config.teacher_model_init_kwargs == {"dtype": "bfloat16"}
    assert DistillationConfig().teacher_model_init_kwargs is None
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\], got 1.5: 0 = forward KL"):
        DistillationConfig(beta=1.5)
    assert not hasattr(DistillationConfig(), "num_generations")  # a GRPO-only field
