"""The run's checks, in one place: what `GRPOConfig.validate` cannot know until the trainer is built (the data, the
launch, the rollout engine, the checkpoint format), each refused early with a message that says how to fix it."""

from __future__ import annotations

from .config import GRPOConfig
from .rollout import RolloutRunner


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
