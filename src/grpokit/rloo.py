"""RLOOConfig and RLOOTrainer: TRL 1.16's `trl.RLOOConfig` / `trl.RLOOTrainer` on grpokit's one loop.

TRL's RLOOTrainer (REINFORCE leave-one-out; Ahmadian et al. 2024, arXiv 2402.14740) differs from its GRPOTrainer
in four places, and each is an option of the shared loop here, not a second trainer:

1. The KL is in the reward, not the loss: a completion's reward loses beta · sum_t (log π_old - log π_ref), the
   first-order (k1) log-ratio summed over its tokens, with π_old the policy that sampled (`kl_in_reward`;
   `advantages.sequence_kl`, `advantages.shape_rewards`). Before that the summed reward is clipped to
   `reward_clip_range`. beta defaults to 0.05, so a reference model is loaded by default.
2. The advantage is the leave-one-out baseline r_i - mean_{j != i} r_j (`advantage_estimator="rloo"`), and
   `normalize_advantages=True` whitens it over the generation batch (`scale_rewards="batch"`; else "none").
3. The loss is PPO's clipped surrogate of ONE ratio per completion, exp(sum_t log π_θ - sum_t log π_old) (not
   length-normalised, unlike GSPO), averaged over completions (`loss_type="rloo"`,
   `importance_sampling_level="sequence_sum"`).
4. No sampler-mismatch correction with vLLM (TRL's RLOOTrainer has none).

`RLOOConfig` has exactly TRL's fields, in TRL's order, with TRL's defaults (`grpokit/trl_rloo_fields.json`, written
by `scripts/trl_fields.py`); every field it shares with grpokit's GRPOConfig has that field's help and meaning.
`RLOOTrainer` turns it into the GRPOConfig the loop reads (`grpo_config`): `trainer.args` is that GRPOConfig and
`trainer.rloo_args` the RLOOConfig as given.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from importlib.resources import files

from .config import GRPOConfig, trl_config_fields
from .models import default_output_dir
from .trainer import GRPOTrainer

TRL_RLOO_FIELDS: dict = json.loads(files("grpokit").joinpath("trl_rloo_fields.json").read_text())

# The fields grpokit's GRPOConfig has not, or has with another meaning: name -> (annotation, help)
RLOO_FIELDS = {
    "beta": (
        "float",
        (
            "KL coefficient. As in TRL's RLOOTrainer it is a penalty in the reward, not a loss term: each completion's "
            "reward loses beta · sum_t (log π_old - log π_ref) before the leave-one-out baseline. 0: no reference "
            "model."
        ),
    ),
    "normalize_advantages": (
        "bool",
        ("Whiten the advantages over the generation batch (mean 0, std 1, + 1e-4), as TRL's RLOOTrainer does."),
    ),
}

# What RLOO is on the shared loop (see the module docstring): the GRPOConfig values an RLOOConfig maps to.
RLOO_ON_THE_LOOP = {
    "advantage_estimator": "rloo",
    "loss_type": "rloo",
    "importance_sampling_level": "sequence_sum",
    "kl_in_reward": True,
    "vllm_importance_sampling_correction": False,
}


def _post_init(config) -> None:
    """TRL's RLOOConfig checks its values and derives steps_per_generation and generation_batch_size when it is
    built; so does this one, through the GRPOConfig it maps to (whose warnings wait for the trainer)."""
    if config.beta < 0:
        raise ValueError(f"beta={config.beta} must be >= 0 (0 disables the KL penalty and the reference model).")
    clip = config.reward_clip_range
    if clip is not None and (not isinstance(clip, (list, tuple)) or len(clip) != 2 or not clip[0] <= clip[1]):
        raise ValueError(f"reward_clip_range={clip!r} must be (min, max) with min <= max, or None (no clipping).")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        derived = grpo_config(config)
    config.steps_per_generation, config.generation_batch_size = (
        derived.steps_per_generation,
        derived.generation_batch_size,
    )


RLOOConfig = dataclasses.make_dataclass(
    "RLOOConfig",
    trl_config_fields(TRL_RLOO_FIELDS["fields"], RLOO_FIELDS, keep_kind=False),
    namespace={
        "__post_init__": _post_init,
        "__module__": __name__,
        "__doc__": "TRL 1.16's `RLOOConfig` fields and defaults (see the module docstring).",
    },
)


def grpo_config(config) -> GRPOConfig:
    """The GRPOConfig that runs `config` (an RLOOConfig) on the shared loop: its values, plus `RLOO_ON_THE_LOOP`
    and scale_rewards "batch" (normalize_advantages) or "none". Cross-field checks are GRPOConfig's."""
    values = {spec.name: getattr(config, spec.name) for spec in dataclasses.fields(config)}
    normalize = values.pop("normalize_advantages")
    return GRPOConfig(**values, **RLOO_ON_THE_LOOP, scale_rewards="batch" if normalize else "none")


class RLOOTrainer(GRPOTrainer):
    """TRL 1.16's RLOOTrainer: its arguments, in its order; `args` an `RLOOConfig` (default: TRL's defaults, in
    "<model name>-RLOO"). Everything else is GRPOTrainer's: `trainer.args` is the GRPOConfig the RLOOConfig maps
    to (`grpo_config`), `trainer.rloo_args` the RLOOConfig."""

    progress_label = "RLOO"

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        **grpokit_options,
    ):
        if args is None:
            args = RLOOConfig(output_dir=default_output_dir(model, "RLOO"))
        if not isinstance(args, RLOOConfig):
            raise TypeError(
                f"RLOOTrainer takes an RLOOConfig (from grpokit import RLOOConfig), got "
                f"{type(args).__name__}; for a GRPOConfig use GRPOTrainer."
            )
        self.rloo_args = args
        super().__init__(
            model,
            reward_funcs,
            grpo_config(args),
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            **grpokit_options,
        )

    # TRL's RLOOTrainer attributes of its RLOO settings
    beta = property(lambda self: self.rloo_args.beta)
    normalize_advantages = property(lambda self: self.rloo_args.normalize_advantages)
    reward_clip_range = property(lambda self: self.rloo_args.reward_clip_range)
