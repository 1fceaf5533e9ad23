"""pytest plugin for the TRL test-suite harness: a per-test time limit (SIGALRM; pytest-timeout is not a
dependency), so one hung test cannot stop the measurement. The limit is TRL_TEST_TIMEOUT seconds (default 600).
It also loads tests/vllm_env/torchvision_cpu_shim.py before anything imports torchvision."""

import os
import signal

import pytest
import torchvision_cpu_shim  # noqa: F401  (run_trl_tests puts it on the path: torchvision imports beside a CPU torch)


class TestTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get("TRL_TEST_TIMEOUT", "600"))

    def expire(signum, frame):
        raise TestTimeout(f"test ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
