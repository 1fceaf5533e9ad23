"""Sandboxed code-execution reward for RL on code (TRL reward-function contract).

Each completion's last ```python (or untagged ```) block, followed by the row's
test code, runs in a fresh ``python -I -S`` process.  Reward is 1.0 iff it exits 0
within the limits *and* ran to the end of the tests, else 0.0.

Isolated
* Always: rlimits on CPU time, address space, file size, process count and core
  dumps; a wall-clock timeout enforced by the parent; an empty environment; a
  fresh temp dir as cwd; the child's process group (and, without bubblewrap, its
  whole session) is SIGKILLed when the run ends, pass or fail.  When running as
  root the child drops to uid/gid 65534 (nobody) if that works, so it cannot
  write root-owned files or read other processes' /proc/*/environ, and
  RLIMIT_NPROC (which root ignores) applies.
* With a working bubblewrap (``apt-get install bubblewrap``), additionally: new
  user/PID/network/IPC/UTS/cgroup namespaces (no network, no host processes,
  everything dies with the sandbox), no capabilities, only /usr, /etc, /bin-like
  dirs and the interpreter's prefix mounted read-only, and a private writable
  /tmp (the work dir).

NOT isolated
* Without bubblewrap: the network, the host filesystem as far as the child's uid
  may read/write it (e.g. world-writable /tmp), other processes of that uid (all
  sandboxes share it, and its RLIMIT_NPROC count: a fork bomb in one makes forks
  fail in concurrent ones), and a grandchild that double-forks into a new
  session escapes the kill.  A one-time warning says so.
* ``sys.exit(0)``/``os._exit(0)`` before the tests fails, because success also
  needs a per-run token the trusted wrapper prints after them; but code that
  deliberately digs the token out of the wrapper's memory could forge it.
* Kernel/CPU side channels: bubblewrap is a namespace sandbox, not a VM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

logger = logging.getLogger(__name__)

__all__ = ["SandboxLimits", "code_execution_reward", "extract_code", "make_code_execution_reward"]


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    file_size_bytes: int = 16 << 20  # RLIMIT_FSIZE, also bounds captured output
    max_processes: int = 32  # RLIMIT_NPROC (threads count too)


@dataclasses.dataclass(frozen=True)
class _Mode:
    bubblewrap: bool
    uid: int | None  # uid/gid to drop to, None = keep ours
    python: str


_NOBODY = 65534
_WORK = "/tmp"  # where the work dir appears inside bubblewrap
# Opening fence at line start (any info string), body up to the next fence line or
# end of text (a truncated completion may never close its block).
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.M | re.S)
_PY_TAGS = {"", "python", "py", "python3"}

# Trusted wrapper run as `python -I -S -c _WRAPPER cpu mem fsize nproc file`.  Limits
# are set here rather than in a preexec_fn (unsafe with threads) and after
# bubblewrap created the user namespace, so RLIMIT_NPROC counts per sandbox.  The
# token is only printed if the solution+tests ran to the end, which defeats
# sys.exit(0)/os._exit(0) before the asserts.  Kept inside a function so the
# token is not a module global the solution could import.
_WRAPPER = r"""
import os, resource, sys
def main():
    R = resource
    for res, lim in zip((R.RLIMIT_CPU, R.RLIMIT_AS, R.RLIMIT_FSIZE, R.RLIMIT_NPROC, R.RLIMIT_CORE),
                        [int(a) for a in sys.argv[1:5]] + [0]):
        hard = R.getrlimit(res)[1]
        lim = lim if hard == R.RLIM_INFINITY else min(lim, hard)
        R.setrlimit(res, (lim, lim))
    token = sys.stdin.readline().strip()
    path = sys.argv[5]
    sys.argv[:] = [path]
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
    sys.stdout.flush(); sys.stderr.flush()
    os.write(1, ("\n" + token + "\n").encode())
main()
"""


def extract_code(text: str) -> str:
    """Last ```python / untagged fenced block of ``text``, or the whole text if none."""
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _PY_TAGS]
    return textwrap.dedent(blocks[-1]) if blocks else text


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    content = completion[-1]["content"] if completion else ""  # conversational
    if isinstance(content, list):  # multimodal-style [{"type": "text", "text": ...}]
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _bwrap_argv(mode: _Mode, work: str) -> list[str]:
    argv = [
        "bwrap",
        "--unshare-all",  # new user/pid/net/ipc/uts/cgroup namespaces: no network, no host pids
        "--die-with-parent",  # trainer dies -> sandbox dies
        "--new-session",  # no controlling tty (TIOCSTI injection)
        "--cap-drop",
        "ALL",  # bwrap keeps all capabilities when started as root
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        _WORK,
        "--setenv",
        "TMPDIR",
        _WORK,
        "--ro-bind",
        "/usr",
        "/usr",
        "--ro-bind-try",
        "/etc",
        "/etc",
    ]
    # Merged-/usr systems have /bin etc. as symlinks; recreate them as such.
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    # The interpreter may live outside /usr (pyenv, conda, uv): bind its prefixes.
    prefixes = {os.path.dirname(os.path.dirname(mode.python))}
    if mode.python == os.path.realpath(sys.executable):
        prefixes.add(os.path.realpath(sys.base_prefix))  # its stdlib
    for prefix in prefixes:
        if prefix not in ("/", "/usr") and not prefix.startswith("/usr/"):
            argv += ["--ro-bind-try", prefix, prefix]
    return [*argv, "--proc", "/proc", "--dev", "/dev", "--bind", work, _WORK, "--chdir", _WORK, "--"]


def _kill_session(sid: int) -> None:
    """SIGKILL every process whose process group or session is ``sid``."""
    for _ in range(3):  # repeat: a member may fork while we scan
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
                if sid in (int(fields[2]), int(fields[3])):
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except (OSError, IndexError, ValueError):
                continue  # process vanished or is not ours
        if not found:
            return


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait for ``pid`` to exit without reaping it, so its pid (= our pgid/sid
    handle) cannot be recycled before we kill the group.  True if it exited."""
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _run(source: str, limits: SandboxLimits, mode: _Mode) -> tuple[bool, str]:
    """Run ``source`` once in the sandbox; return (passed, output tail)."""
    tmp = tempfile.mkdtemp(prefix="grpokit-sandbox-")
    try:
        work = os.path.join(tmp, "work")  # only this dir is visible/writable to the child
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "solution.py"), "w") as f:
            f.write(source)
        if mode.uid is not None:
            os.chown(work, mode.uid, mode.uid)
            os.chmod(tmp, 0o711)  # the dropped uid (and bwrap) must traverse to work/
        token = secrets.token_hex(16)
        rlimits = (
            max(1, math.ceil(limits.cpu_seconds)),
            limits.memory_bytes,
            limits.file_size_bytes,
            limits.max_processes,
        )
        argv = [mode.python, "-I", "-S", "-c", _WRAPPER, *map(str, map(int, rlimits)), "solution.py"]
        if mode.bubblewrap:
            argv = _bwrap_argv(mode, work) + argv
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work}
        drop = {} if mode.uid is None else {"user": mode.uid, "group": mode.uid, "extra_groups": []}
        # Output goes to a file outside the work dir (bounded by RLIMIT_FSIZE), never a
        # pipe: a chatty child cannot deadlock us.
        with open(os.path.join(tmp, "out"), "w+b") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=work,
                env=env,
                start_new_session=True,
                **drop,
            )
            try:
                proc.stdin.write(token.encode() + b"\n")
                proc.stdin.close()
            except OSError:
                pass  # child already died
            exited = _wait_unreaped(proc.pid, limits.wall_seconds)
            # Kill the whole group whatever happened, so no stray children survive.
            # Bubblewrap: killing bwrap tears down its PID namespace (--die-with-parent).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if not mode.bubblewrap:
                _kill_session(proc.pid)
            proc.wait()
            out.seek(max(0, out.seek(0, os.SEEK_END) - 65536))
            tail = out.read().decode(errors="replace")
        return exited and proc.returncode == 0 and token in tail, tail
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_warn_lock = threading.Lock()
_warned = False


def _warn_weak_isolation(reason: str) -> None:
    global _warned
    with _warn_lock:
        if not _warned:
            _warned = True
            warnings.warn(
                f"grpokit code_execution_reward: {reason}; generated code runs with resource "
                "limits only (no network, filesystem or PID isolation). Install bubblewrap "
                "(apt-get install bubblewrap) for a real sandbox.",
                RuntimeWarning,
                stacklevel=5,
            )


def _resolve_mode(limits: SandboxLimits, use_bubblewrap: bool | None, require_bubblewrap: bool) -> _Mode:
    """Pick the strongest configuration that actually runs a trivial program here."""
    python = os.path.realpath(sys.executable)
    # As nobody our interpreter may be unreachable (e.g. under /root): then try the
    # system one rather than give up the uid drop.
    system_py = shutil.which("python3", path="/usr/bin:/bin")
    pythons = list(dict.fromkeys([python] + ([os.path.realpath(system_py)] if system_py else [])))
    uids = [_NOBODY, None] if os.geteuid() == 0 else [None]
    wraps = [True] if use_bubblewrap is not False and shutil.which("bwrap") else []
    wraps += [] if require_bubblewrap else [False]
    candidates = [
        _Mode(bw, uid, py) for bw in wraps for uid in uids for py in (pythons if uid is not None else [python])
    ]
    errors = []
    for mode in candidates:
        try:
            ok, tail = _run("pass", limits, mode)
        except OSError as e:  # e.g. interpreter not executable by the dropped uid
            ok, tail = False, str(e)
        if ok:
            if not mode.bubblewrap:
                _warn_weak_isolation(
                    "bubblewrap disabled"
                    if use_bubblewrap is False
                    else "bubblewrap (bwrap) is missing or unusable here"
                )
                if errors:
                    logger.warning("bubblewrap failed: %s", "; ".join(errors))
            if mode.uid is None and os.geteuid() == 0:
                logger.warning(
                    "code_execution_reward: sandboxed code runs as root (uid drop failed); "
                    "RLIMIT_NPROC is not enforced for root"
                )
            logger.info("code_execution_reward sandbox: %s", mode)
            return mode
        errors.append(f"{mode}: {tail[-500:]!r}")
    what = "bubblewrap sandbox" if require_bubblewrap else "sandbox"
    errors = errors or ["bwrap not found"]
    raise RuntimeError(f"no working {what} for code_execution_reward:\n" + "\n".join(errors))


def make_code_execution_reward(
    limits: SandboxLimits = SandboxLimits(),
    workers: int | None = None,
    require_bubblewrap: bool = False,
    use_bubblewrap: bool | None = None,
):
    """Build a TRL-style reward ``f(completions, tests, **kwargs) -> list[float]``.

    ``use_bubblewrap``: None = use it if it works, False = never (resource limits
    only).  ``require_bubblewrap=True`` raises RuntimeError on first call instead of
    falling back.  The sandbox is probed lazily on the first call and cached.
    A batch takes at most about ceil(len/workers) * (wall_seconds + startup).
    """
    if require_bubblewrap and use_bubblewrap is False:
        raise ValueError("require_bubblewrap=True contradicts use_bubblewrap=False")
    workers = max(1, workers or os.cpu_count() or 1)
    lock, resolved = threading.Lock(), []

    def sandbox_mode() -> _Mode:
        with lock:
            if not resolved:
                resolved.append(_resolve_mode(limits, use_bubblewrap, require_bubblewrap))
            return resolved[0]

    def score(completion, test) -> float:
        if isinstance(test, (list, tuple)):  # e.g. MBPP-style list of assert strings
            test = "\n".join(test)
        source = extract_code(_completion_text(completion)) + "\n\n" + (test or "") + "\n"
        try:
            return 1.0 if _run(source, limits, sandbox_mode())[0] else 0.0
        except OSError:  # infrastructure trouble (fd/disk exhaustion): score 0, keep training
            logger.exception("code_execution_reward: sandbox run failed")
            return 0.0

    def code_execution_reward(completions, tests, **kwargs) -> list[float]:
        if len(completions) != len(tests):
            raise ValueError(f"{len(completions)} completions but {len(tests)} tests")
        if not completions:
            return []
        sandbox_mode()  # probe once, outside the pool, so errors surface directly
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(completions))) as pool:
            return list(pool.map(score, completions, tests))

    code_execution_reward.sandbox_mode = sandbox_mode  # introspection for logs/tests
    return code_execution_reward


code_execution_reward = make_code_execution_reward()
