"""GRPOConfig: the one place where a run's configuration lives.

Field names follow `trl.GRPOConfig` (and the `transformers.TrainingArguments` fields TRL users pass), so a TRL
script runs with only its import changed. YAML files and CLI flags load into this dataclass; every cross-field
check lives in `validate()`, with messages that say how to fix the value. Fields accepted for compatibility but
not implemented warn by name when set to anything but their default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .advantages import SCALE_REWARDS
from .loss import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS

LR_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr")


def _f(default, help: str, **kwargs):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class GRPOConfig:
    # ---- output, logging, checkpoints
    output_dir: str = _f("grpo-output", "Where checkpoints, metrics.jsonl and the final model are written.")
    run_name: str | None = _f(None, "Name of the run for trackers (default: the output directory's name).")
    logging_steps: float = _f(10, "Log metrics every N optimizer steps (a float < 1 is a fraction of all steps).")
    logging_first_step: bool = _f(True, "Also log the first step.")
    report_to: Any = _f("none", "Trackers besides metrics.jsonl: 'tensorboard', 'wandb', a list, 'all' or 'none'.")
    logging_dir: str | None = _f(None, "TensorBoard directory (default: output_dir/runs).")
    disable_tqdm: bool = _f(False, "Hide the progress bar.")
    save_strategy: str = _f("steps", "'steps' (every save_steps), 'epoch', or 'no'.")
    save_steps: float = _f(500, "Save a checkpoint every N optimizer steps (a float < 1 is a fraction).")
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints (the newest); None keeps all.")
    save_only_model: bool = _f(False, "Checkpoints hold only the model (no optimizer/scheduler/RNG: no resume).")
    resume_from_checkpoint: str | None = _f(None, "Checkpoint path, or 'true' for the newest in output_dir.")
    log_completions: bool = _f(False, "Write sampled completions with their rewards to completions.jsonl.")
    num_completions_to_print: int | None = _f(None, "How many completions to log each logging step.")

    # ---- steps, batches, optimisation
    per_device_train_batch_size: int = _f(8, "Completions per process per micro-step (TRL semantics).")
    gradient_accumulation_steps: int = _f(1, "Micro-steps accumulated into one optimizer step.")
    num_train_epochs: float = _f(3.0, "Passes over the prompts (ignored when max_steps > 0).")
    max_steps: int = _f(-1, "Total optimizer steps; overrides num_train_epochs when > 0.")
    learning_rate: float = _f(1e-6, "Peak AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the gradient to this global norm (0 or less: no clipping).")
    lr_scheduler_type: str = _f("linear", f"Learning-rate schedule: one of {', '.join(LR_SCHEDULERS)}.")
    lr_scheduler_kwargs: dict = _f({}, "Extra arguments of the schedule (e.g. min_lr_rate).")
    warmup_ratio: float = _f(0.0, "Linear warm-up over this fraction of the steps.")
    warmup_steps: int = _f(0, "Linear warm-up over this many steps (overrides warmup_ratio).")
    seed: int = _f(42, "Seed of every random generator (data order, sampling, initialisation).")
    data_seed: int | None = _f(None, "Seed of the data order only (default: seed).")
    bf16: bool = _f(False, "bfloat16 autocast for forward passes (weights and optimizer stay float32).")
    fp16: bool = _f(False, "float16 autocast with loss scaling (GPU).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass to save memory.")
    gradient_checkpointing_kwargs: dict | None = _f(None, "Passed to model.gradient_checkpointing_enable.")
    use_cpu: bool = _f(False, "Train on the CPU even when a GPU is present.")
    shuffle_dataset: bool = _f(True, "Shuffle the prompts each epoch.")
    dataloader_drop_last: bool = _f(False, "Accepted for compatibility: prompts stream across epochs.")

    # ---- model
    model_init_kwargs: dict | None = _f(None, "Keyword arguments of from_pretrained when model is a path / id.")
    disable_dropout: bool = _f(True, "Turn dropout off so that sampling and training see the same policy.")

    # ---- data and generation
    remove_unused_columns: bool = _f(False, "Accepted for compatibility; every column reaches the rewards.")
    max_prompt_length: int | None = _f(512, "Keep the last N prompt tokens (left truncation); None keeps all.")
    num_generations: int = _f(8, "G: completions sampled per prompt.")
    max_completion_length: int = _f(256, "Stop a completion after this many tokens.")
    generation_batch_size: int | None = _f(None, "Completions per process per generation (default: "
                                                 "per_device_train_batch_size * steps_per_generation).")
    steps_per_generation: int | None = _f(None, "Micro-steps per generation (default: gradient_accumulation_steps).")
    temperature: float = _f(1.0, "Sampling temperature (also divides the logits of the training forward).")
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest set of tokens with this total probability.")
    top_k: int | None = _f(None, "Keep only the k most likely tokens (None or 0: all).")
    min_p: float | None = _f(None, "Drop tokens less likely than min_p times the most likely one.")
    repetition_penalty: float = _f(1.0, "CTRL repetition penalty on tokens already in the prompt/completion.")
    generation_kwargs: dict | None = _f(None, "Accepted for compatibility; use the named sampling fields.")
    chat_template_kwargs: dict | None = _f(None, "Extra arguments of tokenizer.apply_chat_template.")

    # ---- the objective
    beta: float = _f(0.0, "KL coefficient (k3 estimator); 0 loads no reference model.")
    num_iterations: int = _f(1, "μ: optimisation passes over each generation batch.")
    epsilon: float = _f(0.2, "Lower clipping bound: ratio >= 1 - epsilon.")
    epsilon_high: float | None = _f(None, "Upper clipping bound 1 + epsilon_high (DAPO clip-higher; default: epsilon).")
    delta: float | None = _f(None, "Two-sided clipping: cap the unclipped ratio at delta (> 1 + epsilon).")
    importance_sampling_level: str = _f("token", "'token' ratios (GRPO) or one 'sequence' ratio (GSPO).")
    reward_weights: list | None = _f(None, "Weight of each reward function (default: all 1).")
    scale_rewards: Any = _f("group", "Divide advantages by the std of the 'group', the 'batch', or 'none'.")
    loss_type: str = _f("dapo", f"Token aggregation: one of {', '.join(AGGREGATIONS)}.")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    sync_ref_model: bool = _f(False, "Move the reference towards the policy every ref_model_sync_steps.")
    ref_model_mixup_alpha: float = _f(0.6, "ref <- alpha * policy + (1 - alpha) * ref at each sync.")
    ref_model_sync_steps: int = _f(512, "Optimizer steps between reference syncs.")
    top_entropy_quantile: float = _f(1.0, "Keep only tokens above this entropy quantile in the policy loss.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (subtracted from the loss).")
    reward_fn_errors: str = _f("raise", "A reward function that raises: 'raise' (named) or 'none' (count as None).")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
                                       "more prompts until the batch is full.")
    max_resample_rounds: int = _f(4, "Dynamic sampling: extra sampling rounds per batch at most (then zero-spread "
                                     "groups fill what is missing, counted in dynamic_sampling/filled_groups).")
    reward_routing_column: str = _f("reward_funcs", "Dataset column listing, per row, the names of the reward "
                                                    "functions that apply to it (the others count as None).")
    step_separator: Any = _f("\n", "Where process rewards cut a completion into steps (a token id for models "
                                   "without a tokenizer).")
    save_merged: bool = _f(False, "With LoRA, save_model also writes the adapter merged into full weights "
                                  "(in <dir>/merged).")
    max_nonfinite_steps: int = _f(3, "Stop after this many optimizer steps in a row whose loss or gradient is "
                                     "NaN/inf (each such step is skipped and counted in `nonfinite_steps`).")

    # ---- evaluation and reward-hacking signals
    eval_strategy: str = _f("no", "'steps': evaluate on eval_dataset every eval_steps optimizer steps; 'no': never.")
    eval_steps: float | None = _f(None, "Evaluate every N optimizer steps (a float < 1 is a fraction; default: "
                                        "logging_steps).")
    per_device_eval_batch_size: int = _f(8, "Completions per process per evaluation generation (whole groups of "
                                            "num_generations_eval, at least one).")
    num_generations_eval: int | None = _f(None, "Completions sampled per eval prompt, n of pass@k (default: "
                                                "num_generations).")
    pass_threshold: float = _f(1.0, "A completion passes a reward function (for pass@k) when its reward >= this.")
    guard_metric: str | None = _f(None, "Warn when the reward rises while this metric falls (e.g. "
                                        "'rewards/format/mean', 'completions/mean_length'); None: off.")
    guard_window: int = _f(5, "Logging steps over which guard_metric's trend is compared with the reward's.")

    # ---- accepted for compatibility with TRL / transformers, not implemented (warned when set)
    use_vllm: bool = _f(False, "Not implemented: grpokit samples with its own KV-cached loop.")
    vllm_mode: str = _f("server", "Not implemented (vLLM).")
    vllm_gpu_memory_utilization: float = _f(0.3, "Not implemented (vLLM).")
    use_liger_loss: bool = _f(False, "Not implemented (Liger kernels).")
    push_to_hub: bool = _f(False, "Not implemented: no network access is assumed.")
    hub_model_id: str | None = _f(None, "Not implemented (Hub).")
    optim: str = _f("adamw_torch", "Only AdamW ('adamw_torch') is implemented.")
    torch_compile: bool = _f(False, "Not implemented.")
    label_smoothing_factor: float = _f(0.0, "Not applicable to GRPO.")
    wandb_log_unique_prompts: bool = _f(False, "Not implemented.")
    ds3_gather_for_generation: bool = _f(True, "Not implemented (DeepSpeed ZeRO-3 generation).")
    deepspeed: Any = _f(None, "Not implemented here: configure DeepSpeed through `accelerate launch`.")
    fsdp: Any = _f("", "Not implemented here: configure FSDP through `accelerate launch`.")
    dataloader_num_workers: int = _f(0, "Not implemented: prompts are read in the main process.")
    overwrite_output_dir: bool = _f(False, "Accepted for compatibility; output_dir is always reused.")
    do_train: bool = _f(False, "Accepted for compatibility; train() always trains.")

    NOT_IMPLEMENTED = (
        "use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "use_liger_loss", "push_to_hub", "hub_model_id",
        "optim", "torch_compile", "label_smoothing_factor", "wandb_log_unique_prompts", "ds3_gather_for_generation",
        "deepspeed", "fsdp", "dataloader_num_workers", "generation_kwargs",
    )  # fmt: skip

    def __post_init__(self):
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        self.report_to = list(self.report_to or [])
        if self.report_to == ["all"]:
            self.report_to = ["tensorboard", "wandb"]
        if self.steps_per_generation is None and self.generation_batch_size is not None:
            if self.generation_batch_size % self.per_device_train_batch_size:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) must be a multiple of "
                    f"per_device_train_batch_size ({self.per_device_train_batch_size})."
                )
            self.steps_per_generation = self.generation_batch_size // self.per_device_train_batch_size
        elif self.generation_batch_size is not None and self.generation_batch_size != (
            self.per_device_train_batch_size * self.steps_per_generation
        ):
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) and steps_per_generation "
                f"({self.steps_per_generation}) disagree: generation_batch_size must equal "
                f"per_device_train_batch_size x steps_per_generation. Set only one of them."
            )
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        self.generation_batch_size = self.per_device_train_batch_size * self.steps_per_generation
        if self.top_k == 0:
            self.top_k = None
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        self.validate()
        for name in self.NOT_IMPLEMENTED:
            default = _default_of(name)
            if getattr(self, name) != default:
                warnings.warn(
                    f"GRPOConfig.{name}={getattr(self, name)!r} is accepted for compatibility with TRL but is not "
                    f"implemented by grpokit: it has no effect. {self.field_help(name)}",
                    UserWarning,
                    stacklevel=3,
                )

    # ------------------------------------------------------------------------------------------- validation

    def validate(self) -> None:
        """Check every value and every relation between values; raise ValueError saying how to fix it."""

        def fail(message: str):
            raise ValueError(message)

        if self.loss_type not in AGGREGATIONS:
            fail(f"loss_type={self.loss_type!r} is not a loss type; use one of {sorted(AGGREGATIONS)}.")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            fail(
                f"importance_sampling_level={self.importance_sampling_level!r} is not valid; use 'token' (GRPO) "
                f"or 'sequence' (GSPO)."
            )
        if self.scale_rewards not in (*SCALE_REWARDS, True, False):
            fail(f"scale_rewards={self.scale_rewards!r} is not valid; use 'group', 'batch' or 'none'.")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            fail(f"lr_scheduler_type={self.lr_scheduler_type!r} is not supported; use one of {list(LR_SCHEDULERS)}.")
        if self.save_strategy not in ("steps", "epoch", "no"):
            fail(f"save_strategy={self.save_strategy!r} is not valid; use 'steps', 'epoch' or 'no'.")
        if self.reward_fn_errors not in ("raise", "none"):
            fail(f"reward_fn_errors={self.reward_fn_errors!r} is not valid; use 'raise' or 'none'.")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                     "steps_per_generation", "max_completion_length"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail(f"{name}={value!r} must be a positive integer (>= 1).")
        if self.num_generations < 2:
            fail(
                f"num_generations={self.num_generations} must be at least 2: GRPO's advantage compares the "
                f"completions of one prompt with each other, so a group of 1 has no signal."
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            fail(f"max_prompt_length={self.max_prompt_length} must be a positive integer or None (no limit).")
        if self.learning_rate < 0 or not math.isfinite(self.learning_rate):
            fail(f"learning_rate={self.learning_rate} must be a finite number >= 0 (e.g. 1e-6).")
        if self.beta < 0:
            fail(f"beta={self.beta} must be >= 0 (0 disables the KL term and the reference model).")
        if self.epsilon <= 0 or (self.epsilon_high is not None and self.epsilon_high <= 0):
            fail(f"epsilon={self.epsilon} and epsilon_high={self.epsilon_high} must be > 0.")
        if self.delta is not None and self.delta <= 1 + self.epsilon:
            fail(f"delta={self.delta} must be greater than 1 + epsilon ({1 + self.epsilon}), or None to disable.")
        if self.temperature <= 0:
            fail(f"temperature={self.temperature} must be > 0 (use a small value such as 0.01 for near-greedy).")
        if not 0 < self.top_p <= 1:
            fail(f"top_p={self.top_p} must be in (0, 1].")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            fail(f"min_p={self.min_p} must be in [0, 1].")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty={self.repetition_penalty} must be > 0 (1.0 disables it).")
        if not 0 < self.top_entropy_quantile <= 1:
            fail(f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1] (1.0 keeps every token).")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            fail(f"ref_model_mixup_alpha={self.ref_model_mixup_alpha} must be in [0, 1].")
        if self.ref_model_sync_steps < 1:
            fail(f"ref_model_sync_steps={self.ref_model_sync_steps} must be >= 1.")
        if not 0 <= self.warmup_ratio <= 1:
            fail(f"warmup_ratio={self.warmup_ratio} must be in [0, 1].")
        if self.bf16 and self.fp16:
            fail("bf16 and fp16 are both set; choose one.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            fail("Set max_steps > 0 or num_train_epochs > 0: otherwise there is nothing to train.")
        if self.steps_per_generation % self.gradient_accumulation_steps:
            fail(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}), so that an optimizer step "
                f"never straddles two generation batches."
            )
        if self.max_nonfinite_steps < 1:
            fail(f"max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1.")
        if self.eval_strategy not in ("no", "steps"):
            fail(f"eval_strategy={self.eval_strategy!r} is not valid; use 'steps' (with eval_steps) or 'no'.")
        if self.eval_steps is not None and self.eval_steps <= 0:
            fail(f"eval_steps={self.eval_steps} must be > 0, or None to evaluate every logging_steps.")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            fail(f"num_generations_eval={self.num_generations_eval} must be >= 1, or None for num_generations.")
        if self.per_device_eval_batch_size < 1:
            fail(f"per_device_eval_batch_size={self.per_device_eval_batch_size} must be >= 1.")
        if self.guard_window < 2:
            fail(f"guard_window={self.guard_window} must be >= 2: a trend needs at least two logging steps.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            fail(f"save_total_limit={self.save_total_limit} must be >= 1, or None to keep every checkpoint.")

    def check_batch(self, num_processes: int) -> None:
        """The global generation batch must hold whole groups of num_generations (TRL's rule)."""
        global_batch = self.generation_batch_size * num_processes
        if global_batch % self.num_generations:
            valid = [g for g in range(2, global_batch + 1) if global_batch % g == 0]
            raise ValueError(
                f"The global generation batch ({num_processes} process(es) x per_device_train_batch_size "
                f"{self.per_device_train_batch_size} x steps_per_generation {self.steps_per_generation} = "
                f"{global_batch} completions) must be a multiple of num_generations ({self.num_generations}). "
                f"Change per_device_train_batch_size or num_generations (valid num_generations here: {valid})."
            )

    # ----------------------------------------------------------------------------------------------- helpers

    @classmethod
    def field_help(cls, name: str) -> str:
        return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, default=str))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"Unknown GRPOConfig field(s): {unknown}. Check the spelling; `grpokit train --help` lists them all."
            )
        return cls(**values)


def _default_of(name: str):
    f = GRPOConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
