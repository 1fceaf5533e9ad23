"""grpokit.optim.build_optimizer: each `optim` name builds transformers' optimizer with the config's hyperparameters,
and one real step on a tiny model moves the weights exactly as that optimizer built by hand does."""

import copy
import importlib.util

import pytest
import torch
from transformers.optimization import Adafactor

from grpokit import GRPOConfig, build_optimizer
from grpokit.optim import RowBlockedTorchAdam, decay_parameter_names
from grpokit.testing import build_tiny_model

HYPER = dict(learning_rate=3e-3, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
NORMS_AND_BIASES = {
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.bias",
    "model.layers.0.self_attn.v_proj.bias",
    "model.norm.weight",
}


def tiny():
    return build_tiny_model(16, hidden_size=16, num_layers=1, seed=0)


def config(**values) -> GRPOConfig:
    return GRPOConfig(**{**HYPER, **values})


def train_step(model, optimizer, seed=0):
    """One step on a language-modelling loss: real gradients through every parameter."""
    ids = torch.randint(3, 16, (4, 6), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# name -> (optim_args, the optimizer class, the hyperparameters its param group must hold)
EXPECTED = {
    "adamw_torch": (None, torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "fused": None}),
    "adamw_torch_fused": (None, torch.optim.AdamW, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "fused": True}),
    "adafactor": (None, Adafactor, {"lr": 3e-3, "scale_parameter": False, "relative_step": False}),
    "sgd": ("momentum=0.9,nesterov=true", torch.optim.SGD, {"lr": 3e-3, "momentum": 0.9, "nesterov": True}),
    "adagrad": ("lr_decay=0.01", torch.optim.Adagrad, {"lr": 3e-3, "lr_decay": 0.01}),
    "rmsprop": ("alpha=0.9", torch.optim.RMSprop, {"lr": 3e-3, "alpha": 0.9}),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_name_builds_its_optimizer_with_the_config_hyperparameters(name):
    optim_args, cls, hyper = EXPECTED[name]
    optimizer = build_optimizer(tiny(), config(optim=name, optim_args=optim_args))
    # torch's AdamW with grpokit.optim.RowBlockedTorchAdam's step (torch's own for the fused kernel); others as is
    assert isinstance(optimizer, cls) and type(optimizer).__name__ == cls.__name__
    assert isinstance(optimizer, RowBlockedTorchAdam) == (cls is torch.optim.AdamW)
    (group,) = optimizer.param_groups  # weight_decay=0: one group
    assert {key: group[key] for key in hyper} == hyper
    assert group["weight_decay"] == 0.0


# name -> the optimizer transformers' registry should give, built by hand from the same config
BY_HAND = {
    "adamw_torch": lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    "adamw_torch_fused": lambda p: torch.optim.AdamW(
        p, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0, fused=True
    ),
    "adafactor": lambda p: Adafactor(p, lr=3e-3, scale_parameter=False, relative_step=False, weight_decay=0.0),
    "sgd": lambda p: torch.optim.SGD(p, lr=3e-3, weight_decay=0.0),
}


@pytest.mark.parametrize("name", list(BY_HAND))
def test_a_real_step_moves_the_weights_as_the_optimizer_built_by_hand(name):
    model = tiny()
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, config(optim=name))
    by_hand = BY_HAND[name]([p for p in reference.parameters() if p.requires_grad])
    before = copy.deepcopy(model)
    for seed in range(3):
        train_step(model, optimizer, seed)
        train_step(reference, by_hand, seed)
    assert same_weights(model, reference)
    assert not same_weights(model, before)


def test_default_is_bitwise_grpokits_previous_adamw():
    # grpokit's trainer built torch.optim.AdamW([trainable], lr, betas, eps, weight_decay) before build_optimizer;
    # with optim='adamw_torch' and weight_decay=0 the numbers and the checkpoint layout must not change.
    args = GRPOConfig(optim="adamw_torch", learning_rate=1e-2)
    model = tiny()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters stay out, as before
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, args)
    previous = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    for seed in range(3):
        train_step(model, optimizer, seed)
        train_step(reference, previous, seed)
    assert same_weights(model, reference)
    saved, expected = optimizer.state_dict(), previous.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    assert all(
        torch.equal(saved["state"][i][k], expected["state"][i][k])
        for i in expected["state"]
        for k in expected["state"][i]
    )


def test_decay_parameters_are_transformers_choice():
    model = tiny()
    names = {name for name, _ in model.named_parameters()}
    assert names - decay_parameter_names(model) == NORMS_AND_BIASES


def test_weight_decay_skips_biases_and_norm_weights():
    # With zero gradients AdamW's only change is the decoupled decay p <- p (1 - lr wd): decayed weights shrink by
    # exactly that factor, biases and norm weights stay put.
    model = tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, config(learning_rate=0.1, weight_decay=0.5))
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.5, 0.0]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        factor = 1.0 if name in NORMS_AND_BIASES else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7, msg=name)


def test_bare_parameters_all_decay():
    # Without names nothing tells a bias from a weight: one group, decayed (the caller's choice to pass a model).
    bias = torch.nn.Parameter(torch.ones(3))
    optimizer = build_optimizer([bias], config(learning_rate=0.1, weight_decay=0.5))
    bias.grad = torch.zeros_like(bias)
    optimizer.step()
    torch.testing.assert_close(bias.detach(), torch.full((3,), 0.95))


def test_unknown_optimizer_name_fails_at_config_time():
    with pytest.raises(ValueError, match="optim='adamw_typo' is not an optimizer transformers knows"):
        GRPOConfig(optim="adamw_typo")


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_32bit"])
def test_bitsandbytes_optimizers_without_bitsandbytes_say_what_to_install(name, monkeypatch):
    import transformers.trainer_optimizer

    # Where bitsandbytes is installed, make transformers' registry see it missing.
    monkeypatch.setattr(transformers.trainer_optimizer, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(ImportError, match=rf"optim='{name}' needs a package that is not installed.*bitsandbytes"):
        build_optimizer(tiny(), config(optim=name))


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_adamw_8bit_steps_with_8bit_states_and_32bit_embeddings():
    import bitsandbytes

    model = build_tiny_model(128, hidden_size=64, num_layers=1, seed=0)  # tensors of >= 4096 values get 8-bit states
    before = copy.deepcopy(model)
    optimizer = build_optimizer(model, config(optim="adamw_8bit"))
    assert type(optimizer) is bitsandbytes.optim.AdamW
    (group,) = optimizer.param_groups
    assert (group["lr"], group["betas"], group["eps"]) == (3e-3, (0.8, 0.95), 1e-6)
    ids = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert not same_weights(model, before)
    linear, embedding = model.model.layers[0].mlp.gate_proj.weight, model.model.embed_tokens.weight
    assert linear.numel() >= 4096 and optimizer.state[linear]["state1"].dtype == torch.uint8
    # As transformers' Trainer: embeddings keep 32-bit states.
    assert embedding.numel() >= 4096 and optimizer.state[embedding]["state1"].dtype == torch.float32
