"""The float32 route for bfloat16 linear layers on CPUs without bfloat16 hardware (grpokit/cpu_matmul.py), against
its naive twin: torch's own bfloat16 kernels (bfloat16 tensors, or float32 ones under bfloat16 autocast)."""

import copy
import importlib.util

import pytest
import torch

from grpokit import cpu_matmul
from grpokit.cpu_matmul import MIN_ROWS, Float32Linear, float32_matmuls, linear_forward
from grpokit.logprobs import chunked_token_logprobs, token_logprobs
from grpokit.onednn_linear import is_onednn_routed
from grpokit.testing import build_tiny_model

ULP = 2.0**-7  # a bfloat16 ulp relative to the value (8 significant bits)


def close_to_one_bf16_ulp(actual: torch.Tensor, expected: torch.Tensor):
    """Equal up to float32 summation order: at most one bfloat16 rounding step apart, and mostly identical."""
    actual, expected = actual.double(), expected.double()
    assert torch.all((actual - expected).abs() <= ULP * expected.abs() + 1e-30), (actual - expected).abs().max()
    assert (actual == expected).double().mean() > 0.9


def linear_inputs(dtype, bias=True, rows=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows // 2, 48, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(40, 48, generator=g) / 7).to(dtype).requires_grad_()
    b = (torch.randn(40, generator=g) / 3).to(dtype).requires_grad_() if bias else None
    grad_out = torch.randn(2, rows // 2, 40, generator=g).to(torch.bfloat16)
    return x, weight, b, grad_out


def forward_backward(fn, x, weight, bias, grad_out, autocast):
    inputs = [t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(*inputs, *([None] if bias is None else []))
    out.backward(grad_out)
    return out, [t.grad for t in inputs]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)])
def test_float32_linear_equals_the_bfloat16_kernels(dtype, autocast, bias):
    x, weight, b, grad_out = linear_inputs(dtype, bias)
    fast, fast_grads = forward_backward(Float32Linear.apply, x, weight, b, grad_out, autocast)
    naive, naive_grads = forward_backward(torch.nn.functional.linear, x, weight, b, grad_out, autocast)
    assert fast.dtype == naive.dtype == torch.bfloat16
    close_to_one_bf16_ulp(fast, naive)
    for fast_grad, naive_grad in zip(fast_grads, naive_grads):
        assert fast_grad.dtype == naive_grad.dtype == dtype
        close_to_one_bf16_ulp(fast_grad, naive_grad)


def test_float32_linear_is_exact_float64_arithmetic_rounded_once():
    """The products of bfloat16 values are exact in float32 and their float32 sum is within float32 rounding of the
    float64 one: the result is the float64 product of the bfloat16-rounded operands, rounded to bfloat16."""
    x, weight, b, _ = linear_inputs(torch.float32)
    with torch.no_grad():
        out = Float32Linear.apply(x, weight, b)
        x16, w16, b16 = (t.to(torch.bfloat16).double() for t in (x, weight, b))
        expected = (x16 @ w16.T + b16).to(torch.bfloat16)
    close_to_one_bf16_ulp(out, expected)


def test_routing_by_rows_dtype_and_device():
    layer = torch.nn.Linear(48, 40).to(torch.bfloat16)
    many, few = torch.randn(MIN_ROWS, 48, dtype=torch.bfloat16), torch.randn(MIN_ROWS - 1, 48, dtype=torch.bfloat16)
    assert type(linear_forward(layer, many).grad_fn).__name__ == "Float32LinearBackward"
    assert type(linear_forward(layer, few).grad_fn).__name__ != "Float32LinearBackward"  # decode steps
    fp32 = torch.nn.Linear(48, 40)
    assert type(linear_forward(fp32, many.float()).grad_fn).__name__ != "Float32LinearBackward"  # no bf16 anywhere
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(linear_forward(fp32, many.float()).grad_fn).__name__ == "Float32LinearBackward"


def test_float32_matmuls_routes_every_linear_and_the_head_apart(monkeypatch):
    model = build_tiny_model(vocab_size=40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: True)  # a CPU with bf16 hardware: untouched
    assert float32_matmuls(model, "cpu") == 0
    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    assert float32_matmuls(model, "cuda") == 0
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert float32_matmuls(model, "cpu") == len(linears) - 1 == 2 * 7
    head = model.get_output_embeddings()
    assert getattr(head, cpu_matmul.FLOAT32_HEAD) is True  # the chunked head's route
    assert head.forward.function is cpu_matmul.head_forward  # the sampler's logits
    reference = copy.deepcopy(model)  # the reference copy routes its own layers, not the policy's
    routed = reference.model.layers[0].mlp.up_proj
    assert routed.forward.layer() is routed


@pytest.mark.parametrize("weights", ["bf16", "fp32_autocast"])
def test_a_routed_model_gives_the_bfloat16_models_logprobs_and_gradients(monkeypatch, weights):
    """A whole model's training forward and backward (several rows per sequence, so the route is taken), against
    the same model on torch's bfloat16 kernels: log-probs and gradients agree to bfloat16 rounding of the layers."""
    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    torch.manual_seed(0)
    naive = build_tiny_model(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    if weights == "bf16":
        naive = naive.to(torch.bfloat16)
    fast = copy.deepcopy(naive)
    assert float32_matmuls(fast, "cpu") == 14
    ids = torch.randint(0, 64, (6, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def run(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights != "bf16"):
            logprobs, _ = token_logprobs(model, ids, mask, 12, 1.0)
        logprobs.float().sum().backward()
        return logprobs.float(), {n: p.grad.float() for n, p in model.named_parameters()}

    fast_logprobs, fast_grads = run(fast)
    naive_logprobs, naive_grads = run(naive)
    assert any(type(n).__name__ == "Float32LinearBackward" for n in walk(fast_logprobs.grad_fn))
    assert not any(type(n).__name__ == "Float32LinearBackward" for n in walk(naive_logprobs.grad_fn))
    # Rounding differences of one bf16 ulp in a layer propagate: a few bf16 ulps of the log-probs' scale.
    torch.testing.assert_close(fast_logprobs, naive_logprobs, rtol=0, atol=0.05)
    assert (fast_logprobs - naive_logprobs).abs().mean() < 5e-3
    for name, grad in naive_grads.items():
        scale = grad.abs().max().item()
        assert (fast_grads[name] - grad).abs().max() <= 0.05 * scale + 1e-6, name


def walk(node, seen=None):
    seen = set() if seen is None else seen
    if node is None or node in seen:
        return
    seen.add(node)
    yield node
    for child, _ in node.next_functions:
        yield from walk(child, seen)


def test_gradient_checkpointing_recomputes_through_the_same_route(monkeypatch):
    """A checkpointed layer re-runs its forward in the backward pass: it must take the float32 route again (the
    saved tensors would not match otherwise), and give the same gradients as without checkpointing."""
    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    torch.manual_seed(0)
    plain = build_tiny_model(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    ).to(torch.bfloat16)
    float32_matmuls(plain, "cpu")
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 64, (6, 24), generator=torch.Generator().manual_seed(1))
    grads = []
    for model in (plain, checkpointed):
        model.train()
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), 12, 1.0)
        logprobs.float().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("bf16", [True, False])
def test_the_trainer_routes_its_policy_and_reference_under_bf16_only(monkeypatch, tmp_path, bf16):
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import save_tiny_model

    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    model_dir = str(save_tiny_model(tmp_path / "tiny", hidden_size=32))
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        beta=0.1,
        bf16=bf16,
        use_cpu=True,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": "ab"}] * 8,
    )
    for model in (trainer.unwrapped_model, trainer.reference):
        routed = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)]
        routed = [m for m in routed if not is_onednn_routed(m)]  # float32's own route (onednn_linear) apart
        assert len(routed) == (14 + 1 if bf16 else 0)  # the layers, and the head for the sampler
        assert all(m.forward.layer() is m for m in routed)  # the reference's layers route to themselves
        assert getattr(model.get_output_embeddings(), cpu_matmul.FLOAT32_HEAD, False) is bf16


def test_a_routed_layer_is_freed_when_dropped_without_the_garbage_collector(monkeypatch):
    # Its forward refers to it weakly: no reference cycle keeps a replaced layer's weights (quantize_linears drops
    # each routed bf16 layer of the int8 reference), and a deep copy's layers route to themselves.
    import copy
    import gc
    import weakref

    from grpokit.quantized import quantize_linears

    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(torch.bfloat16)
    assert cpu_matmul.float32_matmuls(model, "cpu") == 2
    twin = copy.deepcopy(model)
    assert [m.forward.layer() for m in twin] == list(twin)
    x = torch.randn(64, 8, dtype=torch.bfloat16)
    assert torch.equal(twin(x), model(x))
    weights = [weakref.ref(m.weight) for m in model]
    gc.disable()
    try:
        quantize_linears(model)
        assert [w() for w in weights] == [None, None]
    finally:
        gc.enable()


# ------------------------------------------------------------------------------------------------- the LM head


def head_inputs(rows, hidden_size, vocab_size, bias, frozen, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab_size, hidden_size, generator=g) / hidden_size**0.5).to(dtype)
    b = (torch.randn(vocab_size, generator=g) / 3).to(dtype) if bias else None
    targets = torch.randint(vocab_size, (rows,), generator=g)
    # the first and last token, the first of the second vocabulary block
    targets[:3] = torch.tensor([0, vocab_size - 1, min(cpu_matmul.VOCAB_BLOCK, vocab_size - 1)])
    upstream = torch.randn(rows, generator=g)
    return hidden, weight, b, targets, upstream, [not frozen, not frozen and bias]


def head_run(hidden, weight, bias, targets, upstream, trains, temperature, autocast, float32_gemm, float64=False):
    """Log-probs, entropies and the gradients of upstream · log-probs: by `chunked_token_logprobs`, or by the
    naive float64 formula on the bfloat16-rounded operands (the exact value the bfloat16 kernels approximate)."""
    leaves = [hidden.detach().clone().requires_grad_()]
    leaves += [
        None if t is None else t.detach().clone().requires_grad_(train) for t, train in zip((weight, bias), trains)
    ]
    if float64:
        h, w, b = (None if t is None else t.to(torch.bfloat16).double() for t in leaves)
        logits = (h @ w.T + (0 if b is None else b)) / temperature
        log_softmax = logits.log_softmax(-1)
        logprobs = log_softmax.gather(-1, targets[:, None]).squeeze(-1)
        entropies = -(log_softmax.exp() * log_softmax).sum(-1)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropies = chunked_token_logprobs(
                leaves[0], leaves[1], targets, temperature, bias=leaves[2], with_entropy=True, float32_gemm=float32_gemm
            )
    (logprobs * upstream.to(logprobs.dtype)).sum().backward()
    grads = [None if t is None or t.grad is None else t.grad.double() for t in leaves]
    return logprobs.double(), entropies.double(), grads


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("bias,temperature", [(False, 1.0), (True, 0.7)])
@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float32, True)])
def test_float32_head_equals_the_bfloat16_chunked_head(monkeypatch, frozen, bias, temperature, dtype, autocast):
    """`Float32Head` (several row chunks, several vocabulary blocks, the last one partial) against the chunked head
    on torch's bfloat16 kernels, both measured from the float64 value of the same bfloat16 operands: log-probs and
    entropies within float32 rounding of the chunked head's, gradients no further from the float64 value than the
    bfloat16 kernels' (they round the same products to bfloat16, in other chunks)."""
    monkeypatch.setattr(cpu_matmul, "ROWS", 64)
    monkeypatch.setattr(cpu_matmul, "VOCAB_BLOCK", 96)
    inputs = head_inputs(150, 48, 1000, bias, frozen, dtype)
    fast = head_run(*inputs, temperature, autocast, float32_gemm=True)
    naive = head_run(*inputs, temperature, autocast, float32_gemm=False)
    exact = head_run(*inputs, temperature, autocast, float32_gemm=False, float64=True)
    for f, n, e in zip(fast[:2], naive[:2], exact[:2]):
        torch.testing.assert_close(f, n, rtol=0, atol=2e-5)
        assert (f - e).abs().max() <= (n - e).abs().max() + 2e-5
    for f, n, e in zip(fast[2], naive[2], exact[2]):
        assert (f is None) == (n is None) == (e is None)
        if f is None:
            continue
        scale = e.abs().max()
        assert (f - e).abs().max() <= 2 * ULP * scale and (n - e).abs().max() <= 2 * ULP * scale
        assert (f - n).abs().max() <= 2 * ULP * scale
    trained = [x is not None for x in fast[2]]
    assert trained == [True, not frozen, not frozen and bias]


def test_float32_head_runs_only_for_bfloat16_matmuls_on_the_cpu():
    hidden, weight, _, targets, _upstream, _ = head_inputs(80, 16, 300, False, False, torch.float32)
    hidden.requires_grad_()
    for autocast, expected in ((True, "Float32HeadBackward"), (False, "_ChunkedTokenLogprobsBackward")):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logprobs, _ = chunked_token_logprobs(hidden, weight, targets, float32_gemm=True)
        assert type(logprobs.grad_fn).__name__ in (expected, "ViewBackward0")
        assert any(type(n).__name__ == expected for n in walk(logprobs.grad_fn))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = chunked_token_logprobs(hidden, weight, targets, float32_gemm=True, fp32_head=True)
    assert not any(type(n).__name__ == "Float32HeadBackward" for n in walk(logprobs.grad_fn))  # a float32 head


def test_a_routed_models_head_takes_the_float32_route(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    model = build_tiny_model(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model = model.to(torch.bfloat16)
    ids = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(1))
    naive, _ = token_logprobs(model, ids, torch.ones_like(ids), 10)
    float32_matmuls(model, "cpu")
    fast, _ = token_logprobs(model, ids, torch.ones_like(ids), 10)
    assert any(type(n).__name__ == "Float32HeadBackward" for n in walk(fast.grad_fn))
    assert not any(type(n).__name__ == "Float32HeadBackward" for n in walk(naive.grad_fn))
    # 40 rows: the decoder's layers stay on torch's kernels in both, so only the head's summation order differs.
    torch.testing.assert_close(fast, naive, rtol=0, atol=1e-4)


def test_head_forward_equals_the_bfloat16_kernel_where_no_gradient_is_needed(monkeypatch):
    """The sampler's logits through the blocked float32 route (several vocabulary blocks, the last one partial),
    within a bfloat16 ulp of F.linear's bfloat16 kernel, with a bias and with float32 weights under autocast; torch's
    own forward where a gradient is needed or below HEAD_MIN_ROWS rows."""
    monkeypatch.setattr(cpu_matmul, "HEAD_BLOCK", 64)
    g = torch.Generator().manual_seed(3)
    for dtype, autocast, bias in (
        (torch.bfloat16, False, False),
        (torch.bfloat16, False, True),
        (torch.float32, True, True),
    ):
        head = torch.nn.Linear(48, 300, bias=bias).to(dtype)
        x = torch.randn(2, 8, 48, generator=g).to(dtype)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            fast, naive = cpu_matmul.head_forward(head, x), torch.nn.functional.linear(x, head.weight, head.bias)
        assert fast.shape == naive.shape == (2, 8, 300) and fast.dtype == naive.dtype == torch.bfloat16
        close_to_one_bf16_ulp(fast, naive)
    head = torch.nn.Linear(48, 300, bias=False).to(torch.bfloat16)
    x = torch.randn(8, 48, generator=g).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(cpu_matmul, "float32_copy", lambda *a: calls.append(1) or torch.Tensor.float(a[0]))
    assert cpu_matmul.head_forward(head, x).grad_fn is not None and not calls  # the weight wants a gradient
    with torch.no_grad():
        cpu_matmul.head_forward(head, x[: cpu_matmul.HEAD_MIN_ROWS - 1])
        assert not calls  # a few rows: the bfloat16 kernel
        cpu_matmul.head_forward(head, x)
    assert len(calls) == 5  # 300 rows of the head in blocks of 64


def test_float32_scratch_is_reused_grown_and_released():
    cpu_matmul.release_scratch()
    first = cpu_matmul.float32_scratch("weight", (30, 40))
    again = cpu_matmul.float32_scratch("weight", (20, 10))
    assert again.data_ptr() == first.data_ptr() and again.shape == (20, 10)  # a smaller request: the same memory
    other = cpu_matmul.float32_scratch("input", (20, 10))
    assert other.data_ptr() != first.data_ptr()  # slots are separate
    grown = cpu_matmul.float32_scratch("weight", (50, 40))
    assert grown.shape == (50, 40) and grown.dtype == torch.float32
    x = torch.randn(7, 5).to(torch.bfloat16)
    assert torch.equal(cpu_matmul.float32_copy(x, "weight"), x.float())
    cpu_matmul.release_scratch()
    assert not cpu_matmul._SCRATCH.__dict__


# --------------------------------------------------------------------------------- bitsandbytes 4-bit layers

needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed (pip install '.[lowmem]')"
)


def linear4bit(in_features=96, out_features=80, bias=True, quant_type="nf4"):
    import bitsandbytes as bnb

    torch.manual_seed(0)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=torch.bfloat16, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(plain.weight.data.clone(), requires_grad=False, quant_type=quant_type)
    if bias:
        layer.bias = torch.nn.Parameter(plain.bias.data.to(torch.bfloat16).clone())
    return layer.to("cpu")  # quantizes the weight


@needs_bitsandbytes
@pytest.mark.parametrize(
    "quant_type,nested,blocksize,storage",
    [("nf4", False, 64, torch.uint8), ("fp4", True, 128, torch.uint8), ("nf4", True, 64, torch.bfloat16)],
)
@pytest.mark.parametrize("out_features,in_features", [(83, 128), (40, 100), (83, 96)])
def test_a_4bit_weight_dequantized_in_pieces_is_bitwise_the_whole(
    monkeypatch, quant_type, nested, blocksize, storage, out_features, in_features
):
    """`dequantized_float32` dequantizes a few rows at a time (here 4 or 5 pieces, the last one partial), double
    quantization's block scales included: bitwise bitsandbytes' whole dequantization, upcast. Rows of 100 or 96
    inputs do not each start on a block of 64 or 128: the whole weight then (with 96, bitsandbytes' AVX-512 kernel
    gives a piece of rows other values than the whole weight's: seen on an Intel Xeon with AMX)."""
    import bitsandbytes as bnb

    monkeypatch.setattr(cpu_matmul, "DEQUANT_PIECE", 20 * in_features)
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=False,
        compute_dtype=torch.bfloat16,
        quant_type=quant_type,
        compress_statistics=nested,
        quant_storage=storage,
    )
    layer.weight = bnb.nn.Params4bit(
        torch.randn(out_features, in_features, dtype=torch.bfloat16),
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=nested,
        blocksize=blocksize,
        quant_storage=storage,
    )
    layer = layer.to("cpu")
    assert layer.weight.quant_state.nested == nested and layer.weight.dtype == storage
    pieces = []
    real = bnb.functional.dequantize_4bit
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", lambda *a, **k: pieces.append(1) or real(*a, **k))
    got = cpu_matmul.dequantized_float32(layer)
    aligned = in_features % blocksize == 0
    assert len(pieces) == (-(-out_features // 20) if aligned else 1)
    assert torch.equal(got, real(layer.weight.data, layer.weight.quant_state).to(torch.bfloat16).float())


@needs_bitsandbytes
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float32_linear4bit_equals_bitsandbytes(bias, dtype):
    """The routed 4-bit layer against bitsandbytes' own forward and backward: output and input gradient within a
    bfloat16 ulp (mostly identical); the 4-bit weight gets no gradient. The bias gradient is within a bfloat16 ulp
    of the exact sum (bitsandbytes sums over the first dimension in bfloat16, then autograd over the second: two
    roundings, so its value can be two ulps off)."""
    layer = linear4bit(bias=bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, MIN_ROWS, 96, generator=g).to(dtype)
    grad_out = torch.randn(2, MIN_ROWS, 80, generator=g).to(dtype)
    results = []
    for routed in (False, True):
        inputs = x.clone().requires_grad_()
        if layer.bias is not None:
            layer.bias.grad = None
        out = cpu_matmul.linear4bit_forward(layer, inputs) if routed else layer(inputs)
        out.backward(grad_out)
        results.append((out, inputs.grad, None if layer.bias is None else layer.bias.grad.clone()))
        assert (type(out.grad_fn).__name__ == "Float32Linear4bitBackward") == routed
    (fast, fast_x, fast_b), (naive, naive_x, naive_b) = results[1], results[0]
    assert fast.dtype == naive.dtype == dtype and layer.weight.grad is None
    close_to_one_bf16_ulp(fast, naive)
    close_to_one_bf16_ulp(fast_x, naive_x)
    if bias:
        exact = grad_out.to(torch.bfloat16).double().sum((0, 1)).to(torch.bfloat16)
        close_to_one_bf16_ulp(fast_b, exact)
        assert (naive_b.double() - exact.double()).abs().max() <= 2 * ULP * exact.double().abs().max()
    few = torch.randn(3, 96).to(dtype)  # a decode step: routed too (both dequantize; the float32 gemm is faster)
    close_to_one_bf16_ulp(cpu_matmul.linear4bit_forward(layer, few).detach(), layer(few).detach())
    layer.compute_dtype = torch.float32  # bitsandbytes' float32 compute: left to it
    unrouted = cpu_matmul.linear4bit_forward(layer, few.requires_grad_())
    assert type(unrouted.grad_fn).__name__ != "Float32Linear4bitBackward"


@needs_bitsandbytes
def test_qlora_base_layers_are_routed_and_learn_the_letter_task(tmp_path, monkeypatch):
    """QLoRA on the CPU: a 4-bit NF4 base (transformers' BitsAndBytesConfig) with a LoRA adapter, bf16 compute.
    The base's layers take the float32 route, the reference is the 4-bit base with the adapter off (no copy), and
    the adapter learns to start completions with 'a' (a 64-wide LoRA model learns the letter-repeating task too
    slowly for a test, with or without quantization)."""
    from letters import LETTERS, letter_dataset
    from letters import letter_config as config
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from grpokit import GRPOTrainer
    from grpokit.testing import save_tiny_model

    def starts_with_a(completions, **kwargs):
        return [1.0 if c[:1] == "a" else 0.0 for c in completions]

    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=64))
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    args = config(tmp_path, bf16=True, beta=0.04, max_steps=30, logging_steps=5, learning_rate=2e-2)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=starts_with_a,
        args=args,
        train_dataset=letter_dataset(),
        quantization_config=quantization,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    base = [m for m in trainer.unwrapped_model.modules() if cpu_matmul.is_linear4bit(m)]
    assert len(base) == 14 and all(m.forward.function is cpu_matmul.linear4bit_forward for m in base)
    assert trainer.reference is None
    slots = []
    release = cpu_matmul.release_scratch
    monkeypatch.setattr(
        "grpokit.trainer.release_scratch", lambda: slots.append(set(cpu_matmul._SCRATCH.__dict__)) or release()
    )
    trainer.train()
    assert slots == [{"weight", "input"}] and not cpu_matmul._SCRATCH.__dict__  # used, then freed at the end
    rewards = [entry["reward"] for entry in trainer.state.log_history[:-1]]
    assert rewards[0] < 0.1, rewards
    assert sum(rewards[-3:]) / 3 >= 0.2, rewards  # 0.078 -> 0.237 seen (AVX2 CPU)


@needs_bitsandbytes
def test_the_sampler_leaves_4bit_weights_in_their_trainable_layout(tmp_path, monkeypatch):
    """On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place for its inference kernel on the first
    forward in eval mode without gradients (the sampler's) and never unpacks it. Emulated here: the flag forced on,
    and the float32 route off (as on such a CPU), so bitsandbytes' own forward runs. The trainer turns the flag off:
    after a training step every base weight still has its packed 4-bit shape [n/2, 1]."""
    from letters import LETTERS, letter_dataset
    from letters import letter_config as config
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpokit import GRPOTrainer
    from grpokit.testing import save_tiny_model

    monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: True)
    model_dir = save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=64)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization)
    base = [m for m in model.modules() if cpu_matmul.is_linear4bit(m)]
    shapes = [tuple(m.weight.shape) for m in base]
    assert len(base) == 14 and all(shape[1] == 1 for shape in shapes)
    for layer in base:
        layer.support_avx512bf16_for_cpu = True
    layer = copy.deepcopy(base[0]).eval()
    with torch.no_grad():  # what the flag does, on this CPU too
        layer(torch.randn(3, layer.in_features, dtype=torch.bfloat16))
    assert layer.weight.quant_state.packing_format_for_cpu and layer.weight.shape[1] != 1
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=config(tmp_path, bf16=True, max_steps=1),
        train_dataset=letter_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    assert not any(m.support_avx512bf16_for_cpu for m in base)
    trainer.train()
    assert [tuple(m.weight.shape) for m in base] == shapes
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in base)
