"""The README and the documentation stay true: the quick start has two commands, every config field is documented,
the site builds strictly, every Python block runs (or says why it cannot offline), and the pages speak to users."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# A Python block that cannot run offline (a Hub model, vLLM, a fragment) is marked on the line before its fence:
#     <!-- not-run: why -->
NOT_RUN = re.compile(r"<!-- not-run: \S.*-->\s*$")


def python_blocks():
    for page in PAGES:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() == "```python":
                end = lines.index("```", number + 1)
                marked = number > 0 and bool(NOT_RUN.match(lines[number - 1].strip()))
                name = f"{page.relative_to(ROOT)}:{number + 1}"
                yield pytest.param("\n".join(lines[number + 1 : end]), marked, id=name)


def test_quick_start_has_exactly_two_commands():
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", README, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    # .ci/run installs and tests with the second line as written.
    assert commands[0] == 'pip install "torch==2.13.0" . && grpokit train'
    assert commands[1] == 'pip install "torch==2.13.0" ".[test]" && python -m pytest -q'


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 400


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_generated_from_the_fields():
    page = ROOT / "docs" / "reference" / "configuration.md"
    documented = set(re.findall(r"^\| `(\w+)` \|", page.read_text(), re.M))
    assert {f.name for f in dataclasses.fields(GRPOConfig)} == documented
    assert page.read_text() == load_script("config_reference").config_reference_page(), (
        "run python scripts/config_reference.py"
    )


def test_the_docs_speak_to_users_not_about_the_projects_history():
    words = re.compile(r"this session|the lease|the issue.s|issue #?[0-9]+|contended machine", re.I)
    found = [
        f"{page.relative_to(ROOT)}:{n + 1}: {line.strip()}"
        for page in PAGES
        for n, line in enumerate(page.read_text().splitlines())
        if words.search(line)
    ]
    assert found == []


def test_the_readmes_links_point_at_files_that_exist():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target


@pytest.mark.parametrize("code, marked", python_blocks())
def test_every_python_block_runs_or_says_why_not(code, marked, tmp_path, monkeypatch):
    if marked:
        pytest.skip("marked not runnable offline")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code, "<docs>", "exec"), {"__name__": "__docs__"})


def test_mkdocs_builds_strictly(tmp_path):
    """Broken links, missing pages, pages outside the navigation and API entries that no longer resolve fail."""
    for module in ("mkdocs", "material", "mkdocstrings"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install '.[test]')")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def test_every_guide_is_listed_on_the_front_pages():
    guides = sorted(path.name for path in (ROOT / "docs" / "guides").glob("*.md"))
    index = (ROOT / "docs" / "index.md").read_text()
    assert [name for name in guides if f"(guides/{name})" not in index] == []
    assert [name for name in guides if f"(docs/guides/{name})" not in README] == []


def marked_blocks(page: Path, marker: str) -> list[tuple[str, str]]:
    """(the marker's text, the block's body) for every fenced block whose line before is `<!-- MARKER: text -->`."""
    lines = page.read_text().splitlines()
    found = []
    for number, line in enumerate(lines[:-1]):
        match = re.fullmatch(rf"<!-- {marker}: (.+?) -->", line.strip())
        if match and lines[number + 1].startswith("```"):
            end = lines.index("```", number + 2)
            found.append((match.group(1), "\n".join(lines[number + 2 : end]) + "\n"))
    return found


def test_the_newcomer_path_runs_as_written(tmp_path):
    """Getting started's "your own model and data", verbatim: the JSONL files it shows, then its commands (train on
    them with an eval set, evaluate the saved model, draw the report), on a tiny model saved as ./my-model."""
    from grpokit.testing import save_tiny_model

    page = ROOT / "docs" / "getting-started.md"
    for name, body in marked_blocks(page, "file"):
        (tmp_path / name).write_text(body)
    ((_, commands),) = marked_blocks(page, "run")
    save_tiny_model(tmp_path / "my-model", chars="0123456789+=")
    shim = f'grpokit() {{ "{sys.executable}" -m grpokit.cli "$@"; }}\nset -e\n'
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        ["bash", "-c", shim + commands], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (tmp_path / "my-run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/reward" in r] == [2, 4]  # evaluated every logging step
    assert [r["step"] for r in records if "reward" in r] == [1, 2, 4]
    results = json.loads((tmp_path / "my-run" / "eval.json").read_text())
    assert results["num_prompts"] == 2 and results["num_generations_eval"] == 4  # the run's group size
    assert [len(sample["completions"]) for sample in results["samples"]] == [4, 4]
    assert (tmp_path / "my-run" / "report" / "report.html").is_file()
    assert "Generating train split" not in done.stderr and "Traceback" not in done.stderr


def test_the_readmes_command_line_is_the_run_of_the_script_above_it():
    script = re.search(r"```python\n# train_grpo.py\n(.*?)```", README, re.S).group(1)
    commands = re.search(r"The same run from the command line:\s+```bash\n(.*?)```", README, re.S).group(1)
    train = " ".join(commands.replace("\\\n", " ").split("grpokit train ")[1].split("\ngrpokit ")[0].split())
    model = re.search(r'model="([^"]+)"', script).group(1)
    dataset = re.search(r'load_dataset\("([^"]+)"', script).group(1)
    output_dir = re.search(r'output_dir="([^"]+)"', script).group(1)
    logging_steps = re.search(r"logging_steps=(\d+)", script).group(1)
    for flag in (
        f"--model {model}",
        f"--dataset {dataset}",
        f"--output_dir {output_dir}",
        f"--logging_steps {logging_steps}",
    ):
        assert flag in train, flag
    assert "def reward_len(" in script and "--reward rewards.py:reward_len" in train


def test_the_development_section_says_how_to_develop_not_one_machines_timings():
    section = README.split("## Development\n")[1].split("\n## ")[0]
    assert "pip install -e" in section and "python -m pytest" in section
    assert not re.search(r"\b[0-9a-f]{7,40}\b|\bminutes\b|\d[\d,]* passed|\d+ skipped", section), section


def test_the_demo_pictures_caption_is_what_the_picture_shows():
    """docs/demo_report.png carries its title as the PNG's Description (scripts/demo_report_picture.py draws both
    from the run's demo_results.json); the README and Getting started quote it, and it names no local path."""
    from PIL import Image

    described = Image.open(ROOT / "docs" / "demo_report.png").info["Description"]
    assert re.fullmatch(r"held-out accuracy went from \d+% before GRPO to \d+% after \d+ GRPO steps", described)
    for page in (README, (ROOT / "docs" / "getting-started.md").read_text()):
        paragraph = page.split("grpokit report grpo-demo")[1].split("![")[0]
        assert described in " ".join(paragraph.split()), paragraph
        assert not re.search(r"/tmp/|/home/|/work/|/Users/", paragraph)
