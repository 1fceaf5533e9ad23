"""Slow, multi-process and GPU tests are skipped by default: `pytest --runslow` runs the slow ones, `-m distributed`
(or `--rundistributed`) those that launch several training processes (torchrun, accelerate launch; .ci/run runs them
after the default suite), `-m gpu` needs CUDA. vLLM tests
(`-m vllm`) need vllm installed (docs/guides/vllm.md: CPU recipe; `.ci/run` builds it) and skip without it,
unless GRPOKIT_REQUIRE_VLLM=1, which turns a missing vllm into a failure (CI sets it, so a broken install shows).
Likewise verifiers' tests (`-m verifiers`, classic verifiers environments) skip without verifiers, unless
GRPOKIT_REQUIRE_VERIFIERS=1; verifiers-v1 tests (`-m verifiers_v1`) need verifiers 0.4, in an environment of its own
(.ci/run), and GRPOKIT_REQUIRE_VERIFIERS_V1=1 makes its absence a failure. OpenEnv's tests (`-m openenv`) skip without
openenv-core, unless GRPOKIT_REQUIRE_OPENENV=1."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# The tests exercise the installed grpokit (a wheel built from this tree, or `pip install -e .` while developing): the
# package lives in src/, so neither the checkout on sys.path nor the processes the tests start (torchrun ranks, the
# CLI, a vLLM server) can import it from the tree by accident. The header of every run says which one it imports.
REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_report_header(config):
    import grpokit

    where = Path(grpokit.__file__).resolve().parent
    kind = "this checkout's src/ (editable install)" if where.is_relative_to(REPO_ROOT) else "an installed package"
    return f"grpokit {grpokit.__version__} from {where}: {kind}"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption(
        "--rundistributed", action="store_true", default=False, help="run tests that launch several processes"
    )


def pytest_sessionstart(session):
    if os.environ.get("GRPOKIT_REQUIRE_VERIFIERS") == "1" and importlib.util.find_spec("verifiers") is None:
        raise pytest.UsageError(
            "GRPOKIT_REQUIRE_VERIFIERS=1 but verifiers is not importable: the verifiers "
            "environment was not built (pip install 'grpokit[verifiers]'; .ci/run builds it)."
        )
    if os.environ.get("GRPOKIT_REQUIRE_OPENENV") == "1" and importlib.util.find_spec("openenv") is None:
        raise pytest.UsageError(
            "GRPOKIT_REQUIRE_OPENENV=1 but openenv-core is not importable: the OpenEnv "
            "environment was not built (pip install 'grpokit[openenv]'; .ci/run builds it)."
        )


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or "slow" in (config.getoption("-m") or "")
    run_distributed = config.getoption("--rundistributed") or "distributed" in (config.getoption("-m") or "")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))
        if "distributed" in item.keywords and not run_distributed:
            item.add_marker(pytest.mark.skip(reason="several processes: run with -m distributed (.ci/run does)"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "vllm" in item.keywords and importlib.util.find_spec("vllm") is None:
            if os.environ.get("GRPOKIT_REQUIRE_VLLM") == "1":
                raise pytest.UsageError(
                    "GRPOKIT_REQUIRE_VLLM=1 but vllm is not importable: the vLLM environment "
                    "was not built (see the CPU recipe in docs/guides/vllm.md)."
                )
            item.add_marker(pytest.mark.skip(reason="needs vllm (docs/guides/vllm.md: CPU recipe; .ci/run builds it)"))
        if "verifiers_v1" in item.keywords and not has_verifiers_v1():
            if os.environ.get("GRPOKIT_REQUIRE_VERIFIERS_V1") == "1":
                raise pytest.UsageError(
                    "GRPOKIT_REQUIRE_VERIFIERS_V1=1 but verifiers>=0.4 is not installed: the "
                    "verifiers-v1 environment was not built (.ci/run builds it)."
                )
            item.add_marker(
                pytest.mark.skip(
                    reason="needs verifiers 0.4 (pip install grpokit[verifiers-v1] in an "
                    "environment of its own; .ci/run builds it)"
                )
            )


def has_verifiers_v1() -> bool:
    """verifiers 0.4 (its v1 API) is installed; read from the package metadata, so that an older verifiers (the
    classic API) is not imported to find out."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("verifiers").split(".")[:2]) >= (0, 4)
    except (PackageNotFoundError, ValueError):
        return False


@pytest.fixture
def onednn_everywhere(monkeypatch):
    """Every float32 product of a layer grpokit routes through oneDNN (grpokit/onednn_linear.py) takes it on this
    machine, whatever the CPU (GRPOKIT_ONEDNN_LINEARS=1, no size floor); skipped where torch has no working oneDNN.
    The cached decision is cleared before and after."""
    from grpokit import onednn_linear

    if not onednn_linear._onednn_works():
        pytest.skip("this torch has no oneDNN float32 linear product")
    monkeypatch.setenv(onednn_linear.ENV, "1")
    monkeypatch.setattr(onednn_linear, "MIN_MACS", 0)
    onednn_linear.onednn_is_faster.cache_clear()
    yield
    onednn_linear.onednn_is_faster.cache_clear()
