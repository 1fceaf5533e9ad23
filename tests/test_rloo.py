"""RLOOConfig / RLOOTrainer (issue 38, item 10): TRL 1.16's fields and defaults; the reward with its KL penalty and
clipping, the leave-one-out advantages and the sequence-ratio loss checked against the code of the installed TRL's
RLOOTrainer (its own lines, run on the same inputs, in float64); the shared loop's batches against the same code, in
one process and in two (a group spanning them); a TRL RLOO script with only its import changed; and learning on the
letter task (slow)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import textwrap
import types
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from letters import LETTERS, letter_dataset, repeat_letter, tiny_letter_model

from grpokit import GRPOConfig, RLOOConfig, RLOOTrainer
from grpokit.advantages import combine_and_normalize, sequence_kl
from grpokit.experience import logprobs_in_chunks
from grpokit.loss import policy_loss
from grpokit.rloo import RLOO_FIELDS, grpo_config
from grpokit.testing import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
RECORDED = json.loads(files("grpokit").joinpath("trl_rloo_fields.json").read_text())


def defaults(config_class) -> dict:
    """{name: default} of a dataclass's init fields, in declaration order (factories called)."""
    return {
        spec.name: spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        for spec in dataclasses.fields(config_class)
        if spec.init
    }


# ----------------------------------------------------------------------------------------------- the config


def test_fields_and_defaults_are_the_installed_trls():
    trl = pytest.importorskip("trl")
    if trl.__version__ != RECORDED["versions"]["trl"]:
        pytest.skip(f"trl {trl.__version__} is installed; grpokit follows {RECORDED['versions']['trl']}")
    expected, actual = defaults(trl.RLOOConfig), defaults(RLOOConfig)
    assert list(actual) == list(expected)  # the same fields, in TRL's order
    assert {name: value for name, value in actual.items() if value != expected[name]} == {}
    assert (
        RLOOConfig().beta,
        RLOOConfig().num_generations,
        RLOOConfig().normalize_advantages,
        RLOOConfig().reward_clip_range,
    ) == (0.05, 2, False, None)
    assert defaults(RLOOConfig) == RECORDED["fields"]


def test_the_config_maps_onto_the_shared_loop():
    grpo_fields = {spec.name: spec for spec in dataclasses.fields(GRPOConfig)}
    for spec in dataclasses.fields(RLOOConfig):  # shared fields keep GRPOConfig's help: one meaning per name
        if spec.name not in RLOO_FIELDS:
            assert spec.metadata["help"] == grpo_fields[spec.name].metadata["help"], spec.name
    config = grpo_config(
        RLOOConfig(
            output_dir="out", normalize_advantages=True, reward_clip_range=(-1.0, 2.0), beta=0.1, learning_rate=3e-6
        )
    )
    assert (
        config.advantage_estimator,
        config.scale_rewards,
        config.loss_type,
        config.importance_sampling_level,
        config.kl_in_reward,
        config.reward_clip_range,
        config.beta,
        config.learning_rate,
    ) == ("rloo", "batch", "rloo", "sequence_sum", True, [-1.0, 2.0], 0.1, 3e-6)
    assert config.objective_options()["beta"] == 0.0  # the KL is in the reward, never a loss term
    assert grpo_config(RLOOConfig()).scale_rewards == "none"
    derived = RLOOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3)  # derived when built, as TRL
    assert (derived.steps_per_generation, derived.generation_batch_size) == (3, 12)
    assert grpo_config(derived).generation_batch_size == 12
    with pytest.raises(ValueError, match="reward_clip_range=\\(2, 1\\) must be \\(min, max\\)"):
        RLOOConfig(reward_clip_range=(2, 1))
    with pytest.raises(TypeError, match="RLOOTrainer takes an RLOOConfig"):
        RLOOTrainer(model=None, reward_funcs=repeat_letter, args=GRPOConfig())


# ------------------------------------------------------------------- TRL's own code on the same inputs


def trl_lines(method, first: str, last: str) -> str:
    """The lines of one of TRL's methods from the one containing `first` to the next containing `last`, dedented:
    TRL's code itself, not a transcription of it."""
    lines = inspect.getsource(method).splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i in range(start, len(lines)) if last in lines[i])
    return textwrap.dedent("\n".join(lines[start : end + 1]))


def trl_rloo_advantages(
    rewards_per_func,
    weights,
    old_logprobs,
    ref_logprobs,
    mask,
    num_generations,
    *,
    beta,
    normalize_advantages,
    reward_clip_range,
):
    """TRL 1.16 RLOOTrainer._generate_and_score_completions from the weighted reward sum to the advantages."""
    pytest.importorskip("trl")
    from trl.trainer.rloo_trainer import RLOOTrainer as TRLRLOOTrainer
    from trl.trainer.utils import nanstd

    code = trl_lines(
        TRLRLOOTrainer._generate_and_score_completions,
        "unscorable_mask = torch.isnan(",
        "advantages = torch.nan_to_num(advantages",
    )
    trainer = types.SimpleNamespace(
        reward_weights=weights,
        reward_clip_range=reward_clip_range,
        beta=beta,
        normalize_advantages=normalize_advantages,
    )
    scope = dict(
        self=trainer,
        torch=torch,
        nanstd=nanstd,
        gather=lambda t: t,
        device="cpu",
        rewards_per_func=rewards_per_func,
        old_per_token_logps=old_logprobs,
        ref_per_token_logps=ref_logprobs,
        completion_mask=mask,
        num_generations=num_generations,
    )
    exec(code, scope)
    return scope["advantages"]


def random_inputs(seed: int, num_prompts=4, num_generations=4, num_functions=2, width=6):
    generator = torch.Generator().manual_seed(seed)
    n = num_prompts * num_generations
    scores = torch.randn(n, num_functions, generator=generator, dtype=torch.float64) * 2
    scores[1, 0] = float("nan")  # a function that does not apply to one completion
    scores[5] = float("nan")  # an unscorable completion: excluded from its group's baseline, advantage 0
    scores[8:11] = float("nan")  # a group with one scorable completion: no sibling, advantage 0
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)[:num_functions]
    old = -torch.rand(n, width, generator=generator, dtype=torch.float64) * 3
    ref = old + torch.randn(n, width, generator=generator, dtype=torch.float64) * 0.3
    lengths = torch.randint(1, width + 1, (n,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    return scores, weights, old, ref, mask


@pytest.mark.parametrize("beta", [0.0, 0.05, 0.7])
@pytest.mark.parametrize("normalize_advantages", [False, True])
@pytest.mark.parametrize("reward_clip_range", [None, (-1.0, 1.5)])
def test_advantages_with_the_kl_in_the_reward_are_trls(beta, normalize_advantages, reward_clip_range):
    for seed in range(3):
        scores, weights, old, ref, mask = random_inputs(seed)
        expected = trl_rloo_advantages(
            scores,
            weights,
            old,
            ref,
            mask,
            4,
            beta=beta,
            normalize_advantages=normalize_advantages,
            reward_clip_range=reward_clip_range,
        )
        actual = combine_and_normalize(
            scores,
            weights,
            4,
            estimator="rloo",
            scale_rewards="batch" if normalize_advantages else "none",
            reward_clip_range=reward_clip_range,
            kl_penalty=beta * sequence_kl(old, ref, mask) if beta else None,
        )
        assert actual.dtype == torch.float64
        # TRL's nanstd computes its Bessel factor count / (count - 1) as an int / int division, in float32: the
        # whitened advantages carry that factor's rounding (~1e-8 relative); grpokit's is exact.
        tolerance = 1e-7 if normalize_advantages else 1e-12
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
        assert actual[5] == 0 and (actual[8:12] == 0).all()


def test_the_kl_penalty_changes_the_advantages_by_beta_times_the_summed_log_ratio():
    """A hand check of the fold: one group of 2 with equal rewards; only the KL differs."""
    old = torch.tensor([[-1.0, -1.0, -9.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.5, 0.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kl = sequence_kl(old, ref, mask)  # [1.0, 0.0]: the masked token (-9 vs 0) does not count
    assert kl.tolist() == [1.0, 0.0]
    advantages = combine_and_normalize(
        torch.ones(2, 1, dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        2,
        estimator="rloo",
        scale_rewards="none",
        kl_penalty=0.1 * kl,
    )
    assert advantages.tolist() == pytest.approx([-0.1, 0.1], abs=1e-15)  # (1 - 0.1) - 1 and 1 - (1 - 0.1)


def test_the_loss_and_its_gradient_are_trls():
    trl = pytest.importorskip("trl")
    from trl.trainer.rloo_trainer import RLOOTrainer as TRLRLOOTrainer

    code = trl_lines(
        TRLRLOOTrainer._compute_loss,
        "logps = (per_token_logps * completion_mask).sum(1)",
        "loss = per_sequence_loss.mean()",
    )
    generator = torch.Generator().manual_seed(0)
    n, width = 12, 5
    mask = (torch.arange(width)[None] < torch.randint(1, width + 1, (n,), generator=generator)[:, None]).double()
    old = -torch.rand(n, width, generator=generator, dtype=torch.float64) * 2
    # ratios from well inside to well outside the clip range, both signs of advantage
    logprobs = (old + torch.randn(n, width, generator=generator, dtype=torch.float64) * 0.15).requires_grad_()
    advantages = torch.randn(n, generator=generator, dtype=torch.float64)
    trainer = types.SimpleNamespace(epsilon_low=0.2, epsilon_high=0.28)
    scope = dict(
        self=trainer,
        torch=torch,
        per_token_logps=logprobs,
        completion_mask=mask,
        inputs={"old_logps": (old * mask).sum(1), "advantages": advantages},
    )
    exec(code, scope)
    (expected,) = torch.autograd.grad(scope["loss"], logprobs)
    loss, stats = policy_loss(
        logprobs,
        old,
        None,
        advantages,
        mask,
        loss_type="rloo",
        epsilon=0.2,
        epsilon_high=0.28,
        importance_sampling_level="sequence_sum",
    )
    (actual,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(loss, scope["loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    ratio = torch.exp((logprobs.detach() - old).mul(mask).sum(1))
    clipped = ((ratio < 0.8) & (advantages < 0)) | ((ratio > 1.28) & (advantages > 0))
    assert 0 < clipped.sum() < n  # the case exercises the clip
    assert stats.objective["clip_ratio/region_mean"].item() == pytest.approx(clipped.double().mean().item())
    assert trl.__version__


# ------------------------------------------------------------------------------------- through the loop


def first_token_reward(completions, completion_ids, **kwargs):
    """A reward that the batch itself tells: the first completion token's id, modulo 3."""
    return [float(ids[0] % 3) if len(ids) else 0.0 for ids in completion_ids]


def rloo_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=3,
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        report_to="none",
        gradient_checkpointing=False,
    )
    return RLOOConfig(**{**values, **overrides})


@pytest.mark.parametrize("normalize_advantages", [False, True])
def test_the_loops_batches_carry_trls_advantages(tmp_path, normalize_advantages):
    """A generation batch of RLOOTrainer: its advantages are TRL's code's of its rewards, of its π_old (the batch's
    old_logprobs, as TRL's old_per_token_logps) and of the reference's log-probs; the loss sees no π_ref."""
    model, tokenizer = tiny_letter_model()
    dataset = Dataset.from_list([{"prompt": f"{c}{d}:"} for c in LETTERS for d in LETTERS[:2]])  # distinct prompts
    args = rloo_config(
        tmp_path, beta=0.5, bf16=False, normalize_advantages=normalize_advantages, reward_clip_range=(0.0, 1.5)
    )
    trainer = RLOOTrainer(
        model=model, reward_funcs=first_token_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    with torch.no_grad():  # move the policy away from the reference, so that the KL is not 0
        generator = torch.Generator().manual_seed(1)
        for parameter in trainer.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    batch = trainer.generate_batch()
    assert batch.ref_logprobs is None and batch.old_logprobs is not None
    # regroup the shuffled rows by prompt (each prompt's G completions), as TRL's rows come
    keys = [tuple(row.tolist()) for row in batch.prompt_ids]
    order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
    grouped = batch.select(torch.tensor(order))
    assert all(len({tuple(r.tolist()) for r in grouped.prompt_ids[g : g + 4]}) == 1 for g in range(0, 16, 4))
    ref = logprobs_in_chunks(trainer.ref_model, grouped, trainer.args, trainer.accelerator.autocast)
    kl = sequence_kl(grouped.old_logprobs, ref, grouped.loss_mask)
    assert kl.abs().min() > 1e-3  # a KL that moves the advantages
    rewards = torch.tensor([[float(ids[0] % 3)] for ids in grouped.completion_ids.tolist()], dtype=torch.float64)
    expected = trl_rloo_advantages(
        rewards,
        torch.ones(1, dtype=torch.float64),
        grouped.old_logprobs.double(),
        ref.double(),
        grouped.loss_mask,
        4,
        beta=0.5,
        normalize_advantages=normalize_advantages,
        reward_clip_range=(0.0, 1.5),
    )
    torch.testing.assert_close(grouped.advantages[:, 0].double(), expected, rtol=1e-5, atol=1e-5)
    assert (grouped.advantages == grouped.advantages[:, :1]).all()  # one advantage per completion
    trainer.train()
    logged = [record for record in trainer.state.log_history if "loss" in record]
    assert len(logged) == 2 and all("kl" in record and "clip_ratio/region_mean" in record for record in logged)


TRL_RLOO_SCRIPT = """
from datasets import Dataset
from trl import RLOOConfig, RLOOTrainer

dataset = Dataset.from_list([{"prompt": c + ":"} for c in "abcdefgh"] * 4)


def reward_len(completions, **kwargs):
    return [-abs(3 - len(completion)) for completion in completions]


training_args = RLOOConfig(output_dir=OUTPUT_DIR, per_device_train_batch_size=8, max_completion_length=4,
                           max_steps=3, logging_steps=1, report_to="none", use_cpu=True)
trainer = RLOOTrainer(model=model, reward_funcs=reward_len, args=training_args, train_dataset=dataset,
                      processing_class=tokenizer)
trainer.train()
"""


def test_a_trl_rloo_script_runs_with_only_the_import_changed(tmp_path):
    model, tokenizer = tiny_letter_model()
    script = TRL_RLOO_SCRIPT.replace("from trl import", "from grpokit import")
    scope = {"OUTPUT_DIR": str(tmp_path / "out"), "model": model, "tokenizer": tokenizer}
    exec(compile(script, "train_rloo.py", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 3 and trainer.rloo_args.beta == 0.05 and trainer.ref_model is not None
    assert (trainer.beta, trainer.normalize_advantages, trainer.reward_clip_range) == (0.05, False, None)  # TRL's
    steps = [record for record in trainer.state.log_history if "loss" in record]
    assert len(steps) == 3 and all(key in steps[0] for key in ("reward", "kl", "entropy", "clip_ratio/region_mean"))
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(sum(r["loss"] for r in steps) / 3, rel=1e-6)
    # TRL's eval_loss is its loss on-policy: mean(-A), 0 since leave-one-out advantages sum to 0 in every group
    assert trainer.evaluate(scope["dataset"].select(range(4)))["eval_loss"] == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------- TRL's batch count per epoch

# TRL's test_prepare_input_called_with_correct_data (tests/test_rloo_trainer.py): its config, on its 17-prompt set.
TRL_COUNT_CONFIG = dict(
    gradient_accumulation_steps=3,
    steps_per_generation=4,
    num_generations=4,
    per_device_train_batch_size=6,
    num_iterations=2,
    shuffle_dataset=False,
)
TRL_COUNT_PROMPTS = 17


def trls_training_step_calls(num_train_epochs: int = 3) -> int:
    """TRL's count, from TRL's own code: its RepeatSampler behind the train DataLoader (an epoch holds whole
    generation batches of 24 / 4 = 6 prompts: 2, the 5 prompts left over are skipped, each batch repeated
    steps_per_generation x num_iterations times), one `training_step` per DataLoader batch of
    per_device_train_batch_size x steps_per_generation rows (transformers' loop), num_train_epochs epochs."""
    pytest.importorskip("trl")
    from trl.trainer.utils import RepeatSampler

    c = TRL_COUNT_CONFIG
    rows_per_batch = c["per_device_train_batch_size"] * c["steps_per_generation"]
    sampler = RepeatSampler(
        list(range(TRL_COUNT_PROMPTS)),
        mini_repeat_count=c["num_generations"],
        batch_size=rows_per_batch // c["num_generations"],
        repeat_count=c["num_iterations"] * c["steps_per_generation"],
        shuffle=False,
    )
    return num_train_epochs * len(list(sampler)) // rows_per_batch


class CountingRLOOTrainer(RLOOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        self.training_steps = getattr(self, "training_steps", 0) + 1
        return super().training_step(model, inputs, num_items_in_batch)


def test_training_step_is_called_as_often_as_in_trl(tmp_path):
    """TRL's test counts 48 `training_step` calls for its config (3 epochs x 2 generation batches x 8); grpokit made
    72 (3 generation batches per epoch: the 5 prompts left over made a third batch with the next epoch's first).
    An epoch now holds whole generation batches, as TRL's sampler: the same count, and the same prompts."""
    model, tokenizer = tiny_letter_model()
    prompts = [f"{a}{b}:" for a in LETTERS for b in LETTERS][:TRL_COUNT_PROMPTS]
    seen = []

    def recording(completions, prompts, **kwargs):
        seen.append(sorted(set(prompts)))
        return [float(len(c)) for c in completions]

    args = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        max_completion_length=2,
        learning_rate=0.1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        beta=0.0,
        **TRL_COUNT_CONFIG,
    )
    trainer = CountingRLOOTrainer(
        model=model,
        reward_funcs=recording,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
    )
    trainer.train()
    assert trls_training_step_calls() == 48  # TRL's test's own figure
    assert trainer.training_steps == trls_training_step_calls() == 48
    # 48 micro-batches in windows of 3 (TRL steps 18 times: transformers ends each epoch's window early)
    assert trainer.state.global_step == 16 and trainer.state.epoch == 3
    assert seen == [sorted(prompts[:6]), sorted(prompts[6:12])] * 3  # shuffle_dataset=False: TRL's batches


@pytest.mark.slow
def test_trls_own_rloo_trainer_calls_training_step_48_times(tmp_path):
    """The figure trls_training_step_calls derives, from TRL 1.16's RLOOTrainer itself on the tiny model (about a
    minute on a CPU)."""
    trl = pytest.importorskip("trl")
    model, tokenizer = tiny_letter_model()
    prompts = [f"{a}{b}:" for a in LETTERS for b in LETTERS][:TRL_COUNT_PROMPTS]

    class Counting(trl.RLOOTrainer):
        def training_step(self, *args, **kwargs):
            self.training_steps = getattr(self, "training_steps", 0) + 1
            return super().training_step(*args, **kwargs)

    args = trl.RLOOConfig(
        output_dir=str(tmp_path / "out"),
        max_completion_length=2,
        learning_rate=0.1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        bf16=False,
        use_cpu=True,
        beta=0.0,
        **TRL_COUNT_CONFIG,
    )
    trainer = Counting(
        model=model,
        reward_funcs=lambda completions, **kwargs: [1.0] * len(completions),
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
    )
    trainer.train()
    assert trainer.training_steps == trls_training_step_calls() == 48


TRL_RLOO_DATALOADER_SCRIPT = """
from datasets import Dataset
from trl import RLOOConfig, RLOOTrainer

dataset = Dataset.from_list([{"prompt": c + ":"} for c in "abcdefgh"] * 4)


def reward_len(completions, **kwargs):
    return [-abs(3 - len(completion)) for completion in completions]


training_args = RLOOConfig(output_dir=OUTPUT_DIR, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                           max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, bf16=False)
trainer = RLOOTrainer(model=MODEL, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
dataloader = trainer.get_train_dataloader()
first = next(iter(dataloader))
batching = {"rows per batch": dataloader.batch_sampler.batch_size, "batch_size": dataloader.batch_size,
            "num_workers": dataloader.num_workers, "batches per epoch": len(dataloader),
            "first batch": [row["prompt"] for row in first]}
trainer.train()
"""


def test_a_trl_rloo_script_reading_the_train_dataloader_runs_with_only_the_import_changed(tmp_path):
    """The same script under TRL 1.16 and under grpokit: the same batching, the same first batch (the epoch's seeded
    order is TRL's: torch.randperm with a generator seeded with `seed`)."""
    pytest.importorskip("trl")
    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32))
    runs = {}
    for library in ("trl", "grpokit"):
        scope = {"OUTPUT_DIR": str(tmp_path / library), "MODEL": model_dir}
        script = TRL_RLOO_DATALOADER_SCRIPT.replace("from trl import", f"from {library} import")
        exec(compile(script, "train_rloo.py", "exec"), scope)
        runs[library] = scope
    assert runs["grpokit"]["trainer"].state.global_step == 2
    batching = runs["grpokit"]["batching"]
    assert batching == runs["trl"]["batching"]
    # 8 rows (4 prompts x 2 generations) x steps_per_generation 2; 4 generation batches in 32 prompts, each twice
    assert (batching["rows per batch"], batching["batch_size"], batching["batches per epoch"]) == (16, None, 8)
    assert batching["first batch"][::2] == batching["first batch"][1::2]


# ------------------------------------------------------------------------------------------------ learning


@pytest.mark.slow
def test_rloo_learns_the_letter_task(tmp_path):
    """By the criterion of tests/test_objectives_learning.py, with TRL RLOOConfig's defaults (beta 0.05 in the
    reward) but for the batch shape and the learning rate."""
    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=64))
    args = RLOOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        max_steps=80,
        logging_steps=5,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
    )
    trainer = RLOOTrainer(model=model_dir, reward_funcs=[repeat_letter], args=args, train_dataset=letter_dataset())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    letter = [entry["rewards/repeat_letter/mean"] for entry in logs]
    assert letter[0] < 0.25, letter
    assert sum(letter[-8:]) / 8 >= 0.45, letter
    assert all("kl" in entry for entry in logs)  # TRL RLOO's kl: the mean per-token log-ratio, at every record


# --------------------------------------------------------------------------------------------- two processes

TWO_PROCESS_SCRIPT = """
import json, os, sys

import torch
from datasets import Dataset

from grpokit import RLOOConfig, RLOOTrainer
from grpokit.experience import logprobs_in_chunks


def first_token_reward(completions, completion_ids, **kwargs):
    return [float(ids[0] % 3) if len(ids) else 0.0 for ids in completion_ids]


def main(spec_path):
    spec = json.load(open(spec_path))[0]
    letters = "abcdefgh"
    dataset = Dataset.from_list([{"prompt": f"{a}{b}:"} for a in letters for b in letters])
    args = RLOOConfig(output_dir=spec["out"], per_device_train_batch_size=6, num_generations=4,
                      max_completion_length=3, max_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                      report_to="none", bf16=False, gradient_checkpointing=False, beta=0.5,
                      normalize_advantages=True)
    trainer = RLOOTrainer(model=spec["model"], reward_funcs=first_token_reward, args=args, train_dataset=dataset)
    with torch.no_grad():  # the same move away from the reference on every rank
        generator = torch.Generator().manual_seed(1)
        for parameter in trainer.unwrapped_model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    batch = trainer.generate_batch()
    ref = logprobs_in_chunks(trainer.ref_model, batch, trainer.args, trainer.accelerator.autocast)
    rank = int(os.environ.get("RANK", 0))
    torch.save({"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids, "mask": batch.loss_mask,
                "old": batch.old_logprobs, "ref": ref, "advantages": batch.advantages[:, 0]},
               os.path.join(spec["out"], f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.distributed
def test_two_processes_fold_the_kl_of_the_whole_group(tmp_path):
    """2 processes x 6 completions, groups of 4: the middle prompt's group spans the processes. Each rank's
    advantages are TRL's code's over the gathered rows (rewards, π_old and π_ref of both ranks)."""
    from test_distributed import launch

    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32))
    out = tmp_path / "out"
    out.mkdir()
    launch(tmp_path, dict(model=model_dir, out=str(out)), script=TWO_PROCESS_SCRIPT)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    rows = {key: torch.cat([rank[key] for rank in ranks]) for key in ranks[0]}
    keys = [tuple(row.tolist()) for row in rows["prompt_ids"]]
    assert sorted(keys.count(key) for key in set(keys)) == [4, 4, 4]
    assert {tuple(r.tolist()) for r in ranks[0]["prompt_ids"]} & {tuple(r.tolist()) for r in ranks[1]["prompt_ids"]}
    assert sequence_kl(rows["old"], rows["ref"], rows["mask"]).abs().min() > 1e-3  # a KL that moves the advantages
    order = torch.tensor(sorted(range(len(keys)), key=lambda i: (keys[i], i)))
    rewards = torch.tensor([[float(ids[0] % 3)] for ids in rows["completion_ids"][order].tolist()], dtype=torch.float64)
    expected = trl_rloo_advantages(
        rewards,
        torch.ones(1, dtype=torch.float64),
        rows["old"][order].double(),
        rows["ref"][order].double(),
        rows["mask"][order],
        4,
        beta=0.5,
        normalize_advantages=True,
        reward_clip_range=None,
    )
    torch.testing.assert_close(rows["advantages"][order].double(), expected, rtol=1e-5, atol=1e-5)
