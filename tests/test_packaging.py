"""What users install: the wheel and the sdist built from this tree carry every file of the package (the modules and
the JSON files it reads at run time: TRL's recorded config fields), the `grpokit` command, and the installed grpokit
the tests import has every file of the tree's."""

import configparser
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest

import grpokit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "grpokit"


def package_files(folder: Path) -> set[str]:
    """The package's files below `folder`, as paths relative to its parent (`grpokit/rollout/engine.py`)."""
    return {
        path.relative_to(folder.parent).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, built with setuptools' PEP 517 hooks from a copy of the tree (the tree itself stays
    free of build/ and egg-info folders), without network access."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("dist")
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "site", ".venv", "*.pyc")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(PACKAGE, tree / "src" / "grpokit", ignore=ignore)
    # (build_sdist rewrites sys.argv: the folder is read first)
    script = (
        "import sys; from setuptools import build_meta as hooks; "
        "out = sys.argv[1]; hooks.build_sdist(out); hooks.build_wheel(out)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_the_wheel_has_every_file_of_the_package_and_the_command(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = configparser.ConfigParser()
        (record,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        entry_points.read_string(wheel.read(record).decode())
    in_wheel = {name for name in names if name.startswith("grpokit/")}
    assert in_wheel == package_files(PACKAGE)
    # the files read at run time, named: the TRL field lists behind GRPOConfig, RLOOConfig, DistillationConfig and
    # AsyncGRPOConfig, and TRL's renames (the wheel without them crashed at `import grpokit`'s first config)
    for name in (
        "trl_fields.json",
        "trl_rloo_fields.json",
        "trl_distillation_fields.json",
        "trl_async_grpo_fields.json",
        "trl_renames.json",
    ):
        assert f"grpokit/{name}" in in_wheel
    assert entry_points["console_scripts"]["grpokit"] == "grpokit.cli:main"


def test_the_sdist_has_every_file_of_the_package(built):
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {f"src/{name}" for name in package_files(PACKAGE)} <= names
    assert {"pyproject.toml", "README.md", "LICENSE"} <= names


def test_the_grpokit_under_test_is_installed_with_every_file_of_the_tree():
    installed = Path(grpokit.__file__).resolve().parent
    assert package_files(installed) == package_files(PACKAGE)
    assert files("grpokit").joinpath("trl_fields.json").read_text().startswith("{")


def test_import_grpokit_is_light_and_every_public_name_resolves_to_its_module():
    import ast
    import logging

    code = "import sys, grpokit; print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
    # the lazy names are the TYPE_CHECKING imports (what type checkers and the API reference see) and __all__
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    (block,) = [node for node in tree.body if getattr(getattr(node, "test", None), "id", "") == "TYPE_CHECKING"]
    imported = {alias.name: node.module for node in block.body for alias in node.names}
    assert imported == grpokit._HOMES and sorted(grpokit.__all__) == sorted(imported)
    for name, module in imported.items():
        assert getattr(grpokit, name).__module__.startswith(f"grpokit.{module}"), name
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        grpokit.GRPOTrainr  # noqa: B018
    # bitsandbytes' failed fetch of an optional Hub kernel is dropped; its other warnings are not
    kept = []
    handler = logging.Handler()
    handler.emit = kept.append
    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    bnb.addHandler(handler)
    try:
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "x")
        bnb.warning("something else")
    finally:
        bnb.removeHandler(handler)
    assert [record.getMessage() for record in kept] == ["something else"]
