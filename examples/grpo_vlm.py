"""TRL's `grpo_vlm.py` with grpokit: GRPO on a vision-language model, the script unchanged but for its import.

    python examples/grpo_vlm.py                                  # Qwen2.5-VL-3B, LoRA, multimodal-open-r1 (GPU)
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/grpo_vlm.py
    python examples/grpo_vlm.py --tiny                           # a tiny VLM built offline, a colour task (CPU)

The dataset's `image` column holds each row's image; the prompt is a conversation, and the trainer places the image
before the first user text (TRL's `prepare_multimodal_messages`). The checkpoint loads as its vision-language class
with its processor; LoRA adapts the language model (the vision tower stays frozen: `freeze_vision_tower`).
`--tiny` builds a random-weight Gemma 3 and a task where the answer is the colour of a solid image; it ends by
printing where it saved the model and the completions of its last logging step (the prompts as their text).
"""

import argparse
import json
from pathlib import Path

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.rewards import accuracy_reward, think_format_reward

SYSTEM_PROMPT = (
    "A conversation between user and assistant. The user asks a question, and the assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> tags, i.e., <think>\nThis is my "
    "reasoning.\n</think>\nThis is my answer."
)


def make_conversation(example):
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": example["problem"]}]
    return {"prompt": prompt}


def colour_letter(completions, answer, **kwargs):
    """The tiny task's reward: the completion starts with the colour's first letter."""
    return [float(completion[0]["content"][:1] == target[:1]) for completion, target in zip(completions, answer)]


def tiny_setup():
    """A tiny random-weight Gemma 3 with its processor, and solid images whose colour is the answer."""
    from datasets import Dataset

    from grpokit.testing import build_tiny_vlm, solid_image

    model, processor = build_tiny_vlm("gemma3")
    colours = {"red": (220, 20, 20), "blue": (20, 20, 220)}
    question = [{"role": "user", "content": "what colour is the image?"}]
    rows = [{"prompt": question, "image": solid_image(rgb), "answer": name} for name, rgb in colours.items()] * 8
    return model, processor, Dataset.from_list(rows), [colour_letter]


def show_last_completions(output_dir: str) -> None:
    """The completions of the last logging step (completions.jsonl), each prompt as its text, an image as [image]."""
    records = [json.loads(line) for line in (Path(output_dir) / "completions.jsonl").read_text().splitlines()]
    step = records[-1]["step"]
    print(f"Completions at step {step} (every logged step's in {Path(output_dir) / 'completions.jsonl'}):")
    for record in (r for r in records if r["step"] == step):
        prompt = " ".join(part.get("text", "[image]") for message in record["prompt"] for part in message["content"])
        print(f"  {prompt!r} -> {record['completion'][0]['content']!r}  reward {record['reward']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2.5-VL-3B-Instruct")
    parser.add_argument(
        "--output_dir",
        default=None,
        help="Default: Qwen2.5-VL-3B-GRPO; with --tiny, a folder in the temporary directory.",
    )
    parser.add_argument("--tiny", action="store_true", help="A tiny offline VLM and task (CPU-friendly).")
    parser.add_argument("--max_steps", type=int, default=-1)
    options = parser.parse_args(argv)

    if options.tiny:
        from grpokit.testing import tiny_output_dir

        model, processor, dataset, rewards = tiny_setup()
        peft_config = None
        output_dir = options.output_dir or tiny_output_dir("grpo_vlm")
        training_args = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=4,
            learning_rate=1e-3,
            max_steps=options.max_steps if options.max_steps > 0 else 20,
            logging_steps=5,
            save_strategy="no",
            log_completions=True,
            report_to=[],
        )
    else:
        from datasets import load_dataset
        from peft import LoraConfig

        model, processor = options.model, None
        dataset = load_dataset("lmms-lab/multimodal-open-r1-8k-verified", split="train")
        dataset = dataset.map(make_conversation).remove_columns(["problem", "original_question", "original_answer"])
        rewards = [think_format_reward, accuracy_reward]
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        training_args = GRPOConfig(
            output_dir=options.output_dir or "Qwen2.5-VL-3B-GRPO",
            learning_rate=1e-5,
            bf16=True,
            gradient_checkpointing=True,
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=1024,
            logging_steps=1,
            log_completions=True,
            max_steps=options.max_steps,
            model_init_kwargs={"dtype": "bfloat16"},
        )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=dataset,
        processing_class=processor,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model()
    if trainer.accelerator.is_main_process:
        if options.tiny:
            show_last_completions(training_args.output_dir)
        print(f"Model saved to {training_args.output_dir}")
    return trainer


if __name__ == "__main__":
    main()
