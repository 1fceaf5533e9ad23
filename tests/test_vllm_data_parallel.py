"""`grpokit vllm-serve --data-parallel-size N` without vLLM: the server's real engine processes (`EngineProcess`) and
its splitting, ordering, seeding and weight pushes (`DataParallelService`), over a stand-in sampler whose completions
say which prompt, seed, weights and process made them. tests/test_vllm_server.py drives real vLLM engines; so do the
served-policy checks of each engine at the end of this file (marker `vllm`: `python -m pytest -m vllm` in the vLLM
environment)."""

import os
import re
import signal
import threading
from http.server import HTTPServer

import pytest
import torch
from safetensors.torch import save

from grpokit.json_http import JSONError
from grpokit.rollout.vllm import prompt_seeds
from grpokit.served import SERVED_GAP, ServedPolicyMismatch
from grpokit.state import TrainerCallback
from grpokit.testing import save_tiny_model
from grpokit.vllm_server import (
    DataParallelService,
    EngineDied,
    EngineProcess,
    VLLMService,
    engine_environments,
    handler_for,
    split_rows,
    start_engines,
)


class RecordingSampler:
    """Stands in for `VLLMService` in an engine process: completion j of a prompt is the prompt's ids then j, and its
    "log-probs" are the prompt's seed, the sum of the last pushed `marker` weight, and the engine's pid; then, where
    the request has them, what the engine got of the prompt's images and unexpanded ids, and its regex."""

    def __init__(self, model_dir, **options):
        self.marker = 0.0
        self.info = {"model_type": "recording", "max_model_len": 64, "version": 0, "options": options}

    def describe(self) -> dict:
        return dict(self.info)

    def generate(self, request: dict) -> dict:
        if request.get("structured_outputs_regex") == "refuse":
            raise ValueError("this sampler refuses the regex")
        rows, images, unexpanded = [], request.get("images"), request.get("unexpanded_ids")
        for i, (ids, count, seed) in enumerate(zip(request["prompt_ids"], request["counts"], request["prompt_seeds"])):
            recorded = [float(seed), self.marker, float(os.getpid())]
            if images is not None:  # the prompt's images (their count, the first one's first byte) and unexpanded ids
                recorded += [float(len(images[i])), float(ord(images[i][0][0]) if images[i] else -1)]
                recorded += [float(sum(unexpanded[i]))]
            if request.get("structured_outputs_regex") is not None:
                recorded += [float(len(request["structured_outputs_regex"]))]
            rows += [([*ids, j], recorded, "stop") for j in range(count)]
        return {"completions": rows}

    def _load(self, weights: dict) -> None:
        self.marker = float(weights["marker"].sum())


def test_split_rows_is_contiguous_and_balanced_by_completions():
    assert split_rows([4] * 6, 2) == [range(3), range(3, 6)]
    assert split_rows([4] * 5, 2) == [range(2), range(2, 5)]  # a tie: the earlier boundary
    assert split_rows([4] * 6, 3) == [range(2), range(2, 4), range(4, 6)]
    assert split_rows([1, 1, 1, 9], 2) == [range(3), range(3, 4)]  # 3 and 9 completions, not 12 and 0
    assert split_rows([4], 3) == [range(0), range(1), range(1, 1)]  # fewer prompts than engines
    for counts in ([3, 1, 4, 1, 5, 9, 2, 6], [2] * 7, [8]):
        for parts in (1, 2, 3, 4):
            ranges = split_rows(counts, parts)
            assert [i for part in ranges for i in part] == list(range(len(counts)))


def test_each_engine_gets_its_gpus_or_its_share_of_the_cores():
    gpus = ["0", "1", "2", "3"]
    assert engine_environments(2, 2, gpus, 16) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert engine_environments(4, 1, ["4", "5", "6", "7"], 16)[3] == {"CUDA_VISIBLE_DEVICES": "7"}
    with pytest.raises(ValueError, match="needs 6 GPUs, and 4 are visible"):
        engine_environments(3, 2, gpus, 16)
    assert engine_environments(2, 1, None, 2) == [{"OMP_NUM_THREADS": "1"}] * 2
    assert engine_environments(3, 1, None, 2) == [{"OMP_NUM_THREADS": "1"}] * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("served") / "tiny", chars="ab", hidden_size=16))


def served(model_dir, engines: int) -> DataParallelService:
    return DataParallelService(model_dir, start_engines(model_dir, engines, {"seed": 3}, service=RecordingSampler))


def push(service: DataParallelService, value: float) -> dict:
    return service.update_weights(save({"marker": torch.full((2,), value / 2)}))


def test_engines_sample_their_parts_at_once_answer_in_order_take_every_push_and_a_dead_one_is_named(model_dir):
    request = {"prompt_ids": [[1], [2, 2], [3], [4, 4], [5]], "counts": [2, 2, 2, 2, 2], "seed": 7, "params": {}}
    seeds = prompt_seeds(7, 5)
    one, two = served(model_dir, 1), served(model_dir, 2)
    try:
        info = two.describe()
        assert info["data_parallel_size"] == 2 and info["device"] == "cpu" and info["options"] == {"seed": 3}
        pids = [engine["pid"] for engine in info["engines"]]
        assert len(set(pids)) == 2 and os.getpid() not in pids

        answered = two.generate({**request, "instance": info["instance"]})
        answer = answered["completions"]
        # In the request's order, each prompt with the seed it has in one request...
        assert [ids for ids, _, _ in answer] == [[*p, j] for p in request["prompt_ids"] for j in range(2)]
        assert [logprobs[0] for _, logprobs, _ in answer] == [float(s) for s in seeds for _ in range(2)]
        # ...the first two prompts by one engine, the last three by the other (4 and 6 completions)...
        assert [logprobs[2] for _, logprobs, _ in answer] == [float(pids[0])] * 4 + [float(pids[1])] * 6
        assert answered["engines"] == [0] * 4 + [1] * 6  # as the answer says (the served-policy check's samplers)
        assert [engine["prompts"] for engine in two.describe()["engines"]] == [2, 3]
        # ...and, but for which process made them, what one engine answers.
        alone = one.generate(request)["completions"]
        assert [(ids, lp[:2]) for ids, lp, _ in alone] == [(ids, lp[:2]) for ids, lp, _ in answer]
        # Seeds given by the client (several servers: `VLLMServers`) are kept.
        given = two.generate({**request, "prompt_seeds": [11, 12, 13, 14, 15]})["completions"]
        assert [lp[0] for _, lp, _ in given] == [11.0, 11.0, 12.0, 12.0, 13.0, 13.0, 14.0, 14.0, 15.0, 15.0]

        # A push reaches every engine before it is answered.
        assert push(two, 5.0) == {"version": 1} and two.describe()["version"] == 1
        assert {lp[1] for _, lp, _ in two.generate(request)["completions"]} == {5.0}
        assert push(two, 9.0) == {"version": 2}
        assert {lp[1] for _, lp, _ in two.generate(request)["completions"]} == {9.0}
        with pytest.raises(ValueError, match="other shapes than the served model's"):
            two.update_weights(save({"model.embed_tokens.weight": torch.zeros(3, 3)}))

        # An engine's own error comes back naming the engine; the server goes on.
        with pytest.raises(RuntimeError, match=r"engine 0 of 2 \(pid \d+\): ValueError: this sampler refuses"):
            two.generate({**request, "structured_outputs_regex": "refuse"})
        assert two.health() == {"status": "ok"}

        # An engine that dies is named, by /health and by every request from then on.
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(EngineDied, match=rf"vLLM engine 1 of 2 \(pid {pids[1]}\) was killed by SIGKILL"):
            two.generate(request)
        with pytest.raises(EngineDied, match="engine 1 of 2"):
            push(two, 1.0)
        with pytest.raises(JSONError, match="engine 1 of 2") as refused:
            two.health()
        assert refused.value.status == 503
    finally:
        one.close()
        two.close()
    assert not any(engine.process.is_alive() for engine in one.engines + two.engines)


def test_each_engine_gets_the_images_of_its_own_prompts_and_every_engine_the_regex(model_dir):
    # What a vision-language model's prompts and structured outputs carry, split with the prompts: each prompt's
    # images (as the wire gives them: PNG in base64) and its ids before the placeholders were expanded go to the
    # engine that samples the prompt; the regex to every engine.
    request = {
        "prompt_ids": [[1], [2, 2], [3], [4, 4], [5]],
        "counts": [2, 2, 2, 2, 2],
        "seed": 7,
        "params": {},
        "images": [["A"], ["B", "C"], [], ["D", "E", "F"], ["G"]],
        "unexpanded_ids": [[10], [20, 1], [30], [40, 2], [50]],
        "structured_outputs_regex": "(a|b)+",
    }
    two = served(model_dir, 2)
    try:
        pids = [engine["pid"] for engine in two.describe()["engines"]]
        answer = two.generate(request)["completions"]
    finally:
        two.close()
    assert [lp[2] for _, lp, _ in answer] == [float(pids[0])] * 4 + [float(pids[1])] * 6
    assert [lp[3:] for _, lp, _ in answer] == [
        [float(len(images)), float(ord(images[0])) if images else -1.0, float(sum(unexpanded)), 6.0]
        for images, unexpanded in zip(request["images"], request["unexpanded_ids"])
        for _ in range(2)
    ]


# ------------------------------------------------------------- with vLLM: the served-policy check of each engine

DROP_LOADS = "GRPOKIT_TEST_DROP_LOADS"


class LoadsDroppedOnFlag(VLLMService):
    """vLLM's service in an engine process, whose loads are dropped (the push answered, the weights never reaching
    vLLM) while the file its environment's GRPOKIT_TEST_DROP_LOADS names exists."""

    def _load(self, weights: dict) -> None:
        flag = os.environ.get(DROP_LOADS)
        if not (flag and os.path.exists(flag)):
            super()._load(weights)


@pytest.fixture(scope="module")
def vllm_data_parallel(tmp_path_factory):
    """`grpokit vllm-serve --data-parallel-size 2`'s server (its engine processes, `DataParallelService` and HTTP
    handler, as `vllm_server.main` builds them) over the letter task's tiny model, in float32 as the other server
    tests; engine 1's loads are dropped while the flag file exists. Yields (URL, checkpoint directory, flag)."""
    from test_vllm import tiny
    from test_vllm_server import save

    model, tokenizer = tiny(seed=0)
    directory = tmp_path_factory.mktemp("data_parallel")
    model_dir, flag = str(save(model, tokenizer, directory / "model")), directory / "drop"
    options = dict(dtype="float32", max_model_len=64, max_num_seqs=64, kv_cache_gib=1, seed=0)
    environments = engine_environments(2, 1, None, os.cpu_count() or 1)
    environments[1] = {**environments[1], DROP_LOADS: str(flag)}
    engines = [EngineProcess(i, 2, model_dir, options, env, LoadsDroppedOnFlag) for i, env in enumerate(environments)]
    service = DataParallelService(model_dir, engines)
    server = HTTPServer(("127.0.0.1", 0), handler_for(service))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", model_dir, flag
    finally:
        server.shutdown()
        server.server_close()
        service.close()


def varied_letter(completions, letter, **kwargs):
    """The letter reward with a tie-break: every group's scores differ, so every step moves the policy."""
    return [float(c[:1] == t) + 0.1 * (sum(map(ord, c)) % 7) for c, t in zip(completions, letter)]


class DropFromStep(TrainerCallback):
    """Engine 1 drops every push from the end of step `step` on."""

    def __init__(self, step: int, flag):
        self.step, self.flag = step, flag

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.flag.touch()


def data_parallel_run(server, tmp_path, tolerance, drop_from: int | None = None, max_steps: int = 3):
    """The letter task on the data-parallel server: 4 prompts of 4 completions a batch, 2 prompts an engine."""
    from letters import letter_config, letter_dataset

    from grpokit import GRPOTrainer

    url, model_dir, flag = server
    flag.unlink(missing_ok=True)
    args = letter_config(
        tmp_path,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=4,
        learning_rate=5e-2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        vllm_server_timeout=60,
        served_logprob_tolerance=tolerance,
    )
    callbacks = [] if drop_from is None else [DropFromStep(drop_from, flag)]
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=varied_letter, args=args, train_dataset=letter_dataset(), callbacks=callbacks
    )
    return trainer


# An engine of two that drops a push samples half of the next batch with the weights before it: 0.60 nats of its own
# after one step at learning rate 5e-2, the batch's mean (the logged gap) 0.26. A tolerance between the two is met
# only by a check of each engine's own gap.
DATA_PARALLEL_TOLERANCE = 0.4


@pytest.mark.vllm
def test_a_healthy_data_parallel_vllm_server_raises_nothing(vllm_data_parallel, tmp_path):
    """Both engines take every push: every batch's gap is vLLM's float32 noise, on both engines' rows."""
    trainer = data_parallel_run(vllm_data_parallel, tmp_path, DATA_PARALLEL_TOLERANCE, max_steps=4)
    trainer.train()
    gaps = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
    print("healthy data-parallel gaps:", gaps)
    assert len(gaps) == 4 and max(gaps) < 1e-3, gaps
    engines = trainer.engine.request("GET", "/info")["engines"]
    assert all(engine["prompts"] >= 8 for engine in engines), engines  # both sampled part of every batch


@pytest.mark.vllm
def test_an_engine_of_a_data_parallel_vllm_server_that_drops_a_push_stops_the_run_naming_it(
    vllm_data_parallel, tmp_path
):
    """Engine 1 drops the push after step 1: the batch it samples half of is refused as soon as it is made (vLLM's
    correction: π_old is a forward), naming the engine, with its own gap; the same run with the check off logs the
    batch's mean, below the tolerance."""
    url, _, flag = vllm_data_parallel
    try:
        trainer = data_parallel_run(vllm_data_parallel, tmp_path / "off", None, drop_from=1)
        trainer.train()
        logged = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
        trainer = data_parallel_run(vllm_data_parallel, tmp_path / "on", DATA_PARALLEL_TOLERANCE, drop_from=1)
        with pytest.raises(ServedPolicyMismatch) as raised:
            trainer.train()
    finally:
        flag.unlink(missing_ok=True)
    message = str(raised.value)
    assert message.startswith(
        f"VLLMServerEngine does not sample with the weights it was sent on engine 1 of 2 of the vLLM server at "
        f"{url}: after the push of the weights of version 1 (after 1 optimizer steps), its log-probs of the tokens "
        f"it sampled differ from the trainer's π_old (a forward's) by "
    ), message
    own = float(re.search(r"by (\S+) nats on average", message).group(1))
    print(f"batch mean gaps (check off): {logged}; engine 1's own gap at step 2: {own}")
    assert trainer.state.global_step == 1
    assert logged[0] < 1e-3 and logged[1] < DATA_PARALLEL_TOLERANCE < own < 2.0, (logged, own)
    assert 0.3 < logged[1] / own < 0.7  # half the rows are engine 1's: the batch mean dilutes its gap
