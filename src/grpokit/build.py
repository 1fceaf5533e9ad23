"""The trainer's set-up, outside the loop: the run's inputs (checked by `grpokit.checks`) and multi-turn driver,
TRL's advisory warnings, the process's seed, the models (policy, reference) and their preparation by accelerate, the
parts the loop drives (rollout runner, reward scorer, optimizer stepper, checkpointer, prompt sampler, teacher,
entropy controller, state), and the small parts built from the config (the schedule, the reward weights, the MoE
auxiliary loss coefficient, activation offloading)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .agents import EnvironmentPool, build_agents, check_chat_template, placeholder_dataset
from .checkpoint import Checkpointer
from .checkpoint.model_files import ModelWriter
from .checks import check_checkpoint_format, check_launch, check_reward_columns, check_run, check_streaming
from .config import LOG_LEVELS, GRPOConfig
from .cpu_matmul import float32_matmuls
from .cpu_memory import keep_large_allocations_mapped
from .data import (
    PromptSampler,
    StreamSampler,
    dataset_columns,
    is_iterable_dataset,
    named_eval_datasets,
    prompts_per_epoch,
)
from .distributed import (
    all_processes_done,
    build_accelerator,
    check_backend,
    configure_deepspeed,
    deepspeed_stage,
    is_sharded,
    place_before_reference_copy,
    prepare_reference,
    unwrap_model,
)
from .experience import Evaluator, ExperienceMaker
from .integrations import adapt_environment, environment_inputs
from .loss import AdaptiveEntropyController
from .models import (
    build_policy,
    build_reference,
    compile_blocks,
    enable_gradient_checkpointing,
    full_precision,
    prompt_length_limit,
    whole_copy,
)
from .multimodal import check_images_supported, tokenizer_of
from .offload import ActivationOffload
from .onednn_linear import onednn_linears, takes_onednn_linears
from .optim import build_optimizer
from .rewards import build_reward_functions
from .rewards.model import RewardModel
from .rewards.scorer import RewardScorer
from .rollout import HFEngine, PromptCodec, RolloutEngine, RolloutRunner, eos_token_ids
from .rollout.hf_generate import TransformersGenerateEngine
from .rollout.process_engine import start_engine_server
from .rollout.vllm import VLLMEngine
from .rollout.vllm_client import VLLMServers
from .state import TrainerState
from .stepping import OptimizerStepper
from .teacher import load_teacher

# Advisory warnings go through the logger, as TRL's do (`logging.get_logger(__name__)`): log handlers, caplog and
# log_level see them. Deprecations stay FutureWarnings and GRPOConfig's own warnings stay Python warnings, as in TRL.
logger = logging.getLogger(__name__)


def moe_shape(config) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts config, whatever the family calls them; None if not MoE."""
    experts = next(
        (
            getattr(config, n)
            for n in ("num_experts", "num_local_experts", "n_routed_experts")
            if getattr(config, n, None)
        ),
        None,
    )
    top_k = next(
        (getattr(config, n) for n in ("num_experts_per_tok", "experts_per_token") if getattr(config, n, None)), None
    )
    return (experts, top_k) if experts and top_k else None


def router_aux_loss_coef(args: GRPOConfig, model) -> float:
    """TRL's rule: router_aux_loss_coef, or (None) the MoE model config's own (Qwen3-MoE: 0.001); 0 turns it off."""
    config = getattr(model, "config", None)
    is_moe = moe_shape(config) is not None
    if args.router_aux_loss_coef is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if is_moe else 0.0
    if args.router_aux_loss_coef and not is_moe:
        raise ValueError(
            f"router_aux_loss_coef={args.router_aux_loss_coef} needs a mixture-of-experts model (its "
            f"config has num_experts and num_experts_per_tok); this model has none. "
            f"Set it to None."
        )
    return float(args.router_aux_loss_coef)


def reward_weights(args: GRPOConfig, count: int, environment_rewards: int = 0) -> torch.Tensor:
    """One weight per reward function; the environments' get_reward functions (last) weigh 1, as in TRL."""
    count -= environment_rewards
    weights = args.reward_weights or [1.0] * count
    if len(weights) != count:
        raise ValueError(
            f"reward_weights has {len(weights)} entries for {count} reward functions; give one weight per function."
        )
    return torch.tensor(list(weights) + [1.0] * environment_rewards, dtype=torch.float32)


def total_steps(args: GRPOConfig, train_dataset, num_processes: int) -> int:
    """max_steps, or the optimizer steps that num_train_epochs passes over the prompts take."""
    if args.max_steps > 0:
        return args.max_steps
    prompts_per_generation = args.generation_batch_size // args.num_generations
    num_prompts = prompts_per_epoch(len(train_dataset), prompts_per_generation)
    generations = math.ceil(args.num_train_epochs * num_prompts / prompts_per_generation)
    micro_batches = generations * args.steps_per_generation * args.num_iterations
    return max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)


def build_scheduler(optimizer, args: GRPOConfig, max_steps: int):
    from transformers import get_scheduler

    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
    return get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=max_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )


def best_metric_key(name: str, metrics: dict) -> str:
    """The evaluation metric metric_for_best_model names, as transformers reads it ('loss' is eval_loss) or by
    grpokit's own names ('reward' is eval/reward)."""
    for key in (name, f"eval_{name}", f"eval/{name}"):
        if key in metrics:
            return key
    raise ValueError(
        f"metric_for_best_model={name!r} is not among the evaluation's metrics: "
        f"{sorted(k for k in metrics if k not in ('step', 'epoch'))}."
    )


def set_log_level(name: str) -> None:
    """transformers' logging verbosity by TrainingArguments' level name ('passive': leave it)."""
    if LOG_LEVELS[name] is not None:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity(LOG_LEVELS[name])
        logging.getLogger("grpokit").setLevel(LOG_LEVELS[name])  # grpokit's advisories, as TRL's follow its logger


def activation_offload(args: GRPOConfig, device: torch.device) -> ActivationOffload | None:
    """The hooks that keep the training forward's saved tensors in host memory (activation_offloading), where there
    is an accelerator to take them off."""
    if not args.activation_offloading:
        return None
    if device.type == "cpu":
        logger.warning(
            "activation_offloading=True has no effect on a CPU: the activations are in host memory "
            "already. It is left off; set it on GPU runs."
        )
        return None
    return ActivationOffload(device.type)


def warn_like_trl(args: GRPOConfig, model, quantization_config) -> None:
    """TRL's advisory warnings through the logger, as TRL logs them: TRL's words first, then grpokit's advice."""
    if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        logger.warning(
            f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums "
            f"per-token contributions, which effectively weights each sequence by its completion length "
            f"instead of optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set "
            f"`loss_type='grpo'` (see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-"
            f"policy-optimization)."
        )
    if not isinstance(model, str) and quantization_config is not None:
        logger.warning(
            "You passed `quantization_config` to the trainer, but your model is already instantiated. The "
            "`quantization_config` will be ignored. Quantize the model when loading it, or pass it as a "
            "path."
        )
    if not isinstance(model, str) and args.model_init_kwargs:
        logger.warning(
            "You passed `model_init_kwargs` to the `GRPOConfig`, but your model is already instantiated. "
            "The `model_init_kwargs` will be ignored."
        )


def build_engine(model, args: GRPOConfig, processing_class, accelerator) -> RolloutEngine:
    """The default engine: vLLM (use_vllm), else sampling in this process from the policy, with transformers'
    `generate` where generation_kwargs ask for what only it does (beams, its logits processors)."""
    if args.use_vllm:
        return build_vllm_engine(
            model,
            args,
            processing_class,
            accelerator.process_index,
            accelerator.num_processes,
            accelerator.local_process_index,
        )
    generate_options = args.transformers_generate_kwargs()
    if generate_options:
        return TransformersGenerateEngine(model, accelerator.device, generate_options, autocast=accelerator.autocast)
    # With sharded parameters every forward is a collective: the processes sample in step (see generate()).
    all_done = all_processes_done if is_sharded(model) else None
    exact = not (args.bf16 or args.fp16) and full_precision(model)  # bf16 weights: not exact
    compile = False if (args.generation_kwargs or {}).get("disable_compile") else None
    return HFEngine(
        model,
        accelerator.device,
        autocast=accelerator.autocast,
        all_done=all_done,
        logprobs_match_training=exact,
        cache_implementation=args.cache_implementation,
        compile=compile,
    )


def build_vllm_engine(
    model: torch.nn.Module,
    args: GRPOConfig,
    tokenizer=None,
    process_index: int = 0,
    num_processes: int = 1,
    local_process_index: int = 0,
) -> RolloutEngine:
    """The engine `GRPOConfig(use_vllm=True)` asks for: colocated `VLLMEngine` (one per training process), or the
    server client (no vLLM needed in this process)."""
    if args.vllm_mode == "server":
        return VLLMServers.from_config(model, args, process_index, num_processes)
    return VLLMEngine.from_config(
        model,
        args,
        tokenizer=tokenizer,
        process_index=process_index,
        num_processes=num_processes,
        local_process_index=local_process_index,
    )


def track_best_checkpoint(args: GRPOConfig, state, evaluation: dict | None) -> None:
    """metric_for_best_model: when this step's evaluation beats state.best_metric (strictly, as transformers), the
    checkpoint about to be written becomes state.best_model_checkpoint."""
    if args.metric_for_best_model is None or evaluation is None or evaluation["step"] != state.global_step:
        return
    value = float(evaluation[best_metric_key(args.metric_for_best_model, evaluation)])
    if state.best_metric is None or (
        value > state.best_metric if args.greater_is_better else value < state.best_metric
    ):
        state.best_metric, state.best_global_step = value, state.global_step
        state.best_model_checkpoint = str(Path(args.output_dir) / f"checkpoint-{state.global_step}")


@dataclass
class RunInputs:
    """What a run trains on, checked before the model is loaded: the rows, the multi-turn parts and the rewards."""

    train_dataset: Any
    environments: Any  # grpokit.agents.EnvironmentPool (environment_factory), or None
    adapter: Any  # grpokit.integrations.EnvironmentAdapter (environment=), or None
    reward_functions: list
    reward_weights: torch.Tensor
    # checks the processing class once it is known and before the weights load (the agents' chat template), or None
    check_tokenizer: Any = None
    eval_dataset: Any = None
    rollout_engine: RolloutEngine | None = None  # the user's, or None: build_engine's
    tools: Any = None  # the rest as the trainer was given them
    rollout_func: Any = None


def run_inputs(
    args: GRPOConfig,
    train_dataset,
    eval_dataset,
    reward_funcs,
    reward_processing_classes,
    rollout_engine,
    tools,
    rollout_func,
    environment_factory,
    environment,
    *,
    rewards_required: bool,
) -> RunInputs:
    """The trainer's inputs: an environment of another library supplies its rows and rewards (and its weights go
    into args.reward_weights), environment_factory's instances the prompts when there is no dataset; then every
    check of the data, the agent arguments and the rewards."""
    adapter = None if environment is None else adapt_environment(environment, tools, rollout_func, environment_factory)
    if adapter is not None:
        train_dataset, reward_funcs = environment_inputs(adapter, args, train_dataset, reward_funcs)
    environments = EnvironmentPool(environment_factory) if environment_factory is not None else None
    if train_dataset is None and environments is not None:  # the environments supply the prompts (reset)
        train_dataset = placeholder_dataset(args, environment_factory)
    # TRL's order: the reward source before the data (with neither, the message names the reward)
    functions, weights = build_rewards(args, reward_funcs, reward_processing_classes, environments, rewards_required)
    check_run(args, train_dataset, eval_dataset, rollout_engine, tools, rollout_func, environment_factory)
    if rollout_func is None and adapter is None:  # a rollout_func's extra fields are columns known once it has run
        agents = bool(tools) or environments is not None
        check_reward_columns(functions, (train_dataset, eval_dataset), agents)
    uses_chat_tools = adapter is None and rollout_func is None and (bool(tools) or environments is not None)
    check_tokenizer = partial(check_agent_tokenizer, args.chat_template_kwargs) if uses_chat_tools else None
    return RunInputs(
        train_dataset,
        environments,
        adapter,
        functions,
        weights,
        check_tokenizer,
        eval_dataset,
        rollout_engine,
        tools,
        rollout_func,
    )


def check_agent_tokenizer(chat_template_kwargs, processing_class, model_or_config) -> None:
    """Tools and environments read the chat template (agents.check_chat_template) with the engine's EOS tokens."""
    stop_ids = eos_token_ids(tokenizer_of(processing_class), model_or_config) if processing_class else None
    check_chat_template(processing_class, chat_template_kwargs, stop_ids)


def build_driver(
    inputs: RunInputs, tokenizer, model, args: GRPOConfig, max_prompt_length: int | None, tools, rollout_func
):
    """The multi-turn driver: the environment adapter's, grpokit's agents (tools, environments, a rollout_func), or
    None for single-turn training."""
    if inputs.adapter is not None:
        return inputs.adapter.driver(tokenizer, args, max_prompt_length)
    return build_agents(tokenizer, model, args, max_prompt_length, tools, inputs.environments, rollout_func)


def build_rewards(args: GRPOConfig, reward_funcs, reward_processing_classes, environments, required: bool = True):
    """(reward functions, their weights): the user's functions and reward models, then the environments'
    get_reward."""
    functions = build_reward_functions(
        reward_funcs,
        reward_processing_classes,
        args.per_device_train_batch_size,
        args.trust_remote_code,
        environment_rewards=environments.reward_functions() if environments is not None else (),
        required=required,
    )
    weights = reward_weights(args, len(functions), len(environments.reward_types) if environments is not None else 0)
    return functions, weights


def launch(args: GRPOConfig, model, quantization_config, rollout_engine, peft_config) -> tuple[Any, bool]:
    """(accelerator, wrapped): the process's launch, before any model is built. accelerate's Accelerator for args
    (the batch checked against its processes), the log level, TRL's advisory warnings, what the launch cannot run
    refused by name (`checks.check_launch`; `wrapped`: FSDP2 or DeepSpeed will wrap the policy), then what the
    process sets (`prepare_process`: the seed)."""
    accelerator = build_accelerator(args)
    args.check_batch(accelerator.num_processes)
    set_log_level(args.log_level if accelerator.is_main_process else args.log_level_replica)
    warn_like_trl(args, model, quantization_config)  # after set_log_level: log_level decides what shows
    wrapped = check_launch(args, accelerator, rollout_engine, peft_config)
    prepare_process(args, accelerator.device)
    if samples_in_engine_process(args, accelerator.device, rollout_engine):  # its imports run beside the model's load
        start_engine_server([type(model).__module__] if isinstance(model, torch.nn.Module) else ())
    return accelerator, wrapped


def samples_in_engine_process(args: GRPOConfig, device: torch.device, engine) -> bool:
    """Whether the run's producer samples with the in-process sampler in a process of its own
    (`producer.producer_engine`): asynchronous generation on a CPU with an HFEngine, `engine` (a subclass is
    refused: `checks.check_producer_engine`), or with the default engine, `engine` None, where that is one."""
    if device.type != "cpu" or not args.max_staleness:
        return False
    if engine is not None:
        return type(engine) is HFEngine
    return not args.use_vllm and not args.transformers_generate_kwargs()


def prepare_process(args: GRPOConfig, device: torch.device) -> None:
    """What the process sets before the model is built: on a CPU, glibc's allocation threshold; the seed."""
    if device.type == "cpu":  # freed tensors leave the process (cpu_memory: glibc kept them, +30% peak RSS)
        keep_large_allocations_mapped()
    if args.full_determinism:  # as transformers' Trainer: deterministic kernels, then the same seeding
        from transformers import enable_full_determinism

        enable_full_determinism(args.seed)
    else:
        from accelerate.utils import set_seed

        set_seed(args.seed)


def build_models(
    model,
    processing_class,
    peft_config,
    quantization_config,
    args: GRPOConfig,
    accelerator,
    datasets,
    check_tokenizer=None,
) -> tuple[Any, Any, Any, int | None]:
    """(policy, processing class, reference, prompt length limit): the policy loaded or wrapped (LoRA) and placed
    on the device, each dataset of `datasets` (train, eval) checked for images the processing class cannot take,
    the frozen reference copied from the policy (None with beta = 0 or LoRA), then the policy's own training
    options (gradient checkpointing, torch.compile), which the reference so does not take. `check_tokenizer`:
    RunInputs.check_tokenizer."""
    policy, processing_class = build_policy(
        model, processing_class, peft_config, args, quantization_config, check_tokenizer
    )
    if args.bf16 or not full_precision(policy):  # before the reference is copied: it takes the same route
        float32_matmuls(policy, accelerator.device)
    elif takes_onednn_linears(args, accelerator):
        onednn_linears(policy, accelerator.device)
    train_dataset, eval_dataset = datasets
    for dataset in (train_dataset, *named_eval_datasets(eval_dataset).values()):
        check_images_supported(processing_class, dataset_columns(dataset))
    max_prompt_length = prompt_length_limit(policy, args)
    policy = place_before_reference_copy(accelerator, policy)  # the reference is then copied on the device
    reference = build_reference(model, policy, args)
    enable_gradient_checkpointing(policy, args, accelerator.device)
    check_backend(accelerator, policy, args)
    if args.torch_compile:  # the policy only, after the reference was copied from it
        compile_blocks(policy, backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    return policy, processing_class, reference, max_prompt_length


def prepare_models(accelerator, args: GRPOConfig, policy, optimizer, reference) -> tuple[Any, Any, Any, bool]:
    """(policy, optimizer, reference, deepspeed): the policy and its optimizer (None: built from args) prepared by
    accelerate (DDP, FSDP2 or DeepSpeed, configured from args first), the reference placed to match; with
    debug="underflow_overflow", transformers' hooks on the policy."""
    optimizer = optimizer or build_optimizer(policy, args)
    deepspeed = deepspeed_stage(accelerator) is not None
    if deepspeed:
        configure_deepspeed(accelerator, args)
    policy, optimizer = accelerator.prepare(policy, optimizer)
    reference = prepare_reference(accelerator, reference, policy)
    if "underflow_overflow" in args.debug:  # as transformers' Trainer: hooks on every module, stop at inf/nan
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(unwrap_model(accelerator, policy))
    return policy, optimizer, reference, deepspeed


@dataclass
class TrainedModels:
    """The models a run trains with, prepared by accelerate (`build_trained_models`)."""

    policy: Any  # prepared: DDP, FSDP2 or DeepSpeed's wrapper, or the model itself
    processing_class: Any
    reference: Any  # the frozen reference, placed to match; None with beta = 0 or LoRA
    optimizer: Any
    deepspeed: bool
    max_prompt_length: int | None
    producer_copy: Any  # asynchronous generation under FSDP2 or DeepSpeed: the policy whole, before wrapping; or None


def build_trained_models(
    model,
    processing_class,
    peft_config,
    quantization_config,
    optimizer,
    args: GRPOConfig,
    accelerator,
    inputs: RunInputs,
    wrapped: bool,
) -> TrainedModels:
    """`build_models` (for `inputs`' datasets and tokenizer check) then `prepare_models`; with max_staleness under
    FSDP2 or DeepSpeed (`wrapped`), the producer's copy of the policy is taken between them (whole, and without
    their hooks)."""
    datasets = (inputs.train_dataset, inputs.eval_dataset)
    policy, processing_class, reference, max_prompt_length = build_models(
        model, processing_class, peft_config, quantization_config, args, accelerator, datasets, inputs.check_tokenizer
    )
    producer_copy = whole_copy(policy) if args.max_staleness is not None and wrapped else None
    policy, optimizer, reference, deepspeed = prepare_models(accelerator, args, policy, optimizer, reference)
    return TrainedModels(policy, processing_class, reference, optimizer, deepspeed, max_prompt_length, producer_copy)


def place_reward_models(reward_functions: list, device: torch.device) -> None:
    """The reward models among the reward functions onto the device, where the completions they score are."""
    for function in reward_functions:
        if isinstance(function.fn, RewardModel):
            function.fn.to(device)


def build_runner(inputs: RunInputs, models: TrainedModels, args: GRPOConfig, accelerator, host) -> RolloutRunner:
    """What samples the completions: the prompt codec, the engine (the user's rollout_engine, else `build_engine`'s),
    the multi-turn driver (`build_driver`) and the sampling settings of args; refused where groups streamed one by
    one cannot run (`checks.check_streaming`). `host` is what a user's rollout_func receives as its trainer (TRL's
    contract)."""
    stop_token_ids, suppress_token_ids = args.generation_token_ids()
    processing_class, max_prompt_length = models.processing_class, models.max_prompt_length
    model = unwrap_model(accelerator, models.policy)
    codec = PromptCodec(
        processing_class, model, max_prompt_length, args.chat_template_kwargs, stop_token_ids, suppress_token_ids
    )
    engine = inputs.rollout_engine
    engine = engine if engine is not None else build_engine(model, args, processing_class, accelerator)
    driver = build_driver(inputs, processing_class, model, args, max_prompt_length, inputs.tools, inputs.rollout_func)
    params = codec.sampling_params(
        args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        keep_sampling_mask=args.keep_sampling_mask,
        sampling_mask_max_tokens=args.sampling_mask_max_tokens,
    )
    runner = RolloutRunner(engine, codec, params, accelerator.device, driver=driver, host=host)
    check_streaming(args, runner, accelerator.num_processes)
    return runner


def build_scorer(reward_functions: list, weights: torch.Tensor, tokenizer, args: GRPOConfig) -> RewardScorer:
    return RewardScorer(
        reward_functions,
        weights,
        tokenizer,
        on_error=args.reward_fn_errors,
        routing_column=args.reward_routing_column,
        step_separator=args.step_separator,
    )


def new_state(args: GRPOConfig, train_dataset, accelerator) -> TrainerState:
    """A run's state before its first step (`total_steps` to go)."""
    return TrainerState(
        max_steps=total_steps(args, train_dataset, accelerator.num_processes),
        logging_steps=args.logging_steps,
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        train_batch_size=args.per_device_train_batch_size,
        num_train_epochs=args.num_train_epochs,
        is_local_process_zero=accelerator.is_local_main_process,
        is_world_process_zero=accelerator.is_main_process,
    )


def build_stepper(accelerator, model, optimizer, scheduler, args: GRPOConfig, deepspeed: bool) -> OptimizerStepper:
    sync_each_batch = args.accelerator_options().get("gradient_accumulation_kwargs", {}).get("sync_each_batch")
    return OptimizerStepper(
        accelerator,
        model,
        optimizer,
        scheduler,
        deepspeed=deepspeed,
        max_grad_norm=args.max_grad_norm,
        max_nonfinite_steps=args.max_nonfinite_steps,
        sync_each_batch=bool(sync_each_batch),
    )


def build_checkpointer(
    accelerator, args: GRPOConfig, model_writer: ModelWriter, deepspeed: bool, sharded: bool
) -> Checkpointer:
    """The checkpointer of args' options, writing the model's files with `model_writer`, refused where the run's
    checkpoint format cannot honour the options."""
    checkpointer = Checkpointer(
        accelerator,
        args.output_dir,
        model_writer,
        save_total_limit=args.save_total_limit,
        save_only_model=args.save_only_model,
        deepspeed=deepspeed,
        gather_weights=model_writer.gather,
        save_on_each_node=args.save_on_each_node,
    )
    check_checkpoint_format(args, checkpointer.format, sharded)
    return checkpointer


def build_sampler(train_dataset, args: GRPOConfig, num_processes: int) -> PromptSampler | StreamSampler:
    """Which prompts come next: a stream's rows in its order, or a dataset's in a seeded order (data_seed, else seed;
    shuffled per epoch unless shuffle_dataset is False), each epoch whole generation batches as in TRL."""
    if is_iterable_dataset(train_dataset):
        return StreamSampler(train_dataset)
    return PromptSampler(
        len(train_dataset),
        args.data_seed or args.seed,
        args.shuffle_dataset,
        args.generation_batch_size // args.num_generations,
    )


def build_experience(args: GRPOConfig, accelerator, runner, scorer, models: TrainedModels, teacher_model, rows):
    """(ExperienceMaker, Evaluator): the generation batches' maker over the runner and scorer, the policy and
    reference of `models` and the teacher of `teacher_model` (`build_teacher`; `rows(n)`: the next n prompt rows),
    and the evaluation over it."""
    policy = unwrap_model(accelerator, models.policy)
    teacher = build_teacher(teacher_model, args, accelerator.device, policy, models.processing_class)
    experience = ExperienceMaker(
        args, accelerator, runner, scorer, lambda: policy, models.reference, rows, teacher=teacher
    )
    return experience, Evaluator(args, accelerator, experience)


def build_teacher(teacher_model, args: GRPOConfig, device, student, processing_class):
    """The teacher of the per-token teacher signal (grpokit.teacher), loaded with model_init_kwargs when a path is
    given; None without a teacher_model."""
    if teacher_model is None:
        return None
    init_kwargs = args.model_init_kwargs if isinstance(teacher_model, str) else None
    return load_teacher(teacher_model, init_kwargs, None, args.trust_remote_code, device, student, processing_class)


def build_entropy_controller(args: GRPOConfig) -> AdaptiveEntropyController | None:
    """The adaptive entropy bonus's controller (use_adaptive_entropy), else None: the fixed entropy_coef."""
    if not args.use_adaptive_entropy:
        return None
    return AdaptiveEntropyController(
        args.entropy_coef, args.entropy_target, args.entropy_coef_delta, args.entropy_coef_min, args.entropy_coef_max
    )
