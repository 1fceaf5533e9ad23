"""The experience component (grpokit.experience): it returns what a generation made and writes no trainer state; the
rollout runner's seam (single-turn and multi-turn alike); the engine's declared log-prob guarantee; and the package's
import directions (DESIGN.md: data → rollout → agents, rewards → experience → trainer → cli)."""

import ast
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import grpokit
from grpokit import GRPOConfig, GRPOTrainer, TrainBatch
from grpokit.rollout import ScriptedEngine, engine_logprobs_match_training
from grpokit.testing import build_char_tokenizer, build_tiny_model

PACKAGE = Path(grpokit.__file__).resolve().parent  # the installed package under test


def letter_trainer(tmp_path, **overrides):
    tokenizer = build_char_tokenizer("abcd:")
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=32,
        seed=0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=3,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        beta=0.04,
        log_completions=True,
    )
    data = Dataset.from_list([{"prompt": f"{c}:", "letter": c} for c in "abcd"] * 2)

    def first_letter(completions, letter, **kwargs):
        return [float(c[:1] == t) for c, t in zip(completions, letter)]

    return GRPOTrainer(
        model=model,
        reward_funcs=first_letter,
        args=GRPOConfig(**{**values, **overrides}),
        train_dataset=data,
        processing_class=tokenizer,
    )


def same_batch(a: TrainBatch, b: TrainBatch) -> None:
    for name in (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "attention_mask",
        "loss_mask",
        "lengths",
        "advantages",
        "old_logprobs",
        "ref_logprobs",
        "sampling_logprobs",
    ):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name


def test_make_returns_the_generation_and_writes_no_trainer_state(tmp_path):
    maker_run, trainer_run = letter_trainer(tmp_path / "a"), letter_trainer(tmp_path / "b")
    before = (maker_run.state.rollouts, maker_run.state.num_tokens)
    experience = maker_run.experience.make(maker_run.state.rollouts, maker_run.state)
    assert (maker_run.state.rollouts, maker_run.state.num_tokens) == before
    assert maker_run.window.flush() == {}  # nothing recorded behind the trainer's back
    # What generate_batch records is exactly what the maker returned.
    batch = trainer_run.generate_batch()
    same_batch(experience.batch, batch)
    assert trainer_run.state.rollouts == experience.rollouts == 1
    rollout_tokens = int(batch.prompt_mask.sum() + batch.attention_mask.sum())
    assert experience.num_tokens == trainer_run.state.num_tokens == rollout_tokens
    assert trainer_run.window.flush() == pytest.approx(experience.metrics)
    assert {"reward", "reward_std", "completions/mean_length", "frac_reward_zero_std"} <= set(experience.metrics)
    assert len(experience.samples) == 4 and {"completion", "reward", "advantage"} <= set(experience.samples[0])
    # beta > 0: π_ref is there; one pass, whole generation batches per step: no π_old needed.
    assert batch.ref_logprobs is not None and batch.old_logprobs is None


def test_train_batch_from_a_rollout_repeats_outcome_advantages_and_takes_token_ones(tmp_path):
    trainer = letter_trainer(tmp_path)
    decoded = trainer.runner.run([{"prompt": "a:"}] * 4, [4], seed=3)
    rollout, width = decoded.rollout, decoded.rollout.completion_ids.shape[1]
    batch = TrainBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, 0.0]))
    assert torch.equal(batch.advantages, torch.tensor([1.0, -1.0, 0.5, 0.0])[:, None].expand(-1, width))
    assert batch.advantages.is_contiguous() and torch.equal(batch.loss_mask, rollout.loss_mask)
    per_token = torch.arange(4 * (width + 2), dtype=torch.float32).reshape(4, width + 2)
    masked = torch.zeros_like(rollout.loss_mask)
    batch = TrainBatch.from_rollout(rollout, per_token, masked)
    assert torch.equal(batch.advantages, per_token[:, :width]) and torch.equal(batch.loss_mask, masked)
    assert torch.equal(batch.sampling_logprobs, rollout.sampling_logprobs)


def test_the_runner_says_whether_its_logprobs_may_serve_as_pi_old(tmp_path):
    assert letter_trainer(tmp_path / "f32").runner.logprobs_match_training  # the in-process engine in float32
    assert not letter_trainer(tmp_path / "bf16", bf16=True).runner.logprobs_match_training
    scripted = ScriptedEngine(lambda prompt_ids, index: [1, 2])
    assert not engine_logprobs_match_training(scripted)

    class Undeclared:
        def generate(self, prompts, params, seed): ...

        def sync_weights(self, model): ...

    assert not engine_logprobs_match_training(Undeclared())
    Undeclared.logprobs_match_training = "yes"
    with pytest.raises(TypeError, match="logprobs_match_training must be a bool"):
        engine_logprobs_match_training(Undeclared())

    class FormerName:  # an engine written when the attribute was called exact_logprobs
        exact_logprobs = True

        def generate(self, prompts, params, seed): ...

        def sync_weights(self, model): ...

    with pytest.warns(DeprecationWarning, match="exact_logprobs is now named logprobs_match_training"):
        assert engine_logprobs_match_training(FormerName())


def test_with_mu_2_the_float32_engine_logprobs_are_pi_old_and_equal_a_training_forward(tmp_path):
    from grpokit.experience import logprobs_in_chunks

    trainer = letter_trainer(tmp_path, num_iterations=2)
    batch = trainer.generate_batch()
    assert batch.old_logprobs is not None and torch.equal(batch.old_logprobs, batch.sampling_logprobs)
    recomputed = logprobs_in_chunks(trainer.unwrapped_model, batch, trainer.args, trainer.accelerator.autocast)
    torch.testing.assert_close(recomputed * batch.loss_mask, batch.old_logprobs * batch.loss_mask, rtol=0, atol=1e-5)


def imports_of(path: Path) -> set[str]:
    """The grpokit modules a file imports (absolute names, relative imports resolved), at any depth in the file."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("grpokit"):
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("grpokit"))
    return found


def importers_of(target: str) -> set[str]:
    return {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if any(name == target or name.startswith(target + ".") for name in imports_of(path))
    }


def import_circles() -> list[set[str]]:
    """The package's modules that import each other, directly or through others (at any depth in a file:
    function-level imports count): the strongly connected components of the import graph with more than one module."""
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in PACKAGE.rglob("*.py")
    }

    def module_of(name: str) -> str:  # grpokit.rollout.HFEngine -> grpokit.rollout
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph = {m: {module_of(n) for n in imports_of(path)} - {m, "grpokit"} for m, path in modules.items()}
    reaches = {m: set() for m in graph}
    for start in graph:  # the modules each one reaches (the package is small: a walk from each)
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m in graph and m not in reaches[start]:
                reaches[start].add(m)
                todo.extend(graph[m])
    circles = {frozenset({m} | {n for n in reaches[m] if m in reaches[n]}) for m in graph if m in reaches[m]}
    return sorted((set(c) for c in circles), key=sorted)


def test_no_modules_import_each_other():
    # The last pair (distributed <-> models) went with is_peft_model moving into compat; a new circle fails here.
    assert import_circles() == []


def test_imports_run_one_way():
    # rloo.py, distill_trainer.py, async_grpo.py: GRPOTrainer subclasses (another estimator, another objective, TRL's
    # asynchronous trainer's interface, on the same loop)
    assert importers_of("grpokit.trainer") <= {
        "__init__.py",
        "cli.py",
        "demo/task.py",
        "rloo.py",
        "distill_trainer.py",
        "async_grpo.py",
    }
    assert importers_of("grpokit.demo") - {"demo/__init__.py", "demo/task.py"} <= {"cli.py"}
    # build.py builds the trainer's experience maker (build_experience); the producer makes batches with it
    assert importers_of("grpokit.experience") <= {"trainer.py", "build.py", "producer.py"}
    for pure in ("advantages.py", "loss.py"):  # the math imports nothing from the package
        assert not imports_of(PACKAGE / pure), pure
    # The training forward shares helpers with the sampler through grpokit.forward, not the sampler's modules.
    assert not {name for name in imports_of(PACKAGE / "logprobs.py") if name.startswith("grpokit.rollout")}
    assert "grpokit" not in {
        name for path in PACKAGE.rglob("*.py") if path.name != "__init__.py" for name in imports_of(path)
    }  # nothing reaches the package's __init__
