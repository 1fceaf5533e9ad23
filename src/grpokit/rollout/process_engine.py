"""An engine in a process of its own: `ProcessEngine` runs another `RolloutEngine` (grpokit's in-process `HFEngine`)
in a child process, so that sampling and training run at once without sharing one interpreter (the sampler's
per-token Python would otherwise contend with training for the GIL). Asynchronous generation (grpokit.producer)
uses it for the default engine, on the CPU.

The child is forked from a server process (multiprocessing's forkserver; spawned where the platform has none), never
from the trainer: by the time a run starts it, the trainer has threads (the producer's, tqdm's monitor, the
tokenizers' pool, an agent endpoint's server, OpenMP's), and a fork copies the locks they hold (Python's, a native
library's) into a child that has no thread to release them: the child can deadlock. The server is a new interpreter
with one thread that imports torch, transformers, grpokit's sampler and the model's module once per Python process
(`start_engine_server`; the trainer starts it as it is built, so that those imports, seconds, run beside loading the
model), and forks a child per engine in milliseconds. A child gets the server's environment variables, those of
the time the server started. The engine is pickled to the child with torch.multiprocessing's reductions: the
model's parameters and buffers, moved to shared memory first, travel as handles to that memory, so the child
samples from the very storage the parent writes (`HFEngine` pickles its autocast as the autocast state it sets;
transformers' input-require-grads hook, a local function, travels as an equivalent one: `EnginePickler`). A child
imports the script that started it again (as `__mp_main__`, for the classes it may define); the engine process
does so only when the model or the engine uses a class defined in that script, and a script that trains at top
level must then do so under `if __name__ == "__main__":`. Otherwise the script is hidden from the child while it
starts.

The child runs its ops on one thread, leaving the cores to the trainer's ops that run meanwhile. Weights move by
`copy_` in the parent (`sync_weights`), never while the child samples: every request waits for the previous one (one
request at a time, under a lock), and the copy takes the same lock. Requests and rollouts cross a pipe, pickled.

Faults: a child that dies (a crash, the OOM killer, SIGKILL) is noticed while the parent waits for its reply, within
`poll_s`, and `generate` raises `EngineProcessDied` naming the signal or exit code; an exception inside the child's
engine is raised in the parent with the child's traceback as text. A child that is alive but does not answer a
request within `request_timeout_s` (a hang in the sampler) is killed, and `generate` raises `EngineProcessHung`.
`close` is bounded: a request in flight that does not end within its timeout has the child killed.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers the reductions that pickle shared-memory tensors as handles

from .engine import PromptBatch, Rollout, RolloutEngine, SamplingParams, engine_logprobs_match_training

# GRPOConfig.heartbeat_stale_after_s's default: one request that takes longer would stop the run anyway.
REQUEST_TIMEOUT_S = 300.0
START_TIMEOUT_S = 300.0  # the child imports torch and transformers: seconds, more on a loaded machine


# What the server the engine processes are forked from imports once (`start_engine_server`), besides the model's module.
SERVER_MODULES = ("torch", "transformers.modeling_utils", "grpokit.rollout.hf")


def engine_context():
    """The multiprocessing context engine processes start in: forked from a clean server (forkserver) where the
    platform has one, else spawned."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return torch.multiprocessing.get_context(method)


def start_engine_server(modules=()) -> None:
    """Start, once per Python process and without waiting for it, the server engine processes are forked from,
    importing `SERVER_MODULES` and `modules` (module names; a script's own `__main__` is never imported) in it
    meanwhile. A server already running (started by an earlier engine, or by other code of this process) is kept
    as it is: what it lacks, a child imports as it starts."""
    context = engine_context()
    if context.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # Private in CPython (3.10-3.13 checked): where it is missing, the preload is set as if no server ran yet.
    running = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None) is not None
    if not running:
        wanted = [*SERVER_MODULES, *modules]
        context.set_forkserver_preload([m for m in dict.fromkeys(wanted) if m not in ("__main__", "__mp_main__")])
    forkserver.ensure_running()


class EngineProcessDied(RuntimeError):
    """The engine's process ended while a request was in flight, or before one was sent."""


class EngineProcessHung(EngineProcessDied):
    """The engine's process did not answer a request (or did not start) in time, and was killed."""


# transformers' `enable_input_require_grads` (which gradient checkpointing calls) hooks the input embeddings with a
# local function, which pickle cannot name: the engine process gets `EnginePickler.inputs_require_grads`, its body.
INPUTS_REQUIRE_GRADS = "PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads"


class EnginePickler(ForkingPickler):
    """torch.multiprocessing's pickler (shared-memory tensors as file descriptors), which also pickles transformers'
    input-require-grads hook."""

    @staticmethod
    def inputs_require_grads(module, inputs, output):
        output.requires_grad_(True)

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and obj.__qualname__ == INPUTS_REQUIRE_GRADS:
            return getattr, (EnginePickler, "inputs_require_grads")
        return NotImplemented


class PickledEngine:
    """An engine, pickled by `EnginePickler` as the child is started (so that its tensors' file descriptors are
    passed to the child with it) and unpickled by the child in `_serve`, which reports a failure to the parent."""

    def __init__(self, engine: RolloutEngine | None = None, data: bytes = b""):
        self.engine, self.data = engine, data

    def __reduce__(self):
        buffer = io.BytesIO()
        EnginePickler(buffer, pickle.HIGHEST_PROTOCOL).dump(self.engine)
        return PickledEngine, (None, buffer.getvalue())


def _serve(pickled: PickledEngine, connection) -> None:
    """The child: ("ready",) or ("error", text) once the engine is rebuilt; then ("generate", prompts, params, seed)
    → ("ok", rollout) or ("error", text), until ("stop",) or the parent's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops the child
    torch.set_num_threads(1)  # one thread beside the trainer's (see the module's docstring)
    try:
        engine = pickle.loads(pickled.data)
        reply = ("ready",)
    except BaseException as error:
        engine, reply = None, ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
    connection.send_bytes(pickle.dumps(reply))
    while engine is not None:
        try:
            request = pickle.loads(connection.recv_bytes())
        except EOFError:  # the parent is gone
            break
        if request[0] == "stop":
            break
        try:
            reply = ("ok", engine.generate(*request[1:]))
        except BaseException as error:
            reply = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        connection.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    # Nothing to clean up: end at once rather than tear down an interpreter that imported torch (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def _script_not_reimported(engine, model: torch.nn.Module):
    """While the child is started: unless the engine or the model uses a class defined in the script itself (which
    the child can only find by importing the script), the script is hidden from multiprocessing's preparation data,
    so that the child does not run it again; a script that trains at top level then needs no `__main__` guard."""
    main = sys.modules.get("__main__")
    classes = [type(engine)] + [type(m) for m in model.modules()]
    if main is None or any(c.__module__ == "__main__" for c in classes):
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class ProcessEngine:
    """`engine` (built over `model`, on the CPU) run in a child process (`engine_context`), on one thread. `model`
    must be the module the engine samples from: it is moved to shared memory and the engine pickled to the child,
    and new weights are copied into it, in this process, under `lock`. A request that gets no answer within
    `request_timeout_s` (None: no limit) kills the child; so does a start that takes longer than `start_timeout_s`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        model: torch.nn.Module,
        poll_s: float = 0.5,
        request_timeout_s: float | None = REQUEST_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        self.model, self.poll_s, self.request_timeout_s = model.share_memory(), poll_s, request_timeout_s
        self.logprobs_match_training = engine_logprobs_match_training(engine)
        self.lock = threading.Lock()
        self.ended: EngineProcessDied | None = None  # why this side ended the child, if it did: raised again
        start_engine_server([type(engine).__module__, *{type(m).__module__ for m in model.modules()}])
        context = engine_context()
        self.connection, child_end = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(PickledEngine(engine), child_end), daemon=True, name="grpokit-engine"
        )
        try:
            with _script_not_reimported(engine, model):
                self.process.start()  # pickles the engine, before the child exists
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            self.connection.close()
            raise TypeError(
                f"{type(engine).__name__} cannot be pickled to the engine process, which needs it to be: {error}"
            ) from error
        finally:
            child_end.close()
        self.owner = os.getpid()
        try:
            try:
                status = self._reply(start_timeout_s, starting=True)
            except EOFError:
                self._check_alive(wait=True, starting=True)
                raise
            if status[0] == "error":
                raise EngineProcessDied(
                    f"The engine process (pid {self.pid}) could not rebuild the "
                    f"{type(engine).__name__} it was sent:\n{status[1]}"
                )
        except BaseException:
            self.close(timeout=0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        request = pickle.dumps(("generate", prompts, params, seed), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            self._check_alive()
            try:
                self.connection.send_bytes(request)
                status, payload = self._reply(self.request_timeout_s)
            except (EOFError, BrokenPipeError, ConnectionResetError):
                self._check_alive(wait=True)
                raise
        if status == "error":
            raise RuntimeError(f"The engine process (pid {self.pid}) raised:\n{payload}")
        return payload

    def sync_weights(self, model: torch.nn.Module) -> None:
        """`model`'s weights into the shared ones, between requests (nothing to do for the shared model itself,
        which the producer updates in place under `lock`)."""
        if model is not self.model:
            with self.lock:
                self.model.load_state_dict(model.state_dict())

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child: asked between requests; killed if a request in flight does not end within `timeout` (its
        `generate` then raises `EngineProcessDied`) or if it does not stop within `timeout` when asked. Never waits
        for the lock unbounded: it returns within about `timeout` + `poll_s` when a request is in flight."""
        idle = self.lock.acquire(timeout=timeout)
        try:
            if self.ended is None:
                self.ended = EngineProcessDied(f"The engine process (pid {self.pid}) was closed (ProcessEngine.close).")
            if idle and self.process.is_alive():
                with contextlib.suppress(OSError):
                    self.connection.send_bytes(pickle.dumps(("stop",)))
                self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)
            if not idle:  # the request in flight sees the child gone within poll_s
                idle = self.lock.acquire(timeout=self.poll_s + timeout)
        finally:
            if idle:
                self.connection.close()
                self.lock.release()

    def _reply(self, timeout: float | None, starting: bool = False):
        """The child's next message; the child is killed and `EngineProcessHung` raised if none comes within
        `timeout` seconds, and `EngineProcessDied` raised if it dies meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.connection.poll(
            self.poll_s if deadline is None else min(self.poll_s, max(deadline - time.monotonic(), 0.0))
        ):
            self._check_alive(starting=starting)
            if deadline is not None and time.monotonic() >= deadline:
                self.ended = EngineProcessHung(
                    f"The engine process (pid {self.pid}) did not start within {timeout} s (start_timeout_s): it "
                    f"was killed (SIGKILL)."
                    if starting
                    else f"The engine process (pid {self.pid}) did not answer a request within {timeout} s: it was "
                    f"killed (SIGKILL). Its sampler hung (a deadlock), or one request takes longer than that. The last "
                    f"checkpoint is good: resume from it. If requests are that slow, raise the timeout (GRPOConfig's "
                    f"heartbeat_stale_after_s, which the producer passes as request_timeout_s)."
                )
                self.process.kill()
                self._check_alive(wait=True)
        return pickle.loads(self.connection.recv_bytes())

    def _check_alive(self, wait: bool = False, starting: bool = False) -> None:
        if wait:
            self.process.join(self.poll_s)
        if self.process.is_alive():
            return
        if self.ended is not None:
            raise type(self.ended)(*self.ended.args)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
        if starting:
            raise EngineProcessDied(
                f"The engine process (pid {self.pid}) {how} while starting (its traceback, if "
                f"any, is above). If it shows your script running again, start training "
                f"under `if __name__ == '__main__':` (an engine process imports a script that "
                f"defines the model's classes)."
            )
        memory = "The system may be out of memory (dmesg shows the OOM killer). " if code == -9 else ""
        raise EngineProcessDied(
            f"The engine process (pid {self.pid}) {how}: generation cannot go on. {memory}"
            f"The last checkpoint is good: resume from it."
        )

    def __del__(self):
        # A process forked from this one later (a DataLoader worker) holds a copy of this object, not its child.
        try:
            if self.owner == os.getpid() and self.process.is_alive():
                self.process.kill()
        except AttributeError:  # a constructor that failed; or interpreter exit, after multiprocessing ended it
            pass
