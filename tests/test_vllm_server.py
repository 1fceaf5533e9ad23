"""Server mode: a `grpokit vllm-serve` started by the test on localhost, and the trainer's client engine
(`grpokit.rollout.vllm_client`). Run in the vLLM environment: `python -m pytest -m vllm`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from letters import letter_config, letter_dataset, repeat_letter
from ports import free_port
from test_vllm import TOLERANCE, check_pushes, counted_pushes, logprob_gap, tiny, train_a_step
from transformers import TrainerCallback

from grpokit import GRPOTrainer

pytestmark = pytest.mark.vllm

# Every server of these tests takes a token (grpokit.vllm_server), which the trainers send from this environment.
os.environ.setdefault("GRPOKIT_VLLM_TOKEN", "grpokit-test-token")


def server_command(model_dir: Path, port: int, max_model_len: int = 64, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "grpokit.vllm_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        "64",
        "--dtype",
        "float32",
        *extra,
    ]


def start_server(model_dir: Path, port: int, max_model_len: int = 64, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`grpokit vllm-serve` in its own process, waited for until it answers (or its log is shown)."""
    import urllib.request

    log = open(model_dir.parent / f"server-{port}.log", "w")  # noqa: SIM115 (the server's process writes it until stopped)
    process = subprocess.Popen(
        server_command(model_dir, port, max_model_len, extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "GRPOKIT_VLLM_TOKEN": os.environ["GRPOKIT_VLLM_TOKEN"]},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {(model_dir.parent / f'server-{port}.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("the server did not come up in 300 s")


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=30)


def save(model, tokenizer, path: Path) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tokenizer = tiny(tied=True, seed=1)
    model_dir = save(model, tokenizer, tmp_path_factory.mktemp("served") / "model")
    port = free_port()
    process = start_server(model_dir, port)
    yield f"http://127.0.0.1:{port}", model_dir
    stop(process)


def test_server_logprobs_equal_the_training_forward_after_each_push(server):
    from grpokit.rollout.vllm_client import VLLMServerEngine

    url, _ = server
    # The served checkpoint is another seed's weights: the first sync must push the policy's.
    model, tokenizer = tiny(tied=True, seed=0)
    engine = VLLMServerEngine(model, url, timeout=30)
    assert logprob_gap(engine, model, tokenizer) > 1e-2
    with counted_pushes(engine) as push:
        engine.sync_weights(model)
    assert push.call_count == 1
    check_pushes(engine, model, tokenizer)


def test_broadcast_pushes_through_a_process_group_give_the_training_forwards_logprobs(server):
    # TRL's vllm_group_port: the weights go through a gloo group of two on CPU (NCCL on GPUs), not over HTTP.
    from grpokit.rollout.vllm_client import VLLMServerEngine

    url, _ = server
    model, tokenizer = tiny(tied=True, seed=2)  # neither the served checkpoint nor the other tests' weights
    engine = VLLMServerEngine(model, url, timeout=30, group_port=free_port())
    assert logprob_gap(engine, model, tokenizer) > 1e-2
    version = engine.request("GET", "/info")["version"]
    with counted_pushes(engine) as push:
        engine.sync_weights(model)
    assert push.call_count == 1 and engine.group is not None
    assert engine.request("GET", "/info")["version"] == version + 1
    check_pushes(engine, model, tokenizer)
    # A second client (a new run against the same server) joins a group of its own at another port.
    again = VLLMServerEngine(model, url, timeout=30, group_port=free_port())
    train_a_step(model, seed=7)
    again.sync_weights(model)
    assert logprob_gap(again, model, tokenizer) <= TOLERANCE


def test_structured_outputs_in_server_mode_every_completion_matches_the_regex(server):
    """vllm_structured_outputs_regex in server mode: the request carries the regex, and the server (which loaded
    the tokenizer its checkpoint directory holds) masks the tokens that cannot continue a match; the log-probs are
    the masked distribution's (test_vllm.py's check, against the training forward of the pushed weights)."""
    from test_vllm import PROMPTS, check_structured_outputs, params_for

    from grpokit.rollout.vllm_client import VLLMServerEngine

    url, _ = server
    pattern = "[ab]{1,3}(c|de):"
    model, tokenizer = tiny(tied=True, seed=3)
    engine = VLLMServerEngine(model, url, timeout=30, structured_outputs_regex=pattern)
    assert engine.info["structured_outputs"] is True
    engine.sync_weights(model)
    check_structured_outputs(engine.generate(PROMPTS, params_for(tokenizer), seed=5), model, tokenizer, pattern)


def test_server_of_another_vocabulary_or_model_is_refused(server):
    from grpokit.rollout.vllm_client import VLLMServerEngine
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    url, _ = server
    other_vocab = build_tiny_model(len(build_char_tokenizer("abc:")), hidden_size=64, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens; the policy's has \d+"):
        VLLMServerEngine(other_vocab, url, timeout=30)
    model, _ = tiny()
    wider = build_tiny_model(model.config.vocab_size, hidden_size=128, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match=r"serves another model .hidden_size: server 64, policy 128"):
        VLLMServerEngine(wider, url, timeout=30)


class KillAt(TrainerCallback):
    def __init__(self, step: int, process: subprocess.Popen):
        self.step, self.process = step, process

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            stop(self.process)


@pytest.mark.parametrize("transport, max_staleness", [("http", None), ("broadcast", None), ("http", 1)])
def test_the_server_going_away_mid_run_fails_clearly_and_the_run_resumes(tmp_path, transport, max_staleness):
    """The server SIGKILLed at the end of step 3: the run stops with the client's message (under asynchronous
    generation, raised by the producer, which was sampling ahead, once the batches it had sampled are trained), the
    checkpoints are intact, and a run resumed against a new server reaches step 6 sampling from its own weights."""
    model, tokenizer = tiny(seed=0)
    model_dir = save(model, tokenizer, tmp_path / "model")
    port = free_port()
    args = letter_config(
        tmp_path,
        max_steps=6,
        save_steps=2,
        save_strategy="steps",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_host="127.0.0.1",
        vllm_server_port=port,
        vllm_server_timeout=20,
        vllm_importance_sampling_mode="token_truncate",
        vllm_group_port=free_port() if transport == "broadcast" else None,
        max_staleness=max_staleness,
    )
    process = start_server(model_dir, port)
    try:
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=repeat_letter,
            args=args,
            train_dataset=letter_dataset(),
            callbacks=[KillAt(3, process)],
        )
        raised_by = ConnectionError if max_staleness is None else RuntimeError  # the producer's failure
        with pytest.raises(raised_by, match=r"stopped answering.*resume the run from its last checkpoint") as raised:
            trainer.train()
        if max_staleness is not None:
            assert raised.value.args[0].startswith("The generation producer failed: ConnectionError")
            assert isinstance(raised.value.__cause__, ConnectionError)
    finally:
        stop(process)
    # Asynchronous: the producer may have sampled the next batches before the server died; the trainer trains them.
    stopped = trainer.state.global_step
    assert stopped == 3 if max_staleness is None else 3 <= stopped < 6
    out = Path(args.output_dir)
    # Asynchronous (exact schedule): a checkpoint holds the batches sampled by weights older than its own, so the one
    # at the step the run stopped at could not be written (those batches needed the dead server); nothing else is.
    saved = [f"checkpoint-{step}" for step in range(2, stopped + 1, 2) if max_staleness is None or step < stopped]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == saved  # intact; nothing half-written
    # A new server (the original checkpoint: the resumed run pushes its own weights first) and a resumed run.
    process = start_server(model_dir, port)
    try:
        resumed = GRPOTrainer(
            model=str(model_dir), reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset()
        )
        resumed.train(resume_from_checkpoint=True)
    finally:
        stop(process)
    assert resumed.state.global_step == 6
    assert [r["step"] for r in resumed.state.log_history if "reward" in r] == [1, 2, 3, 4, 5, 6]
    assert (out / "checkpoint-6").is_dir()
    # The resumed run trained from checkpoint-2's weights, pushed to the new server: its first generation's
    # log-probs from vLLM match the training forward's (the correction's metric), not the served checkpoint's.
    first = next(r for r in resumed.state.log_history if r.get("step") == int(saved[-1].split("-")[1]) + 1)
    assert first["sampling/sampling_logp_difference/max"] < 1e-3


def test_two_training_processes_share_one_server_and_only_the_main_one_pushes(server, tmp_path):
    """Server mode under torchrun (2 CPU processes, DDP): each process asks the one server for its own prompts; the
    main process pushes the weights and the other waits for the push before sampling, so both sample from the
    current weights (vLLM's log-probs equal the training forward's on both), and the run trains as one process
    given the same samples (tests/test_vllm_distributed.py's check)."""
    from test_vllm_distributed import (
        TWO_PROCESSES,
        check_two_processes_train_as_one,
        initial_weights,
        launch_script,
        save_policy,
    )

    url, _ = server
    model_dir = save_policy(tmp_path / "policy")  # another seed than the served checkpoint: the first sync pushes
    initial_weights(model_dir, tmp_path / "two")
    config = {**TWO_PROCESSES, "vllm_mode": "server", "vllm_server_base_url": url, "vllm_server_timeout": 60}
    launch_script(tmp_path, dict(out=str(tmp_path / "two"), model=model_dir, config=config))
    # Only the main process pushes: before each generation (the first replaces the served checkpoint's weights).
    check_two_processes_train_as_one(
        tmp_path, model_dir, "MULTI_CPU", engine="VLLMServerEngine", pushes=([1, 2, 3], [0, 0, 0])
    )


def test_a_restarted_server_gets_the_weights_pushed_again(tmp_path):
    """A server that restarted since the last push (same port, a new instance without the pushed weights) answers
    the next generation with 409; the client pushes the weights again and samples from them."""
    from grpokit.rollout.vllm_client import VLLMServerEngine

    model, tokenizer = tiny(seed=0)
    model_dir = save(model, tokenizer, tmp_path / "model")
    train_a_step(model, seed=3)  # the policy is no longer the checkpoint the server starts from
    port = free_port()
    process = start_server(model_dir, port)
    try:
        engine = VLLMServerEngine(model, f"http://127.0.0.1:{port}", timeout=30)
        with counted_pushes(engine) as push:
            engine.sync_weights(model)
            first = engine.info["instance"]
            stop(process)
            process = start_server(model_dir, port)
            engine.sync_weights(model)  # the weights did not change: nothing is pushed here
            assert push.call_count == 1
            # Without the second push vLLM would sample from the checkpoint's weights (a gap > 1e-2, as
            # check_pushes shows after a training step).
            assert logprob_gap(engine, model, tokenizer) <= TOLERANCE
            assert push.call_count == 2 and engine.info["instance"] != first
    finally:
        stop(process)


def test_fsdp2_training_processes_gather_and_the_main_one_pushes_to_the_server(tmp_path):
    """Server mode under FSDP2 (2 CPU processes): each push gathers the sharded weights one parameter at a time on
    both processes (a collective) and the main process sends them; both sample from the current weights, and the
    run trains as one process given the same samples. The server is restarted after step 1 (by the main process):
    at the next generation both processes meet the new instance (409), agree on it (an all-reduce) and push again
    together, so the weights vLLM samples from are the policy's, not the checkpoint's."""
    import signal

    from test_distributed import FSDP2
    from test_vllm_distributed import (
        TWO_PROCESSES,
        check_two_processes_train_as_one,
        initial_weights,
        launch_script,
        save_policy,
    )

    model, tokenizer = tiny(tied=True, seed=1)
    served = save(model, tokenizer, tmp_path / "served")
    model_dir = save_policy(tmp_path / "policy")  # another seed than the served checkpoint: the first sync pushes
    initial_weights(model_dir, tmp_path / "two")
    port = free_port()
    process = start_server(served, port)
    url, pid_file = f"http://127.0.0.1:{port}", tmp_path / "restarted.pid"
    restart = dict(
        after_step=1,
        pid=process.pid,
        command=server_command(served, port),
        url=url,
        pid_file=str(pid_file),
        log=str(tmp_path / "restarted.log"),
    )
    config = {**TWO_PROCESSES, "vllm_mode": "server", "vllm_server_base_url": url, "vllm_server_timeout": 60}
    try:
        launch_script(
            tmp_path, dict(out=str(tmp_path / "two"), model=model_dir, config=config, restart_server=restart), env=FSDP2
        )
    finally:
        stop(process)
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert pid_file.exists()  # the server was restarted
    # The main process's pushes: the first sync; at generation 2 the sync (to the new server) and the push after
    # its 409; the sync of generation 3. The other process sends none, though it gathers at each.
    check_two_processes_train_as_one(
        tmp_path, model_dir, "FSDP", engine="VLLMServerEngine", pushes=([1, 3, 4], [0, 0, 0])
    )


@pytest.mark.parametrize("model_type", ["llava", "gemma3", "qwen2_vl"])
def test_image_prompts_in_server_mode_are_sampled_from_the_pushed_weights(tmp_path, model_type):
    """A vision-language model's checkpoint and processor served by `grpokit vllm-serve`: the prompts' images travel
    as PNG with their unexpanded ids, the server's vLLM expands them as the processor did (checked there at each
    call), and after the push (the vision tower renamed to vLLM's names on the server) its log-probs are the
    training forward's (LLaVA) or the causal forward's (Gemma 3), as in colocate mode (test_vllm.py)."""
    import torch
    from test_vllm import check_image_prompts, tiny_vlm

    from grpokit.rollout.vllm_client import VLLMServerEngine

    served, processor = tiny_vlm(model_type, seed=1)
    model_dir = save(served, processor, tmp_path / "model")
    port = free_port()
    process = start_server(model_dir, port, max_model_len=128)
    try:
        model, _ = tiny_vlm(model_type, seed=0)
        assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), served.parameters()))
        engine = VLLMServerEngine(model, f"http://127.0.0.1:{port}", timeout=60)
        assert engine.info["images"]
        engine.sync_weights(model)  # the served checkpoint is another seed's
        check_image_prompts(engine, model, processor, model_type)
    finally:
        stop(process)


def test_two_servers_sample_every_batch_from_the_pushed_weights_and_a_dead_one_is_named(tmp_path):
    """Two real servers (vllm_server_base_url with both URLs): each samples part of every batch, from the weights
    pushed to both (vLLM's log-probs equal the training forward's on every batch); the second killed after step 2:
    the run stops naming it, and resumes from its checkpoint with a new one."""
    model, tokenizer = tiny(seed=0)
    model_dir = save(model, tokenizer, tmp_path / "model")
    ports = [free_port(), free_port()]
    args = letter_config(
        tmp_path,
        max_steps=4,
        save_steps=1,
        save_strategy="steps",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_timeout=20,
        vllm_server_base_url=",".join(f"http://127.0.0.1:{p}" for p in ports),
        vllm_importance_sampling_mode="token_truncate",
    )
    processes = [start_server(model_dir, port) for port in ports]
    try:
        trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=repeat_letter,
            args=args,
            train_dataset=letter_dataset(),
            callbacks=[KillAt(2, processes[1])],
        )
        with pytest.raises(ConnectionError, match=f"The vLLM server at http://127.0.0.1:{ports[1]} stopped answering"):
            trainer.train()
        taken = trainer.engine.pieces_taken
        assert all(taken[f"http://127.0.0.1:{p}"] >= 2 for p in ports), taken  # both sampled, every batch
        steps = [r for r in trainer.state.log_history if "sampling/sampling_logp_difference/max" in r]
        assert len(steps) == 2 and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in steps)
        processes[1] = start_server(model_dir, ports[1])
        resumed = GRPOTrainer(
            model=str(model_dir), reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset()
        )
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 4
        later = [r for r in resumed.state.log_history if "sampling/sampling_logp_difference/max" in r]
        assert later and all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in later)
    finally:
        for process in processes:
            stop(process)


def test_a_data_parallel_server_splits_each_request_over_its_engines_pushes_to_both_and_names_a_dead_one(server):
    """`grpokit vllm-serve --data-parallel-size 2`: one URL, two vLLM engines in processes of their own. Each samples
    part of every request, what a one-engine server samples (each prompt keeps its seed); every push, over HTTP or
    through a process group, reaches both (the log-probs of rows from both engines equal the training forward's);
    an engine killed is named by the next request and by /health."""
    import json
    import signal
    import urllib.error
    import urllib.request

    import torch
    from test_vllm import PROMPTS, params_for

    from grpokit.rollout import PromptBatch
    from grpokit.rollout.vllm_client import ServerError, VLLMServerEngine

    single_url, model_dir = server
    port = free_port()
    process = start_server(model_dir, port, extra=("--data-parallel-size", "2"))
    try:
        url = f"http://127.0.0.1:{port}"
        model, tokenizer = tiny(tied=True, seed=3)  # neither the served checkpoint nor the other tests' weights
        parallel, alone = VLLMServerEngine(model, url, timeout=30), VLLMServerEngine(model, single_url, timeout=30)
        assert parallel.info["data_parallel_size"] == 2 and len({e["pid"] for e in parallel.info["engines"]}) == 2
        prompts = PromptBatch(PROMPTS.ids * 2, PROMPTS.counts * 2, PROMPTS.raw * 2)  # 6 prompts: 3 an engine
        params = params_for(tokenizer)

        def same_samples():
            ours, theirs = parallel.generate(prompts, params, seed=5), alone.generate(prompts, params, seed=5)
            assert torch.equal(ours.completion_ids, theirs.completion_ids)
            gap = ((ours.sampling_logprobs - theirs.sampling_logprobs) * ours.loss_mask).abs().max().item()
            assert gap <= TOLERANCE, gap

        # The same weights in both (the one-engine server is the module's, which other tests push to).
        started = time.monotonic()
        parallel.sync_weights(model)
        print(f"push to 2 engines: {time.monotonic() - started:.2f} s")
        assert parallel.request("GET", "/info")["version"] == 1
        alone.sync_weights(model)
        same_samples()  # on one engine and split over two
        engines = parallel.request("GET", "/info")["engines"]
        assert [e["prompts"] for e in engines] == [3, 3], engines

        # Pushes over HTTP: rows from both engines score as the training forward after each, none before.
        check_pushes(parallel, model, tokenizer)
        alone.sync_weights(model)
        same_samples()  # after two more pushes
        # A push through a process group (gloo: the server's /info says "cpu") reaches both engines as well.
        broadcast = VLLMServerEngine(model, url, timeout=30, group_port=free_port())
        assert broadcast.info["device"] == "cpu"
        train_a_step(model, seed=11)
        broadcast.sync_weights(model)
        assert logprob_gap(broadcast, model, tokenizer, prompts=prompts) <= TOLERANCE

        # One engine killed: the next request, and /health, name it.
        pid = parallel.request("GET", "/info")["engines"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ServerError, match=rf"vLLM engine 1 of 2 \(pid {pid}\) was killed by SIGKILL"):
            parallel.generate(prompts, params, seed=5)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert health.value.code == 503 and "engine 1 of 2" in json.loads(health.value.read())["error"]["message"]
    finally:
        stop(process)
