"""AsyncGRPOConfig / AsyncGRPOTrainer (issue 35): every field of TRL 1.16's `trl.experimental.async_grpo`
AsyncGRPOConfig with TRL's default (the recorded list, grpokit/trl_async_grpo_fields.json, is checked against the
installed trl in tests/test_trl_config.py); a TRL async script with only its import changed trains on a tiny model
with the in-process engine, within max_staleness; the default backend is the vLLM server at vllm_server_base_url with
TRL's timeouts; what grpokit cannot honour is refused by name."""

from __future__ import annotations

import dataclasses
import enum
import json
import runpy
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from letters import LETTERS, letter_dataset, repeat_letter, tiny_letter_model
from test_rloo import defaults
from test_vllm_client import served, stand_in_server

from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig
from grpokit.async_grpo import ASYNC_FIELDS
from grpokit.build import build_vllm_engine
from grpokit.rollout.vllm_client import VLLMServerEngine
from grpokit.testing import build_tiny_model, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads(files("grpokit").joinpath("trl_async_grpo_fields.json").read_text())


def installed_trl_async():
    trl = pytest.importorskip("trl")
    if trl.__version__ != RECORDED["versions"]["trl"]:
        pytest.skip(f"trl {trl.__version__} is installed; grpokit follows {RECORDED['versions']['trl']}")
    from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    return TRLAsyncGRPOConfig


# ----------------------------------------------------------------------------------------------- the config


def test_every_trl_field_is_a_field_with_trls_default():
    ours = defaults(AsyncGRPOConfig)
    assert {name: ours.get(name, "<missing>") for name in RECORDED["fields"]} == RECORDED["fields"]
    trl_config = installed_trl_async()
    assert {name: ours[name] for name in defaults(trl_config)} == defaults(trl_config)
    # The values TRL's config holds once built (its __post_init__ run), for the fields TRL declares itself.
    built_trl, built = trl_config(output_dir="unused", use_cpu=True), AsyncGRPOConfig(output_dir="unused")
    own = [name for name in trl_config.__dataclass_fields__ if name in vars(trl_config)["__annotations__"]]

    def plain(value):  # transformers' enums (SchedulerType, ...) as their values
        return value.value if isinstance(value, enum.Enum) else value

    differing = {
        name: (getattr(built, name), plain(getattr(built_trl, name)))
        for name in own
        if plain(getattr(built, name)) != plain(getattr(built_trl, name))
    }
    assert differing == {"top_k": (None, 0)}  # GRPOConfig reads top_k 0 as None: both mean no top-k filtering
    assert (
        built.max_staleness,
        built.logging_steps,
        built.lr_scheduler_type,
        built.max_completion_length,
        built.ignore_data_skip,
        built.vllm_server_base_url,
        built.bf16,
    ) == (4, 1, "constant", 2048, True, "http://localhost:8000", True)


def test_the_fields_grpoconfig_lacks_are_declared_here_and_the_shared_ones_keep_grpoconfigs_meaning():
    grpo = {spec.name: spec for spec in dataclasses.fields(GRPOConfig)}
    assert set(ASYNC_FIELDS) == {name for name in RECORDED["fields"] if name not in grpo}
    for spec in dataclasses.fields(AsyncGRPOConfig):
        if spec.name in ASYNC_FIELDS:
            assert spec.metadata["help"] == ASYNC_FIELDS[spec.name]
        else:
            assert dict(spec.metadata) == dict(grpo[spec.name].metadata), spec.name
    assert issubclass(AsyncGRPOConfig, GRPOConfig)  # every grpokit option applies
    config = AsyncGRPOConfig()
    assert (config.use_vllm, config.vllm_mode) == (True, "server")  # TRL's only backend: the vLLM server
    assert (config.beta, config.loss_type, config.num_iterations) == (0.0, "dapo", 1)  # TRL's async loss


@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"token_budget": 4096}, NotImplementedError, "token_budget=4096: grpokit micro-batches by count"),
        ({"dtype": "float64"}, ValueError, "dtype='float64' is not one of"),
        ({"max_inflight_tasks": 0}, ValueError, "max_inflight_tasks=0: give a positive count"),
        ({"request_timeout": 0}, ValueError, "request_timeout=0 and weight_sync_timeout=1800 must be positive"),
    ],
)
def test_values_grpokit_cannot_honour_are_refused_by_name(values, error, message):
    with pytest.raises(error, match=message):
        AsyncGRPOConfig(**values)
    for accepted in (None, 0, -1):  # TRL's default (the server's max_model_len) and its count-based packing
        assert AsyncGRPOConfig(token_budget=accepted).token_budget == accepted


# ------------------------------------------------------------------------------------ a TRL script, as it is

# A TRL AsyncGRPO script (TRL's documented example, made offline: a local model, the letter task). Its config comes
# from the command line, as in TRL's example scripts, so the in-process engine is a flag (--use_vllm false; TRL's
# own needs a vLLM server) and the script's text changes in its import only.
TRL_ASYNC_SCRIPT = """
from dataclasses import dataclass

from datasets import Dataset
from trl import TrlParser
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = "Qwen/Qwen2.5-0.5B-Instruct"


def repeat_letter(completions, letter, **kwargs):
    return [1.0 if completion[:1] == target else 0.0 for completion, target in zip(completions, letter)]


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, AsyncGRPOConfig))
    script_args, training_args = parser.parse_args_and_config()
    dataset = Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in "abcdefgh"] * 8)
    trainer = AsyncGRPOTrainer(model=script_args.model_name_or_path, reward_funcs=repeat_letter, args=training_args, train_dataset=dataset)
    trainer.train()
"""


def test_a_trl_async_script_runs_with_only_the_import_changed(tmp_path, monkeypatch):
    model_dir = save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32)
    script = TRL_ASYNC_SCRIPT.replace("from trl.experimental.async_grpo import", "from grpokit import")
    changed = [line for old, line in zip(TRL_ASYNC_SCRIPT.splitlines(), script.splitlines()) if old != line]
    assert changed == ["from grpokit import AsyncGRPOConfig, AsyncGRPOTrainer"]
    (tmp_path / "train_async_grpo.py").write_text(script)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train_async_grpo.py",
            "--output_dir",
            str(tmp_path / "out"),
            "--use_vllm",
            "false",
            "--bf16",
            "false",
            "--per_device_train_batch_size",
            "16",
            "--num_generations",
            "4",
            "--max_completion_length",
            "2",
            "--max_steps",
            "4",
            "--max_staleness",
            "1",
            "--learning_rate",
            "1e-2",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
            "--disable_tqdm",
            "true",
            "--model_name_or_path",
            str(model_dir),
        ],
    )
    trainer = runpy.run_path(str(tmp_path / "train_async_grpo.py"), run_name="__main__")["trainer"]
    args = trainer.args
    assert isinstance(trainer, AsyncGRPOTrainer) and trainer.state.global_step == 4
    assert (args.max_staleness, args.gradient_checkpointing, args.lr_scheduler_type) == (1, True, "constant")
    assert args.model_init_kwargs == {"dtype": "float32"}  # TRL's dtype, applied when loading from a path
    steps = [record for record in trainer.state.log_history if "sample/staleness_max" in record]
    assert len(steps) == 4 and all(r["sample/staleness_max"] <= args.max_staleness for r in steps)  # logging_steps 1
    assert all(key in steps[0] for key in ("loss", "reward", "sample/dropped_stale_total", "perf/rollout_wait_s"))
    # TRL's attributes
    assert (trainer.epsilon_low, trainer.epsilon_high, trainer.temperature) == (0.2, 0.2, 1.0)
    assert trainer.model_version == 4 and trainer.aux_loss_enabled is False
    assert args.max_inflight_tasks == 1 * 16 * 1 * 1  # TRL's auto: max_staleness × completions per step
    for name in ("rollout_worker", "rollout_queue", "weight_transfer", "vllm_client"):
        with pytest.raises(AttributeError, match=f"AsyncGRPOTrainer.{name} is TRL's child-process rollout"):
            getattr(trainer, name)
        assert getattr(trainer, name, None) is None


def test_trainer_arguments_are_trls_and_its_plug_ins_are_refused_by_name(tmp_path):
    import inspect

    trl_config = installed_trl_async()  # noqa: F841 (skips without the recorded trl)
    from trl.experimental.async_grpo import AsyncGRPOTrainer as TRLAsyncGRPOTrainer

    trl_names = list(inspect.signature(TRLAsyncGRPOTrainer.__init__).parameters)
    assert list(inspect.signature(AsyncGRPOTrainer.__init__).parameters)[: len(trl_names)] == trl_names
    model, tokenizer = tiny_letter_model()
    args = AsyncGRPOConfig(output_dir=str(tmp_path), use_vllm=False, report_to="none")
    for option in ("rollout_worker", "weight_transfer"):
        with pytest.raises(NotImplementedError, match=f"AsyncGRPOTrainer\\({option}=...\\) plugs into TRL's"):
            AsyncGRPOTrainer(model, repeat_letter, args, letter_dataset(), tokenizer, **{option: object()})
    with pytest.raises(TypeError, match="AsyncGRPOTrainer takes an AsyncGRPOConfig"):
        AsyncGRPOTrainer(model, repeat_letter, GRPOConfig(), letter_dataset(), tokenizer)
    with pytest.raises(ValueError, match=r"dtype='bfloat16' applies when the model is loaded from a path"):
        AsyncGRPOTrainer(
            model,
            repeat_letter,
            AsyncGRPOConfig(output_dir=str(tmp_path), use_vllm=False, dtype="bfloat16"),
            letter_dataset(),
            tokenizer,
        )


# ---------------------------------------------------------------------------------------- the vLLM server


def test_the_default_backend_is_the_vllm_server_at_the_base_url_with_trls_timeouts(tmp_path):
    model = build_tiny_model(40, hidden_size=32)
    with stand_in_server({**served(model.config), "instance": "i"}) as url:
        engine = build_vllm_engine(model, AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=url))
        assert isinstance(engine, VLLMServerEngine) and engine.base_url == url
        assert (engine.timeout, engine.request_timeout, engine.weight_sync_timeout) == (
            240.0,
            (600, "request_timeout"),
            (1800, "weight_sync_timeout"),
        )
        plain = build_vllm_engine(
            model,
            GRPOConfig(
                output_dir=str(tmp_path),
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_url=url,
                vllm_server_timeout=30,
            ),
        )
        assert plain.request_timeout == plain.weight_sync_timeout == (30, "vllm_server_timeout")  # as before


def test_with_no_server_it_says_at_once_that_it_waits_for_what_and_both_ways_out(tmp_path):
    """TRL's defaults without a server: said within a second, not after vllm_server_timeout (240 s) of silence."""
    import logging
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    said = []

    class Record(logging.Handler):
        def emit(self, record):
            said.append((time.monotonic(), record.getMessage()))

    handler, started = Record(level=logging.WARNING), time.monotonic()
    logging.getLogger("grpokit").addHandler(handler)
    model, tokenizer = tiny_letter_model()
    try:
        with pytest.raises(
            ConnectionError,
            match=r"after 3 s \(vllm_server_timeout\): start one with `grpokit "
            rf"vllm-serve --model MODEL_DIR --port {port}`.* or sample in this "
            r"process instead with use_vllm=False",
        ):
            AsyncGRPOTrainer(
                model,
                repeat_letter,
                AsyncGRPOConfig(
                    output_dir=str(tmp_path),
                    vllm_server_timeout=3,
                    max_completion_length=8,
                    vllm_server_base_url=f"http://127.0.0.1:{port}",
                ),
                letter_dataset(),
                tokenizer,
            )
    finally:
        logging.getLogger("grpokit").removeHandler(handler)
    ((when, message),) = [(when, message) for when, message in said if "Waiting" in message]
    assert when - started < 3  # (the model is built first; the first refused connection is said at once)
    assert message == (
        f"Waiting up to 3 s (vllm_server_timeout) for a vLLM server at http://127.0.0.1:{port} "
        "(use_vllm=True, vllm_mode='server'): none answers yet. Either start one with `grpokit "
        f"vllm-serve --model MODEL_DIR --port {port}` (or check vllm_server_base_url / "
        "vllm_server_host / vllm_server_port), or sample in this process instead with use_vllm=False."
    )


def test_a_model_object_in_the_configs_dtype_is_taken(tmp_path):
    model, tokenizer = tiny_letter_model()
    trainer = AsyncGRPOTrainer(
        model,
        repeat_letter,
        AsyncGRPOConfig(output_dir=str(tmp_path), use_vllm=False, max_completion_length=2, report_to="none"),
        letter_dataset(),
        tokenizer,
    )
    assert trainer.args.model_init_kwargs is None and next(trainer.unwrapped_model.parameters()).dtype == torch.float32
