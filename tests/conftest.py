"""Slow and GPU tests are skipped by default: `pytest --runslow` runs the slow ones, `-m gpu` needs CUDA."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or "slow" in (config.getoption("-m") or "")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
