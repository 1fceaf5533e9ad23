"""AsyncGRPOConfig and AsyncGRPOTrainer: TRL 1.16's `trl.experimental.async_grpo` on grpokit's GRPOTrainer.

TRL's AsyncGRPOTrainer samples with a vLLM server in a child process while the trainer trains, drops samples more
than `max_staleness` weight versions old, and packs what it trains on by a token budget. grpokit's GRPOTrainer has
asynchronous generation of its own (`GRPOConfig.max_staleness`, `grpokit.producer`, docs/guides/async.md), so the
drop-in is a config and a thin trainer over it, not a second loop:

- `AsyncGRPOConfig` is a GRPOConfig (every grpokit option applies) whose fields include every field of TRL's
  AsyncGRPOConfig (`grpokit/trl_async_grpo_fields.json`, written by `scripts/trl_fields.py`) with TRL's default:
  max_staleness 4 (asynchronous by default), logging_steps 1, a constant learning rate, max_completion_length 2048,
  vllm_server_base_url "http://localhost:8000", ... The fields TRL's has and GRPOConfig lacks are declared here
  (`ASYNC_FIELDS`), each implemented, stored for the producer, or refused by name at a value grpokit cannot honour.
- Generation: TRL's only backend, a vLLM server at `vllm_server_base_url` (`use_vllm=True, vllm_mode="server"` are
  this config's defaults; the server is `grpokit vllm-serve`, not `vllm serve`), or grpokit's in-process engine
  with `use_vllm=False` (a laptop, a test), or any `rollout_engine=`.
- The objective is GRPOConfig's defaults, which are TRL's async loss: the clipped token ratio to the behaviour
  policy, no KL term (beta 0), tokens summed over the batch's token count (loss_type "dapo"; TRL divides each
  micro-batch by its own token count, the same update with its default gradient_accumulation_steps=1).
  Advantages are the group z-score with the Bessel-corrected std + 1e-4 (TRL's GRPOTrainer's); TRL's async worker
  uses the population std + 1e-8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import GRPOConfig, _field
from .models import default_output_dir
from .trainer import GRPOTrainer

DTYPES = ("auto", "bfloat16", "float16", "float32")


def _grpo_field(name: str, default):
    """A GRPOConfig field with TRL AsyncGRPOConfig's default: its help and kind stay GRPOConfig's (one meaning)."""
    spec = GRPOConfig.__dataclass_fields__[name]
    return _field(default, spec.metadata["help"], {k: v for k, v in spec.metadata.items() if k != "help"})


# The fields of TRL's AsyncGRPOConfig that grpokit's GRPOConfig has not: name -> help.
ASYNC_FIELDS = {
    "dtype": "The dtype the model is loaded in when `model` is a path or Hub id: 'auto', 'bfloat16', 'float16' or "
    "'float32' (TRL's default: the trainer's precision decides the training-inference mismatch). A 'dtype' "
    "in model_init_kwargs wins. A model passed as an object must already be in it ('auto': any).",
    "fork_threshold_tokens": "TRL re-tokenizes a multi-turn conversation every turn and forks a new training row "
    "when the re-tokenized prompt drifts by more than this many trained tokens. Accepted, "
    "no effect: grpokit's multi-turn runner keeps every turn's sampled token ids and never "
    "re-tokenizes, so there is no drift to decide on and every trained token keeps its "
    "signal.",
    "request_timeout": "Server mode: seconds one sampling request to the vLLM server may take in all, its retries "
    "included (vllm_server_timeout bounds only the wait for the server to come up).",
    "weight_sync_timeout": "Server mode: seconds one weight push to the vLLM server may take in all; a push that "
    "does not complete in time raises instead of hanging the run.",
    "token_budget": "TRL's token-budgeted micro-batching: at most this many tokens per rank's row, a dynamic number "
    "of samples per micro-batch; TRL's default, None, budgets by the vLLM server's max_model_len, and with its "
    "default gradient_accumulation_steps=1 each optimizer step then trains on as many samples as the budget holds. "
    "grpokit's optimizer step trains on a generation batch, per_device_train_batch_size completions per micro-batch "
    "(TRL's token_budget <= 0): None and values <= 0 are accepted and mean that. A positive budget is refused "
    "(grpokit's steps are whole generation batches, not budget-filled micro-batches): bound memory with "
    "per_device_train_batch_size, and drop padding with padding_free=True.",
}


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """TRL 1.16's `AsyncGRPOConfig` fields and defaults on grpokit's GRPOConfig (see the module docstring)."""

    # After a keyword that is not a field, most likely a TRL 1.17-1.19 name (TRL v1.18.0's release notes: renamed
    # fields, one timeout instead of three; they do not name the new fields, so grpokit cannot take them).
    unknown_field_hint = (
        "grpokit takes the names of TRL 1.16's AsyncGRPOConfig and GRPOConfig. TRL 1.18 renamed AsyncGRPOConfig "
        "fields and merged its three timeouts into one: write TRL 1.16's names, e.g. vllm_server_timeout (the vLLM "
        "server coming up), request_timeout (one sampling request) and weight_sync_timeout (one weight push) "
        "(docs/guides/from-trl.md#trl-versions)."
    )

    # ---- GRPOConfig's fields with TRL AsyncGRPOConfig's defaults
    logging_steps: float = _grpo_field("logging_steps", 1)
    logging_first_step: bool = _grpo_field("logging_first_step", False)
    lr_scheduler_type: str = _grpo_field("lr_scheduler_type", "constant")
    optim: str = _grpo_field("optim", "adamw_torch_fused")
    bf16: bool | None = _grpo_field("bf16", None)
    gradient_checkpointing: bool = _grpo_field("gradient_checkpointing", True)
    ignore_data_skip: bool = _grpo_field("ignore_data_skip", True)
    remove_unused_columns: bool | None = _grpo_field("remove_unused_columns", True)
    max_completion_length: int | None = _grpo_field("max_completion_length", 2048)
    vllm_server_base_url: str | None = _grpo_field("vllm_server_base_url", "http://localhost:8000")
    max_staleness: int | None = _grpo_field("max_staleness", 4)
    # TRL's only generation backend (not fields of TRL's config): use_vllm=False samples in this process instead.
    use_vllm: bool = _grpo_field("use_vllm", True)
    vllm_mode: str = _grpo_field("vllm_mode", "server")

    # ---- TRL AsyncGRPOConfig's fields that GRPOConfig has not
    dtype: str = _field("float32", ASYNC_FIELDS["dtype"], {})
    fork_threshold_tokens: int = _field(1024, ASYNC_FIELDS["fork_threshold_tokens"], {})
    request_timeout: int = _field(600, ASYNC_FIELDS["request_timeout"], {})
    weight_sync_timeout: int = _field(1800, ASYNC_FIELDS["weight_sync_timeout"], {})
    token_budget: int | None = _field(None, ASYNC_FIELDS["token_budget"], {})

    def validate(self) -> None:
        """GRPOConfig's checks, and those of the fields above."""
        super().validate()
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {list(DTYPES)}.")
        if not (self.request_timeout > 0 and self.weight_sync_timeout > 0):
            raise ValueError(
                f"request_timeout={self.request_timeout} and weight_sync_timeout="
                f"{self.weight_sync_timeout} must be positive numbers of seconds."
            )
        if self.token_budget is not None and self.token_budget > 0:
            raise NotImplementedError(
                f"token_budget={self.token_budget}: grpokit micro-batches by count (per_device_train_batch_size "
                f"completions), not by a token budget. Leave token_budget unset (or <= 0, TRL's count-based "
                f"packing); bound a micro-batch's memory with per_device_train_batch_size and drop padding with "
                f"padding_free=True."
            )


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's `trl.experimental.async_grpo.AsyncGRPOTrainer`: its arguments, in its order; `args` an
    AsyncGRPOConfig (default: TRL's defaults, in "<model name>-AsyncGRPO"). It is grpokit's GRPOTrainer with the
    config's `max_staleness`: keyword options of GRPOTrainer (`eval_dataset`, `rollout_engine`, ...) pass through.

    `rollout_worker` and `weight_transfer` (TRL's plug-ins for its child-process worker and NCCL weight transfer) are
    refused: a custom generation backend is a `rollout_engine=` (grpokit.rollout.RolloutEngine), whose
    `sync_weights(model)` is its weight transfer."""

    # TRL's flag for transformers' Trainer; grpokit's loss does its own accumulation scaling, as TRL's does.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        **grpokit_options,
    ):
        if args is None:
            args = AsyncGRPOConfig(output_dir=default_output_dir(model, "AsyncGRPO"))
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(
                f"AsyncGRPOTrainer takes an AsyncGRPOConfig (from grpokit import AsyncGRPOConfig), got "
                f"{type(args).__name__}; for a GRPOConfig use GRPOTrainer (its max_staleness makes "
                f"it asynchronous)."
            )
        for option, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise NotImplementedError(
                    f"AsyncGRPOTrainer({option}=...) plugs into TRL's child-process rollout worker, which grpokit "
                    f"does not have. Pass rollout_engine=<a grpokit.rollout.RolloutEngine> instead: its "
                    f"generate(prompts, params, seed) samples and its sync_weights(model) takes the new weights."
                )
        if isinstance(model, str):  # as TRL: the config's dtype unless model_init_kwargs names one
            args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        else:
            check_model_dtype(model, args.dtype)
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
            **grpokit_options,
        )
        if args.max_inflight_tasks < 0:  # TRL's auto value: what the trainer can take before it is stale
            completions_per_step = (
                args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
            )
            args.max_inflight_tasks = max(args.max_staleness or 0, 1) * completions_per_step

    # TRL's AsyncGRPOTrainer attributes
    epsilon_low = property(lambda self: self.args.epsilon)
    epsilon_high = property(
        lambda self: self.args.epsilon if self.args.epsilon_high is None else self.args.epsilon_high
    )
    temperature = property(lambda self: self.args.temperature)
    aux_loss_enabled = property(lambda self: self.router_aux_loss_coef != 0.0)

    @property
    def model_version(self) -> int:
        """The policy version staleness is measured in: optimizer steps taken. (TRL counts weight syncs; the same
        with its default weight_sync_steps=1.)"""
        return self.state.global_step

    # TRL's attributes of its child-process worker and NCCL transfer: refused by name (AttributeError, so that
    # getattr(trainer, name, None) still works).
    rollout_worker = property(lambda self: _refuse_attribute("rollout_worker"))
    rollout_queue = property(lambda self: _refuse_attribute("rollout_queue"))
    weight_transfer = property(lambda self: _refuse_attribute("weight_transfer"))
    vllm_client = property(lambda self: _refuse_attribute("vllm_client"))


def _refuse_attribute(name: str):
    raise AttributeError(
        f"AsyncGRPOTrainer.{name} is TRL's child-process rollout worker / vLLM transport, which "
        f"grpokit does not have: generation runs in grpokit's producer (trainer.producer while "
        f"training) over trainer.engine (a grpokit.rollout.RolloutEngine; the vLLM server client "
        f"in server mode)."
    )


def check_model_dtype(model: torch.nn.Module, dtype: str) -> None:
    """A model passed as an object is not loaded, so `dtype` cannot apply: it must already be in it."""
    if dtype == "auto":
        return
    found = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if found and found != {getattr(torch, dtype)}:
        raise ValueError(
            f"dtype={dtype!r} applies when the model is loaded from a path; this model's weights are "
            f"{sorted(str(d).removeprefix('torch.') for d in found)}. Cast it (model.to(torch.{dtype})), "
            f"pass its path, or set dtype='auto'."
        )
