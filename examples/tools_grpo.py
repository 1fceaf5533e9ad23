"""TRL 1.16's tool-calling GRPO example with grpokit: only the import changed.

The model may call `multiply` while it answers; each call's result is appended to the conversation (rendered by the
chat template, attended to, never trained on) and generation goes on, up to max_tool_calling_iterations tool turns.

    python examples/tools_grpo.py                  # Qwen/Qwen3-0.6B (downloads it)
    python examples/tools_grpo.py --tiny           # offline, on CPU: a scripted policy calls the tool

Metrics: tools/call_frequency (calls per completion), tools/failure_frequency (failed calls per call), and the same
per tool (tools/multiply/...).

`--tiny` trains a tiny random-weight model with Qwen2.5's chat template. Such a model never writes a tool call, so
a scripted policy (grpokit's `ScriptedEngine`, passed as `rollout_engine=`) writes the turns in its place: it calls
`multiply` in about half of the rollouts and answers with the result, and guesses in the others. The tool loop,
the rewards and the updates are the real ones; the script does not learn, so the reward stays near 0.5.
"""

import argparse
import json
import random
import re

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
    [
        {"prompt": [{"role": "user", "content": f"What is {a} multiplied by {b}?"}], "answer": a * b}
        for a in range(3, 13)
        for b in range(7, 17)
    ]
)


def scripted_policy(tokenizer, seed: int = 0):
    """--tiny's stand-in for a model that uses the tool: each turn reads the conversation so far (the prompt and
    the transcript, as token ids) and writes the assistant's next turn."""
    from grpokit.rollout import ScriptedEngine

    draw = random.Random(seed)

    def next_turn(context_ids: list[int], index: int) -> list[int]:
        context = tokenizer.decode(context_ids)
        a, b = re.search(r"What is (\d+) multiplied by (\d+)\?", context).groups()
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
        if results:  # the tool answered: say its result
            text = f"The product is {results[-1]}."
        elif draw.random() < 0.5:  # call the tool, in Qwen's format
            call = {"name": "multiply", "arguments": {"a": int(a), "b": int(b)}}
            text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        else:  # guess
            text = f"About {int(a) * 10}."
        return tokenizer(text + tokenizer.eos_token, add_special_tokens=False)["input_ids"]

    return ScriptedEngine(next_turn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model and a scripted policy (CPU).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen3-0.6B-GRPO-tools; with --tiny, a folder in the temporary directory.",
    )
    options = parser.parse_args()
    model, tokenizer, engine = "Qwen/Qwen3-0.6B", None, None
    output_dir = options.output_dir or "Qwen3-0.6B-GRPO-tools"
    args = GRPOConfig(
        output_dir=output_dir,
        max_steps=options.max_steps,
        max_completion_length=512,
        max_tool_calling_iterations=4,
        logging_steps=10,
    )
    if options.tiny:
        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("multiply", "integer", "product"))
        model = build_tiny_model(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        engine = scripted_policy(tokenizer)
        output_dir = options.output_dir or tiny_output_dir("tools_grpo")
        args = GRPOConfig(
            output_dir=output_dir,
            max_steps=options.max_steps if options.max_steps > 0 else 10,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=96,
            max_tool_calling_iterations=2,
            logging_steps=1,
            save_strategy="no",
        )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=accuracy,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[multiply],
        rollout_engine=engine,
    )
    trainer.train()
    from grpokit.report import reward_trend

    history = trainer.state.log_history
    calls = [record["tools/call_frequency"] for record in history if "tools/call_frequency" in record]
    scripted = " (a scripted policy: it does not learn)" if options.tiny else ""
    print(
        f"{reward_trend(history)}{scripted}; {sum(calls) / max(len(calls), 1):.2f} tool calls per completion; "
        f"output in {args.output_dir}"
    )


if __name__ == "__main__":
    main()
