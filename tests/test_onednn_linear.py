"""float32 linear layers through oneDNN on AMD CPUs with AVX-512 (grpokit/onednn_linear.py), against torch's own
F.linear (MKL) and the float64 product."""

import pytest
import torch
from letters import letter_trainer, tiny_letter_model

from grpokit import onednn_linear
from grpokit.onednn_linear import MIN_MACS, OnednnLinear, onednn_linear_forward, onednn_linears, takes_onednn
from grpokit.testing import build_tiny_model

EPS = torch.finfo(torch.float32).eps / 2  # float32's unit roundoff


def body_linears(model):
    """The model's nn.Linear layers other than its LM head: the ones `onednn_linears` routes."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.get_output_embeddings()]


def inputs(rows=96, features_in=256, features_out=320, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, features_in, generator=g).requires_grad_()
    weight = (torch.randn(features_out, features_in, generator=g) / 16).requires_grad_()
    b = (torch.randn(features_out, generator=g) / 4).requires_grad_() if bias else None
    grad_out = torch.randn(2, rows // 2, features_out, generator=g)
    return x, weight, b, grad_out


def grads(fn, x, weight, bias, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    out = fn(*leaves, *([None] if bias is None else []))
    out.backward(grad_out)
    return out, [t.grad for t in leaves]


def within_rounding_bound(result, exact, magnitude, terms):
    """|result - exact| <= terms * u * magnitude elementwise: the bound of any order of a float32 sum of `terms`
    products (Higham's gamma_n, to first order), `magnitude` being the sum of the products' absolute values."""
    return bool(torch.all((result.double() - exact).abs() <= terms * EPS * magnitude + 1e-30))


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_input_gradient_are_float32_products_as_exact_as_mkls(onednn_everywhere, bias):
    x, weight, b, grad_out = inputs(bias=bias)
    out, (grad_x, *_) = grads(OnednnLinear.apply, x, weight, b, grad_out)
    mkl_out, (mkl_grad_x, *_) = grads(torch.nn.functional.linear, x, weight, b, grad_out)
    x64, w64, g64 = x.detach().double(), weight.detach().double(), grad_out.double()
    exact = x64 @ w64.T + (b.detach().double() if bias else 0)
    exact_grad_x = g64 @ w64
    # every element within the rounding bound of a 256-term (+ bias) float32 sum, as MKL's are
    assert within_rounding_bound(out, exact, x64.abs() @ w64.abs().T + (b.detach().double().abs() if bias else 0), 257)
    assert within_rounding_bound(grad_x, exact_grad_x, g64.abs() @ w64.abs(), 320)
    assert within_rounding_bound(
        mkl_out, exact, x64.abs() @ w64.abs().T + (b.detach().double().abs() if bias else 0), 257
    )
    # and, over the tensor, about as far from the float64 product as MKL's result
    for ours, mkl, truth in ((out, mkl_out, exact), (grad_x, mkl_grad_x, exact_grad_x)):
        ours_error = (ours.double() - truth).abs().mean()
        mkl_error = (mkl.double() - truth).abs().mean()
        assert ours_error <= 1.5 * mkl_error, (ours_error, mkl_error)


@pytest.mark.parametrize("bias", [True, False])
def test_weight_and_bias_gradients_are_torchs_own(onednn_everywhere, bias):
    # the weight's and the bias's gradients are F.linear's backward's: bitwise, given the same inputs
    x, weight, b, grad_out = inputs(bias=bias)
    _, (_, grad_w, *grad_b) = grads(OnednnLinear.apply, x, weight, b, grad_out)
    _, (_, mkl_grad_w, *mkl_grad_b) = grads(torch.nn.functional.linear, x, weight, b, grad_out)
    assert torch.equal(grad_w, mkl_grad_w)
    assert all(torch.equal(ours, mkl) for ours, mkl in zip(grad_b, mkl_grad_b, strict=True))


def test_a_non_contiguous_output_gradient_gives_the_same_input_gradient(onednn_everywhere):
    x, weight, b, grad_out = inputs()
    strided = grad_out.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not strided.is_contiguous() and torch.equal(strided, grad_out)
    assert torch.equal(
        grads(OnednnLinear.apply, x, weight, b, strided)[1][0], grads(OnednnLinear.apply, x, weight, b, grad_out)[1][0]
    )


def test_which_calls_take_onednn(monkeypatch):
    monkeypatch.setattr(onednn_linear, "MIN_MACS", MIN_MACS)
    weight = torch.zeros(256, 256)
    rows = MIN_MACS // (256 * 256)
    assert takes_onednn(torch.zeros(rows, 256), weight, None)
    assert not takes_onednn(torch.zeros(rows - 1, 256), weight, None)  # below the size floor: MKL
    assert takes_onednn(torch.zeros(2, rows // 2, 256), weight, torch.zeros(256))
    assert not takes_onednn(torch.zeros(rows, 256, dtype=torch.bfloat16), weight.bfloat16(), None)
    assert not takes_onednn(torch.zeros(rows, 256, dtype=torch.float64), weight.double(), None)
    assert not takes_onednn(torch.zeros(rows, 256, device="meta"), weight, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_onednn(torch.zeros(rows, 256), weight, None)
    # below the floor a routed layer is F.linear itself, bitwise
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(rows - 1, 256)
    assert torch.equal(onednn_linear_forward(layer, x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_the_setting_is_checked(monkeypatch):
    onednn_linear.onednn_is_faster.cache_clear()
    monkeypatch.setenv(onednn_linear.ENV, "yes")
    with pytest.raises(ValueError, match="GRPOKIT_ONEDNN_LINEARS='yes': set it to 0"):
        onednn_linear.onednn_is_faster()
    monkeypatch.setenv(onednn_linear.ENV, "0")
    onednn_linear.onednn_is_faster.cache_clear()
    assert not onednn_linear.onednn_is_faster()
    assert onednn_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), "cpu") == 0
    onednn_linear.onednn_is_faster.cache_clear()


def test_a_routed_model_samples_through_packed_layers_and_gets_its_route_back(onednn_everywhere):
    # the rollout packs the routed layers for its decode (fast.packed_linears) and gives them the route back
    from grpokit.rollout import fast

    model = build_tiny_model(40, hidden_size=32, num_layers=2)
    head = model.get_output_embeddings()
    routed = body_linears(model)
    assert onednn_linears(model, "cpu") == len(routed) == 14
    assert "forward" not in vars(head)
    packable = fast.packable_linears(model, torch.device("cpu")) if fast._can_pack_linears() else None
    if packable is None:
        pytest.skip("this torch has no oneDNN linear packing")
    assert set(map(id, packable)) == set(map(id, [*routed, head]))
    forwards = {id(m): m.forward for m in routed}
    with fast.packed_linears(model, torch.device("cpu")):
        assert all(fast.is_packed(m) for m in routed)
    assert all(onednn_linear.is_onednn_routed(m) and m.forward is forwards[id(m)] for m in routed)
    assert "forward" not in vars(head)


def test_the_trainer_routes_policy_and_reference_and_their_update_is_mkls_to_rounding(
    onednn_everywhere, monkeypatch, tmp_path
):
    # one step of the letter task at hidden size 64, every product of policy and reference through oneDNN, against
    # the same step with GRPOKIT_ONEDNN_LINEARS=0 (MKL): the same sampled tokens (the decode packs both runs' layers
    # alike), the loss and the updated weights equal to float32 rounding, not bitwise
    calls = []
    product = onednn_linear._onednn_linear
    monkeypatch.setattr(onednn_linear, "_onednn_linear", lambda *a: calls.append(1) or product(*a))

    def one_step(name):
        trainer = letter_trainer(
            tmp_path / name, hidden_size=64, max_steps=1, beta=0.04, per_device_train_batch_size=32, optim="sgd"
        )
        trainer.train()
        return trainer

    routed = one_step("onednn")
    for model in (routed.unwrapped_model, routed.reference):
        linears = body_linears(model)
        assert linears and all(onednn_linear.is_onednn_routed(m) for m in linears)
        assert all(m.forward.layer() is m for m in linears)  # the reference's layers route to themselves
    assert len(calls) > 0
    monkeypatch.setenv(onednn_linear.ENV, "0")
    onednn_linear.onednn_is_faster.cache_clear()
    calls.clear()
    plain = one_step("mkl")
    assert calls == []
    assert not any(onednn_linear.is_onednn_routed(m) for m in plain.unwrapped_model.modules())
    (ours,), (theirs,) = ([r for r in t.state.log_history if "loss" in r] for t in (routed, plain))
    assert ours["completions/mean_length"] == theirs["completions/mean_length"]
    assert ours["reward"] == theirs["reward"]  # the same tokens sampled
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-9)
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    # SGD: the update is the gradient times the learning rate, so the weights show the gradients' difference
    weights, plain_weights = routed.unwrapped_model.state_dict(), plain.unwrapped_model.state_dict()
    moved = max((weights[k] - plain_weights[k]).abs().max().item() for k in weights)
    step = max(
        (weights[k] - start).abs().max().item()
        for k, start in tiny_letter_model(hidden_size=64)[0].state_dict().items()
    )
    assert moved < 1e-4 * step  # another summation order: 3.7e-9 apart for a largest step of 1.4e-3 seen here


def test_the_letter_task_learns_through_onednn(onednn_everywhere, tmp_path):
    trainer = letter_trainer(tmp_path, max_steps=30)
    assert all(onednn_linear.is_onednn_routed(m) for m in body_linears(trainer.unwrapped_model))
    trainer.train()
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    assert rewards[0] < 0.1, rewards  # a random policy names the letter ~1 time in 17
    assert sum(rewards[-4:]) / 4 >= 0.2, rewards  # 0.078 -> 0.31 over the last four logs seen (AMD AVX-512)


def test_the_small_benchmark_models_log_probs_move_by_float_rounding(onednn_everywhere, monkeypatch):
    # benchmarks/bench_vs_trl.py's `small` shape (hidden 256, MLP 1024, 4 layers; 64 sequences of 89 tokens), the
    # route at its real size floor: every layer's training call is above it. Seen: max 1.4e-6, mean 2.3e-7 nats.
    import copy

    from grpokit.logprobs import token_logprobs

    monkeypatch.setattr(onednn_linear, "MIN_MACS", MIN_MACS)  # the route whatever this CPU, at its real floor
    model = build_tiny_model(53, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024)
    routed = copy.deepcopy(model)
    assert onednn_linears(routed, "cpu") == 4 * 7
    ids = torch.randint(3, 53, (64, 89), generator=torch.Generator().manual_seed(0))
    calls = []
    product = onednn_linear._onednn_linear
    monkeypatch.setattr(onednn_linear, "_onednn_linear", lambda *a: calls.append(1) or product(*a))
    with torch.no_grad():
        plain, _ = token_logprobs(model, ids, torch.ones_like(ids), 64)
        assert calls == []
        ours, _ = token_logprobs(routed, ids, torch.ones_like(ids), 64)
    assert len(calls) == 4 * 7  # every projection of the four layers, once
    difference = (ours - plain).abs()
    assert difference.max().item() < 1e-5, difference.max()
    assert difference.mean().item() < 1e-6, difference.mean()
