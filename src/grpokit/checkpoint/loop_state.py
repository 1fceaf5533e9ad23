"""The training loop's part of a checkpoint, besides the weights, optimizer and `TrainerState` that the
`Checkpointer` saves itself: where the loop is in its generation batches, what the logging window holds, the
adaptive entropy controller, and under asynchronous generation the batches in flight. `loop_state` gives it to
`Checkpointer.save`; `restore_loop` puts back what `Checkpointer.load` read, so a resumed run takes exactly the
micro-batches the interrupted one would have taken next."""

from __future__ import annotations


def loop_state(generation, window, entropy_controller, producer, step: int) -> tuple[dict, dict]:
    """(loop, process) for `Checkpointer.save`. `loop`, the same on every process: `generation`'s position (its
    sampler's, the pass and micro-batch), the logging `window`'s pending metrics, the `entropy_controller`'s state
    (None: a fixed coefficient). `process`, this process's own: its half-used generation batch, and the batches in
    flight that a resumed run could not sample again (`producer`, under max_staleness; None without one)."""
    position = generation.state_dict()
    process = {"batch": position.pop("batch")}  # each process's own slice of the generation batch
    loop = {
        **position,
        "window": window.state_dict(),
        "entropy_controller": None if entropy_controller is None else entropy_controller.state_dict(),
    }
    if producer is not None:
        process["in_flight"] = producer.checkpoint_state(step)
    return loop, process


def restore_loop(resumed, generation, window, entropy_controller, device) -> list[dict]:
    """Put back what `loop_state` saved (`resumed`: `Checkpointer.load`'s; this process's generation batch onto
    `device`); returns the batches that were in flight (their state dicts, for the producer to start with; [] when
    none)."""
    process = resumed.process or {}
    generation.load_state_dict({**resumed.loop, "batch": process.get("batch")}, device)
    window.load_state_dict(resumed.loop["window"])
    if entropy_controller is not None and resumed.loop.get("entropy_controller"):
        entropy_controller.load_state_dict(resumed.loop["entropy_controller"])
    return process.get("in_flight") or []
