"""Run TRL's own trainer tests against grpokit, as a TRL user would: only the trainer/config import changed.

For each of TRL's test files (tests/test_grpo_trainer.py, tests/test_rloo_trainer.py,
tests/experimental/test_distillation_trainer.py) the harness

1. copies the file and the helpers it imports (tests/__init__.py, conftest.py, testing_utils.py,
   testing_constants.py) out of a TRL checkout into a scratch folder;
2. builds offline stand-ins for the Hub models and datasets the tests load (build_fixtures.py);
3. runs the file twice, offline on CPU: once as TRL wrote it (TRL's trainer: a test that fails there fails for
   reasons of this environment, and is not fair to count) and once with the import switched to grpokit's classes;
4. writes a per-test table (results.md) and the counts: a test is fair when it passes with TRL's trainer and does
   not read TRL's private internals (PRIVATE below, each with its reason) nor assert how TRL's loop is built
   (REFUSED: grpokit's differs by design).

    python benchmarks/trl_tests/run_trl_tests.py [--work DIR] [--files grpo rloo distillation] [-k EXPR]

grpokit is imported from wherever Python finds it (PYTHONPATH=src for a checkout).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_REPO = "/work/.mirror/huggingface+trl/repo"
FILES = {
    "grpo": "tests/test_grpo_trainer.py",
    "rloo": "tests/test_rloo_trainer.py",
    "distillation": "tests/experimental/test_distillation_trainer.py",
}
HELPERS = ["tests/__init__.py", "tests/conftest.py", "tests/testing_utils.py", "tests/testing_constants.py"]
HELPERS += ["tests/experimental/__init__.py"]
SCRIPTS = ["scripts/generate_zen_dataset.py", "scripts/generate_zen_image_dataset.py"]
SCRIPTS += ["scripts/generate_zen_multi_image_dataset.py"]
REMOTE_CODE = "scripts/generate_tiny_models/for_causal_lm/_remote_code/"
SCRIPTS += [REMOTE_CODE + name for name in ("__init__.py", "configuration_remote.py", "modeling_remote.py")]
# The only lines changed: the public trainer/config imports, as a user switches them.
IMPORTS = {
    "from trl import GRPOConfig, GRPOTrainer": "from grpokit import GRPOConfig, GRPOTrainer",
    "from trl import RLOOConfig, RLOOTrainer": "from grpokit import RLOOConfig, RLOOTrainer",
    "from trl.experimental.distillation import DistillationConfig, DistillationTrainer": (
        "from grpokit import DistillationConfig, DistillationTrainer"
    ),
}
# Where the TRL checkout's tests predate the installed TRL (1.16): the same edit in both runs, so that the file
# collects. TRL 1.16 dropped distillation_trainer._RepeatBatchDataLoader (the one test using it fails in both).
SKEW = {
    "from trl.experimental.distillation.distillation_trainer import _RepeatBatchDataLoader": (
        "try:\n    from trl.experimental.distillation.distillation_trainer import _RepeatBatchDataLoader\n"
        "except ImportError:  # not in TRL 1.16\n    _RepeatBatchDataLoader = None"
    ),
}
# Tests that read TRL's private internals (a private method or module-level helper of TRL's trainer), so that no
# other trainer can pass them with only the import changed. Name (without parameters) -> what it reads.
PRIVATE = {
    "test_compute_entropy_mask_0": "GRPOTrainer._compute_entropy_mask",
    "test_compute_entropy_mask_1": "GRPOTrainer._compute_entropy_mask",
    "test_compute_entropy_mask_lower_threshold": "GRPOTrainer._compute_entropy_mask",
    "test_compute_entropy_threshold_0": "GRPOTrainer._compute_entropy_mask",
    "test_compute_entropy_threshold_1": "GRPOTrainer._compute_entropy_mask",
    "test_compute_entropy_all_masked": "GRPOTrainer._compute_entropy_mask",
    "test_generate_prefers_rollout_func": "GRPOTrainer._generate with a mocked self",
    "test_generate_rollout_func_syncs_vllm_weights_when_needed": "GRPOTrainer._generate with a mocked self",
    "test_generate_rollout_func_raises_when_required_keys_are_missing": "GRPOTrainer._generate with a mocked self",
    "test_get_off_policy_mask": "GRPOTrainer.get_off_policy_mask (TRL's static helper)",
    "test_get_off_policy_mask_padding": "GRPOTrainer.get_off_policy_mask (TRL's static helper)",
    "test_compute_liger_loss_passes_vllm_is_ratio": "GRPOTrainer.compute_liger_loss with a mocked self",
    "test_repeat_batch_dataloader_delegates_set_epoch_via_getattr": "trl's _RepeatBatchDataLoader",
    "test_entropy_bonus_flows_gradients": "GRPOTrainer._entropy_bonus_enabled / _get_per_token_logps_and_entropies",
    "test_train_reward_func_with_log_extra": "GRPOTrainer._logs (its only assertion)",
    "test_train_vlm_log_multimodal_false": "GRPOTrainer._logs (its only assertion)",
}

# Tests that assert how TRL's loop is built, which grpokit's differs from by design (README, "Refused"), so that no
# other loop passes them. Name -> what it asserts.
REFUSED = {
    "test_prepare_input_called_with_correct_data": (
        "that training_step receives the generation batch's raw dataset rows (TRL generates inside it, in "
        "_prepare_inputs); grpokit's receives the typed micro-batch it trains on"
    ),
}


# The packages TRL's test files need on a CPU machine, by the testing_utils marker that skips a test without them
# (marker -> (module, pip name)): a test skipped for want of one would silently leave the figure, so the harness
# refuses to run without them. testing_utils itself imports psutil.
NEEDED = {
    "require_jmespath": ("jmespath", "jmespath"),
    "require_peft": ("peft", "peft"),
    "require_vision": ("PIL", "Pillow"),
    "testing_utils": ("psutil", "psutil"),
}
# Markers of tests that need an accelerator or a package that runs only on one: on CPU they are skipped, and the
# table counts them as fair tests not run.
ACCELERATOR_ONLY = {
    "require_torch_accelerator": "a CUDA/XPU accelerator",
    "require_torch_multi_accelerator": "several accelerators",
    "require_3_accelerators": "three accelerators",
    "require_vllm": "vLLM",
    "require_liger_kernel": "liger-kernel (Triton kernels)",
    "require_kernels": "kernels (Hub GPU kernels; with flash attention on an Ampere GPU)",
    "require_bitsandbytes": "bitsandbytes (in these files only on tests that also need an accelerator or vLLM)",
}


def check_requirements(texts: list[str]) -> None:
    """Exit with one line if a package the selected test files need is not importable, or if they use a require_*
    marker this harness does not know (a new optional dependency: add it to NEEDED or ACCELERATOR_ONLY)."""
    used = set(re.findall(r"@(require_\w+)", "\n".join(texts)))
    unknown = sorted(used - NEEDED.keys() - ACCELERATOR_ONLY.keys())
    if unknown:
        sys.exit(
            f"run_trl_tests: TRL's test files use {', '.join(unknown)}, unknown to the harness: add each to NEEDED "
            f"(a package the tests need on CPU) or ACCELERATOR_ONLY in {__file__}."
        )
    for marker in [*sorted(used & NEEDED.keys()), "testing_utils"]:
        module, package = NEEDED[marker]
        if importlib.util.find_spec(module) is None:
            sys.exit(
                f"run_trl_tests: TRL's tests need {package} ({marker} skips tests without it, which would leave them "
                f"out of the figure): pip install {package}"
            )


# The folder of tests/vllm_env/torchvision_cpu_shim.py, which lets PyPI's torchvision (a CUDA build; none is published
# for a CPU build of torch 2.13) import beside a CPU torch. TRL's VLM tests need torchvision: the processors of the
# Qwen-VL family, Qwen 3.5 and Gemma 4 build a video processor.
SHIM_DIR = HERE.parents[1] / "tests" / "vllm_env"


def torchvision_path(work: Path) -> list[str]:
    """The folders the test processes need on their path for torchvision to import: the shim's (harness_plugin and
    build_fixtures import it first), and, where the interpreter has no torchvision that imports, `work`'s
    torchvision-site, into which the harness installs the torchvision of the installed torch's release (--no-deps,
    leaving the caller's environment as it was). Exits with one line if that install fails."""
    import importlib.metadata

    def imports(paths: list[str]) -> bool:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
        probe = [sys.executable, "-c", "import torchvision_cpu_shim, torchvision"]
        return subprocess.run(probe, env=env, capture_output=True).returncode == 0

    paths = [str(SHIM_DIR)]
    if imports(paths):
        return paths
    site = work / "torchvision-site"
    paths.append(str(site))
    if imports(paths):
        return paths
    torch_minor = int(importlib.metadata.version("torch").split(".")[1])
    spec = f"torchvision==0.{torch_minor + 15}.*"  # torch 2.N pairs with torchvision 0.(N+15)
    shutil.rmtree(site, ignore_errors=True)
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), spec]
    print("run_trl_tests: installing", spec, "into", site)
    done = subprocess.run(install, capture_output=True, text=True)
    if done.returncode or not imports(paths):
        why = (done.stderr.strip().splitlines() or ["it installed, but does not import"])[-1]
        sys.exit(f"run_trl_tests: TRL's VLM tests need torchvision, and `{' '.join(install[2:])}` failed: {why}")
    return paths


def fixtures_stamp() -> str:
    """What the stand-ins were built by (build_fixtures.py's text): a different stamp rebuilds them."""
    return hashlib.sha1((HERE / "build_fixtures.py").read_bytes()).hexdigest()


def git_show(repo: str, ref: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, "show", f"{ref}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def tolerant_imports(text: str) -> str:
    """testing_utils' `from trl.import_utils import (...)` names a checker per optional dependency; one the installed
    TRL lacks reads as 'not available' instead of failing every test file's collection."""
    match = re.search(r"from trl\.import_utils import \(([^)]*)\)", text)
    if not match:
        return text
    names = [name.strip() for name in match.group(1).split(",") if name.strip()]
    lines = ["import trl.import_utils as _trl_import_utils", ""]
    lines += [f"{name} = getattr(_trl_import_utils, {name!r}, lambda: False)" for name in names]
    return text.replace(match.group(0), "\n".join(lines))


def copy_tests(repo: str, ref: str, dest: Path, switch: bool) -> None:
    for path in HELPERS + list(FILES.values()):
        text = git_show(repo, ref, path)
        for before, after in SKEW.items():
            text = text.replace(before, after)
        if path == "tests/testing_utils.py":
            text = tolerant_imports(text)
        if switch and path in FILES.values():
            for before, after in IMPORTS.items():
                text = text.replace(before, after)
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def run_pytest(run_dir: Path, tests: list[str], report: Path, env: dict, keyword: str | None) -> None:
    command = [sys.executable, "-m", "pytest", *tests, "-p", "harness_plugin", "-q", "-rN", "--tb=line"]
    command += ["-p", "no:cacheprovider", f"--junitxml={report}", "-o", "junit_family=xunit1"]
    if keyword:
        command += ["-k", keyword]
    subprocess.run(command, cwd=run_dir, env=env)


def outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed | failed | skipped, first line of the reason)."""
    results = {}
    if not report.exists():
        return results
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        if not case.get("name") or not case.get("classname"):
            continue  # an interrupted run's (Ctrl-C) entry for no test
        name = case.get("classname", "").split(".")[-1] + "::" + case.get("name")
        status, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                status = "skipped" if tag == "skipped" else "failed"
                message = element.get("message") or (element.text or "")
                reason = " ".join(message.split())[:160]
                if "TestTimeout" in reason:
                    status = "timed out"  # harness_plugin's limit: no outcome
                break
        results[name] = (status, reason)
    return results


def load_record(path: Path) -> dict:
    """The outcomes on record (outcomes.json): {"runs": [what ran when], "outcomes": {mode: {file: {test id:
    [status, reason, date]}}}}. Every run updates it, so a -k rerun here keeps the other rows of earlier runs."""
    if not path.exists():
        return {"runs": [], "outcomes": {}}
    return json.loads(path.read_text())


def record_run(record: dict, mode: str, name: str, report: Path, keyword: str | None, partial: bool) -> None:
    """Puts a report's outcomes on record, dated today: a full run of a file replaces its rows, a partial run
    (-k, --trl-where-grpokit-fails) replaces those it ran."""
    results = outcomes(report)
    if not results:
        return  # the run collected nothing (a -k selecting none of this file's tests, or a crash): nothing to record
    today = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    rows = record["outcomes"].setdefault(mode, {}).setdefault(name, {})
    if not partial:
        rows.clear()
    rows.update({test: [status, reason, today] for test, (status, reason) in results.items()})
    selection = f"-k '{keyword}'" if keyword else ("the tests grpokit failed" if partial else "the whole file")
    run = {"date": today, "mode": mode, "file": name, "selection": selection, "tests": len(results)}
    if mode == "grpokit":
        run["grpokit"] = grpokit_commit()
    record["runs"].append(run)


def grpokit_commit() -> str:
    """The commit of the grpokit that pytest imports (+dirty for uncommitted changes), or where it is installed."""
    spec = importlib.util.find_spec("grpokit")
    if spec is None or spec.origin is None:
        return "not importable"
    where = Path(spec.origin).resolve().parent
    git = ["git", "-C", str(where)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if not head:
        return str(where)
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True).stdout
    return head + ("+dirty" if dirty.strip() else "")


def node_id(test_file: str, test_id: str) -> str:
    """pytest's node id of a table row's test id (Class::name, or module::name for a function)."""
    cls, name = test_id.split("::")
    return f"{test_file}::{name}" if cls == Path(test_file).stem else f"{test_file}::{cls}::{name}"


def base_name(test_id: str) -> str:
    return re.sub(r"\[.*\]$", "", test_id.split("::")[-1])


def classify(test_id: str, trl: tuple, ours: tuple) -> tuple[str, str]:
    """(why the test is not counted, or "fair" or "not run", the reason shown). A test TRL's trainer fails here,
    or that reads TRL's internals or asserts its loop's design, is not counted; a test skipped here (it needs an
    accelerator, vLLM, liger-kernel: ACCELERATOR_ONLY) is a fair test not run, counted in the denominator."""
    (trl_status, trl_reason), (status, reason) = trl[:2], ours[:2]
    if trl_status == "timed out" or (trl_status == "failed" and "TestTimeout" in trl_reason):
        trl_status = "not run"  # no outcome: the test ran past the per-test limit (TRL_TEST_TIMEOUT)
    needed = {f"test requires {marker.removeprefix('require_')}" for marker in NEEDED}
    if trl_status == "skipped" and trl_reason in needed and status != "skipped":
        trl_status = "not run"  # a run from before the harness required the package: TRL's trainer did not run it
    if trl_status == "failed":
        return "env", f"fails with TRL's trainer here: {trl_reason}"
    if base_name(test_id) in PRIVATE:
        return "private", f"reads TRL's private {PRIVATE[base_name(test_id)]}"
    if base_name(test_id) in REFUSED:
        return "refused", f"refused: asserts {REFUSED[base_name(test_id)]}"
    if "skipped" in (trl_status, status):
        return "not run", f"skipped here: {trl_reason if trl_status == 'skipped' else reason}"
    if status == "timed out" or (status == "failed" and "TestTimeout" in reason):
        return "not run", f"timed out here (TRL_TEST_TIMEOUT): {reason}"
    if status == "not run":
        return "not run", "not run with grpokit"
    return "fair", reason


def table(name: str, trl: dict, grpokit: dict) -> list[str]:
    rows = ["| test | TRL 1.16 | grpokit | fair | reason | run (TRL / grpokit) |", "|---|---|---|---|---|---|"]
    counts = dict(fair=0, passed=0, not_run=0, env=0, private=0, refused=0, unverified=0)
    skips: dict[str, int] = {}
    for test_id in sorted(set(trl) | set(grpokit)):
        trl_outcome, ours = trl.get(test_id, ("not run", "", "")), grpokit.get(test_id, ("not run", "", ""))
        kind, reason = classify(test_id, trl_outcome, ours)
        fair = {"fair": "yes", "not run": "not run"}.get(kind, "no")
        if kind in ("fair", "not run"):
            counts["fair"] += 1
            counts["passed"] += kind == "fair" and ours[0] == "passed"
            counts["unverified"] += kind == "fair" and trl_outcome[0] != "passed" and ours[0] == "passed"
            if kind == "not run":
                counts["not_run"] += 1
                skips[reason.removeprefix("skipped here: ")] = skips.get(reason.removeprefix("skipped here: "), 0) + 1
        else:
            counts[kind] += 1
        dates = f"{trl_outcome[2] or '-'} / {ours[2] or '-'}"
        rows.append(f"| {test_id} | {trl_outcome[0]} | {ours[0]} | {fair} | {reason.replace('|', '/')} | {dates} |")
    why = "; ".join(f"{count}: {reason}" for reason, count in sorted(skips.items(), key=lambda item: -item[1]))
    summary = (
        f"{counts['passed']} of {counts['fair']} fair tests pass with grpokit, {counts['not_run']} not run"
        + (f" ({why})" if why else "")
        + f". Not counted: {counts['env']} that fail with TRL's own trainer here, {counts['private']} that read "
        f"TRL's private internals, {counts['refused']} that assert TRL's loop design (refused)"
        + (
            f"; {counts['unverified']} of the fair tests passed with grpokit have no TRL run on record"
            if counts["unverified"]
            else ""
        )
        + "."
    )
    return [f"### {name}", "", summary, "", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl-tests-work"))
    parser.add_argument("--trl-repo", default=os.environ.get("TRL_REPO", TRL_REPO), help="a TRL git checkout or mirror")
    parser.add_argument("--ref", default="HEAD", help="the TRL commit whose tests to run")
    parser.add_argument("--files", nargs="+", choices=sorted(FILES), default=sorted(FILES))
    parser.add_argument(
        "--modes", nargs="*", choices=["trl", "grpokit"], default=["trl", "grpokit"], help="none: the table only"
    )
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a partial run; the table covers it only)")
    parser.add_argument(
        "--trl-where-grpokit-fails",
        action="store_true",
        help="run TRL's trainer only on the tests that fail with grpokit (the last grpokit run's); the tests grpokit "
        "passes are then counted fair without TRL's run (a quick measurement: TRL's trainer takes hours on 2 cores)",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the models and datasets")
    parser.add_argument("--table", type=Path, default=HERE / "results.md")
    parser.add_argument("--record", type=Path, default=HERE / "outcomes.json", help="the outcomes on record")
    args = parser.parse_args()
    work = args.work.resolve()
    hub_cache, datasets_root = work / "hf" / "hub", work / "datasets"
    env = dict(os.environ, HF_HOME=str(work / "hf"), HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    env.update(HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", WANDB_DISABLED="true")
    env.update(TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(work / "hf" / "datasets-cache"))
    # One intra-op thread per test process unless the caller sets OMP_NUM_THREADS: where other work shares the cores,
    # torch's OpenMP threads wait at every operation's barrier for a descheduled sibling, and a tiny model's many
    # small operations then take ten times as long.
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.modes:
        check_requirements([git_show(args.trl_repo, args.ref, FILES[name]) for name in args.files])
        # Absolute: pytest runs in the run folder, where PYTHONPATH=src would name nothing and grpokit would be
        # imported from wherever else it is installed.
        paths = [str(Path(path).resolve()) for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), *torchvision_path(work), *paths])
    stamp = work / "fixtures.done"
    if args.modes and (args.rebuild or not stamp.exists() or stamp.read_text() != fixtures_stamp()):
        scripts = work / "trl-scripts"
        for path in SCRIPTS:
            target = scripts / ("remote_code/" if path.startswith(REMOTE_CODE) else "") / Path(path).name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(git_show(args.trl_repo, args.ref, path))
        fixture_paths = [f"--datasets-root={datasets_root}", f"--trl-scripts={scripts}"]
        shutil.rmtree(hub_cache, ignore_errors=True)
        shutil.rmtree(datasets_root, ignore_errors=True)
        build = [sys.executable, str(HERE / "build_fixtures.py"), f"--hub-cache={hub_cache}", *fixture_paths]
        subprocess.run(build, check=True, env=env)
        stamp.write_text(fixtures_stamp())

    commit = subprocess.run(
        ["git", "-C", args.trl_repo, "rev-parse", args.ref], capture_output=True, text=True
    ).stdout.strip()

    record = load_record(args.record)
    for mode in args.modes:
        # The tests load "trl-internal-testing/zen" etc. as paths relative to the run folder: the datasets live there.
        run_dir = work / f"run-{mode}"
        shutil.rmtree(run_dir / "tests", ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        link = run_dir / "trl-internal-testing"
        if not link.exists():
            link.symlink_to(datasets_root / "trl-internal-testing")
        copy_tests(args.trl_repo, args.ref, run_dir, switch=mode == "grpokit")
        for name in args.files:
            partial = bool(args.keyword) or (mode == "trl" and args.trl_where_grpokit_fails)
            report = work / f"{mode}-{name}{f'-partial-{time.time():.0f}' if partial else ''}.xml"
            report.unlink(missing_ok=True)
            tests = [FILES[name]]
            if mode == "trl" and args.trl_where_grpokit_fails:
                ours = record["outcomes"].get("grpokit", {}).get(name, {})
                tests = [node_id(FILES[name], test) for test, (status, *_) in ours.items() if status == "failed"]
                if not tests:
                    continue
            run_pytest(run_dir, tests, report, env, args.keyword)
            record_run(record, mode, name, report, args.keyword, partial)
            args.record.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    import trl

    lines = [
        "# TRL's trainer tests with the import switched to grpokit",
        "",
        f"TRL's tests at {commit[:12]} of {args.trl_repo} (installed trl {trl.__version__}), offline on CPU with the "
        "stand-in models and datasets of build_fixtures.py, run with `python benchmarks/trl_tests/run_trl_tests.py`. "
        "Each row is the latest outcome on record (outcomes.json) under each trainer, dated by the run that gave it:",
        "",
        *[
            f"- {run['date']}: {run['mode']} on {FILES.get(run['file'], run['file'])}, {run['selection']}"
            + (f" ({run['tests']} tests)" if "tests" in run else "")
            + (f", grpokit {run['grpokit']}" if "grpokit" in run else "")
            for run in record["runs"]
        ],
        "",
    ]
    for name in args.files:
        trl_rows = record["outcomes"].get("trl", {}).get(name, {})
        lines += [*table(FILES[name], trl_rows, record["outcomes"].get("grpokit", {}).get(name, {})), ""]
    args.table.write_text("\n".join(lines))
    print("\n".join(line for line in lines if "fair tests pass" in line or line.startswith("###")))
    print(f"table: {args.table}")


if __name__ == "__main__":
    main()
