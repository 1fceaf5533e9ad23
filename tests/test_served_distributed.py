"""The served-policy check (grpokit.served) in two training processes (torchrun, gloo, CPU) under DDP, FSDP2 and
ZeRO-3: each process's engine holds a copy of the policy of its own (tests/served_helpers.py), so every push is
really checked. A healthy run logs a gap of float rounding at every step on both processes; a push lost on one
process only stops both at the next step, together, with the engine, the version, the process and its gap in the
error; the same with a producer per process sampling ahead (max_staleness=1).

The script (SCRIPT below) records what each process saw in a file of its own and exits cleanly after a
`ServedPolicyMismatch`: a process that did not raise would go on into the next step's collectives, which its peer
never enters, and the launch would run past its timeout.
"""

import json
import re
import textwrap
from pathlib import Path

import pytest
from test_distributed import FSDP2, LETTERS, launch, zero3_env

from grpokit.testing import save_tiny_model

# Several training processes: `python -m pytest -m distributed` runs them (.ci/run does, after the default suite).
pytestmark = pytest.mark.distributed

TESTS = str(Path(__file__).parent)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.served import SERVED_GAP, ServedPolicyMismatch

    RANK = int(os.environ["RANK"])


    def repeat_letter(completions, letter, **kwargs):  # a tie-break: groups whose scores differ, a policy that moves
        return [float(c[:1] == t) + 0.1 * (sum(map(ord, c)) % 7) for c, t in zip(completions, letter)]


    def train(spec, engine_model):
        sys.path.insert(0, spec["tests"])
        import served_helpers

        out = Path(spec["out"])
        out.mkdir(parents=True, exist_ok=True)
        name, options = spec["engines"][RANK]
        engine = getattr(served_helpers, name)(engine_model, **options)
        data = Dataset.from_list([{"prompt": f"{a}{b}:", "letter": a} for a in "abcdefgh" for b in "abcdefgh"])
        args = GRPOConfig(output_dir=str(out), logging_steps=1, save_strategy="no", disable_tqdm=True,
                          report_to="none", seed=0, **spec["config"])
        trainer = GRPOTrainer(model=spec["model"], reward_funcs=repeat_letter, args=args, train_dataset=data,
                              rollout_engine=engine)
        error = None
        try:
            trainer.train()
        except (ServedPolicyMismatch, RuntimeError) as raised:  # RuntimeError: a producer's, with its cause
            error = f"{type(raised).__name__}: {raised}"
        record = {
            "gaps": [entry.get(SERVED_GAP) for entry in trainer.state.log_history if "loss" in entry],
            "global_step": trainer.state.global_step,
            "error": error,
            "distributed_type": trainer.accelerator.distributed_type.value,
        }
        (out / f"result_{RANK}.json").write_text(json.dumps(record))


    if __name__ == "__main__":
        specs = json.loads(Path(sys.argv[1]).read_text())
        # The engines' copies are loaded whole before any trainer's config exists (ZeRO-3 would partition them after).
        engine_models = [AutoModelForCausalLM.from_pretrained(spec["model"]) for spec in specs]
        for spec, engine_model in zip(specs, engine_models):
            train(spec, engine_model)
        import gc

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            gc.collect()  # finished trainers first (their DDP wrappers hold the group), as test_distributed's script
            dist.barrier()
            dist.destroy_process_group()
    """
)

# 8 completions per process, 16 in all (4 prompts of G=4), one optimizer step per generation batch: the training
# forward's log-probs are π_old, and each step checks the batch it trains (`served.check_step`). Process 1's own gap
# in the step after a lost push is ~0.25 nats, the logged gap (the mean over the two processes) ~0.13: a tolerance
# between them is met only by a check of each process's own gap.
RUN = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=4,
    learning_rate=5e-2,
    lr_scheduler_type="constant",
    max_steps=3,
    served_logprob_tolerance=0.2,
)
# A producer per process samples batch n with the weights of version n - 1, its π_old a forward of its copy at that
# version (`served.check_processes` in the producer's thread, on the producers' process group). Process 1's own gap
# on the first batch after a lost push is ~0.44 nats, the mean ~0.22.
ASYNC = dict(max_staleness=1, served_logprob_tolerance=0.3)
# Each process's engine (tests/served_helpers.py) and its options.
HEALTHY = [("CopyPushEngine", {}), ("CopyPushEngine", {})]
LOST_ON_RANK_1 = [("LostPushEngine", {"lose": False}), ("LostPushEngine", {"lose": True})]
JOBS = {
    "healthy": (HEALTHY, RUN),
    "lost": (LOST_ON_RANK_1, RUN),
    "async_healthy": (HEALTHY, {**RUN, **ASYNC}),
    "async_lost": (LOST_ON_RANK_1, {**RUN, **ASYNC}),
}
BACKENDS = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}
TIMEOUT_S = 120  # a launch whose processes do not raise together never ends: the launcher stops it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=32))


@pytest.fixture(scope="module", params=list(BACKENDS))
def runs(request, model_dir, tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """Every job of JOBS in one launch under the backend: (the backend, each job's records by process)."""
    backend, directory = request.param, tmp_path_factory.mktemp(request.param)
    if backend == "zero3":
        pytest.importorskip("deepspeed")
    env = {"ddp": {}, "fsdp2": FSDP2, "zero3": zero3_env(directory) if backend == "zero3" else {}}[backend]
    specs = [
        dict(out=str(directory / name), model=model_dir, engines=engines, tests=TESTS, config=config)
        for name, (engines, config) in JOBS.items()
    ]
    launch(directory, *specs, env=env, script=SCRIPT, timeout=TIMEOUT_S)
    return backend, {
        name: [json.loads((directory / name / f"result_{rank}.json").read_text()) for rank in (0, 1)] for name in JOBS
    }


@pytest.mark.parametrize("mode", ["", "async_"], ids=["sync", "async"])
def test_a_healthy_run_logs_a_gap_of_float_rounding_at_every_step_on_every_process(runs, mode):
    """Each engine's copy gets the full weights at every push (gathered under FSDP2 and ZeRO-3): its log-probs are
    the training forward's in float32 (the lost pushes below show what a copy that does not get them measures)."""
    backend, records = runs
    for record in records[f"{mode}healthy"]:
        assert record["distributed_type"] == BACKENDS[backend]
        assert record["error"] is None and record["global_step"] == 3
        assert len(record["gaps"]) == 3 and max(record["gaps"]) < 1e-5, record["gaps"]


# Per mode: how the error starts, what π_old was, the steps logged before it.
LOST = {
    "sync": ("ServedPolicyMismatch: ", "the training forward's", 1),
    "async": ("RuntimeError: The generation producer failed: ServedPolicyMismatch: ", "a forward's", 2),
}


@pytest.mark.parametrize("mode", LOST)
def test_a_push_lost_on_one_process_stops_both_at_the_next_step_together(runs, mode):
    """The first batch is sampled with the initial weights, which process 1's engine still holds; the next with them
    again, while the policy moved. Both processes raise at the same point, with the same error, which names process
    1's own gap: in step 2, before it trains (synchronous: the training forward's gap of the step's batch), or
    when the trainer takes batch 2, sampled with version 1 (a producer running ahead: its π_old is a forward)."""
    _, records = runs
    rank0, rank1 = records["async_lost" if mode == "async" else "lost"]
    raised, where, logged = LOST[mode]
    for record in (rank0, rank1):
        assert record["global_step"] == 2 and record["error"] is not None
        assert len(record["gaps"]) == logged and max(record["gaps"]) < 1e-5  # the healthy steps'
    assert rank0["error"] == rank1["error"]
    assert rank0["error"].startswith(
        f"{raised}LostPushEngine does not sample with the weights it was sent on process 1 of 2: after the push of "
        f"the weights of version 1 (after 1 optimizer steps), its log-probs of the tokens it sampled differ from the "
        f"trainer's π_old ({where}) by "
    )
    gap = float(re.search(r"by (\S+) nats on average", rank0["error"]).group(1))
    tolerance = JOBS["async_lost" if mode == "async" else "lost"][1]["served_logprob_tolerance"]
    assert tolerance < gap < 1.0, gap
