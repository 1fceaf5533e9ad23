"""router_aux_loss_coef (the MoE load-balancing loss from the training forward's router logits) and
cast_lm_head_to_fp32 (TRL 1.16)."""

import pytest
import torch
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.testing import build_char_tokenizer

LETTERS = "abcd"


def tiny_qwen3_moe(vocab_size):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        router_aux_loss_coef=0.001,
        max_position_embeddings=128,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config)


def constant(completions, **kwargs):  # no advantage anywhere: the aux loss is the only gradient
    return [1.0] * len(completions)


def one_step(tmp_path, coef):
    tokenizer = build_char_tokenizer(LETTERS + ":")
    model = tiny_qwen3_moe(len(tokenizer))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = GRPOConfig(
        output_dir=str(tmp_path / str(coef)),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=3,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        router_aux_loss_coef=coef,
        max_grad_norm=0.0,
        report_to="none",
    )
    data = Dataset.from_list([{"prompt": f"{c}:"} for c in LETTERS])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=constant,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        optimizers=(optimizer, schedule),
    )
    gates = {k: v.detach().clone() for k, v in model.named_parameters() if k.endswith("mlp.gate.weight")}
    trainer.train()
    moved = {k: (dict(model.named_parameters())[k].detach() - v).abs().max().item() for k, v in gates.items()}
    return trainer, moved


def test_the_load_balancing_loss_reaches_the_router(tmp_path):
    trainer, moved = one_step(tmp_path, 0.5)
    record = trainer.state.log_history[0]
    assert record["aux_loss"] >= 2.0 - 1e-6  # E·Σ f·P >= k (= 2), equality only for uniform routing
    assert len(moved) == 2 and all(change > 0 for change in moved.values()), moved


def test_no_load_balancing_loss_with_a_zero_coefficient(tmp_path):
    trainer, moved = one_step(tmp_path, 0.0)
    assert "aux_loss" not in trainer.state.log_history[0]
    assert all(change == 0 for change in moved.values()), moved


def test_the_coefficient_defaults_to_the_model_configs_and_refuses_dense_models(tmp_path):
    from grpokit.build import router_aux_loss_coef
    from grpokit.testing import build_tiny_model

    assert router_aux_loss_coef(GRPOConfig(report_to="none"), tiny_qwen3_moe(16)) == 0.001
    assert router_aux_loss_coef(GRPOConfig(report_to="none"), build_tiny_model(16)) == 0.0
    with pytest.raises(ValueError, match="mixture-of-experts"):
        router_aux_loss_coef(GRPOConfig(report_to="none", router_aux_loss_coef=0.01), build_tiny_model(16))


# ---------------------------------------------------------------------------------------- cast_lm_head_to_fp32


def test_fp32_head_computes_the_head_in_float32_under_bf16_autocast_on_both_paths():
    """The expected values: the decoder under bf16 autocast (as training runs it), then the head in float32 by
    hand. With cast_lm_head_to_fp32 both head paths give them; without it the head rounds in bf16."""
    from grpokit import token_logprobs
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(4000, hidden_size=64, seed=1)  # a vocabulary large enough for bf16 logits to round
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4000, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model.model(input_ids=ids).last_hidden_state[:, -7:-1]
        logits = hidden.float() @ model.lm_head.weight.float().T
        expected = logits.log_softmax(-1).gather(-1, ids[:, -6:, None]).squeeze(-1)
        errors = {}
        for chunked in (False, True):
            for fp32_head in (False, True):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    values, _ = token_logprobs(model, ids, mask, 6, chunked=chunked, fp32_head=fp32_head)
                errors[chunked, fp32_head] = (values.float() - expected).abs().max().item()
    for chunked in (False, True):
        assert errors[chunked, True] < 1e-4 < errors[chunked, False], errors


@pytest.mark.parametrize("tied", [True, False])
def test_cast_lm_head_to_fp32_holds_and_trains_the_head_in_float32_as_trl(tmp_path, tied):
    """TRL casts the head's weight to float32 (TRL's test_train_with_cast_lm_head_to_fp32 checks its dtype after
    training); a tied embedding shares it and still hands the decoder bfloat16 activations."""
    from grpokit.testing import build_tiny_model

    tokenizer = build_char_tokenizer(LETTERS + ":")
    model = build_tiny_model(len(tokenizer), hidden_size=32, tie_word_embeddings=tied, seed=0).to(torch.bfloat16)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=3,
        learning_rate=0.1,
        max_steps=2,
        bf16=False,
        cast_lm_head_to_fp32=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"prompt": f"{c}:"} for c in LETTERS])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(ord(c[0])) if c else 0.0 for c in completions],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    head = trainer.model.lm_head.weight
    assert head.dtype == torch.float32
    assert (trainer.model.model.embed_tokens.weight is head) == tied
    assert trainer.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert trainer.model.model.embed_tokens(torch.tensor([[3, 4]])).dtype == torch.bfloat16
    before = head.detach().clone()
    trainer.train()
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert not torch.equal(before, trainer.model.lm_head.weight)
