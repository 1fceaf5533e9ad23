"""Offline report for GRPO training runs: plots + one self-contained HTML page.

Usage (the CLI wires ``grpokit report OUTPUT_DIR [OUTPUT_DIR ...]`` to this)::

    from grpokit.report import load_run, plot_metrics, write_report
    html_path = write_report(["runs/a", "runs/b"])

Everything here must work while a run is still writing its files, so every
reader is tolerant: missing files, missing keys and a half-written last line
are expected, not errors.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# Figure + explicit Agg canvas instead of pyplot: no global backend switch,
# no GUI, and no figure registry that leaks memory across many plots.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .config import GRPOConfig, _default_of

__all__ = ["Run", "collect_series", "load_run", "plot_metrics", "write_report"]


@dataclass
class Run:
    name: str
    metrics: list[dict] = field(default_factory=list)
    completions: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    path: Path | None = None
    # True when metrics.jsonl ended in an unparsable line: the run is most
    # likely still being written.
    partial: bool = False
    # The built-in demo's demo_results.json: held-out accuracy before and after GRPO ({} for other runs).
    heldout: dict = field(default_factory=dict)


def _read_jsonl(path: Path) -> tuple[list[dict], bool]:
    """Return (records, last_line_was_broken). Missing file -> ([], False)."""
    if not path.is_file():
        return [], False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records, broken_last = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            # Last line: the writer is mid-line, the next report will have it.
            # Elsewhere (e.g. a crash mid-write, then a resume): skip, a report beats a traceback.
            broken_last = i == len(lines) - 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
    return records, broken_last


def reward_trend(log_history: list[dict]) -> str:
    """The reward's trend from a trainer's `state.log_history` (or metrics.jsonl's records), honest on noisy short
    runs: the mean over the first and over the last fifth of the training records that have a reward (at least one
    each), e.g. 'mean reward 0.121 over steps 1-12 -> 0.140 over steps 49-60'. The last record of a finished run is
    the summary (train_loss, train_runtime, ...), which has none."""
    records = [r for r in log_history if isinstance(r.get("reward"), (int, float))]
    if not records:
        return "no reward logged"
    if len(records) == 1:
        return f"reward {records[0]['reward']:.3f} at step {records[0].get('step')} (one logged step)"
    fifth = max(1, len(records) // 5)

    def mean(part: list[dict]) -> str:
        first, last = part[0].get("step"), part[-1].get("step")
        steps = f"step {first}" if len(part) == 1 else f"steps {first}-{last}"
        return f"{sum(r['reward'] for r in part) / len(part):.3f} over {steps}"

    return f"mean reward {mean(records[:fifth])} -> {mean(records[-fifth:])}"


# The run's configuration, as each trainer names it (GRPOTrainer and RLOOTrainer, DistillationTrainer).
CONFIG_FILES = ("grpo_config.json", "distillation_config.json")
RUN_FILES = ("metrics.jsonl", "completions.jsonl", *CONFIG_FILES)
HELDOUT_FILE = "demo_results.json"  # written by the built-in demo (grpokit.demo)


def holds_a_run(output_dir: str | Path) -> bool:
    """Whether a folder is a training run's output_dir (one of the files a run writes is there)."""
    return any((Path(output_dir) / name).is_file() for name in RUN_FILES)


def load_run(output_dir: str | Path) -> Run:
    """Load metrics.jsonl, completions.jsonl and the run's configuration (all optional)."""
    path = Path(output_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"not a run directory: {path}")
    metrics, partial = _read_jsonl(path / "metrics.jsonl")
    completions, _ = _read_jsonl(path / "completions.jsonl")
    config: dict = {}
    cfg_path = next((path / name for name in CONFIG_FILES if (path / name).is_file()), None)
    if cfg_path is not None:
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except json.JSONDecodeError:
            config = {}  # being rewritten right now; a report without it beats a crash
    name = path.resolve().name or str(path)
    heldout: dict = {}
    if (path / HELDOUT_FILE).is_file():
        try:
            heldout = json.loads((path / HELDOUT_FILE).read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            heldout = {}
    return Run(name, metrics, completions, config, path, partial, heldout)


# --- plotting -----------------------------------------------------------------

# (file stem, title, subplots); each subplot is a list of full-match key regexes,
# in legend order (a key matched by several patterns appears once, at the first).
# Keys that share a scale share an axes; differently-scaled ones get their own.
PANELS: list[tuple[str, str, list[list[str]]]] = [
    ("reward", "Reward", [[r"reward", r"rewards/.+/mean", r"eval/reward", r"eval/rewards/.+/mean"]]),
    ("reward_std", "Reward spread", [[r"reward_std"], [r"frac_reward_zero_std"]]),
    ("kl", "KL divergence", [[r"kl", r"eval/kl"]]),
    ("entropy", "Entropy", [[r"entropy", r"eval/entropy"]]),
    ("clip_ratio", "Clip ratios", [[r"clip_ratio(/.+)?"]]),
    (
        "completion_length",
        "Completion length",
        [
            [
                r"completions/mean_length",
                r"completions/min_length",
                r"completions/max_length",
                r"completions/.*_length",
            ],
            [r"completions/clipped_ratio"],
        ],
    ),
    ("learning_rate", "Learning rate", [[r"learning_rate"]]),
    ("grad_norm", "Grad norm", [[r"grad_norm"]]),
    ("step_time", "Step time (s)", [[r"step_time"]]),
]


class Series(NamedTuple):
    label: str  # legend label; carries the run name when several runs are overlaid
    key: str  # metric key in metrics.jsonl
    run: int  # index into the runs list
    xs: list[float]  # steps
    ys: list[float]


def _num(v) -> float | None:
    # bool is an int subclass but never a metric; NaN/inf would break min/max.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _display_names(runs: list[Run]) -> list[str]:
    """Directory names, disambiguated by parent dir when two runs share one."""
    names = [r.name for r in runs]
    if len(set(names)) == len(names):
        return names
    return [f"{r.path.resolve().parent.name}/{r.name}" if r.path else r.name for r in runs]


def _series(run: Run, key: str) -> tuple[list[float], list[float]]:
    """A metric's (steps, values). A terminated-length metric has no point where no completion terminated (it is
    logged as 0 there, as TRL does, but 0 is not a length any completion had)."""
    xs, ys = [], []
    terminated = "terminated_length" in key
    for i, rec in enumerate(run.metrics):
        y = _num(rec.get(key))
        if y is None or (terminated and _num(rec.get("completions/clipped_ratio")) == 1.0):
            continue
        x = _num(rec.get("step"))
        xs.append(x if x is not None else float(i))
        ys.append(y)
    return xs, ys


def _all_zero(subplots: list[list[Series]]) -> bool:
    return all(y == 0 for series in subplots for s in series for y in s.ys)


def all_zero_panels(runs: list[Run]) -> list[str]:
    """The titles of the panels whose every logged value is 0 (no token clipped, say): not drawn, but named."""
    titles = {stem: title for stem, title, _ in PANELS}
    return [titles[stem] for stem, subplots in _collect(runs).items() if _all_zero(subplots)]


# Panels whose flat line says nothing a number does not (a constant learning rate): not drawn when flat, but named
# with their value.
FLAT_NOT_DRAWN = ("learning_rate",)


def _flat_value(subplots: list[list[Series]]) -> float | None:
    """The one value of every series, when they have one (to float rounding: a scheduler's constant 1e-3 is
    logged as 0.001 and 0.0010000000000000002); None otherwise."""
    values = [y for series in subplots for s in series for y in s.ys]
    if not values or max(values) - min(values) > 1e-6 * max(abs(v) for v in values):
        return None
    return values[0]


def flat_panels(runs: list[Run]) -> dict[str, float]:
    """Title -> value of the FLAT_NOT_DRAWN panels whose every logged value is one number: not drawn, but named."""
    titles = {stem: title for stem, title, _ in PANELS}
    found = {stem: _flat_value(subplots) for stem, subplots in _collect(runs).items() if stem in FLAT_NOT_DRAWN}
    return {titles[stem]: value for stem, value in found.items() if value is not None}


def collect_series(runs: list[Run]) -> dict[str, list[list[Series]]]:
    """Panel stem -> subplots -> series, only for data that exists and panels not all zero (nor flat, for those of
    FLAT_NOT_DRAWN).

    Separated from drawing so tests (and callers) can inspect what a plot
    will show, including the legend labels, without parsing images.
    """
    return {
        stem: subplots
        for stem, subplots in _collect(runs).items()
        if not _all_zero(subplots) and not (stem in FLAT_NOT_DRAWN and _flat_value(subplots) is not None)
    }


def _collect(runs: list[Run]) -> dict[str, list[list[Series]]]:
    names = _display_names(runs)
    multi = len(runs) > 1
    out: dict[str, list[list[Series]]] = {}
    for stem, _title, subplots in PANELS:
        filled = []
        for patterns in subplots:
            series: list[Series] = []
            for ri, (run, rname) in enumerate(zip(runs, names)):
                keys = sorted({k for rec in run.metrics for k in rec})
                seen: set[str] = set()
                for pat in patterns:
                    for key in (k for k in keys if k not in seen and re.fullmatch(pat, k)):
                        seen.add(key)
                        xs, ys = _series(run, key)
                        if ys:
                            series.append(Series(f"{rname}: {key}" if multi else key, key, ri, xs, ys))
            if series:
                filled.append(series)
        if filled:
            out[stem] = filled
    return out


def smoothed(ys: list[float]) -> list[float]:
    """A centred moving average, without the lag of an exponential one: each point is the mean of the points within
    a half-width of it (a tenth of the series, at least 1), the window narrowing near the ends so that the first and
    last points are their own values (an EMA drew a last entropy of 0 near 0.4 on a short run).

    >>> smoothed([0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0])
    [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 6.0]
    """
    half = max(1, len(ys) // 10)
    out = []
    for i in range(len(ys)):
        reach = min(half, i, len(ys) - 1 - i)
        window = ys[i - reach : i + reach + 1]
        out.append(sum(window) / len(window))
    return out


_LINESTYLES = ["-", "--", ":", "-."]


def plot_metrics(runs: list[Run] | Run, out_dir: str | Path) -> list[Path]:
    """Write one PNG per panel that has data; return their paths in panel order."""
    runs = [runs] if isinstance(runs, Run) else list(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    titles = {stem: title for stem, title, _ in PANELS}
    paths = []
    for stem, subplots in collect_series(runs).items():
        # Long legends go below the axes (see below); make the figure taller to keep the plot size.
        rows = max((len(series) + 1) // 2 if len(series) > 4 else 0 for series in subplots)
        fig = Figure(figsize=(6.4 * len(subplots), 3.8 + 0.25 * rows), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        fig.suptitle(titles[stem])
        for ax, series in zip(fig.subplots(1, len(subplots), squeeze=False)[0], subplots):
            keys = list(dict.fromkeys(s.key for s in series))
            for s in series:
                # Colour = metric and line style = run, so one metric is easy to follow
                # across runs; with a single metric, colour the runs apart instead.
                cidx = keys.index(s.key) if len(keys) > 1 else s.run
                style = {"color": f"C{cidx % 10}", "linestyle": _LINESTYLES[s.run % len(_LINESTYLES)]}
                if len(s.ys) >= 10:  # raw stays visible underneath the smoothed curve
                    ax.plot(s.xs, s.ys, alpha=0.3, linewidth=0.8, **style)
                    ax.plot(s.xs, smoothed(s.ys), linewidth=1.6, label=s.label, **style)
                else:
                    ax.plot(s.xs, s.ys, marker="o", markersize=3, label=s.label, **style)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            if len(series) > 4:  # a long legend inside the axes would hide the curves
                # Two columns: when two runs log the same keys, each column is one run.
                ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
            else:
                ax.legend(fontsize="small")
        path = out_dir / f"{stem}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


# --- HTML ---------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1400px;
 padding:1.5em;color:#222;background:#fafafa}
h1{margin-bottom:.2em} h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
.muted{color:#777;font-size:.9em} .warn{color:#a60}
table{border-collapse:collapse;margin:.5em 0;background:#fff;font-size:.9em}
th,td{border:1px solid #ddd;padding:.3em .7em;text-align:left;vertical-align:top}
th{background:#f0f0f0} tr.diff td{background:#fff6d6} td.num{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:flex;flex-wrap:wrap;gap:1em}
figure{margin:0;background:#fff;border:1px solid #ddd;padding:.5em;max-width:100%}
figure img{max-width:100%;height:auto;display:block}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:.8em}
.prompt-image{width:64px;height:64px;image-rendering:pixelated;border:1px solid #ccc;margin-right:.3em}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6em .9em;min-width:0}
pre{white-space:pre-wrap;word-break:break-word;background:#f5f5f5;padding:.5em;margin:.3em 0;
 max-height:22em;overflow:auto;font-size:.85em}
.label{font-weight:600;font-size:.85em;color:#555}
"""

_MAX_CHARS = 4000  # per prompt/completion, so one runaway sample can't bloat the page


def _esc(v) -> str:
    return html.escape(str(v), quote=True)


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def _message_text(message: dict) -> str:
    """'role: content', with an agent's tool calls (→ name(arguments)) and the tool a result came from."""
    name = f" ({message['name']})" if message.get("role") == "tool" and message.get("name") else ""
    text = f"{message.get('role', '?')}{name}: {message['content']}"
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        text += (
            f"\n  → {function.get('name')}({json.dumps(function.get('arguments'), ensure_ascii=False, default=str)})"
        )
    return text


def _text(v) -> str:
    """Prompt/completion as plain text; chat-format message lists become 'role: content'."""
    if isinstance(v, list) and all(isinstance(m, dict) and "content" in m for m in v):
        s = "\n".join(_message_text(m) for m in v)
    else:
        s = v if isinstance(v, str) else json.dumps(v, indent=1, ensure_ascii=False)
    if len(s) > _MAX_CHARS:
        s = s[:_MAX_CHARS] + f"\n… [{len(s) - _MAX_CHARS} more characters]"
    return s


def summarize(run: Run) -> dict:
    """first/last/best reward and step counts, from the lines that have them."""
    xs, ys = _series(run, "reward")
    steps = [s for s in (_num(r.get("step")) for r in run.metrics) if s is not None]
    summary = {
        "log_lines": len(run.metrics),
        "last_step": int(max(steps)) if steps else None,
        "first_reward": None,
        "last_reward": None,
        "best_reward": None,
        "best_step": None,
    }
    if ys:
        best = max(range(len(ys)), key=ys.__getitem__)
        summary.update(first_reward=ys[0], last_reward=ys[-1], best_reward=ys[best], best_step=int(xs[best]))
    return summary


def _summary_html(runs: list[Run], names: list[str]) -> str:
    cols = [
        ("log_lines", "logged lines"),
        ("last_step", "last step"),
        ("first_reward", "first reward"),
        ("last_reward", "last reward"),
        ("best_reward", "best reward"),
        ("best_step", "best at step"),
    ]
    head = "".join(f"<th>{_esc(c)}</th>" for _, c in cols)
    rows = []
    for run, name in zip(runs, names):
        s = summarize(run)
        cells = "".join(f'<td class="num">{_esc(_fmt(s[k]))}</td>' for k, _ in cols)
        note = ' <span class="warn">(in progress?)</span>' if run.partial else ""
        rows.append(f"<tr><td>{_esc(name)}{note}</td>{cells}</tr>")
    return f"<table><tr><th>run</th>{head}</tr>{''.join(rows)}</table>"


def config_rows(runs: list[Run]) -> tuple[list[str], int]:
    """The configuration keys worth a row, and how many others there are: with several runs, those whose values
    differ between them; with one, those it sets to other than GRPOConfig's default (~200 rows hide the few that
    explain a run)."""
    keys = sorted({k for r in runs for k in r.config})
    if len(runs) > 1:
        shown = [k for k in keys if len({_fmt(r.config.get(k)) if k in r.config else "" for r in runs}) > 1]
    else:
        fields = GRPOConfig.__dataclass_fields__
        shown = [k for k in keys if k not in fields or _fmt(runs[0].config[k]) != _fmt(_default_of(k))]
    return shown, len(keys) - len(shown)


def _config_html(runs: list[Run], names: list[str]) -> str:
    if not any(r.config for r in runs):
        return '<p class="muted">No configuration file (grpo_config.json) found.</p>'
    keys, others = config_rows(runs)
    head = "".join(f"<th>{_esc(n)}</th>" for n in names)
    rows = []
    for k in keys:
        vals = [_fmt(r.config.get(k)) if k in r.config else "" for r in runs]
        rows.append(f"<tr><td>{_esc(k)}</td>" + "".join(f"<td>{_esc(v)}</td>" for v in vals) + "</tr>")
    rest = "the same in every run" if len(runs) > 1 else "at GRPOConfig's defaults"
    note = f'<p class="muted">{others} other field(s) {rest}: the run\'s configuration file has them all.</p>'
    if not rows:
        return note
    return f"<table><tr><th>key</th>{head}</tr>{''.join(rows)}</table>{note}"


def _images_html(c: dict, run_path: Path | None) -> str:
    """The prompt's images a completions record names (log_multimodal), embedded; missing files are named."""
    parts = []
    for name in c.get("images") or []:
        path = None if run_path is None else Path(run_path) / str(name)
        if path is not None and path.is_file():
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append(f'<img class="prompt-image" alt="{_esc(name)}" src="data:image/png;base64,{data}">')
        else:
            parts.append(f'<span class="muted">(image {_esc(name)} not found)</span>')
    return f'<div class="label">images</div><div>{"".join(parts)}</div>' if parts else ""


def _completion_card(c: dict, run_path: Path | None = None) -> str:
    rewards = c.get("rewards") if isinstance(c.get("rewards"), dict) else {}
    cells = "".join(f"<th>{_esc(k)}</th>" for k in rewards) + "<th>reward</th><th>advantage</th>"
    vals = "".join(f'<td class="num">{_esc(_fmt(v))}</td>' for v in rewards.values())
    vals += f'<td class="num">{_esc(_fmt(c.get("reward")))}</td><td class="num">{_esc(_fmt(c.get("advantage")))}</td>'
    return (
        f'<div class="card">{_images_html(c, run_path)}'
        f'<div class="label">prompt</div><pre>{_esc(_text(c.get("prompt", "")))}</pre>'
        f'<div class="label">completion</div><pre>{_esc(_text(c.get("completion", "")))}</pre>'
        f"<table><tr>{cells}</tr><tr>{vals}</tr></table></div>"
    )


def _samples_html(run: Run, per_step: int) -> str:
    by_step: dict = {}
    for c in run.completions:
        by_step.setdefault(c.get("step"), []).append(c)
    if not by_step:
        return '<p class="muted">No completions.jsonl found.</p>'
    steps = list(by_step)  # file order = logging order; avoids comparing None with ints
    picked = [(steps[0], "early")] + ([(steps[-1], "late")] if len(steps) > 1 else [])
    parts = []
    for step, when in picked:
        items = by_step[step]
        shown = f"showing {min(per_step, len(items))} of {len(items)}"
        parts.append(f'<h3>{when}: step {_esc(_fmt(step))} <span class="muted">({shown})</span></h3>')
        parts.append(
            '<div class="cards">' + "".join(_completion_card(c, run.path) for c in items[:per_step]) + "</div>"
        )
    return "".join(parts)


def _heldout_html(runs: list[Run], names: list[str]) -> str:
    """The built-in demo's held-out accuracy before and after GRPO, for the runs that have it ('' for none)."""
    rows = [
        f'<tr><td>{_esc(name)}</td><td class="num">{run.heldout.get("accuracy_before", 0):.0%}</td>'
        f'<td class="num">{run.heldout.get("accuracy_after", 0):.0%}</td>'
        f'<td class="num">{_esc(_fmt(run.heldout.get("grpo_steps")))}</td></tr>'
        for run, name in zip(runs, names)
        if "accuracy_before" in run.heldout and "accuracy_after" in run.heldout
    ]
    if not rows:
        return ""
    measure = next(r.heldout.get("heldout_accuracy_measures", "") for r in runs if r.heldout)
    return (
        "<h2>Held-out accuracy</h2><table><tr><th>run</th><th>before GRPO</th><th>after GRPO</th>"
        f'<th>GRPO steps</th></tr>{"".join(rows)}</table><p class="muted">{_esc(measure)}.</p>'
    )


def _all_samples_html(runs: list[Run], names: list[str], per_step: int) -> str:
    """Sample completions of each run that logged some; one line when none did (log_completions was off)."""
    if not any(r.completions for r in runs):
        return (
            '<p class="muted">No sample completions: the run did not log them (log_completions=True writes '
            "completions.jsonl, shown here).</p>"
        )
    return "".join(
        (f"<h2>Sample completions — {_esc(n)}</h2>" if len(runs) > 1 else "<h2>Sample completions</h2>")
        + _samples_html(r, per_step)
        for r, n in zip(runs, names)
        if r.completions
    )


def write_report(
    output_dirs: list[str | Path] | str | Path, out: Path | None = None, samples_per_step: int = 4
) -> Path:
    """Write PNG plots and a self-contained ``report.html`` into ``out``; return the HTML path.

    ``out`` defaults to ``<first output_dir>/report/``. Several dirs = overlaid comparison.
    """
    output_dirs = [output_dirs] if isinstance(output_dirs, (str, Path)) else list(output_dirs)
    runs = [load_run(d) for d in output_dirs]
    if not runs:
        raise ValueError("write_report needs at least one output directory")
    out = Path(out) if out is not None else Path(output_dirs[0]) / "report"
    pngs = plot_metrics(runs, out)
    names = _display_names(runs)
    titles = {stem: title for stem, title, _ in PANELS}

    figures = []
    for p in pngs:
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        figures.append(
            f'<figure><img alt="{_esc(titles.get(p.stem, p.stem))}" src="data:image/png;base64,{data}"></figure>'
        )
    plots = f'<div class="plots">{"".join(figures)}</div>' if figures else '<p class="muted">No metrics logged yet.</p>'
    zero = all_zero_panels(runs)
    if zero:
        plots += f'<p class="muted">Not drawn, every value 0: {_esc(", ".join(zero))}.</p>'
    flat = flat_panels(runs)
    if flat:
        shown = ", ".join(f"{title} (constant at {value:.4g})" for title, value in flat.items())
        plots += f'<p class="muted">Not drawn, the same value at every step: {_esc(shown)}.</p>'

    title = "GRPO report: " + " vs ".join(names)
    now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    samples = _all_samples_html(runs, names, samples_per_step)
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f"<h1>{_esc(title)}</h1>"
        f'<p class="muted">Generated {now} from: {_esc(", ".join(str(d) for d in output_dirs))}</p>'
        f"<h2>Summary</h2>{_summary_html(runs, names)}{_heldout_html(runs, names)}"
        f"<h2>Metrics</h2>{plots}"
        f"<h2>Configuration</h2>{_config_html(runs, names)}"
        f"{samples}</body></html>\n"
    )
    # Write-then-rename: a report regenerated during training is never seen half-written.
    html_path = out / "report.html"
    tmp = html_path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(html_path)
    return html_path
