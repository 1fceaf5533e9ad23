"""DistillationConfig: TRL 1.16's `trl.DistillationConfig` surface (issue 37), and the GRPOConfig that grpokit's one
training loop runs a distillation on (`loop_config`).

TRL's DistillationConfig is its GRPOConfig's fields (those of `transformers.TrainingArguments` and the generation,
vLLM and logging ones) less the GRPO-only ones, with `beta` redefined, plus three teacher fields; its defaults are
TRL GRPOConfig's but for `beta` (1.0). So this dataclass takes every field TRL's has, in TRL's order
(`grpokit/trl_distillation_fields.json`, written by `scripts/trl_fields.py`), with TRL's default, and the help and
kind (implemented / not implemented / no effect) of grpokit's GRPOConfig field of the same name: one definition of
what e.g. `vllm_mode` means. Only the teacher fields and `beta` are declared here.

Where grpokit's GRPOConfig departs from TRL's default (`optim`, `bf16`, `gradient_checkpointing`,
`logging_first_step`, `disable_dropout`, `vllm_group_port`), this class keeps TRL's: a TRL distillation script's
config, built with only the import changed, holds the same values as TRL's.
"""

from __future__ import annotations

import dataclasses
import json
from importlib.resources import files

from .config import GRPOConfig, trl_config_fields

TRL_DISTILLATION_FIELDS: dict = json.loads(files("grpokit").joinpath("trl_distillation_fields.json").read_text())

# The fields GRPOConfig has not, or has with another meaning: name -> (annotation, help)
DISTILLATION_FIELDS = {
    "teacher_model_name_or_path": (
        "str | None",
        (
            "Model id or path of the teacher, when `teacher_model` is not given to the trainer. It must share the "
            "student's tokenizer (`distillation.check_shared_tokenizer`)."
        ),
    ),
    "teacher_model_revision": ("str | None", "Revision (branch, tag or commit) of the teacher model."),
    "teacher_model_init_kwargs": (
        "dict | str | None",
        (
            "Keyword arguments of the teacher's `from_pretrained` (e.g. its dtype or quantization), as "
            "model_init_kwargs."
        ),
    ),
    "beta": (
        "float",
        (
            "The divergence (`loss.generalized_jsd`): 0 = forward KL(teacher ‖ student), 0.5 = JSD, 1 = reverse "
            "KL(student ‖ teacher). Not GRPO's KL coefficient: there is no reference model."
        ),
    ),
}


def _validate(config) -> None:
    if not 0.0 <= config.beta <= 1.0:
        raise ValueError(
            f"beta must be in [0, 1], got {config.beta}: 0 = forward KL, 0.5 = JSD, 1 = reverse KL. It picks the "
            "divergence; it is not GRPO's KL coefficient."
        )


DistillationConfig = dataclasses.make_dataclass(
    "DistillationConfig",
    trl_config_fields(TRL_DISTILLATION_FIELDS["fields"], DISTILLATION_FIELDS),
    namespace={
        "__post_init__": _validate,
        "__module__": __name__,
        "__doc__": "TRL 1.16's `DistillationConfig` fields and defaults (see the module docstring).",
    },
)


class DistillationLoopConfig(GRPOConfig):
    """The GRPOConfig a `DistillationTrainer` runs grpokit's loop with: groups of one completion per prompt (no
    advantage compares completions), so `min_num_generations` is 1."""

    min_num_generations = 1


def loop_config(config) -> DistillationLoopConfig:
    """The loop's settings for a DistillationConfig: every shared field as given, and TRL 1.16's distillation
    batching — one completion per prompt (num_generations = 1), one generation batch per optimizer step
    (steps_per_generation = gradient_accumulation_steps, the default), one pass over it (num_iterations = 1) — with
    GRPO's beta 0 (no reference model: the divergence's beta is the trainer's `beta`)."""
    grpo_names = {spec.name for spec in dataclasses.fields(GRPOConfig)}
    shared = {
        name: getattr(config, name)
        for name in TRL_DISTILLATION_FIELDS["fields"]
        if name in grpo_names and name != "beta"
    }
    return DistillationLoopConfig(**shared, num_generations=1, num_generations_eval=1, num_iterations=1, beta=0.0)
