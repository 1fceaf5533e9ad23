"""Tests for the sandboxed code-execution reward (grpokit.rewards.code).

Every behavioural test runs twice: under bubblewrap (skipped where bwrap is missing
or unusable) and in the forced resource-limits-only fallback.  Hostile cases that
only bubblewrap (or the root -> nobody uid drop) can stop are skipped elsewhere.
"""

import contextlib
import dataclasses
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest

from grpokit.rewards import code as code_mod
from grpokit.rewards.code import SandboxLimits, code_execution_reward, make_code_execution_reward

LIMITS = SandboxLimits(
    cpu_seconds=1, wall_seconds=2.0, memory_bytes=512 << 20, file_size_bytes=1 << 20, max_processes=32
)
GOOD_SRC = "def add(a, b):\n    return a + b\n"
BAD_SRC = "def add(a, b):\n    return a - b\n"
GOOD, BAD = f"```python\n{GOOD_SRC}```", f"```python\n{BAD_SRC}```"
TEST = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"


@pytest.fixture(scope="module", params=["bubblewrap", "fallback"])
def reward(request):
    if request.param == "bubblewrap":
        fn = make_code_execution_reward(LIMITS, workers=4, require_bubblewrap=True)
        try:
            fn.sandbox_mode()
        except RuntimeError as e:
            pytest.skip(f"bubblewrap unusable here: {e}")
    else:
        fn = make_code_execution_reward(LIMITS, workers=4, use_bubblewrap=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            fn.sandbox_mode()
    return fn


def strong(fn):
    """True where the sandbox hides the host filesystem / other processes."""
    mode = fn.sandbox_mode()
    return mode.bubblewrap or mode.uid is not None


def marker():
    return f"30{random.randrange(10**6)}.5"  # unique `sleep` argument to find in /proc


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def processes_with(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if mark.encode() in read_bytes(f"/proc/{pid}/cmdline"):
                found.append(int(pid))
    return found


def assert_no_survivors(*marks: str) -> None:
    deadline = time.monotonic() + 3
    while any(processes_with(m) for m in marks) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = {m: processes_with(m) for m in marks}
    for pids in left.values():  # don't leak them into later tests even on failure
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
    assert not any(left.values()), f"processes survived the sandbox: {left}"


def test_extract_code():
    extract = code_mod.extract_code
    assert extract("no fences here") == "no fences here"
    assert extract("```python\na = 1\n```\ntext\n```python\nb = 2\n```\n") == "b = 2\n"
    assert extract("```\nx = 1\n```") == "x = 1\n"
    assert extract("```python\nx = 1\n```\n```bash\nrm -rf /\n```") == "x = 1\n"
    assert extract("Sure:\n```python\ny = 2\n") == "y = 2\n"  # truncated, never closed
    assert extract("1. step\n   ```python\n   z = 3\n   ```") == "z = 3\n"  # indented fence


def test_api_contract():
    assert code_execution_reward.__name__ == "code_execution_reward"
    assert make_code_execution_reward().__name__ == "code_execution_reward"
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.cpu_seconds = 10
    with pytest.raises(ValueError):
        make_code_execution_reward(require_bubblewrap=True, use_bubblewrap=False)
    with pytest.raises(ValueError):
        code_execution_reward([GOOD], [])
    assert code_execution_reward([], []) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert code_execution_reward([GOOD, BAD], [TEST, TEST]) == [1.0, 0.0]  # default limits


def test_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(code_mod, "_warned", False)
    with pytest.warns(RuntimeWarning, match="apt-get install bubblewrap"):
        make_code_execution_reward(LIMITS, use_bubblewrap=False)(["pass"], [""])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_code_execution_reward(LIMITS, use_bubblewrap=False)(["pass"], [""])


def test_missing_bwrap(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, path=None: None if name == "bwrap" else real_which(name, path=path)
    )
    monkeypatch.setattr(code_mod, "_warned", False)
    with pytest.raises(RuntimeError, match="bwrap not found"):
        make_code_execution_reward(LIMITS, require_bubblewrap=True)([GOOD], [TEST])
    fallback = make_code_execution_reward(LIMITS)
    with pytest.warns(RuntimeWarning, match="missing or unusable"):
        assert fallback([GOOD, BAD], [TEST, TEST]) == [1.0, 0.0]
    assert not fallback.sandbox_mode().bubblewrap


def test_honest_and_wrong(reward):
    chat = [[{"role": "user", "content": "add"}, {"role": "assistant", "content": GOOD}]]
    two_blocks = BAD + "\nOops, fixed:\n" + GOOD  # last block wins
    completions = [GOOD, BAD, "def add(a, b): return a + b", two_blocks, GOOD + "\n" + BAD, *chat]
    got = reward(completions, [TEST] * 6, prompts=["p"] * 6, completion_ids=[[1]] * 6, extra_col=[0] * 6)
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    # MBPP-style list of asserts; syntax errors score 0.
    assert reward([GOOD, "def add(a, b) return"], [TEST.splitlines(), TEST]) == [1.0, 0.0]


def test_exit_before_tests_is_not_a_pass(reward):
    # Wrong code that exits 0 before the appended asserts can run.
    hacks = ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"]
    assert reward([BAD_SRC + h for h in hacks], [TEST] * 3) == [0.0] * 3


def test_hostile_batch_is_bounded(reward, monkeypatch):
    monkeypatch.setenv("GRPOKIT_TEST_SECRET", "hunter2")
    hostile = [
        "while True:\n    pass",  # CPU limit
        "import time\ntime.sleep(1000)",  # wall-clock limit
        "x = bytearray(10 * 1024**3)\nx[-1] = 1",  # RLIMIT_AS
        "import os\nassert os.environ.get('GRPOKIT_TEST_SECRET') == 'hunter2'",
        "open('big', 'wb').write(b'x' * (64 << 20))",  # RLIMIT_FSIZE
        "print('y' * 10**7)\nraise ValueError",  # chatty and failing
    ]
    start = time.monotonic()
    got = reward([*hostile, GOOD], [""] * len(hostile) + [TEST])
    elapsed = time.monotonic() - start
    assert got == [0.0] * len(hostile) + [1.0]
    # 7 jobs on 4 workers: two rounds of at most wall_seconds each, plus slack.
    assert elapsed < 2 * LIMITS.wall_seconds + 4, elapsed


def test_secret_in_other_process_environ(reward):
    if not strong(reward):
        pytest.skip("without bwrap or a uid drop, /proc/*/environ of our uid is readable")
    secret = f"s3cret-{random.randrange(10**9)}"
    holder = subprocess.Popen(["sleep", "30"], env={"GRPOKIT_TEST_SECRET": secret})
    try:
        deadline = time.monotonic() + 3  # wait for the exec, then check the secret is out there
        while secret.encode() not in read_bytes(f"/proc/{holder.pid}/environ"):
            assert time.monotonic() < deadline, "helper never showed its environment"
            time.sleep(0.01)
        spy = (
            "import glob\nfound = False\nfor p in glob.glob('/proc/*/environ'):\n"
            f"    try:\n        found |= {secret.encode()!r} in open(p, 'rb').read()\n"
            "    except OSError:\n        pass\nassert found"
        )
        assert reward([spy], [""]) == [0.0]
    finally:
        holder.kill()
        holder.wait()


def test_cannot_write_outside_workdir(reward, tmp_path):
    if not strong(reward):
        pytest.skip("without bwrap or a uid drop the child may write where we can")
    target = tmp_path / "pwned"
    assert reward([f"open({str(target)!r}, 'w').write('x')"], [""]) == [0.0]
    assert not target.exists()
    # Writing inside its own work dir is fine.
    assert reward(["open('ok.txt', 'w').write('x')\nassert open('ok.txt').read() == 'x'"], [""]) == [1.0]


def test_no_capabilities(reward):
    if not strong(reward):
        pytest.skip("the fallback keeps our own uid and capabilities")
    caps = "caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\nassert int(caps, 16)"
    assert reward([caps], [""]) == [0.0]


def test_no_network(reward):
    if not reward.sandbox_mode().bubblewrap:
        pytest.skip("the fallback does not isolate the network")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    port, seen, stop = server.getsockname()[1], [], threading.Event()

    def serve():
        while not stop.is_set():
            with contextlib.suppress(OSError):  # accept() timed out
                seen.append(server.accept())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
        assert reward([client], [""]) == [0.0]
        time.sleep(0.2)
        assert seen == []
    finally:
        stop.set()
        thread.join()
        server.close()


def test_no_long_lived_children(reward):
    m1, m2, m3 = marker(), marker(), marker()
    leaver = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '{m1}'])\n"
        f"if os.fork() == 0:\n    os.execvp('sleep', ['sleep', '{m2}'])\n"
        # leaves our process group (but not the session)
        f"subprocess.Popen(['sleep', '{m3}'], preexec_fn=os.setpgrp)\n"
    )
    assert reward([leaver], [""]) == [1.0]
    assert_no_survivors(m1, m2, m3)


def test_double_fork_setsid_escape_is_contained(reward):
    if not reward.sandbox_mode().bubblewrap:
        pytest.skip("documented limit: without bwrap a double-forked setsid daemon escapes")
    m = marker()
    daemon = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execvp('sleep', ['sleep', '{m}'])\n    os._exit(0)\nos.wait()\n"
    )
    assert reward([daemon], [""]) == [1.0]
    assert_no_survivors(m)


def test_fork_bomb_is_capped(reward):
    mode = reward.sandbox_mode()
    if mode.uid is None and os.geteuid() == 0:
        pytest.skip("RLIMIT_NPROC does not apply to root")
    m = marker()
    bomb = (
        "import os\nn = 0\ntry:\n    while n < 200:\n        if os.fork() == 0:\n"
        f"            os.execvp('sleep', ['sleep', '{m}'])\n        n += 1\n"
        "except OSError:\n    pass\nassert n >= 200, n\n"
    )
    assert reward([bomb], [""]) == [0.0]
    assert_no_survivors(m)


def test_bubblewrap_started_by_root_without_uid_drop():
    """The mode used where unprivileged user namespaces are disabled (bwrap run by root)."""
    if os.geteuid() != 0 or not shutil.which("bwrap"):
        pytest.skip("needs root and bwrap")
    mode = code_mod._Mode(True, None, os.path.realpath(sys.executable))

    def passes(src):
        return code_mod._run(src, LIMITS, mode)[0]

    if not passes("pass"):
        pytest.skip("bubblewrap unusable here")
    assert not passes("caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\nassert int(caps, 16)")
    assert not passes("import socket\nassert len(socket.if_nameindex()) > 1")  # only lo
    assert not passes("open('/usr/pwned', 'w')")
    assert not passes("import os\nassert sum(p.isdigit() for p in os.listdir('/proc')) > 5")  # PID ns
