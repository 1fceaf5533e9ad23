"""Metrics: averaged per logging window, written to metrics.jsonl always, to the console, and to trackers."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

from .extras import install_command


def completion_metrics(lengths, truncated) -> dict[str, float]:
    """TRL's `completions/*` metrics from the whole batch's completion lengths [N] and truncation flags [N]."""
    terminated = lengths[truncated == 0]
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
        "completions/min_terminated_length": terminated.min().item() if len(terminated) else 0.0,
        "completions/max_terminated_length": terminated.max().item() if len(terminated) else 0.0,
    }


def generation_metrics(
    rewards, scores, names, lengths, truncated, num_generations: int, errors: dict[str, float] | None = None
) -> dict[str, float]:
    """TRL's per-generation metrics from the whole batch's rewards [N], per-function scores [N, F] (NaN = None),
    completion lengths [N] and truncation flags [N]."""
    # torch (advantages imports it): config imports this module for TRACKERS, and reading the fields must not.
    from .advantages import group_stats

    _, group_std = group_stats(rewards, num_generations)
    metrics = {
        "reward": rewards.nanmean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": (group_std < 1e-6).float().mean().item(),
        **completion_metrics(lengths, truncated),
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


def reduce_extremes(accelerator, stats: dict) -> dict[str, float]:
    """Per-process metrics (scalar tensors) over all processes: a `.../min` by its minimum, a `.../max` by its
    maximum, anything else by its mean (TRL's reduction of the `sampling/*` metrics)."""
    import torch

    names = sorted(stats)
    values = torch.stack([stats[k].detach().double().reshape(()) for k in names]).to(accelerator.device)
    gathered = accelerator.gather(values[None]).reshape(-1, len(names)).cpu()
    reduce = lambda k, col: col.min() if k.endswith("/min") else col.max() if k.endswith("/max") else col.mean()  # noqa: E731
    return {k: reduce(k, gathered[:, i]).item() for i, k in enumerate(names)}


def reduce_step_metrics(accelerator, metrics: dict[str, float], step_stats: list[dict]) -> dict[str, float]:
    """An optimizer step's metrics averaged over processes: `metrics`, and each key of the micro-batches'
    `step_stats` averaged over the micro-batches that have it. One all-reduce for all of them. Every process has the
    same keys (sorted, so in the same order): a NaN is kept through the reduction (the window drops it after), never
    dropped on one process only."""
    import torch

    keys = sorted({key for stats in step_stats for key in stats})
    metrics = {
        **metrics,
        **{key: sum(s[key] for s in step_stats if key in s) / sum(key in s for s in step_stats) for key in keys},
    }
    names = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=accelerator.device)
    return dict(zip(names, accelerator.reduce(values, "mean").tolist()))


def _short(value, limit: int = 60) -> str:
    """A prompt or completion as a short line: text as it is; chat messages as 'role: text' (image parts as
    [image]), only the last message where the line is short (the question, not the system prompt)."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        text = " | ".join(_message_line(m) for m in (value[-1:] if limit <= 60 else value))
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message_line(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # multimodal parts
        content = " ".join(
            "[image]"
            if isinstance(part, dict) and part.get("type") == "image"
            else str(part.get("text", ""))
            if isinstance(part, dict)
            else str(part)
            for part in content
        )
    return f"{message['role']}: {content if content is not None else ''}"


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


class TensorBoardTracker:
    module = "tensorboard"

    def __init__(self, output_dir: str, run_name: str, logging_dir: str | None, config: dict):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                f"report_to='tensorboard' needs tensorboard: {install_command('trackers', 'tensorboard')}"
            ) from error
        # transformers 5 reads the directory from TENSORBOARD_LOGGING_DIR (logging_dir is grpokit's older spelling).
        directory = logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR") or str(Path(output_dir) / "runs")
        self.writer = SummaryWriter(os.path.expanduser(directory))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A Markdown table, as TensorBoard text."""
        table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        table += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + " |" for row in rows]
        self.writer.add_text(name, "\n".join(table), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    module = "wandb"

    def __init__(self, output_dir: str, run_name: str, logging_dir: str | None, config: dict):
        try:
            import wandb
        except ImportError as error:
            raise ImportError(f"report_to='wandb' needs wandb: {install_command('trackers', 'wandb')}") from error
        self.wandb = wandb
        self.run = wandb.init(name=run_name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """Where and under which experiment come from mlflow's own environment variables, as with transformers'
    MLflowCallback: MLFLOW_TRACKING_URI (default ./mlruns) and MLFLOW_EXPERIMENT_NAME. A run the caller started is
    logged into and left open; otherwise one is started and ended."""

    module = "mlflow"
    MAX_PARAM_LENGTH = 6000  # mlflow refuses longer parameter values
    PARAMS_PER_CALL = 100  # and more parameters in one call

    def __init__(self, output_dir: str, run_name: str, logging_dir: str | None, config: dict):
        try:
            import mlflow
        except ImportError as error:
            raise ImportError(
                f"report_to='mlflow' needs mlflow: {install_command('trackers', 'mlflow-skinny')}"
            ) from error
        self.mlflow = mlflow
        if os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            mlflow.set_experiment(os.environ["MLFLOW_EXPERIMENT_NAME"])
        self.owns_run = mlflow.active_run() is None
        self.run_id = (mlflow.start_run(run_name=run_name) if self.owns_run else mlflow.active_run()).info.run_id
        params = [(key, str(value)) for key, value in config.items() if len(str(value)) <= self.MAX_PARAM_LENGTH]
        for start in range(0, len(params), self.PARAMS_PER_CALL):
            mlflow.log_params(dict(params[start : start + self.PARAMS_PER_CALL]), run_id=self.run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step, run_id=self.run_id)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        table = {column: [row[index] for row in rows] for index, column in enumerate(columns)}
        self.mlflow.log_table(table, artifact_file=f"{name}/step_{step}.json", run_id=self.run_id)

    def close(self) -> None:
        if self.owns_run:
            self.mlflow.end_run()


class TrackioTracker:
    """Logs to Trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio) under `project`; `trackio
    show` opens the dashboard. Publishing to a Hub Space (trackio_space_id) is not implemented."""

    module = "trackio"

    def __init__(self, output_dir: str, run_name: str, logging_dir: str | None, config: dict):
        try:
            import trackio
        except ImportError as error:
            raise ImportError(f"report_to='trackio' needs trackio: {install_command('trackers', 'trackio')}") from error
        self.trackio = trackio
        trackio.init(project=config.get("project") or "huggingface", name=run_name, config=config, resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        import pandas

        self.trackio.log({name: self.trackio.Table(dataframe=pandas.DataFrame(rows, columns=columns))}, step=step)

    def close(self) -> None:
        self.trackio.finish()


# report_to name -> tracker: built with (output_dir, run_name, logging_dir, config); log, log_table and close.
TRACKERS = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}


class MetricSink:
    """metrics.jsonl (always), the console, and the trackers named in `report_to`. Main process only."""

    def __init__(
        self,
        output_dir: str,
        report_to: list[str],
        run_name: str | None,
        logging_dir: str | None,
        config: dict,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.trackers = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        unknown = [name for name in report_to if name not in TRACKERS]
        if unknown:
            raise ValueError(f"report_to={unknown} is not supported; use some of {list(TRACKERS)}, or 'none'.")
        run_name = run_name or Path(output_dir).name
        self.trackers = [TRACKERS[name](output_dir, run_name, logging_dir, config) for name in report_to]

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
        scalars = {_tracker_key(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(scalars, step)
        if console:
            shown = " ".join(f"{k}={record[k]:.4g}" for k in CONSOLE_KEYS if k in record)
            console_line(f"[step {step}] {shown}")

    def write_completions(self, step: int, samples: list[dict], unique_prompts: bool = False) -> None:
        """Sample completions with their rewards: completions.jsonl, a compact console table, and a table in each
        tracker; `unique_prompts` (TRL's log_unique_prompts): the trackers' table keeps the first row of each
        prompt."""
        if not self.enabled or not samples:
            return
        samples = [self._with_image_files(step, index, sample) for index, sample in enumerate(samples)]
        with open(self.path.parent / "completions.jsonl", "a") as handle:
            for sample in samples:
                handle.write(json.dumps({"step": step, **sample}, default=str) + "\n")
        scored = "reward" in samples[0]  # unscored (on-policy distillation): prompt and completion only, as TRL
        lines = [
            f"  {_short(s['prompt'])!r} -> {_short(s['completion'])!r}"
            + (f"  reward={s['reward']}  advantage={s['advantage']:+.3f}" if scored else "")
            for s in samples
        ]
        console_line(f"[step {step}] completions:\n" + "\n".join(lines))
        columns = ["prompt", "completion", "reward", "advantage"][: 4 if scored else 2]
        if unique_prompts:  # the first row of each prompt; conversations compared by their text, as in TRL
            first = {}
            for sample in samples:
                first.setdefault(str(sample["prompt"]), sample)
            samples = list(first.values())
        rows = [
            [_short(s["prompt"], 200), _short(s["completion"], 200), s.get("reward"), s.get("advantage")][
                : len(columns)
            ]
            for s in samples
        ]
        for tracker in self.trackers:
            tracker.log_table("completions", columns, rows, step)

    def _with_image_files(self, step: int, index: int, sample: dict) -> dict:
        """A sample's prompt images (log_multimodal) written as PNG files under completion_images/, the sample
        holding their paths relative to the output directory (what `grpokit report` shows)."""
        if not sample.get("images"):
            return sample
        folder = self.path.parent / "completion_images"
        folder.mkdir(exist_ok=True)
        paths = []
        for number, image in enumerate(sample["images"]):
            name = f"step{step:06d}_{index:03d}_{number}.png"
            image.save(folder / name)
            paths.append(f"completion_images/{name}")
        return {**sample, "images": paths}

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def train_summary(args, state, steps: int, num_processes: int, runtime: float, losses: list[float]) -> dict:
    """transformers' end-of-training record: the speed of a train() call's `steps` (`runtime` seconds, on
    `num_processes` processes), the mean of their `losses` (train_loss), and the run's FLOPs, epoch and step."""
    samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes
    train_loss = sum(losses) / len(losses) if losses else 0.0
    return {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(samples / runtime, 3),
        "train_steps_per_second": round(steps / runtime, 3),
        "total_flos": float(state.total_flos),
        "train_loss": train_loss,
        "epoch": round(state.epoch, 4),
        "step": state.global_step,
    }


def evaluation_line(record: dict) -> str:
    """An evaluation record's reward and pass@k, for the console."""
    shown = [f"{k.removeprefix('eval/')}={v:.4g}" for k, v in record.items() if k == "eval/reward" or "/pass@" in k]
    return " ".join(shown)


def console_line(text: str) -> None:
    """A line for the console (stderr) printed through tqdm, which clears a progress bar first and draws it again
    after, so that the line is not glued onto the bar."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stderr)
    sys.stderr.flush()
