"""Several inference servers (vllm_server_base_url with several URLs): every generation spread over them by load, the
weights pushed to all of them, a server that dies named (or, with vllm_server_failover, left out).

Each server is `grpokit vllm-serve`'s own HTTP handler (`handler_for`) over a service that samples with grpokit's
in-process engine on the served checkpoint and takes pushed weights as vLLM's service does (vLLM itself is not in the
default environment; tests/test_vllm_server.py drives real vLLM servers in the vLLM one)."""

import re
import threading
import time
import uuid
from http.server import HTTPServer

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rollout import HFEngine, PromptBatch, SamplingParams
from grpokit.rollout.vllm import prompt_seeds
from grpokit.rollout.vllm_client import VLLMServerEngine, VLLMServers
from grpokit.served import SERVED_GAP, ServedPolicyMismatch
from grpokit.state import TrainerCallback
from grpokit.testing import save_tiny_model
from grpokit.vllm_server import handler_for, served_model_info

LETTERS = "abcdefgh"


class InProcessService:
    """What vllm_server.VLLMService does, with grpokit's in-process engine in place of vLLM: /info from the
    checkpoint, generation from the current weights, safetensors pushes loaded into them. `delay` slows every
    generation request (a slow server); `pieces` records the prompts of every request it served."""

    def __init__(self, model_dir: str, delay: float = 0.0):
        _, self.info = served_model_info(model_dir)
        self.info.update(instance=uuid.uuid4().hex, model=model_dir, device="cpu", max_model_len=None)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.engine = HFEngine(self.model, torch.device("cpu"), logprobs_match_training=True)
        self.delay, self.version, self.pieces = delay, 0, []

    def health(self):
        return {"status": "ok"}

    def describe(self):
        return {**self.info, "version": self.version}

    def generate(self, request):
        time.sleep(self.delay)
        params = SamplingParams(**{**request["params"], "eos_token_ids": tuple(request["params"]["eos_token_ids"])})
        # As vLLM's service: each prompt with its own seed, given or drawn from the request's (prompt_seeds).
        ids, counts = request["prompt_ids"], request["counts"]
        seeds = request.get("prompt_seeds") or prompt_seeds(int(request["seed"]), len(ids))
        completions = []
        for prompt, count, seed in zip(ids, counts, seeds):
            rollout = self.engine.generate(PromptBatch([prompt], [count], [None]), params, seed)
            for row in range(len(rollout.lengths)):
                length = int(rollout.lengths[row])
                completions.append(
                    (
                        rollout.completion_ids[row, :length].tolist(),
                        rollout.sampling_logprobs[row, :length].tolist(),
                        "length" if bool(rollout.is_truncated[row]) else "stop",
                    )
                )
        self.pieces.append((self.version, [tuple(prompt) for prompt in ids]))
        return {"completions": completions, "version": self.version}

    def update_weights(self, body):
        from safetensors.torch import load

        with torch.no_grad():
            self.model.load_state_dict(load(body), strict=False)  # a tied head comes once, as from the trainer
        self.version += 1
        return {"version": self.version}


class Served:
    def __init__(self, model_dir: str, delay: float = 0.0):
        self.service = InProcessService(model_dir, delay)
        self.server = HTTPServer(("127.0.0.1", 0), handler_for(self.service))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def kill(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("served") / "tiny", chars=LETTERS + ":", hidden_size=32))


def first_letter(completions, letter, **kwargs):
    return [float(c[:1] == t) for c, t in zip(completions, letter)]


class KillAt(TrainerCallback):
    def __init__(self, step: int, served: Served):
        self.step, self.served = step, served

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.served.kill()


def trainer_for(model_dir, out, servers, callbacks=(), reward=first_letter, **overrides):
    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=3,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        disable_tqdm=True,
        report_to="none",
        seed=0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=",".join(s.url for s in servers),
        vllm_server_timeout=20,
    )
    data = Dataset.from_list([{"prompt": f"{a}{b}:", "letter": a} for a in LETTERS for b in LETTERS])
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=GRPOConfig(**{**values, **overrides}),
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=list(callbacks),
    )


def weights(trainer):
    return {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}


def test_two_servers_share_every_batch_by_load_and_both_get_every_version_of_the_weights(model_dir, tmp_path):
    even, uneven = [Served(model_dir), Served(model_dir)], [Served(model_dir), Served(model_dir, delay=0.3)]
    runs = {}
    for name, servers in (("even", even), ("uneven", uneven)):
        trainer = trainer_for(model_dir, tmp_path / name, servers, max_staleness=1)
        assert isinstance(trainer.engine, VLLMServers)
        trainer.train()
        runs[name] = weights(trainer)
        # Every version the producer sampled with went to both servers, and each batch (4 pieces) was sampled by one:
        # batches 0 and 1 by the first push (the policy's version 0, max_staleness=1), batches 2 and 3 by the next two.
        assert servers[0].service.version == servers[1].service.version >= 3
        by_batch = sorted((version, piece) for served in servers for version, piece in served.service.pieces)
        assert [version for version, _ in by_batch][:16] == [1] * 8 + [2] * 4 + [3] * 4
        # ...and each server sampled part of each of the 4 batches (4 prompts a batch, pieces of 1 prompt).
        prompts = [p for served in servers for _, piece in served.service.pieces for p in piece]
        assert len(prompts) >= 16 and all(served.service.pieces for served in servers)
    # The slow server took fewer pieces: spread by load, not in turn...
    slow, fast = len(uneven[1].service.pieces), len(uneven[0].service.pieces)
    assert slow < fast, (slow, fast)
    # ...and which server sampled a piece changes nothing: a piece's seed is its place in the batch.
    assert all(torch.equal(runs["even"][k], runs["uneven"][k]) for k in runs["even"])


def test_the_samples_do_not_depend_on_how_many_servers_share_a_batch(model_dir):
    """Each prompt's seed is its place in the batch, whatever the pieces: one server (the whole batch), two (pieces
    of 2 prompts) and three (pieces of 1) sample the same completions."""
    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    served = [Served(model_dir) for _ in range(3)]
    try:
        ids = [tokenizer(f"{a}{b}:")["input_ids"] for a in LETTERS[:4] for b in LETTERS[:3]]
        prompts = PromptBatch(ids, [2] * len(ids), [None] * len(ids))
        params = SamplingParams(
            max_new_tokens=4, temperature=1.0, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=0
        )
        rollouts = [VLLMServerEngine(model, served[0].url, timeout=120).generate(prompts, params, seed=3)]
        for n in (2, 3):
            servers = VLLMServers([VLLMServerEngine(model, s.url, timeout=120) for s in served[:n]])
            before = [len(s.service.pieces) for s in served[:n]]
            rollouts.append(servers.generate(prompts, params, seed=3))
            assert all(taken > 0 for taken in servers.pieces_taken.values())
            # Each row is labelled with the server that sampled it (the served-policy check's samplers).
            assert servers.samplers == [f"the vLLM server at {s.url}" for s in served[:n]]
            took = [{p for _, piece in s.service.pieces[b:] for p in piece} for s, b in zip(served, before)]
            labels = rollouts[-1].sampler.tolist()
            assert [tuple(ids[row // 2]) in took[label] for row, label in enumerate(labels)] == [True] * len(labels)
        assert {len(piece) for _, piece in served[1].service.pieces} == {2, 1}  # pieces of 2, then of 1
        assert {len(piece) for _, piece in served[2].service.pieces} == {1}
        assert all(torch.equal(r.completion_ids, rollouts[0].completion_ids) for r in rollouts[1:])
        assert rollouts[0].completion_ids.unique().numel() > 3  # sampled, not one token repeated
    finally:
        for s in served:
            s.kill()


def test_a_server_that_dies_is_named_the_checkpoint_resumes_and_failover_goes_on_without_it(model_dir, tmp_path):
    servers = [Served(model_dir), Served(model_dir)]
    trainer = trainer_for(model_dir, tmp_path / "out", servers, callbacks=[KillAt(2, servers[1])])
    with pytest.raises(ConnectionError, match=f"The vLLM server at {servers[1].url} stopped answering"):
        trainer.train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    # The server back (a new one at another address): the run resumes from its checkpoint and ends.
    servers[1] = Served(model_dir)
    resumed = trainer_for(model_dir, tmp_path / "out", servers)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4

    # With vllm_server_failover the run goes on with the server left, which samples whole batches from then on.
    left = [Served(model_dir), Served(model_dir)]
    trainer = trainer_for(
        model_dir, tmp_path / "failover", left, callbacks=[KillAt(2, left[1])], vllm_server_failover=True
    )
    trainer.train()
    assert trainer.state.global_step == 4 and list(trainer.engine.dead) == [left[1].url]
    assert [len(piece) for version, piece in left[0].service.pieces if version >= 3] == [1] * 8


def test_several_urls_are_checked(model_dir):
    from grpokit.rollout.vllm_client import server_urls

    args = GRPOConfig(report_to="none", vllm_server_base_url="http://a:1, http://b:2")
    assert server_urls(args) == ["http://a:1", "http://b:2"]
    for bad in ("http://a:1,,http://b:2", "http://a:1,http://a:1"):
        with pytest.raises(ValueError, match="several distinct ones separated by commas"):
            server_urls(GRPOConfig(report_to="none", vllm_server_base_url=bad))


# ------------------------------------------------------------------------------------ the served-policy check


class DroppedPushService(InProcessService):
    """A server that answers every push and loads none of them (a push lost on its way into the engine)."""

    def update_weights(self, body):
        self.version += 1
        return {"version": self.version}


def varied(completions, letter, **kwargs):
    """first_letter with a tie-break: every group's scores differ, so every step moves the policy."""
    return [float(c[:1] == t) + 0.1 * (sum(map(ord, c)) % 7) for c, t in zip(completions, letter)]


def dropped_push_run(model_dir, out, correction: bool, tolerance: float | None, dropping: bool = True):
    """Two servers, the second one's pushes dropped (`dropping`), over batches of 2 prompts: each server samples one
    prompt's 4 completions (pieces of one prompt; each server answers a piece in 0.2 s, so that each takes one)."""
    servers = [Served(model_dir, delay=0.2), Served(model_dir, delay=0.2)]
    if dropping:
        servers[1].service.__class__ = DroppedPushService
    trainer = trainer_for(
        model_dir,
        out,
        servers,
        reward=varied,
        per_device_train_batch_size=8,
        lr_scheduler_type="constant",
        max_steps=3,
        learning_rate=5e-2,
        save_strategy="no",
        vllm_importance_sampling_correction=correction,
        served_logprob_tolerance=tolerance,
    )
    return trainer, servers


# A push lost by one server of two shows in the rows it sampled, half the batch: after one step at learning rate 5e-2
# its own gap is ~0.45 nats, the batch's mean (the logged gap) ~0.22. A tolerance between the two is met only by a
# check of each server's own gap.
TOLERANCE = 0.3


@pytest.mark.parametrize("correction", [True, False], ids=["forward", "training_forward"])
def test_a_server_that_drops_pushes_stops_the_run_naming_it_though_the_batch_mean_would_pass(
    model_dir, tmp_path, correction
):
    """The first push (the checkpoint's weights, which both servers start from) agrees; the second is lost by the
    second server: the run stops at the next batch, naming that server, and its gap, which is about twice the
    batch's mean (the logged gap, which the same run with the check off logs below the tolerance). With vLLM's
    correction π_old is a forward, compared as the batch is made; without it the training forward of step 2."""
    trainer, servers = dropped_push_run(model_dir, tmp_path / "off", correction, None)
    trainer.train()
    logged = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
    trainer, servers = dropped_push_run(model_dir, tmp_path / "on", correction, TOLERANCE)
    where = "a forward's" if correction else "the training forward's"
    with pytest.raises(ServedPolicyMismatch) as raised:
        trainer.train()
    message = str(raised.value)
    assert message.startswith(
        f"VLLMServers does not sample with the weights it was sent on the vLLM server at {servers[1].url}: after "
        f"the push of the weights of version 1 (after 1 optimizer steps), its log-probs of the tokens it sampled "
        f"differ from the trainer's π_old ({where}) by "
    ), message
    own = float(re.search(r"by (\S+) nats on average", message).group(1))
    print(f"batch mean gaps (check off): {logged}; the dropping server's own gap at step 2: {own}")
    assert trainer.state.global_step == (1 if correction else 2)
    assert logged[0] < 1e-5 and logged[1] < TOLERANCE < own < 1.0, (logged, own)
    assert 0.3 < logged[1] / own < 0.7  # half the rows are the dropping server's: the batch mean dilutes its gap
    assert [len(piece) for _, piece in servers[1].service.pieces] == [1, 1]  # one prompt a batch, as the other


def test_two_healthy_servers_raise_nothing(model_dir, tmp_path):
    trainer, servers = dropped_push_run(model_dir, tmp_path, True, TOLERANCE, dropping=False)
    trainer.train()
    logged = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
    assert len(logged) == 3 and max(logged) < 1e-5, logged
    assert servers[0].service.version == servers[1].service.version == 3
    assert all(len(served.service.pieces) == 3 for served in servers)  # both sampled part of every batch
