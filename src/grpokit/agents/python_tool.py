"""The built-in `python` tool: the model runs Python code and reads what it printed, in grpokit's sandbox
(grpokit.rewards.code: a fresh `python -I -S` process under rlimits on CPU time, memory, file size and processes,
a wall-clock limit and a kill of its whole process group; inside bubblewrap namespaces — no network, no host
files, no host processes — where bubblewrap works). Any tool that runs model-written code needs this isolation;
tools that only read data you control do not.

    from grpokit.agents import python_tool
    GRPOTrainer(..., tools=[python_tool()])
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..rewards.code import SandboxLimits, _resolve_mode, _run


def python_tool(
    limits: SandboxLimits = SandboxLimits(),
    use_bubblewrap: bool | None = None,
    require_bubblewrap: bool = False,
    max_output_chars: int = 2000,
) -> Callable[[str], str]:
    """A tool named `python` that runs its `code` argument in the sandbox and returns the output (stdout and
    stderr together, the last max_output_chars characters); a run that fails returns its output (e.g. the
    traceback) and says how it ended. The sandbox is probed on the first call."""
    lock, resolved = threading.Lock(), []

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it printed.

        Args:
            code: the Python program to run; use print() to show results
        """
        with lock:
            if not resolved:
                resolved.append(_resolve_mode(limits, use_bubblewrap, require_bubblewrap))
        passed, output = _run(code, limits, resolved[0])
        if passed:  # the wrapper ends a run that got through with "\n<token>\n": not the program's output
            output = output.rstrip("\n")
            output = output[: output.rfind("\n")]
        else:
            output += (
                f"\n[the program failed, or was stopped at {limits.wall_seconds:g} s wall / {limits.cpu_seconds} s CPU]"
            )
        return output[-max_output_chars:]

    return python
