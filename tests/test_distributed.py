"""Two processes on CPU (torchrun, gloo) against one: the same update, identical ranks, gathered rewards, resume.

A small script (SCRIPT below) runs under `python -m torch.distributed.run --nproc_per_node 2` and leaves its evidence
in files: weights per rank, the rows each rank's reward function saw, the advantages of each generation batch. The
library is used as it ships; only the exact-update comparison hands the trainer a fixed generation batch (in place
of sampling), so that one and two processes see the same completions.
"""

import json
import os
import runpy
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from ports import free_port
from transformers import AutoModelForCausalLM

from grpokit import group_advantages
from grpokit.testing import save_tiny_model

# Several training processes: `python -m pytest -m distributed` runs them (.ci/run does, after the default suite).
pytestmark = pytest.mark.distributed

LETTERS = "abcdefgh"

SCRIPT = textwrap.dedent(
    '''
    import json, os, sys
    from pathlib import Path

    import torch
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer, TrainBatch, group_advantages
    from grpokit.distributed import full_state_dict
    from transformers.integrations import is_deepspeed_zero3_enabled

    RANK = int(os.environ.get("RANK", 0))
    LETTERS = "abcdefgh"


    def dataset():
        # 64 distinct prompts "xy:", so that a prompt's text names its row; the task: repeat the first letter.
        return Dataset.from_list([{"prompt": f"{a}{b}:", "letter": a} for a in LETTERS for b in LETTERS])


    def adapter_config(spec):
        """The job's `adapter`: "lora" (on the attention's q and v projections), "prompt_tuning", or none."""
        if spec.get("adapter") is None:
            return None
        import peft

        if spec["adapter"] == "prompt_tuning":
            return peft.PromptTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM")
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


    def recording_reward(log, tiebreak):
        def repeat_letter(prompts, completions, letter, log_metric=None, **kwargs):
            scores = [(1.0 if c[:1] == t else 0.0) + tiebreak * (sum(map(ord, c)) % 7)
                      for c, t in zip(completions, letter)]
            if log_metric is not None:  # TRL's reward kwarg: averaged over the processes that logged
                log_metric("rank_logged", float(RANK))
                if RANK == 1:  # a name only one process logs still reaches the shared record
                    log_metric("only_rank_1", 3.0)
            with open(log, "a") as handle:
                handle.write(json.dumps({"prompts": prompts, "scores": scores}) + "\\n")
            return scores
        return repeat_letter


    def config(out, **values):
        defaults = dict(max_completion_length=2, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                        disable_tqdm=True, seed=0)
        return GRPOConfig(output_dir=str(out), **{**defaults, **values})


    def fixed_batch(model):
        """One global generation batch, the same in every process: 4 prompts x G=4, ragged completions."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        generator = torch.Generator().manual_seed(0)
        prompt_ids = torch.tensor(tokenizer(["ab:", "cd:", "ef:", "gh:"])["input_ids"]).repeat_interleave(4, 0)
        first_letter = tokenizer.convert_tokens_to_ids("a")
        completion_ids = torch.randint(first_letter, len(tokenizer), (16, 5), generator=generator)
        lengths = torch.randint(1, 6, (16, 1), generator=generator)
        mask = (torch.arange(5) < lengths).long()
        advantages = group_advantages(torch.rand(16, generator=generator), 4)
        return TrainBatch(prompt_ids, torch.ones_like(prompt_ids), completion_ids, attention_mask=mask, loss_mask=mask,
                          lengths=mask.sum(-1), advantages=advantages[:, None].expand(-1, 5).contiguous())


    def one_update(spec):
        """One optimizer step on this process's slice of the fixed batch, for each variant; weights to files."""
        out, batch = Path(spec["out"]), fixed_batch(spec["model"])
        for name, values in spec["variants"].items():
            args = config(out / name, num_generations=4, max_steps=1, max_grad_norm=0.0, learning_rate=1e6,
                          adam_epsilon=1e6, **values)
            trainer = GRPOTrainer(model=spec["model"], reward_funcs=recording_reward(os.devnull, 0.0), args=args,
                                  train_dataset=dataset())
            rows = slice(trainer.accelerator.process_index * args.generation_batch_per_process,
                         (trainer.accelerator.process_index + 1) * args.generation_batch_per_process)
            trainer.generate_batch = lambda: batch.select(rows)
            trainer.train()
            # Full weights (gathered under FSDP2, where only the main process gets them).
            torch.save({"weights": full_state_dict(trainer.unwrapped_model), "log_history": trainer.state.log_history[:-1]},
                       out / f"{name}_{RANK}.pt")


    def train(spec):
        """A real run; records what the rewards saw and each generation batch's advantages, per process.
        `save_model`: save the final model into out/final_model."""
        out, resume = Path(spec["out"]), spec.get("resume")
        if spec.get("per_node"):  # nodes that share no storage: each its own output_dir (the same path on each)
            out = out / f"node{os.environ['GROUP_RANK']}"
            resume = str(out / resume) if isinstance(resume, str) else resume
        out.mkdir(parents=True, exist_ok=True)
        if spec.get("partial_state_first"):  # as TRL scripts do; on a CPU-only machine it forms no process group
            from accelerate import PartialState

            PartialState()
        evaluation = dataset().select(range(spec["eval_rows"])) if spec.get("eval_rows") else None
        trainer = GRPOTrainer(model=spec["model"], args=config(out, **spec["config"]), train_dataset=dataset(),
                              reward_funcs=recording_reward(out / f"rewards_{RANK}.jsonl", spec["tiebreak"]),
                              eval_dataset=evaluation, peft_config=adapter_config(spec))
        batches, generate = [], trainer.generate_batch

        def observed_generate():  # the real generation, observed: its advantages are the evidence
            batch = generate()
            reference = trainer.reference
            batches.append({"prompts": trainer.processing_class.batch_decode(batch.prompt_ids,
                                                                             skip_special_tokens=True),
                            "advantages": batch.advantages[:, 0].tolist(),
                            # FSDP2: whether the reference's parameters are shards (DTensors) once it has been used
                            "reference_sharded": None if reference is None else
                                                 all(hasattr(p, "to_local") for p in reference.parameters())})
            return batch

        trainer.generate_batch = observed_generate
        reductions = []
        if spec.get("count_reductions"):  # DDP's gradient all-reduces, counted by a communication hook
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):
                reductions.append(bucket.index())
                return allreduce_hook(state, bucket)

            trainer.model.register_comm_hook(None, counted)
        trainer.train(resume_from_checkpoint=resume)
        if spec.get("save_model"):
            trainer.save_model(str(out / "final_model"))
        torch.save({"weights": full_state_dict(trainer.unwrapped_model),
                    "distributed_type": trainer.accelerator.distributed_type.value, "log_history": trainer.state.log_history[:-1],
                    "zero3_init": is_deepspeed_zero3_enabled(),
                    "global_step": trainer.state.global_step, "num_processes": trainer.accelerator.num_processes,
                    "batches": batches, "reductions": len(reductions)}, out / f"final_{RANK}.pt")


    def refused(spec):
        """Build a trainer that must be refused; record the error."""
        try:
            GRPOTrainer(model=spec["model"], args=config(spec["out"], **spec.get("config", {})), train_dataset=dataset(),
                        reward_funcs=recording_reward(os.devnull, 0.0), peft_config=adapter_config(spec))
            message = None
        except (NotImplementedError, ValueError) as error:
            message = str(error)
        Path(spec["out"]).mkdir(parents=True, exist_ok=True)
        (Path(spec["out"]) / f"error_{RANK}.json").write_text(json.dumps(message))


    def process_options(spec):
        """One step with the ddp_* fields set; record what the process group and the DDP wrapper got."""
        import torch.distributed as dist

        trainer = GRPOTrainer(model=spec["model"], args=config(spec["out"], **spec["config"]), train_dataset=dataset(),
                              reward_funcs=recording_reward(os.devnull, 0.0))
        trainer.train()
        ddp, group = trainer.model, dist.group.WORLD
        seen = {"wrapper": type(ddp).__name__, "backend": dist.get_backend(),
                "timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
                "find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
                "broadcast_buffers": ddp.broadcast_buffers, "bucket_bytes_cap": ddp.bucket_bytes_cap}
        Path(spec["out"]).mkdir(parents=True, exist_ok=True)
        (Path(spec["out"]) / f"options_{RANK}.json").write_text(json.dumps(seen))


    def main(spec_path):
        for spec in json.loads(Path(spec_path).read_text()):  # jobs, one after the other, in the same processes
            {"one_update": one_update, "train": train, "refused": refused,
             "process_options": process_options}[spec["job"]](spec)


    if __name__ == "__main__":
        main(sys.argv[1])
        import gc

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a clean exit: the group's threads stopped, not killed
            # A finished trainer is kept alive by reference cycles, and a DDP wrapper holds the process group: collected
            # first, the group's gloo threads (gloo_tcp_loop, pt_gloo_runloop) end in destroy_process_group instead of
            # running on into the interpreter's teardown. (Under FSDP2 something else still holds the group after the
            # collection: there its threads end with the process, as before.)
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
    '''
)

# per_device_train_batch_size 6 x steps_per_generation 2 = 12 completions per process, 24 in all: 3 prompts of G=8,
# so the second prompt's group spans the two processes (8 + 4 | 4 + 8).
TWO_PROCESS_RUN = dict(
    per_device_train_batch_size=6,
    steps_per_generation=2,
    num_generations=8,
    learning_rate=1e-2,
    max_steps=6,
    save_strategy="steps",
    save_steps=1,
)


def write_script(directory, script: str = SCRIPT) -> str:
    path = directory / "run.py"
    path.write_text(script)
    return str(path)


def launch(
    directory,
    *specs: dict,
    nproc: int = 2,
    timeout: float = 600,
    env: dict | None = None,
    script: str = SCRIPT,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `script`'s jobs `specs` in `nproc` processes under torchrun (gloo on CPU); fail with their output if they
    fail (`check`) or run past `timeout`. Returns the launcher's exit status and output."""
    spec_path = directory / f"spec-{len(list(directory.glob('spec-*')))}.json"
    spec_path.write_text(json.dumps(specs))
    return run_launcher(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            write_script(directory, script),
            str(spec_path),
        ],
        timeout,
        env,
        check,
    )


def launch_nodes(directory, *specs: dict, nodes: int = 2, timeout: float = 600) -> None:
    """Run `script`'s jobs on `nodes` nodes of one process each: one torchrun per node (--node_rank), all on this
    machine, meeting at one master address; fail with their output."""
    spec_path = directory / f"spec-{len(list(directory.glob('spec-*')))}.json"
    spec_path.write_text(json.dumps(specs))
    script, port = write_script(directory, SCRIPT), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node_rank",
                str(rank),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                script,
                str(spec_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nodes)
    ]
    outputs = [run.communicate(timeout=timeout) for run in runs]
    for run, (stdout, stderr) in zip(runs, outputs):
        assert run.returncode == 0, f"a node failed:\n{stdout[-2000:]}\n{stderr[-6000:]}"


def run_launcher(
    command: list[str], timeout: float = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run a launcher command (one thread per process: the CPU is shared); fail with the ranks' tracebacks if it
    fails (`check`). One that runs past `timeout` (a rank waiting in a collective the others never enter) is
    stopped with its workers, which torchrun ends on SIGTERM, and fails the test with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                stdout, stderr = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            pytest.fail(f"launch ran past {timeout} s and was stopped:\n{stdout[-2000:]}\n{stderr[-8000:]}")
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    errors = "\n".join(line for line in result.stderr.splitlines() if line.startswith("[rank"))
    if check:
        assert result.returncode == 0, (
            f"launch failed:\n{result.stdout[-2000:]}\n{errors[-8000:] or result.stderr[-8000:]}"
        )
    return result


def run_in_this_process(directory, spec: dict, script: str = SCRIPT) -> None:
    """The same script in one plain process (no torchrun): the single-process reference."""
    spec_path = directory / "spec-single.json"
    spec_path.write_text(json.dumps([spec]))
    runpy.run_path(write_script(directory, script))["main"](str(spec_path))


def load(path):
    return torch.load(path, weights_only=False)


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=32))


LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # bnpo is a per-process mean by definition (as in TRL): not comparable
UPDATE_VARIANTS = {loss: dict(loss_type=loss, per_device_train_batch_size=8) for loss in LOSS_TYPES}
UPDATE_VARIANTS["dapo_accumulated"] = dict(
    loss_type="dapo", per_device_train_batch_size=4, gradient_accumulation_steps=2
)


@pytest.fixture(scope="module")
def two_process_run(model_dir, tmp_path_factory):
    """One torchrun launch, two jobs: six real steps with a checkpoint after each (evidence in `out`), and one
    update on a fixed batch per variant of UPDATE_VARIANTS (weights in `update`)."""
    directory = tmp_path_factory.mktemp("two")
    launch(
        directory,
        dict(
            job="train",
            model=model_dir,
            out=str(directory / "out"),
            config=TWO_PROCESS_RUN,
            tiebreak=0.01,
            partial_state_first=True,
        ),
        dict(job="one_update", model=model_dir, out=str(directory / "update"), variants=UPDATE_VARIANTS),
    )
    return directory / "out"


@pytest.fixture(scope="module")
def one_process_update(model_dir, tmp_path_factory):
    """The single-process reference: one update on the whole fixed batch (1 x 16 rows) per loss type."""
    directory = tmp_path_factory.mktemp("one")
    run_in_this_process(
        directory,
        dict(
            job="one_update",
            model=model_dir,
            out=str(directory / "one"),
            variants={loss: dict(loss_type=loss, per_device_train_batch_size=16) for loss in LOSS_TYPES},
        ),
    )
    return directory / "one"


def assert_same_update_as_one_process(two, one_dir, model_dir, replicated: bool = True) -> None:
    """The update of 2 processes x 8 rows (files in `two`) against 1 x 16 (`one_dir`), per UPDATE_VARIANT. With
    adam_epsilon = learning_rate >> |g| the first AdamW update is the gradient itself, and max_grad_norm = 0 leaves
    it unclipped: any error in the normalisation shows. `replicated`: every rank holds the full weights (DDP,
    ZeRO-2); otherwise the main process holds them gathered and the other only its shards (FSDP2)."""
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for name, values in UPDATE_VARIANTS.items():
        one = load(one_dir / f"{values['loss_type']}_0.pt")
        rank0, rank1 = load(two / f"{name}_0.pt"), load(two / f"{name}_1.pt")
        moved = max_difference(one["weights"], {k: v for k, v in initial.items() if k in one["weights"]})
        assert moved > 1e-2, name
        if replicated:
            assert max_difference(rank0["weights"], rank1["weights"]) == 0.0, name
        else:
            assert rank1["weights"] == {}, name
        assert max_difference(rank0["weights"], one["weights"]) < 1e-5 * moved, name
        # The logged loss is the mean over processes of each one's share: the one-process loss.
        assert rank0["log_history"][0]["loss"] == pytest.approx(one["log_history"][0]["loss"], abs=1e-6), name


def test_two_processes_make_the_update_of_one_with_the_same_global_batch(
    two_process_run, one_process_update, model_dir
):
    # The same 16 completions (fixed, so the comparison is exact): 1 process x 16 rows against 2 processes x 8 rows
    # (and 2 x 2 micro-batches of 4 accumulated).
    assert_same_update_as_one_process(two_process_run.parent / "update", one_process_update, model_dir)


def test_ranks_end_identical_and_only_the_main_process_writes(two_process_run):
    rank0, rank1 = load(two_process_run / "final_0.pt"), load(two_process_run / "final_1.pt")
    assert rank0["num_processes"] == rank1["num_processes"] == 2
    assert rank0["global_step"] == rank1["global_step"] == 6
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    # One metrics line per step (a second writer would duplicate or interleave them), equal to the logged history.
    lines = [json.loads(line) for line in (two_process_run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert lines == rank0["log_history"]
    logged = [line for line in lines if "rank_logged" in line]  # the steps that sampled a generation batch
    assert len(logged) == 3 and all(line["rank_logged"] == 0.5 and line["only_rank_1"] == 3.0 for line in logged)
    assert sorted(p.name for p in two_process_run.iterdir() if p.name.startswith(("checkpoint-", ".tmp"))) == [
        f"checkpoint-{step}" for step in range(1, 7)
    ]
    checkpoint = two_process_run / "checkpoint-6"
    assert {"rng_state_0.pth", "rng_state_1.pth", "generation_state.pt", "optimizer.pt"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert not (checkpoint / "rng_state.pth").exists()


def test_ranks_score_disjoint_slices_and_advantages_use_the_whole_group(two_process_run):
    calls = [
        [json.loads(line) for line in (two_process_run / f"rewards_{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    batches = [load(two_process_run / f"final_{rank}.pt")["batches"] for rank in (0, 1)]
    assert len(calls[0]) == len(calls[1]) == len(batches[0]) == 3  # 6 steps, 2 per generation batch
    group = TWO_PROCESS_RUN["num_generations"]
    for call0, call1, batch0, batch1 in zip(*calls, *batches):
        # Rank 0 scored the first 12 completions of the generation batch, rank 1 the next 12: together the
        # 3 prompts x 8, each prompt's completions contiguous, no completion scored twice.
        prompts = call0["prompts"] + call1["prompts"]
        assert len(call0["prompts"]) == len(call1["prompts"]) == 12
        distinct = list(dict.fromkeys(prompts))
        assert prompts == [p for p in distinct for _ in range(group)] and len(distinct) == 3
        assert call0["prompts"][-1] == call1["prompts"][0]  # the middle group spans the two processes
        # Each process's advantages are those of the global batch's groups (gathered rewards), not of its half.
        expected = group_advantages(torch.tensor(call0["scores"] + call1["scores"]), group)
        spanning = distinct[1]
        rewards = torch.tensor(call0["scores"] + call1["scores"])[[p == spanning for p in prompts]]
        assert rewards.std() > 0  # the check below would hold trivially for a group of equal rewards
        for prompt in distinct:
            got = [a for b in (batch0, batch1) for p, a in zip(b["prompts"], b["advantages"]) if p == prompt]
            want = expected[[p == prompt for p in prompts]].tolist()
            assert sorted(got) == pytest.approx(sorted(want), abs=1e-5), prompt
    # The logged reward is the mean over both processes' scores.
    first = load(two_process_run / "final_0.pt")["log_history"][0]
    assert first["reward"] == pytest.approx(sum(calls[0][0]["scores"] + calls[1][0]["scores"]) / 24, abs=1e-6)


def test_checkpoint_resumes_in_two_processes_to_the_same_weights(two_process_run, model_dir, tmp_path):
    # checkpoint-3 is half-way through a generation batch (2 steps each): each process must get back its own slice.
    spec = dict(
        job="train",
        model=model_dir,
        out=str(tmp_path / "out"),
        config=TWO_PROCESS_RUN,
        tiebreak=0.01,
        resume=str(two_process_run / "checkpoint-3"),
    )
    launch(tmp_path, spec)
    resumed, unbroken = load(tmp_path / "out" / "final_0.pt"), load(two_process_run / "final_0.pt")
    assert resumed["global_step"] == 6
    assert [e["step"] for e in resumed["log_history"]] == [1, 2, 3, 4, 5, 6]
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [
        4,
        5,
        6,
    ]
    assert max_difference(resumed["weights"], unbroken["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in unbroken["log_history"]]


def test_checkpoint_of_two_processes_resumes_in_one(two_process_run, model_dir, tmp_path):
    # The same global batch in one process (12 x 2 = 24 completions). Resuming from a generation boundary keeps
    # every state; resuming mid-generation drops the half-used batch (laid out for 2 processes) with a warning.
    config = {**TWO_PROCESS_RUN, "per_device_train_batch_size": 12, "max_steps": 8}
    for checkpoint, warns in (("checkpoint-4", False), ("checkpoint-3", True)):
        out = tmp_path / checkpoint
        spec = dict(
            job="train",
            model=model_dir,
            out=str(out),
            config=config,
            tiebreak=0.01,
            resume=str(two_process_run / checkpoint),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_in_this_process(tmp_path, spec)
        assert any("half-used generation batch" in str(w.message) for w in caught) == warns
        state = load(out / "final_0.pt")
        assert state["num_processes"] == 1 and state["global_step"] == 8
        start = int(checkpoint.split("-")[1])
        assert [e["step"] for e in state["log_history"]] == list(range(1, 9))
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
            range(start + 1, 9)
        )
        assert all(torch.isfinite(v).all() for v in state["weights"].values())


@pytest.mark.slow
def test_two_processes_learn(model_dir, tmp_path):
    # "Repeat the prompt's first letter" with 2 x 32 completions per step: the reward rises as in one process.
    config = dict(
        per_device_train_batch_size=32,
        num_generations=8,
        learning_rate=1e-2,
        max_steps=80,
        logging_steps=5,
        save_strategy="steps",
        save_steps=40,
    )
    launch(tmp_path, dict(job="train", model=model_dir, out=str(tmp_path / "out"), config=config, tiebreak=0.0))
    rank0, rank1 = load(tmp_path / "out" / "final_0.pt"), load(tmp_path / "out" / "final_1.pt")
    rewards = [entry["reward"] for entry in rank0["log_history"]]
    assert rewards[0] < 0.25 and sum(rewards[-3:]) / 3 >= 0.5, rewards
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-40", "checkpoint-80"]


def test_ddp_fields_reach_the_process_group_and_the_ddp_wrapper(model_dir, tmp_path):
    # transformers' TrainingArguments names: ddp_backend / ddp_timeout for the process group, ddp_find_unused_
    # parameters / ddp_bucket_cap_mb / ddp_broadcast_buffers / ddp_static_graph for DistributedDataParallel.
    options = dict(
        ddp_backend="gloo",
        ddp_timeout=321,
        ddp_find_unused_parameters=True,
        ddp_bucket_cap_mb=7,
        ddp_broadcast_buffers=False,
        ddp_static_graph=True,
    )
    config = dict(per_device_train_batch_size=4, num_generations=4, max_steps=1, **options)
    launch(tmp_path, {"job": "process_options", "model": model_dir, "out": str(tmp_path / "out"), "config": config})
    for rank in (0, 1):
        seen = json.loads((tmp_path / "out" / f"options_{rank}.json").read_text())
        assert seen == {
            "wrapper": "DistributedDataParallel",
            "backend": "gloo",
            "timeout_s": 321.0,
            "find_unused_parameters": True,
            "static_graph": True,
            "broadcast_buffers": False,
            "bucket_bytes_cap": 7 * 1024 * 1024,
        }, seen


def test_sync_each_batch_reduces_every_micro_batch_and_updates_alike(model_dir, tmp_path):
    """accelerator_config gradient_accumulation_kwargs.sync_each_batch under DDP, 2 micro-batches per step: DDP
    all-reduces the gradients after each micro-batch's backward (twice as many reductions as with no_sync on the
    first), and the updates are the same up to rounding (the mean of sums against the sum of means)."""
    # learning_rate = adam_epsilon >> |g|: AdamW's update is its first moment (unnormalised), so float rounding in
    # the gradients is not amplified as AdamW's per-weight normalisation does near 0 (as the vLLM tests compare).
    run = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=8,
        learning_rate=1e6,
        adam_epsilon=1e6,
        max_grad_norm=0.0,
        max_steps=2,
    )
    job = dict(job="train", model=model_dir, tiebreak=0.01, count_reductions=True)
    each = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    launch(
        tmp_path,
        {**job, "out": str(tmp_path / "last"), "config": run},
        {**job, "out": str(tmp_path / "each"), "config": {**run, "accelerator_config": each}},
    )
    last, every = load(tmp_path / "last" / "final_0.pt"), load(tmp_path / "each" / "final_0.pt")
    assert last["reductions"] > 0 and every["reductions"] == 2 * last["reductions"]
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    moved = max_difference(last["weights"], {k: v for k, v in initial.items() if k in last["weights"]})
    assert moved > 1e-3 and max_difference(every["weights"], last["weights"]) < 1e-5 * moved
    assert [e["loss"] for e in every["log_history"]] == pytest.approx(
        [e["loss"] for e in last["log_history"]], abs=1e-6
    )


def test_save_on_each_node_writes_every_checkpoint_on_each_node_and_each_resumes_from_its_own(model_dir, tmp_path):
    """Two nodes of one process each (two torchruns, --node_rank 0 and 1, on this machine) whose output_dirs are
    different directories, as on nodes that share no storage. With save_on_each_node each node's main process
    writes every checkpoint (all processes' RNG states and generation batches included) and the final model into
    its own output_dir, the same files on both; each node then resumes from its own copy, and the resumed run ends
    bitwise where the unbroken one did. Without it only node 0 has them (transformers' semantics)."""
    run = {**TWO_PROCESS_RUN, "max_steps": 4, "save_steps": 2}
    job = dict(job="train", model=model_dir, tiebreak=0.01, per_node=True, save_model=True)
    launch_nodes(
        tmp_path,
        {**job, "out": str(tmp_path / "each"), "config": {**run, "save_on_each_node": True}},
        {**job, "out": str(tmp_path / "main"), "config": run},
    )
    each = [tmp_path / "each" / f"node{n}" for n in (0, 1)]
    for node in each:
        assert sorted(p.name for p in node.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt", "generation_state.pt"} <= {
            p.name for p in (node / "checkpoint-2").iterdir()
        }
        assert (node / "final_model" / "model.safetensors").is_file()
    for name in ("model.safetensors", "optimizer.pt", "rng_state_1.pth", "generation_state.pt"):  # (trainer_state.json:
        # the writer's own, e.g. its step times and is_world_process_zero)
        for step in (2, 4):
            assert (each[0] / f"checkpoint-{step}" / name).read_bytes() == (
                each[1] / f"checkpoint-{step}" / name
            ).read_bytes(), (name, step)
    main = [tmp_path / "main" / f"node{n}" for n in (0, 1)]
    assert sorted(p.name for p in main[0].glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(main[1].glob("checkpoint-*")) and not (main[1] / "final_model").exists()
    # Each node resumes from its own copy of checkpoint-2 (node 1's from node 1's directory), in a fresh output_dir.
    for n in (0, 1):
        shutil.copytree(each[n] / "checkpoint-2", tmp_path / "resumed" / f"node{n}" / "checkpoint-2")
    launch_nodes(
        tmp_path,
        {
            **job,
            "out": str(tmp_path / "resumed"),
            "resume": "checkpoint-2",
            "save_model": False,
            "config": {**run, "save_on_each_node": True},
        },
    )
    for n in (0, 1):
        unbroken, resumed = load(each[n] / f"final_{n}.pt"), load(tmp_path / "resumed" / f"node{n}" / f"final_{n}.pt")
        assert resumed["global_step"] == 4 and resumed["num_processes"] == 2
        assert max_difference(resumed["weights"], unbroken["weights"]) == 0.0
        assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in unbroken["log_history"]]
        assert (tmp_path / "resumed" / f"node{n}" / "checkpoint-4").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("launch_config", ["ddp.yaml", "fsdp2.yaml"])
def test_example_script_under_accelerate_launch(tmp_path, launch_config):
    # The shipped examples/train_grpo.py and examples/accelerate configs, as a user runs them (2 CPU processes).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run_launcher(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            os.path.join(root, "examples", "accelerate", launch_config),
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            os.path.join(root, "examples", "train_grpo.py"),
            "--tiny",
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "30",
        ]
    )
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 31))  # written once, by the main process
    config = json.loads((tmp_path / "out" / "grpo_config.json").read_text())
    assert config["per_device_train_batch_size"] == 32
    # Counted over both processes: 2 x 32 completions, each with a 3-token prompt.
    assert lines[0]["num_tokens"] == 2 * 32 * 3 + round(lines[0]["completions/mean_length"] * 64)
    assert (tmp_path / "out" / "checkpoint-30" / "rng_state_1.pth").is_file()
    assert (tmp_path / "out" / "model.safetensors").is_file()
    # FSDP2 really sharded: its optimizer state was gathered by parameter name (DDP's is the optimizer's own).
    optimizer = torch.load(tmp_path / "out" / "checkpoint-30" / "optimizer.pt", weights_only=False)
    assert all(isinstance(key, str) for key in optimizer["state"]) == (launch_config == "fsdp2.yaml")


GENERATION_BATCH_SCRIPT = textwrap.dedent(
    """
    import json, os, sys

    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer

    # A TRL script's batch: generation_batch_size counts the completions of all processes.
    VALUES = dict(per_device_train_batch_size=4, generation_batch_size=16, num_generations=4)


    def main(spec_path):
        spec = json.load(open(spec_path))[0]
        sampled = []

        def reward(completions, **kwargs):  # called once per generation batch, with this process's rows
            sampled.append(len(completions))
            return [float(len(c)) for c in completions]

        args = GRPOConfig(output_dir=spec["out"], max_completion_length=2, max_steps=4, save_strategy="no",
                          disable_tqdm=True, report_to="none", seed=0, **VALUES)
        dataset = Dataset.from_list([{"prompt": f"{a}{b}:"} for a in "abcdefgh" for b in "abcdefgh"])
        trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=dataset)
        trainer.train()
        import trl

        theirs = trl.GRPOConfig(output_dir=spec["out"], use_cpu=True, bf16=False, report_to="none", **VALUES)
        record = {"sampled": sampled, "ours": [args.generation_batch_size, args.steps_per_generation],
                  "trl": [theirs.generation_batch_size, theirs.steps_per_generation, theirs.world_size],
                  "steps": trainer.state.global_step}
        with open(os.path.join(spec["out"], f"rank{os.environ['RANK']}.json"), "w") as handle:
            json.dump(record, handle)


    if __name__ == "__main__":
        main(sys.argv[1])
    """
)


def test_generation_batch_size_counts_all_processes_as_trls(model_dir, tmp_path):
    """A TRL script's generation_batch_size=16 with per_device_train_batch_size=4 on 2 processes: TRL's own GRPOConfig
    derives steps_per_generation = 16 / (4 x 2) = 2 and samples 16 completions per generation, 8 per process; so does
    grpokit (it sampled 16 per process, 32 in all, before)."""
    pytest.importorskip("trl")
    launch(tmp_path, {"model": model_dir, "out": str(tmp_path)}, script=GENERATION_BATCH_SCRIPT)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["trl"] == [16, 2, 2]  # TRL 1.16's arithmetic, in the same launched process
        assert record["ours"] == record["trl"][:2]
        assert record["sampled"] == [8, 8] and record["steps"] == 4  # 2 generation batches of 2 optimizer steps
    assert sum(records[0]["sampled"][:1] + records[1]["sampled"][:1]) == 16  # one generation, all processes


@pytest.mark.slow
def test_command_line_under_torchrun(model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}{b}:", "target": a}) + "\n" for a in LETTERS for b in LETTERS))
    run_launcher(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            "-m",
            "grpokit.cli",
            "train",
            "--model",
            model_dir,
            "--dataset",
            str(data),
            "--reward",
            "exact_match",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--max_completion_length",
            "2",
            "--max_steps",
            "3",
            "--logging_steps",
            "1",
            "--save_steps",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
            "--disable_tqdm",
        ]
    )
    out = tmp_path / "out"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (out / "checkpoint-2").iterdir()}
    assert (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------------ FSDP2
# torch's FSDP2 runs on CPU with gloo; accelerate routes an FSDP config to it only on GPUs, and grpokit honours the
# request on CPU (distributed._fsdp_on_cpu). These variables are what `accelerate launch` sets for
# examples/accelerate/fsdp2.yaml; each decoder layer is its own unit, gathered for each forward and resharded after.
FSDP2 = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
}
# Completions of up to 16 tokens from a model that often ends them early (eos_prone_model_dir): the two processes'
# rows finish at different steps, so their sampling loops must be kept in step. A KL term to a reference that is
# mixed with the policy every 2 steps: the reference is sharded too, moves, and is checkpointed.
FSDP2_RUN = {
    **TWO_PROCESS_RUN,
    "max_completion_length": 16,
    "beta": 0.04,
    "sync_ref_model": True,
    "ref_model_sync_steps": 2,
    "ref_model_mixup_alpha": 0.5,
}
# LoRA (the SCRIPT's adapter="lora": q and v projections) on the same ragged run, four steps: its reference is the
# frozen base with the adapter off, so each generation batch takes a second, adapter-off forward (under FSDP2 and
# ZeRO-3 a collective too).
LORA_RUN = {**FSDP2_RUN, "sync_ref_model": False, "max_steps": 4}


def lora_job(model: str, out, **values) -> dict:
    """A `train` job of LORA_RUN with the LoRA adapter; `config` in values updates LORA_RUN."""
    return dict(
        job="train",
        model=model,
        out=str(out),
        tiebreak=0.01,
        adapter="lora",
        **{**values, "config": {**LORA_RUN, **values.get("config", {})}},
    )


def adapter_of(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if "lora_" in k}


def assert_lora_run_follows_ddp(run: dict, ddp: dict, model_dir: str) -> None:
    """A LoRA run (final_0.pt of a LORA_RUN job) against the same run under DDP: the same completions, losses,
    rewards, KL and gradient norms (of the adapter alone) within 1e-5, the adapter within 1e-4, and the frozen base
    exactly as loaded."""
    assert run["global_step"] == ddp["global_step"] == 4
    lengths = [e["completions/mean_length"] for e in run["log_history"][::2]]  # a generation batch lasts two steps
    assert lengths == pytest.approx([e["completions/mean_length"] for e in ddp["log_history"][::2]], abs=1e-9)
    assert run["log_history"][-1]["kl"] > 0  # the adapter moved away from the adapter-off reference
    for key in ("loss", "reward", "kl", "grad_norm"):
        assert [e.get(key) for e in run["log_history"]] == pytest.approx(
            [e.get(key) for e in ddp["log_history"]], abs=1e-5
        ), key
    assert max_difference(adapter_of(run["weights"]), adapter_of(ddp["weights"])) < 1e-4
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    base = {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
        for k, v in run["weights"].items()
        if "lora_" not in k
    }
    assert base.keys() == initial.keys() and max_difference(base, initial) == 0.0


def assert_merged_is_peft_merge(directory, model_dir: str) -> None:
    """directory/merged (save_merged) holds what peft's merge_and_unload makes of the base and directory's adapter."""
    from peft import PeftModel

    merged = AutoModelForCausalLM.from_pretrained(directory / "merged").state_dict()
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), directory)
    expected = expected.merge_and_unload().state_dict()
    assert merged.keys() == expected.keys() and max_difference(merged, expected) == 0.0
    assert max_difference(merged, AutoModelForCausalLM.from_pretrained(model_dir).state_dict()) > 1e-3


@pytest.fixture(scope="module")
def eos_prone_model_dir(model_dir, tmp_path_factory):
    """The tiny model with its EOS row of the LM head along the mean final hidden state: P(EOS) ~ 0.17 a token."""
    from transformers import AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    ids = torch.randint(7, len(tokenizer), (64, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mean = model.model(ids).last_hidden_state.mean((0, 1))
        model.lm_head.weight[tokenizer.eos_token_id] = 0.5 * mean / mean.norm()
    path = tmp_path_factory.mktemp("eos_prone") / "tiny"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fsdp2_runs(eos_prone_model_dir, model_dir, tmp_path_factory):
    """Six steps under FSDP2 (checkpoint after each) and the same under DDP; one FSDP2 update per UPDATE_VARIANT;
    the LoRA run (LORA_RUN) under FSDP2 and under DDP (`fsdp2_lora`, `ddp_lora`)."""
    directory = tmp_path_factory.mktemp("fsdp2")
    launch(
        directory,
        dict(job="train", model=eos_prone_model_dir, out=str(directory / "fsdp2"), config=FSDP2_RUN, tiebreak=0.01),
        dict(job="one_update", model=model_dir, out=str(directory / "update"), variants=UPDATE_VARIANTS),
        lora_job(eos_prone_model_dir, directory / "fsdp2_lora"),
        env=FSDP2,
    )
    launch(
        directory,
        dict(job="train", model=eos_prone_model_dir, out=str(directory / "ddp"), config=FSDP2_RUN, tiebreak=0.01),
        lora_job(eos_prone_model_dir, directory / "ddp_lora"),
    )
    return directory


def test_fsdp2_makes_the_update_of_one_process(fsdp2_runs, one_process_update, model_dir):
    assert_same_update_as_one_process(fsdp2_runs / "update", one_process_update, model_dir, replicated=False)


def test_fsdp2_training_follows_ddp_with_sharded_sampling(fsdp2_runs):
    # Sampling, scoring and updating with sharded parameters give the run DDP gives (same seeds, same completions),
    # up to the rounding of reduce-scatter against all-reduce.
    fsdp2, ddp = load(fsdp2_runs / "fsdp2" / "final_0.pt"), load(fsdp2_runs / "ddp" / "final_0.pt")
    assert fsdp2["distributed_type"] == "FSDP" and ddp["distributed_type"] == "MULTI_CPU"
    assert fsdp2["global_step"] == 6
    generations = fsdp2["log_history"][::2]  # a generation batch lasts two steps
    lengths = [e["completions/mean_length"] for e in generations]
    assert lengths == pytest.approx([e["completions/mean_length"] for e in ddp["log_history"][::2]], abs=1e-9)
    assert all(e["completions/min_length"] < e["completions/max_length"] for e in generations)  # ragged
    assert fsdp2["log_history"][-1]["kl"] > 0
    # The sharded reference is resharded after each use: its root (embeddings, final norm) is not kept whole.
    assert [batch["reference_sharded"] for batch in fsdp2["batches"]] == [True, True, True]
    for key in ("loss", "reward", "entropy", "kl"):
        assert [e.get(key) for e in fsdp2["log_history"]] == pytest.approx(
            [e.get(key) for e in ddp["log_history"]], abs=1e-5
        ), key
    assert max_difference(fsdp2["weights"], ddp["weights"]) < 1e-4
    assert [p.name for p in sorted((fsdp2_runs / "fsdp2").glob("checkpoint-*"))] == [
        f"checkpoint-{step}" for step in range(1, 7)
    ]


def test_fsdp2_checkpoint_is_a_plain_model_and_resumes_in_two_processes_or_one(
    fsdp2_runs, eos_prone_model_dir, tmp_path
):
    out = fsdp2_runs / "fsdp2"
    final = load(out / "final_0.pt")
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint-6")  # unsharded, loadable without grpokit
    assert type(saved).__name__ == "Qwen2ForCausalLM"
    assert (out / "checkpoint-6" / "reference.safetensors").is_file()
    assert max_difference({k: v for k, v in saved.state_dict().items() if k in final["weights"]}, final["weights"]) == 0
    # FSDP2 -> FSDP2, from the middle of a generation batch: the same run, exactly.
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "two"),
            config=FSDP2_RUN,
            tiebreak=0.01,
            resume=str(out / "checkpoint-3"),
        ),
        env=FSDP2,
    )
    resumed = load(tmp_path / "two" / "final_0.pt")
    assert max_difference(resumed["weights"], final["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in final["log_history"]]
    # FSDP2 -> one process, at a generation boundary: the sharded optimizer state, gathered by parameter name,
    # loads into a plain optimizer, and the run goes on to the same weights as under DDP up to rounding.
    config = {**FSDP2_RUN, "per_device_train_batch_size": 12}
    run_in_this_process(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "one"),
            config=config,
            tiebreak=0.01,
            resume=str(out / "checkpoint-4"),
        ),
    )
    one = load(tmp_path / "one" / "final_0.pt")
    assert one["num_processes"] == 1 and one["global_step"] == 6
    assert all(torch.isfinite(v).all() for v in one["weights"].values())
    # DDP -> FSDP2: the positional optimizer state is mapped to names and sharded; the run ends where DDP's did.
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "from_ddp"),
            config=FSDP2_RUN,
            tiebreak=0.01,
            resume=str(fsdp2_runs / "ddp" / "checkpoint-4"),
        ),
        env=FSDP2,
    )
    from_ddp, ddp = load(tmp_path / "from_ddp" / "final_0.pt"), load(fsdp2_runs / "ddp" / "final_0.pt")
    assert from_ddp["distributed_type"] == "FSDP" and from_ddp["global_step"] == 6
    assert max_difference(from_ddp["weights"], ddp["weights"]) < 1e-4
    assert [e["loss"] for e in from_ddp["log_history"]] == pytest.approx(
        [e["loss"] for e in ddp["log_history"]], abs=1e-5
    )
    ddp_checkpoint = torch.load(fsdp2_runs / "ddp" / "checkpoint-4" / "optimizer.pt", weights_only=False)
    fsdp2_checkpoint = torch.load(out / "checkpoint-4" / "optimizer.pt", weights_only=False)
    names = list(fsdp2_checkpoint["state"])
    assert len(names) == len(ddp_checkpoint["state"]) and all(isinstance(n, str) for n in names)
    for index, name in enumerate(names):  # the same Adam moments, keyed by name rather than position
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(
                fsdp2_checkpoint["state"][name][moment], ddp_checkpoint["state"][index][moment], atol=1e-6
            ), (name, moment)


def test_lora_under_fsdp2_follows_ddp_and_checkpoints_the_adapter(fsdp2_runs, eos_prone_model_dir):
    # The frozen base and the adapter share each decoder layer's FSDP2 unit; the reference forward (adapter off) is
    # one more sharded forward, taken in step by both processes. The run is DDP's up to rounding, the base untouched.
    from peft import PeftModel

    out = fsdp2_runs / "fsdp2_lora"
    fsdp2, ddp = load(out / "final_0.pt"), load(fsdp2_runs / "ddp_lora" / "final_0.pt")
    assert fsdp2["distributed_type"] == "FSDP" and ddp["distributed_type"] == "MULTI_CPU"
    assert_lora_run_follows_ddp(fsdp2, ddp, eos_prone_model_dir)
    # The checkpoint holds the adapter alone (gathered, in peft's format), not the base.
    checkpoint = out / "checkpoint-4"
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "merged").exists()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(eos_prone_model_dir), checkpoint)
    assert max_difference(adapter_of(reloaded.state_dict()), adapter_of(fsdp2["weights"])) == 0.0
    # Adam's moments of the adapter, keyed by name (DDP's by position), equal DDP's up to rounding.
    fsdp2_state = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    ddp_state = torch.load(fsdp2_runs / "ddp_lora" / "checkpoint-4" / "optimizer.pt", weights_only=False)["state"]
    assert len(fsdp2_state) == len(ddp_state) == 8 and all("lora_" in name for name in fsdp2_state)
    for index, name in enumerate(fsdp2_state):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(fsdp2_state[name][moment], ddp_state[index][moment], atol=1e-6), (name, moment)


@pytest.fixture(scope="module")
def lora_resumed_in_one_process(fsdp2_runs, eos_prone_model_dir, tmp_path_factory):
    """The FSDP2 LoRA run's checkpoint-2 (a generation boundary) resumed in one process (1 x 12 rows)."""
    directory = tmp_path_factory.mktemp("lora_one")
    run_in_this_process(
        directory,
        lora_job(
            eos_prone_model_dir,
            directory / "out",
            resume=str(fsdp2_runs / "fsdp2_lora" / "checkpoint-2"),
            config={"per_device_train_batch_size": 12},
        ),
    )
    return load(directory / "out" / "final_0.pt")


def test_lora_under_fsdp2_resumes_in_two_processes_or_one(
    fsdp2_runs, lora_resumed_in_one_process, eos_prone_model_dir, tmp_path
):
    out, ddp_out = fsdp2_runs / "fsdp2_lora", fsdp2_runs / "ddp_lora"
    final, ddp = load(out / "final_0.pt"), load(ddp_out / "final_0.pt")
    # FSDP2 -> FSDP2 from the middle of a generation batch, writing the merged model too (built from the gathered
    # weights: a sharded model cannot be copied); DDP -> FSDP2 (the positional optimizer state mapped to names).
    launch(
        tmp_path,
        lora_job(
            eos_prone_model_dir,
            tmp_path / "two",
            resume=str(out / "checkpoint-3"),
            config={"save_merged": True},
            save_model=True,
        ),
        lora_job(eos_prone_model_dir, tmp_path / "from_ddp", resume=str(ddp_out / "checkpoint-2")),
        env=FSDP2,
    )
    resumed = load(tmp_path / "two" / "final_0.pt")
    assert resumed["global_step"] == 4 and max_difference(resumed["weights"], final["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in final["log_history"]]
    for directory in (tmp_path / "two" / "checkpoint-4", tmp_path / "two" / "final_model"):
        assert_merged_is_peft_merge(directory, eos_prone_model_dir)
    from_ddp = load(tmp_path / "from_ddp" / "final_0.pt")
    assert from_ddp["distributed_type"] == "FSDP"
    assert_lora_run_follows_ddp(from_ddp, ddp, eos_prone_model_dir)
    # FSDP2 -> one process at a generation boundary: the adapter and its name-keyed optimizer state load into the
    # plain model, and the run ends where resuming DDP's checkpoint of the same step ends, up to rounding.
    run_in_this_process(
        tmp_path,
        lora_job(
            eos_prone_model_dir,
            tmp_path / "one_from_ddp",
            resume=str(ddp_out / "checkpoint-2"),
            config={"per_device_train_batch_size": 12},
        ),
    )
    one, one_from_ddp = lora_resumed_in_one_process, load(tmp_path / "one_from_ddp" / "final_0.pt")
    assert one["num_processes"] == 1 and one["global_step"] == 4
    assert [e["loss"] for e in one["log_history"]] == pytest.approx(
        [e["loss"] for e in one_from_ddp["log_history"]], abs=1e-5
    )
    assert max_difference(adapter_of(one["weights"]), adapter_of(one_from_ddp["weights"])) < 1e-5


def test_fsdp1_and_what_fsdp2_cannot_do_are_refused_with_the_way_out(model_dir, tmp_path):
    launch(
        tmp_path, dict(job="refused", model=model_dir, out=str(tmp_path / "fsdp1")), env={**FSDP2, "FSDP_VERSION": "1"}
    )
    launch(
        tmp_path,
        dict(job="refused", model=model_dir, out=str(tmp_path / "prompt_tuning"), adapter="prompt_tuning"),
        dict(job="refused", model=model_dir, out=str(tmp_path / "compile"), config={"torch_compile": True}),
        dict(job="refused", model=model_dir, out=str(tmp_path / "each_node"), config={"save_on_each_node": True}),
        env=FSDP2,
    )
    for rank in (0, 1):
        fsdp1 = json.loads((tmp_path / "fsdp1" / f"error_{rank}.json").read_text())
        assert "FSDP1" in fsdp1 and "fsdp_version: 2" in fsdp1
        prompt_tuning = json.loads((tmp_path / "prompt_tuning" / f"error_{rank}.json").read_text())
        assert "Prompt-learning adapters" in prompt_tuning and "LoraConfig" in prompt_tuning
        assert "torch_compile under FSDP2" in json.loads((tmp_path / "compile" / f"error_{rank}.json").read_text())
        each_node = json.loads((tmp_path / "each_node" / f"error_{rank}.json").read_text())
        assert "save_on_each_node=True is supported with whole weights" in each_node and "all nodes share" in each_node


def test_fsdp2_sharded_checkpoints_resume_in_two_processes_or_one(
    fsdp2_runs, lora_resumed_in_one_process, eos_prone_model_dir, tmp_path
):
    # accelerate's SHARDED_STATE_DICT: each process writes its own shards (torch.distributed.checkpoint) into the
    # atomic checkpoint directory; nothing is gathered. The run is the FULL_STATE_DICT run, bit for bit; so is the
    # LoRA run (LORA_RUN), launched alongside.
    sharded_env = {**FSDP2, "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT"}
    launch(
        tmp_path,
        dict(job="train", model=eos_prone_model_dir, out=str(tmp_path / "sharded"), config=FSDP2_RUN, tiebreak=0.01),
        lora_job(eos_prone_model_dir, tmp_path / "sharded_lora"),
        env=sharded_env,
    )
    out, full = tmp_path / "sharded", load(fsdp2_runs / "fsdp2" / "final_0.pt")
    assert max_difference(load(out / "final_0.pt")["weights"], full["weights"]) == 0.0
    checkpoint = out / "checkpoint-3"
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp", "config.json"} <= set(files)
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    # FSDP2 -> FSDP2 from the middle of a generation batch: the unbroken run, exactly (the moving reference too).
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "two"),
            config=FSDP2_RUN,
            tiebreak=0.01,
            resume=str(checkpoint),
        ),
        lora_job(eos_prone_model_dir, tmp_path / "two_lora", resume=str(tmp_path / "sharded_lora" / "checkpoint-3")),
        env=sharded_env,
    )
    resumed = load(tmp_path / "two" / "final_0.pt")
    assert max_difference(resumed["weights"], full["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in full["log_history"]]
    # Sharded -> one process: the same weights as resuming the FULL_STATE_DICT checkpoint of the same step.
    config = {**FSDP2_RUN, "per_device_train_batch_size": 12}
    for name, source in (("from_sharded", out / "checkpoint-4"), ("from_full", fsdp2_runs / "fsdp2" / "checkpoint-4")):
        run_in_this_process(
            tmp_path,
            dict(
                job="train",
                model=eos_prone_model_dir,
                out=str(tmp_path / name),
                config=config,
                tiebreak=0.01,
                resume=str(source),
            ),
        )
    from_sharded, from_full = (
        load(tmp_path / "from_sharded" / "final_0.pt"),
        load(tmp_path / "from_full" / "final_0.pt"),
    )
    assert from_sharded["global_step"] == 6
    assert max_difference(from_sharded["weights"], from_full["weights"]) == 0.0
    # LoRA: the shards hold the adapter and its optimizer state, not the frozen base (torch keeps the LM head, tied
    # to the frozen embeddings); the run, resumed in two processes or one, is the FULL_STATE_DICT LoRA run's.
    import torch.distributed.checkpoint as dcp

    lora_full = load(fsdp2_runs / "fsdp2_lora" / "final_0.pt")
    saved = dcp.FileSystemReader(str(tmp_path / "sharded_lora" / "checkpoint-3" / "sharded")).read_metadata()
    weights = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert len([key for key in weights if "lora_" in key]) == 8 and not any("base_layer" in key for key in weights)
    for name in ("sharded_lora", "two_lora"):
        assert max_difference(load(tmp_path / name / "final_0.pt")["weights"], lora_full["weights"]) == 0.0, name
    run_in_this_process(
        tmp_path,
        lora_job(
            eos_prone_model_dir,
            tmp_path / "one_lora",
            resume=str(tmp_path / "sharded_lora" / "checkpoint-2"),
            config={"per_device_train_batch_size": 12},
        ),
    )
    one = load(tmp_path / "one_lora" / "final_0.pt")
    assert max_difference(one["weights"], lora_resumed_in_one_process["weights"]) == 0.0


def test_fsdp_fields_run_as_the_accelerate_config_does(fsdp2_runs, eos_prone_model_dir, tmp_path):
    # TRL's fsdp / fsdp_config under plain torchrun, no accelerate variables: transformers' legacy option string
    # and an FSDP2 config with the 'fsdp_' prefixes, sharded checkpoints. The run is the accelerate-configured
    # FSDP2 run, bit for bit; a second trainer in the same processes takes the same setup, another one is refused.
    # With checkpoints every 3 steps the reference is mixed at step 2 without a save in between (that crashed: the
    # reference's root module stayed unsharded after its forward, `mix_into_reference`).
    fields = {
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        },
    }
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "fsdp"),
            tiebreak=0.01,
            config={**FSDP2_RUN, "save_steps": 3, **fields},
        ),
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "again"),
            tiebreak=0.01,
            config={**FSDP2_RUN, "save_strategy": "no", "max_steps": 2, **fields},
        ),
        dict(
            job="refused",
            model=eos_prone_model_dir,
            out=str(tmp_path / "other"),
            config={"fsdp": "shard_grad_op auto_wrap"},
        ),
    )
    run, expected = load(tmp_path / "fsdp" / "final_0.pt"), load(fsdp2_runs / "fsdp2" / "final_0.pt")
    assert run["distributed_type"] == "FSDP" and run["global_step"] == 6
    for key in ("loss", "reward", "kl", "grad_norm", "entropy", "completions/mean_length"):
        assert [e.get(key) for e in run["log_history"]] == [e.get(key) for e in expected["log_history"]], key
    assert max_difference(run["weights"], expected["weights"]) == 0.0
    assert (tmp_path / "fsdp" / "checkpoint-3" / "sharded").is_dir()  # state_dict_type reached the checkpoints
    again = load(tmp_path / "again" / "final_0.pt")
    assert [e["loss"] for e in again["log_history"]] == [e["loss"] for e in run["log_history"][:2]]
    assert "differ from the FSDP setup an earlier trainer" in json.loads(
        (tmp_path / "other" / "error_0.json").read_text()
    )


# -------------------------------------------------------------------------------------------------- DeepSpeed
# ZeRO-2 through accelerate on CPU processes (gloo). DeepSpeed is not among the test extras (it JIT-compiles a
# communication op on first use): these run where it is installed, e.g. `pip install deepspeed` in a venv.
DEEPSPEED_ZERO2 = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
    "ACCELERATE_MIXED_PRECISION": "no",
}


@pytest.fixture(scope="module")
def zero2_runs(fsdp2_runs, eos_prone_model_dir, model_dir, tmp_path_factory):
    """Under ZeRO-2: the six-step run, one update per UPDATE_VARIANT and the LoRA run (`zero2_lora`); then both
    runs resumed from their checkpoint-3 (`resumed`, `resumed_lora`), in a second launch."""
    pytest.importorskip("deepspeed")
    directory = tmp_path_factory.mktemp("zero2")
    launch(
        directory,
        dict(job="train", model=eos_prone_model_dir, out=str(directory / "zero2"), config=FSDP2_RUN, tiebreak=0.01),
        dict(job="one_update", model=model_dir, out=str(directory / "update"), variants=UPDATE_VARIANTS),
        lora_job(eos_prone_model_dir, directory / "zero2_lora"),
        env=DEEPSPEED_ZERO2,
    )
    launch(
        directory,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(directory / "resumed"),
            config=FSDP2_RUN,
            tiebreak=0.01,
            resume=str(directory / "zero2" / "checkpoint-3"),
        ),
        lora_job(
            eos_prone_model_dir, directory / "resumed_lora", resume=str(directory / "zero2_lora" / "checkpoint-3")
        ),
        env=DEEPSPEED_ZERO2,
    )
    return directory


def test_zero2_makes_the_update_of_one_process(zero2_runs, one_process_update, model_dir):
    # With 2 accumulated micro-batches too: DeepSpeed must not divide the loss by the accumulation steps again.
    assert_same_update_as_one_process(zero2_runs / "update", one_process_update, model_dir)


def test_zero2_training_follows_ddp_and_its_checkpoint_resumes(zero2_runs, fsdp2_runs):
    zero2, ddp = load(zero2_runs / "zero2" / "final_0.pt"), load(fsdp2_runs / "ddp" / "final_0.pt")
    assert zero2["distributed_type"] == "DEEPSPEED" and zero2["global_step"] == 6
    # ZeRO-2 reduces the gradients in other buckets than DDP: the weights part at float rounding, and so does what
    # the next steps compute from them; the grad norm to 1e-5 of itself (the sixth step's is ~6: 1.6e-5 apart).
    for key in ("loss", "reward", "kl", "grad_norm"):
        tolerance = {"abs": 1e-5, "rel": 1e-5} if key == "grad_norm" else {"abs": 1e-5}
        assert [e.get(key) for e in zero2["log_history"]] == pytest.approx(
            [e.get(key) for e in ddp["log_history"]], **tolerance
        ), key
    assert max_difference(zero2["weights"], ddp["weights"]) < 1e-4
    assert max_difference(zero2["weights"], load(zero2_runs / "zero2" / "final_1.pt")["weights"]) == 0.0
    checkpoint = zero2_runs / "zero2" / "checkpoint-3"
    files = json.loads((checkpoint / "manifest.json").read_text())["files"]
    assert {
        "deepspeed/state/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "reference.safetensors",
    } <= set(files)
    resumed = load(zero2_runs / "resumed" / "final_0.pt")  # from checkpoint-3
    assert max_difference(resumed["weights"], zero2["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in zero2["log_history"]]


def deepspeed_module_keys(checkpoint) -> list[str]:
    """The weights' names in a checkpoint's DeepSpeed model-state file(s)."""
    return sorted(
        {
            key
            for path in (checkpoint / "deepspeed" / "state").glob("*model_states.pt")
            for key in torch.load(path, weights_only=False)["module"]
        }
    )


def assert_lora_checkpoint_holds_the_adapter_alone(checkpoint) -> None:
    # DeepSpeed's own state leaves the frozen base out (as transformers' Trainer saves PEFT models): the adapter,
    # and the LM head, which DeepSpeed keeps because it is tied to the frozen embeddings.
    keys = deepspeed_module_keys(checkpoint)
    assert len([k for k in keys if "lora_" in k]) == 8 and not any("base_layer" in k for k in keys), keys


def test_lora_under_zero2_follows_ddp_and_resumes(zero2_runs, fsdp2_runs, eos_prone_model_dir):
    zero2 = load(zero2_runs / "zero2_lora" / "final_0.pt")
    assert zero2["distributed_type"] == "DEEPSPEED"
    assert_lora_run_follows_ddp(zero2, load(fsdp2_runs / "ddp_lora" / "final_0.pt"), eos_prone_model_dir)
    assert max_difference(zero2["weights"], load(zero2_runs / "zero2_lora" / "final_1.pt")["weights"]) == 0.0
    assert_lora_checkpoint_holds_the_adapter_alone(zero2_runs / "zero2_lora" / "checkpoint-3")
    resumed = load(zero2_runs / "resumed_lora" / "final_0.pt")  # from checkpoint-3, mid-generation
    assert max_difference(resumed["weights"], zero2["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in zero2["log_history"]]


@pytest.fixture(scope="module")
def zero3_config(tmp_path_factory):
    return zero3_env(tmp_path_factory.mktemp("zero3"))


def zero3_env(directory) -> dict:
    """ZeRO-3 through accelerate's variables, its config file written into `directory`, with nothing kept resident:
    every forward gathers every layer's partitions (with DeepSpeed's defaults a model this small would stay whole
    and uneven forward counts would go unnoticed)."""
    path = directory / "ds_config.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_param_persistence_threshold": 0,
                    "stage3_max_live_parameters": 0,
                    "stage3_max_reuse_distance": 0,
                    "stage3_prefetch_bucket_size": 0,
                },
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
            }
        )
    )
    return {**DEEPSPEED_ZERO2, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}


ZERO3_RUN = {**FSDP2_RUN, "sync_ref_model": False}  # the reference stays the initial weights under ZeRO-3


@pytest.fixture(scope="module")
def zero3_runs(zero3_config, eos_prone_model_dir, tmp_path_factory):
    """ZERO3_RUN under ZeRO-3 and under DDP; the LoRA run under ZeRO-3 (`zero3_lora`), its final model saved with
    the merged weights; both ZeRO-3 runs resumed from their checkpoint-3 (`resumed`, `resumed_lora`)."""
    pytest.importorskip("deepspeed")
    directory = tmp_path_factory.mktemp("zero3_runs")
    launch(
        directory,
        dict(job="train", model=eos_prone_model_dir, out=str(directory / "zero3"), config=ZERO3_RUN, tiebreak=0.01),
        lora_job(eos_prone_model_dir, directory / "zero3_lora", config={"save_merged": True}, save_model=True),
        env=zero3_config,
    )
    launch(
        directory,
        dict(job="train", model=eos_prone_model_dir, out=str(directory / "ddp"), config=ZERO3_RUN, tiebreak=0.01),
    )
    launch(
        directory,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(directory / "resumed"),
            config=ZERO3_RUN,
            tiebreak=0.01,
            resume=str(directory / "zero3" / "checkpoint-3"),
        ),
        lora_job(
            eos_prone_model_dir, directory / "resumed_lora", resume=str(directory / "zero3_lora" / "checkpoint-3")
        ),
        env=zero3_config,
    )
    return directory


def test_zero3_samples_in_step_follows_ddp_and_resumes(zero3_runs):
    zero3, ddp = load(zero3_runs / "zero3" / "final_0.pt"), load(zero3_runs / "ddp" / "final_0.pt")
    assert zero3["distributed_type"] == "DEEPSPEED"
    assert all(e["completions/min_length"] < e["completions/max_length"] for e in zero3["log_history"][::2])
    for key in ("loss", "reward", "kl", "completions/mean_length"):
        assert [e.get(key) for e in zero3["log_history"]] == pytest.approx(
            [e.get(key) for e in ddp["log_history"]], abs=1e-5
        ), key
    assert max_difference(zero3["weights"], ddp["weights"]) < 1e-4
    resumed = load(zero3_runs / "resumed" / "final_0.pt")  # from checkpoint-3
    assert max_difference(resumed["weights"], zero3["weights"]) == 0.0


def test_lora_under_zero3_follows_ddp_saves_merged_and_resumes(zero3_runs, fsdp2_runs, eos_prone_model_dir):
    # The base is loaded partitioned, the adapter partitioned with it; the adapter-off reference is one more
    # partitioned forward, in step on both processes.
    zero3 = load(zero3_runs / "zero3_lora" / "final_0.pt")
    assert zero3["distributed_type"] == "DEEPSPEED"
    assert_lora_run_follows_ddp(zero3, load(fsdp2_runs / "ddp_lora" / "final_0.pt"), eos_prone_model_dir)
    assert_lora_checkpoint_holds_the_adapter_alone(zero3_runs / "zero3_lora" / "checkpoint-3")
    # save_model gathers the adapter; the merged model is built from the gathered full weights.
    assert_merged_is_peft_merge(zero3_runs / "zero3_lora" / "final_model", eos_prone_model_dir)
    resumed = load(zero3_runs / "resumed_lora" / "final_0.pt")  # from checkpoint-3, mid-generation
    assert max_difference(resumed["weights"], zero3["weights"]) == 0.0
    assert [e["loss"] for e in resumed["log_history"]] == [e["loss"] for e in zero3["log_history"]]


def test_deepspeed_field_runs_as_the_accelerate_config_does(
    zero2_runs, zero3_runs, zero3_config, eos_prone_model_dir, tmp_path
):
    # TRL scripts pass DeepSpeed as GRPOConfig(deepspeed=...) under plain torchrun: a dict of ZeRO-2 with 'auto'
    # values, and the ZeRO-3 config file's path. No accelerate variables are set: the field alone turns DeepSpeed on.
    zero2 = {
        "zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    # A second trainer in the same processes runs on the same config (accelerate sets DeepSpeed up once per
    # process); a different config is refused by name.
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "zero2"),
            tiebreak=0.01,
            config={**FSDP2_RUN, "save_strategy": "no", "deepspeed": zero2},
        ),
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "again"),
            tiebreak=0.01,
            config={**FSDP2_RUN, "save_strategy": "no", "deepspeed": zero2, "max_steps": 2},
        ),
        dict(
            job="refused",
            model=eos_prone_model_dir,
            out=str(tmp_path / "other"),
            config={"deepspeed": {**zero2, "zero_optimization": {"stage": 1}}},
        ),
    )
    launch(
        tmp_path,
        dict(
            job="train",
            model=eos_prone_model_dir,
            out=str(tmp_path / "zero3"),
            tiebreak=0.01,
            config={**ZERO3_RUN, "save_strategy": "no", "deepspeed": zero3_config["ACCELERATE_DEEPSPEED_CONFIG_FILE"]},
        ),
    )
    again = load(tmp_path / "again" / "final_0.pt")
    assert [e["loss"] for e in again["log_history"]] == [
        e["loss"] for e in load(tmp_path / "zero2" / "final_0.pt")["log_history"][:2]
    ]
    assert "differs from the DeepSpeed config an earlier trainer" in json.loads(
        (tmp_path / "other" / "error_0.json").read_text()
    )
    for name, expected, exact in (("zero2", zero2_runs / "zero2", True), ("zero3", zero3_runs / "zero3", False)):
        run, expected = load(tmp_path / name / "final_0.pt"), load(expected / "final_0.pt")
        assert run["distributed_type"] == "DEEPSPEED" and run["global_step"] == expected["global_step"] == 6
        for key in ("loss", "reward", "kl", "grad_norm", "completions/mean_length"):
            assert [e.get(key) for e in run["log_history"]] == pytest.approx(
                [e.get(key) for e in expected["log_history"]], abs=0 if exact else 1e-5
            ), key
        # ZeRO-3 from the field loads the model partitioned (zero.Init, as transformers' Trainer does); the
        # accelerate-variables run above loads it whole: the same run up to float summation order.
        assert max_difference(run["weights"], expected["weights"]) <= (0.0 if exact else 1e-4)


@pytest.mark.slow
def test_two_nodes_through_a_c10d_rendezvous(model_dir, tmp_path):
    # The multi-node launch line of the README, with two "nodes" on this machine (one process each): they meet at
    # a c10d rendezvous endpoint, split the prompts, and end with identical weights after the same steps.
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps(
            [
                dict(
                    job="train",
                    model=model_dir,
                    out=str(tmp_path / "out"),
                    tiebreak=0.01,
                    config={**TWO_PROCESS_RUN, "save_strategy": "no"},
                )
            ]
        )
    )
    endpoint, script = f"127.0.0.1:{free_port()}", write_script(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--rdzv-id",
                "grpo",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                script,
                str(spec_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    rank0, rank1 = load(tmp_path / "out" / "final_0.pt"), load(tmp_path / "out" / "final_1.pt")
    assert rank0["num_processes"] == rank1["num_processes"] == 2 and rank0["global_step"] == 6
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    calls = [len((tmp_path / "out" / f"rewards_{rank}.jsonl").read_text().splitlines()) for rank in (0, 1)]
    assert calls == [3, 3]  # each node scored its own slice of every generation batch


def test_fsdp2_evaluates_an_uneven_split_in_step(eos_prone_model_dir, tmp_path):
    # 3 eval prompts over 2 processes, one prompt per batch: process 0 samples 2 batches, process 1 only 1, and
    # then samples a discarded one so that its sharded forwards stay in step (otherwise the run hangs).
    config = {
        **FSDP2_RUN,
        "max_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "steps",
        "eval_steps": 1,
        "num_generations_eval": 2,
        "per_device_eval_batch_size": 2,
    }
    launch(
        tmp_path,
        dict(
            job="train", model=eos_prone_model_dir, out=str(tmp_path / "out"), config=config, tiebreak=0.01, eval_rows=3
        ),
        env=FSDP2,
        timeout=300,
    )
    history = load(tmp_path / "out" / "final_0.pt")["log_history"]
    evaluation = [e for e in history if "eval/reward" in e]
    assert len(evaluation) == 1 and 0.0 <= evaluation[0]["eval/reward"] <= 1.1
