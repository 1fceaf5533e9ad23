"""GRPO on an agent written with the OpenAI SDK, trained as it is: grpokit serves the policy on 127.0.0.1 as an
OpenAI-compatible endpoint, runs the agent once per completion against its own base URL, and trains on the tokens
the policy sampled there (docs/guides/agent-endpoint.md).

    python examples/agent_endpoint_grpo.py             # Qwen/Qwen3-0.6B (downloads it)
    python examples/agent_endpoint_grpo.py --tiny      # offline, on CPU: a scripted policy plays

The agent is ordinary OpenAI-SDK code: it offers a `multiply` tool, runs the calls the model makes, sends the
results back, and returns its own reward (1 when the final answer holds the product). Metrics: endpoint/
calls_per_rollout, endpoint/timeout_frequency, endpoint/error_frequency, endpoint/prefix_break_frequency.

`--tiny` trains a tiny random-weight model with Qwen2.5's chat template. Such a model never writes a tool call, so
a scripted policy (grpokit's `ScriptedEngine`, passed as `rollout_engine=`) writes the turns the endpoint serves:
it calls `multiply` in about half of the rollouts and answers with the result, and guesses in the others. The
endpoint, the agent, its rewards and the updates are the real ones; the script does not learn, so the reward stays
near 0.5.
"""

import argparse
import json

import openai
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.integrations.openai_agent import OpenAIAgentEnvironment

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiplies two integers.",
        "parameters": {
            "type": "object",
            "required": ["a", "b"],
            "properties": {
                "a": {"type": "integer", "description": "The first integer."},
                "b": {"type": "integer", "description": "The second integer."},
            },
        },
    },
}


def agent(base_url: str, row: dict) -> float:
    """One episode: up to three model turns, the tool calls run in between; the reward is the agent's to give."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[MULTIPLY])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = str(int(arguments["a"]) * int(arguments["b"]))
            except (ValueError, KeyError, TypeError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return float(str(row["answer"]) in (messages[-1].get("content") or ""))


dataset = Dataset.from_list(
    [
        {
            "prompt": [{"role": "user", "content": f"What is {a} multiplied by {b}?"}],
            "question": f"What is {a} multiplied by {b}?",
            "answer": a * b,
        }
        for a in range(3, 13)
        for b in range(7, 17)
    ]
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model and a scripted policy (CPU).")
    parser.add_argument("--max_steps", type=int, default=-1)
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen3-0.6B-GRPO-agent; with --tiny, a folder in the temporary directory.",
    )
    options = parser.parse_args()
    model, tokenizer, engine = "Qwen/Qwen3-0.6B", None, None
    output_dir = options.output_dir or "Qwen3-0.6B-GRPO-agent"
    args = GRPOConfig(output_dir=output_dir, max_steps=options.max_steps, max_completion_length=512, logging_steps=10)
    if options.tiny:
        from tools_grpo import scripted_policy  # the same task and scripted policy as examples/tools_grpo.py

        from grpokit.testing import build_qwen_chat_tokenizer, build_tiny_model, tiny_output_dir

        tokenizer = build_qwen_chat_tokenizer(("multiply", "integer", "product"))
        model = build_tiny_model(
            len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
        )
        engine = scripted_policy(tokenizer)
        output_dir = options.output_dir or tiny_output_dir("agent_endpoint_grpo")
        args = GRPOConfig(
            output_dir=output_dir,
            max_steps=options.max_steps if options.max_steps > 0 else 10,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=96,
            logging_steps=1,
            save_strategy="no",
        )
    environment = OpenAIAgentEnvironment(agent, dataset, timeout=300)
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, environment=environment, rollout_engine=engine
    )
    trainer.train()
    from grpokit.report import reward_trend

    history = trainer.state.log_history
    calls = [record["endpoint/calls_per_rollout"] for record in history if "endpoint/calls_per_rollout" in record]
    scripted = " (a scripted policy: it does not learn)" if options.tiny else ""
    print(
        f"{reward_trend(history)}{scripted}; {sum(calls) / max(len(calls), 1):.2f} endpoint calls per rollout; "
        f"output in {args.output_dir}"
    )


if __name__ == "__main__":
    main()
