"""Atomic checkpoints: written under a temporary name, completed by a manifest, then renamed into place.

A directory `checkpoint-<step>` exists only once everything in it was written and fsynced, so a process killed at
any moment leaves either a complete checkpoint or a `.tmp-checkpoint-<step>-*` directory that resuming ignores
(with a warning) and the next save removes. `manifest.json` lists every file with its size; a checkpoint whose
files do not match it is treated as incomplete.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
MANIFEST = "manifest.json"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(output_dir: str | Path, step: int, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)` to fill a checkpoint, then publish it atomically as output_dir/checkpoint-<step>."""
    tmp = begin_checkpoint(output_dir, step)
    write(tmp)
    return finish_checkpoint(output_dir, step, tmp)


def begin_checkpoint(output_dir: str | Path, step: int) -> Path:
    """The temporary directory a checkpoint is written into (debris of earlier killed saves removed)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    for stale in output_dir.glob(f"{TMP_PREFIX}*"):  # debris of a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{step}-", dir=output_dir))


def finish_checkpoint(output_dir: str | Path, step: int, tmp: Path) -> Path:
    """fsync what `tmp` holds, list it in a manifest, and rename it to output_dir/checkpoint-<step>."""
    output_dir = Path(output_dir)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        files[str(path.relative_to(tmp))] = path.stat().st_size
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    with open(manifest, "rb") as handle:
        os.fsync(handle.fileno())
    _fsync_dir(tmp)
    final = output_dir / f"{PREFIX}{step}"
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(output_dir)
    return final


def is_complete(checkpoint: Path) -> bool:
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all(
        (checkpoint / name).is_file() and (checkpoint / name).stat().st_size == size for name, size in files.items()
    )


def _step_of(path: Path) -> int:
    match = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = sorted((p for p in output_dir.iterdir() if p.is_dir() and _step_of(p) >= 0), key=_step_of)
    return [p for p in found if is_complete(p)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    # Said whether or not a complete checkpoint comes before it: an interrupted save is worth knowing about even
    # when the run resumes from an older complete checkpoint.
    for partial in sorted(output_dir.glob(f"{TMP_PREFIX}*")):
        warnings.warn(
            f"Skipping partial checkpoint {partial}: a save was interrupted there (the next save removes it).",
            stacklevel=2,
        )
    candidates = sorted((p for p in output_dir.iterdir() if p.is_dir() and _step_of(p) >= 0), key=_step_of)
    for path in reversed(candidates):
        if is_complete(path):
            return path
        warnings.warn(
            f"Skipping incomplete checkpoint {path} (no valid manifest): it was not finished writing.", stacklevel=2
        )
    return None


def rotate_checkpoints(output_dir: str | Path, keep: int | None, protect: str | Path | None = None) -> None:
    """Delete the oldest complete checkpoints beyond `keep`; the newest complete one always stays, and so does
    `protect` (the best checkpoint: then the newest keep - 1 others stay with it, as in transformers)."""
    if keep is None:
        return
    complete = list_checkpoints(output_dir)
    protected = [c for c in complete if protect is not None and c.resolve() == Path(protect).resolve()]
    others = [c for c in complete if c not in protected]
    kept_others = max(keep, 1) - len(protected)  # the protected one counts among the kept...
    if protected and protected[0] != complete[-1]:
        kept_others = max(kept_others, 1)  # ...but never at the newest one's expense
    for old in others[: max(len(others) - kept_others, 0)]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
