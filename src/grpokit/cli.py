"""The command line: `grpokit train [config.yaml] [--field value ...]`, `grpokit eval --model DIR ...`,
`grpokit report OUTPUT_DIR ...`, `grpokit vllm-serve --model DIR ...` (server mode's vLLM server).

`grpokit train` with no model and no dataset runs the built-in demo (flags still apply, e.g. --max_steps).
Every GRPOConfig field is a flag; values are parsed as YAML scalars (`--bf16`, `--bf16 false`,
`--top_k null`); list fields take `--reward_weights 1.0`, `--reward_weights 1.0 0.5`, `--reward_weights 1.0,0.5`
or `--reward_weights "[1, 0.5]"`. A YAML file gives the same keys, plus `model`, `dataset` and `reward`; flags
override the file. Mistakes (an unknown command, flag or key, a bad value) print one line with a suggestion.

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


def build_train_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="grpokit train",
        description="Train with GRPO. With no --model and no --dataset (and no config file), runs the built-in demo.",
    )
    parser.add_argument("config", nargs="?", help="YAML file with GRPOConfig fields and model/dataset/reward.")
    parser.add_argument("--model", help="Model directory or Hugging Face Hub id.")
    parser.add_argument("--dataset", help="Hub id, local directory, or a .jsonl/.json/.csv/.parquet file.")
    parser.add_argument("--dataset_split", default=None, help="Split of a Hub / directory dataset (default: train).")
    parser.add_argument("--eval_dataset", default=None, help="Prompts for eval_strategy=steps (forms of --dataset).")
    parser.add_argument("--eval_dataset_split", default=None, help="Split of a Hub / dir eval set (default: test).")
    parser.add_argument(
        "--reward",
        action="append",
        default=None,
        help="Reward: a built-in name (accuracy, think_format, length, code_execution, exact_match) "
        "or module:function / path.py:function. Repeat for several.",
    )
    add_rename_column(parser)
    for f in dataclasses.fields(GRPOConfig):
        parser.add_argument(
            f"--{f.name}",
            dest=f.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f.metadata.get("help", ""),
            **({"nargs": "+"} if _is_list_field(f.name) else {"nargs": "?", "const": "true"}),
        )
    return parser


def parse_train_args(argv: list[str]) -> tuple[dict, dict]:
    """(run options: model/dataset/reward, GRPOConfig values) from a YAML file and flags."""
    namespace = vars(build_train_parser().parse_args(argv))
    values: dict = {}
    if namespace.get("config"):
        path = Path(namespace["config"])
        if not path.is_file():
            raise UsageError(f"config file {path} not found.")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise UsageError(f"config file {path} is not valid YAML: {error}".replace("\n", " ")) from None
        if not isinstance(values, dict):
            raise UsageError(f"config file {path} must hold a mapping of field: value.")
    run = {key: values.pop(key, None) for key in RUN_KEYS}
    if "reward_funcs" in values:
        run["reward"] = values.pop("reward_funcs")
    for key in RUN_KEYS:
        if namespace.get(key) is not None:
            run[key] = namespace[key]
    if isinstance(run["reward"], str):
        run["reward"] = [run["reward"]]
    run["rename_column"] = column_renames(run["rename_column"])
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        hints = "".join(did_you_mean(key, [*fields, *RUN_KEYS]) for key in unknown)
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
        from .demo import run_demo

        try:
            run_demo(**{"output_dir": "grpo-demo", **values})
        except ValueError as error:
            if _raised_by_config_validation(error):
                raise UsageError(str(error)) from None
            raise
        return 0
    missing = [key for key in ("model", "dataset", "reward") if not run[key]]
    if missing:
        raise UsageError(f"missing {', '.join('--' + k for k in missing)} (or give them in the YAML file).")
    rewards = resolve_rewards(run["reward"])  # bad reward names fail before any loading
    args = build_config(values)
    dataset = load_data(run["dataset"], run["dataset_split"] or "train", run["rename_column"])
    check_columns(dataset, run["dataset"], rewards)
    eval_dataset = None
    if run["eval_dataset"]:
        eval_dataset = load_data(run["eval_dataset"], run["eval_dataset_split"] or "test", run["rename_column"])
        check_columns(eval_dataset, run["eval_dataset"], rewards)
    check_model(run["model"])
    trainer = build_trainer(
        model=run["model"], reward_funcs=rewards, args=args, train_dataset=dataset, eval_dataset=eval_dataset
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:  # once, also under torchrun / accelerate launch
        out = Path(args.output_dir).resolve()
        print(f"Model saved to {out}; metrics in {out / 'metrics.jsonl'}.")
    return 0


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
    looks_local = model.startswith((".", "/", "~")) or model.count("/") != 1
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        where = "no such directory" if looks_local else "not a local directory, and not loadable from the Hub"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(
            f"--model {model}: {where} ({reason}). Give a model directory (save_pretrained's) or a "
            "Hub id this machine can download."
        ) from None


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


def eval_command(argv: list[str]) -> int:
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
        parser.add_argument(
            f"--{name}",
            dest=name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=GRPOConfig.field_help(name),
            **({"nargs": "+"} if _is_list_field(name) else {"nargs": "?", "const": "true"}),
        )
    options = vars(parser.parse_args(argv))
    values = {name: _coerce(name, _parse_value(options[name])) for name in EVAL_FIELDS if name in options}
    if (
        "reward_weights" in values
        and values["reward_weights"] is not None
        and len(values["reward_weights"]) != len(options["reward"])
    ):
        raise UsageError(
            f"--reward_weights has {len(values['reward_weights'])} value(s) for "
            f"{len(options['reward'])} --reward(s); give one weight per reward."
        )
    run_config = run_config_of(options["model"])
    if run_config is not None:  # the run's own sampling settings, unless a flag says otherwise
        saved = json.loads(run_config.read_text())
        inherited = {name: saved[name] for name in EVAL_FIELDS if name in saved and name not in values}
        weights = inherited.get("reward_weights")
        if weights is not None and len(weights) != len(options["reward"]):
            del inherited["reward_weights"]  # the run's weights were for its own rewards, not these
        values = {**inherited, **values}
        print(
            f"Settings from {run_config} (flags override): "
            + ", ".join(f"{k}={v}" for k, v in inherited.items() if v is not None)
        )
    from .evaluation import format_table

    rewards = resolve_rewards(options["reward"])
    args = build_config({"disable_tqdm": True, **values})
    renames = column_renames(options["rename_column"])
    dataset = load_data(options["dataset"], options["dataset_split"] or "train", renames)
    check_columns(dataset, options["dataset"], rewards)
    check_model(options["model"])
    # The trainer loads the model exactly as training does and evaluates exactly as it does during training.
    trainer = build_trainer(
        model=options["model"], reward_funcs=rewards, args=args, train_dataset=dataset, eval_dataset=dataset
    )
    metrics = trainer.evaluate()
    if not trainer.accelerator.is_main_process:  # under accelerate launch every process evaluates its share
        return 0
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
