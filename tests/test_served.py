"""The served-policy check (grpokit.served): after each weight push, the engine's log-probs of the tokens it sampled
must equal the trainer's π_old within the engine's noise, or the run stops within a step. Engines whose push
silently fails are in tests/served_helpers.py; the vLLM ones are in tests/test_vllm_served.py."""

from __future__ import annotations

import contextlib
import json
import logging
import math

import pytest
import torch
from letters import letter_config, letter_dataset, repeat_letter, tiny_letter_model
from served_helpers import NoOpPushEngine, UnmergedLoraEngine

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.batch import TrainBatch
from grpokit.logprobs import token_logprobs
from grpokit.loss import logprob_gap
from grpokit.micro_batch import micro_batch_loss
from grpokit.rollout import HFEngine
from grpokit.served import SERVED_GAP, ServedPolicyMismatch, check_gap, check_processes, gap_totals, mean_gaps

GAP_MAX = "sampling/sampling_logp_difference/max"


def gaps(trainer) -> list[float]:
    return [r.get(SERVED_GAP, math.nan) for r in trainer.state.log_history if "loss" in r]


def letter_trainer(tmp_path, engine=None, lora=False, **overrides):
    model, tokenizer = tiny_letter_model()
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    values = {"max_steps": 3, "per_device_train_batch_size": 32, "max_completion_length": 4}
    args = letter_config(tmp_path, **{**values, **overrides})
    return GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        args=args,
        train_dataset=letter_dataset(),
        processing_class=tokenizer,
        rollout_engine=None if engine is None else engine(model),
        peft_config=peft_config,
    )


# ---------------------------------------------------------------------------------------------- the statistic


def test_logprob_gap_is_the_mean_and_max_absolute_difference_over_the_mask():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -9.0]], dtype=torch.float64)
    sampling = torch.tensor([[-1.5, -1.0, 50.0], [-0.5, float("nan"), -8.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 50.0 is masked (a tool's token), the NaN left out
    stats = logprob_gap(logprobs, sampling, mask)
    # |d| over the kept tokens: 0.5, 1.0, 0.0, 1.0
    assert stats[SERVED_GAP].item() == pytest.approx(2.5 / 4, abs=1e-12)
    assert stats[GAP_MAX].item() == pytest.approx(1.0, abs=1e-12)
    empty = logprob_gap(logprobs, sampling, torch.zeros_like(mask))
    assert empty[SERVED_GAP].item() == 0.0 and empty[GAP_MAX].item() == 0.0


def test_the_error_names_the_engine_the_push_the_gap_and_the_setting():
    policy = torch.nn.Linear(2, 2)
    check_gap(0.1, 0.1, NoOpPushEngine, 3, "x", policy)  # at the tolerance: healthy
    check_gap(math.nan, 0.1, object(), 3, "x", policy)  # nothing measured
    check_gap(5.0, None, object(), 3, "x", policy)  # the check is off
    with pytest.raises(ServedPolicyMismatch) as raised:
        check_gap(0.25, 0.1, object(), 3, "a forward's", policy)
    message = str(raised.value)
    for part in ("object does not sample", "version 3", "0.25 nats", SERVED_GAP, "served_logprob_tolerance=0.1"):
        assert part in message, message
    assert "set it to None" in message


def test_the_tolerance_must_be_positive():
    with pytest.raises(ValueError, match=r"served_logprob_tolerance=0.0 must be > 0.*None"):
        GRPOConfig(served_logprob_tolerance=0.0)
    assert GRPOConfig().served_logprob_tolerance == 0.1
    assert GRPOConfig(served_logprob_tolerance=None).served_logprob_tolerance is None


def test_the_training_forward_measures_marked_rows_on_sampled_tokens_only(tmp_path):
    """The micro-batch loss measures the gap on its own forward, over the marked rows' loss-mask tokens: an inserted
    token (loss mask 0) with a wild sampling log-prob does not count, nor does an unmarked row."""
    model, _ = tiny_letter_model()
    args = letter_config(tmp_path)
    prompt = torch.tensor([[3, 4], [5, 4]])
    completion = torch.tensor([[6, 7, 8], [7, 6, 9]])
    batch = TrainBatch(
        prompt,
        torch.ones_like(prompt),
        completion,
        torch.ones_like(completion),
        torch.tensor([[1, 0, 1], [1, 1, 1]]),
        torch.tensor([3, 3]),
        torch.zeros(2, 3),
    )
    with torch.no_grad():
        _, stats = micro_batch_loss(model, batch, (2, 5, 1), args, _no_autocast)
    assert SERVED_GAP not in stats  # no rows marked: nothing measured
    with torch.no_grad():
        exact, _ = token_logprobs(model, batch.input_ids, batch.input_mask, 3, 1.0)
    batch.sampling_logprobs = exact + torch.tensor([[0.5, 40.0, -0.5], [9.0, 9.0, 9.0]])
    batch.served_rows = torch.tensor([True, False])
    with torch.no_grad():
        _, stats = micro_batch_loss(model, batch, (2, 5, 1), args, _no_autocast)
    assert stats[SERVED_GAP] == pytest.approx(0.5, abs=1e-5)


def _no_autocast():
    return contextlib.nullcontext()


class TwoProcesses:
    """What `check_processes` reads of an accelerator: two processes, whose own gaps `gather` returns."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, gaps: list[float]):
        self.gaps = torch.tensor(gaps, dtype=torch.float64)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.gaps


def test_several_processes_are_checked_on_the_largest_of_their_own_gaps():
    """The logged gap is the mean over processes: a push lost on one of N would read as 1/N of its gap. Every process
    raises on the largest process's own gap, naming it; a process that measured nothing (NaN) does not hide another."""
    policy = torch.nn.Linear(2, 2)
    for gaps in ([0.0, 0.3], [math.nan, 0.3]):
        with pytest.raises(ServedPolicyMismatch, match=r"sent on process 1 of 2: .* by 0\.3 nats on average"):
            check_processes(TwoProcesses(gaps), 0.0, 0.2, object(), 1, "x", policy)
    for gaps in ([0.15, 0.2], [math.nan, math.nan]):
        check_processes(TwoProcesses(gaps), 0.0, 0.2, object(), 1, "x", policy)
    check_processes(None, 5.0, None, object(), 1, "x", policy)  # the check off: no collective
    check_processes(None, 5.0, 0.1, HFEngine(policy), 1, "x", policy)  # nothing pushed: no collective either


class NamedSamplers:
    """An engine that spreads its batches over two samplers (several servers), named as `VLLMServers` names them."""

    samplers = ["the vLLM server at http://a:1", "the vLLM server at http://b:2"]


def test_each_samplers_gap_is_the_mean_over_the_tokens_it_sampled():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -9.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    sampling = torch.tensor([[-1.5, -1.0, 50.0], [-0.5, float("nan"), -8.0], [-2.0, 7.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 1]])  # masked tokens and the NaN left out
    sampler = torch.tensor([1, 0, 1])
    # sampler 0 (row 1): 0 + 1 over 2 tokens; sampler 1 (rows 0, 2): 0.5 + 1 + 1 + 0 over 4; sampler 2: none
    totals = gap_totals(logprobs, sampling, mask, sampler, 3)
    assert totals.tolist() == [[1.0, 2.0], [2.5, 4.0], [0.0, 0.0]]
    means = mean_gaps(totals)
    assert means[:2].tolist() == [0.5, 0.625] and math.isnan(means[2])
    assert gap_totals(logprobs, sampling, mask, sampler).shape == (2, 2)  # up to the largest index
    whole = gap_totals(logprobs, sampling, mask, None)  # one sampler: the batch's gap, as logprob_gap's
    assert mean_gaps(whole).item() == pytest.approx(logprob_gap(logprobs, sampling, mask)[SERVED_GAP].item(), 1e-12)
    with pytest.raises(ValueError, match=r"sampler indices \[0, 1, 3\], and the engine names 3 sampler"):
        gap_totals(logprobs, sampling, mask, torch.tensor([1, 0, 3]), 3)


def test_the_check_takes_the_worst_sampler_on_the_worst_process_and_names_both():
    """A push lost by one of two servers shows in its rows only: the batch mean would halve its gap. Each sampler's
    own gap is gathered from every process (S gaps a process), and the largest raises, naming the sampler."""
    policy = torch.nn.Linear(2, 2)
    with pytest.raises(ServedPolicyMismatch) as raised:
        check_processes(TwoProcesses([0.0, 0.1, math.nan, 0.3]), torch.zeros(2), 0.2, NamedSamplers(), 1, "x", policy)
    assert str(raised.value).startswith(
        "NamedSamplers does not sample with the weights it was sent on the vLLM server at http://b:2 (the rows of "
        "process 1 of 2): after the push of the weights of version 1 (after 1 optimizer steps), its log-probs of the "
        "tokens it sampled differ from the trainer's π_old (x) by 0.3 nats on average"
    ), raised.value
    check_processes(TwoProcesses([0.0, 0.1, math.nan, 0.2]), torch.zeros(2), 0.2, NamedSamplers(), 1, "x", policy)
    # One gap a process (rows no sampler was named for, e.g. multi-turn transcripts): no sampler is named.
    with pytest.raises(ServedPolicyMismatch, match=r"sent on process 1 of 2: .* by 0\.3 nats"):
        check_processes(TwoProcesses([0.0, 0.3]), 0.0, 0.2, NamedSamplers(), 1, "x", policy)


# ------------------------------------------------------------------------------------------- failing pushes


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_push_that_does_nothing_fails_the_next_step(tmp_path):
    """The default loop (one pass: π_old is the training forward): the first step's batch was sampled by the initial
    weights the engine holds (gap 0); the second step's by the same, while the policy moved: the step raises."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine)
    with pytest.raises(ServedPolicyMismatch, match=r"NoOpPushEngine does not sample.*version 1 .*training forward"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert gaps(trainer) == [pytest.approx(0.0, abs=1e-5)]  # step 1, healthy; step 2 raised


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_push_that_does_nothing_fails_before_training_where_pi_old_is_a_forward(tmp_path):
    """μ = 2: π_old is a forward of the pushed weights, compared as soon as the batch is made: the second generation
    batch (after two steps on the first) is refused before any step trains on it."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine, num_iterations=2)
    with pytest.raises(ServedPolicyMismatch, match=r"NoOpPushEngine.*version 2 .*a forward's"):
        trainer.train()
    assert trainer.state.global_step == 2
    first, second = gaps(trainer)  # the first batch's, logged with its generation metrics at step 1; step 2 reuses it
    assert first == pytest.approx(0.0, abs=1e-5) and math.isnan(second)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_lora_adapter_that_never_reaches_the_engine_fails_the_run(tmp_path):
    """The adapter starts as the identity (B = 0), so the first batches agree; once it has moved the policy, the
    engine that samples without it is caught (verl #7495)."""
    trainer = letter_trainer(tmp_path, UnmergedLoraEngine, lora=True, learning_rate=5e-2)
    with pytest.raises(ServedPolicyMismatch, match=r"UnmergedLoraEngine.*version 1 "):
        trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_with_the_check_off_the_gap_is_still_logged(tmp_path):
    trainer = letter_trainer(tmp_path, NoOpPushEngine, served_logprob_tolerance=None, max_steps=3)
    trainer.train()
    logged = gaps(trainer)
    assert logged[0] == pytest.approx(0.0, abs=1e-5)
    assert logged[1] > 0.1 and logged[2] > 0.1, logged  # the stale engine's distance to the policy


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_truncated_sampling_without_the_sampling_mask_is_not_checked_and_the_run_says_so(tmp_path, caplog):
    """keep_sampling_mask=False: π_old is the full vocabulary's, and an engine may report the truncated distribution's
    log-probs (vLLM does): nothing is measured, even from an engine whose pushes do nothing, and the log says why."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine, top_p=0.9, keep_sampling_mask=False, max_steps=2)
    with caplog.at_level(logging.WARNING, logger="grpokit.experience"):
        trainer.train()
    assert len(gaps(trainer)) == 2 and all(math.isnan(g) for g in gaps(trainer))
    said = [r.getMessage() for r in caplog.records if "served-policy check" in r.getMessage()]
    assert said == [
        "The served-policy check does not run on these batches: truncated or penalised sampling (top_k, top_p, "
        "min_p, repetition_penalty, suppress_tokens) with keep_sampling_mask=False: π_old is the full vocabulary's, "
        "while an engine may report the log-probs of the distribution it drew from (vLLM does); "
        "keep_sampling_mask=True checks them (grpokit.served)."
    ]


# Truncated sampling with the sampling mask kept (the default): π_old is renormalised over each token's kept set,
# the distribution the engine drew from, so the check runs. Kept sets on this 16-token vocabulary (the first batch):
# top_p 13 tokens, top_k 8, min_p 1-16 (10.3 on average), combined 6, penalty (no truncation) the whole vocabulary
# with the penalty replayed; "bounded" would keep 16 under top_p alone, and sampling_mask_max_tokens (an implicit
# top-k the engine samples with) keeps 3.
TRUNCATED = {
    "top_p": dict(top_p=0.8),
    "top_k": dict(top_k=8),
    "min_p": dict(min_p=0.55),
    "combined": dict(top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    "penalty": dict(repetition_penalty=1.3),
    "bounded": dict(top_p=0.99, sampling_mask_max_tokens=3),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("sampling", TRUNCATED.values(), ids=TRUNCATED.keys())
def test_truncated_sampling_with_the_sampling_mask_passes_a_healthy_run(tmp_path, sampling, caplog):
    """The in-process engine in float32: its log-probs of the kept sets equal the training forward's renormalised
    over them to float rounding (the full vocabulary's would differ by -log of the kept mass, 0.1-1 nats here)."""
    trainer = letter_trainer(tmp_path, max_steps=2, **sampling)
    with caplog.at_level(logging.WARNING, logger="grpokit.experience"):
        trainer.train()
    logged = gaps(trainer)
    assert len(logged) == 2 and max(logged) < 1e-5, logged
    assert not [r for r in caplog.records if "served-policy check" in r.getMessage()]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("sampling", TRUNCATED.values(), ids=TRUNCATED.keys())
def test_truncated_sampling_with_a_push_that_does_nothing_fails_the_next_step(tmp_path, sampling):
    """The engine's kept sets and log-probs are its stale weights'; π_old renormalised over those sets with the
    policy's moved weights differs: the second step raises, the first (same weights on both sides) measured ~0."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine, **sampling)
    with pytest.raises(ServedPolicyMismatch, match=r"NoOpPushEngine does not sample.*version 1 .*training forward"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert gaps(trainer) == [pytest.approx(0.0, abs=1e-5)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_truncated_sampling_with_a_push_that_does_nothing_fails_before_training_where_pi_old_is_a_forward(tmp_path):
    """μ = 2, top_p = 0.8: π_old is a forward of the pushed weights renormalised over the engine's kept sets, compared
    as soon as the second generation batch is made, before any step trains on it."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine, num_iterations=2, top_p=0.8)
    with pytest.raises(ServedPolicyMismatch, match=r"NoOpPushEngine.*version 2 .*a forward's"):
        trainer.train()
    assert trainer.state.global_step == 2
    first, second = gaps(trainer)
    assert first == pytest.approx(0.0, abs=1e-5) and math.isnan(second)


# ------------------------------------------------------------------------------------------------ healthy runs


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_the_in_process_engine_passes_every_step(tmp_path, precision):
    """Healthy: float32 log-probs equal the training forward's to ~1e-7; bf16 autocast's decode against the
    training forward is the engine's own noise (2e-4 to 4e-4 on this model), far below the tolerance."""
    trainer = letter_trainer(tmp_path, bf16=precision == "bf16")
    trainer.train()
    logged = gaps(trainer)
    assert len(logged) == 3
    assert max(logged) < (1e-5 if precision == "float32" else 2e-3), logged


def test_an_engine_sampling_with_the_policy_module_itself_is_never_stopped():
    """Nothing is pushed to it, so no push can have failed: its gap is rounding, logged only."""
    policy, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    check_gap(5.0, 0.1, HFEngine(policy), 3, "x", policy)
    with pytest.raises(ServedPolicyMismatch, match="HFEngine does not sample"):
        check_gap(5.0, 0.1, HFEngine(other), 3, "x", policy)  # a copy of its own: a push must reach it


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_in_process_engine_rounding_above_the_tolerance_is_logged_not_raised(tmp_path):
    """bf16 autocast's decode differs from the training forward by ~3e-4 (above): a tolerance below that stops
    no run of the in-process engine, and the gaps are still logged, as they are (0.19 nats) for a bf16 model trained
    into peaked distributions (TRL's test_train[tiny-NemotronHForCausalLM-nano] at learning rate 0.1)."""
    trainer = letter_trainer(tmp_path, bf16=True, served_logprob_tolerance=1e-9)
    trainer.train()
    logged = gaps(trainer)
    assert trainer.state.global_step == 3 and len(logged) == 3
    assert min(logged) > 1e-9, logged


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_lora_policy_with_the_in_process_engine_passes(tmp_path):
    trainer = letter_trainer(tmp_path, lora=True, learning_rate=5e-2)
    trainer.train()
    assert max(gaps(trainer)) < 1e-5


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("sampling", [{}, dict(top_p=0.8)], ids=["full", "top_p"])
def test_a_producer_running_ahead_names_the_version_it_pushed(tmp_path, sampling):
    """max_staleness=1: the producer's π_old is a forward of its copy at the sampling version (renormalised over the
    engine's kept sets under top_p); batches 0 and 1 are sampled by version 0, batch 2 by version 1, which the engine
    never got: the run stops when the trainer takes it."""
    trainer = letter_trainer(tmp_path, NoOpPushEngine, max_staleness=1, max_steps=4, **sampling)
    with pytest.raises(RuntimeError, match=r"producer failed: ServedPolicyMismatch: NoOpPushEngine.*version 1 "):
        trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tool_results_inserted_into_the_transcript_are_not_counted(tmp_path):
    """A multi-turn rollout: the engine's log-probs of every policy turn equal the training forward's of the whole
    transcript, so the gap stays at float rounding; the tool result tokens between the turns (loss mask 0, no
    sampling log-prob) are left out, or they alone would make it several nats."""
    from agents_helpers import ForcedCallsEngine, lookup, tiny_agent_model
    from datasets import Dataset

    model, tokenizer = tiny_agent_model()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=40,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        log_completions=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **k: [float(len(completions[i])) for i in range(len(completions))],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": f"key k{i}"}]} for i in (3, 12)]),
        processing_class=tokenizer,
        tools=[lookup],
        rollout_engine=ForcedCallsEngine(model, tokenizer, calls=1),
    )
    trainer.train()
    logged_rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" for m in logged_rows[0]["completion"])
    logged = gaps(trainer)
    assert len(logged) == 1 and logged[0] < 1e-4, logged


def test_what_is_not_checked_says_why():
    from grpokit.rollout import SamplingParams
    from grpokit.served import skip_reason

    args, plain = GRPOConfig(), SamplingParams(4)
    assert skip_reason(args, plain, logprobs_are_engines=True, streamed=False, kept_sets=False) is None
    assert "streamed" in skip_reason(args, plain, logprobs_are_engines=True, streamed=True, kept_sets=False)
    assert "rollout_func" in skip_reason(args, plain, logprobs_are_engines=False, streamed=False, kept_sets=False)
    processed = (dict(top_k=5), dict(top_p=0.95), dict(min_p=0.1), dict(repetition_penalty=1.1))
    for sampling in (*processed, dict(suppress_token_ids=(3,))):
        kept = SamplingParams(4, **sampling)
        # the engine's kept sets (or vLLM's, replayed): π_old is over them, as the engine's log-probs are
        assert skip_reason(args, kept, logprobs_are_engines=True, streamed=False, kept_sets=True) is None
        unreported = skip_reason(args, kept, logprobs_are_engines=True, streamed=False, kept_sets=False)
        assert "kept sets the engine did not return" in unreported
        full = SamplingParams(4, keep_sampling_mask=False, **sampling)
        assert "keep_sampling_mask=False" in skip_reason(args, full, True, False, kept_sets=False)
    full_plain = SamplingParams(4, keep_sampling_mask=False)  # nothing processed: the policy's distribution
    assert skip_reason(args, full_plain, logprobs_are_engines=True, streamed=False, kept_sets=False) is None
    regex = GRPOConfig(use_vllm=True, vllm_structured_outputs_regex="[ab]+")
    assert "structured outputs" in skip_reason(regex, plain, logprobs_are_engines=True, streamed=False, kept_sets=True)


def test_a_multi_turn_rollout_whose_engine_reported_no_logprobs_has_none():
    """Zeros in place of log-probs an engine did not report would read as a gap of |log π| (several nats)."""
    from grpokit.agents.loop import Transcript, transcripts_rollout

    reported, unreported = Transcript([1, 2], {}), Transcript([1], {})
    reported.add([3, 4], 1, [-0.5, -0.25])
    reported.add([5], 0)  # a tool's result: inserted, no log-prob to report
    unreported.add([3], 1)
    logprobs = transcripts_rollout([reported], 0, {}).sampling_logprobs
    assert torch.equal(logprobs, torch.tensor([[-0.5, -0.25, 0.0]]))
    assert transcripts_rollout([reported, unreported], 0, {}).sampling_logprobs is None
