"""TRL 1.16's environment GRPO example with grpokit: only the import changed.

Each rollout gets its own `IncrementEnv` (instances are pooled: built once, `reset` for every rollout); its public
methods are the model's tools, and the reward function reads the environments the rollouts used.

    python examples/environment_grpo.py            # Qwen/Qwen3-0.6B (downloads it)
    python examples/environment_grpo.py --tiny     # a tiny random-weight model with Qwen2.5's template, offline
"""

import argparse

from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


class IncrementEnv:
    def reset(self, **kwargs) -> str | None:
        """Called with the dataset row before each rollout; what it returns is appended to the user's message."""
        self.counter = 0
        return f" The counter starts at {self.counter}."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def reward_func(environments, **kwargs):
    """Reward the rollouts that brought their counter to exactly 10."""
    return [float(env.counter == 10) for env in environments]


dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Bring the counter to 10."}]}] * 64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model (CPU-friendly; it will not learn).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--output_dir", default=None,
                        help="Default: Qwen3-0.6B-GRPO-env; with --tiny, a folder in the temporary directory.")
    options = parser.parse_args()
    model, tokenizer = "Qwen/Qwen3-0.6B", None
    output_dir = options.output_dir or "Qwen3-0.6B-GRPO-env"
    args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=512,
                      max_tool_calling_iterations=10, logging_steps=10)  # fmt: skip
    if options.tiny:
        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("increment", "counter", "step"))
        model = build_tiny_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=None)  # fmt: skip
        output_dir = options.output_dir or tiny_output_dir("environment_grpo")
        args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps if options.max_steps > 0 else 2,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=48,
                          max_tool_calling_iterations=2, logging_steps=1, save_strategy="no")  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward_func, args=args, train_dataset=dataset,
                          processing_class=tokenizer, environment_factory=IncrementEnv)  # fmt: skip
    trainer.train()
    from grpokit.report import reward_trend

    print(f"{reward_trend(trainer.state.log_history)}; output in {args.output_dir}")


if __name__ == "__main__":
    main()
