"""The command line: `grpokit train [config.yaml] [--field value ...]`, `grpokit eval --model DIR ...`,
`grpokit report OUTPUT_DIR ...`, `grpokit vllm-serve --model DIR ...` (server mode's vLLM server).

`grpokit train` with no model and no dataset runs the built-in demo (flags still apply, e.g. --max_steps).
Every GRPOConfig field is a flag; values are parsed as YAML scalars (`--bf16`, `--bf16 false`,
`--top_k null`); list fields take `--reward_weights 1.0`, `--reward_weights 1.0 0.5`, `--reward_weights 1.0,0.5`
or `--reward_weights "[1, 0.5]"`. A YAML file gives the same keys, plus `model`, `dataset` and `reward`; flags
override the file. TRL's `ModelConfig` options (`--use_peft`, `--lora_r`, `--load_in_4bit`, ...) build the LoRA
adapter and the model's loading arguments (model_options.py). Mistakes (an unknown command, flag or key, a bad value,
a missing optional package, an output_dir that holds another run) print one line with a suggestion, before anything
loads.

Each command imports the package modules it runs inside its function: `grpokit --help`, `--version` and
`train --help` read only GRPOConfig's fields, and must not import torch (seconds), as `import grpokit` does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from pathlib import Path

import yaml

from .config import GRPOConfig, annotation_of

RUN_KEYS = ("model", "dataset", "dataset_split", "reward", "eval_dataset", "eval_dataset_split", "rename_column")


class UsageError(ValueError):
    """A user's mistake on the command line or in a config file: printed as one or two lines, no traceback."""


def closest(word: str, choices) -> str | None:
    """The closest of `choices` to `word`, or None when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(word: str, choices) -> str:
    """' Did you mean X?' for the closest of `choices`, or '' when nothing is close."""
    close = closest(word, choices)
    return f" Did you mean {close}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching (`--learning_rat` is not `--learning_rate`) and with short errors: one line
    and a suggestion instead of the whole usage, which lists every GRPOConfig field."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [word for word in extras if word.startswith("-")]
            if flags:
                known = [option for action in self._actions for option in action.option_strings]
                self.error(f"unknown option {flags[0]}.{did_you_mean(flags[0].split('=')[0], known)}")
            self.error(f"unexpected argument(s): {' '.join(extras)}")
        return namespace

    def error(self, message):
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")


def _parse_value(raw: str | list[str]):
    if isinstance(raw, list):  # a list flag given several values: `--reward_weights 1.0 0.5`
        values = [yaml.safe_load(item) for item in raw]
        return values[0] if len(values) == 1 else values
    return yaml.safe_load(raw)


def _is_list_field(name: str) -> bool:
    return annotation_of(name).startswith("list[")


def _field_types(name: str) -> set[str]:
    """The types a field's annotation allows, by name: `float | None` -> {'float', 'None'}, `list[str]` -> 'list',
    `Literal[False]` -> 'bool'."""
    parts = (part.strip() for part in annotation_of(name).split("|"))
    return {"bool" if part.startswith("Literal[") else part.split("[")[0] for part in parts}


def _coerce(name: str, value):
    """Give a flag's or a YAML file's value the type of the field's annotation (YAML reads `1e-3` as a string,
    `2` as an int where a float is wanted, `none` as a string)."""
    types = _field_types(name)
    if "list" in types and "str" not in types and value is not None and not isinstance(value, (list, dict)):
        # `--reward_weights 1.0`, `--reward_weights 1.0,0.5`, `reward_weights: 1`: the list users mean
        items = [yaml.safe_load(item) for item in value.split(",")] if isinstance(value, str) else [value]
        inner = annotation_of(name).split("[", 1)[1].split("]", 1)[0]
        if inner == "float":
            try:
                return [float(item) for item in items]
            except (TypeError, ValueError):
                raise UsageError(f"--{name} takes numbers (1.0, or 1.0,0.5, or '[1.0, 0.5]'), not {value!r}.") from None
        return [str(item) for item in items] if inner == "str" else items
    numbers = [kind for kind in ("int", "float") if kind in types]
    if isinstance(value, str) and "str" not in types:
        if value in ("none", "None") and "None" in types:
            return None  # `--top_k none`; but `--scale_rewards none` stays the string 'none'
        if "bool" in types:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UsageError(f"--{name} takes true or false, not {value!r}.")
            return value.lower() in ("true", "1", "yes")
        for kind in numbers:  # int first: `--save_steps 50` stays an int where int is allowed
            try:
                return int(value) if kind == "int" else float(value)
            except ValueError:
                pass
        if numbers:
            raise UsageError(f"--{name} takes a number, not {value!r}.")
        return value
    if isinstance(value, bool) and "bool" not in types and "str" in types and not value:
        return "no"  # YAML 1.1 reads `save_strategy: no` as False
    if value is None or isinstance(value, bool):
        return value
    if numbers == ["float"] and isinstance(value, int):
        return float(value)
    if numbers == ["int"] and isinstance(value, float) and value.is_integer():
        return int(value)
    if types <= {"str", "None"} and isinstance(value, (int, float)):
        return str(value)  # `--run_name 2024`
    return value


# `grpokit train --help` by topic: (title, what it covers, the GRPOConfig fields in it; a name ending in "_" takes
# every field that starts with it). Fields of no topic are listed under "other"; fields TRL has that grpokit does not
# implement, and those accepted for compatibility with no effect, are named in one paragraph (they still parse).
TOPICS = (
    ("run", "where it writes, how long, checkpoints", "output_dir run_name seed data_seed full_determinism max_steps "
     "num_train_epochs resume_from_checkpoint save_strategy save_steps save_total_limit save_only_model save_merged "
     "enable_jit_checkpoint ignore_data_skip push_to_hub hub_"),
    ("model", "loading the model (see also the LoRA / QLoRA options)", "model_init_kwargs disable_dropout "
     "trust_remote_code cast_lm_head_to_fp32 freeze_vision_tower"),
    ("data", "prompts", "shuffle_dataset chat_template_kwargs max_prompt_length"),
    ("rewards", "how completions are scored", "reward_weights reward_fn_errors reward_routing_column step_separator "
     "multi_objective_aggregation reward_clip_range pass_threshold"),
    ("generation", "sampling completions", "num_generations max_completion_length generation_batch_size "
     "steps_per_generation temperature top_p top_k min_p repetition_penalty cache_implementation generation_kwargs "
     "use_transformers_continuous_batching use_transformers_paged transformers_continuous_batching_config use_cache "
     "dynamic_sampling max_resample_rounds max_tool_calling_iterations tool_timeout max_tool_output_chars"),
    ("vLLM", "sampling with vLLM", "use_vllm vllm_ ds3_gather_for_generation"),
    ("objective", "the loss: clipping, KL, aggregation, advantages", "beta num_iterations epsilon epsilon_high delta "
     "importance_sampling_level scale_rewards loss_type mask_truncated_completions sync_ref_model "
     "ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef advantage_estimator kl_in_reward "
     "use_adaptive_entropy entropy_coef_ entropy_target off_policy_mask_threshold use_bias_correction_kl "
     "router_aux_loss_coef sapo_ vespo_ teacher_kl_coef"),
    ("optimization", "batches, optimizer, schedule", "per_device_train_batch_size gradient_accumulation_steps "
     "learning_rate optim optim_args optim_target_modules weight_decay adam_ max_grad_norm lr_scheduler_type "
     "lr_scheduler_kwargs warmup_steps max_nonfinite_steps"),
    ("memory and speed", "precision, checkpointing, offloading, compilation", "bf16 fp16 torch_compile torch_compile_ "
     "gradient_checkpointing gradient_checkpointing_kwargs "
     "activation_checkpointing activation_checkpointing_kwargs padding_free activation_offloading ref_model_dtype "
     "torch_empty_cache_steps use_cpu auto_find_batch_size"),
    ("asynchronous generation", "sampling ahead of training", "max_staleness off_policy_correction "
     "off_policy_correction_cap queue_maxsize weight_sync_steps heartbeat_stale_after_s async_schedule "
     "max_inflight_tasks"),
    ("several processes", "DDP, FSDP, DeepSpeed", "ddp_ accelerator_config parallelism_config deepspeed fsdp "
     "fsdp_config local_rank save_on_each_node log_on_each_node"),
    ("logging", "metrics, trackers, completions, the reward-hacking guard", "logging_steps logging_first_step "
     "logging_strategy log_level log_level_replica report_to project disable_tqdm log_completions "
     "num_completions_to_print guard_metric guard_window log_unique_prompts log_multimodal"),
    ("evaluation", "held-out prompts during training", "eval_strategy eval_steps eval_on_start metric_for_best_model "
     "greater_is_better load_best_model_at_end eval_delay per_device_eval_batch_size num_generations_eval "
     "bf16_full_eval fp16_full_eval"),
)  # fmt: skip


def topic_of(name: str) -> str:
    """The --help topic of a GRPOConfig field ('other' when none names it)."""
    for title, _, names in TOPICS:
        for entry in names.split():
            if name == entry or (entry.endswith("_") and name.startswith(entry)):
                return title
    return "other"


def _add_field_flag(group, name: str, help_text: str) -> None:
    group.add_argument(
        f"--{name}",
        dest=name,
        default=argparse.SUPPRESS,
        metavar="VALUE",
        help=help_text,
        **({"nargs": "+"} if _is_list_field(name) else {"nargs": "?", "const": "true"}),
    )


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    from .model_options import MODEL_OPTION_FIELDS

    group = parser.add_argument_group("LoRA / QLoRA and model loading (TRL's ModelConfig names)")
    for name, spec in MODEL_OPTION_FIELDS.items():
        kind = {"nargs": "+"} if spec.type.startswith("list[") else {"nargs": "?", "const": "true"}
        group.add_argument(
            f"--{name}", dest=name, default=argparse.SUPPRESS, metavar="VALUE", help=spec.metadata["help"], **kind
        )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model, data and rewards")
    group.add_argument("--model", help="Model directory or Hugging Face Hub id.")
    group.add_argument("--dataset", help="Hub id, local directory, or a .jsonl/.json/.csv/.parquet file.")
    group.add_argument("--dataset_split", default=None, help="Split of a Hub / directory dataset (default: train).")
    group.add_argument(
        "--eval_dataset", default=None, help="Prompts to evaluate on every eval_steps (forms of --dataset)."
    )
    group.add_argument("--eval_dataset_split", default=None, help="Split of a Hub / dir eval set (default: test).")
    group.add_argument(
        "--reward",
        action="append",
        default=None,
        help="Reward: a built-in name (accuracy, think_format, length, code_execution, exact_match) "
        "or module:function / path.py:function. Repeat for several.",
    )
    add_rename_column(group)
    group.add_argument(
        "--overwrite_output_dir",
        nargs="?",
        const="true",
        default=argparse.SUPPRESS,
        metavar="VALUE",
        help="Start over in an output_dir that holds a previous run: its checkpoints, metrics.jsonl and "
        "completions.jsonl are removed first (without it, such an output_dir is refused).",
    )


def build_train_parser() -> argparse.ArgumentParser:
    from .config import DEPRECATED, NO_EFFECT, NOT_IMPLEMENTED

    parser = Parser(
        prog="grpokit train",
        usage="grpokit train [config.yaml] [--model M --dataset D --reward R] [--FIELD VALUE ...]",
        description="Train with GRPO. With no --model and no --dataset (and no config file), runs the built-in demo. "
        "Every GRPOConfig field is a flag (docs/reference/configuration.md has them all, with defaults).",
    )
    parser.add_argument("config", nargs="?", help="YAML file with GRPOConfig fields and model/dataset/reward.")
    _add_run_options(parser)
    groups = {}
    for title, about, _ in TOPICS:
        groups[title] = parser.add_argument_group(f"{title}: {about}")
        if title == "model":
            _add_model_options(parser)
    groups["other"] = parser.add_argument_group("other")
    hidden, deprecated = [], []
    for f in dataclasses.fields(GRPOConfig):
        if f.name == "overwrite_output_dir":
            continue  # a run option of the command line (above)
        if f.name in NOT_IMPLEMENTED or f.name in NO_EFFECT:
            hidden.append(f.name)
            _add_field_flag(parser, f.name, argparse.SUPPRESS)
        elif f.name in DEPRECATED:
            deprecated.append(f.name)
            _add_field_flag(parser, f.name, argparse.SUPPRESS)
        else:
            _add_field_flag(groups[topic_of(f.name)], f.name, f.metadata.get("help", ""))
    parser.epilog = (
        f"Accepted for TRL compatibility, not implemented or without effect here (each warns when set): "
        f"{', '.join(hidden)}. Deprecated names (they still work, and warn with the name to use): "
        f"{', '.join(deprecated)}."
    )
    return parser


def _read_config_file(path_name: str) -> dict:
    path = Path(path_name)
    if not path.is_file():
        raise UsageError(f"config file {path} not found.")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"config file {path} is not valid YAML: {error}".replace("\n", " ")) from None
    if not isinstance(values, dict):
        raise UsageError(f"config file {path} must hold a mapping of field: value.")
    return values


def _model_options(values: dict, namespace: dict) -> dict:
    """TRL's ModelConfig keys, from the YAML file's values (popped) and the flags (which win), coerced."""
    from .model_options import MODEL_OPTION_FIELDS

    options = {name: values.pop(name) for name in list(values) if name in MODEL_OPTION_FIELDS}
    for name in MODEL_OPTION_FIELDS:
        if name in namespace:
            raw = namespace[name]
            options[name] = _parse_value(raw) if isinstance(raw, (str, list)) else raw
    coerced = {}
    for name, value in options.items():
        kind = MODEL_OPTION_FIELDS[name].type
        coerced[name] = _coerce_as(name, value, kind)
    return coerced


def _coerce_as(name: str, value, annotation: str):
    """A model option's value as its annotation says (the same rules as a GRPOConfig field's)."""
    if annotation.startswith("list[") and value is not None:
        return [str(v) for v in value] if isinstance(value, list) else [v for v in str(value).split(",") if v]
    if annotation == "bool":
        if isinstance(value, str):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise UsageError(f"--{name} takes true or false, not {value!r}.")
            return value.lower() in ("true", "1", "yes")
        return bool(value)
    for kind in (int, float):
        if annotation == kind.__name__:
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise UsageError(f"--{name} takes a number, not {value!r}.") from None
    return None if value is None else str(value)


def parse_train_args(argv: list[str]) -> tuple[dict, dict]:
    """(run options: model/dataset/reward/LoRA/overwrite_output_dir, GRPOConfig values) from a YAML file and flags."""
    namespace = vars(build_train_parser().parse_args(argv))
    values = _read_config_file(namespace["config"]) if namespace.get("config") else {}
    if "model_name_or_path" in values:  # TRL's YAML name for the model
        values.setdefault("model", values.pop("model_name_or_path"))
    run = {key: values.pop(key, None) for key in RUN_KEYS}
    if "reward_funcs" in values:
        run["reward"] = values.pop("reward_funcs")
    run["peft_config"] = values.pop("peft_config", None)
    run["overwrite_output_dir"] = values.pop("overwrite_output_dir", False)
    if "overwrite_output_dir" in namespace:
        run["overwrite_output_dir"] = namespace["overwrite_output_dir"]
    run["overwrite_output_dir"] = _coerce_as("overwrite_output_dir", run["overwrite_output_dir"], "bool")
    run["model_options"] = _model_options(values, namespace)
    for key in RUN_KEYS:
        if namespace.get(key) is not None:
            run[key] = namespace[key]
    if isinstance(run["reward"], str):
        run["reward"] = [run["reward"]]
    run["rename_column"] = column_renames(run["rename_column"])
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        hints = "".join(did_you_mean(key, [*fields, *RUN_KEYS, "peft_config"]) for key in unknown)
        raise UsageError(
            f"unknown key(s) in {namespace['config']}: {', '.join(unknown)}.{hints} "
            "`grpokit train --help` lists the fields."
        )
    for name in fields & set(namespace):
        raw = namespace[name]
        values[name] = _parse_value(raw) if isinstance(raw, (str, list)) else raw
        if isinstance(values[name], bool) and "bool" not in _field_types(name) and "str" in _field_types(name):
            values[name] = raw  # YAML 1.1 reads `--eval_strategy no` as False; the field wants the word
    return run, {name: _coerce(name, value) for name, value in values.items()}


def train_command(argv: list[str]) -> int:
    run, values = parse_train_args(argv)
    if run["model"] is None and run["dataset"] is None:
        return demo_command(run, values)
    missing = [key for key in ("model", "dataset", "reward") if not run[key]]
    if missing:
        raise UsageError(f"missing {', '.join('--' + k for k in missing)} (or give them in the YAML file).")
    check_eval_request(run, values)
    peft_arguments = model_options_into(run, values)
    args = build_config(values)
    check_packages(args, run["reward"], peft_arguments is not None, run["model_options"])
    check_output_dir(args, run["overwrite_output_dir"])
    rewards = resolve_rewards(run["reward"])  # bad reward names fail before any loading
    quiet_library_progress()
    dataset = load_data(run["dataset"], run["dataset_split"] or "train", run["rename_column"])
    check_columns(dataset, run["dataset"], rewards)
    eval_dataset = None
    if run["eval_dataset"]:
        eval_dataset = load_data(run["eval_dataset"], run["eval_dataset_split"] or "test", run["rename_column"])
        check_columns(eval_dataset, run["eval_dataset"], rewards)
    check_model(run["model"])
    peft_config = build_lora_config(peft_arguments)
    clear_previous_run(args.output_dir, run["overwrite_output_dir"])
    trainer = build_trainer(
        model=run["model"],
        reward_funcs=rewards,
        args=args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:  # once, also under torchrun / accelerate launch
        out = Path(args.output_dir).resolve()
        print(f"Model saved to {out}; metrics in {out / 'metrics.jsonl'}.")
    return 0


def demo_command(run: dict, values: dict) -> int:
    """The built-in demo: its own model, data and rewards, so run options that name others are refused, not
    ignored; every check of a config (packages, output_dir) runs before its warm-up."""
    given = [f"--{key}" for key in (*RUN_KEYS, "peft_config") if run.get(key)] + [
        f"--{key}" for key in run["model_options"]
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} without --model and --dataset: give both (with --reward) to train your own model; "
            "without them `grpokit train` runs the built-in demo, which has its own model, data and rewards."
        )
    # The packages the flags name, checked before the demo's imports (torch, the trainer) take their seconds.
    light = {name: values[name] for name in ("report_to", "optim", "use_vllm", "deepspeed") if name in values}
    check_packages(build_config(light), [], False, {})
    from .demo import run_demo

    def check(args: GRPOConfig) -> None:
        check_packages(args, [], False, {})
        check_output_dir(args, run["overwrite_output_dir"], can_resume=False)
        clear_previous_run(args.output_dir, run["overwrite_output_dir"])

    quiet_library_progress()
    try:
        run_demo(**{"output_dir": "grpo-demo", **values}, before_warm_up=check)
    except ValueError as error:
        if _raised_by_config_validation(error):
            raise UsageError(str(error)) from None
        raise
    return 0


def check_eval_request(run: dict, values: dict) -> None:
    """An eval dataset is evaluated on: with --eval_dataset and no eval_strategy, evaluation runs every eval_steps
    (logging_steps by default) and says so; contradictions are errors, not silence."""
    if run["eval_dataset_split"] and not run["eval_dataset"]:
        raise UsageError("--eval_dataset_split without --eval_dataset: name the evaluation dataset too.")
    strategy = values.get("eval_strategy")
    if run["eval_dataset"] and strategy in (None, "steps"):
        values["eval_strategy"] = "steps"
        every = values.get("eval_steps") or values.get("logging_steps") or GRPOConfig.logging_steps
        print(
            f"Evaluating on {run['eval_dataset']} every {every:g} steps (eval_strategy=steps; set --eval_steps "
            f"to change it)."
        )
    elif run["eval_dataset"]:
        raise UsageError(
            f"--eval_dataset {run['eval_dataset']} with --eval_strategy {strategy}: nothing would be evaluated. "
            "Drop --eval_strategy (with an eval dataset the run evaluates every eval_steps), or drop --eval_dataset."
        )
    elif strategy == "steps" or values.get("eval_on_start"):
        raise UsageError("evaluation (eval_strategy=steps / eval_on_start) needs --eval_dataset: the prompts to use.")


def model_options_into(run: dict, values: dict) -> dict | None:
    """TRL's ModelConfig options: their from_pretrained arguments merged into values' model_init_kwargs (the
    user's own model_init_kwargs win, as in TRL's scripts); returns peft.LoraConfig's arguments, or None."""
    from .model_options import ModelOptions

    try:
        options = ModelOptions(**run["model_options"])
    except ValueError as error:
        raise UsageError(str(error)) from None
    init = options.model_init_kwargs()
    if init:
        given = values.get("model_init_kwargs") or {}
        if isinstance(given, str):
            given = yaml.safe_load(given) or {}
        values["model_init_kwargs"] = {**init, **given}
    lora = options.lora_arguments()
    if run["peft_config"] is not None and lora is not None:
        raise UsageError("peft_config (a YAML mapping) and --use_peft both describe the adapter: give one of them.")
    if run["peft_config"] is not None and not isinstance(run["peft_config"], dict):
        raise UsageError("peft_config must be a mapping of peft.LoraConfig's arguments (r: 16, lora_alpha: 32, ...).")
    return run["peft_config"] if run["peft_config"] is not None else lora


def build_lora_config(arguments: dict | None):
    if arguments is None:
        return None
    from .model_options import lora_config

    try:
        return lora_config(arguments)
    except ValueError as error:
        raise UsageError(str(error)) from None


# Optional packages a run may need: tracker name -> its pip package (grpokit's `trackers` extra holds them all).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny", "trackio": "trackio"}


def needed_packages(args: GRPOConfig, reward_specs: list[str], lora: bool, model_options: dict) -> list[tuple]:
    """(what needs it, module, grpokit extra, pip package) for every optional package this run will import."""
    from .logs import TRACKERS

    needs = [
        (f"report_to {name}", TRACKERS[name].module, "trackers", TRACKER_PACKAGES[name]) for name in args.report_to
    ]
    if lora:
        needs.append(("a LoRA adapter (--use_peft / peft_config)", "peft", "peft", "peft"))
    for flag in ("load_in_4bit", "load_in_8bit"):
        if model_options.get(flag):
            needs.append((f"--{flag}", "bitsandbytes", "lowmem", "bitsandbytes"))
    if "accuracy" in reward_specs:
        needs.append(("the accuracy reward", "math_verify", "math", "math-verify"))
    optim = args.optim
    if "_torch_" in optim and any(kind in optim for kind in ("8bit", "4bit", "bf16", "fp8")):
        needs.append((f"optim {optim}", "torchao", "lowmem", "torchao"))
    elif "8bit" in optim or "paged" in optim or "bnb" in optim:
        needs.append((f"optim {optim}", "bitsandbytes", "lowmem", "bitsandbytes"))
    if args.use_vllm:
        needs.append(("use_vllm", "vllm", "vllm", "vllm"))
    if args.deepspeed:
        needs.append(("deepspeed", "deepspeed", "test", "deepspeed"))
    return needs


def check_packages(args: GRPOConfig, reward_specs: list[str], lora: bool, model_options: dict) -> None:
    """Every optional package the run needs is importable, before anything loads: one line with its install
    command otherwise."""
    from .extras import missing_message

    for what, module, extra, package in needed_packages(args, reward_specs, lora, model_options):
        message = missing_message(what, module, extra, package)
        if message is not None:
            raise UsageError(message + ".")


# What a run writes into output_dir that a second run there would mix with its own.
RUN_FILES = ("metrics.jsonl", "completions.jsonl", "train_results.json", "completion_images")


def previous_run(output_dir: str) -> list[str]:
    """The names, in output_dir, of a previous run's checkpoints and logs (empty when there is none)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    checkpoints = sorted(p.name for p in folder.glob("checkpoint-*") if p.is_dir())
    return checkpoints + [name for name in RUN_FILES if (folder / name).exists()]


def check_output_dir(args: GRPOConfig, overwrite: bool, can_resume: bool = True) -> None:
    """A second run in the output_dir of a first would mix the two (checkpoints rotated across both runs, one
    metrics.jsonl): refused, with the ways out, unless it resumes the first or starts over."""
    found = previous_run(args.output_dir)
    if not found or overwrite or (can_resume and args.resume_from_checkpoint):
        return
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    resume = "continue it with --resume_from_checkpoint true, or " if can_resume else ""
    raise UsageError(
        f"output_dir {args.output_dir} holds a previous run ({shown}): {resume}start over with "
        "--overwrite_output_dir true (removes its checkpoints and logs), or choose another --output_dir."
    )


def clear_previous_run(output_dir: str, overwrite: bool) -> None:
    """--overwrite_output_dir: the previous run's checkpoints and logs removed, and said."""
    import shutil

    found = previous_run(output_dir) if overwrite else []
    for name in found:
        path = Path(output_dir) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if found:
        print(f"--overwrite_output_dir: removed the previous run's {', '.join(found)} from {output_dir}.")


def quiet_library_progress() -> None:
    """No progress bars of datasets ("Generating train split") or transformers ("Loading weights") on every run:
    grpokit's own bar and log lines say what the run does. Nor, offline, the `kernels` package's note, on
    bitsandbytes' import, that it skips a check it cannot make offline."""
    import logging

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kernels").setLevel(logging.ERROR)


def build_trainer(**kwargs):
    """GRPOTrainer(**kwargs); the checks it makes on the run's values (batch shapes, datasets, rewards) are the
    user's to fix, so a ValueError there is one line, not a traceback (GRPOKIT_TRACEBACK=1 shows it)."""
    import os

    from .trainer import GRPOTrainer

    try:
        return GRPOTrainer(**kwargs)
    except ValueError as error:
        if os.environ.get("GRPOKIT_TRACEBACK") == "1":
            raise
        raise UsageError(" ".join(str(error).split())) from None


def add_rename_column(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rename_column",
        nargs="+",
        default=None,
        metavar="OLD=NEW",
        help="Rename dataset columns before training, e.g. --rename_column question=prompt "
        "answer=solution (the prompts go in 'prompt'; built-in rewards read their own columns).",
    )


def column_renames(value) -> dict[str, str]:
    """--rename_column's OLD=NEW pairs (or a YAML mapping {old: new}) as a dict."""
    if not value:
        return {}
    if isinstance(value, dict):
        return {str(old): str(new) for old, new in value.items()}
    pairs = [item for word in ([value] if isinstance(value, str) else value) for item in str(word).split(",") if item]
    bad = [pair for pair in pairs if pair.count("=") != 1 or not all(pair.split("="))]
    if bad:
        raise UsageError(f"--rename_column takes OLD=NEW pairs (e.g. --rename_column question=prompt), not {bad[0]!r}.")
    return dict(pair.split("=") for pair in pairs)


def check_model(model: str) -> None:
    """A model that is neither a local directory nor loadable from the Hub is named before anything loads, with the
    closest local directory."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"--model {model}: the directory has no config.json (a save_pretrained / save_model "
                "directory, or a checkpoint-<step> directory of a run, holds one)."
            )
        return
    folder = path.parent if path.parent.is_dir() else None
    nearby = [entry.name for entry in folder.iterdir() if entry.is_dir()] if folder is not None else []
    near = closest(path.name, nearby)
    if near is not None:
        shown = near if str(path.parent) == "." else str(path.parent / near)
        raise UsageError(f"--model {model}: no such directory. Did you mean {shown}?")
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UsageError(f"--model {model}: no such directory. Give a model directory (save_pretrained's) or a Hub id.")
    problem = hub_model_problem(model)
    if problem is not None:
        raise UsageError(
            f"--model {model}: not a local directory, and {problem}. Give a model directory (save_pretrained's), "
            "or a Hub id this machine can download."
        )


def hub_model_problem(model_id: str) -> str | None:
    """Why `model_id` cannot be loaded from the Hub (offline, not found, gated), said at once, without the
    download's retries; None when it is in the local cache or the Hub has it."""
    import os

    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
            return None
    except HFValidationError as error:
        return f"not a valid Hub id ({str(error).splitlines()[0]})"
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "not in the Hugging Face cache (HF_HUB_OFFLINE is set, so the Hub is not tried)"
    try:
        model_info(model_id, timeout=10)
    except GatedRepoError:
        return "gated on the Hub: accept its terms on its page and log in (hf auth login)"
    except RepositoryNotFoundError:
        return "not found on the Hub (a private model needs hf auth login)"
    except Exception as error:  # the HTTP client's connection and timeout errors: offline, or a proxy in the way
        return f"the Hub cannot be reached from this machine ({type(error).__name__}: {error}; offline?)"
    return None


def check_columns(dataset, spec: str, rewards: list) -> None:
    """The dataset's prompt column and the columns the rewards read, with the command line's fix: --rename_column."""
    from .data import PROMPT_COLUMNS, dataset_columns
    from .rewards.base import RewardFunction, reward_name

    columns = dataset_columns(dataset)
    if not any(column in columns for column in PROMPT_COLUMNS):
        guess = next(
            (c for c in ("question", "problem", "query", "input", "instruction", "text") if c in columns),
            columns[0] if columns else "COLUMN",
        )
        raise UsageError(
            f"dataset {spec} has no 'prompt' column (its columns: {', '.join(columns)}): say which "
            f"column holds the prompts with --rename_column {guess}=prompt."
        )
    for reward in rewards:
        function = RewardFunction(reward_name(reward), reward)
        missing = [c for c in function.required_columns() if c not in columns]
        if missing:
            others = [c for c in columns if c not in PROMPT_COLUMNS]
            guess = closest(missing[0], others) or (others[0] if others else "COLUMN")
            raise UsageError(
                f"reward {function.name} reads the dataset column {missing[0]!r}, which dataset {spec} "
                f"lacks (its columns: {', '.join(columns)}): name the column that holds it with "
                f"--rename_column {guess}={missing[0]}."
            )


def _raised_by_config_validation(error: BaseException) -> bool:
    """Whether GRPOConfig's validation raised this (a value the user gave), not the code behind it."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve() == Path(__file__).with_name("config.py").resolve()


def resolve_rewards(specs: list[str]) -> list:
    from .rewards.builtin import resolve_reward

    try:
        return [resolve_reward(spec) for spec in specs]
    except (ValueError, FileNotFoundError, AttributeError, ImportError) as error:
        raise UsageError(str(error)) from None


def build_config(values: dict) -> GRPOConfig:
    try:
        return GRPOConfig(**values)
    except ValueError as error:  # GRPOConfig's validation says which value and how to fix it
        raise UsageError(str(error)) from None


def load_data(spec: str, split: str, renames: dict[str, str] | None = None):
    from .data import dataset_columns, load_dataset_source

    try:
        dataset = load_dataset_source(spec, split=split)
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    columns = dataset_columns(dataset)
    for old, new in (renames or {}).items():
        if old not in columns:
            raise UsageError(
                f"--rename_column {old}={new}: dataset {spec} has no column {old!r} (its columns: "
                f"{', '.join(columns)}).{did_you_mean(old, columns)}"
            )
    return dataset.rename_columns(renames) if renames else dataset


def report_command(argv: list[str]) -> int:
    parser = Parser(prog="grpokit report", description="Plots and an HTML page for one or more runs.")
    parser.add_argument("output_dirs", nargs="+", help="Run output directories (several are overlaid).")
    parser.add_argument("--out", default=None, help="Where to write the report (default: FIRST_DIR/report).")
    options = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "grpokit report draws its plots with matplotlib, a dependency of grpokit that is missing "
            "here: pip install matplotlib"
        ) from None
    from .report import holds_a_run, write_report

    for folder in options.output_dirs:  # a mistyped or empty folder is not a run whose report is empty
        if not Path(folder).is_dir():
            raise UsageError(f"{folder} is not a directory: give the output_dir of a training run.")
        if not holds_a_run(folder):
            raise UsageError(
                f"{folder} holds no run (no metrics.jsonl, completions.jsonl or *_config.json): "
                "give the output_dir of a training run."
            )
    try:
        path = write_report(options.output_dirs, Path(options.out) if options.out else None)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from None
    print(f"Report written to {path}")
    return 0


# The GRPOConfig fields that shape an evaluation (every one is a flag of `grpokit eval`).
EVAL_FIELDS = (
    "num_generations_eval",
    "per_device_eval_batch_size",
    "pass_threshold",
    "max_completion_length",
    "max_prompt_length",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "chat_template_kwargs",
    "reward_weights",
    "reward_fn_errors",
    "seed",
    "bf16",
    "fp16",
    "use_cpu",
    "model_init_kwargs",
)


def run_config_of(model: str) -> Path | None:
    """The configuration (grpo_config.json, distillation_config.json) of the run that wrote `model`: in a save_model
    directory (the run's output_dir) or in the parent of a checkpoint-<step> directory; None for a Hub id or a model
    from elsewhere."""
    from .report import CONFIG_FILES

    path = Path(model).expanduser()
    for directory in (path, path.parent):
        for name in CONFIG_FILES:
            if (directory / name).is_file():
                return directory / name
    return None


def build_eval_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="grpokit eval",
        description="Sample num_generations_eval completions per prompt from a saved model or checkpoint, score them "
        "with the rewards, print mean rewards and pass@k, and write them with every completion to JSON. "
        "Sampling settings default to the run's grpo_config.json (next to the model or its checkpoint "
        "directory); flags override them.",
    )
    parser.add_argument("--model", required=True, help="A save_model or checkpoint-<step> directory, or a Hub id.")
    parser.add_argument("--dataset", required=True, help="Hub id, local directory, or .jsonl/.json/.csv/.parquet file.")
    parser.add_argument("--dataset_split", default=None, help="Split of a Hub / directory dataset (default: train).")
    parser.add_argument(
        "--reward", action="append", required=True, help="Reward, as for `grpokit train --reward`. Repeat for several."
    )
    parser.add_argument("--out", default="eval_results.json", help="JSON file to write (default: %(default)s).")
    add_rename_column(parser)
    for name in EVAL_FIELDS:
        _add_field_flag(parser, name, GRPOConfig.field_help(name))
    return parser


def eval_values(options: dict) -> dict:
    """The evaluation's GRPOConfig values: the flags, over the run's own settings (its grpo_config.json)."""
    values = {name: _coerce(name, _parse_value(options[name])) for name in EVAL_FIELDS if name in options}
    weights = values.get("reward_weights")
    if weights is not None and len(weights) != len(options["reward"]):
        raise UsageError(
            f"--reward_weights has {len(weights)} value(s) for {len(options['reward'])} --reward(s); give one "
            "weight per reward."
        )
    run_config = run_config_of(options["model"])
    if run_config is None:
        return values
    saved = json.loads(run_config.read_text())
    inherited = {name: saved[name] for name in EVAL_FIELDS if name in saved and name not in values}
    if inherited.get("num_generations_eval", 0) is None and saved.get("num_generations"):
        inherited["num_generations_eval"] = saved["num_generations"]  # the run evaluated with its group size
    weights = inherited.get("reward_weights")
    if weights is not None and len(weights) != len(options["reward"]):
        del inherited["reward_weights"]  # the run's weights were for its own rewards, not these
    print(
        f"Settings from {run_config} (flags override): "
        + ", ".join(f"{k}={v}" for k, v in inherited.items() if v is not None)
    )
    return {**inherited, **values}


def write_eval_results(options: dict, args: GRPOConfig, trainer, dataset, metrics: dict) -> Path:
    """The table on the console, and the metrics with every completion in --out's JSON file."""
    from .evaluation import format_table

    names = [f.name for f in trainer.reward_functions]
    n = args.num_generations_eval
    print(
        f"{options['model']} on {options['dataset']}: {len(dataset)} prompts x {n} completions, "
        f"pass threshold {args.pass_threshold}\n" + format_table(metrics, names, n)
    )
    results = {
        "model": options["model"],
        "dataset": options["dataset"],
        "num_prompts": len(dataset),
        "num_generations_eval": n,
        "pass_threshold": args.pass_threshold,
        "rewards": dict(zip(names, trainer.reward_weights.tolist())),
        "config": {name: getattr(args, name) for name in EVAL_FIELDS},
        "metrics": metrics,
        "samples": trainer.eval_samples,
    }
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"Results written to {out.resolve()}")
    return out


def eval_command(argv: list[str]) -> int:
    options = vars(build_eval_parser().parse_args(argv))
    values = eval_values(options)
    rewards = resolve_rewards(options["reward"])
    args = build_config({"disable_tqdm": True, **values})
    check_packages(args, options["reward"], False, {})
    quiet_library_progress()
    renames = column_renames(options["rename_column"])
    dataset = load_data(options["dataset"], options["dataset_split"] or "train", renames)
    check_columns(dataset, options["dataset"], rewards)
    check_model(options["model"])
    # The trainer loads the model exactly as training does and evaluates exactly as it does during training.
    trainer = build_trainer(
        model=options["model"], reward_funcs=rewards, args=args, train_dataset=dataset, eval_dataset=dataset
    )
    metrics = trainer.evaluate()
    if trainer.accelerator.is_main_process:  # under accelerate launch every process evaluates its share
        write_eval_results(options, args, trainer, dataset, metrics)
    return 0


def vllm_serve_command(argv: list[str]) -> int:
    from .vllm_server import main as serve

    return serve(argv)


COMMANDS = {"train": train_command, "report": report_command, "eval": eval_command, "vllm-serve": vllm_serve_command}


USAGE = (
    "usage: grpokit {train,eval,report,vllm-serve} ...\n\n"
    "  train [config.yaml] [--field value ...]   GRPO training (no arguments: the built-in demo)\n"
    "  eval --model DIR --dataset D --reward R   mean rewards and pass@k of a saved model or checkpoint\n"
    "  report OUTPUT_DIR [OUTPUT_DIR ...]        plots and an HTML report of runs\n"
    "  vllm-serve --model DIR [--port 8000]      a vLLM server for vllm_mode='server'\n"
    "  --version                                 grpokit's version\n"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a command is needed: the usage, as an error (exit 2), as argparse does
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"grpokit {version('grpokit')}")
        except PackageNotFoundError:  # a checkout on the path, not installed
            print("grpokit (not installed: running from a checkout)")
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"grpokit: unknown command {argv[0]!r}.{did_you_mean(argv[0], COMMANDS)} "
            f"Commands: {', '.join(COMMANDS)} (`grpokit --help`).",
            file=sys.stderr,
        )
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except UsageError as error:
        print(f"grpokit {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
