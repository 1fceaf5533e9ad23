"""Tests for grpokit.report: loading a (possibly in-progress) run dir, plots, HTML."""

import json
import subprocess
from pathlib import Path

import pytest

from grpokit.report import collect_series, load_run, plot_metrics, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REWARDS = [0.1, 0.5, 0.3, 0.9, 0.7]  # first 0.1, last 0.7, best 0.9 at step 4
SCRIPT = '<script>alert("pwned")</script>'


def make_run(root: Path, name: str = "run_a", rewards=REWARDS, truncated: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    lines = []
    for i, r in enumerate(rewards, 1):
        # Deliberately no "kl" (beta=0) and no "entropy": those panels must not appear.
        lines.append(
            {
                "step": i,
                "reward": r,
                "reward_std": 0.3,
                "rewards/exact_match/mean": r,
                "rewards/format/mean": 1.0,
                "frac_reward_zero_std": 0.25,
                "clip_ratio/region_mean": 0.01,
                "completions/mean_length": 7.5 + i,
                "completions/min_length": 3,
                "completions/max_length": 16,
                "completions/clipped_ratio": 0.1,
                "learning_rate": 1e-5,
                "grad_norm": 0.8,
                "step_time": 0.31,
            }
        )
    lines.insert(3, {"step": 3, "eval/reward": 0.55})  # eval-only line: every other key missing
    text = "".join(json.dumps(rec) + "\n" for rec in lines)
    if truncated:
        text += '{"step": 6, "reward": 0.'  # writer killed / still writing mid-line
    (d / "metrics.jsonl").write_text(text)
    comps = []
    for step, tag in [(1, "EARLY"), (3, "MIDDLE"), (5, "LATE")]:
        for k in range(2):
            comps.append(
                {
                    "step": step,
                    "prompt": f"{tag} prompt {k} {SCRIPT} & more",
                    "completion": f"{tag} completion {k}",
                    "rewards": {"exact_match": 1.0, "format": None},
                    "reward": 1.0,
                    "advantage": 0.7 if k else -0.7,
                }
            )
    (d / "completions.jsonl").write_text("".join(json.dumps(c) + "\n" for c in comps))
    (d / "grpo_config.json").write_text(
        json.dumps({"model_name_or_path": "tiny-test-model", "beta": 0.0, "num_generations": 8, "loss_type": "dr_grpo"})
    )
    return d


def test_load_run_tolerates_truncated_last_line(tmp_path):
    run = load_run(make_run(tmp_path))
    assert run.name == "run_a"
    assert len(run.metrics) == 6  # 5 training lines + 1 eval line; broken tail dropped
    assert run.partial is True
    assert len(run.completions) == 6
    assert run.config["num_generations"] == 8
    assert load_run(make_run(tmp_path, "done", truncated=False)).partial is False


def test_load_run_missing_files_and_bad_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    run = load_run(tmp_path / "empty")
    assert (run.metrics, run.completions, run.config) == ([], [], {})
    with pytest.raises(FileNotFoundError):
        load_run(tmp_path / "nope")


def test_corrupt_middle_line_is_skipped(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward": 1}\nGARBAGE\n{"step": 2, "reward": 2}\n')
    run = load_run(d)
    assert [m["reward"] for m in run.metrics] == [1, 2]
    assert run.partial is False


def test_plot_metrics_writes_valid_pngs_only_for_present_metrics(tmp_path):
    paths = plot_metrics([load_run(make_run(tmp_path))], tmp_path / "plots")
    names = {p.name for p in paths}
    assert names == {
        "reward.png",
        "reward_std.png",
        "clip_ratio.png",
        "completion_length.png",
        "grad_norm.png",
        "step_time.png",
    }
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, p
    assert not (tmp_path / "plots" / "kl.png").exists()
    assert not (tmp_path / "plots" / "learning_rate.png").exists()  # constant: named in the page, not drawn
    assert not (tmp_path / "plots" / "entropy.png").exists()


def test_collect_series_values_and_sparse_keys(tmp_path):
    panels = collect_series([load_run(make_run(tmp_path))])
    reward = {s.label: s for s in panels["reward"][0]}
    assert list(reward) == ["reward", "rewards/exact_match/mean", "rewards/format/mean", "eval/reward"]
    assert reward["reward"].xs == [1, 2, 3, 4, 5] and reward["reward"].ys == REWARDS
    assert reward["eval/reward"].xs == [3] and reward["eval/reward"].ys == [0.55]
    # Differently-scaled metrics of one panel land in separate subplots.
    assert [[s.key for s in sub] for sub in panels["reward_std"]] == [["reward_std"], ["frac_reward_zero_std"]]
    assert "kl" not in panels and "entropy" not in panels


def test_overlay_two_runs_labels_both(tmp_path):
    a = load_run(make_run(tmp_path, "run_a"))
    b = load_run(make_run(tmp_path, "run_b", rewards=[0.2, 0.4]))
    panels = collect_series([a, b])
    labels = [s.label for s in panels["reward"][0]]
    assert "run_a: reward" in labels and "run_b: reward" in labels
    assert {s.run for s in panels["reward"][0]} == {0, 1}
    paths = plot_metrics([a, b], tmp_path / "cmp")
    assert (tmp_path / "cmp" / "reward.png") in paths


def test_same_dir_names_are_disambiguated(tmp_path):
    a = load_run(make_run(tmp_path / "exp1", "out"))
    b = load_run(make_run(tmp_path / "exp2", "out"))
    labels = [s.label for s in collect_series([a, b])["reward"][0]]
    assert "exp1/out: reward" in labels and "exp2/out: reward" in labels


def test_write_report_html(tmp_path):
    run_dir = make_run(tmp_path)
    html_path = write_report([run_dir])
    assert html_path == run_dir / "report" / "report.html"
    assert (run_dir / "report" / "reward.png").is_file()
    page = html_path.read_text()
    # The configuration: what differs from GRPOConfig's defaults (num_generations=8 and beta=0.0 are its defaults).
    config = page.split("<h2>Configuration</h2>")[1].split("<h2>")[0]
    for value in ("tiny-test-model", "loss_type", "dr_grpo", "2 other field(s) at GRPOConfig's defaults"):
        assert value in config
    assert "num_generations" not in config and "beta" not in config
    # All text escaped; the page has no script and no external resources.
    assert SCRIPT not in page and "<script" not in page
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt; &amp; more" in page
    assert 'src="http' not in page and "<link" not in page
    assert page.count('src="data:image/png;base64,') == 6
    assert "Learning rate (constant at 1e-05)" in page
    # Early and late completions shown, the middle step is not.
    assert "EARLY prompt 0" in page and "EARLY completion 1" in page
    assert "LATE prompt 1" in page and "LATE completion 0" in page
    assert "MIDDLE" not in page
    assert "-0.7" in page and "exact_match" in page
    # Summary: logged lines, last step, first/last/best reward, best step.
    summary = page.split("<h2>Summary</h2>")[1].split("<h2>")[0]
    cells = [c.split("</td>")[0] for c in summary.split('<td class="num">')[1:]]
    assert cells == ["6", "5", "0.1", "0.7", "0.9", "4"]
    assert "in progress" in summary


def test_write_report_comparison_and_empty_run(tmp_path):
    a, b = make_run(tmp_path, "run_a"), make_run(tmp_path, "run_b", truncated=False)
    (tmp_path / "fresh").mkdir()  # a run that has not logged anything yet
    html_path = write_report([a, b, tmp_path / "fresh"], out=tmp_path / "out")
    assert html_path == tmp_path / "out" / "report.html"
    page = html_path.read_text()
    assert "GRPO report: run_a vs run_b vs fresh" in page
    assert "Sample completions — run_b" in page
    assert "Sample completions — fresh" not in page  # a run with no completions has no empty section

    only_fresh = write_report([tmp_path / "fresh"])
    assert "No metrics logged yet." in only_fresh.read_text()


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian package chromium")
def test_html_renders_in_headless_chromium(tmp_path):
    html_path = write_report([make_run(tmp_path, "run_a"), make_run(tmp_path, "run_b")], out=tmp_path / "out")
    shot = tmp_path / "shot.png"
    common = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    url = html_path.as_uri()
    dom = subprocess.run([*common, "--dump-dom", url], check=False, capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<title>GRPO report: run_a vs run_b</title>" in dom.stdout
    assert dom.stdout.count("<img") == 6
    # Check that every embedded PNG actually decodes: a copy of the page (the report itself
    # has no JS) counts the loaded images into a DOM attribute that --dump-dom shows.
    probe = tmp_path / "probe.html"
    probe.write_text(
        html_path.read_text().replace(
            "</body>",
            (
                "<script>window.onload=()=>{document.body.dataset.ok=[...document.images]"
                ".filter(i=>i.complete&&i.naturalWidth>300).length}</script></body>"
            ),
        )
    )
    dom = subprocess.run(
        [*common, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert 'data-ok="7"' in dom.stdout, dom.stdout[:300]
    res = subprocess.run(
        [*common, "--window-size=1400,3000", f"--screenshot={shot}", url],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000  # a blank page is a few KB


def test_reward_trend_skips_the_summary_record():
    from grpokit.report import reward_trend

    history = [
        {"step": 1, "reward": 0.25},
        {"step": 5, "reward": 0.5, "eval/reward": 0.4},
        {"step": 5, "train_loss": 0.1, "train_runtime": 3.0},
    ]  # the last record of a finished run
    assert reward_trend(history) == "mean reward 0.250 over step 1 -> 0.500 over step 5"
    assert reward_trend([{"train_loss": 0.1}]) == "no reward logged"
    assert reward_trend(history[:1]) == "reward 0.250 at step 1 (one logged step)"
    # a noisy run: the first and last fifths' means, not one step each (0.0 at step 1 said nothing of the trend)
    noisy = [{"step": s, "reward": r} for s, r in enumerate([0.0, 0.2, 0.1, 0.15, 0.1, 0.12, 0.14, 0.11, 0.13, 0.3], 1)]
    assert reward_trend(noisy) == "mean reward 0.100 over steps 1-2 -> 0.215 over steps 9-10"


def test_short_runs_are_drawn_honestly(tmp_path):
    """A short run: the smoothed line ends on the last value (no lag), an all-zero panel is named, not drawn, a
    terminated length is not drawn as 0 where no completion terminated, and a comparison's configuration table holds
    only what differs between the runs."""
    from grpokit.report import collect_series, config_rows, load_run, smoothed

    d = tmp_path / "short"
    d.mkdir()
    records = [
        {
            "step": step,
            "entropy": 0.4 * (10 - step) / 9,
            "clip_ratio/region_mean": 0.0,
            "completions/mean_terminated_length": 0.0 if step < 3 else 5.0,
            "completions/clipped_ratio": 1.0 if step < 3 else 0.5,
        }
        for step in range(1, 11)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = load_run(d)
    entropy = [r["entropy"] for r in records]
    assert smoothed(entropy)[-1] == entropy[-1] == 0.0 and smoothed(entropy)[0] == entropy[0]
    assert smoothed(entropy)[4] == pytest.approx(sum(entropy[3:6]) / 3, abs=1e-12)
    series = collect_series([run])
    assert "clip_ratio" not in series
    (lengths,) = [s for sub in series["completion_length"] for s in sub if s.key.endswith("terminated_length")]
    assert lengths.xs == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0] and set(lengths.ys) == {5.0}
    page = write_report([d]).read_text()
    assert "Not drawn, every value 0: Clip ratios." in page
    # a comparison: the rows are the keys whose values differ
    (d / "grpo_config.json").write_text(json.dumps({"beta": 0.0, "learning_rate": 1e-5, "seed": 1}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "grpo_config.json").write_text(json.dumps({"beta": 0.04, "learning_rate": 1e-5, "seed": 1}))
    assert config_rows([load_run(d), load_run(other)]) == (["beta"], 2)
    assert config_rows([load_run(d)]) == (["learning_rate", "seed"], 1)


def test_a_learning_rate_constant_to_float_rounding_is_named_not_drawn(tmp_path):
    from grpokit.report import flat_panels

    run_dir = make_run(tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip().startswith("{") and line.strip().endswith("}")]
    for number, record in enumerate(records):
        if "learning_rate" in record:
            record["learning_rate"] = 0.0010000000000000002 if number % 2 else 0.001  # a constant schedule's logs
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert flat_panels([load_run(run_dir)]) == {"Learning rate": 0.001}
    records[-1]["learning_rate"] = 0.0009  # a schedule that moves is drawn
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert flat_panels([load_run(run_dir)]) == {}
    assert (tmp_path / "plots").exists() is False
    assert "learning_rate.png" in {p.name for p in plot_metrics([load_run(run_dir)], tmp_path / "plots")}
