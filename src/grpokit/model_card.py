"""The model card (`README.md`) that `GRPOTrainer.save_model` writes next to the weights.

It records what a reader of the directory needs to know how the weights came about: the base model, the data,
the reward functions and their weights, the key settings and the last logged metrics. A README.md that grpokit
did not write (no `MARKER` in it) is never overwritten.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data import dataset_columns, is_iterable_dataset
from .version import __version__

MARKER = "<!-- grpokit model card: remove this line to keep grpokit from overwriting the file -->"

# What distinguishes one GRPO run from another; the full configuration is in grpo_config.json.
KEY_FIELDS = (
    "loss_type",
    "beta",
    "num_generations",
    "learning_rate",
    "max_steps",
    "epsilon",
    "epsilon_high",
    "num_iterations",
    "scale_rewards",
    "importance_sampling_level",
    "temperature",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "lr_scheduler_type",
    "seed",
)
# Builders whose name says how the data was stored, not which data it is.
GENERIC_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "generator", "pandas")


def describe_dataset(dataset) -> str:
    """'name (R rows; columns: a, b)' — the name only when the dataset carries a meaningful one."""
    if dataset is None:
        return "unknown"
    rows = "a stream of rows" if is_iterable_dataset(dataset) else f"{len(dataset)} rows"
    shape = f"{rows}; columns: {', '.join(dataset_columns(dataset))}"
    name = getattr(getattr(dataset, "info", None), "dataset_name", None)
    return f"{name} ({shape})" if name and name not in GENERIC_BUILDERS else shape


def _value(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return f"`{value!r}`" if isinstance(value, str) else str(value)


def _table(header: tuple[str, str], rows: list[tuple[str, Any]]) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    return lines + [f"| `{key}` | {_value(value)} |" for key, value in rows]


def render_model_card(
    title: str,
    base_model: str,
    dataset: str,
    rewards: Sequence[tuple[str, float]],
    config: dict[str, Any],
    final_metrics: dict[str, Any] | None = None,
    final_eval: dict[str, Any] | None = None,
    model_class: str = "model",
    method: str = "GRPO",
) -> str:
    """Markdown text of the card. `rewards` is (function name, weight) pairs; `config` a GRPOConfig as a dict (only
    KEY_FIELDS are shown; no reward section without rewards); `base_model` the hub id or path ("" for a model built in
    code: then `model_class` names it); `final_metrics` / `final_eval` the last training / evaluation record of
    log_history."""
    lines = [
        "---",
        "library_name: transformers",
        "tags: [grpokit, grpo]",
        "---",
        MARKER,
        "",
        f"# {title}",
        "",
        f"Trained with {method} (grpokit {__version__}) from "
        f"{f'the base model **{base_model}**' if base_model else f'a `{model_class}` built in code'}.",
        "",
        "## Training data",
        "",
        f"- dataset: {dataset}",
        "",
        *(
            [
                "## Reward functions",
                "",
                "| reward function | weight |",
                "|---|---|",
                *(f"| `{name}` | {weight:g} |" for name, weight in rewards),
                "",
            ]
            if rewards
            else []
        ),
        "## Configuration",
        "",
        "Key settings (every field is in `grpo_config.json` of the run's output_dir).",
        "",
        *_table(("field", "value"), [(key, config[key]) for key in KEY_FIELDS if key in config]),
    ]
    for heading, record in (("Final training metrics", final_metrics), ("Final evaluation", final_eval)):
        if record:
            metrics = [(key, value) for key, value in record.items() if key not in ("step", "epoch")]
            lines += ["", f"## {heading} (step {record.get('step', '?')})", "", *_table(("metric", "value"), metrics)]
    return "\n".join(lines) + "\n"


def run_model_card(
    args,
    model,
    state,
    train_dataset,
    rewards: Sequence[tuple[str, float]],
    method: str = "GRPO",
    final_keys: tuple[str, str] = ("reward", "eval/reward"),
    config: dict | None = None,
) -> str:
    """The card of a run of `method`: `config` (default: args'), and the last records of state.log_history with
    `final_keys` (train, eval); `rewards` as in `render_model_card`."""
    history = state.log_history
    base_model = getattr(getattr(model, "config", None), "name_or_path", "")
    return render_model_card(
        args.run_name or Path(args.output_dir).name,
        base_model,
        describe_dataset(train_dataset),
        rewards,
        {**(config or args.to_dict()), "max_steps": state.max_steps},
        final_metrics=next((r for r in reversed(history) if final_keys[0] in r), None),
        final_eval=next((r for r in reversed(history) if final_keys[1] in r), None),
        model_class=type(model).__name__,
        method=method,
    )


def model_card_writable(directory: str | Path) -> bool:
    """True when directory/README.md is absent or was written by grpokit (it holds MARKER).

    Ask before saving the weights: peft's save_pretrained writes a README.md of its own, which grpokit replaces.
    """
    path = Path(directory) / "README.md"
    return not path.exists() or MARKER in path.read_text(errors="replace")


def write_model_card(directory: str | Path, text: str) -> None:
    (Path(directory) / "README.md").write_text(text)
