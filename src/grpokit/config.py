"""GRPOConfig: the one place where a run's configuration lives.

Every field of TRL 1.16's `trl.GRPOConfig` (its own and the `transformers.TrainingArguments` fields it inherits,
listed with their defaults in `grpokit/trl_fields.json`) is a field here with TRL's name, so a TRL script runs with
only its import changed. Each field is one of four kinds, told by how it is declared:

- `_f`: implemented by grpokit;
- `_not_implemented`: accepted, but grpokit does not do what TRL does with it; a value other than the default warns
  once, by name, saying what TRL does with it and what to use in grpokit instead (`NOT_IMPLEMENTED`);
- `_no_effect`: accepted, and nothing needs doing: it does not change what a GRPO run computes, or grpokit always does
  what it asks (`NO_EFFECT`, with the reason);
- `_deprecated`: an older grpokit name that TRL 1.16 / transformers 5 dropped or renamed; it keeps working and warns
  (FutureWarning) naming the replacement (`DEPRECATED`).

TRL's renamed fields are one table, `grpokit/trl_renames.json` (`TRL_RENAMES`: the old name, the new one and the TRL
release that renamed it): the old name's value moves to the new one with a FutureWarning, and both names set to
different values is an error naming both.

YAML files and CLI flags load into this dataclass (the annotations drive the CLI's type coercion); every
cross-field check lives in `validate()`, with messages that say how to fix the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib.util
import json
import math
import os
import types
import warnings
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .logs import TRACKERS

if TYPE_CHECKING:
    from accelerate.parallelism_config import ParallelismConfig
else:

    class ParallelismConfig:
        """The name of parallelism_config's annotation at run time: transformers' HfArgumentParser (TRL's TrlParser)
        resolves every field's annotation when it builds a command line from GRPOConfig, and importing accelerate's
        class would import torch whenever the fields are read (`grpokit train --help`). grpokit does not implement
        the field (a value warns), so nothing checks a value against the class."""


# transformers' schedules that need no metric; extra arguments go in lr_scheduler_kwargs (name -> required keys,
# any one of which will do).
LR_SCHEDULERS = {
    "linear": (),
    "cosine": (),
    "cosine_with_restarts": (),
    "polynomial": (),
    "constant": (),
    "constant_with_warmup": (),
    "inverse_sqrt": (),
    "cosine_with_min_lr": ("min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("min_lr", "min_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps",),
}

# transformers' log levels by name (TrainingArguments' log_level / log_level_replica); 'passive' keeps the current.
LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "passive": None}

# generation_kwargs keys grpokit's engines honour (TRL passes any key on to generate() / vLLM's SamplingParams).
GENERATION_KWARGS = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "temperature",
    "do_sample",
    "eos_token_id",
    "stop_token_ids",
    "suppress_tokens",
    "disable_compile",
)

# generation_kwargs keys TRL passes on (transformers' GenerationConfig, vLLM's SamplingParams) that do not change what
# is sampled whatever their value: output, caching and detokenization options, and beam-search-only ones (no beams).
GENERATION_KWARGS_WITHOUT_EFFECT = (
    "use_cache",
    "cache_implementation",
    "output_scores",
    "output_logits",
    "return_dict_in_generate",
    "output_attentions",
    "output_hidden_states",
    "return_legacy_cache",
    "pad_token_id",
    "bos_token_id",
    "decoder_start_token_id",
    "remove_invalid_values",
    "renormalize_logits",
    "low_memory",
    "compile_config",
    "length_penalty",
    "early_stopping",
    "logprobs",
    "prompt_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
)
# generation_kwargs keys accepted at their neutral value (the sampling grpokit does); any other value would change
# the sampling in a way grpokit's engines do not implement, and is refused by name.
GENERATION_KWARGS_NEUTRAL = {
    "num_beams": (1,),
    "num_beam_groups": (1,),
    "num_return_sequences": (1,),
    "n": (1,),
    "best_of": (None, 1),
    "diversity_penalty": (0.0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "encoder_repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "min_new_tokens": (None, 0),
    "min_length": (0,),
    "min_tokens": (0,),
    "guidance_scale": (None, 1.0),
    "penalty_alpha": (None,),
    "ignore_eos": (False,),
    "token_healing": (False,),
    **dict.fromkeys(
        (
            "bad_words_ids",
            "bad_words",
            "force_words_ids",
            "constraints",
            "sequence_bias",
            "logit_bias",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "begin_suppress_tokens",
            "exponential_decay_length_penalty",
            "watermarking_config",
            "stop_strings",
            "stop",
            "seed",
            "allowed_token_ids",
            "logits_processors",
            "max_time",
            "prompt_lookup_num_tokens",
            "assistant_early_exit",
            "dola_layers",
            "truncate_prompt_tokens",
            "structured_outputs",
            "guided_decoding",
            "top_h",
        ),
        (None,),
    ),
}

# generation_kwargs keys of transformers' GenerationConfig that grpokit's own sampler does not implement but
# transformers' `generate` does (TRL samples with it without vLLM): away from their neutral value they make the
# in-process engine sample with `model.generate` (rollout/hf_generate.py). The beam options ride along. Not among
# them: modes transformers 5 moved to Hub repositories (group / constrained beam search, contrastive search, DoLa),
# several sequences per prompt, and options generate needs more than a config for (stop_strings: a tokenizer).
GENERATE_KWARGS = (
    "num_beams",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "encoder_repetition_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "min_new_tokens",
    "min_length",
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "begin_suppress_tokens",
    "exponential_decay_length_penalty",
    "watermarking_config",
    "max_time",
    "top_h",
)
GENERATE_COMPANION_KWARGS = ("length_penalty", "early_stopping", "renormalize_logits", "remove_invalid_values")

# cache_implementation values the in-process sampler takes (`rollout/static.py`); TRL passes any to generate().
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")


def _token_ids(value) -> list[int] | None:
    """A token id or a list of them as a list of ints; None when the value is neither."""
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        return None
    return list(values)


NOT_IMPLEMENTED_KIND, NO_EFFECT_KIND, DEPRECATED_KIND = "not implemented", "no effect", "deprecated"
# The loss types' names, for loss_type's help without importing torch (the command line reads the fields' help);
# loss.LOSS_TYPES defines them, and tests/test_config.py checks the two agree.
LOSS_TYPE_NAMES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "rloo")


def _field(default, help: str, metadata: dict):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})


def trl_config_fields(
    recorded: dict, own: dict[str, tuple[str, str]], keep_kind: bool = True
) -> list[tuple[str, str, dataclasses.Field]]:
    """The fields of a config built from another TRL config's recorded fields (name -> TRL's default, in TRL's
    order: DistillationConfig, RLOOConfig), for `dataclasses.make_dataclass`: the annotation and help of `own`
    where it declares the field, else GRPOConfig's (with its kind, with `keep_kind`)."""
    grpo_fields = {spec.name: spec for spec in dataclasses.fields(GRPOConfig)}
    declared = []
    for name, default in recorded.items():
        if name in own:
            (annotation, help_text), metadata = own[name], {}
        else:
            spec = grpo_fields[name]
            annotation, help_text = spec.type, spec.metadata["help"]
            metadata = {k: v for k, v in spec.metadata.items() if k != "help"} if keep_kind else {}
        declared.append((name, annotation, _field(default, help_text, metadata)))
    return declared


def _f(default, help: str):
    return _field(default, help, {})


def _not_implemented(default, message: str):
    return _field(default, f"Not implemented. {message}", {"kind": NOT_IMPLEMENTED_KIND, "message": message})


def _no_effect(default, reason: str):
    return _field(default, f"Accepted, no effect: {reason}", {"kind": NO_EFFECT_KIND, "message": reason})


def _deprecated(default, message: str):
    return _field(default, f"Deprecated: {message}", {"kind": DEPRECATED_KIND, "message": message})


# The dataloader_* fields' effect: on the DataLoaders TRL's API returns, not on the loop.
LOADER_ONLY = (
    "the loop reads prompts in the main process; get_train_dataloader() and get_eval_dataloader() "
    "(TRL's API) build their DataLoaders with it."
)

# transformers' AcceleratorConfig options and their defaults (transformers.trainer_pt_utils.AcceleratorConfig).
ACCELERATOR_CONFIG_DEFAULTS = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
    "use_configured_state": False,
}


@dataclass
class GRPOConfig:
    # The smallest group (not a field): GRPO's advantage compares the completions of one prompt with each other. A
    # loop that computes no advantages (on-policy distillation: `distillation_config.DistillationLoopConfig`) takes 1.
    min_num_generations = 2  # no annotation: a class attribute, not a dataclass field
    # Said after a keyword that is not a field (`fields_note`): where this config's names come from.
    unknown_field_hint = (
        "grpokit takes the names of TRL 1.16's GRPOConfig; `grpokit train --help` lists every field "
        "(docs/guides/from-trl.md)."
    )

    # ---- output, logging, checkpoints
    output_dir: str | None = _f(
        None, "Where checkpoints, metrics.jsonl and the final model are written (None: 'trainer_output', as in TRL)."
    )
    run_name: str | None = _f(None, "Name of the run for trackers (default: the output directory's name).")
    logging_steps: float = _f(10, "Log metrics every N optimizer steps (a float < 1 is a fraction of all steps).")
    logging_first_step: bool = _f(True, "Also log the first step.")
    logging_strategy: str = _f(
        "steps",
        "'steps': log every logging_steps (and the last step); 'epoch': at the end of "
        "each epoch; 'no': only what callbacks ask for (control.should_log), and "
        "train()'s summary.",
    )
    log_level: str = _f(
        "passive",
        "transformers' logging level on the main process ('debug', 'info', 'warning', "
        "'error', 'critical'; 'passive' leaves it as it is).",
    )
    log_level_replica: str = _f("warning", "transformers' logging level on the other processes (same values).")
    report_to: None | str | list[str] = _f(
        "none",
        f"Trackers besides metrics.jsonl: {', '.join(TRACKERS)}, a list of them, 'all' (those installed) or 'none'.",
    )
    project: str = _f("huggingface", "Trackio project the run is logged to (report_to='trackio').")
    disable_tqdm: bool | None = _f(None, "Hide the progress bar (None: show it).")
    save_strategy: str = _f("steps", "'steps' (every save_steps), 'epoch', or 'no'.")
    save_steps: float = _f(500, "Save a checkpoint every N optimizer steps (a float < 1 is a fraction).")
    save_total_limit: int | None = _f(None, "Keep at most this many checkpoints (the newest); None keeps all.")
    save_only_model: bool = _f(False, "Checkpoints hold only the model (no optimizer/scheduler/RNG: no resume).")
    resume_from_checkpoint: str | None = _f(None, "Checkpoint path, or 'true' for the newest in output_dir.")
    enable_jit_checkpoint: bool = _f(
        False,
        "On SIGTERM (preemption), finish the current optimizer step, save a "
        "checkpoint and return from train() (the processes agree on the step). "
        "The scheduler's grace period must cover a step and a save.",
    )
    log_completions: bool = _f(False, "Write sampled completions with their rewards to completions.jsonl.")
    num_completions_to_print: int | None = _f(None, "How many completions to log each logging step.")

    # ---- steps, batches, optimisation
    per_device_train_batch_size: int = _f(8, "Completions per process per micro-step (TRL semantics).")
    gradient_accumulation_steps: int = _f(1, "Micro-steps accumulated into one optimizer step.")
    num_train_epochs: float = _f(3.0, "Passes over the prompts (ignored when max_steps > 0).")
    max_steps: int = _f(-1, "Total optimizer steps; overrides num_train_epochs when > 0.")
    learning_rate: float = _f(1e-6, "Peak learning rate.")
    optim: str = _f(
        "adamw_torch",
        "Optimizer, by transformers' name (adamw_torch, adamw_torch_fused, adafactor, sgd, "
        "adamw_8bit, ...), or grpokit's adamw_torch_bf16 (torchao's AdamW, states in the "
        "weights' dtype, bf16 stochastic rounding): grpokit.optim.build_optimizer.",
    )
    optim_args: str | None = _f(None, "Extra optimizer arguments as 'key=value,key=value' (transformers' format).")
    optim_target_modules: None | str | list[str] = _f(None, "Modules that GaLore / APOLLO optimizers project.")
    weight_decay: float = _f(0.0, "Weight decay (not applied to biases and norm weights, as in transformers).")
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_epsilon: float = _f(1e-8, "Adam epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the gradient to this global norm (0 or less: no clipping).")
    lr_scheduler_type: str = _f("linear", f"Learning-rate schedule: one of {', '.join(LR_SCHEDULERS)}.")
    lr_scheduler_kwargs: dict | str | None = _f(None, "Extra arguments of the schedule (e.g. min_lr_rate).")
    warmup_steps: float = _f(0, "Linear warm-up over this many steps; a float in (0, 1) is a fraction of all steps.")
    seed: int = _f(42, "Seed of every random generator (data order, sampling, initialisation).")
    data_seed: int | None = _f(None, "Seed of the data order only (default: seed).")
    full_determinism: bool = _f(
        False,
        "transformers.enable_full_determinism(seed) instead of seeding alone: "
        "deterministic kernels only (torch.use_deterministic_algorithms; CUDA's "
        "workspace settings), slower on GPUs.",
    )
    bf16: bool | None = _f(
        False,
        "bfloat16 autocast for forward passes (weights and optimizer stay float32). "
        "Off by default (TRL's default is on unless fp16: set bf16=True on GPUs); "
        "None: on unless fp16.",
    )
    fp16: bool = _f(False, "float16 autocast with loss scaling (GPU).")
    torch_empty_cache_steps: int | None = _f(
        None,
        "Return the accelerator's cached memory (torch.cuda.empty_cache "
        "and the like) before the backward of every micro-batch of every "
        "N-th optimizer step, as transformers' Trainer (None: never).",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in the backward pass to save memory.")
    gradient_checkpointing_kwargs: dict | str | None = _f(
        None,
        "As transformers' Trainer reads them: every_n_layers "
        "(checkpoint every n-th decoder layer only: memory "
        "given back for speed), offload (accelerators), the "
        "rest passed to torch.utils.checkpoint.",
    )
    activation_checkpointing: bool | None = _f(
        None, "transformers 5's name for gradient_checkpointing (wins when set)."
    )
    activation_checkpointing_kwargs: dict | str | None = _f(
        None, "transformers 5's name for gradient_checkpointing_kwargs (wins when set)."
    )
    use_cpu: bool = _f(False, "Train on the CPU even when a GPU is present.")
    shuffle_dataset: bool | None = _f(True, "Shuffle the prompts each epoch.")
    auto_find_batch_size: bool = _f(
        False, "Refused, as in TRL: halving the batch on out-of-memory would break the groups of num_generations."
    )

    # ---- processes (torchrun / accelerate launch)
    ddp_backend: str | None = _f(
        None,
        "Process-group backend: 'nccl', 'gloo', 'mpi', 'xccl', 'hccl', 'cncl', 'mccl' "
        "(None: accelerate's choice, nccl on GPUs and gloo on CPUs).",
    )
    ddp_timeout: int = _f(
        1800, "Seconds a collective may wait before the process group fails (torch's init_process_group timeout)."
    )
    ddp_find_unused_parameters: bool | None = _f(None, "DDP's find_unused_parameters (None: DDP's default, False).")
    ddp_bucket_cap_mb: int | None = _f(None, "DDP's bucket_cap_mb, the gradient all-reduce bucket size (None: 25).")
    ddp_broadcast_buffers: bool | None = _f(None, "DDP's broadcast_buffers (None: DDP's default, True).")
    ddp_static_graph: bool | None = _f(None, "DDP's static_graph (None: DDP's default, False).")

    # ---- model
    model_init_kwargs: dict | str | None = _f(None, "Keyword arguments of from_pretrained when model is a path / id.")
    disable_dropout: bool = _f(True, "Turn dropout off so that sampling and training see the same policy.")

    # ---- data and generation
    num_generations: int | None = _f(8, "G: completions sampled per prompt.")
    max_completion_length: int | None = _f(512, "Stop a completion after this many tokens.")
    generation_batch_size: int | None = _f(
        None,
        "Completions per generation, all processes together, as in TRL "
        "(default: per_device_train_batch_size * number of processes * "
        "steps_per_generation; the processes are counted from WORLD_SIZE, "
        "which torchrun and accelerate launch set). Each process samples "
        "per_device_train_batch_size * steps_per_generation of them.",
    )
    steps_per_generation: int | None = _f(None, "Micro-steps per generation (default: gradient_accumulation_steps).")
    temperature: float = _f(1.0, "Sampling temperature (also divides the logits of the training forward).")
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest set of tokens with this total probability.")
    top_k: int | None = _f(0, "Keep only the k most likely tokens (None or 0: all).")
    min_p: float | None = _f(None, "Drop tokens less likely than min_p times the most likely one.")
    repetition_penalty: float = _f(1.0, "CTRL repetition penalty on tokens already in the prompt/completion.")
    keep_sampling_mask: bool = _f(
        True,
        "With top_p, top_k, min_p, a repetition penalty or suppressed tokens: the sampler's log-probs are those of the "
        "distribution it drew from, and π_θ and π_old are renormalised over each token's kept set (DeepSeek-V3.2's "
        "keep sampling mask), so that an unchanged policy has importance ratio 1. False: TRL 1.16's full-vocabulary "
        "log-probs (every ratio then carries the kept probability mass).",
    )
    sampling_mask_max_tokens: int = _f(
        512,
        "With keep_sampling_mask and truncation (top_p < 1, top_k or min_p), the sampler keeps at most this many "
        "tokens per step (an implicit top-k; it bounds the kept sets recorded with each token).",
    )
    chat_template_kwargs: dict | str | None = _f(None, "Extra arguments of tokenizer.apply_chat_template.")

    # ---- the objective
    beta: float = _f(0.0, "KL coefficient (k3 estimator); 0 loads no reference model.")
    num_iterations: int = _f(1, "μ: optimisation passes over each generation batch.")
    epsilon: float = _f(0.2, "Lower clipping bound: ratio >= 1 - epsilon.")
    epsilon_high: float | None = _f(None, "Upper clipping bound 1 + epsilon_high (DAPO clip-higher; default: epsilon).")
    delta: float | None = _f(None, "Two-sided clipping: cap the unclipped ratio at delta (> 1 + epsilon).")
    importance_sampling_level: str = _f("token", "'token' ratios (GRPO) or one 'sequence' ratio (GSPO).")
    reward_weights: list[float] | None = _f(None, "Weight of each reward function (default: all 1).")
    scale_rewards: str = _f("group", "Divide advantages by the std of the 'group', the 'batch', or 'none'.")
    loss_type: str = _f("dapo", f"Token aggregation: one of {', '.join(LOSS_TYPE_NAMES)}.")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    sync_ref_model: bool = _f(False, "Move the reference towards the policy every ref_model_sync_steps.")
    ref_model_mixup_alpha: float = _f(0.6, "ref <- alpha * policy + (1 - alpha) * ref at each sync.")
    ref_model_sync_steps: int = _f(512, "Optimizer steps between reference syncs.")
    top_entropy_quantile: float = _f(1.0, "Keep only tokens above this entropy quantile in the policy loss.")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (subtracted from the loss).")

    # ---- evaluation
    eval_strategy: str = _f("no", "'steps': evaluate on eval_dataset every eval_steps optimizer steps; 'no': never.")
    eval_steps: float | None = _f(
        None, "Evaluate every N optimizer steps (a float < 1 is a fraction; default: logging_steps)."
    )
    eval_on_start: bool = _f(
        False, "Evaluate before the first optimizer step (a record at step 0; needs an eval_dataset)."
    )
    metric_for_best_model: str | None = _f(
        None,
        "The evaluation metric that picks the best checkpoint: 'loss' "
        "(eval_loss), 'eval/reward', 'eval/rewards/<fn>/pass@1', ... (an "
        "'eval_' or 'eval/' prefix is added when missing). Tracked at each "
        "checkpoint in state.best_metric / best_model_checkpoint. Default "
        "'loss' with load_best_model_at_end.",
    )
    greater_is_better: bool | None = _f(
        None,
        "Whether a larger metric_for_best_model is better (default: False for "
        "a metric ending in 'loss', True otherwise).",
    )
    load_best_model_at_end: bool = _f(
        False,
        "At the end of train(), load the weights of the best checkpoint "
        "(metric_for_best_model; save_total_limit keeps it). Needs "
        "save_strategy and eval_strategy 'steps' with save_steps a multiple of "
        "eval_steps, and plain checkpoints (not FSDP2 SHARDED_STATE_DICT or "
        "DeepSpeed).",
    )
    eval_delay: float = _f(0, "With eval_strategy='steps': no evaluation before this optimizer step.")
    per_device_eval_batch_size: int = _f(
        8, "Completions per process per evaluation generation (whole groups of num_generations_eval, at least one)."
    )
    num_generations_eval: int | None = _f(
        None, "Completions sampled per eval prompt, n of pass@k (default: num_generations)."
    )

    # ---- grpokit's own (not in TRL)
    reward_fn_errors: str = _f("raise", "A reward function that raises: 'raise' (named) or 'none' (count as None).")
    dynamic_sampling: bool = _f(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
        "more prompts until the batch is full.",
    )
    max_resample_rounds: int = _f(
        4,
        "Dynamic sampling: extra sampling rounds per batch at most (then zero-spread "
        "groups fill what is missing, counted in dynamic_sampling/filled_groups).",
    )
    reward_routing_column: str = _f(
        "reward_funcs",
        "Dataset column listing, per row, the names of the reward "
        "functions that apply to it (the others count as None).",
    )
    step_separator: str = _f(
        "\n", "Where process rewards cut a completion into steps (a token id for models without a tokenizer)."
    )
    save_merged: bool = _f(
        False, "With LoRA, save_model also writes the adapter merged into full weights (in <dir>/merged)."
    )
    max_nonfinite_steps: int = _f(
        3,
        "Stop after this many optimizer steps in a row whose loss or gradient is "
        "NaN/inf (each such step is skipped and counted in `nonfinite_steps`).",
    )
    ref_model_dtype: str | None = _f(
        None,
        "The frozen reference's weights in 'bfloat16' / 'float16' (inference only: "
        "half a float32 copy's memory, no per-op cast under bf16 autocast) or "
        "'int8' (linear layers in int8 with a scale per row, the rest bfloat16); "
        "log-prob differences in the memory guide; None: the policy's dtype, "
        "as TRL.",
    )
    pass_threshold: float = _f(1.0, "A completion passes a reward function (for pass@k) when its reward >= this.")
    guard_metric: str | None = _f(
        None,
        "Warn when the reward rises while this metric falls (e.g. "
        "'rewards/format/mean', 'completions/mean_length'); None: off.",
    )
    guard_window: int = _f(5, "Logging steps over which guard_metric's trend is compared with the reward's.")
    padding_free: bool = _f(
        False,
        "Packed training forwards: the real tokens of a micro-batch only, each distinct "
        "prompt once followed by its completions, with an attention mask that keeps them "
        "apart (no padding, no KV cache: also under gradient checkpointing). Same values "
        "and gradients as the padded forward; needs full-attention layers, SDPA or eager "
        "attention and no entropy bonus.",
    )
    activation_offloading: bool = _f(
        False,
        "The training forward's saved activations wait in pinned host memory "
        "until the backward needs them (TRL SFTConfig's field; with gradient "
        "checkpointing: each layer's input). Exact; accelerators only (on a CPU "
        "it warns and does nothing).",
    )
    freeze_vision_tower: bool = _f(
        False,
        "Vision-language models: True keeps the vision encoder and its projector "
        "as they are (LoRA adapts the language model only, through peft's "
        "exclude_modules; full training freezes them). False (TRL's behaviour) "
        "trains them too.",
    )

    # ---- accepted, not implemented: a value other than the default warns (what TRL does; what to use instead)
    use_transformers_continuous_batching: bool = _not_implemented(
        False, "TRL samples with transformers' continuous batching; grpokit uses its own sampler."
    )
    use_transformers_paged: bool = _not_implemented(
        False, "TRL's deprecated spelling of use_transformers_continuous_batching; grpokit uses its own sampler."
    )
    cache_implementation: str | None = _f(
        None,
        "The in-process sampler's KV cache, as TRL asks generate() for one: "
        "None or 'dynamic': grpokit's preallocated cache, finished rows "
        "leave the batch; 'static': fixed shapes (a transformers "
        "StaticCache kept between rollouts, no rows dropped) and, on CUDA, "
        "the decode step compiled with CUDA graphs (torch.compile "
        "'reduce-overhead'; generation_kwargs disable_compile=True turns "
        "that off). Full-attention models only. No effect with use_vllm. "
        "On a GPU the faster choice (memory guide, 'Static decoding and "
        "CUDA graphs'); it holds its cache through training.",
    )
    generation_kwargs: dict | str | None = _f(
        None,
        "Sampling options as TRL passes them to generate() / vLLM: top_p, top_k, "
        "min_p, repetition_penalty (they override the named fields, as in "
        "TRL), eos_token_id / stop_token_ids (more tokens that end a "
        "completion), suppress_tokens (never sampled; vLLM: a logit bias of -100), "
        "do_sample=True. Without use_vllm, transformers' GenerationConfig "
        "options grpokit's sampler lacks (num_beams, no_repeat_ngram_size, "
        "bad_words_ids, sequence_bias, min_new_tokens, typical_p, ...) "
        "sample with transformers' generate, as TRL does (no sampling "
        "log-probs: pi_old is recomputed). Keys that cannot change what is "
        "sampled (output options, beam options without beams, penalties at "
        "their neutral value) pass; others are refused by name.",
    )
    max_tool_calling_iterations: int | None = _f(
        None,
        "Most tool-calling turns per rollout of an agent "
        "(GRPOTrainer(tools=... / environment_factory=...)); None: "
        "until a turn calls no tool or max_completion_length is used.",
    )
    tool_timeout: float = _f(
        30.0,
        "grpokit-only: seconds a tool call may run; a call that takes longer returns an "
        "error to the model and counts as a failure (tools/failure_frequency).",
    )
    max_tool_output_chars: int | None = _f(
        100_000,
        "grpokit-only: a tool result longer than this many characters "
        "is cut there, before it is tokenized, and counted "
        "(tools/truncated_frequency); None: no limit.",
    )
    teacher_kl_coef: float = _f(
        1.0,
        "grpokit-only: GRPOTrainer(teacher_model=...): the weight of the teacher's "
        "per-token signal -(log pi_student - log pi_teacher) added to the reward "
        "advantages (docs/guides/distillation.md).",
    )
    max_staleness: int | None = _f(
        None,
        "Asynchronous generation (TRL's AsyncGRPOConfig name): a producer samples "
        "ahead of training, and a sample of policy version v (optimizer steps) is "
        "trained on at version <= v + max_staleness, else dropped and counted "
        "(sample/dropped_stale_total). 0: the synchronous loop, bitwise; None "
        "(grpokit's default): no producer. docs/guides/async.md.",
    )
    off_policy_correction: str = _f(
        "behaviour",
        "grpokit-only: what the clip acts around when a batch is trained "
        "after the policy moved (max_staleness). 'behaviour' (TRL's "
        "asynchronous GRPO): the policy that sampled it. 'decoupled' "
        "(AReaL's decoupled PPO): the policy at the optimizer step, each "
        "token weighted by pi_prox / pi_behav and dropped above "
        "off_policy_correction_cap; needs num_iterations=1, not with "
        "loss_type='vespo'. docs/guides/async.md.",
    )
    off_policy_correction_cap: float | None = _f(
        5.0,
        "grpokit-only: off_policy_correction='decoupled': a token whose "
        "weight pi_prox / pi_behav exceeds this (> 1) is dropped from "
        "the loss (AReaL's behav_imp_weight_cap and default); None: no "
        "cap.",
    )
    queue_maxsize: int = _f(
        1024,
        "Asynchronous generation: completions the producer may hold ready for the trainer "
        "(whole generation batches; at least one).",
    )
    weight_sync_steps: int = _f(1, "Asynchronous generation: optimizer steps between the producer's weight updates.")
    heartbeat_stale_after_s: float = _f(
        300.0,
        "Asynchronous generation: seconds without a sign of life from the "
        "producer after which the run stops with a message.",
    )
    async_schedule: str | None = _f(
        None,
        "grpokit-only: asynchronous generation's weights. 'exact': generation "
        "batch n is sampled by the weights of exactly version max(0, n - "
        "max_staleness) (raised to a multiple of weight_sync_steps where that "
        "keeps the bound), whatever the timing: seeded runs are reproducible and "
        "a resumed run is bitwise the unbroken one. 'latest': by the newest "
        "weights when the batch starts (fresher, timing-dependent). None: 'exact' "
        "for whole generation batches, 'latest' for multi-turn groups streamed "
        "one by one (they cannot be exact: docs/guides/async.md).",
    )
    max_inflight_tasks: int = _f(
        -1,
        "Asynchronous generation (TRL's AsyncGRPOConfig name): how many completions may "
        "be in generation at once in multi-turn rollouts, streamed group by group "
        "(docs/guides/async.md). -1 (auto, TRL's): max(max_staleness, 1) x "
        "generation_batch_size.",
    )
    multi_objective_aggregation: str = _f(
        "sum_then_normalize",
        "'sum_then_normalize': weight and sum the rewards, "
        "then normalise in the group; 'normalize_then_sum' "
        "(GDPO): normalise each reward in its group first.",
    )
    advantage_estimator: str = _f(
        "grpo",
        "grpokit-only: 'grpo' (group z-score), 'rloo' (leave-one-out baseline) or "
        "'reinforce_pp_baseline' (group mean, batch std); docs/objectives.md.",
    )
    kl_in_reward: bool = _f(
        False,
        "grpokit-only: put the KL to the reference in the reward instead of the loss, as "
        "TRL's RLOOTrainer does: each completion's reward loses beta · sum_t (log π_old - "
        "log π_ref) before the advantage estimator, and the loss has no KL term "
        "(grpokit.RLOOTrainer sets it).",
    )
    reward_clip_range: list[float] | None = _f(
        None,
        "grpokit-only (TRL RLOOConfig's): clip each completion's summed "
        "reward to [lo, hi] before the KL penalty and the estimator "
        "(None: no clipping).",
    )
    use_adaptive_entropy: bool = _f(
        False,
        "Skywork-OR1: adapt entropy_coef (within entropy_coef_min/max, by "
        "entropy_coef_delta) towards entropy_target; the bonus applies only while "
        "entropy is below the target.",
    )
    off_policy_mask_threshold: float | None = _f(
        None,
        "DeepSeek-V3.2: drop negative-advantage sequences whose KL to the sampling policy exceeds this (None: off).",
    )
    use_bias_correction_kl: bool = _f(
        True,
        "Weight the k3 KL term by the importance ratio (DeepSeek-V3.2), so its "
        "gradient is the unbiased reverse-KL gradient (TRL's default).",
    )
    router_aux_loss_coef: float | None = _f(
        None,
        "MoE load-balancing loss weight (Switch Transformer); None: the "
        "model config's own (e.g. 0.001 for Qwen3-MoE), 0: off.",
    )
    cast_lm_head_to_fp32: bool = _f(
        False,
        "ScaleRL: the LM head's matmul and log-softmax in float32 for the policy "
        "and reference forwards, also under bf16 autocast (both head paths).",
    )
    trust_remote_code: bool = _f(
        False, "Allow custom model code from the Hub for the policy, its tokenizer and reward models (as TRL)."
    )
    use_liger_kernel: bool = _not_implemented(
        False,
        "TRL patches the model with Liger kernels; grpokit's chunked LM head already avoids full-vocabulary logits.",
    )
    liger_kernel_config: dict | None = _not_implemented(None, "Liger kernel options (see use_liger_kernel).")
    torch_compile: bool = _f(
        False,
        "Compile the policy's repeated blocks (its decoder layers) with torch.compile, "
        "in place, one block at a time (regional compilation, as accelerate's "
        "compile_regions): the rest (embeddings, the chunked LM head, the sampler's "
        "loop) runs eagerly. Refused under FSDP2 / DeepSpeed (not verified there).",
    )
    torch_compile_backend: str | None = _f(
        None, "torch.compile backend (None: 'inductor'); setting it turns torch_compile on, as in transformers."
    )
    torch_compile_mode: str | None = _f(
        None, "torch.compile mode (e.g. 'max-autotune'); setting it turns torch_compile on, as in transformers."
    )
    neftune_noise_alpha: float | None = _not_implemented(
        None, "TRL adds NEFTune noise to the embeddings (an SFT technique); grpokit does not."
    )
    bf16_full_eval: bool = _f(
        False,
        "evaluate() called outside train() first casts the policy to bfloat16, in "
        "place and for good, as transformers' Trainer does; evaluations during "
        "train() keep the training precision.",
    )
    fp16_full_eval: bool = _f(False, "As bf16_full_eval, in float16.")
    log_unique_prompts: bool = _f(
        False,
        "With log_completions, the trackers' completions table keeps one row per "
        "prompt (the first), as TRL's; completions.jsonl and the console keep all.",
    )
    log_completions_hub_repo: str | None = _not_implemented(
        None, "TRL uploads completions to a Hub dataset; grpokit writes completions.jsonl in output_dir."
    )
    trackio_space_id: str | None = _not_implemented(
        None, "TRL logs to a Trackio Space on the Hub; grpokit logs to Trackio locally (trackio sync to upload)."
    )
    trackio_bucket_id: str | None = _not_implemented(
        None, "Hub bucket of a Trackio Space; grpokit logs to Trackio locally."
    )
    trackio_static_space_id: str | None | Literal[False] = _not_implemented(
        None, "TRL publishes a static Trackio Space; grpokit logs to Trackio locally."
    )
    save_on_each_node: bool = _f(
        False,
        "Multi-node runs whose nodes share no storage: each node's main process "
        "writes the checkpoints and the final model into its own output_dir (so each "
        "node can resume from its own copy). With shared storage leave it False. "
        "DDP or one process per node; refused under FSDP2 / DeepSpeed.",
    )
    ignore_data_skip: bool = _f(
        False,
        "On resume, draw the current epoch's prompts from its start again (its "
        "order is the same), as transformers does; False continues where the "
        "checkpoint stopped. A generation batch the checkpoint holds half used is "
        "finished first.",
    )
    push_to_hub: bool = _f(
        False,
        "Upload the model to the Hub (hub_model_id, default: output_dir's name) when "
        "save_model / push_to_hub() is called; the Hub is checked at start-up.",
    )
    accelerator_config: dict | str | None = _f(
        None,
        "transformers' AcceleratorConfig: a dict, a JSON string or a "
        "JSON file's path; held as an AcceleratorConfig, as in TRL "
        "(`args.accelerator_config.dispatch_batches`). "
        "use_configured_state (the script's "
        "accelerate state is used, and must exist) and "
        "gradient_accumulation_kwargs.sync_each_batch (gradients "
        "synchronised at every micro-batch: less memory under FSDP) act; "
        "dispatch_batches, even_batches, use_seedable_sampler, "
        "non_blocking need no effect (grpokit's prompt sampler is "
        "seeded and gives every process whole batches); split_batches "
        "is refused.",
    )
    parallelism_config: ParallelismConfig | None = _not_implemented(
        None, "TRL's tensor/context parallelism; grpokit runs DDP, FSDP2 or ZeRO through accelerate launch."
    )
    deepspeed: dict | str | None = _f(
        None,
        "A DeepSpeed config, as TRL takes it: a dict, a JSON string or the path "
        "of a JSON file. Under torchrun / accelerate launch the run uses it as "
        "accelerate's deepspeed_config_file (ZeRO-1/2/3); 'auto' values take the "
        "run's own (batch sizes, accumulation, clipping, precision, bucket "
        "sizes). grpokit builds the optimizer and the scheduler, so an "
        "'optimizer' / 'scheduler' section is refused.",
    )
    fsdp: str | None = _f(
        None,
        "FSDP as TRL's field turns it on: True, or transformers' options "
        "'full_shard' / 'shard_grad_op' / 'offload' / 'auto_wrap' (a string "
        "or a list). grpokit runs FSDP2 (through accelerate, under torchrun / "
        "accelerate launch); FSDP1-only options are refused.",
    )
    fsdp_config: dict | str | None = _f(
        None,
        "FSDP options (a dict, a JSON string or a JSON file's path; keys with "
        "or without the 'fsdp_' prefix), as transformers reads them for FSDP2: "
        "version (2), auto_wrap_policy, transformer_layer_cls_to_wrap, "
        "min_num_params, reshard_after_forward, cpu_offload, state_dict_type, "
        "activation_checkpointing, cpu_ram_efficient_loading.",
    )
    debug: str | list[str] = _f(
        "",
        "'underflow_overflow': transformers' DebugUnderflowOverflow watches every module's "
        "inputs, outputs and weights and stops at the first inf/nan with the last frames "
        "(grpokit's chunked LM head is read outside the head module's forward, so the head's "
        "logits are not among them). 'tpu_metrics_debug' is refused (no TPU support).",
    )

    # ---- accepted, no effect needed (why)
    do_train: bool = _no_effect(False, "read by training scripts, not by the trainer; train() always trains.")
    do_eval: bool = _no_effect(False, "read by scripts, not by the trainer; eval_strategy decides evaluation.")
    do_predict: bool = _no_effect(False, "read by scripts, not by the trainer.")
    local_rank: int = _no_effect(-1, "the launcher's rank; accelerate reads it from the environment.")
    remove_unused_columns: bool | None = _no_effect(False, "every column reaches the reward functions.")
    dataloader_drop_last: bool = _no_effect(
        False, "an epoch holds whole generation batches (as TRL's sampler), so no batch is ever short."
    )
    dataloader_num_workers: int = _no_effect(0, LOADER_ONLY)
    dataloader_pin_memory: bool = _no_effect(True, LOADER_ONLY)
    dataloader_persistent_workers: bool = _no_effect(False, LOADER_ONLY)
    dataloader_prefetch_factor: int | None = _no_effect(None, LOADER_ONLY)
    dataloader_multiprocessing_context: str | None = _no_effect(None, LOADER_ONLY)
    dataloader_in_order: bool = _no_effect(True, "prompts are read in the main process, in order.")
    train_sampling_strategy: str = _no_effect(
        "random", "TRL's GRPO ignores it too (its own prompt sampler); use shuffle_dataset."
    )
    length_column_name: str = _no_effect("length", "only read by group_by_length sampling, which GRPO does not use.")
    label_names: list[str] | None = _no_effect(None, "GRPO has no labels.")
    label_smoothing_factor: float = _no_effect(0.0, "a term of supervised losses; GRPO has none.")
    prediction_loss_only: bool = _no_effect(False, "for Trainer.predict; GRPO evaluation returns rewards.")
    eval_do_concat_batches: bool = _no_effect(True, "for compute_metrics, which GRPO evaluation does not use.")
    eval_use_gather_object: bool = _no_effect(False, "for compute_metrics, which GRPO evaluation does not use.")
    eval_accumulation_steps: int | None = _no_effect(None, "for compute_metrics, which GRPO evaluation does not use.")
    include_for_metrics: list[str] = _no_effect([], "for compute_metrics, which GRPO evaluation does not use.")
    batch_eval_metrics: bool = _no_effect(False, "for compute_metrics, which GRPO evaluation does not use.")
    average_tokens_across_devices: bool = _no_effect(
        True, "for label losses; GRPO's loss_type does its own token normalisation across processes."
    )
    include_num_input_tokens_seen: str | bool = _no_effect("no", "grpokit, like TRL's GRPO, always logs num_tokens.")
    log_on_each_node: bool = _no_effect(True, "grpokit logs from the main process only.")
    logging_nan_inf_filter: bool = _no_effect(
        True, "logged means leave NaN out; non-finite steps are skipped (max_nonfinite_steps)."
    )
    skip_memory_metrics: bool = _no_effect(True, "grpokit adds no memory-profiler metrics.")
    log_multimodal: bool = _f(
        True,
        "With log_completions: the prompts' images are logged too (PNG files in "
        "<output_dir>/completion_images/, named in completions.jsonl and shown by "
        "`grpokit report`). Disable to keep logs small with large images.",
    )
    restore_callback_states_from_checkpoint: bool = _no_effect(False, "grpokit has no trainer callbacks.")
    use_cache: bool = _no_effect(False, "training forwards never use a KV cache; sampling always does.")
    tf32: bool | None = _no_effect(
        None, "grpokit leaves torch's matmul precision as it is (set torch.backends.cuda.matmul.allow_tf32 yourself)."
    )
    pad_to_multiple_of: int | str | None = _no_effect(
        "auto", "padding for shape-compiled backends (Neuron); values are the same without it."
    )
    ds3_gather_for_generation: bool = _no_effect(
        True, "under ZeRO-3 grpokit samples over the partitioned weights; the completions are the same either way."
    )
    hub_model_id: str | None = _f(None, "Hub repository push_to_hub uploads to (default: output_dir's name).")
    hub_token: str | None = _f(None, "Token for the Hub (default: the logged-in one).")
    hub_private_repo: bool | None = _f(None, "Create the Hub repository private.")
    hub_strategy: str = _no_effect(
        "every_save",
        "grpokit pushes when save_model / push_to_hub() is called (TRL's "
        "scripts call them at the end); checkpoints are not pushed.",
    )
    hub_always_push: bool = _no_effect(False, "checkpoints are not pushed (see hub_strategy).")
    hub_revision: str | None = _f(None, "Branch of the Hub repository to push to.")
    transformers_continuous_batching_config: dict | str | None = _no_effect(
        None, "only read with use_transformers_continuous_batching (not implemented; warned there)."
    )
    use_vllm: bool = _f(
        False,
        'Sample with vLLM (grpokit.rollout.vllm; `pip install ".[vllm]"` in the checkout '
        "on a GPU machine, the CPU recipe in the vLLM guide) instead of the in-process "
        "engine. π_old is then always the training forward's, and vLLM's log-probs feed only "
        "the importance-sampling correction.",
    )
    vllm_mode: str = _f(
        "colocate",
        "'colocate': vLLM runs inside each training process; 'server': "
        "it runs in `grpokit vllm-serve` (vllm_server_*) and the trainer talks to it "
        "over HTTP.",
    )
    vllm_model_impl: str = _f("vllm", "vLLM's model implementation: 'vllm' (its own) or 'transformers'.")
    vllm_enable_sleep_mode: bool = _f(
        False,
        "Colocate: vLLM frees its weights and KV cache while the trainer trains "
        "(GPU only: on CPU vLLM has no sleep mode; it warns and stays awake).",
    )
    vllm_structured_outputs_regex: str | None = _f(
        None,
        "Every completion matches this regex (vLLM's "
        "structured outputs; vLLM then needs the tokenizer: in "
        "server mode, in the server's --model directory). The "
        "sampling log-probs are the masked distribution's.",
    )
    vllm_server_base_url: str | None = _f(
        None,
        "Server mode: the server's URL, e.g. 'http://localhost:8000' (wins "
        "over vllm_server_host / vllm_server_port); several servers of the "
        "same model: their URLs separated by commas (each generation is "
        "spread over them by load, the weights go to all).",
    )
    vllm_server_failover: bool = _f(
        False,
        "Server mode with several servers: a server that fails is left out for "
        "the rest of the run (its prompts go to the others, with a warning) "
        "instead of stopping the run with its URL.",
    )
    vllm_server_host: str = _f("0.0.0.0", "Server mode: the server's host (when no vllm_server_base_url).")
    vllm_server_port: int = _f(8000, "Server mode: the server's port (when no vllm_server_base_url).")
    vllm_server_timeout: float = _f(
        240.0,
        "Server mode: seconds to wait for the server to come up, and for each "
        "request in all (its retries after a connection error included, after "
        "pauses of 2, 4, 8 s), before failing with a clear error.",
    )
    vllm_group_port: int | None = _f(
        None,
        "Server mode: push the weights through a process group with the server, "
        "whose store it hosts at this port (NCCL between GPUs, gloo between "
        "CPUs), as TRL does at its default 51216. None (grpokit's default): "
        "safetensors over HTTP, which needs no port.",
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "Colocate on GPU: the share of GPU memory vLLM takes. On CPU the KV "
        "cache size is VLLM_CPU_KVCACHE_SPACE (GiB; grpokit's default 1).",
    )
    vllm_max_model_length: int | None = _f(
        None, "vLLM's max_model_len, prompt plus completion tokens (None: the model's context length)."
    )
    vllm_tensor_parallel_size: int = _f(
        1, "Colocate: vLLM's tensor-parallel size (1 with several training processes: each runs a whole engine)."
    )
    vllm_importance_sampling_correction: bool = _f(
        True,
        "With use_vllm: weight each token's loss by π_old / "
        "π_sampler (the training forward's over vLLM's log-probs), "
        "truncated or masked per vllm_importance_sampling_mode "
        "(TIS / MIS; grpokit.loss.sampling_correction).",
    )
    vllm_importance_sampling_mode: str = _f(
        "sequence_mask",
        "'token_truncate', 'token_mask', 'sequence_truncate' or "
        "'sequence_mask': per-token or per-sequence (sum of the "
        "log differences) ratio, clamped to the clip bounds or "
        "set to 0 outside them.",
    )
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "Upper bound of the correction's ratio (None: none).")
    vllm_importance_sampling_clip_min: float | None = _f(None, "Lower bound of the correction's ratio (None: none).")
    vllm_importance_sampling_cap: float | None = _f(
        None, "TRL's deprecated name of vllm_importance_sampling_clip_max: moved there, with a FutureWarning."
    )
    served_logprob_tolerance: float | None = _f(
        0.1,
        "grpokit-only: the served-policy check. On every batch sampled with the weights "
        "just pushed, the mean |pi_old - pi_sampler| over the sampled tokens "
        "(sampling/sampling_logp_difference/mean) must not exceed it, or the run stops: "
        "the engine is not sampling with the weights it was sent (grpokit.served). The "
        "in-process engine samples with the trained module itself: its gap is logged, never "
        "raised. None: the gap is logged, never raised (docs/guides/vllm.md).",
    )
    sapo_temperature_neg: float = _f(1.05, "SAPO gate temperature for negative advantages.")
    sapo_temperature_pos: float = _f(1.0, "SAPO gate temperature for positive advantages.")
    vespo_k_pos: float = _f(2.0, "VESPO k for positive advantages.")
    vespo_lambda_pos: float = _f(3.0, "VESPO lambda for positive advantages.")
    vespo_k_neg: float = _f(3.0, "VESPO k for negative advantages.")
    vespo_lambda_neg: float = _f(2.0, "VESPO lambda for negative advantages.")
    entropy_coef_min: float = _f(0.0, "use_adaptive_entropy: lowest entropy_coef.")
    entropy_coef_max: float = _f(1.0, "use_adaptive_entropy: highest entropy_coef.")
    entropy_coef_delta: float = _f(0.005, "use_adaptive_entropy: change of entropy_coef per step.")
    entropy_target: float = _f(0.2, "use_adaptive_entropy: the mean token entropy aimed at.")

    # ---- deprecated grpokit names (TRL 1.16 / transformers 5 dropped or renamed them): they still take effect
    max_prompt_length: int | None = _deprecated(
        None,
        "TRL 1.16 dropped it and no longer cuts prompts; filter "
        "overlong prompts out of the dataset instead. Set, grpokit "
        "still keeps each prompt's last max_prompt_length tokens.",
    )
    warmup_ratio: float = _deprecated(
        0.0,
        "transformers 5 dropped it; use warmup_steps=<fraction> (a float in "
        "(0, 1)). A fraction given either way is kept here.",
    )
    logging_dir: str | None = _deprecated(
        None,
        "transformers 5 dropped it; set the TENSORBOARD_LOGGING_DIR environment variable (default: output_dir/runs).",
    )
    use_liger_loss: bool = _deprecated(False, "TRL 0.25.0 renamed it use_liger_kernel.")
    wandb_log_unique_prompts: bool = _deprecated(False, "TRL 0.26.0 renamed it log_unique_prompts.")
    overwrite_output_dir: bool = _deprecated(
        False,
        "transformers 5 dropped it; GRPOTrainer writes into output_dir as told. `grpokit train "
        "--overwrite_output_dir true` starts over in a folder that holds a previous run.",
    )

    def __new__(cls, *args, **kwargs):
        # A keyword that is not a field fails here, before the dataclass's __init__, whose TypeError names only the
        # keyword: this one also says what to write instead.
        unknown = sorted(set(kwargs) - set(cls.__dataclass_fields__))
        if unknown:
            said = (
                f"an unexpected keyword argument {unknown[0]!r}"
                if len(unknown) == 1
                else f"unexpected keyword arguments {', '.join(map(repr, unknown))}"
            )
            raise TypeError(f"{cls.__name__}() got {said}: {fields_note(cls, unknown)}")
        return super().__new__(cls)

    def __post_init__(self):
        # What the user wrote, before anything is derived: saved as the run's grpo_config.json (`save`).
        object.__setattr__(self, "_as_written", {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        self._normalise()
        self._apply_deprecated()
        self._apply_generation_kwargs()
        self._resolve_aliases_and_nones()
        self._derive_generation_batch()
        self.validate()
        self._hold_accelerator_config()
        self._warn_not_implemented()

    # ------------------------------------------------------------------------------------- normalisation

    def _normalise(self) -> None:
        """Plain values from what TRL also accepts: enum members, dicts given as JSON strings, integral floats."""
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, enum.Enum):  # transformers' SchedulerType.COSINE, IntervalStrategy.STEPS, ...
                setattr(self, spec.name, value.value)
            elif isinstance(value, str) and value.startswith("{") and "dict" in annotation_of(spec.name):
                setattr(self, spec.name, json.loads(value))
        for name in ("logging_steps", "save_steps", "eval_steps", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, float) and value >= 1 and value.is_integer():
                setattr(self, name, int(value))  # as transformers does: 10.0 steps is 10
        if isinstance(self.include_num_input_tokens_seen, bool):  # transformers' spelling
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if isinstance(self.debug, str) or self.debug is None:  # transformers' spelling: options separated by spaces
            self.debug = (self.debug or "").split()
        self.debug = [getattr(option, "value", option) for option in self.debug]  # DebugOption members too
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        self.report_to = list(self.report_to or [])
        if self.report_to == ["none"]:
            self.report_to = []
        if self.report_to == ["all"]:  # transformers' meaning: every supported tracker that is installed
            self.report_to = [name for name, tracker in TRACKERS.items() if importlib.util.find_spec(tracker.module)]

    def _apply_deprecated(self) -> None:
        self._apply_renames()
        for name, message in DEPRECATED.items():
            if _is_default(getattr(self, name), _default_of(name)):
                continue
            warnings.warn(f"GRPOConfig.{name} is deprecated: {message}", FutureWarning, stacklevel=4)
        # A warm-up fraction lives in warmup_ratio, whichever name gave it (the trainer reads it there).
        if 0 < self.warmup_steps < 1:
            self.warmup_ratio, self.warmup_steps = float(self.warmup_steps), 0

    def _apply_renames(self) -> None:
        """TRL_RENAMES for this config's class and the classes it extends: an old name's value moves to the new
        name, with a FutureWarning. Both set, to different values, is an error: which one was meant is unknown."""
        classes = {cls.__name__ for cls in type(self).__mro__}
        for rename in TRL_RENAMES:
            if rename["config"] not in classes:
                continue
            old, new = rename["old"], rename["new"]
            old_value, old_default = getattr(self, old), _default_of(old, type(self))
            new_value, new_default = getattr(self, new), _default_of(new, type(self))
            if _is_default(old_value, old_default):
                continue
            if not _is_default(new_value, new_default) and new_value != old_value:
                raise ValueError(
                    f"{old}={old_value!r} and {new}={new_value!r} set one option twice: {new} is its name since "
                    f"TRL {rename['trl']} ({old} the older one). Give only {new}."
                )
            warnings.warn(
                f"{type(self).__name__}.{old} is deprecated: TRL {rename['trl']} renamed it {new}; its value "
                f"{old_value!r} is used as {new}.",
                FutureWarning,
                stacklevel=5,
            )
            setattr(self, new, old_value)
            setattr(self, old, old_default)

    def _apply_generation_kwargs(self) -> None:
        """TRL's generation_kwargs: the keys grpokit's engines honour exactly, the keys that cannot change what is
        sampled (GENERATION_KWARGS_WITHOUT_EFFECT) and the rest at their neutral value (GENERATION_KWARGS_NEUTRAL);
        anything else fails by name."""
        options = self.generation_kwargs
        if options is None:
            return

        def fail(message: str):
            raise ValueError(message)

        if not isinstance(options, dict):
            fail(f"generation_kwargs={options!r} must be a dict, e.g. {{'top_k': 50, 'eos_token_id': [2, 7]}}.")
        if "temperature" in options and options["temperature"] != self.temperature:
            fail(
                f"generation_kwargs temperature={options['temperature']!r} differs from temperature="
                f"{self.temperature}: grpokit samples and computes the training log-probs at one temperature (a "
                f"sampling-only temperature would make the importance ratio wrong). Set temperature instead."
            )
        if options.get("do_sample", True) is not True:
            fail(
                "generation_kwargs do_sample=False: GRPO needs sampled completions (greedy ones are the same in "
                "every group). Use top_k=1 to sample the most likely token, knowingly."
            )
        for name in ("max_new_tokens", "max_tokens", "max_length"):
            if name in options:
                fail(f"generation_kwargs {name}: set max_completion_length instead.")
        changing = sorted(
            name
            for name, neutral in GENERATION_KWARGS_NEUTRAL.items()
            if name in options and not any(_same(options[name], value) for value in neutral)
        )
        if "num_beams" in options and not (type(options["num_beams"]) is int and options["num_beams"] >= 1):
            fail(f"generation_kwargs num_beams={options['num_beams']!r} must be a whole number >= 1 (1: no beams).")
        generated = [name for name in changing if name in GENERATE_KWARGS]
        if not self.use_vllm:  # the in-process engine samples these with transformers' generate, as TRL
            changing = [name for name in changing if name not in GENERATE_KWARGS]
        if changing:
            also = (
                f"; without use_vllm, {', '.join(GENERATE_KWARGS)} are sampled with transformers' generate"
                if generated
                else ""
            )
            fail(
                f"generation_kwargs {changing}: {', '.join(f'{n}={options[n]!r}' for n in changing)} would change the "
                f"sampling in a way grpokit's engines do not implement (accepted at "
                f"{', '.join(f'{n}={GENERATION_KWARGS_NEUTRAL[n][0]!r}' for n in changing)}). Supported: "
                f"{', '.join(GENERATION_KWARGS)}{also}."
            )
        known = {*GENERATION_KWARGS, *GENERATION_KWARGS_WITHOUT_EFFECT, *GENERATION_KWARGS_NEUTRAL}
        unknown = sorted(set(options) - known)
        if unknown:
            fail(
                f"generation_kwargs {unknown}: not an option of transformers' GenerationConfig or vLLM's "
                f"SamplingParams that grpokit knows (TRL would ignore a misspelt one silently). Supported: "
                f"{', '.join(GENERATION_KWARGS)}."
            )
        for name in ("eos_token_id", "stop_token_ids", "suppress_tokens"):
            if name in options and _token_ids(options[name]) is None:
                fail(
                    f"generation_kwargs {name}={options[name]!r} must be a token id or a list of token ids (ints >= 0)."
                )
        if not isinstance(options.get("disable_compile", False), bool):
            fail(f"generation_kwargs disable_compile={options['disable_compile']!r} must be True or False.")
        for name in ("top_p", "top_k", "min_p", "repetition_penalty"):  # TRL: these override the named fields
            if name in options:
                setattr(self, name, options[name])

    def deepspeed_config(self) -> dict | None:
        """The `deepspeed` field as a dict of its own (None when unset): given as a dict, a JSON string (turned into a
        dict by `_normalise`) or the path of a JSON file, as transformers' TrainingArguments reads it."""
        if self.deepspeed is None:
            return None
        if isinstance(self.deepspeed, dict):
            return json.loads(json.dumps(self.deepspeed))
        path = Path(self.deepspeed)
        if not path.is_file():
            raise ValueError(
                f"deepspeed={self.deepspeed!r} is neither a dict, a JSON object nor the path of a JSON "
                f"file; pass the DeepSpeed config (e.g. deepspeed='ds_zero2.json')."
            )
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"deepspeed={self.deepspeed!r}: the file is not valid JSON ({error}).") from None
        if not isinstance(config, dict):
            raise ValueError(
                f"deepspeed={self.deepspeed!r}: the file holds {type(config).__name__}, not a JSON object."
            )
        return config

    def _given_accelerator_config(self) -> dict:
        """The options the `accelerator_config` field was given ({} when unset): a dict, an AcceleratorConfig, a JSON
        string or the path of a JSON file."""
        value = self.accelerator_config
        if value is None:
            return {}
        if dataclasses.is_dataclass(value):  # transformers' AcceleratorConfig
            value = dataclasses.asdict(value)
        elif isinstance(value, str):
            path = Path(value)
            if not path.is_file():
                raise ValueError(
                    f"accelerator_config={value!r} is neither a dict, a JSON object nor the path of a JSON file."
                )
            value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError(
                f"accelerator_config must be a dict of AcceleratorConfig options, not {type(value).__name__}."
            )
        return value

    def _hold_accelerator_config(self) -> None:
        """As transformers' TrainingArguments: the field holds an AcceleratorConfig whatever form it was given in, so
        that TRL's code and scripts read and set its attributes (`args.accelerator_config.dispatch_batches`)."""
        from transformers.trainer_pt_utils import AcceleratorConfig

        if not isinstance(self.accelerator_config, AcceleratorConfig):
            self.accelerator_config = AcceleratorConfig(**self._given_accelerator_config())

    def accelerator_options(self) -> dict:
        """The `accelerator_config` field as a dict of all of transformers' AcceleratorConfig options (their defaults
        where not given). Unknown options, an accumulation count other than gradient_accumulation_steps, and
        split_batches are refused."""
        value = self._given_accelerator_config()
        unknown = sorted(set(value) - set(ACCELERATOR_CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(
                f"accelerator_config {unknown}: not options of transformers' AcceleratorConfig; known: "
                f"{sorted(ACCELERATOR_CONFIG_DEFAULTS)}."
            )
        options = {**ACCELERATOR_CONFIG_DEFAULTS, **value}
        if options["split_batches"]:
            raise ValueError(
                "accelerator_config split_batches=True is not supported: per_device_train_batch_size is "
                "each process's share (as in TRL's GRPO, whose batch arithmetic assumes it); divide it "
                "by the number of processes instead."
            )
        accumulation = dict(options["gradient_accumulation_kwargs"] or {})
        unknown = sorted(
            set(accumulation) - {"num_steps", "adjust_scheduler", "sync_with_dataloader", "sync_each_batch"}
        )
        if unknown:
            raise ValueError(
                f"accelerator_config gradient_accumulation_kwargs {unknown}: not options of accelerate's "
                f"GradientAccumulationPlugin."
            )
        steps = accumulation.get("num_steps")
        if steps is not None and steps != self.gradient_accumulation_steps:
            raise ValueError(
                f"accelerator_config gradient_accumulation_kwargs num_steps={steps} disagrees with "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: set the count once, "
                f"with gradient_accumulation_steps."
            )
        options["gradient_accumulation_kwargs"] = accumulation
        return options

    def fsdp_plugin_kwargs(self) -> dict | None:
        """accelerate's FullyShardedDataParallelPlugin arguments from `fsdp` / `fsdp_config` (None: FSDP off), as
        transformers' TrainingArguments derives them for FSDP2; anything grpokit would not run is refused by name."""
        if self.fsdp in (None, False, "", []):
            return None
        options = self.fsdp_config if self.fsdp_config is not None else {}
        if isinstance(options, str):
            if not Path(options).is_file():
                raise ValueError(
                    f"fsdp_config={options!r} is neither a dict, a JSON object nor the path of a JSON file."
                )
            options = json.loads(Path(options).read_text())
        options = {name.removeprefix("fsdp_"): value for name, value in options.items()}
        items = [] if self.fsdp is True else self.fsdp.split() if isinstance(self.fsdp, str) else list(self.fsdp)
        for item in items:  # transformers' legacy options, into fsdp_config's terms
            if item in ("full_shard", "shard_grad_op"):
                options.setdefault("reshard_after_forward", item == "full_shard")
            elif item == "offload":
                options.setdefault("cpu_offload", True)
            elif item in ("hybrid_shard", "hybrid_shard_zero2", "no_shard"):
                raise ValueError(
                    f"fsdp={self.fsdp!r}: '{item}' is an FSDP1 strategy, and grpokit runs FSDP2; use "
                    f"'full_shard' or 'shard_grad_op' (or DDP for 'no_shard')."
                )
            elif item != "auto_wrap":
                raise ValueError(
                    f"fsdp={self.fsdp!r}: unknown option '{item}'; use 'full_shard', 'shard_grad_op', "
                    f"'offload' and/or 'auto_wrap', or fsdp=True with fsdp_config."
                )
        if int(options.pop("version", 2)) != 2:
            raise ValueError("fsdp_config version 1 (FSDP1) is not supported: grpokit runs FSDP2; set version 2.")
        known = {
            "auto_wrap_policy",
            "transformer_layer_cls_to_wrap",
            "min_num_params",
            "reshard_after_forward",
            "cpu_offload",
            "state_dict_type",
            "activation_checkpointing",
            "cpu_ram_efficient_loading",
        }
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"fsdp_config {unknown}: not FSDP2 options grpokit passes on (FSDP1's and XLA's are not "
                f"run); use {sorted(known)}."
            )
        policy = options.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
        if policy not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"):
            raise ValueError(
                f"fsdp_config auto_wrap_policy={policy!r}: use 'TRANSFORMER_BASED_WRAP', "
                f"'SIZE_BASED_WRAP' or 'NO_WRAP'."
            )
        state_dict_type = options.get("state_dict_type", "FULL_STATE_DICT")
        if state_dict_type not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            raise ValueError(
                f"fsdp_config state_dict_type={state_dict_type!r}: use 'FULL_STATE_DICT' or 'SHARDED_STATE_DICT'."
            )

        def flag(value) -> bool:
            return value if isinstance(value, bool) else str(value).lower() in ("true", "1", "yes", "y", "on")

        kwargs = {
            "fsdp_version": 2,
            "auto_wrap_policy": policy,
            "state_dict_type": state_dict_type,
            "reshard_after_forward": flag(options.get("reshard_after_forward", True)),
            "cpu_ram_efficient_loading": flag(options.get("cpu_ram_efficient_loading", False)),
        }
        for name in ("cpu_offload", "activation_checkpointing"):
            if name in options:
                kwargs[name] = flag(options[name])
        if policy == "SIZE_BASED_WRAP" and int(options.get("min_num_params", 0)) > 0:
            kwargs["min_num_params"] = int(options["min_num_params"])
        layers = options.get("transformer_layer_cls_to_wrap")
        if policy == "TRANSFORMER_BASED_WRAP" and layers is not None:
            kwargs["transformer_cls_names_to_wrap"] = ",".join([layers] if isinstance(layers, str) else layers)
        return kwargs

    def objective_options(self) -> dict:
        """The objective's settings as `loss.PolicyLossSettings`' fields (`policy_loss`'s keyword arguments)."""
        names = (
            "loss_type",
            "beta",
            "epsilon",
            "epsilon_high",
            "importance_sampling_level",
            "max_completion_length",
            "delta",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
            "off_policy_mask_threshold",
            "use_bias_correction_kl",
            "off_policy_correction",
            "off_policy_correction_cap",
        )
        options = {name: getattr(self, name) for name in names}
        if self.kl_in_reward:  # the KL is a reward penalty (experience.py), not a loss term
            options["beta"] = 0.0
        return options

    def transformers_generate_kwargs(self) -> dict:
        """The generation_kwargs only transformers' `generate` honours (GENERATE_KWARGS away from their neutral
        value, and the beam options beside them); empty when grpokit's own sampler does what they ask."""
        options = self.generation_kwargs or {}
        needed = {
            name: options[name]
            for name in GENERATE_KWARGS
            if name in options and not any(_same(options[name], v) for v in GENERATION_KWARGS_NEUTRAL[name])
        }
        if not needed or self.use_vllm:
            return {}
        return {**needed, **{name: options[name] for name in GENERATE_COMPANION_KWARGS if name in options}}

    def generation_token_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(extra tokens that end a completion, tokens never sampled) from generation_kwargs."""
        options = self.generation_kwargs or {}
        stop = [*_token_ids(options.get("eos_token_id", [])), *_token_ids(options.get("stop_token_ids", []))]
        return tuple(dict.fromkeys(stop)), tuple(_token_ids(options.get("suppress_tokens", [])))

    def _resolve_aliases_and_nones(self) -> None:
        if self.load_best_model_at_end and self.metric_for_best_model is None:  # transformers' defaults
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        # transformers 5's activation_checkpointing* win over gradient_checkpointing* when set. They are not mirrored
        # back: a copy that changes gradient_checkpointing (dataclasses.replace) must not be overruled by a stale copy.
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is not None:
                setattr(self, old, getattr(self, new))
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:  # transformers' rule
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        if self.shuffle_dataset is None:
            self.shuffle_dataset = True
        if self.top_k == 0:
            self.top_k = None
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations

    def _derive_generation_batch(self) -> None:
        """TRL's GRPOConfig.__post_init__ arithmetic: generation_batch_size is global (all processes), counted from
        the launcher's WORLD_SIZE; steps_per_generation is each process's."""
        if not isinstance(self.per_device_train_batch_size, int) or self.per_device_train_batch_size < 1:
            return  # validate() names the field
        global_batch = self.per_device_train_batch_size * launched_processes()
        if self.steps_per_generation is None and self.generation_batch_size is not None:
            if self.generation_batch_size % global_batch:
                raise ValueError(  # TRL's words first
                    f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch size "
                    f"({global_batch}): per_device_train_batch_size ({self.per_device_train_batch_size}) x "
                    f"{launched_processes()} process(es); generation_batch_size counts the completions of all "
                    f"processes, as in TRL."
                )
            self.steps_per_generation = self.generation_batch_size // global_batch
        elif self.generation_batch_size is not None and self.generation_batch_size != (
            global_batch * self.steps_per_generation
        ):
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) and steps_per_generation "
                f"({self.steps_per_generation}) disagree: generation_batch_size must equal "
                f"per_device_train_batch_size x processes ({launched_processes()}) x steps_per_generation. Set only "
                f"one of them."
            )
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if isinstance(self.steps_per_generation, int):
            self.generation_batch_size = global_batch * self.steps_per_generation

    @property
    def generation_batch_per_process(self) -> int:
        """The completions each process samples per generation: per_device_train_batch_size x steps_per_generation
        (generation_batch_size / number of processes)."""
        return self.per_device_train_batch_size * self.steps_per_generation

    def _warn_not_implemented(self) -> None:
        for name, message in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if not _is_default(value, _default_of(name)):
                warnings.warn(
                    f"GRPOConfig.{name}={value!r} is accepted for compatibility with TRL but is not implemented by "
                    f"grpokit: it has no effect. {message}",
                    UserWarning,
                    stacklevel=4,
                )

    # ------------------------------------------------------------------------------------------- validation

    def validate(self) -> None:
        """Check every value and every relation between values, one feature at a time (`_CHECKS`, below the
        class); raise ValueError saying how to fix it."""
        for check in _CHECKS:
            check(self)

    def check_batch(self, num_processes: int) -> None:
        """The generation batch counts the run's processes, and holds whole groups of num_generations (TRL's rule).
        A generation_batch_size derived for another number of processes (no WORLD_SIZE when the config was made)
        is derived again; one the user gave cannot be, and is refused."""
        global_batch = self.generation_batch_per_process * num_processes
        if self.generation_batch_size != global_batch:
            if (getattr(self, "_as_written", None) or {}).get("generation_batch_size") is not None:
                raise ValueError(
                    f"generation_batch_size ({self.generation_batch_size}) was read for {launched_processes()} "
                    f"process(es) (WORLD_SIZE when the config was made), but the run has {num_processes}: make the "
                    f"config in the launched processes (after torchrun / accelerate launch set WORLD_SIZE), or set "
                    f"steps_per_generation instead."
                )
            self.generation_batch_size = global_batch
        if global_batch % self.num_generations:
            valid = [g for g in range(2, global_batch + 1) if global_batch % g == 0]
            raise ValueError(  # TRL's phrase first
                f"generation_batch_size ({global_batch}) must be divisible by num_generations "
                f"({self.num_generations}): the global generation batch ({num_processes} process(es) x "
                f"per_device_train_batch_size {self.per_device_train_batch_size} x steps_per_generation "
                f"{self.steps_per_generation} = {global_batch} completions) must be a multiple of num_generations. "
                f"Change per_device_train_batch_size or num_generations (valid num_generations here: {valid})."
            )

    # ----------------------------------------------------------------------------------------------- helpers

    @classmethod
    def field_help(cls, name: str) -> str:
        return cls.__dataclass_fields__[name].metadata.get("help", "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """The configuration as the user wrote it (derived values, such as steps_per_generation from
        gradient_accumulation_steps, are derived again on loading): `GRPOConfig.from_dict` of it is this config."""
        written = getattr(self, "_as_written", None) or self.to_dict()
        # An AcceleratorConfig given as one is written as its options.
        written = {
            name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            for name, value in written.items()
        }
        Path(path).write_text(json.dumps(written, indent=2, default=str))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"Unknown {cls.__name__} field(s) {unknown}: {fields_note(cls, unknown)}")
        values = dict(values)
        if 0 < values.get("warmup_ratio", 0) < 1 and not values.get("warmup_steps"):
            # A saved config keeps a warm-up fraction in warmup_ratio; load it under its current name.
            values["warmup_steps"] = values.pop("warmup_ratio")
        return cls(**values)


def fields_note(config_class: type, unknown: list[str]) -> str:
    """What to write instead of keywords that are not fields of `config_class`: the nearest field name of each
    misspelling, and the class's `unknown_field_hint` (which TRL release its names follow)."""
    fields = list(config_class.__dataclass_fields__)
    nearest = {name: difflib.get_close_matches(name, fields, n=1, cutoff=0.8) for name in unknown}
    guesses = "".join(f" {name!r}: did you mean {close[0]!r}?" for name, close in nearest.items() if close)
    return f"not {'a field' if len(unknown) == 1 else 'fields'} of {config_class.__name__}.{guesses} " + (
        config_class.unknown_field_hint
    )


def launched_processes() -> int:
    """The processes of the run as the launcher set them (torchrun, accelerate launch: WORLD_SIZE), 1 without one:
    TRL's GRPOConfig derives generation_batch_size from its world_size when it is made."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# ------------------------------------------------------------------------------------------- validation
# One check per feature, run in this order by `GRPOConfig.validate`: each takes the config and raises ValueError
# with a message that says how to fix the value.


def _check_batch_shape(config: GRPOConfig) -> None:
    """The counts that shape a batch, and the group size GRPO's advantage needs."""
    for name in (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_iterations",
        "steps_per_generation",
        "max_completion_length",
    ):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer (>= 1).")
    if not isinstance(config.num_generations, int) or config.num_generations < config.min_num_generations:
        raise ValueError(
            f"GRPO requires at least 2 generations per prompt to calculate the advantages. You provided "
            f"num_generations={config.num_generations}: GRPO's advantage compares the completions of one prompt "
            f"with each other, so a group of 1 has no signal."
        )
    if config.max_prompt_length is not None and config.max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={config.max_prompt_length} must be a positive integer or None (no limit).")
    if config.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size is not supported by GRPO (auto_find_batch_size=True): the generation batch must "
            "hold whole groups of num_generations completions, and halving the batch on out-of-memory breaks them. Set "
            "auto_find_batch_size=False and lower per_device_train_batch_size instead."
        )


def _check_objective(config: GRPOConfig) -> None:
    """The loss (`loss.PolicyLossSettings`): its type, clip range, KL, entropy options and off-policy correction."""
    # The loss module imports torch, which `grpokit train --help` (reading the fields) must not.
    from .loss import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, OFF_POLICY_CORRECTIONS

    if config.loss_type not in AGGREGATIONS:
        raise ValueError(f"loss_type={config.loss_type!r} is not a loss type; use one of {sorted(AGGREGATIONS)}.")
    if config.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={config.importance_sampling_level!r} is not valid; use 'token' (GRPO) "
            f"or 'sequence' (GSPO) (or 'sequence_sum': TRL RLOOTrainer's summed log-ratio)."
        )
    if config.beta < 0:
        raise ValueError(f"beta={config.beta} must be >= 0 (0 disables the KL term and the reference model).")
    if config.epsilon <= 0 or (config.epsilon_high is not None and config.epsilon_high <= 0):
        raise ValueError(f"epsilon={config.epsilon} and epsilon_high={config.epsilon_high} must be > 0.")
    if config.delta is not None and config.delta <= 1 + config.epsilon:
        raise ValueError(
            f"delta={config.delta} must be greater than 1 + epsilon ({1 + config.epsilon}), or None to disable."
        )
    if not 0 <= config.top_entropy_quantile <= 1:  # TRL's range: 0.0 keeps only the highest-entropy token
        raise ValueError(
            f"top_entropy_quantile={config.top_entropy_quantile} must be in [0, 1] (1.0 keeps every "
            "token, 0.0 only the highest-entropy one)."
        )
    if config.padding_free and (config.entropy_coef != 0 or config.use_adaptive_entropy):
        raise ValueError(
            "padding_free=True gives entropies without a gradient, and an entropy bonus (entropy_coef != "
            "0 or use_adaptive_entropy) needs one: set padding_free=False or drop the bonus."
        )
    if config.off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"off_policy_correction={config.off_policy_correction!r} is not valid; use one of "
            f"{list(OFF_POLICY_CORRECTIONS)} ('behaviour': TRL's asynchronous GRPO; 'decoupled': AReaL's "
            f"decoupled PPO)."
        )
    cap = config.off_policy_correction_cap
    if cap is not None and not cap > 1:
        raise ValueError(
            f"off_policy_correction_cap={cap} must be > 1 (a token whose weight pi_prox / pi_behav "
            f"exceeds it is dropped; the weight is 1 on-policy), or None for no cap."
        )
    if config.off_policy_correction == "decoupled" and config.num_iterations != 1:
        raise ValueError(
            f"off_policy_correction='decoupled' needs num_iterations=1 (got {config.num_iterations}): "
            f"its proximal policy is the training forward's own log-probs, the weights of the optimizer "
            f"step, which holds only when each batch is trained in one step. Set num_iterations=1, or "
            f"off_policy_correction='behaviour'."
        )
    if config.off_policy_correction == "decoupled" and not AGGREGATIONS[config.loss_type].decoupled_correction:
        raise ValueError(
            f"off_policy_correction='decoupled' is not defined for loss_type={config.loss_type!r}: its "
            f"sequence weight is its own off-policy correction. Use off_policy_correction='behaviour' "
            f"with it."
        )


def _check_rewards(config: GRPOConfig) -> None:
    """How rewards become advantages: clipping, the KL penalty in the reward, scaling, failing reward functions."""
    # The advantages module imports torch, which `grpokit train --help` (reading the fields) must not.
    from .advantages import SCALE_REWARDS

    if config.reward_clip_range is not None:
        clip = config.reward_clip_range
        if not isinstance(clip, (list, tuple)) or len(clip) != 2 or not clip[0] <= clip[1]:
            raise ValueError(
                f"reward_clip_range={clip!r} must be two numbers [lo, hi] with lo <= hi (or None: no clipping)."
            )
        config.reward_clip_range = [float(clip[0]), float(clip[1])]
    if (config.kl_in_reward or config.reward_clip_range) and config.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            "kl_in_reward and reward_clip_range shape the summed reward: they need "
            "multi_objective_aggregation='sum_then_normalize'."
        )
    if config.scale_rewards not in (*SCALE_REWARDS, True, False):  # True / False: TRL's legacy spelling
        raise ValueError(f"scale_rewards={config.scale_rewards!r} is not valid; use 'group', 'batch' or 'none'.")
    if config.reward_fn_errors not in ("raise", "none"):
        raise ValueError(f"reward_fn_errors={config.reward_fn_errors!r} is not valid; use 'raise' or 'none'.")


def _check_tools(config: GRPOConfig) -> None:
    """Multi-turn rollouts with tools."""
    if config.max_tool_calling_iterations is not None and config.max_tool_calling_iterations < 0:
        raise ValueError(
            f"max_tool_calling_iterations={config.max_tool_calling_iterations} must be >= 0 (or None: no limit)."
        )
    if not config.tool_timeout > 0:
        raise ValueError(f"tool_timeout={config.tool_timeout} must be a positive number of seconds.")
    if config.max_tool_output_chars is not None and config.max_tool_output_chars < 1:
        raise ValueError(
            f"max_tool_output_chars={config.max_tool_output_chars} must be a positive number of "
            f"characters (or None: no limit)."
        )


def _check_async(config: GRPOConfig) -> None:
    """Asynchronous generation: staleness, the schedule, the queue and the producer's heartbeat."""
    if config.max_inflight_tasks == 0 or config.max_inflight_tasks < -1:
        raise ValueError(
            f"max_inflight_tasks={config.max_inflight_tasks}: give a positive count of completions, or "
            f"-1 (auto: max(max_staleness, 1) x generation_batch_size)."
        )
    if config.max_staleness is not None and config.max_staleness < 0:
        raise ValueError(
            f"max_staleness={config.max_staleness}: give the optimizer steps a sample may lag behind "
            f"the policy (0: the synchronous loop), or None for no producer."
        )
    if config.async_schedule not in (None, "exact", "latest"):
        raise ValueError(
            f"async_schedule={config.async_schedule!r} is not valid; use 'exact', 'latest' or None "
            f"(exact where possible)."
        )
    if config.weight_sync_steps < 1 or config.queue_maxsize < 1 or not config.heartbeat_stale_after_s > 0:
        raise ValueError(
            f"weight_sync_steps={config.weight_sync_steps}, queue_maxsize={config.queue_maxsize} and "
            f"heartbeat_stale_after_s={config.heartbeat_stale_after_s} must be positive."
        )


def _check_sampling(config: GRPOConfig) -> None:
    """The in-process sampler: its cache and the sampling options."""
    if config.cache_implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={config.cache_implementation!r} is not supported by grpokit's "
            f"sampler; use None / 'dynamic' (its preallocated cache) or 'static' (fixed shapes, CUDA "
            f"graphs on a GPU)."
        )
    if config.cache_implementation == "static" and config.use_vllm:
        warnings.warn(
            "cache_implementation='static' has no effect with use_vllm=True: vLLM manages its own "
            "KV cache and CUDA graphs. Leave it unset.",
            UserWarning,
            stacklevel=5,
        )
    if config.temperature <= 0:
        raise ValueError(
            f"temperature={config.temperature} must be > 0 (use a small value such as 0.01 for near-greedy)."
        )
    if not 0 < config.top_p <= 1:
        raise ValueError(f"top_p={config.top_p} must be in (0, 1].")
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        raise ValueError(f"min_p={config.min_p} must be in [0, 1].")
    if config.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty={config.repetition_penalty} must be > 0 (1.0 disables it).")
    if config.sampling_mask_max_tokens < 1:
        raise ValueError(
            f"sampling_mask_max_tokens={config.sampling_mask_max_tokens} must be >= 1 (the largest kept set recorded "
            f"per token; 512 by default)."
        )


def _check_vllm(config: GRPOConfig) -> None:
    """vLLM generation and the correction of its sampling mismatch."""
    # The loss module imports torch, which `grpokit train --help` (reading the fields) must not.
    from .loss import SAMPLING_CORRECTION_MODES

    if config.vllm_mode not in ("colocate", "server"):
        raise ValueError(f"vllm_mode={config.vllm_mode!r} is not valid; use 'colocate' or 'server'.")
    if config.vllm_model_impl not in ("vllm", "transformers"):
        raise ValueError(f"vllm_model_impl={config.vllm_model_impl!r} is not valid; use 'vllm' or 'transformers'.")
    if config.vllm_importance_sampling_mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r} is not valid; use "
            f"one of {list(SAMPLING_CORRECTION_MODES)}."
        )
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"vllm_importance_sampling_clip_min={low} is above vllm_importance_sampling_clip_max={high}; "
            f"give clip_min <= clip_max (or None for no bound)."
        )
    tolerance = config.served_logprob_tolerance
    if tolerance is not None and not tolerance > 0:
        raise ValueError(
            f"served_logprob_tolerance={tolerance} must be > 0 (the mean log-prob gap, in nats, above which the run "
            f"stops), or None to only log the gap."
        )
    if (
        config.loss_type == "vespo"
        and config.use_vllm
        and config.vllm_importance_sampling_correction
        and not config.vllm_importance_sampling_mode.startswith("token")
    ):
        raise ValueError(
            f"loss_type='vespo' takes the vLLM correction per token: set vllm_importance_sampling_mode "
            f"to 'token_truncate' or 'token_mask' (got {config.vllm_importance_sampling_mode!r})."
        )


def _check_reference_model(config: GRPOConfig) -> None:
    """The reference policy: its dtype and its synchronisation with the policy."""
    if not 0 <= config.ref_model_mixup_alpha <= 1:
        raise ValueError(f"ref_model_mixup_alpha={config.ref_model_mixup_alpha} must be in [0, 1].")
    if config.ref_model_sync_steps < 1:
        raise ValueError(f"ref_model_sync_steps={config.ref_model_sync_steps} must be >= 1.")
    if config.ref_model_dtype not in (None, "bfloat16", "float16", "float32", "int8"):
        raise ValueError(
            f"ref_model_dtype={config.ref_model_dtype!r} is not valid; use 'bfloat16', 'float16', "
            f"'float32', 'int8' or None (the policy's dtype)."
        )
    if config.ref_model_dtype == "int8" and config.sync_ref_model:
        raise ValueError(
            "ref_model_dtype='int8' cannot be combined with sync_ref_model=True (the policy's weights "
            "cannot be mixed into int8 ones); use ref_model_dtype='bfloat16'."
        )


def _check_optimization(config: GRPOConfig) -> None:
    """The optimizer, the schedule, the precision and how long to train."""
    if config.learning_rate < 0 or not math.isfinite(config.learning_rate):
        raise ValueError(f"learning_rate={config.learning_rate} must be a finite number >= 0 (e.g. 1e-6).")
    if config.lr_scheduler_type not in LR_SCHEDULERS:
        raise ValueError(
            f"lr_scheduler_type={config.lr_scheduler_type!r} is not supported; use one of "
            f"{list(LR_SCHEDULERS)} (reduce_lr_on_plateau and greedy need an evaluation metric each "
            f"step, which GRPO has not)."
        )
    needed = LR_SCHEDULERS[config.lr_scheduler_type]
    if needed and not any(key in (config.lr_scheduler_kwargs or {}) for key in needed):
        raise ValueError(
            f"lr_scheduler_type={config.lr_scheduler_type!r} needs {' or '.join(needed)} in "
            f"lr_scheduler_kwargs, e.g. lr_scheduler_kwargs={{{needed[0]!r}: "
            f"{0.1 if 'rate' in needed[-1] else 100}}}."
        )
    if not 0 <= config.warmup_ratio <= 1:
        raise ValueError(f"warmup_ratio={config.warmup_ratio} must be in [0, 1].")
    if config.warmup_steps < 0 or (config.warmup_steps >= 1 and config.warmup_steps != int(config.warmup_steps)):
        raise ValueError(
            f"warmup_steps={config.warmup_steps} must be a whole number of steps, or a fraction in (0, 1) of all steps."
        )
    if config.optim != _default_of("optim"):
        # transformers' optimizer names; transformers imports torch, which `grpokit train --help` must not.
        from transformers.training_args import OptimizerNames

        from .optim import GRPOKIT_OPTIMIZERS

        if config.optim not in {name.value for name in OptimizerNames} | set(GRPOKIT_OPTIMIZERS):
            raise ValueError(
                f"optim={config.optim!r} is not an optimizer transformers knows; use e.g. "
                f"'adamw_torch', 'adamw_torch_fused', 'adafactor', 'sgd' or 'adamw_8bit' (or "
                f"grpokit's {', '.join(map(repr, GRPOKIT_OPTIMIZERS))})."
            )
    if config.bf16 and config.fp16:
        raise ValueError("bf16 and fp16 are both set; choose one.")
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        raise ValueError("Set max_steps > 0 or num_train_epochs > 0: otherwise there is nothing to train.")
    if config.max_nonfinite_steps < 1:
        raise ValueError(f"max_nonfinite_steps={config.max_nonfinite_steps} must be >= 1.")
    if config.torch_empty_cache_steps is not None and config.torch_empty_cache_steps <= 0:
        raise ValueError(
            f"torch_empty_cache_steps={config.torch_empty_cache_steps} must be a positive number of steps, or None."
        )


def _check_logging_and_evaluation(config: GRPOConfig) -> None:
    """Trackers, log levels, the evaluation schedule and the guard."""
    unknown = [name for name in config.report_to if name not in TRACKERS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*TRACKERS, "all", "none"], n=1, cutoff=0.6)
        raise ValueError(
            f"report_to={unknown} is not supported by grpokit;{f' did you mean {close[0]!r}?' if close else ''} use "
            f"one or more of {list(TRACKERS)}, 'all' (those installed) or 'none'. metrics.jsonl in output_dir is "
            f"written in every case."
        )
    if config.logging_strategy not in ("steps", "epoch", "no"):
        raise ValueError(f"logging_strategy={config.logging_strategy!r} is not valid; use 'steps', 'epoch' or 'no'.")
    for name in ("log_level", "log_level_replica"):
        if getattr(config, name) not in LOG_LEVELS:
            raise ValueError(f"{name}={getattr(config, name)!r} is not valid; use one of {sorted(LOG_LEVELS)}.")
    if config.eval_strategy not in ("no", "steps"):
        raise ValueError(f"eval_strategy={config.eval_strategy!r} is not valid; use 'steps' (with eval_steps) or 'no'.")
    if config.eval_delay < 0:
        raise ValueError(f"eval_delay={config.eval_delay} must be >= 0 (optimizer steps before the first evaluation).")
    if config.eval_steps is not None and config.eval_steps <= 0:
        raise ValueError(f"eval_steps={config.eval_steps} must be > 0, or None to evaluate every logging_steps.")
    if config.num_generations_eval is not None and config.num_generations_eval < 1:
        raise ValueError(
            f"num_generations_eval={config.num_generations_eval} must be >= 1, or None for num_generations."
        )
    if config.per_device_eval_batch_size < 1:
        raise ValueError(f"per_device_eval_batch_size={config.per_device_eval_batch_size} must be >= 1.")
    if config.guard_window < 2:
        raise ValueError(f"guard_window={config.guard_window} must be >= 2: a trend needs at least two logging steps.")
    for option in config.debug:
        if option != "underflow_overflow":
            raise ValueError(
                f"debug={config.debug!r}: {option!r} is not supported; grpokit has "
                f"'underflow_overflow' (TPUs, which 'tpu_metrics_debug' is for, are not "
                f"supported)."
            )


def _check_checkpoints(config: GRPOConfig) -> None:
    """When checkpoints are written and kept, and the best one reloaded."""
    if config.save_strategy not in ("steps", "epoch", "no"):
        raise ValueError(f"save_strategy={config.save_strategy!r} is not valid; use 'steps', 'epoch' or 'no'.")
    if config.save_total_limit is not None and config.save_total_limit < 1:
        raise ValueError(f"save_total_limit={config.save_total_limit} must be >= 1, or None to keep every checkpoint.")
    if config.load_best_model_at_end:
        if config.save_strategy != "steps" or config.eval_strategy != "steps":
            raise ValueError(
                f"load_best_model_at_end=True needs a checkpoint where there is an evaluation: set "
                f"save_strategy='steps' and eval_strategy='steps' (now {config.save_strategy!r} and "
                f"{config.eval_strategy!r})."
            )
        eval_steps = config.eval_steps or config.logging_steps
        if config.save_steps >= 1 and eval_steps >= 1 and config.save_steps % eval_steps:
            raise ValueError(
                f"load_best_model_at_end=True needs save_steps ({config.save_steps}) to be a multiple "
                f"of eval_steps ({eval_steps}), so that every checkpoint has an evaluation."
            )


def _check_distributed(config: GRPOConfig) -> None:
    """The launch across processes: the backend, and one way to shard the model (FSDP or DeepSpeed)."""
    if config.ddp_backend not in (None, "nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl"):
        raise ValueError(
            f"ddp_backend={config.ddp_backend!r} is not a torch.distributed backend; use 'nccl', "
            f"'gloo', 'mpi', 'xccl', 'hccl', 'cncl', 'mccl' or None."
        )
    if config.ddp_timeout <= 0:
        raise ValueError(f"ddp_timeout={config.ddp_timeout} must be a positive number of seconds.")
    config.accelerator_options()  # refuses what grpokit would not run
    fsdp = config.fsdp_plugin_kwargs()  # refuses what grpokit would not run
    if fsdp is not None and config.deepspeed is not None:
        raise ValueError("fsdp and deepspeed are both set; choose one way to shard the model.")
    if fsdp is None and config.fsdp_config is not None:
        warnings.warn(
            "GRPOConfig.fsdp_config is set but fsdp is not: FSDP stays off (set fsdp=True to use it, as in TRL).",
            UserWarning,
            stacklevel=5,
        )
    deepspeed = config.deepspeed_config()
    if deepspeed is not None:
        sections = [name for name in ("optimizer", "scheduler") if name in deepspeed]
        if sections:
            raise ValueError(
                f"deepspeed: the config's {' and '.join(repr(s) for s in sections)} section(s) would "
                f"replace the optimizer / scheduler grpokit builds from optim, learning_rate, adam_*, "
                f"weight_decay and lr_scheduler_type; remove them from the DeepSpeed config and set "
                f"those fields instead."
            )
        if not isinstance(deepspeed.get("zero_optimization"), dict):
            raise ValueError(
                "deepspeed: the config has no 'zero_optimization' section; add one, e.g. "
                "{'zero_optimization': {'stage': 2}}."
            )


_CHECKS = (
    _check_batch_shape,
    _check_objective,
    _check_rewards,
    _check_tools,
    _check_async,
    _check_sampling,
    _check_vllm,
    _check_reference_model,
    _check_optimization,
    _check_logging_and_evaluation,
    _check_checkpoints,
    _check_distributed,
)


def _same(value, neutral) -> bool:
    """A generation option equal to its neutral value (1 and 1.0 alike, never True for 1)."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return isinstance(value, (int, float)) and value == neutral


def _default_of(name: str, config_class: type | None = None):
    """The field's default on `config_class` (GRPOConfig's by default; a subclass may change it)."""
    spec = (config_class or GRPOConfig).__dataclass_fields__[name]
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def _is_empty(value) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)


def annotation_of(name: str) -> str:
    """A field's annotation as written (`dict | str | None`). transformers' HfArgumentParser replaces the fields'
    `type` with resolved, narrowed types (a `dict | str | None` becomes `str`), so `type` cannot be trusted."""
    return GRPOConfig.__annotations__[name]


def _is_default(value, default) -> bool:
    """Equal to the default, or empty where the default is empty too (transformers' older fsdp='', debug=[])."""
    return value == default or (_is_empty(value) and _is_empty(default))


def _fields_of_kind(kind: str) -> dict[str, str]:
    return {
        spec.name: spec.metadata["message"]
        for spec in dataclasses.fields(GRPOConfig)
        if spec.metadata.get("kind") == kind
    }


# TRL 1.16 fields whose grpokit default is deliberately not TRL's: name -> why (docs/guides/from-trl.md lists them;
# `scripts/trl_fields.py --check` fails on any other default that differs from grpokit/trl_fields.json).
TRL_DEFAULT_DIFFERENCES: dict[str, str] = {
    "bf16": "False: the default run is exact on any device (under bf16 autocast the incremental decode and the "
    "training forward round differently); set bf16=True on GPUs, as TRL's None resolves it.",
    "gradient_checkpointing": "False: with it on transformers turns the KV cache off, which grpokit's shared-prompt "
    "training forward needs; turn it on with padding_free=True for models that do not fit.",
    "disable_dropout": "True: the policy that samples is the policy that is trained.",
    "optim": "adamw_torch: every pinned number was taken with it (the fused kernel rounds differently); set "
    "adamw_torch_fused for TRL's.",
    "logging_first_step": "True: the first step's metrics show at once.",
    "vllm_group_port": "None: server mode pushes the weights over HTTP; set TRL's 51216 to broadcast them through "
    "a process group.",
}

# name -> what TRL does with it and what to use in grpokit instead (warned when set to anything but the default)
NOT_IMPLEMENTED: dict[str, str] = _fields_of_kind(NOT_IMPLEMENTED_KIND)
# name -> why nothing needs doing (accepted silently)
NO_EFFECT: dict[str, str] = _fields_of_kind(NO_EFFECT_KIND)
# name -> what replaces it (warned with a FutureWarning when set; still takes effect)
DEPRECATED: dict[str, str] = _fields_of_kind(DEPRECATED_KIND)
IMPLEMENTED: tuple[str, ...] = tuple(
    spec.name for spec in dataclasses.fields(GRPOConfig) if "kind" not in spec.metadata
)
# TRL's renamed fields: [{"config", "old", "new", "trl" (the release that renamed it), "source"}], the one table of
# them (`_apply_renames`); docs/guides/from-trl.md lists them.
TRL_RENAMES: list[dict[str, str]] = json.loads(files("grpokit").joinpath("trl_renames.json").read_text())["renames"]
# Each field's metadata keeps only its "help" from here on: transformers' HfArgumentParser (TRL's TrlParser) hands a
# field's metadata to argparse's add_argument, which refuses any other key. The kinds are in the tables above.
for _spec in dataclasses.fields(GRPOConfig):
    _spec.metadata = types.MappingProxyType({"help": _spec.metadata["help"]})
del _spec
