"""grpokit.rollout.process_engine: the in-process engine in a process of its own (asynchronous generation on the CPU).
The process is started safely beside the trainer's threads (forked from a clean server process, never from the
trainer), the server importing torch and transformers once per Python process, started as the trainer is built; it samples with the weights the
trainer copies into shared memory after it started, and never hangs a run: a request without an answer within
request_timeout_s kills it and raises EngineProcessHung, and close() is bounded while a request is in flight. What
the engine is pickled with reaches the process: HFEngine's autocast, transformers' input-require-grads hook (gradient
checkpointing), grpokit's float32-routed layers.

The engines below are defined at module level: an engine process imports them by name."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from grpokit.cpu_matmul import RoutedForward, linear_forward
from grpokit.rollout import HFEngine
from grpokit.rollout.engine import PromptBatch, SamplingParams
from grpokit.rollout.process_engine import EngineProcessDied, EngineProcessHung, ProcessEngine
from grpokit.testing import build_char_tokenizer, build_tiny_model

HELD = threading.Lock()  # held by one of the trainer's threads while the engine process starts
SLACK_S = 3.0  # a loaded 2-core machine: what a bound may be late by


class HangingEngine:
    """Never answers: a deadlock in the sampler, as far as the trainer can tell."""

    logprobs_match_training = False

    def generate(self, prompts, params, seed):
        time.sleep(3600)


class LockingEngine:
    """Samples while holding HELD. A process forked while another thread held it inherits it held, as it would
    malloc's, logging's or OpenMP's locks, and never gets it: what a fork beside threads can deadlock on."""

    def __init__(self, engine):
        self.engine, self.logprobs_match_training = engine, engine.logprobs_match_training

    def generate(self, prompts, params, seed):
        if not HELD.acquire(timeout=5):
            raise RuntimeError("HELD was inherited held: the engine process was forked beside a thread holding it")
        try:
            return self.engine.generate(prompts, params, seed)
        finally:
            HELD.release()


class FailsToStart:
    """Cannot be rebuilt in the engine process."""

    def __reduce__(self):
        return (fail_to_start, ())


def fail_to_start():
    raise RuntimeError("this engine cannot be rebuilt")


def tiny(seed: int = 0):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        len(tokenizer),
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    prompts = PromptBatch(
        ids=[tokenizer.encode(text) for text in ("ab", "cd:", "x=1")], counts=[3, 3, 3], raw=[None] * 3
    )
    params = SamplingParams(
        max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )
    return model, prompts, params


def assert_same_rollout(rollout, expected):
    assert torch.equal(rollout.completion_ids, expected.completion_ids)
    assert torch.equal(rollout.loss_mask, expected.loss_mask)
    # The engine process samples on one thread, this one on several: the same ops, summed in another order.
    torch.testing.assert_close(rollout.sampling_logprobs, expected.sampling_logprobs)


def test_weights_copied_after_the_start_are_the_ones_the_engine_process_samples_with():
    model, prompts, params = tiny(seed=0)
    other, _, _ = tiny(seed=1)
    # As under gradient checkpointing: transformers hooks the input embeddings with a local function, which pickle
    # cannot name.
    model.enable_input_require_grads()
    process = ProcessEngine(HFEngine(model), model)
    try:
        before = process.generate(prompts, params, seed=0)
        with process.lock, torch.no_grad():  # what the producer does between requests
            for mine, theirs in zip(model.parameters(), other.parameters()):
                mine.copy_(theirs)
        after = process.generate(prompts, params, seed=0)
    finally:
        process.close()
    expected = HFEngine(other).generate(prompts, params, seed=0)
    assert not torch.equal(before.completion_ids, expected.completion_ids)  # the copy changes what is sampled
    assert_same_rollout(after, expected)


def test_the_engine_process_starts_safely_beside_threads_holding_locks():
    model, prompts, params = tiny()
    release, holding = threading.Event(), threading.Event()

    def hold():
        with HELD:
            holding.set()
            release.wait(60)

    threads = [threading.Thread(target=hold, daemon=True)] + [
        threading.Thread(target=release.wait, args=(60,), daemon=True) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    holding.wait(10)
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns when a process with threads forks
            warnings.filterwarnings("error", message=".*fork", category=DeprecationWarning)
            process = ProcessEngine(LockingEngine(HFEngine(model)), model)
        try:
            rollout = process.generate(prompts, params, seed=0)
        finally:
            process.close()
    finally:
        release.set()
    assert_same_rollout(rollout, HFEngine(model).generate(prompts, params, seed=0))


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_process_is_forked_from_the_server_not_from_the_trainer():
    from multiprocessing import forkserver

    model, prompts, params = tiny()
    process = ProcessEngine(HFEngine(model), model)
    try:
        server = forkserver._forkserver._forkserver_pid
        assert parent_pid(process.pid) == server != os.getpid()
        assert parent_pid(server) == os.getpid()
        rollout = process.generate(prompts, params, seed=0)
    finally:
        process.close()
    assert_same_rollout(rollout, HFEngine(model).generate(prompts, params, seed=0))


SERVER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from multiprocessing import forkserver
    from datasets import Dataset
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    def server_pid():
        return forkserver._forkserver._forkserver_pid

    def trainer(max_staleness):
        tokenizer = build_char_tokenizer()
        model = build_tiny_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
        args = GRPOConfig(output_dir=sys.argv[1], per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=4, max_steps=1, max_staleness=max_staleness, report_to="none",
                          save_strategy="no", disable_tqdm=True)
        data = Dataset.from_list([{"prompt": "ab"}] * 4)
        return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                           args=args, train_dataset=data, processing_class=tokenizer)

    trainer(None)
    after_sync = server_pid()
    async_trainer = trainer(1)
    after_async = server_pid()
    maps = ""
    for _ in range(1200):  # the server imports in the background: up to 120 s on a loaded machine
        maps = open(f"/proc/{after_async}/maps").read() if after_async else ""
        if "libtorch_cpu" in maps:
            break
        time.sleep(0.1)
    print(json.dumps({"after_sync": after_sync, "after_async": after_async, "libtorch": "libtorch_cpu" in maps,
                      "modeling": "transformers.models.qwen2.modeling_qwen2" in forkserver._forkserver._preload_modules}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_asynchronous_cpu_trainer_starts_the_engine_server_as_it_is_built(tmp_path):
    """Only a run whose producer samples in an engine process starts the server, when the trainer is built (its
    imports then run beside loading the model), and the server imports torch and the model's module."""
    script = tmp_path / "server.py"
    script.write_text(SERVER_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["after_sync"] is None  # the synchronous loop samples in the trainer's process: no server
    assert seen["after_async"] is not None and seen["libtorch"] and seen["modeling"]


def test_a_request_without_an_answer_kills_the_engine_process_within_the_timeout():
    _, prompts, params = tiny()
    process = ProcessEngine(HangingEngine(), torch.nn.Linear(2, 2), request_timeout_s=1.0, poll_s=0.2)
    started = time.monotonic()
    with pytest.raises(
        EngineProcessHung,
        match=rf"pid {process.pid}\) did not answer a request within 1.0 s: it "
        r"was killed.*resume from it.*heartbeat_stale_after_s",
    ):
        process.generate(prompts, params, seed=0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert not process.process.is_alive()
    with pytest.raises(EngineProcessDied, match="did not answer a request"):  # and says so on the next request
        process.generate(prompts, params, seed=0)
    started = time.monotonic()
    process.close()
    assert time.monotonic() - started < 1.0


def test_close_is_bounded_while_a_request_is_in_flight():
    _, prompts, params = tiny()
    process = ProcessEngine(HangingEngine(), torch.nn.Linear(2, 2), request_timeout_s=None, poll_s=0.2)
    raised = []

    def request():
        try:
            process.generate(prompts, params, seed=0)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    time.sleep(1.0)  # the request is in flight: the child sleeps in it
    assert process.lock.locked()
    started = time.monotonic()
    process.close(timeout=1.0)
    assert time.monotonic() - started < 1.0 + SLACK_S
    assert not process.process.is_alive()
    thread.join(SLACK_S)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], EngineProcessDied) and "closed" in str(raised[0]), raised


def test_an_engine_that_cannot_start_is_reported_when_the_process_engine_is_built():
    with pytest.raises(
        EngineProcessDied,
        match=r"could not rebuild the FailsToStart it was sent:\nRuntimeError: this "
        r"engine cannot be rebuilt",
    ):
        ProcessEngine(FailsToStart(), torch.nn.Linear(2, 2))


def test_an_engine_that_does_not_pickle_is_refused_by_name():
    engine = HangingEngine()
    engine.callback = lambda: None
    with pytest.raises(TypeError, match=r"HangingEngine.*pickled"):
        ProcessEngine(engine, torch.nn.Linear(2, 2))


def test_an_hf_engine_pickles_with_the_autocast_its_factory_sets():
    """The trainer's engine autocasts with the accelerator's context, which reads accelerate's per-process state: a
    new process would not have it. The engine pickles the autocast state it sets instead."""
    model, _, _ = tiny()
    engine = pickle.loads(pickle.dumps(HFEngine(model, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))))
    with engine.autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    engine = pickle.loads(pickle.dumps(HFEngine(model)))
    with engine.autocast():
        assert not torch.is_autocast_enabled("cpu")


def test_a_layer_routed_to_float32_matmuls_pickles_with_its_layer():
    """A bfloat16 policy on a CPU without bfloat16 instructions has its linear layers routed (grpokit.cpu_matmul),
    each through a forward that holds its layer weakly: pickled, it holds the rebuilt layer."""
    model, _, _ = tiny()
    model = model.to(torch.bfloat16)
    layer = model.model.layers[0].mlp.up_proj
    layer.forward = RoutedForward(linear_forward, layer)
    copied = pickle.loads(pickle.dumps(model))
    rebuilt = copied.model.layers[0].mlp.up_proj
    assert isinstance(rebuilt.forward, RoutedForward) and rebuilt.forward.layer() is rebuilt
    inputs = torch.randn(4, layer.in_features, dtype=torch.bfloat16)
    assert torch.equal(rebuilt(inputs), layer(inputs))
