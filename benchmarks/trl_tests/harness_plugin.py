"""pytest plugin for the TRL test-suite harness: a per-test time limit (SIGALRM; pytest-timeout is not a
dependency), so one hung test cannot stop the measurement. The limit is TRL_TEST_TIMEOUT seconds (default 600)."""

import os
import signal

import pytest


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
