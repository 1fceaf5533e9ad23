"""An engine in a process of its own: `ProcessEngine` runs another `RolloutEngine` (grpokit's in-process `HFEngine`)
in a child process, so that sampling and training run at once without sharing one interpreter (the sampler's
per-token Python would otherwise contend with training for the GIL). Asynchronous generation (grpokit.producer)
uses it for the default engine.

The child is forked from the trainer once, with the engine and its model already built: the model's parameters and
buffers are moved to shared memory first, so the child samples from the very tensors the parent writes. It is a CPU
engine: CUDA cannot be used in a forked child, and neither can the OpenMP thread pool the parent has used (GNU
OpenMP hangs in a child's parallel region), so the child runs its ops on one thread. Weights
therefore move by `copy_` in the parent (`sync_weights`), never while the child samples: every request waits for the
previous one (one request at a time, under a lock), and the copy takes the same lock. Requests and rollouts cross a
pipe, pickled.

Faults: a child that dies (a crash, the OOM killer, SIGKILL) is noticed while the parent waits for its reply, within
`poll_s`, and `generate` raises `EngineProcessDied` naming the signal or exit code; an exception inside the child's
engine is raised in the parent with the child's traceback as text.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import traceback

import torch

from .engine import PromptBatch, Rollout, RolloutEngine, SamplingParams


class EngineProcessDied(RuntimeError):
    """The engine's process ended while a request was in flight, or before one was sent."""


def _serve(engine: RolloutEngine, connection) -> None:
    """The child's loop: ("generate", prompts, params, seed) → ("ok", rollout) or ("error", text); ("stop",) ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it stops the child
    torch.set_num_threads(1)  # see the module's docstring: no OpenMP pool after a fork
    while True:
        try:
            request = pickle.loads(connection.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if request[0] == "stop":
            return
        try:
            reply = ("ok", engine.generate(*request[1:]))
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
            reply = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        connection.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


class ProcessEngine:
    """`engine` (built over `model`, on the CPU) run in a forked child process, on one thread. `model` must be the
    module the engine samples from: it is moved to shared memory before the fork, and new weights are copied into
    it, in this process, under `lock`."""

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, poll_s: float = 0.5):
        self.model, self.poll_s = model.share_memory(), poll_s
        self.exact_logprobs = bool(getattr(engine, "exact_logprobs", False))
        self.lock = threading.Lock()
        context = multiprocessing.get_context("fork")  # the engine, model and tokenizer are inherited, not pickled
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=_serve, args=(engine, child_end), daemon=True,
                                       name="grpokit-engine")  # fmt: skip
        self.process.start()
        child_end.close()
        self.owner = os.getpid()

    @property
    def pid(self) -> int:
        return self.process.pid

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        with self.lock:
            self._check_alive()
            try:
                self.connection.send_bytes(pickle.dumps(("generate", prompts, params, seed),
                                                        protocol=pickle.HIGHEST_PROTOCOL))  # fmt: skip
                while not self.connection.poll(self.poll_s):
                    self._check_alive()
                status, payload = pickle.loads(self.connection.recv_bytes())
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
        """Stop the child: asked first, then killed if it does not end within `timeout` (a request in progress)."""
        if self.process.is_alive():
            try:
                self.connection.send_bytes(pickle.dumps(("stop",)))
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout)
        self.connection.close()

    def _check_alive(self, wait: bool = False) -> None:
        if wait:
            self.process.join(self.poll_s)
        if self.process.is_alive():
            return
        code = self.process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
               f"exited with code {code}")  # fmt: skip
        memory = "The system may be out of memory (dmesg shows the OOM killer). " if code == -9 else ""
        raise EngineProcessDied(f"The engine process (pid {self.pid}) {how}: generation cannot go on. {memory}"
                                f"The last checkpoint is good: resume from it.")

    def __del__(self):
        process = getattr(self, "process", None)  # the forked child holds a copy of this object too: not its own
        if process is not None and getattr(self, "owner", None) == os.getpid() and process.is_alive():
            process.kill()
