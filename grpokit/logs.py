"""Metrics: averaged per logging window, written to metrics.jsonl always, to the console, and to trackers."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path

def generation_metrics(rewards, scores, names, lengths, truncated, num_generations: int,
                       errors: dict[str, float] | None = None) -> dict[str, float]:
    """TRL's per-generation metrics from the whole batch's rewards [N], per-function scores [N, F] (NaN = None),
    completion lengths [N] and truncation flags [N]."""
    from .advantages import group_stats

    _, group_std = group_stats(rewards, num_generations)
    terminated = lengths[truncated == 0]
    metrics = {
        "reward": rewards.nanmean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": (group_std < 1e-6).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
    }
    for index, name in enumerate(names):
        column = scores[:, index]
        valid = column[~column.isnan()]
        metrics[f"rewards/{name}/mean"] = column.nanmean().item()
        metrics[f"rewards/{name}/std"] = valid.std().item() if len(valid) > 1 else 0.0
    for name, count in (errors or {}).items():
        metrics[f"rewards/{name}/errors"] = count
    return metrics


CONSOLE_KEYS = ("loss", "reward", "reward_std", "kl", "entropy", "completions/mean_length", "learning_rate")


def _short(value, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tracker_key(key: str) -> str:
    """`train/reward`, but `eval/reward` stays as it is."""
    return key if key.startswith("eval/") else f"train/{key}"


class MetricWindow:
    """Collects values between two logging steps; `flush` returns their means."""

    def __init__(self):
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self._values[key].append(float(value))

    def flush(self) -> dict[str, float]:
        out = {key: sum(values) / len(values) for key, values in self._values.items() if values}
        self._values.clear()
        return out

    def state_dict(self) -> dict:
        return dict(self._values)

    def load_state_dict(self, state: dict) -> None:
        self._values = defaultdict(list, {k: list(v) for k, v in state.items()})


class MetricSink:
    """metrics.jsonl (always), the console, TensorBoard and W&B (when asked for). Main process only."""

    def __init__(self, output_dir: str, report_to: list[str], run_name: str | None, logging_dir: str | None,
                 config: dict, enabled: bool = True):  # fmt: skip
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.tensorboard = self.wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        unknown = set(report_to) - {"tensorboard", "wandb"}
        if unknown:
            raise ValueError(f"report_to={sorted(unknown)} is not supported; use 'tensorboard', 'wandb' or 'none'.")
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError("report_to='tensorboard' needs: pip install 'grpokit[trackers]'") from error
            self.tensorboard = SummaryWriter(logging_dir or str(Path(output_dir) / "runs"))
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as error:
                raise ImportError("report_to='wandb' needs: pip install 'grpokit[trackers]'") from error
            self.wandb = wandb.init(name=run_name or Path(output_dir).name, config=config)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint's step (they will be logged again)."""
        if not self.enabled:
            return
        for path in (self.path, self.path.parent / "completions.jsonl"):
            if not path.exists():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except ValueError:
                    continue  # a line cut short by a crash
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict, console: bool = True) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(_tracker_key(key), value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({_tracker_key(k): v for k, v in record.items() if k != "step"}, step=step)
        if console:
            shown = " ".join(f"{k}={record[k]:.4g}" for k in CONSOLE_KEYS if k in record)
            print(f"[step {step}] {shown}", file=sys.stderr, flush=True)

    def write_completions(self, step: int, samples: list[dict]) -> None:
        """Sample completions with their rewards: completions.jsonl, a compact console table, and the trackers
        (a Markdown table as TensorBoard text, a W&B table)."""
        if not self.enabled or not samples:
            return
        with open(self.path.parent / "completions.jsonl", "a") as handle:
            for sample in samples:
                handle.write(json.dumps({"step": step, **sample}, default=str) + "\n")
        lines = [f"  {_short(s['prompt'])!r} -> {_short(s['completion'])!r}  reward={s['reward']}  "
                 f"advantage={s['advantage']:+.3f}" for s in samples]  # fmt: skip
        print(f"[step {step}] completions:\n" + "\n".join(lines), file=sys.stderr, flush=True)
        columns = ["prompt", "completion", "reward", "advantage"]
        rows = [[_short(s["prompt"], 200), _short(s["completion"], 200), s["reward"], s["advantage"]] for s in samples]
        if self.tensorboard is not None:
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |" for row in rows]
            self.tensorboard.add_text("completions", "\n".join(table), step)
            self.tensorboard.flush()
        if self.wandb is not None:
            import wandb

            self.wandb.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
