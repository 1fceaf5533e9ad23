"""TRL 1.16's environment GRPO example with grpokit: only the import changed.

Each rollout gets its own `IncrementEnv` (instances are pooled: built once, `reset` for every rollout); its public
methods are the model's tools, and the reward function reads the environments the rollouts used.

    python examples/environment_grpo.py            # Qwen/Qwen3-0.6B (downloads it)
    python examples/environment_grpo.py --tiny     # offline, on CPU: a scripted policy plays

`--tiny` trains a tiny random-weight model with Qwen2.5's chat template. Such a model never writes a tool call, so
a scripted policy (grpokit's `ScriptedEngine`, passed as `rollout_engine=`) writes the turns in its place: it adds
4, 5 or 6 at random, twice, then reports the counter. The environments, the tool loop, the rewards and the updates
are the real ones; the script does not learn, so the reward stays near 1/3 (the chance that two draws make 10).
"""

import argparse
import json
import random
import re

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


def scripted_policy(tokenizer, seed: int = 0):
    """--tiny's stand-in for a model that uses the environment: each turn reads the conversation so far (the prompt
    and the transcript, as token ids) and writes the assistant's next turn."""
    from grpokit.rollout import ScriptedEngine

    draw = random.Random(seed)

    def next_turn(context_ids: list[int], index: int) -> list[int]:
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", tokenizer.decode(context_ids))
        if len(results) < 2:  # call the tool, in Qwen's format
            call = {"name": "increment", "arguments": {"step": draw.choice([4, 5, 6])}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:
            text = f"The counter is at {results[-1]}."
        return tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]

    return ScriptedEngine(next_turn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model and a scripted policy (CPU).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen3-0.6B-GRPO-env; with --tiny, a folder in the temporary directory.",
    )
    options = parser.parse_args()
    model, tokenizer, engine = "Qwen/Qwen3-0.6B", None, None
    output_dir = options.output_dir or "Qwen3-0.6B-GRPO-env"
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=options.max_steps,
        max_completion_length=512,
        max_tool_calling_iterations=10,
        logging_steps=10,
    )
    if options.tiny:
        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("increment", "counter", "step"))
        model = build_tiny_model(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        engine = scripted_policy(tokenizer)
        output_dir = options.output_dir or tiny_output_dir("environment_grpo")
        args = GRPOConfig(
            output_dir=output_dir,
            max_steps=options.max_steps if options.max_steps > 0 else 10,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=128,
            max_tool_calling_iterations=2,
            logging_steps=1,
            save_strategy="no",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=IncrementEnv,
        rollout_engine=engine,
    )
    trainer.train()
    from grpokit.report import reward_trend

    history = trainer.state.log_history
    calls = [record["tools/call_frequency"] for record in history if "tools/call_frequency" in record]
    scripted = " (a scripted policy: it does not learn)" if options.tiny else ""
    print(
        f"{reward_trend(history)}{scripted}; {sum(calls) / max(len(calls), 1):.2f} increment calls per completion; "
        f"output in {args.output_dir}"
    )


if __name__ == "__main__":
    main()
