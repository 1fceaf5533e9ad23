"""TRL's renamed config fields (grpokit/trl_renames.json, `grpokit.config.TRL_RENAMES`): the old name keeps working,
moved to the new name with a FutureWarning that names the TRL release; both names set to different values is an
error naming both; the guide lists every row."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import grpokit
from grpokit.config import TRL_RENAMES

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "from-trl.md"
# A value other than the old name's default, for each row.
VALUES = {
    "use_liger_loss": True,
    "wandb_log_unique_prompts": True,
    "use_transformers_paged": True,
    "vllm_importance_sampling_cap": 2.0,
}
# Two different non-default values (old, new), for the rows whose values can differ while both are set (a bool set
# away from its default False is True under either name: the same value).
CONFLICTS = {"vllm_importance_sampling_cap": (2.0, 4.0)}
ROWS = {row["old"]: row for row in TRL_RENAMES}


def build(config_class=grpokit.GRPOConfig, **values):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = config_class(**values)
    return config, [w for w in record if issubclass(w.category, FutureWarning)]


def test_each_row_renames_a_field_of_its_config_to_another_in_a_trl_release():
    assert set(VALUES) == set(ROWS), "a row was added or removed: give its test value here"
    assert len(ROWS) == len(TRL_RENAMES), "an old name is in the table twice"
    for row in TRL_RENAMES:
        fields = getattr(grpokit, row["config"]).__dataclass_fields__
        assert row["old"] in fields and row["new"] in fields and row["old"] != row["new"], row
        assert re.fullmatch(r"\d+\.\d+\.\d+", row["trl"]) and row["source"], row
        assert row["new"] not in ROWS, f"{row['new']} is renamed again: point {row['old']} at the last name"


@pytest.mark.parametrize("old", list(VALUES))
def test_the_old_name_moves_to_the_new_one_with_a_future_warning_naming_the_release(old):
    row, value = ROWS[old], VALUES[old]
    config, record = build(**{old: value})
    assert getattr(config, row["new"]) == value
    assert getattr(config, old) == grpokit.GRPOConfig.__dataclass_fields__[old].default  # one place holds it
    (warning,) = [w for w in record if old in str(w.message)]
    assert f"GRPOConfig.{old} is deprecated: TRL {row['trl']} renamed it {row['new']}" in str(warning.message)


@pytest.mark.parametrize("old", list(CONFLICTS))
def test_both_names_with_different_values_is_an_error_naming_both(old):
    new, (old_value, new_value) = ROWS[old]["new"], CONFLICTS[old]
    with pytest.raises(
        ValueError, match=rf"^{old}={old_value} and {new}={new_value} set one option twice.*Give only {new}"
    ):
        grpokit.GRPOConfig(**{old: old_value, new: new_value})


@pytest.mark.parametrize("old", list(VALUES))
def test_both_names_with_the_same_value_is_that_value(old):
    new, value = ROWS[old]["new"], VALUES[old]
    config, _ = build(**{old: value, new: value})
    assert getattr(config, new) == value


def test_a_rename_applies_to_the_configs_built_on_grpoconfig(tmp_path):
    config, record = build(grpokit.AsyncGRPOConfig, output_dir=str(tmp_path), vllm_importance_sampling_cap=2.0)
    assert config.vllm_importance_sampling_clip_max == 2.0
    assert any("AsyncGRPOConfig.vllm_importance_sampling_cap is deprecated" in str(w.message) for w in record)


def test_the_guide_lists_every_rename_with_its_release():
    guide = GUIDE.read_text()
    for row in TRL_RENAMES:
        assert f"| `{row['old']}` | `{row['new']}` | {row['trl']} |" in guide, row


# TRL v1.18.0's release notes (https://github.com/huggingface/trl/releases/tag/v1.18.0) say AsyncGRPOConfig's fields
# were renamed and its three timeouts merged into one, without naming the new fields: grpokit takes TRL 1.16's names,
# and a keyword that is none of them says which to write.
TRL_116_TIMEOUTS = {"vllm_server_timeout": 30.0, "request_timeout": 60, "weight_sync_timeout": 90}


def test_a_name_async_grpo_config_lacks_fails_naming_trl_116s_three_timeouts(tmp_path):
    with pytest.raises(TypeError) as error:
        grpokit.AsyncGRPOConfig(output_dir=str(tmp_path), timeout=60)
    message = str(error.value)
    assert message.startswith("AsyncGRPOConfig() got an unexpected keyword argument 'timeout': not a field of ")
    assert "TRL 1.16's AsyncGRPOConfig" in message and "docs/guides/from-trl.md#trl-versions" in message
    for name in TRL_116_TIMEOUTS:
        assert f" {name} (" in message, name
    assert "\n" not in message


def test_trl_116s_three_timeouts_land_in_their_fields(tmp_path):
    config = grpokit.AsyncGRPOConfig(output_dir=str(tmp_path), **TRL_116_TIMEOUTS)
    assert {name: getattr(config, name) for name in TRL_116_TIMEOUTS} == TRL_116_TIMEOUTS


def test_a_misspelt_field_names_the_nearest_one():
    with pytest.raises(
        TypeError,
        match=r"^GRPOConfig\(\) got an unexpected keyword argument 'num_generation': .*"
        r"'num_generation': did you mean 'num_generations'\? grpokit takes the names of TRL 1\.16's "
        r"GRPOConfig",
    ):
        grpokit.GRPOConfig(num_generation=4)
    with pytest.raises(TypeError, match=r"got unexpected keyword arguments 'beta_kl', 'num_generation': not fields"):
        grpokit.GRPOConfig(num_generation=4, beta_kl=0.1)
    with pytest.raises(ValueError, match=r"^Unknown GRPOConfig field\(s\) \['num_generation'\]: .*did you mean "):
        grpokit.GRPOConfig.from_dict({"num_generation": 4})


def test_copies_of_a_config_are_built_without_the_keyword_check_in_the_way(tmp_path):
    import copy
    import dataclasses
    import pickle

    config = grpokit.AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=3, request_timeout=60)
    for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert type(copied) is grpokit.AsyncGRPOConfig and copied.to_dict() == config.to_dict()
    assert dataclasses.replace(config, max_steps=5).max_steps == 5
