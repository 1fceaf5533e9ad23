"""The run's checks, in one place: what `GRPOConfig.validate` cannot know until the trainer is built (the data, the
launch, the rollout engine, the checkpoint format), each refused early with a message that says how to fix it."""

from __future__ import annotations

import logging
import os
import warnings

from .agents import check_agents
from .config import GRPOConfig
from .data import check_dataset, dataset_columns, is_iterable_dataset, named_eval_datasets, unreadable_share
from .distributed import deepspeed_stage
from .rewards.base import check_required_columns
from .rollout import HFEngine, RolloutEngine, RolloutRunner

logger = logging.getLogger(__name__)


def check_async(
    args: GRPOConfig,
    num_processes: int,
    deepspeed: int | None = None,
    sharded: bool = False,
    shared_engine: bool = False,
    lora: bool = False,
) -> None:
    """What asynchronous generation supports today, refused by name otherwise. `deepspeed`: the ZeRO stage (None:
    no DeepSpeed); `shared_engine`: the producer
    samples with the trainer's own engine (vLLM, a rollout_engine), not one of its own; `lora`: a peft_config (the
    reference is the policy with its adapter off)."""
    if args.max_staleness is None:
        return
    if sharded or deepspeed == 3:
        # FSDP2 / ZeRO-3: the producers' copies are whole models, given the gathered weights of each version
        if args.async_schedule == "latest":
            raise NotImplementedError(
                "async_schedule='latest' with a sharded model (FSDP2 or ZeRO-3): the trainer gathers "
                "the weights each batch is sampled by, at a step every process knows in advance, "
                "which only the exact schedule gives. Leave async_schedule unset."
            )
        if args.beta > 0 and not lora:
            raise NotImplementedError(
                "max_staleness with a sharded model (FSDP2 or ZeRO-3) and beta > 0: the reference "
                "model is sharded too, and its forwards (π_ref, in the producer) would be collectives "
                "interleaving with the training's. Use beta=0 (TRL's default), LoRA (the "
                "reference is the producer's copy with the adapter off), or DDP / ZeRO-2."
            )
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        raise NotImplementedError(
            f"max_staleness (asynchronous generation) needs one optimizer step per generation batch: "
            f"num_iterations=1 and steps_per_generation == gradient_accumulation_steps (got num_iterations="
            f"{args.num_iterations}, steps_per_generation={args.steps_per_generation}, gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}), as in TRL's AsyncGRPOTrainer. Reuse of samples (μ > 1) is "
            f"off-policy by itself; set max_staleness=None for it."
        )
    if num_processes > 1:
        # One producer per process, over its share of each generation batch, as the synchronous loop splits it; the
        # producers gather on a process group of their own (distributed.ProducerCollectives). Their batches must be
        # the same ones on every process, sampled by the same weights: the exact schedule, whole batches.
        if args.async_schedule == "latest":
            raise NotImplementedError(
                "async_schedule='latest' with several training processes: each process's "
                "producer would sample its share of a batch with whichever weights it has "
                "when it starts, and drop stale batches on its own, so the processes would "
                "train slices of different batches. Leave async_schedule unset (the exact "
                "schedule) under DDP."
            )
        if args.use_vllm and args.vllm_mode == "colocate":
            raise NotImplementedError(
                "max_staleness with vllm_mode='colocate' and several training processes: the "
                "colocated engines share the training processes' torch.distributed world, so "
                "the producers' engine calls would interleave with the training collectives. "
                "Use vllm_mode='server' (the producers send their requests to it), or "
                "max_staleness=None."
            )
        if shared_engine and args.eval_strategy != "no":
            raise NotImplementedError(
                "Evaluation during training with max_staleness, several training processes "
                "and an engine the producer shares with the trainer (vLLM, a rollout_engine): "
                "each process's evaluation waits for its producer's batch in progress, whose "
                "gathers wait for the other processes' producers, which may be waiting for "
                "their own evaluation: the run could hang. Set eval_strategy='no' and evaluate "
                "the checkpoints afterwards (grpokit eval), or use the built-in engine (each "
                "producer has its own)."
            )
    if args.sync_ref_model and args.max_staleness > 0:
        raise NotImplementedError(
            "max_staleness > 0 with sync_ref_model: the producer's reference forwards would run "
            "while the trainer mixes the policy into the reference. Set one of them off."
        )


def streams_groups(args: GRPOConfig, runner: RolloutRunner, num_processes: int) -> bool:
    """Whether the producer streams groups one by one (multi-turn rollouts whose driver runs several at once, in one
    process) rather than whole generation batches. Several processes take whole batches: streamed, each process's
    batches would be made of whichever of its groups finish first."""
    return bool(args.max_staleness) and getattr(runner.driver, "concurrent_rollouts", False) and num_processes == 1


def check_streaming(args: GRPOConfig, runner: RolloutRunner, num_processes: int) -> None:
    """What groups streamed one by one cannot do, refused by name when the trainer is built."""
    if not streams_groups(args, runner, num_processes):
        return
    if args.async_schedule == "exact":
        raise NotImplementedError(
            "async_schedule='exact' cannot hold for multi-turn rollouts streamed group by group: "
            "which groups share an engine call (one seed) and which weights sample a group's "
            "later turns depend on timing. Leave async_schedule unset (or 'latest') for "
            "them."
        )
    if args.dynamic_sampling:
        raise NotImplementedError(
            "dynamic_sampling with multi-turn rollouts streamed group by group (max_staleness): "
            "groups are scored when a batch is assembled, not as they finish, so a group "
            "without reward spread cannot be replaced by the next one to finish. Set "
            "dynamic_sampling=False, or max_staleness=None (or 0) for these rollouts."
        )


def check_run(
    args: GRPOConfig, train_dataset, eval_dataset, rollout_engine, tools, rollout_func, environment_factory
) -> None:
    """The run-time checks (what GRPOConfig.validate cannot know: the data, the launch, the arguments)."""
    check_agents(tools, rollout_func, environment_factory, rollout_engine)
    environments = environment_factory is not None  # reset() may supply every prompt (TRL: prompt optional)
    check_dataset(train_dataset, prompt_optional=environments)
    for name, dataset in named_eval_datasets(eval_dataset).items():
        check_dataset(dataset, "eval_dataset" if name is None else f"eval_dataset[{name!r}]", environments)
    configure_iterable_datasets(args, train_dataset, eval_dataset)  # TRL's order: dispatch_batches first
    if is_iterable_dataset(train_dataset) and args.max_steps <= 0:
        raise ValueError(
            "train_dataset is an IterableDataset (no len()): set max_steps > 0 to say how long to "
            "train, as with transformers' Trainer."
        )
    if eval_dataset is None and args.eval_strategy != "no":
        raise ValueError(
            f"eval_strategy={args.eval_strategy!r} needs an eval_dataset: pass "
            f"GRPOTrainer(eval_dataset=...), or set eval_strategy='no'."
        )
    if eval_dataset is None and args.eval_on_start:
        raise ValueError(
            "eval_on_start=True needs an eval_dataset: pass GRPOTrainer(eval_dataset=...), or set eval_on_start=False."
        )
    if args.dynamic_sampling and (args.generation_batch_per_process % args.num_generations):
        raise ValueError(
            "dynamic_sampling keeps or drops whole groups: make the per-process generation batch a "
            "multiple of num_generations."
        )
    if args.dynamic_sampling and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise NotImplementedError(
            "dynamic_sampling runs in one process only for now: processes would draw "
            "different numbers of prompt batches and fall out of step."
        )
    if rollout_engine is not None and not isinstance(rollout_engine, RolloutEngine):
        raise TypeError(
            f"rollout_engine={rollout_engine!r} is not a RolloutEngine: it needs generate(prompts, "
            f"params, seed) -> Rollout and sync_weights(model) (see grpokit.rollout.engine)."
        )


def configure_iterable_datasets(args: GRPOConfig, train_dataset, eval_dataset) -> None:
    """TRL's settings for streams (grpo_trainer.py, trl#3213): accelerate's `dispatch_batches=False` when the train
    or an eval set is iterable (True is refused), and `dataloader_num_workers=0` for an iterable train set (workers
    would shard the stream and split the num_generations groups; map-style sets keep theirs). grpokit reads prompts
    in the main process either way; the fields are set so that the run's config says what TRL's would."""
    iterable_eval = any(is_iterable_dataset(d) for d in named_eval_datasets(eval_dataset).values())
    if is_iterable_dataset(train_dataset) or iterable_eval:
        options = args.accelerator_options()
        if options.get("dispatch_batches"):
            raise ValueError(
                "Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                "`accelerator_config`. Please set it to `False` (each process reads its own share of the "
                "stream)."
            )
        args.accelerator_config.dispatch_batches = False
    if is_iterable_dataset(train_dataset) and args.dataloader_num_workers != 0:
        logger.warning(
            f"Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding "
            f"the provided value ({args.dataloader_num_workers})."
        )
        args.dataloader_num_workers = 0


def check_reward_columns(functions, datasets, agents: bool) -> None:
    """Each dataset of `datasets` (train, eval: one or named sets) has the columns the functions need (an agent's
    rows also carry `turn_ends`)."""
    train_dataset, eval_dataset = datasets
    for dataset in (train_dataset, *named_eval_datasets(eval_dataset).values()):
        check_required_columns(functions, dataset_columns(dataset) + (["turn_ends"] if agents else []))


def check_checkpoint_format(args: GRPOConfig, checkpoint_format: str, sharded: bool) -> None:
    """The checkpoint options that the run's checkpoint format (plain, FSDP2 sharded, DeepSpeed) cannot honour."""
    if args.save_on_each_node and (sharded or checkpoint_format != "plain"):
        raise NotImplementedError(
            "save_on_each_node=True is supported with whole weights in every process "
            "(DDP, or one process per node): under FSDP2 and DeepSpeed every process writes "
            "its part of a checkpoint into one directory, so put output_dir on storage all "
            "nodes share and leave save_on_each_node False."
        )
    if args.load_best_model_at_end and checkpoint_format != "plain":
        raise ValueError(
            f"load_best_model_at_end=True loads plain checkpoints only; this run writes "
            f"{checkpoint_format} ones (FSDP2 SHARDED_STATE_DICT / DeepSpeed). Set it False "
            f"and load trainer.state.best_model_checkpoint (metric_for_best_model tracks it) "
            f"yourself, or use FULL_STATE_DICT checkpoints."
        )


def check_launch(args: GRPOConfig, accelerator, rollout_engine, peft_config) -> bool:
    """What the launch accelerate made (processes, FSDP2, DeepSpeed) cannot run, refused by name: asynchronous
    generation's limits (`check_async`). Returns whether FSDP2 or DeepSpeed will wrap the policy (asynchronous
    generation's copy of it is then taken before they do)."""
    sharded = bool(args.fsdp) or accelerator.distributed_type.value == "FSDP"
    zero_stage = deepspeed_stage(accelerator)
    check_async(
        args,
        accelerator.num_processes,
        deepspeed=zero_stage,
        sharded=sharded,
        shared_engine=args.use_vllm or rollout_engine is not None,
        lora=peft_config is not None,
    )
    check_producer_engine(args, rollout_engine)
    return sharded or zero_stage is not None


def check_producer_engine(args: GRPOConfig, rollout_engine) -> None:
    """Under max_staleness the producer samples with an HFEngine of its own over a copy of the policy
    (`producer.producer_engine`): a subclass of HFEngine passed as rollout_engine would be replaced, its overrides
    unused, so it is refused."""
    if args.max_staleness is None or not isinstance(rollout_engine, HFEngine) or type(rollout_engine) is HFEngine:
        return
    raise ValueError(
        f"rollout_engine is {type(rollout_engine).__name__}, a subclass of HFEngine: with max_staleness the "
        f"producer samples with an HFEngine of its own over a copy of the policy, so your subclass's overrides "
        f"would not run. Set max_staleness=None, or write the engine as a class that holds an HFEngine instead of "
        f"subclassing it (a RolloutEngine: generate and sync_weights), which the producer drives and gives every "
        f"new copy of the weights."
    )


def warn_unreadable_prompts(train_dataset, tokenizer) -> None:
    """Prompts the tokenizer cannot read (most of their characters out of its vocabulary) are said before
    training."""
    share, chars = unreadable_share(train_dataset, tokenizer) if tokenizer is not None else (0.0, 0)
    if share > 0.5:
        warnings.warn(
            f"{share:.0%} of the prompts' characters (of {chars} in the first prompts) are not in the "
            f"tokenizer's vocabulary: they become its unknown token or vanish, so the model cannot read these "
            f"prompts. Use the model's own tokenizer, or a model whose vocabulary covers the prompts' characters "
            f"(their language, their encoding).",
            RuntimeWarning,
            stacklevel=3,
        )
