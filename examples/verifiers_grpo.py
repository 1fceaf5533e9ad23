"""GRPO on a classic verifiers environment, as it is: `GRPOTrainer(model, args=..., environment=vf_env)`.

The environment supplies the prompts (its dataset, system prompt and few-shot examples), plays its own turns (here
a reply asking for the answer again) and scores the rollouts with its rubric (two weighted functions).
Needs verifiers 0.3: pip install "grpokit[verifiers]".

    python examples/verifiers_grpo.py            # Qwen/Qwen2.5-0.5B-Instruct (downloads it)
    python examples/verifiers_grpo.py --tiny     # a tiny random-weight model with Qwen2.5's template, offline
"""

import argparse

import verifiers as vf
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer


class AskTwice(vf.MultiTurnEnv):
    """The model answers; the environment asks it to say the answer again; the model answers again."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=2, **kwargs)

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Say your answer again, the number alone."}]


def correct(completion, answer) -> float:
    """The last answer is the sum."""
    return float(completion[-1]["content"].strip() == answer)


async def answered_twice(completion, answer) -> float:
    """Both answers hold the sum (async: the rubric runs it for all rollouts concurrently)."""
    answers = [m["content"] for m in completion if m["role"] == "assistant"]
    return float(len(answers) == 2 and all(answer in a for a in answers))


def environment() -> AskTwice:
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10) for b in range(10)]
    rubric = vf.Rubric(funcs=[correct, answered_twice], weights=[1.0, 0.5])
    return AskTwice(dataset=Dataset.from_list(rows), system_prompt="Answer with a number.", rubric=rubric)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model (CPU-friendly; it will not learn).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen2.5-0.5B-GRPO-verifiers; with --tiny, a folder in the temporary directory.",
    )
    options = parser.parse_args()
    model, tokenizer = "Qwen/Qwen2.5-0.5B-Instruct", None
    output_dir = options.output_dir or "Qwen2.5-0.5B-GRPO-verifiers"
    args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=256, logging_steps=10)
    if options.tiny:
        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("What", "Answer", "number", "again"))
        model = build_tiny_model(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        output_dir = options.output_dir or tiny_output_dir("verifiers_grpo")
        args = GRPOConfig(
            output_dir=output_dir,
            max_steps=options.max_steps if options.max_steps > 0 else 2,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=32,
            logging_steps=1,
            save_strategy="no",
        )
    trainer = GRPOTrainer(model=model, args=args, processing_class=tokenizer, environment=environment())
    trainer.train()
    from grpokit.report import reward_trend

    print(f"{reward_trend(trainer.state.log_history)}; output in {args.output_dir}")


if __name__ == "__main__":
    main()
