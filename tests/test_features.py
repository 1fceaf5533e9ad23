"""What the seed documents ask beyond plain GRPO: LoRA, reward models, routing, process rewards, token models."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from letters import LETTERS, letter_config, letter_dataset, repeat_letter

from grpokit import GRPOTrainer, process_advantages
from grpokit.rewards.process import process_reward, soft_overlong_punishment, split_steps, step_token_ends
from grpokit.testing import build_char_tokenizer, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":\n", hidden_size=64))


def config(tmp_path, **overrides):
    return letter_config(tmp_path, **{"per_device_train_batch_size": 32, "max_steps": 3, **overrides})


# ---------------------------------------------------------------------------------------------------- LoRA


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def test_lora_trains_the_adapter_only_and_reloads(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path, beta=0.04, save_merged=True),
        peft_config=lora_config(),
    )
    assert trainer.reference is None  # no second copy of the weights: the reference is the adapter switched off
    model = trainer.unwrapped_model
    base_before = {k: v.clone() for k, v in model.named_parameters() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in model.named_parameters() if "lora_" in k}
    trainer.train()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # base weights bit-identical
    assert any(not torch.equal(after[k], v) for k, v in lora_before.items())  # adapter moved
    assert trainer.state.log_history[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # adapter-off = policy at start
    assert trainer.state.log_history[-2]["kl"] > 0

    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    ids = torch.tensor([[10, 11, 12]])
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "merged")
    torch.testing.assert_close(merged(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


def test_lora_with_a_peft_model_and_resume(model_dir, tmp_path):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    def make():
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator
        return get_peft_model(base, lora_config())

    args = dict(max_steps=4, save_strategy="steps", save_steps=2, beta=0.04)
    full = GRPOTrainer(
        model=make(), reward_funcs=repeat_letter, train_dataset=letter_dataset(), args=config(tmp_path / "a", **args)
    )
    full.train()
    first = GRPOTrainer(
        model=make(),
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "b", **{**args, "max_steps": 2}),
    )
    first.train()
    resumed = GRPOTrainer(
        model=make(), reward_funcs=repeat_letter, train_dataset=letter_dataset(), args=config(tmp_path / "b", **args)
    )
    resumed.train(resume_from_checkpoint=True)
    a, b = dict(full.unwrapped_model.named_parameters()), dict(resumed.unwrapped_model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_refuses_reference_sync(model_dir, tmp_path):
    with pytest.raises(ValueError, match="sync_ref_model with LoRA"):
        GRPOTrainer(
            model=model_dir,
            reward_funcs=repeat_letter,
            train_dataset=letter_dataset(),
            args=config(tmp_path, beta=0.04, sync_ref_model=True),
            peft_config=lora_config(),
        )


# ---------------------------------------------------------------------------------------------- reward models


def letter_loving_reward_model(tokenizer, letter: str):
    """A real sequence classifier with no transformer blocks: its score is the normalised embedding of the last
    token dotted with the normalised embedding of `letter` — highest when the text ends with that letter."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        direction = model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(letter)]
        model.score.weight.copy_((direction / direction.pow(2).mean().sqrt())[None] / config.hidden_size)
    return model


def test_reward_model_drives_learning(model_dir, tmp_path):
    tokenizer = build_char_tokenizer(LETTERS + ":\n")
    reward_model = letter_loving_reward_model(tokenizer, "c")
    reward_model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=str(tmp_path / "rm"),
        train_dataset=letter_dataset(),
        args=config(tmp_path, max_steps=40, max_completion_length=1, logging_steps=5),
    )
    trainer.train()
    name = "rewards/rm/mean"
    history = trainer.state.log_history[:-1]
    assert history[0][name] < 0.4 < history[-1][name], [h[name] for h in history]
    # The score is the reward model's logit: check one by hand.
    scores = trainer.reward_functions[0].fn(["a:"], ["c"])
    assert scores[0] == pytest.approx(1.0, abs=2e-3)  # 1 up to RMSNorm's epsilon


def test_reward_model_uses_its_chat_template_for_conversations(tmp_path):
    from grpokit.rewards.model import RewardModel

    tokenizer = build_char_tokenizer(LETTERS + ":\n")
    reward = RewardModel(letter_loving_reward_model(tokenizer, "c"), tokenizer)
    prompt = [{"role": "user", "content": "a:"}]
    text = reward.render(prompt, [{"role": "assistant", "content": "c"}])
    assert text == "<|user|>a:<|end|><|assistant|>c<|end|>"
    assert reward.render("a:", "c") == "a:c"


# ------------------------------------------------------------------------------------------------ routing


def test_routed_rewards_apply_only_to_their_rows(model_dir, tmp_path):
    seen = {"vowel": [], "consonant": []}

    def vowel(prompts, completions, **kwargs):
        seen["vowel"].extend(prompts)
        return [1.0] * len(completions)

    def consonant(prompts, completions, **kwargs):
        seen["consonant"].extend(prompts)
        return [0.5] * len(completions)

    rows = [{"prompt": f"{c}:", "reward_funcs": ["vowel"] if c in "ae" else ["consonant"]} for c in LETTERS]
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[vowel, consonant],
        train_dataset=Dataset.from_list(rows),
        args=config(tmp_path, max_steps=1, per_device_train_batch_size=64),
    )
    trainer.train()
    assert set(seen["vowel"]) == {"a:", "e:"} and set(seen["consonant"]) == {f"{c}:" for c in "bcdfgh"}
    record = trainer.state.log_history[0]
    assert record["rewards/vowel/mean"] == 1.0 and record["rewards/consonant/mean"] == 0.5
    assert record["reward"] == pytest.approx((2 * 1.0 + 6 * 0.5) / 8)  # each row scored by its own function


def test_routing_names_an_unknown_function(model_dir, tmp_path):
    def anything(completions, **kwargs):
        return [0.0] * len(completions)

    rows = [{"prompt": "a:", "reward_funcs": ["nope"]}] * 8
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=anything,
        train_dataset=Dataset.from_list(rows),
        args=config(tmp_path, max_steps=1),
    )
    with pytest.raises(ValueError, match="nope"):
        trainer.train()


# --------------------------------------------------------------------------------------------- process rewards


def test_steps_map_to_token_positions():
    tokenizer = build_char_tokenizer(LETTERS + ":\n")
    ids = tokenizer("ab\ncd\ne")["input_ids"]
    assert split_steps("ab\ncd\ne") == ["ab\n", "cd\n", "e"]
    assert step_token_ends(ids, tokenizer, "\n") == [3, 6, 7]
    assert step_token_ends(tokenizer("ab\n")["input_ids"], tokenizer, "\n") == [3]
    assert step_token_ends([5, 9, 5, 7], None, 9) == [2, 4]  # token models: the separator is a token id


def test_process_rewards_give_hand_computed_token_advantages(model_dir, tmp_path):
    @process_reward
    def per_step(completions, **kwargs):
        # one reward per step: 1 for a step that starts with 'a', else 0
        return [[float(step.startswith("a")) for step in split_steps(c)] for c in completions]

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=per_step,
        train_dataset=letter_dataset(),
        args=config(tmp_path, max_steps=1, max_completion_length=6, temperature=2.0),
    )
    batch = trainer.generate_batch()
    tokenizer = trainer.processing_class
    # Undo the shuffle to regroup the completions by prompt, then recompute the advantages by hand.
    order = torch.randperm(32, generator=torch.Generator().manual_seed(trainer.args.seed + trainer.state.rollouts))
    ids = torch.empty_like(batch.completion_ids)
    ids[order], mask = batch.completion_ids, torch.empty_like(batch.attention_mask)
    mask[order] = batch.attention_mask
    advantages = torch.empty_like(batch.advantages)
    advantages[order] = batch.advantages
    completions = [ids[i][mask[i].bool()].tolist() for i in range(32)]
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    step_rewards = [[float(s.startswith("a")) for s in split_steps(t)] for t in texts]
    ends = [step_token_ends(c, tokenizer, "\n") for c in completions]
    expected = process_advantages(step_rewards, ends, 8, advantages.shape[1])
    assert advantages.shape == (32, ids.shape[1])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)
    assert expected.abs().sum() > 0


def test_soft_overlong_punishment():
    reward = soft_overlong_punishment(max_completion_length=10, buffer_length=4)
    # 0 up to 6 tokens, then (6 - len) / 4: 7 -> -0.25, 8 -> -0.5, 10 -> -1
    assert reward([[1] * 5, [1] * 6, [1] * 7, [1] * 8, [1] * 10]) == [0.0, 0.0, -0.25, -0.5, -1.0]


# ------------------------------------------------------------------------------------------- any token model


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_plain_module_without_tokenizer_learns_to_draw(tmp_path):
    example = load_example("ar_image_grpo")
    checker = example.target_image(example.CHECKER)
    inverted = [1 - p for p in checker]
    assert example.pattern_reward([checker, inverted, [0] * 64], [example.CHECKER] * 3) == [1.0, 0.0, 0.5]
    trainer = example.train(
        steps=15,
        output_dir=str(tmp_path / "out"),
        disable_tqdm=True,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        logging_steps=3,
    )
    rewards = [h["reward"] for h in trainer.state.log_history[:-1]]
    assert trainer.processing_class is None and trainer.state.global_step == 15
    # A random model spends ~3/5 of its tokens on non-pixels (~0.2); it learns to draw pixels, then to match the
    # pattern better than a random 0/1 image (0.5).
    assert rewards[0] < 0.3 and sum(rewards[-3:]) / 3 > 0.52, rewards


# ---------------------------------------------------------------------------------------------- DAPO extras


def test_dynamic_sampling_fills_the_batch_with_varied_groups(model_dir, tmp_path):
    # Prompts 'a:'..'d:' always score 1, 'e:'..'h:' score by chance: the constant groups must be dropped.
    def half_constant(completions, letter, **kwargs):
        return [
            1.0 if target in "abcd" else float(c[:1] == target) + 0.01 * len(c)
            for c, target in zip(completions, letter)
        ]

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=half_constant,
        train_dataset=letter_dataset(),
        args=config(tmp_path, dynamic_sampling=True, max_resample_rounds=8, max_completion_length=4),
    )
    batch = trainer.generate_batch()
    assert len(batch) == 32  # full
    # Every kept completion comes from a varied group: none of the constant prompts remain.
    prompts = trainer.processing_class.batch_decode(batch.prompt_ids, skip_special_tokens=True)
    assert all(p[0] in "efgh" for p in prompts), prompts
    assert trainer.window.flush()["dynamic_sampling/rounds"] >= 1
    # Each group's advantages have spread (none all-zero)
    assert (batch.advantages[:, 0] != 0).float().mean() > 0.5
