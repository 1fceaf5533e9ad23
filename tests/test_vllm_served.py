"""The served-policy check (grpokit.served) against a real vLLM (CPU build): a healthy run never trips it, a push that
never reaches vLLM stops the run at the next generation. Run in the vLLM environment: `python -m pytest -m vllm`."""

from __future__ import annotations

import pytest
from letters import letter_config, letter_dataset, repeat_letter
from test_vllm import counted_pushes, tiny

from grpokit import GRPOTrainer
from grpokit.served import SERVED_GAP, ServedPolicyMismatch

pytestmark = pytest.mark.vllm


def letter_trainer(tmp_path, max_steps: int, engine=None, **overrides):
    model, tokenizer = tiny()
    values = dict(per_device_train_batch_size=16, num_generations=4, use_vllm=True)
    args = letter_config(
        tmp_path, max_steps=max_steps, vllm_importance_sampling_mode="token_truncate", **{**values, **overrides}
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=None if engine is None else engine(model),
    )


def dropped_push_engine(first_arrives: bool):
    """vLLM (which starts from dummy weights) whose pushes are dropped on the way: all of them, or all but the first."""
    from grpokit.rollout.vllm import VLLMEngine

    class DroppedPushEngine(VLLMEngine):
        def sync_weights(self, model) -> None:
            if first_arrives and self.pushed_versions is None:
                super().sync_weights(model)

    return lambda model: DroppedPushEngine(model, max_model_len=64, max_num_seqs=32, seed=0)


@pytest.mark.parametrize("correction", [True, False])
def test_a_dropped_push_stops_the_run_at_the_next_step(tmp_path, correction):
    """With vLLM's correction π_old is a forward, compared when the batch is made (before step 2 trains on it);
    without it, the training forward of step 2 is π_old, and the step raises."""
    trainer = letter_trainer(
        tmp_path, 4, dropped_push_engine(True), vllm_importance_sampling_correction=correction, learning_rate=5e-2
    )
    where = "a forward's" if correction else "the training forward's"
    with pytest.raises(ServedPolicyMismatch, match=rf"DroppedPushEngine does not sample.*version 1 .*{where}"):
        trainer.train()
    assert trainer.state.global_step == (1 if correction else 2)
    assert trainer.state.log_history[0][SERVED_GAP] < 1e-3  # the first batch: the weights of the first push


def test_with_top_p_a_dropped_push_stops_the_run_at_the_next_step(tmp_path):
    """top_p = 0.8 with the sampling mask kept: vLLM's log-probs are of its kept sets, which vLLM on CPU does not
    return; the trainer replays them on π_old's logits and renormalises π_old over them. The first batch (the weights
    of the first push on both sides) agrees to float rounding; the second, sampled by vLLM's stale weights, is refused
    as soon as it is made."""
    trainer = letter_trainer(tmp_path, 4, dropped_push_engine(True), top_p=0.8, learning_rate=5e-2)
    with pytest.raises(ServedPolicyMismatch, match=r"DroppedPushEngine does not sample.*version 1 .*a forward's"):
        trainer.train()
    assert trainer.state.global_step == 1
    first = trainer.state.log_history[0]
    print("first gap", first[SERVED_GAP], "importance ratio", first["sampling/importance_sampling_ratio/mean"])
    assert first[SERVED_GAP] < 1e-3
    assert 0.99 <= first["sampling/importance_sampling_ratio/mean"] <= 1.01  # the kept mass would make it ~0.8


def test_vllm_that_never_got_the_policys_weights_is_refused_at_the_first_step(tmp_path):
    """vLLM samples from its dummy start-up weights: the first batch is refused before any step trains on it."""
    trainer = letter_trainer(tmp_path, 2, dropped_push_engine(False))
    with pytest.raises(ServedPolicyMismatch, match=r"DroppedPushEngine does not sample.*version 0 "):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_lora_adapter_that_never_reaches_vllm_stops_the_run(tmp_path):
    """Every push sends the frozen base weights, the adapter left out (verl #7495): the adapter starts as the
    identity, so step 1 agrees; once it has moved the policy, the next batch is refused."""
    from peft import LoraConfig

    from grpokit.rollout.vllm import VLLMEngine, base_model_of, checkpoint_name, guarded_process_state

    class BaseOnlyEngine(VLLMEngine):
        def sync_weights(self, model) -> None:
            state = base_model_of(model).state_dict()
            with guarded_process_state():
                self.push((checkpoint_name(k), v.detach()) for k, v in state.items() if checkpoint_name(k) is not None)

    model, tokenizer = tiny()
    args = letter_config(
        tmp_path, max_steps=4, per_device_train_batch_size=16, num_generations=4, use_vllm=True, learning_rate=5e-2
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=BaseOnlyEngine(model, max_model_len=64, max_num_seqs=32, seed=0),
        peft_config=LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    )
    with pytest.raises(ServedPolicyMismatch, match=r"BaseOnlyEngine does not sample.*version 1 "):
        trainer.train()
    assert trainer.state.log_history[0][SERVED_GAP] < 1e-3


def test_a_healthy_100_step_vllm_run_passes_every_step(tmp_path):
    """vLLM's float32 log-probs are the training forward's to ~1e-5: the gap stays there, every step, for 100 pushes."""
    trainer = letter_trainer(tmp_path, 100)
    with counted_pushes(trainer.engine) as push:
        trainer.train()
    assert push.call_count == 99  # before each generation but the first
    gaps = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
    assert len(gaps) == 100
    print("max gap", max(gaps))
    assert max(gaps) < 1e-3, max(gaps)


def test_a_server_whose_pushes_are_dropped_stops_the_run(tmp_path):
    """Server mode (`grpokit vllm-serve`, the trainer's HTTP client): the server starts from the policy's checkpoint
    and gets the first push; the later ones are dropped on the way, and the second step raises."""
    from ports import free_port
    from test_vllm_server import save, start_server, stop

    from grpokit.rollout.vllm_client import VLLMServerEngine

    class DroppedPushServerEngine(VLLMServerEngine):
        def sync_weights(self, model) -> None:
            if self.pushed_versions is None:
                super().sync_weights(model)

    model, tokenizer = tiny()
    port = free_port()
    process = start_server(save(model, tokenizer, tmp_path / "model"), port)
    try:
        url = f"http://127.0.0.1:{port}"
        engine = lambda m: DroppedPushServerEngine(m, url, timeout=30)  # noqa: E731
        trainer = letter_trainer(tmp_path, 4, engine, use_vllm=False, learning_rate=5e-2)
        with pytest.raises(ServedPolicyMismatch, match=r"DroppedPushServerEngine does not sample.*version 1 "):
            trainer.train()
        assert trainer.state.global_step == 2
    finally:
        stop(process)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_a_healthy_20_step_bf16_vllm_run_raises_no_false_alarm(tmp_path, mode):
    """vLLM in bfloat16 (colocated: the trainer's bf16=True sets it; a server: `--dtype bfloat16`), the trainer in
    bf16 autocast: the gap is the two sides' bf16 rounding, every step far below the default tolerance (0.1)."""
    from ports import free_port
    from test_vllm_server import save, start_server, stop

    process, overrides = None, {}
    if mode == "server":
        model, tokenizer = tiny()
        port = free_port()
        process = start_server(save(model, tokenizer, tmp_path / "model"), port, extra=("--dtype", "bfloat16"))
        overrides = dict(vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=60)
    try:
        trainer = letter_trainer(tmp_path, 20, bf16=True, learning_rate=5e-2, **overrides)
        assert trainer.args.served_logprob_tolerance == 0.1
        trainer.train()
    finally:
        if process is not None:
            stop(process)
    gaps = [r[SERVED_GAP] for r in trainer.state.log_history if "loss" in r]
    assert len(gaps) == 20
    print(f"bf16 {mode}: max gap {max(gaps):.3g}, mean {sum(gaps) / len(gaps):.3g}")
    assert 1e-4 < max(gaps) < 0.05, gaps  # bf16 noise (float32 sits near 1e-7), well under the tolerance
