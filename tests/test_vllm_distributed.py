"""vLLM in several training processes (torchrun on CPU, gloo): one colocated engine per process, each sampling its
own prompts, under DDP and FSDP2. Run in the vLLM environment: `python -m pytest -m vllm`.

What is shown, and how. SCRIPT trains under `torch.distributed.run --nproc_per_node 2` with `use_vllm=True` and
records, per process and generation, the rollout vLLM returned. Then:
- each process's vLLM sampled from that process's current weights: after every push, the largest gap between
  vLLM's log-probs and the training forward's (the logged `sampling/sampling_logp_difference/max`, a maximum over
  the processes) is below 1e-4, and each engine pushed before every generation but the first;
- 2 processes train as 1 with the same global batch: the two processes' rollouts of each generation, joined, are
  replayed to one process (an engine that returns them), which ends with the same weights and losses. The processes'
  samples themselves cannot equal one process's: each process draws from its own seed, as the in-process engine
  does (`rollout_seed(seed, generation, process_index)`), so only the update given the samples is compared;
- under DDP both processes end with identical weights; under FSDP2 every push gathers the weights one parameter at
  a time (`DTensor.full_tensor()`), and vLLM still samples from them exactly.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from test_distributed import FSDP2, launch, load, max_difference, run_in_this_process, zero3_env

from grpokit.testing import save_tiny_model

pytestmark = pytest.mark.vllm

LETTERS = "abcdefgh"
TOLERANCE = 1e-4  # fp32: vLLM's kernels against the training forward (seen: ~1e-6)

SCRIPT = textwrap.dedent(
    '''
    import json, os, signal, subprocess, sys, time, urllib.request
    from pathlib import Path

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.distributed import full_state_dict
    from grpokit.rollout import Rollout

    RANK = int(os.environ.get("RANK", 0))
    LETTERS = "abcdefgh"


    def dataset():
        return Dataset.from_list([{"prompt": f"{a}{b}:", "letter": a} for a in LETTERS for b in LETTERS])


    def repeat_letter(completions, letter, **kwargs):  # a tie-break so that no group has equal rewards
        return [(1.0 if c[:1] == t else 0.0) + 0.01 * (sum(map(ord, c)) % 7) for c, t in zip(completions, letter)]


    def config(out, **values):
        return GRPOConfig(output_dir=str(out), max_completion_length=8, lr_scheduler_type="constant", logging_steps=1,
                          save_strategy="no", disable_tqdm=True, seed=0, num_generations=8,
                          use_vllm=True, vllm_max_model_length=64, vllm_importance_sampling_mode="token_truncate",
                          **values)


    class Replay:
        """Returns, for the k-th generation, the rollouts the processes of a recorded run sampled, joined."""

        logprobs_match_training = False

        def __init__(self, recorded):
            self.recorded, self.calls = recorded, 0

        def sync_weights(self, model):
            pass

        def generate(self, prompts, params, seed):
            parts = [per_process[self.calls] for per_process in self.recorded]
            rows = lambda ids, counts: [p for p, c in zip(ids, counts) for _ in range(c)]  # noqa: E731
            assert rows(prompts.ids, prompts.counts) == [r for p in parts for r in rows(p["ids"], p["counts"])]
            self.calls += 1
            return Rollout.concat([p["rollout"] for p in parts])


    class RestartServer(TrainerCallback):
        """The main process replaces the vLLM server after a step: the old one killed, a new one (a new instance,
        without the pushed weights) started with the same command, on the same port."""

        def __init__(self, spec):
            self.spec = spec

        def on_step_end(self, args, state, control, **kwargs):
            if RANK != 0 or state.global_step != self.spec["after_step"]:
                return
            os.kill(self.spec["pid"], signal.SIGKILL)
            for _ in range(60):  # until the old one no longer answers
                try:
                    urllib.request.urlopen(self.spec["url"] + "/health", timeout=1)
                    time.sleep(0.5)
                except OSError:
                    break
            log = open(self.spec["log"], "w")
            process = subprocess.Popen(self.spec["command"], stdout=log, stderr=subprocess.STDOUT)
            Path(self.spec["pid_file"]).write_text(str(process.pid))
            deadline = time.monotonic() + 300
            while True:
                try:
                    urllib.request.urlopen(self.spec["url"] + "/health", timeout=2)
                    return
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the new vLLM server did not come up: " + Path(self.spec["log"]).read_text())
                    time.sleep(1)


    def train(spec):
        out = Path(spec["out"])
        recorded = None
        if spec.get("replay"):
            recorded = [torch.load(Path(spec["replay"]) / f"rollouts_{rank}.pt", weights_only=False)
                        for rank in range(spec["replay_processes"])]
        callbacks = [RestartServer(spec["restart_server"])] if spec.get("restart_server") else None
        peft_config = None
        if spec.get("lora"):
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        trainer = GRPOTrainer(model=spec["model"], reward_funcs=repeat_letter, args=config(out, **spec["config"]),
                              train_dataset=dataset(), rollout_engine=Replay(recorded) if recorded else None,
                              callbacks=callbacks, peft_config=peft_config)
        engine, rollouts, pushes = trainer.engine, [], [0]
        if not recorded:  # observe the real generation: its rollouts are the evidence
            generate, push = engine.generate, engine.push

            def counted_push(*args, **kwargs):  # the weights sent to vLLM, after the engine's first (when built)
                pushes[0] += 1
                return push(*args, **kwargs)

            def observed(prompts, params, seed):
                rollout = generate(prompts, params, seed)
                rollouts.append({"ids": prompts.ids, "counts": prompts.counts, "rollout": rollout,
                                 "pushes": pushes[0]})
                return rollout

            engine.generate, engine.push = observed, counted_push
        trainer.train()
        out.mkdir(parents=True, exist_ok=True)
        torch.save(rollouts, out / f"rollouts_{RANK}.pt")
        torch.save({"weights": full_state_dict(trainer.unwrapped_model), "log_history": trainer.state.log_history[:-1],
                    "engine": type(engine).__name__, "distributed_type": trainer.accelerator.distributed_type.value,
                    "num_processes": trainer.accelerator.num_processes}, out / f"final_{RANK}.pt")


    def main(spec_path):
        for spec in json.loads(Path(spec_path).read_text()):
            train(spec)


    if __name__ == "__main__":
        main(sys.argv[1])
    '''
)

# 12 completions per process, 24 in all: 3 prompts of G = 8, the second spanning the processes (8 + 4 | 4 + 8). One
# optimizer step per generation, so that one process with 24 rows takes the same steps. With adam_epsilon =
# learning_rate >> |g| AdamW's update is its first moment (a running mean of the gradients, unnormalised) and
# max_grad_norm = 0 leaves it unclipped, so float rounding is not amplified as AdamW's per-weight normalisation does
# with gradients near 0 (as tests/test_distributed.py compares one update).
UPDATE = dict(learning_rate=1e6, adam_epsilon=1e6, max_grad_norm=0.0, max_steps=3)
TWO_PROCESSES = dict(per_device_train_batch_size=12, **UPDATE)
ONE_PROCESS = dict(per_device_train_batch_size=24, **UPDATE)


def save_policy(path) -> str:
    # vLLM's CPU attention needs head sizes of 32 or more: 2 heads of 32 (test_vllm.tiny's shape).
    return str(save_tiny_model(path, chars=LETTERS + ":", hidden_size=64, num_heads=2, num_kv_heads=1))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_policy(tmp_path_factory.mktemp("model") / "tiny")


def launch_script(directory, spec: dict, env: dict | None = None) -> None:
    launch(directory, spec, env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}, script=SCRIPT)


def check_two_processes_train_as_one(
    directory,
    model_dir,
    distributed_type: str,
    engine: str = "VLLMEngine",
    pushes=([0, 1, 2], [0, 1, 2]),
    lora: bool = False,
) -> None:
    """The recorded 2-process run in `directory / "two"` against one process replaying its rollouts. `pushes`: each
    process's engine's pushes so far at each of the 3 generations. `lora`: the run trained a LoRA adapter."""
    two = directory / "two"
    rank0, rank1 = load(two / "final_0.pt"), load(two / "final_1.pt")
    assert rank0["engine"] == rank1["engine"] == engine
    assert rank0["distributed_type"] == distributed_type and rank0["num_processes"] == 2
    history = rank0["log_history"]
    assert len(history) == 3
    gaps = [entry["sampling/sampling_logp_difference/max"] for entry in history]
    print(f"{distributed_type}: max |vLLM - training forward| log-prob per generation (both processes): {gaps}")
    assert all(gap <= TOLERANCE for gap in gaps), gaps
    for rank in (0, 1):
        rollouts = load(two / f"rollouts_{rank}.pt")
        assert [r["pushes"] for r in rollouts] == pushes[rank]
        assert all(int(r["rollout"].loss_mask.sum()) > 12 for r in rollouts)
        # The check can fail: the last generation's tokens scored by the initial weights (what a process whose engine
        # missed the pushes would have sampled from) are far from vLLM's log-probs.
        assert stale_gap(model_dir, rollouts[-1]["rollout"]) > 1e-1
    first0, first1 = (load(two / f"rollouts_{rank}.pt")[0] for rank in (0, 1))
    assert first0["counts"] == [8, 4] and first1["counts"] == [4, 8]  # the middle group spans the processes
    assert first0["ids"][-1] == first1["ids"][0]
    # The replay in one process: the same global batches, the same update.
    run_in_this_process(
        directory,
        dict(
            out=str(directory / "one"),
            model=model_dir,
            config=ONE_PROCESS,
            replay=str(two),
            replay_processes=2,
            lora=lora,
        ),
        script=SCRIPT,
    )
    one = load(directory / "one" / "final_0.pt")
    if lora:  # the adapter's B starts at zero
        moved = max(v.abs().max().item() for k, v in one["weights"].items() if "lora_B" in k)
        assert all(torch.equal(v, rank0["weights"][k]) for k, v in one["weights"].items() if "base_layer" in k)
    else:
        initial = load(two / "initial.pt")
        moved = max_difference(one["weights"], {k: v for k, v in initial.items() if k in one["weights"]})
    assert moved > 1e-2
    assert max_difference(rank0["weights"], one["weights"]) < 1e-5 * moved
    for key in ("loss", "reward", "sampling/importance_sampling_ratio/mean"):
        assert [e[key] for e in history] == pytest.approx([e[key] for e in one["log_history"]], abs=1e-5), key
    if distributed_type == "FSDP":
        assert rank1["weights"] == {}  # FSDP2: the main process holds the gathered weights
    else:  # DDP replicas; ZeRO-3 gathers on every process
        assert max_difference(rank0["weights"], rank1["weights"]) == 0.0


def stale_gap(model_dir, rollout) -> float:
    """Max |log-prob under the initial weights - vLLM's| over a rollout's sampled tokens (temperature 1)."""
    from transformers import AutoModelForCausalLM

    from grpokit.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logprobs, _ = token_logprobs(
            model,
            torch.cat([rollout.prompt_ids, rollout.completion_ids], 1),
            torch.cat([rollout.prompt_mask, rollout.attention_mask], 1),
            rollout.completion_ids.shape[1],
            1.0,
        )
    return ((logprobs - rollout.sampling_logprobs) * rollout.loss_mask).abs().max().item()


def initial_weights(model_dir, two) -> None:
    from transformers import AutoModelForCausalLM

    two.mkdir(parents=True, exist_ok=True)
    torch.save(AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), two / "initial.pt")


def test_two_processes_each_sample_with_their_own_engine_and_train_as_one_ddp(model_dir, tmp_path):
    initial_weights(model_dir, tmp_path / "two")
    launch_script(tmp_path, dict(out=str(tmp_path / "two"), model=model_dir, config=TWO_PROCESSES))
    # Each process's engine pushed before every generation but the first (the weights changed at each step).
    check_two_processes_train_as_one(tmp_path, model_dir, "MULTI_CPU")


def test_fsdp2_pushes_gathered_parameters_one_at_a_time_and_trains_as_one_process(model_dir, tmp_path):
    initial_weights(model_dir, tmp_path / "two")
    launch_script(tmp_path, dict(out=str(tmp_path / "two"), model=model_dir, config=TWO_PROCESSES), env=FSDP2)
    check_two_processes_train_as_one(tmp_path, model_dir, "FSDP")


def test_lora_under_fsdp2_pushes_each_layer_merged_from_its_gathered_pieces(model_dir, tmp_path):
    """LoRA under FSDP2 with vLLM: each push gathers a LoRA layer's base weight and adapter and sends their merge
    (W + scaling · B A, as peft merges; tests/test_vllm_client.py shows it bit for bit), the model untouched. vLLM
    samples from the merged weights (log-probs equal the training forward's, with the adapter, after every push),
    and the run trains as one process given the same samples; the frozen base never moves."""
    initial_weights(model_dir, tmp_path / "two")
    launch_script(
        tmp_path, dict(out=str(tmp_path / "two"), model=model_dir, config=TWO_PROCESSES, lora=True), env=FSDP2
    )
    check_two_processes_train_as_one(tmp_path, model_dir, "FSDP", lora=True)


@pytest.mark.parametrize("mode", ["colocate", "colocate_lora", "server"])
def test_zero3_pushes_gathered_partitions_one_parameter_at_a_time(model_dir, tmp_path, mode):
    """DeepSpeed ZeRO-3 with vLLM: every push gathers the partitions one parameter at a time
    (`deepspeed.zero.GatheredParameters`, a collective; a LoRA layer's base weight and adapter together, merged as
    peft merges), and vLLM samples from the current weights. DeepSpeed writes its partitions without bumping the
    tensors' version counters, so under ZeRO-3 every sync pushes (one push more than DDP's, at the first
    generation). Colocated: each process pushes into its own vLLM; server mode: both gather and the main process
    sends."""
    pytest.importorskip("deepspeed")
    initial_weights(model_dir, tmp_path / "two")
    config, pushes, server = TWO_PROCESSES, ([1, 2, 3], [1, 2, 3]), None
    if mode == "server":
        from ports import free_port
        from test_vllm import tiny
        from test_vllm_server import save, start_server

        model, tokenizer = tiny(tied=True, seed=1)
        port = free_port()
        server = start_server(save(model, tokenizer, tmp_path / "served"), port)
        config = {**TWO_PROCESSES, "vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{port}"}
        pushes = ([1, 2, 3], [0, 0, 0])
    try:
        launch_script(
            tmp_path,
            dict(out=str(tmp_path / "two"), model=model_dir, config=config, lora=mode == "colocate_lora"),
            env=zero3_env(tmp_path),
        )
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=30)
    check_two_processes_train_as_one(
        tmp_path,
        model_dir,
        "DEEPSPEED",
        engine="VLLMServerEngine" if server else "VLLMEngine",
        pushes=pushes,
        lora=mode == "colocate_lora",
    )
