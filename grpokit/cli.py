"""The command line: `grpokit train [config.yaml] [--field value ...]`, `grpokit eval --model DIR ...`,
`grpokit report OUTPUT_DIR ...`, `grpokit vllm-serve --model DIR ...` (server mode's vLLM server).

`grpokit train` with no model and no dataset runs the built-in demo (flags still apply, e.g. --max_steps).
Every GRPOConfig field is a flag; values are parsed as YAML scalars (`--bf16`, `--bf16 false`,
`--reward_weights "[1, 0.5]"`, `--top_k null`). A YAML file gives the same keys, plus `model`, `dataset` and
`reward`; flags override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

from .config import GRPOConfig, annotation_of

RUN_KEYS = ("model", "dataset", "dataset_split", "reward", "eval_dataset", "eval_dataset_split")


def _parse_value(raw: str):
    return yaml.safe_load(raw)


def _field_types(name: str) -> set[str]:
    """The types a field's annotation allows, by name: `float | None` -> {'float', 'None'}, `list[str]` -> 'list',
    `Literal[False]` -> 'bool'."""
    parts = (part.strip() for part in annotation_of(name).split("|"))
    return {"bool" if part.startswith("Literal[") else part.split("[")[0] for part in parts}


def _coerce(name: str, value):
    """Give a flag's or a YAML file's value the type of the field's annotation (YAML reads `1e-3` as a string,
    `2` as an int where a float is wanted, `none` as a string)."""
    types = _field_types(name)
    numbers = [kind for kind in ("int", "float") if kind in types]
    if isinstance(value, str) and "str" not in types:
        if value in ("none", "None") and "None" in types:
            return None  # `--top_k none`; but `--scale_rewards none` stays the string 'none'
        if "bool" in types:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"--{name} takes true or false, not {value!r}.")
            return value.lower() in ("true", "1", "yes")
        for kind in numbers:  # int first: `--save_steps 50` stays an int where int is allowed
            try:
                return int(value) if kind == "int" else float(value)
            except ValueError:
                pass
        if numbers:
            raise ValueError(f"--{name} takes a number, not {value!r}.")
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
    parser = argparse.ArgumentParser(
        prog="grpokit train",
        description="Train with GRPO. With no --model and no --dataset (and no config file), runs the built-in demo.",
    )
    parser.add_argument("config", nargs="?", help="YAML file with GRPOConfig fields and model/dataset/reward.")
    parser.add_argument("--model", help="Model directory or Hugging Face Hub id.")
    parser.add_argument("--dataset", help="Hub id, local directory, or a .jsonl/.json/.csv/.parquet file.")
    parser.add_argument("--dataset_split", default=None, help="Split of a Hub / directory dataset (default: train).")
    parser.add_argument("--eval_dataset", default=None, help="Prompts for eval_strategy=steps (forms of --dataset).")
    parser.add_argument("--eval_dataset_split", default=None, help="Split of a Hub / dir eval set (default: test).")
    parser.add_argument("--reward", action="append", default=None,
                        help="Reward: a built-in name (accuracy, think_format, length, code_execution, exact_match) "
                             "or module:function / path.py:function. Repeat for several.")  # fmt: skip
    for f in dataclasses.fields(GRPOConfig):
        parser.add_argument(f"--{f.name}", dest=f.name, default=argparse.SUPPRESS, nargs="?", const="true",
                            metavar="VALUE", help=f.metadata.get("help", ""))  # fmt: skip
    return parser


def parse_train_args(argv: list[str]) -> tuple[dict, dict]:
    """(run options: model/dataset/reward, GRPOConfig values) from a YAML file and flags."""
    namespace = vars(build_train_parser().parse_args(argv))
    values: dict = {}
    if namespace.get("config"):
        path = Path(namespace["config"])
        if not path.is_file():
            raise FileNotFoundError(f"Config file {path} not found.")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"Config file {path} must hold a mapping of field: value.")
    run = {key: values.pop(key, None) for key in RUN_KEYS}
    if "reward_funcs" in values:
        run["reward"] = values.pop("reward_funcs")
    for key in RUN_KEYS:
        if namespace.get(key) is not None:
            run[key] = namespace[key]
    if isinstance(run["reward"], str):
        run["reward"] = [run["reward"]]
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"Unknown key(s) in the config file: {unknown}. `grpokit train --help` lists the fields.")
    for name in fields & set(namespace):
        raw = namespace[name]
        values[name] = _parse_value(raw) if isinstance(raw, str) else raw
        if isinstance(values[name], bool) and "bool" not in _field_types(name) and "str" in _field_types(name):
            values[name] = raw  # YAML 1.1 reads `--eval_strategy no` as False; the field wants the word
    return run, {name: _coerce(name, value) for name, value in values.items()}


def train_command(argv: list[str]) -> int:
    run, values = parse_train_args(argv)
    if run["model"] is None and run["dataset"] is None:
        from .demo import run_demo

        run_demo(**{"output_dir": "grpo-demo", **values})
        return 0
    missing = [key for key in ("model", "dataset", "reward") if not run[key]]
    if missing:
        raise SystemExit(f"grpokit train: missing {', '.join('--' + k for k in missing)} (or give them in the YAML file).")
    from .data import load_dataset_source
    from .rewards.builtin import resolve_reward
    from .trainer import GRPOTrainer

    rewards = [resolve_reward(spec) for spec in run["reward"]]  # bad reward names fail before any loading
    args = GRPOConfig(**values)
    dataset = load_dataset_source(run["dataset"], split=run["dataset_split"] or "train")
    eval_dataset = (load_dataset_source(run["eval_dataset"], split=run["eval_dataset_split"] or "test")
                    if run["eval_dataset"] else None)  # fmt: skip
    trainer = GRPOTrainer(model=run["model"], reward_funcs=rewards, args=args, train_dataset=dataset,
                          eval_dataset=eval_dataset)  # fmt: skip
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:  # once, also under torchrun / accelerate launch
        out = Path(args.output_dir).resolve()
        print(f"Model saved to {out}; metrics in {out / 'metrics.jsonl'}.")
    return 0


def report_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpokit report", description="Plots and an HTML page for one or more runs.")
    parser.add_argument("output_dirs", nargs="+", help="Run output directories (several are overlaid).")
    parser.add_argument("--out", default=None, help="Where to write the report (default: FIRST_DIR/report).")
    options = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("grpokit report draws its plots with matplotlib, a dependency of grpokit that is missing "
                         "here: pip install matplotlib") from None
    from .report import write_report

    path = write_report(options.output_dirs, Path(options.out) if options.out else None)
    print(f"Report written to {path}")
    return 0


# The GRPOConfig fields that shape an evaluation (every one is a flag of `grpokit eval`).
EVAL_FIELDS = (
    "num_generations_eval", "per_device_eval_batch_size", "pass_threshold", "max_completion_length",
    "max_prompt_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs",
    "reward_weights", "reward_fn_errors", "seed", "bf16", "fp16", "use_cpu", "model_init_kwargs",
)  # fmt: skip


def run_config_of(model: str) -> Path | None:
    """The grpo_config.json of the run that wrote `model`: in a save_model directory (the run's output_dir) or in
    the parent of a checkpoint-<step> directory; None for a Hub id or a model from elsewhere."""
    path = Path(model).expanduser()
    for directory in (path, path.parent):
        if (directory / "grpo_config.json").is_file():
            return directory / "grpo_config.json"
    return None


def eval_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="grpokit eval",
        description="Sample num_generations_eval completions per prompt from a saved model or checkpoint, score them "
                    "with the rewards, print mean rewards and pass@k, and write them with every completion to JSON. "
                    "Sampling settings default to the run's grpo_config.json (next to the model or its checkpoint "
                    "directory); flags override them.",
    )  # fmt: skip
    parser.add_argument("--model", required=True, help="A save_model or checkpoint-<step> directory, or a Hub id.")
    parser.add_argument("--dataset", required=True, help="Hub id, local directory, or .jsonl/.json/.csv/.parquet file.")
    parser.add_argument("--dataset_split", default=None, help="Split of a Hub / directory dataset (default: train).")
    parser.add_argument("--reward", action="append", required=True,
                        help="Reward, as for `grpokit train --reward`. Repeat for several.")  # fmt: skip
    parser.add_argument("--out", default="eval_results.json", help="JSON file to write (default: %(default)s).")
    for name in EVAL_FIELDS:
        parser.add_argument(f"--{name}", dest=name, default=argparse.SUPPRESS, nargs="?", const="true",
                            metavar="VALUE", help=GRPOConfig.field_help(name))  # fmt: skip
    options = vars(parser.parse_args(argv))
    values = {name: _coerce(name, _parse_value(options[name])) for name in EVAL_FIELDS if name in options}
    run_config = run_config_of(options["model"])
    if run_config is not None:  # the run's own sampling settings, unless a flag says otherwise
        saved = json.loads(run_config.read_text())
        inherited = {name: saved[name] for name in EVAL_FIELDS if name in saved and name not in values}
        values = {**inherited, **values}
        print(f"Settings from {run_config} (flags override): "
              + ", ".join(f"{k}={v}" for k, v in inherited.items() if v is not None))  # fmt: skip
    from .data import load_dataset_source
    from .evaluation import format_table
    from .rewards.builtin import resolve_reward
    from .trainer import GRPOTrainer

    rewards = [resolve_reward(spec) for spec in options["reward"]]
    args = GRPOConfig(disable_tqdm=True, **values)
    dataset = load_dataset_source(options["dataset"], split=options["dataset_split"] or "train")
    # The trainer loads the model exactly as training does and evaluates exactly as it does during training.
    trainer = GRPOTrainer(model=options["model"], reward_funcs=rewards, args=args, train_dataset=dataset,
                          eval_dataset=dataset)  # fmt: skip
    metrics = trainer.evaluate()
    if not trainer.accelerator.is_main_process:  # under accelerate launch every process evaluates its share
        return 0
    names = [f.name for f in trainer.reward_functions]
    n = args.num_generations_eval
    print(f"{options['model']} on {options['dataset']}: {len(dataset)} prompts x {n} completions, "
          f"pass threshold {args.pass_threshold}\n" + format_table(metrics, names, n))  # fmt: skip
    results = {
        "model": options["model"], "dataset": options["dataset"], "num_prompts": len(dataset),
        "num_generations_eval": n, "pass_threshold": args.pass_threshold,
        "rewards": dict(zip(names, trainer.reward_weights.tolist())),
        "config": {name: getattr(args, name) for name in EVAL_FIELDS}, "metrics": metrics,
        "samples": trainer.eval_samples,
    }  # fmt: skip
    out = Path(options["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"Results written to {out.resolve()}")
    return 0


def vllm_serve_command(argv: list[str]) -> int:
    from .vllm_server import main as serve

    return serve(argv)


COMMANDS = {"train": train_command, "report": report_command, "eval": eval_command, "vllm-serve": vllm_serve_command}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: grpokit {train,eval,report,vllm-serve} ...\n\n"
              "  train [config.yaml] [--field value ...]   GRPO training (no arguments: the built-in demo)\n"
              "  eval --model DIR --dataset D --reward R   mean rewards and pass@k of a saved model or checkpoint\n"
              "  report OUTPUT_DIR [OUTPUT_DIR ...]        plots and an HTML report of runs\n"
              "  vllm-serve --model DIR [--port 8000]      a vLLM server for vllm_mode='server'\n")  # fmt: skip
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
