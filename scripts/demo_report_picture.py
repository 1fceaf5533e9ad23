"""Draw the README's picture of the built-in demo (docs/demo_report.png) from a demo run's folder.

    grpokit train                                   # the Quick start's demo, into grpo-demo/
    python scripts/demo_report_picture.py grpo-demo  # writes docs/demo_report.png

The picture shows the report's main plots (`grpokit report`'s series, smoothed the same way) under a title that
gives the held-out accuracy before and after GRPO from the run's demo_results.json. The title is also stored in the
PNG as its Description, and the README and Getting started quote it in their captions (tests/test_docs.py checks
that they agree). Nothing in it names a local path.
"""

import argparse
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from grpokit.report import collect_series, load_run, smoothed

ROOT = Path(__file__).resolve().parents[1]
PANELS = (  # (report panel stem, subplot index, title)
    ("reward", 0, "Reward (weighted sum) and each reward's mean"),
    ("reward_std", 1, "Share of groups with no reward spread"),
    ("completion_length", 0, "Completion length (tokens)"),
)


def caption(heldout: dict) -> str:
    return (
        f"held-out accuracy went from {heldout['accuracy_before']:.0%} before GRPO to "
        f"{heldout['accuracy_after']:.0%} after {heldout['grpo_steps']} GRPO steps"
    )


def draw(run_dir: Path, out: Path) -> str:
    run = load_run(run_dir)
    if not run.heldout:
        raise SystemExit(f"{run_dir} has no demo_results.json: give the output_dir of `grpokit train` (the demo).")
    panels = collect_series([run])
    text = caption(run.heldout)
    fig = Figure(figsize=(13, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"grpokit's built-in demo: {text}", fontsize=13)
    for ax, (stem, index, title) in zip(fig.subplots(1, len(PANELS)), PANELS):
        for number, series in enumerate(panels[stem][index]):
            ax.plot(series.xs, series.ys, color=f"C{number}", alpha=0.3, linewidth=0.8)
            ax.plot(series.xs, smoothed(series.ys), color=f"C{number}", linewidth=1.6, label=series.key)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("GRPO step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out, metadata={"Title": "The built-in demo's run", "Description": text})
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="The demo's output_dir (grpo-demo).")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "demo_report.png")
    options = parser.parse_args()
    print(f"Wrote {options.out}: {draw(options.run_dir, options.out)}")
