"""TRL 1.16's tool-calling GRPO example with grpokit: only the import changed.

The model may call `multiply` while it answers; each call's result is appended to the conversation (rendered by the
chat template, attended to, never trained on) and generation goes on, up to max_tool_calling_iterations tool turns.

    python examples/tools_grpo.py                  # Qwen/Qwen3-0.6B (downloads it)
    python examples/tools_grpo.py --tiny           # a tiny random-weight model with Qwen2.5's template, offline

Metrics: tools/call_frequency (calls per completion), tools/failure_frequency (failed calls per call), and the same
per tool (tools/multiply/...).
"""

import argparse

from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def accuracy(completions, answer, **kwargs):
    """1 when the final assistant message contains the product."""
    return [float(str(target) in completion[-1]["content"]) for completion, target in zip(completions, answer)]


dataset = Dataset.from_list(
    [{"prompt": [{"role": "user", "content": f"What is {a} multiplied by {b}?"}], "answer": a * b}
     for a in range(3, 13) for b in range(7, 17)]
)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model (CPU-friendly; it will not learn).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument("--output_dir", default=None,
                        help="Default: Qwen3-0.6B-GRPO-tools; with --tiny, a folder in the temporary directory.")
    options = parser.parse_args()
    model, tokenizer = "Qwen/Qwen3-0.6B", None
    output_dir = options.output_dir or "Qwen3-0.6B-GRPO-tools"
    args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=512,
                      max_tool_calling_iterations=4, logging_steps=10)  # fmt: skip
    if options.tiny:
        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("multiply", "integer", "product"))
        model = build_tiny_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=None)  # fmt: skip
        output_dir = options.output_dir or tiny_output_dir("tools_grpo")
        args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps if options.max_steps > 0 else 2,
                          per_device_train_batch_size=8, num_generations=4, max_completion_length=48,
                          max_tool_calling_iterations=2, logging_steps=1, save_strategy="no")  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=args, train_dataset=dataset,
                          processing_class=tokenizer, tools=[multiply])  # fmt: skip
    trainer.train()
    from grpokit.report import reward_trend

    print(f"{reward_trend(trainer.state.log_history)}; output in {args.output_dir}")


if __name__ == "__main__":
    main()
