"""Just-in-time checkpoints on preemption (`enable_jit_checkpoint`, transformers' field).

Schedulers (Slurm's `--signal=TERM@<seconds>`, Kubernetes' termination grace period) send SIGTERM some time before
they kill a job. While `train()` runs with this on, SIGTERM only raises a flag; at the end of the optimizer step
under way the trainer saves a checkpoint and returns, and the run resumes from it (`resume_from_checkpoint`) as from
any other. Checkpoints are atomic, so a save cut short by the kill leaves no checkpoint that looks complete, and there
is no need for transformers' wait before starting to save. The previous SIGTERM handler is back when `train()` ends,
however it ends.
"""

from __future__ import annotations

import signal
import threading


class SigtermCheckpoint:
    """Context manager: inside it SIGTERM sets `requested` instead of ending the process."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> SigtermCheckpoint:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "enable_jit_checkpoint=True needs train() to run in the main thread (Python delivers "
                "signals there only); call train() from the main thread or set "
                "enable_jit_checkpoint=False."
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc_info) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True
