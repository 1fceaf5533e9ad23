"""GRPO on an OpenEnv environment: a number-guessing game written as an openenv `Environment`, served on 127.0.0.1
by openenv's own server, and played over its WebSocket client, one session per rollout.

Each rollout: the game's reset observation joins the prompt; the model answers "guess <digit>"; the game steps and
says "higher", "lower" (reward -0.25) or "Correct!" (reward 1, done); the feedback comes back as a user message and
the model guesses again, up to 3 guesses. Needs openenv-core (`pip install "grpokit[openenv]"`).

    python examples/openenv_grpo.py                 # Qwen/Qwen3-0.6B (downloads it)
    python examples/openenv_grpo.py --tiny          # a tiny random-weight model with Qwen2.5's template, offline
    python examples/openenv_grpo.py --url http://localhost:8000   # the same game served elsewhere (see below)

To serve the game yourself (another machine, a container): `uvicorn openenv_grpo:app --port 8000` from this folder.
"""

import argparse
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.integrations.openenv import OpenEnvEnvironment

INSTRUCTION = "I am thinking of a digit. Reply with: guess <digit>."


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""


class GuessingGame(Environment):
    """The episode's digit is the reset seed's last digit; a wrong guess is told 'higher' or 'lower'."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance: rollouts play in parallel

    def __init__(self):
        super().__init__()
        self.target, self._state = 0, State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback="Your first guess?")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(feedback="Correct!", reward=1.0, done=True)
        return GuessObservation(feedback="higher" if action.guess < self.target else "lower", reward=-0.25)

    @property
    def state(self):
        return self._state


app = create_app(GuessingGame, GuessAction, GuessObservation, max_concurrent_envs=256)  # for `uvicorn` (see above)


def parse_guess(text: str) -> dict | None:
    """The model's turn → the game's action; None (a bad action: the rollout ends) when it is not a guess."""
    match = re.search(r"guess\s*(\d)", text)
    return {"guess": int(match.group(1))} if match else None


def tiny_model():
    from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model

    tokenizer = build_qwen_chat_tokenizer(("guess", "higher", "lower", "Correct!", INSTRUCTION))
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=32,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    return model, tokenizer


def warm_up(model, tokenizer, steps: int = 40, lr: float = 1e-2, seed: int = 0) -> float:
    """A random-weight model first learns the game's format (supervised, on transcripts of 1-3 random guesses with
    random feedback; the loss on its own turns only): GRPO sharpens behaviour the policy already samples, it does
    not invent a format from noise. A pretrained model needs none of this. Returns the last loss."""
    import random

    import torch

    draw = random.Random(seed)
    opening = [{"role": "user", "content": f"{INSTRUCTION}\n\nYour first guess?"}]
    prompt = tokenizer.apply_chat_template(opening, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]

    def pieces(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        transcripts = []
        for _ in range(16):
            ids, labels = list(prompt), [-100] * len(prompt)  # -100: no loss (the prompt, the game's feedback)
            for turn in range(draw.randrange(1, 4)):
                if turn:
                    feedback = pieces(
                        f"\n<|im_start|>user\n{draw.choice(['higher', 'lower'])}<|im_end|>\n<|im_start|>assistant\n"
                    )
                    ids, labels = ids + feedback, labels + [-100] * len(feedback)
                guess = pieces(f"guess {draw.randrange(10)}<|im_end|>")
                ids, labels = ids + guess, labels + guess
            transcripts.append((ids, labels))
        width = max(len(ids) for ids, _ in transcripts)
        batch = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in transcripts])
        targets = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in transcripts])
        loss = model(input_ids=batch, labels=targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def environment(url: str | None = None, seeds=range(64), rewards: str = "sum") -> OpenEnvEnvironment:
    """The game, served here on 127.0.0.1 (or reached at url), with the options this example trains with."""
    options = dict(
        prompt=INSTRUCTION,
        seeds=seeds,
        parse_action=parse_guess,
        rewards=rewards,
        max_turns=3,
        invalid_action_reward=-1.0,
    )
    if url is not None:
        return OpenEnvEnvironment(url, action_class=GuessAction, **options)
    return OpenEnvEnvironment.serve(GuessingGame, GuessAction, GuessObservation, **options)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="A tiny offline model, first warmed up on the game's format (CPU-friendly)."
    )
    parser.add_argument("--url", default=None, help="An OpenEnv server of the game (default: serve it here).")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen3-0.6B-GRPO-openenv; with --tiny, a folder in the temporary directory.",
    )
    options = parser.parse_args()
    model, tokenizer = "Qwen/Qwen3-0.6B", None
    args = GRPOConfig(
        output_dir=options.output_dir or "Qwen3-0.6B-GRPO-openenv",
        max_steps=options.max_steps,
        max_completion_length=256,
        chat_template_kwargs={"enable_thinking": False},
        logging_steps=10,
    )
    if options.tiny:
        from grpokit.testing import tiny_output_dir

        model, tokenizer = tiny_model()
        warm_up(model, tokenizer)
        args = GRPOConfig(
            output_dir=options.output_dir or tiny_output_dir("openenv_grpo"),
            max_steps=min(options.max_steps, 2),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=48,
            logging_steps=1,
            save_strategy="no",
        )
    with environment(options.url) as game:
        trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, environment=game)
        trainer.train()
    from grpokit.report import reward_trend

    print(f"{reward_trend(trainer.state.log_history)}; output in {args.output_dir}")


if __name__ == "__main__":
    main()
