"""TRL's `train_grpo.py` with grpokit: the same script runs in one process, under torchrun and under accelerate.

    python examples/train_grpo.py                                             # one process
    torchrun --nproc_per_node 8 examples/train_grpo.py                        # DDP on 8 GPUs
    accelerate launch --config_file examples/accelerate/ddp.yaml examples/train_grpo.py
    torchrun --nnodes 2 --node_rank R --nproc_per_node 8 --rdzv-backend c10d \
             --rdzv-endpoint HOST:29500 examples/train_grpo.py                 # 2 nodes x 8 GPUs

Nothing in it depends on the number of processes: `per_device_train_batch_size` counts completions per process
(TRL's semantics), so 8 processes sample 8x as many completions per step as one. `--tiny` trains a tiny model built
offline on a toy task (repeat the prompt's first letter), to try a launcher without a GPU or a download; it logs
every step and ends with the mean reward over the first and the last fifth of them (in one process, measured: ~0.13
over steps 1-12, what a random letter scores, -> ~0.37 over steps 49-60).
"""

import argparse

from grpokit import GRPOConfig, GRPOTrainer


def reward_len(completions, **kwargs):
    """TRL's example reward: completions close to 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def repeat_letter(completions, letter, **kwargs):
    return [1.0 if completion[:1] == target else 0.0 for completion, target in zip(completions, letter)]


def tiny_setup():
    """A tiny random-weight model (the same seed in every process), its tokenizer and a toy dataset."""
    from datasets import Dataset

    from grpokit.testing import build_char_tokenizer, build_tiny_model

    letters = "abcdefgh"
    tokenizer = build_char_tokenizer(letters + ":")
    model = build_tiny_model(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    dataset = Dataset.from_list([{"prompt": f"{a}{b}:", "letter": a} for a in letters for b in letters])
    return model, tokenizer, dataset, repeat_letter


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Qwen/Qwen2-0.5B-Instruct")
    parser.add_argument(
        "--output_dir", default=None, help="Default: Qwen2-0.5B-GRPO; with --tiny, a folder in the temporary directory."
    )
    parser.add_argument("--tiny", action="store_true", help="A tiny offline model and task (CPU-friendly).")
    parser.add_argument("--max_steps", type=int, default=-1)
    options = parser.parse_args()

    if options.tiny:
        from grpokit.testing import tiny_output_dir

        model, tokenizer, dataset, reward = tiny_setup()
        output_dir = options.output_dir or tiny_output_dir("train_grpo")
        training_args = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=32,
            num_generations=8,
            max_completion_length=2,
            learning_rate=2e-3,
            lr_scheduler_type="constant",
            max_steps=options.max_steps if options.max_steps > 0 else 60,
            logging_steps=1,
            save_steps=30,
        )
    else:
        from datasets import load_dataset

        model, tokenizer = options.model, None
        dataset, reward = load_dataset("trl-lib/tldr", split="train"), reward_len
        training_args = GRPOConfig(
            output_dir=options.output_dir or "Qwen2-0.5B-GRPO", logging_steps=10, max_steps=options.max_steps
        )

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=training_args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model()
    if trainer.accelerator.is_main_process:
        from grpokit.report import reward_trend

        print(f"{reward_trend(trainer.state.log_history)}; model saved to {training_args.output_dir}")


if __name__ == "__main__":
    main()
