"""Asynchronous generation (max_staleness) in two training processes (torchrun, gloo, CPU): one producer per process
over its share of each generation batch, gathering on a process group of its own.

Evidence comes from test_distributed's script (weights per rank, the rows each rank's reward function saw, each
generation batch's advantages): at max_staleness=0 two processes are the synchronous two-process loop bitwise; at
max_staleness=1 both ranks end identical, every batch after the first is one version stale, advantages come from the
whole group across the processes, and a run resumed from a checkpoint (batches in flight) ends on the unbroken run's
weights. A producer that fails on one process stops every process with its cause, and the last checkpoint resumes.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from ports import free_port
from test_distributed import (
    DEEPSPEED_ZERO2,
    FSDP2,
    LETTERS,
    launch,
    load,
    max_difference,
    write_script,
    zero3_env,
)

from grpokit import group_advantages
from grpokit.testing import save_tiny_model

# Several training processes: `python -m pytest -m distributed` runs them (.ci/run does, after the default suite).
pytestmark = pytest.mark.distributed

# 12 completions per process, 24 in all: 3 prompts of G=8, the second one's group spanning the processes (8 + 4 | 4
# + 8); one optimizer step per generation batch, as asynchronous generation needs.
RUN = dict(
    per_device_train_batch_size=12,
    num_generations=8,
    learning_rate=1e-2,
    max_steps=6,
    save_strategy="steps",
    save_steps=1,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=32))


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """One torchrun launch, three jobs in the same two processes: synchronous, max_staleness=0, max_staleness=1."""
    directory = tmp_path_factory.mktemp("async2")
    jobs = {"sync": {}, "k0": {"max_staleness": 0}, "k1": {"max_staleness": 1}}
    launch(
        directory,
        *(
            dict(job="train", model=model_dir, out=str(directory / name), config={**RUN, **extra}, tiebreak=0.01)
            for name, extra in jobs.items()
        ),
    )
    return directory


def test_staleness_zero_in_two_processes_is_the_synchronous_two_process_loop_bitwise(runs):
    for rank in (0, 1):
        sync, k0 = load(runs / "sync" / f"final_{rank}.pt"), load(runs / "k0" / f"final_{rank}.pt")
        assert max_difference(sync["weights"], k0["weights"]) == 0.0
        assert [e["loss"] for e in k0["log_history"]] == [e["loss"] for e in sync["log_history"]]
        assert [e["reward"] for e in k0["log_history"]] == [e["reward"] for e in sync["log_history"]]
        assert [e["sample/staleness_max"] for e in k0["log_history"]] == [0] * 6


def test_staleness_one_in_two_processes_keeps_ranks_identical_and_every_batch_one_version_behind(runs):
    rank0, rank1 = load(runs / "k1" / "final_0.pt"), load(runs / "k1" / "final_1.pt")
    assert rank0["global_step"] == rank1["global_step"] == 6
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    # The exact schedule: batch n sampled by the weights of version n - 1 on both processes, whatever the timing.
    for rank in (rank0, rank1):
        assert [e["sample/staleness_max"] for e in rank["log_history"]] == [0, 1, 1, 1, 1, 1]
    sync = load(runs / "sync" / "final_0.pt")
    assert max_difference(rank0["weights"], sync["weights"]) > 1e-4  # stale batches: another run than the loop's
    # Both processes log the same records (metrics reduced over the processes, on the producers' group).
    assert [e["reward"] for e in rank0["log_history"]] == [e["reward"] for e in rank1["log_history"]]


def test_each_process_scores_its_share_and_advantages_use_the_whole_group_across_processes(runs):
    out = runs / "k1"
    calls = [[json.loads(line) for line in (out / f"rewards_{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)]
    batches = [load(out / f"final_{rank}.pt")["batches"] for rank in (0, 1)]
    # 6 batches trained; the producers may have sampled one more ahead before training stopped.
    assert len(batches[0]) == len(batches[1]) == 6 and len(calls[0]) == len(calls[1]) >= 6
    for call0, call1, batch0, batch1 in zip(*calls, *batches):
        prompts = call0["prompts"] + call1["prompts"]
        distinct = list(dict.fromkeys(prompts))
        assert prompts == [p for p in distinct for _ in range(8)] and len(distinct) == 3
        assert call0["prompts"][-1] == call1["prompts"][0]  # the middle group spans the two processes
        expected = group_advantages(torch.tensor(call0["scores"] + call1["scores"]), 8)
        for prompt in distinct:
            got = [a for b in (batch0, batch1) for p, a in zip(b["prompts"], b["advantages"]) if p == prompt]
            want = expected[[p == prompt for p in prompts]].tolist()
            assert sorted(got) == pytest.approx(sorted(want), abs=1e-5), prompt
    spanning = [s for call0, call1 in zip(*calls) for s in (call0["scores"][-4:] + call1["scores"][:4])]
    assert torch.tensor(spanning).std() > 0  # the spanning groups' advantages are not trivially zero


def test_a_two_process_asynchronous_run_resumed_from_a_checkpoint_ends_on_the_unbroken_runs_weights(
    runs, model_dir, tmp_path
):
    # checkpoint-3 holds, on each process, the batch sampled ahead by version 3 - 1 = 2 (the weights it no longer has).
    saved = torch.load(runs / "k1" / "checkpoint-3" / "generation_state.pt", weights_only=False)
    assert [[b["index"] for b in p["in_flight"]] for p in saved["processes"]] == [[3], [3]]
    spec = dict(
        job="train",
        model=model_dir,
        out=str(tmp_path / "out"),
        config={**RUN, "max_staleness": 1},
        tiebreak=0.01,
        resume=str(runs / "k1" / "checkpoint-3"),
    )
    launch(tmp_path, spec)
    for rank in (0, 1):
        resumed, unbroken = load(tmp_path / "out" / f"final_{rank}.pt"), load(runs / "k1" / f"final_{rank}.pt")
        assert resumed["global_step"] == 6
        assert max_difference(resumed["weights"], unbroken["weights"]) == 0.0
        assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in unbroken["log_history"]]


@pytest.fixture(scope="module")
def fsdp2_runs(model_dir, tmp_path_factory):
    """k=0 and k=1 under FSDP2 (parameters sharded over the two processes)."""
    directory = tmp_path_factory.mktemp("async_fsdp2")
    jobs = {"k0": {"max_staleness": 0}, "k1": {"max_staleness": 1}}
    launch(
        directory,
        *(
            dict(job="train", model=model_dir, out=str(directory / name), config={**RUN, **extra}, tiebreak=0.01)
            for name, extra in jobs.items()
        ),
        env=FSDP2,
    )
    return directory


def test_under_fsdp2_the_producers_sample_gathered_weights_as_ddps_do(fsdp2_runs, runs):
    # The producers' copies are whole models taken before sharding; the trainer gathers each scheduled version's
    # weights (a collective of its own thread) and hands them over. Each run is the one DDP gives (same seeds, same
    # schedule; tests/test_distributed.py shows FSDP2's synchronous run following DDP's), up to reduce-scatter's
    # rounding against all-reduce: k=0 DDP's synchronous run, k=1 DDP's k=1.
    for name, ddp_name in (("k0", "sync"), ("k1", "k1")):
        fsdp2, ddp = load(fsdp2_runs / name / "final_0.pt"), load(runs / ddp_name / "final_0.pt")
        assert fsdp2["distributed_type"] == "FSDP" and fsdp2["global_step"] == 6
        assert [e["sample/staleness_max"] for e in fsdp2["log_history"]] == [0] + [int(name[1])] * 5
        assert [e["reward"] for e in fsdp2["log_history"]] == pytest.approx(
            [e["reward"] for e in ddp["log_history"]], abs=1e-6
        )
        assert max_difference(fsdp2["weights"], ddp["weights"]) < 1e-4
    k1, sync = load(fsdp2_runs / "k1" / "final_0.pt"), load(runs / "sync" / "final_0.pt")
    assert max_difference(k1["weights"], sync["weights"]) > 1e-4  # one version stale: another run


def test_under_zero2_the_optimizer_step_inside_backward_is_under_the_weights_lock(model_dir, runs, tmp_path):
    # DeepSpeed's engine steps inside the window's last backward: that backward runs under the weights' lock, so the
    # producers copy whole versions. k=1 gives the run DDP's k=1 gives, up to the rounding of DeepSpeed's reduction.
    pytest.importorskip("deepspeed")
    launch(
        tmp_path,
        dict(job="train", model=model_dir, out=str(tmp_path / "k1"), config={**RUN, "max_staleness": 1}, tiebreak=0.01),
        env=DEEPSPEED_ZERO2,
    )
    zero2, ddp = load(tmp_path / "k1" / "final_0.pt"), load(runs / "k1" / "final_0.pt")
    assert zero2["distributed_type"] == "DEEPSPEED" and zero2["global_step"] == 6
    assert max_difference(zero2["weights"], load(tmp_path / "k1" / "final_1.pt")["weights"]) == 0.0
    assert [e["sample/staleness_max"] for e in zero2["log_history"]] == [0, 1, 1, 1, 1, 1]
    assert [e["reward"] for e in zero2["log_history"]] == pytest.approx(
        [e["reward"] for e in ddp["log_history"]], abs=1e-6
    )
    assert max_difference(zero2["weights"], ddp["weights"]) < 1e-4


def test_under_zero3_the_trainer_gathers_each_scheduled_version_for_whole_copies_and_the_run_resumes(
    model_dir, runs, tmp_path
):
    # The model is loaded partitioned (accelerate's zero.Init): the producers' copies are rebuilt whole from its
    # gathered weights, and after each optimizer step whose weights the schedule samples a batch with, the trainer
    # gathers them (a collective of its own thread) as under FSDP2. k=1 gives DDP's k=1 run, up to the rounding of
    # DeepSpeed's reduction; a run resumed from checkpoint-3 (a batch in flight) ends on the unbroken run's weights.
    pytest.importorskip("deepspeed")
    env = {**zero3_env(tmp_path), "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}
    config = {**RUN, "max_staleness": 1}
    # LoRA with beta > 0: the reference is the producer's copy with its adapter off (the copy is a PeftModel rebuilt
    # whole); its run is compared with the same run under DDP.
    lora = dict(job="train", model=model_dir, config={**config, "beta": 0.04}, tiebreak=0.01, adapter="lora")
    launch(
        tmp_path,
        dict(job="train", model=model_dir, out=str(tmp_path / "k1"), config=config, tiebreak=0.01),
        {**lora, "out": str(tmp_path / "lora")},
        env=env,
    )
    launch(tmp_path, {**lora, "out": str(tmp_path / "ddp_lora")})
    resume = str(tmp_path / "k1" / "checkpoint-3")
    launch(
        tmp_path,
        dict(job="train", model=model_dir, out=str(tmp_path / "resumed"), config=config, tiebreak=0.01, resume=resume),
        env=env,
    )
    zero3, ddp = load(tmp_path / "k1" / "final_0.pt"), load(runs / "k1" / "final_0.pt")
    assert zero3["distributed_type"] == "DEEPSPEED" and zero3["zero3_init"] and zero3["global_step"] == 6
    assert max_difference(zero3["weights"], load(tmp_path / "k1" / "final_1.pt")["weights"]) == 0.0
    assert [e["sample/staleness_max"] for e in zero3["log_history"]] == [0, 1, 1, 1, 1, 1]
    assert [e["reward"] for e in zero3["log_history"]] == pytest.approx(
        [e["reward"] for e in ddp["log_history"]], abs=1e-6
    )
    assert max_difference(zero3["weights"], ddp["weights"]) < 1e-4
    resumed = load(tmp_path / "resumed" / "final_0.pt")
    assert max_difference(resumed["weights"], zero3["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in zero3["log_history"]]
    lora, ddp_lora = load(tmp_path / "lora" / "final_0.pt"), load(tmp_path / "ddp_lora" / "final_0.pt")
    assert max_difference(lora["weights"], load(tmp_path / "lora" / "final_1.pt")["weights"]) == 0.0
    assert [e["sample/staleness_max"] for e in lora["log_history"]] == [0, 1, 1, 1, 1, 1]
    for key in ("reward", "kl"):
        assert [e[key] for e in lora["log_history"]] == pytest.approx(
            [e[key] for e in ddp_lora["log_history"]], abs=1e-6
        )
    assert lora["log_history"][-1]["kl"] > 0  # the adapter moved the policy away from its reference
    assert max_difference(lora["weights"], ddp_lora["weights"]) < 1e-4


FAILING = textwrap.dedent(
    """
    import os, sys
    from datasets import Dataset
    from grpokit import GRPOConfig, GRPOTrainer

    RANK, RESUMED = int(os.environ["RANK"]), len(sys.argv) > 3
    calls = 0


    def reward(completions, **kwargs):
        global calls
        calls += 1
        if RANK == 1 and calls == 4 and not RESUMED:
            raise ValueError("the grader's database went away")
        return [float(c[:1] == "a") for c in completions]


    data = Dataset.from_list([{"prompt": f"{a}{b}:"} for a in "abcdefgh" for b in "abcdefgh"])
    args = GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, num_generations=4, max_steps=6,
                      max_completion_length=2, max_staleness=1, save_strategy="steps", save_steps=1,
                      disable_tqdm=True, report_to="none", seed=0)
    GRPOTrainer(model=sys.argv[1], reward_funcs=reward, args=args, train_dataset=data).train(
        resume_from_checkpoint=RESUMED)
    """
)


def test_a_producer_failing_on_one_process_stops_every_process_with_its_cause_and_the_checkpoint_resumes(
    model_dir, tmp_path
):
    script, out = write_script(tmp_path, FAILING), tmp_path / "out"

    def torchrun(*extra):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            script,
            model_dir,
            str(out),
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False)

    failed = torchrun()
    assert failed.returncode != 0
    # Rank 1's fourth batch failed: its trainer stopped with the cause; rank 0's producer, whose gathers lost rank 1,
    # points at it rather than at its own broken connection.
    assert (
        "[rank1]: RuntimeError: The generation producer failed: RewardFunctionError: Reward function 'reward' "
        "raised ValueError: the grader's database went away" in failed.stderr
    )
    rank0 = [line for line in failed.stderr.splitlines() if line.startswith("[rank0]: RuntimeError: The generation")]
    assert all("another process stopped, and its error above is the cause" in line for line in rank0)
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints and checkpoints[-1] <= 3 and not list(out.glob(".tmp*"))
    # The last checkpoint is good: the run resumes from it (the fault gone) and ends.
    resumed = torchrun("resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6


@pytest.mark.slow
def test_two_processes_with_max_staleness_learn_as_the_synchronous_two_process_run(model_dir, tmp_path):
    # test_distributed.test_two_processes_learn's task and budget ("repeat the prompt's first letter", 2 x 32
    # completions per step, 80 steps), one version stale: the reward rises as it does there.
    config = dict(
        per_device_train_batch_size=32,
        num_generations=8,
        learning_rate=1e-2,
        max_steps=80,
        logging_steps=5,
        save_strategy="no",
        max_staleness=1,
    )
    launch(tmp_path, dict(job="train", model=model_dir, out=str(tmp_path / "out"), config=config, tiebreak=0.0))
    rank0, rank1 = load(tmp_path / "out" / "final_0.pt"), load(tmp_path / "out" / "final_1.pt")
    rewards = [entry["reward"] for entry in rank0["log_history"]]
    assert rewards[0] < 0.25 and sum(rewards[-3:]) / 3 >= 0.5, rewards
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert {entry["sample/staleness_max"] for entry in rank0["log_history"][1:]} == {1}
