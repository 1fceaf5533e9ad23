"""The built-in demo: teach a tiny transformer to find the last letter in alphabetical order, offline, in minutes.

The task is verifiable: the prompt is 4 letters and `>`, the answer is the one that comes last in the alphabet
(`cfad>` -> `f`).
A random-weight model has nothing for GRPO to sharpen, so the demo first runs a short supervised warm-up that stops
as soon as held-out accuracy reaches a low bar (real GRPO starts from a pretrained model); GRPO then turns a policy
that mostly fails into one that mostly succeeds. Accuracy is exact match under greedy decoding on prompts never
seen in training.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import GRPOConfig
from ..data import pad_left
from ..rewards.builtin import exact_match
from ..rollout import SamplingParams, generate
from ..testing import build_char_tokenizer, build_tiny_model

LETTERS = "abcdefgh"
LENGTH = 4


def answer_format(completions, **kwargs) -> list[float]:
    """1 for a single letter (the format asked for), else 0."""
    return [float(len(c.strip()) == 1 and c.strip() in LETTERS) for c in completions]


@dataclass
class DemoTask:
    seed: int = 0
    num_heldout: int = 200

    def __post_init__(self):
        rng = random.Random(self.seed)
        words = sorted({self._word(rng) for _ in range(20000)})
        rng.shuffle(words)
        self.heldout, self.train = words[: self.num_heldout], words[self.num_heldout :]
        self.tokenizer = build_char_tokenizer(LETTERS + ">")

    @staticmethod
    def _word(rng: random.Random) -> str:
        # The answer is uniform over the last five letters, so no constant guess is right more than 1 time in 5.
        top = rng.randrange(3, len(LETTERS))
        letters = [rng.choice(LETTERS[: top + 1]) for _ in range(LENGTH - 1)]
        letters.insert(rng.randrange(LENGTH), LETTERS[top])
        return "".join(letters)

    @staticmethod
    def row(word: str) -> dict:
        return {"prompt": f"{word}>", "target": max(word)}

    def dataset(self, words=None):
        from datasets import Dataset

        return Dataset.from_list([self.row(w) for w in (words or self.train)])

    def build_model(self, hidden_size: int = 64):
        tok = self.tokenizer
        return build_tiny_model(
            len(tok),
            hidden_size=hidden_size,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            seed=self.seed,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
        )

    @torch.no_grad()
    def accuracy(self, model, words=None) -> float:
        """Exact-match accuracy of greedy decoding on the held-out words."""
        words = words or self.heldout
        tok = self.tokenizer
        ids, mask = pad_left([tok(f"{w}>")["input_ids"] for w in words], tok.pad_token_id)
        params = SamplingParams(
            max_new_tokens=3, top_k=1, eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id
        )
        was_training = model.training
        model.eval()
        rollout = generate(model, ids, mask, params)
        model.train(was_training)
        texts = tok.batch_decode(rollout.completion_id_lists(), skip_special_tokens=True)
        return sum(exact_match(texts, [max(w) for w in words])) / len(words)

    def warm_up(self, model, target_accuracy: float = 0.15, max_steps: int = 600, log=print) -> int:
        """Supervised steps on (prompt, answer) pairs until held-out accuracy first reaches target_accuracy."""
        tok = self.tokenizer
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        generator = random.Random(self.seed + 1)
        model.train()
        for step in range(1, max_steps + 1):
            words = generator.sample(self.train, 64)
            sequences = [tok(f"{w}>{max(w)}")["input_ids"] + [tok.eos_token_id] for w in words]
            ids = torch.tensor(sequences)
            labels = ids.clone()
            labels[:, : LENGTH + 1] = -100  # learn the answer, not the prompt
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 5 and self.accuracy(model) >= target_accuracy:
                return step
        return max_steps


RESULTS_FILE = "demo_results.json"  # the held-out accuracy before and after GRPO, read by `grpokit report`


def demo_config(output_dir: str, max_steps: int, seed: int, disable_tqdm: bool, **overrides) -> dict:
    """The demo's GRPOConfig values; `overrides` (the command line's flags) win."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": 64,
        "num_generations": 8,
        "max_completion_length": 3,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "max_steps": max_steps,
        "logging_steps": 10,
        "save_steps": 50,
        "save_total_limit": 2,
        "beta": 0.0,
        "temperature": 1.0,
        "seed": seed,
        "disable_tqdm": disable_tqdm,
        "report_to": "none",
        "reward_weights": [0.2, 1.0],
        **overrides,
    }


def warm_up_and_measure(task: DemoTask, model, warmup_target: float) -> tuple[int, float]:
    """The supervised warm-up, announced; returns (its steps, held-out accuracy after it)."""
    print(
        f"grpokit demo: name the last of {LENGTH} letters in alphabetical order ('cfad>' -> 'f') with a "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter model, built offline."
    )
    print(
        f"Supervised warm-up (the tiny model starts from random weights; real GRPO starts from a pretrained model) "
        f"until held-out accuracy >= {warmup_target:.0%} ..."
    )
    warm_steps = task.warm_up(model, target_accuracy=warmup_target)
    before = task.accuracy(model)
    print(f"  {warm_steps} warm-up steps. Held-out accuracy before GRPO: {before:.1%}")
    return warm_steps, before


def announce_rewards(reward_weights: list[float]) -> None:
    weights = dict(zip(("answer_format", "exact_match"), reward_weights))
    print(
        f"GRPO: reward = {weights['answer_format']} x answer_format (a single letter) + {weights['exact_match']} x "
        f"exact_match (the right letter), {sum(weights.values()):g} at best; the log's `reward` is that weighted "
        f"sum, rewards/<name>/mean each function alone."
    )


def write_results(output_dir: str, task: DemoTask, results: dict) -> Path:
    """demo_results.json in the run's folder: the held-out accuracies, what they measure, and the steps."""
    path = Path(output_dir) / RESULTS_FILE
    measure = f"exact match under greedy decoding on {len(task.heldout)} held-out prompts never seen in training"
    path.write_text(json.dumps({"heldout_accuracy_measures": measure, **results}, indent=1) + "\n")
    return path


def run_demo(
    output_dir: str = "grpo-demo",
    max_steps: int = 300,
    seed: int = 0,
    warmup_target: float = 0.1,
    disable_tqdm: bool = False,
    hidden_size: int = 64,
    before_warm_up: Callable[[GRPOConfig], None] | None = None,
    **overrides,
) -> dict:
    """Warm up, measure, train with GRPO, measure again; returns the accuracies and paths, and writes the
    accuracies to output_dir/demo_results.json. `before_warm_up` is given the run's GRPOConfig before anything
    runs (the command line checks the packages and the output_dir it needs)."""
    from ..trainer import GRPOTrainer

    started = time.perf_counter()
    args = GRPOConfig(**demo_config(output_dir, max_steps, seed, disable_tqdm, **overrides))
    if before_warm_up is not None:
        before_warm_up(args)
    torch.manual_seed(seed)
    task = DemoTask(seed=seed)
    model = task.build_model(hidden_size)
    warm_steps, before = warm_up_and_measure(task, model, warmup_target)
    announce_rewards(args.reward_weights)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[answer_format, exact_match],
        args=args,
        train_dataset=task.dataset(),
        processing_class=task.tokenizer,
    )
    trainer.train()
    after = task.accuracy(trainer.unwrapped_model)
    trainer.save_model(output_dir)
    elapsed = time.perf_counter() - started
    steps = trainer.state.global_step
    results = {"accuracy_before": before, "accuracy_after": after, "warmup_steps": warm_steps, "grpo_steps": steps}
    write_results(output_dir, task, results)
    out = Path(output_dir).resolve()
    print(
        f"Held-out accuracy: {before:.1%} before GRPO -> {after:.1%} after {steps} GRPO steps ({elapsed:.0f} s in all)."
    )
    print(
        f"Model and tokenizer saved to {out}; metrics in {out / 'metrics.jsonl'}, accuracies in {out / RESULTS_FILE}."
    )
    return {**results, "output_dir": output_dir, "seconds": elapsed, "log_history": trainer.state.log_history}
