"""Memory options at real sizes (issue 16): a light reference (ref_model_dtype), optimizers with 8-bit / 4-bit
states, and what each changes in the numbers."""

import contextlib

import pytest
import torch
from letters import LETTERS, letter_dataset, repeat_letter, tiny_letter_model
from letters import letter_config as config

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.logprobs import token_logprobs
from grpokit.models import frozen_copy
from grpokit.offload import ActivationOffload
from grpokit.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("model") / "tiny", chars=LETTERS + ":", hidden_size=64))


# ------------------------------------------------------------------------------------------ the reference


def test_frozen_copy_in_bfloat16_casts_parameters_once_and_keeps_buffers():
    model, _ = tiny_letter_model()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = frozen_copy(model, torch.bfloat16)
    for name, parameter in reference.named_parameters():
        assert parameter.dtype == torch.bfloat16 and not parameter.requires_grad, name
        assert torch.equal(parameter, before[name].to(torch.bfloat16)), name  # the cast of the policy's value
    # Tied weights stay one tensor (one copy, not two).
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    # Buffers keep their dtype (as from_pretrained(dtype=bfloat16) leaves the rotary frequencies).
    for name, buffer in reference.named_buffers():
        assert buffer.dtype == dict(model.named_buffers())[name].dtype, name
    # The policy is untouched: still float32, still trainable, same values.
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and parameter.requires_grad
        assert torch.equal(parameter, before[name])
    assert not reference.training


def test_bf16_reference_logprobs_are_close_to_the_float32_reference_under_autocast():
    # The difference a bfloat16 reference introduces, on a tiny model (the README gives it at the Qwen2.5-0.5B
    # shape): under bf16 autocast the matmuls already run in bf16; what changes is the embeddings, norms and residual
    # stream rounding to bf16.
    model, _ = tiny_letter_model(hidden_size=64)
    reference = frozen_copy(model, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    prompt, completion = (
        torch.randint(3, 12, (16, 3), generator=generator),
        torch.randint(3, 12, (16, 6), generator=generator),
    )
    ids, mask = torch.cat([prompt, completion], 1), torch.ones(16, 9, dtype=torch.long)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full, _ = token_logprobs(frozen_copy(model), ids, mask, 6, 1.0)
        light, _ = token_logprobs(reference, ids, mask, 6, 1.0)
    difference = (full.float() - light.float()).abs()
    assert light.dtype == torch.float32
    assert 0 < difference.max().item() < 0.05, difference.max()
    assert difference.mean().item() < 0.01, difference.mean()


def test_bf16_reference_trains_and_learns_the_letter_task(model_dir, tmp_path):
    args = config(tmp_path, bf16=True, beta=0.04, ref_model_dtype="bfloat16", max_steps=40, logging_steps=5)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    assert all(p.dtype == torch.bfloat16 for p in trainer.reference.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.unwrapped_model.parameters())
    trainer.train()
    history = trainer.state.log_history[:-1]
    rewards = [entry["reward"] for entry in history]
    assert rewards[0] < 0.1, rewards  # a random policy names the letter ~1 time in 17
    # With beta=0.04 the KL holds the policy back: the float32 reference, same run otherwise, logs rewards
    # 0.06 -> 0.34 (last five logs 0.29, 0.26, 0.34, 0.28, 0.24); the bfloat16
    # one 0.06 -> 0.38 (0.36, 0.33, 0.25, 0.38, 0.38).
    assert sum(rewards[-4:]) / 4 >= 0.25, rewards
    assert history[0]["kl"] == pytest.approx(0.0, abs=2e-3)  # the policy is the reference, up to bf16 rounding
    assert history[-1]["kl"] > 1e-3


@pytest.mark.parametrize("routed", [False, True], ids=["bf16-kernels", "float32-gemm-route"])
@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3_moe"])
def test_reference_linears_in_bf16_give_the_float32_references_logprobs_bitwise(monkeypatch, model_type, routed):
    # Under bf16 autocast F.linear casts a float32 weight and bias to bf16 at every call: casting them once gives
    # the same operands. Also through cpu_matmul's float32 route (CPUs without bf16 instructions, forced here).
    from grpokit import cpu_matmul
    from grpokit.models import linears_in_autocast_dtype
    from grpokit.testing import build_tiny_model_of_type

    model = build_tiny_model_of_type(model_type, num_layers=2, vocab_size=64, tie_word_embeddings=True)
    if routed:
        monkeypatch.setattr(cpu_matmul, "cpu_has_bf16_matmul", lambda: False)
        assert cpu_matmul.float32_matmuls(model, "cpu") > 0
    full, light = frozen_copy(model), frozen_copy(model)
    cast = linears_in_autocast_dtype(light, torch.bfloat16)
    linears = [m for m in light.modules() if type(m) is torch.nn.Linear and m is not light.lm_head]
    assert cast == sum(len(list(m.parameters())) for m in linears) > 0
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for m in linears for p in m.parameters())
    # The embeddings (tied to the head), norms and the head stay float32.
    assert light.lm_head.weight is light.model.embed_tokens.weight and light.lm_head.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for n, p in light.named_parameters() if "norm" in n)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (4, 24), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = token_logprobs(full, ids, mask, 16, 1.0)
        got, _ = token_logprobs(light, ids, mask, 16, 1.0)
    assert torch.equal(got, expected)


def test_linears_in_autocast_dtype_keep_shared_weights_shared_and_leave_other_modules():
    from grpokit.models import linears_in_autocast_dtype

    model, _ = tiny_letter_model()
    shared = model.model.layers[0].mlp.up_proj.weight
    model.model.layers[1].mlp.up_proj.weight = shared  # two linear layers, one weight
    model.model.layers[1].self_attn.o_proj.weight = model.model.layers[0].self_attn.o_proj.weight
    model.model.layers[1].self_attn.o_proj.register_parameter("extra", None)
    embedding_shared = torch.nn.Parameter(torch.zeros(8, 8))
    model.model.layers[0].self_attn.q_proj.weight = embedding_shared  # shared with a module of another kind
    model.register_module("other", torch.nn.Embedding(8, 8))
    model.other.weight = embedding_shared
    reference = frozen_copy(model)
    linears_in_autocast_dtype(reference, torch.bfloat16)
    layers = reference.model.layers
    assert layers[0].mlp.up_proj.weight is layers[1].mlp.up_proj.weight
    assert layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert layers[0].self_attn.q_proj.weight.dtype == torch.float32  # also an embedding's: left as it is
    assert layers[0].self_attn.q_proj.weight is reference.other.weight


def test_the_trainer_keeps_the_float32_references_linears_in_bf16_only_under_bf16_autocast(model_dir, tmp_path):
    def reference_dtypes(**overrides):
        args = config(tmp_path, beta=0.04, max_steps=1, **overrides)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
        reference = trainer.reference
        return reference.model.layers[0].mlp.up_proj.weight.dtype, reference.model.embed_tokens.weight.dtype

    assert reference_dtypes(bf16=True) == (torch.bfloat16, torch.float32)
    assert reference_dtypes(bf16=False) == (torch.float32, torch.float32)
    # The reference sync mixes float32 policy weights into it: it keeps float32 there.
    assert reference_dtypes(bf16=True, sync_ref_model=True) == (torch.float32, torch.float32)


def test_memory_savings_leave_a_seeded_bf16_run_bitwise(model_dir, tmp_path, monkeypatch):
    # The reference's linear layers in bf16, AdamW's update in blocks of rows, the heap trims in the backward and
    # the LM head's weight gradient added in blocks of vocabulary rows (issue 60): a seeded bf16-autocast run with
    # beta > 0 gives the same losses, KL and final weights bitwise as the same run with all four off.
    import grpokit.cpu_memory
    import grpokit.head_autograd
    import grpokit.logprobs
    import grpokit.models
    import grpokit.optim
    import grpokit.trainer

    monkeypatch.setattr(grpokit.optim, "TORCH_ADAM_BLOCK_ELEMENTS", 256)  # the tiny embedding: blocks of 4 rows
    monkeypatch.setattr(grpokit.cpu_memory, "BACKWARD_TRIM_MIN_GRADIENT_BYTES", 0)  # trims on the tiny model too
    monkeypatch.setattr(grpokit.head_autograd, "WEIGHT_GRAD_BLOCK_ELEMENTS", 1)  # the head's gradient row by row
    blocks = []  # (the gradient's dtype, the product's) at each call: the blocked route is a bf16 product's
    add_weight_grad = grpokit.logprobs.add_weight_grad
    monkeypatch.setattr(
        grpokit.logprobs,
        "add_weight_grad",
        lambda gw, gl, h: blocks.append((gw.dtype, gl.dtype)) or add_weight_grad(gw, gl, h),
    )
    trims = []
    monkeypatch.setattr(grpokit.cpu_memory, "return_free_memory", lambda: trims.append(1) or True)
    runs = []
    for saving in (True, False):
        with monkeypatch.context() as patch:
            if not saving:
                patch.setattr(grpokit.models, "AUTOCAST_REFERENCE_LINEARS", False)
                patch.setattr(grpokit.optim, "row_chunked", lambda cls: cls)
                patch.setattr(grpokit.trainer, "trim_heap_in_backward", lambda model: 0)
                patch.setattr(  # the formula before the blocks: the whole product, then its float32 copy
                    grpokit.logprobs,
                    "add_weight_grad",
                    lambda gw, gl, h: blocks.append((gw.dtype, gl.dtype)) or gw.add_((gl.t() @ h).to(gw.dtype)),
                )
            args = config(tmp_path / str(saving), bf16=True, beta=0.04, max_steps=3, per_device_train_batch_size=16)
            trainer = GRPOTrainer(
                model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset()
            )
            trims.clear()
            blocks.clear()
            trainer.train()
            assert blocks and set(blocks) == {(torch.float32, torch.bfloat16)}
            up_proj = trainer.reference.model.layers[0].mlp.up_proj.weight.dtype
            optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
            blocked = isinstance(optimizer, grpokit.optim.RowBlockedTorchAdam)
            assert (up_proj == torch.bfloat16, blocked) == (saving, saving)
            layers = len(trainer.unwrapped_model.model.layers)
            runs.append((trainer, len(trims), layers))
    (on, on_trims, layers), (off, off_trims, _) = runs
    # A trim per layer and forward in each step's backward (the shared-prompt forward runs each layer twice).
    assert on_trims - off_trims in (3 * layers, 6 * layers)
    keys = ("loss", "kl", "reward", "grad_norm")
    assert [[e[k] for k in keys] for e in on.state.log_history[:-1]] == [
        [e[k] for k in keys] for e in off.state.log_history[:-1]
    ]
    assert on.state.log_history[-2]["kl"] > 0
    for (name, a), b in zip(on.unwrapped_model.named_parameters(), off.unwrapped_model.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(on.unwrapped_model.model.embed_tokens.weight, on.reference.model.embed_tokens.weight)


def test_heap_trims_leave_a_seeded_float32_run_bitwise(model_dir, tmp_path, monkeypatch):
    # The `small` benchmark's settings (float32, beta 0.04, groups of 8 completions sharing a prompt: the
    # shared-prompt forward and the chunked head): the same losses, KL, grad norms and final weights bitwise with
    # the heap trimmed wherever it can be (the three thresholds at 0) as with the default thresholds, under which
    # this tiny model trims nowhere in the loop (not in the backward, not in the head, not between the phases). One
    # thread: at two, the `small` benchmark's float32 run is not bitwise reproducible even with the same code.
    import grpokit.cpu_memory
    import grpokit.experience
    import grpokit.logprobs

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trims = {"backward": 0, "head": 0, "phases": 0}
    monkeypatch.setattr(grpokit.cpu_memory, "return_free_memory", lambda: trims.update(backward=trims["backward"] + 1))
    monkeypatch.setattr(grpokit.logprobs, "return_free_memory", lambda: trims.update(head=trims["head"] + 1))
    monkeypatch.setattr(grpokit.experience, "return_free_memory", lambda: trims.update(phases=trims["phases"] + 1))
    runs = []
    try:
        for everywhere in (True, False):
            with monkeypatch.context() as patch:
                if everywhere:
                    patch.setattr(grpokit.cpu_memory, "BACKWARD_TRIM_MIN_GRADIENT_BYTES", 0)
                    patch.setattr(grpokit.logprobs, "HEAD_TRIM_MIN_BYTES", 0)
                    patch.setattr(grpokit.cpu_memory, "PHASE_TRIM_MIN_MODEL_BYTES", 0)
                args = config(
                    tmp_path / str(everywhere), beta=0.04, max_steps=3, max_completion_length=8, learning_rate=1e-3
                )
                trainer = GRPOTrainer(
                    model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset()
                )
                trims.update(backward=0, head=0, phases=0)
                trainer.train()
                runs.append((trainer, dict(trims)))
    finally:
        torch.set_num_threads(threads)
    (everywhere, everywhere_trims), (default, default_trims) = runs
    layers = len(everywhere.unwrapped_model.model.layers)
    # One trim when training starts (`reuse_activation_memory`); in each step's backward, one per layer and decoder
    # call (the shared prompts', then one per group of completion lengths: 2 to 5 calls); in the head, one before
    # the reference's log-probs and one before the policy's; between the phases, one after the rollout and one after
    # the reference's forward.
    backward_trims = everywhere_trims["backward"] - 1
    assert backward_trims % layers == 0 and 3 * 2 * layers <= backward_trims <= 3 * 5 * layers, everywhere_trims
    assert everywhere_trims["head"] == 3 * 2
    assert everywhere_trims["phases"] == 3 * 2
    assert default_trims == {"backward": 1, "head": 0, "phases": 0}
    keys = ("loss", "kl", "reward", "grad_norm", "entropy")
    assert [[e[k] for k in keys] for e in everywhere.state.log_history[:-1]] == [
        [e[k] for k in keys] for e in default.state.log_history[:-1]
    ]
    assert everywhere.state.log_history[-2]["kl"] > 0
    for (name, a), b in zip(everywhere.unwrapped_model.named_parameters(), default.unwrapped_model.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(everywhere.unwrapped_model.lm_head.weight, everywhere.reference.lm_head.weight)


# ----------------------------------------------------------------------------------------- int8 reference


def test_int8_linear_is_the_bf16_linear_of_its_dequantized_weight():
    from grpokit.quantized import Int8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    with torch.no_grad():
        linear.weight[3] = 0.0  # an all-zero row: scale clamped, weights stay 0
    layer = Int8Linear(linear)
    weight = linear.weight.detach()
    scale = weight.abs().amax(1) / 127
    # Hand-computed: round(w / scale) in [-127, 127], the row's largest weight exactly +-127.
    expected_int8 = torch.round(weight / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
    assert layer.weight_int8.dtype == torch.int8 and torch.equal(layer.weight_int8.float(), expected_int8)
    assert layer.weight_int8.abs().amax(1)[torch.arange(40) != 3].eq(127).all() and layer.weight_int8[3].eq(0).all()
    dequantized = layer.weight_int8.float() * layer.scale[:, None]
    assert ((dequantized - weight).abs() <= scale[:, None] / 2 + 1e-7).all()  # at most half a step per weight
    x = torch.randn(5, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        expected = torch.nn.functional.linear(x, dequantized.bfloat16(), linear.bias.detach().bfloat16())
    assert torch.equal(out, expected)
    assert sum(b.numel() * b.element_size() for b in layer.buffers()) < 0.3 * 4 * weight.numel()


def test_int8_linear_dequantizes_on_its_own_device():
    # The float32 product goes to a scratch buffer on the weight's device: an int8 reference on a GPU once failed
    # ("cuda:0 and cpu"), its scratch being a host buffer. The meta device stands in for an accelerator here.
    from grpokit.quantized import Int8Linear

    layer = Int8Linear(torch.nn.Linear(48, 40)).to("meta")
    out = layer(torch.empty(5, 48, device="meta", dtype=torch.bfloat16))
    assert out.device.type == "meta" and out.shape == (5, 40) and out.dtype == torch.bfloat16


@pytest.mark.gpu
def test_int8_linear_on_the_gpu_is_the_cpu_one():
    from grpokit.quantized import Int8Linear

    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(96, 80))
    x = torch.randn(7, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = layer.cuda()(x.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, atol=2e-2, rtol=2e-2)  # bf16 GEMMs of two devices
    torch.testing.assert_close(
        layer.dequantized_weight().cpu(),
        (layer.weight_int8.float() * layer.scale[:, None]).cpu().bfloat16(),
        atol=0,
        rtol=0,
    )


def test_int8_reference_quantizes_its_linear_layers_and_learns_the_letter_task(model_dir, tmp_path):
    from grpokit.quantized import Int8Linear

    args = config(tmp_path, bf16=True, beta=0.04, ref_model_dtype="int8", max_steps=40, logging_steps=5)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    reference, policy = trainer.reference, trainer.unwrapped_model
    assert sum(isinstance(m, Int8Linear) for m in reference.modules()) == 14  # 2 layers x 7 projections
    assert type(reference.lm_head) is torch.nn.Linear and reference.lm_head.weight.dtype == torch.bfloat16
    assert all(type(m) is not Int8Linear for m in policy.modules())  # the policy is untouched
    # The reference's log-probs: close to the policy's own at the start (the same weights, int8-rounded).
    ids = torch.randint(3, 12, (16, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        exact, _ = token_logprobs(policy, ids, torch.ones_like(ids), 6, 1.0)
        int8, _ = token_logprobs(reference, ids, torch.ones_like(ids), 6, 1.0)
    difference = (exact - int8).abs()
    assert 0 < difference.max() < 0.1 and difference.mean() < 0.02, (difference.max(), difference.mean())
    trainer.train()
    history = trainer.state.log_history[:-1]
    rewards = [entry["reward"] for entry in history]
    assert rewards[0] < 0.1, rewards
    assert sum(rewards[-4:]) / 4 >= 0.25, rewards
    assert history[0]["kl"] == pytest.approx(0.0, abs=5e-3)  # the reference is the policy, int8-rounded
    assert history[-1]["kl"] > 1e-3


def test_int8_reference_refuses_reference_sync():
    with pytest.raises(ValueError, match="ref_model_dtype='int8' cannot be combined with sync_ref_model=True"):
        GRPOConfig(ref_model_dtype="int8", sync_ref_model=True)


def test_ref_model_dtype_is_checked():
    with pytest.raises(ValueError, match="ref_model_dtype='bf16' is not valid; use 'bfloat16'"):
        GRPOConfig(ref_model_dtype="bf16")


def test_ref_model_dtype_with_lora_says_how_to_load_the_base(tmp_path):
    from peft import LoraConfig

    model, tokenizer = tiny_letter_model()
    with pytest.raises(ValueError, match=r"ref_model_dtype='bfloat16' with LoRA.*model_init_kwargs"):
        GRPOTrainer(
            model=model,
            reward_funcs=repeat_letter,
            processing_class=tokenizer,
            args=config(tmp_path, beta=0.04, ref_model_dtype="bfloat16"),
            train_dataset=letter_dataset(),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


# ------------------------------------------------------------------------------------- a frozen LM head


def largest_allocation_in_last_position_logits(model, ids):
    """The largest CPU allocation of a `logits_to_keep=1` forward (the sampler's prefill), and its logits."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits
    return max(event.cpu_memory_usage for event in prof.events()), logits


def test_a_frozen_bf16_head_is_not_copied_once_per_prompt_in_the_prefill():
    from grpokit.models import contiguous_head_input
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(8192, hidden_size=64, num_layers=1).to(torch.bfloat16).requires_grad_(False)
    ids = torch.randint(3, 8192, (8, 12), generator=torch.Generator().manual_seed(0))
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()  # 1 MiB
    before, expected = largest_allocation_in_last_position_logits(model, ids)
    # torch's bmm over the sliced hidden states copies the head once per row where its bf16 kernel is the CPU's own
    # (AVX-512 BF16 / AMX); elsewhere bf16 matmuls take another path that does not: the fix must then change nothing.
    copies_the_head = before >= 8 * head_bytes
    assert copies_the_head or before < head_bytes
    assert contiguous_head_input(model) and not contiguous_head_input(model)  # once per model
    after, logits = largest_allocation_in_last_position_logits(model, ids)
    assert after < head_bytes / 4
    assert torch.equal(logits, expected)


def test_the_trainer_gives_the_policy_and_reference_heads_contiguous_inputs(model_dir, tmp_path):
    from peft import LoraConfig

    model, tokenizer = tiny_letter_model()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=repeat_letter,
        processing_class=tokenizer,
        args=config(tmp_path, beta=0.04),
        train_dataset=letter_dataset(),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
    )
    assert trainer.model.get_output_embeddings()._grpokit_contiguous_input
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        args=config(tmp_path, beta=0.04, ref_model_dtype="bfloat16"),
        train_dataset=letter_dataset(),
    )
    for model in (trainer.model, trainer.reference):
        head = model.get_output_embeddings()
        assert head._grpokit_contiguous_input and len(head._forward_pre_hooks) == 1


# ------------------------------------------------------------------------------------- optimizer states

# transformers' registry names with low-precision states that run on the CPU: bitsandbytes' blockwise 8-bit AdamW
# and torchao's 8-bit / 4-bit AdamW (pip install '.[lowmem]' in grpokit's checkout).
LOW_PRECISION_OPTIMIZERS = {"adamw_8bit": "bitsandbytes", "adamw_torch_8bit": "torchao", "adamw_torch_4bit": "torchao"}


def needs(package: str):
    import importlib.util

    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def state_bytes(optimizer) -> int:
    """Bytes held by the optimizer's per-parameter states (tensor subclasses counted by their inner tensors)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            inner = getattr(value, "__tensor_flatten__", None)
            parts = [getattr(value, name) for name in inner()[0]] if inner else [value]
            total += sum(part.numel() * part.element_size() for part in parts)
    return total


def learns_the_letter_task(model_dir, args, bar: float) -> GRPOTrainer:
    """Train on the letter task; the reward starts under 0.1 and its last three logged means average `bar` or more."""
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history[:-1]]
    assert rewards[0] < 0.1, rewards
    assert sum(rewards[-3:]) / 3 >= bar, rewards
    return trainer


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[needs(p)] + ([pytest.mark.slow] if p == "torchao" else []))
        for n, p in LOW_PRECISION_OPTIMIZERS.items()
    ],
)  # torchao compiles its step: ~20 s
def test_low_precision_optimizer_learns_the_letter_task_with_smaller_states(model_dir, tmp_path, name):
    trainer = learns_the_letter_task(model_dir, config(tmp_path, optim=name, max_steps=30, logging_steps=5), 0.35)
    # Smaller states than AdamW's two float32 tensors per parameter (small tensors keep float32 states in both
    # libraries, so the saving shows on the large ones only).
    parameters = sum(p.numel() for p in trainer.unwrapped_model.parameters())
    assert state_bytes(trainer.optimizer) < 0.75 * 2 * 4 * parameters


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[needs(p)] + ([pytest.mark.slow] if p == "torchao" else []))
        for n, p in {**LOW_PRECISION_OPTIMIZERS, "adamw_torch_bf16": "torchao"}.items()
    ],
)
def test_low_precision_optimizer_resumes_bitwise(model_dir, tmp_path, name):
    args = dict(
        optim=name,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=16,
        num_generations=4,
        lr_scheduler_type="constant",
    )
    full = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "full", **args),
    )
    full.train()
    first = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "split", **{**args, "max_steps": 2}),
    )
    first.train()
    resumed = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "split", **args),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-2"))
    a, b = full.unwrapped_model.state_dict(), resumed.unwrapped_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in full.state.log_history[:-1]] == [h["loss"] for h in resumed.state.log_history[:-1]]


# ------------------------------------------------------------------------------------------ bf16 weights


def test_bf16_weights_do_not_claim_exact_sampling_logprobs(model_dir, tmp_path):
    # With half-precision weights the sampler and the training forward round differently, so with μ > 1 π_old
    # must come from a training-style forward, not from the sampler's log-probs.
    full = GRPOTrainer(
        model=model_dir, reward_funcs=repeat_letter, args=config(tmp_path / "a"), train_dataset=letter_dataset()
    )
    half = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "b", model_init_kwargs={"dtype": "bfloat16"}),
    )
    assert full.engine.logprobs_match_training and not half.engine.logprobs_match_training
    assert all(p.dtype == torch.bfloat16 for p in half.unwrapped_model.parameters())


@pytest.mark.slow  # torchao compiles its optimizer step
@needs("torchao")
def test_bf16_weights_with_stochastic_rounding_learn_the_letter_task(model_dir, tmp_path):
    # Weights, gradients and reference in bfloat16, 8-bit AdamW states, updates stochastically rounded into the
    # bf16 weights (no float32 master copy): transformers' names, so the same settings run in TRL.
    args = config(
        tmp_path,
        bf16=True,
        beta=0.04,
        max_steps=30,
        logging_steps=5,
        optim="adamw_torch_8bit",
        optim_args="bf16_stochastic_round=True",
        model_init_kwargs={"dtype": "bfloat16"},
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    assert all(p.dtype == torch.bfloat16 for p in trainer.reference.parameters())
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history[:-1]]
    assert rewards[0] < 0.1, rewards
    assert sum(rewards[-3:]) / 3 >= 0.25, rewards


def test_torch_empty_cache_steps_clears_the_device_cache_on_every_nth_step(model_dir, tmp_path, monkeypatch):
    # transformers' Trainer rule: before the backward of each micro-batch while global_step % N == 0. The call is
    # a no-op on the CPU, so the test counts the calls (the trainer and model are real).
    import grpokit.trainer

    calls = []
    monkeypatch.setattr(grpokit.trainer, "clear_device_cache", lambda: calls.append(None))
    args = config(
        tmp_path,
        max_steps=4,
        torch_empty_cache_steps=2,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=16,
        num_generations=4,
    )
    GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset()).train()
    assert len(calls) == 4  # steps 0 and 2 (global_step before the update), two micro-batches each
    with pytest.raises(ValueError, match="torch_empty_cache_steps=0 must be a positive"):
        config(tmp_path, torch_empty_cache_steps=0)


# ------------------------------------------------------------------------------------ activation offloading


class RecordingOffload(ActivationOffload):
    """ActivationOffload that also keeps what it was offered and what it moved (for the assertions)."""

    def __init__(self, device_type):
        super().__init__(device_type)
        self.offered, self.moved = [], []

    def _pack(self, tensor):
        packed = super()._pack(tensor)
        self.offered.append(tensor)
        if packed is not tensor:
            assert packed.host.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()  # a real copy
            self.moved.append(tensor)
        return packed


def forward_backward(model, input_ids, offload=None):
    model.zero_grad(set_to_none=True)
    with offload or contextlib.nullcontext():
        logprobs, _ = token_logprobs(model, input_ids, torch.ones_like(input_ids), 6, 1.0)
    (logprobs * torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_offloading_moves_the_saved_activations_and_keeps_the_gradients(checkpointing):
    # On a CPU the "device" is the host: the hooks copy each tensor into a fresh host tensor and back, which is
    # everything the GPU path does but the transfer. The gradients must be bitwise those without the hooks.
    from grpokit.offload import MIN_BYTES
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(40, hidden_size=64, num_layers=3)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))
    plain = forward_backward(model, input_ids)
    offload = RecordingOffload("cpu")
    offloaded = forward_backward(model, input_ids, offload)
    for name, grad in plain.items():
        assert torch.equal(offloaded[name], grad), name
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert offload.moved and all(t.untyped_storage().data_ptr() not in weights for t in offload.moved)
    assert all(t.numel() * t.element_size() >= MIN_BYTES for t in offload.moved)
    assert offload.offloaded == len(offload.moved)
    assert offload.offloaded_bytes == sum(t.numel() * t.element_size() for t in offload.moved)
    assert any(t.untyped_storage().data_ptr() in weights for t in offload.offered) or checkpointing  # kept: weights
    hidden_states = [t for t in offload.moved if t.shape == (4, 14, 64)]
    if checkpointing:
        # What survives the forward is each checkpointed layer's input (its insides are recomputed in the backward).
        assert len(hidden_states) >= 3 and not any(t.shape[-1] == 4 * 64 for t in offload.moved)
    else:
        assert any(t.shape[-1] == 4 * 64 for t in offload.moved)  # the MLP's activations move too


def test_activation_offloading_on_a_cpu_warns_and_trains_as_without(model_dir, tmp_path, caplog):
    idle = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "a", max_steps=2, activation_offloading=True),
    )
    assert "activation_offloading=True has no effect on a CPU" in caplog.text  # logged, as TRL's advisories
    assert idle.activation_offload is None
    # The trainer's own path with the hooks on (the CPU stands in for the device): the same run, bitwise.
    plain = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "b", max_steps=2, gradient_checkpointing=True),
    )
    hooked = GRPOTrainer(
        model=model_dir,
        reward_funcs=repeat_letter,
        train_dataset=letter_dataset(),
        args=config(tmp_path / "c", max_steps=2, gradient_checkpointing=True),
    )
    hooked.activation_offload = ActivationOffload("cpu")
    plain.train()
    hooked.train()
    assert hooked.activation_offload.offloaded > 0
    for (name, a), b in zip(plain.model.named_parameters(), hooked.model.parameters()):
        assert torch.equal(a, b), name


def checkpointed_layers(model) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m.gradient_checkpointing for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def saved_bytes(model, input_ids) -> int:
    """Bytes autograd keeps from the training forward until the backward (the weights included)."""
    kept = []

    def pack(tensor):
        kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = token_logprobs(model, input_ids, torch.ones_like(input_ids), 6, 1.0)
    logprobs.sum().backward()
    return sum(kept)


def test_checkpointing_every_n_layers_keeps_the_other_layers_activations():
    # transformers' `every_n_layers` (gradient_checkpointing_kwargs, as its Trainer and so TRL read it): layers 0, 2
    # of four are checkpointed, the others keep what their backward needs, so the forward keeps more than with every
    # layer checkpointed and less than without checkpointing; the gradients are the same bitwise.
    from grpokit.models import enable_gradient_checkpointing
    from grpokit.testing import build_tiny_model

    input_ids = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))
    kept, grads = {}, {}
    for every in (None, 1, 2):
        model = build_tiny_model(40, hidden_size=64, num_layers=4).train()
        kwargs = None if every is None else {"every_n_layers": every}
        enable_gradient_checkpointing(
            model, GRPOConfig(gradient_checkpointing=every is not None, gradient_checkpointing_kwargs=kwargs), "cpu"
        )
        assert checkpointed_layers(model) == {None: [False] * 4, 1: [True] * 4, 2: [True, False, True, False]}[every]
        kept[every] = saved_bytes(model, input_ids)
        grads[every] = {name: p.grad for name, p in model.named_parameters()}
    assert kept[1] < kept[2] < kept[None]
    for name, grad in grads[None].items():
        assert torch.equal(grads[1][name], grad) and torch.equal(grads[2][name], grad), name


def test_checkpointing_every_n_layers_trains_as_every_layer(model_dir, tmp_path):
    runs = []
    for every in (1, 2):
        args = config(
            tmp_path / str(every),
            max_steps=2,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"every_n_layers": every, "use_reentrant": False},
        )
        trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, train_dataset=letter_dataset(), args=args)
        layers = checkpointed_layers(trainer.unwrapped_model)
        assert layers == [index % every == 0 for index in range(len(layers))] and all(layers) == (every == 1)
        trainer.train()
        runs.append(trainer)
    for (name, a), b in zip(runs[0].model.named_parameters(), runs[1].model.parameters()):
        assert torch.equal(a, b), name


def test_checkpointing_offload_on_a_cpu_warns_and_checkpoints_without_it():
    from grpokit.models import enable_gradient_checkpointing
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(40, hidden_size=64, num_layers=2).train()
    args = GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True})
    with pytest.warns(UserWarning, match="offload=True has no effect on a CPU"):
        enable_gradient_checkpointing(model, args, "cpu")
    assert checkpointed_layers(model) == [True, True]
    saved_bytes(model, torch.randint(3, 40, (2, 10)))  # transformers' offload would fail here: pinned memory


def test_checkpointing_every_n_layers_on_a_transformers_without_it_is_refused():
    # transformers < 5.19 checkpoints every layer: its gradient_checkpointing_enable has no every_n_layers.
    from grpokit.models import enable_gradient_checkpointing

    class OldModel(torch.nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            raise AssertionError("not to be reached")

    args = GRPOConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2})
    with pytest.raises(ValueError, match=r"\['every_n_layers'\]: transformers .* has no such option"):
        enable_gradient_checkpointing(OldModel(), args, "cpu")


@pytest.mark.gpu
def test_activation_offloading_lowers_what_the_forward_keeps_on_cuda():
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(4096, hidden_size=512, num_layers=8).cuda().train()
    input_ids = torch.randint(3, 4096, (8, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    held_bytes, grads = [], []
    for offload in (None, ActivationOffload("cuda")):
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        before_forward = torch.cuda.memory_allocated()  # the weights (gradients freed above)
        with offload or contextlib.nullcontext():
            logprobs, _ = token_logprobs(model, input_ids, torch.ones_like(input_ids), 64, 1.0)
        held = torch.cuda.memory_allocated() - before_forward  # what the forward keeps for the backward
        logprobs.sum().backward()
        torch.cuda.synchronize()
        held_bytes.append(held)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert held_bytes[1] < 0.5 * held_bytes[0], held_bytes
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@needs("torchao")
def test_bf16_adamw_one_step_is_float32_adamw_rounded_and_keeps_bf16_states():
    # grpokit's `adamw_torch_bf16` (torchao's AdamW): with bf16 weights its states are bf16; without stochastic
    # rounding one step from zero states is float32 AdamW's step, rounded to the nearest bf16, computed here by hand.
    from types import SimpleNamespace

    from grpokit.optim import build_optimizer

    g = torch.Generator().manual_seed(0)
    weights = torch.randn(64, 48, generator=g).bfloat16()
    gradient = torch.randn(64, 48, generator=g).bfloat16()
    args = SimpleNamespace(
        optim="adamw_torch_bf16",
        optim_args="bf16_stochastic_round=False",
        learning_rate=1e-2,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
    )
    parameter = torch.nn.Parameter(weights.clone())
    optimizer = build_optimizer([parameter], args)
    parameter.grad = gradient.clone()
    optimizer.step()
    m, v = 0.1 * gradient.float(), 0.001 * gradient.float() ** 2  # (1 - β) · g, bias-corrected below
    expected = weights.float() - 1e-2 * (m / 0.1) / ((v / 0.001).sqrt() + 1e-8)
    torch.testing.assert_close(parameter.detach(), expected.bfloat16(), atol=0, rtol=0)
    state = optimizer.state[parameter]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"bf16_stochastic_round=True|False"):
        build_optimizer([parameter], SimpleNamespace(**{**vars(args), "optim_args": "block_size=128"}))


def test_grpokit_optimizer_names_pass_the_config_check():
    assert GRPOConfig(optim="adamw_torch_bf16").optim == "adamw_torch_bf16"
    with pytest.raises(ValueError, match="adamw_torch_bf16"):
        GRPOConfig(optim="adamw_torch_bf17")


@pytest.mark.slow  # torchao compiles its optimizer step
@needs("torchao")
def test_bf16_weights_with_bf16_adamw_states_learn_the_letter_task(model_dir, tmp_path):
    # bf16 weights, gradients and AdamW states (6 bytes per parameter), updates stochastically rounded.
    args = config(
        tmp_path,
        bf16=True,
        beta=0.04,
        max_steps=30,
        logging_steps=5,
        optim="adamw_torch_bf16",
        model_init_kwargs={"dtype": "bfloat16"},
    )
    trainer = learns_the_letter_task(model_dir, args, 0.25)
    parameters = sum(p.numel() for p in trainer.unwrapped_model.parameters())
    # Two bf16 states per parameter, and a float32 step count per tensor.
    assert state_bytes(trainer.optimizer) == 2 * 2 * parameters + 4 * len(trainer.optimizer.state)


# ----------------------------------------------------------------------------- torchao's AdamW in row chunks


@needs("torchao")
@pytest.mark.parametrize(
    "name, dtype",
    [
        ("AdamW8bit", torch.float32),
        ("AdamW8bit", torch.bfloat16),
        ("AdamW4bit", torch.float32),
        ("AdamWFp8", torch.float32),
    ],
)
def test_row_chunked_torchao_adam_is_the_whole_tensor_update(monkeypatch, name, dtype):
    # The update is elementwise and the states are quantized in blocks that the row blocks start on: the states and
    # (without stochastic rounding) the weights are bitwise those of torchao's own step.
    import torchao.optim

    import grpokit.optim

    monkeypatch.setattr(grpokit.optim, "CHUNK_ELEMENTS", 1 << 16)
    cls = getattr(torchao.optim, name)
    weights = torch.randn(1000, 384, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert len(grpokit.optim._row_blocks(weights, [None])) == 6  # blocks of 170 rows (65,280 elements)
    whole, chunked = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    plain, ours = cls([whole], lr=1e-2), grpokit.optim.row_chunked(cls)([chunked], lr=1e-2)
    assert isinstance(ours, cls) and isinstance(ours, grpokit.optim.RowChunkedAdam)
    for step in range(3):
        gradient = torch.randn(1000, 384, generator=torch.Generator().manual_seed(step + 1)).to(dtype)
        whole.grad, chunked.grad = gradient.clone(), gradient.clone()
        plain.step()
        ours.step()
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = plain.state[whole][key], ours.state[chunked][key]
        assert type(a) is type(b) and torch.equal(a.dequantize(), b.dequantize()), key
    assert torch.equal(whole, chunked)
    assert ours.state_dict()["state"][0].keys() == plain.state_dict()["state"][0].keys()


@needs("torchao")
def test_row_chunked_bf16_stochastic_rounding_differs_only_in_the_rounding_direction():
    import torchao.optim

    import grpokit.optim

    weights = torch.randn(2000, 8192, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 16M > 2^23
    assert len(grpokit.optim._row_blocks(weights, [None])) == 2
    whole, chunked = torch.nn.Parameter(weights.clone()), torch.nn.Parameter(weights.clone())
    options = dict(lr=1e-3, bf16_stochastic_round=True)
    plain = torchao.optim.AdamW8bit([whole], **options)
    ours = grpokit.optim.row_chunked(torchao.optim.AdamW8bit)([chunked], **options)
    gradient = torch.randn(2000, 8192, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole.grad, chunked.grad = gradient.clone(), gradient.clone()
    plain.step()
    ours.step()
    assert torch.equal(plain.state[whole]["exp_avg"].dequantize(), ours.state[chunked]["exp_avg"].dequantize())
    # The same float32 update, rounded up or down by other random bits: at most one bf16 step apart.
    step = 2.0 ** (torch.floor(torch.log2(whole.detach().float().abs().clamp(min=1e-30))) - 7)
    assert ((whole.float() - chunked.float()).abs() <= step).all()
    assert not torch.equal(whole, chunked)


def test_stochastic_rounding_to_bf16_rounds_each_value_to_a_neighbour_with_the_right_probability():
    from grpokit.optim import stochastic_round_to_bf16

    # 1 + k/16 of a bf16 step (2^-7 at 1.0): rounds up with probability k/16; exact bf16 values stay put; negative
    # values round away from zero (down) with the same probability.
    k = torch.arange(16, dtype=torch.float32).repeat_interleave(20_000)
    source = torch.cat([1 + k * 2.0**-11, -(1 + k * 2.0**-11)])
    out = torch.empty(source.shape, dtype=torch.bfloat16)
    stochastic_round_to_bf16(source, out, torch.tensor(12345))
    up = (out.float().abs() > 1).view(2, 16, 20_000).float().mean(-1)  # [sign, k]
    assert set(out.float().abs().unique().tolist()) == {1.0, 1 + 2.0**-7}
    assert torch.equal(out[torch.cat([k, k]) == 0].float().abs(), torch.ones(40_000))
    # Binomial: 20,000 draws, standard deviation at most 0.0036; 5 of them.
    torch.testing.assert_close(up, (torch.arange(16) / 16).expand(2, 16), atol=0.018, rtol=0)
    # Another seed, other bits; the same seed, the same bits.
    again, other = torch.empty_like(out), torch.empty_like(out)
    stochastic_round_to_bf16(source, again, torch.tensor(12345))
    stochastic_round_to_bf16(source, other, torch.tensor(54321))
    assert torch.equal(out, again) and not torch.equal(out, other)
    # Unbiased over many seeds: the mean of one value rounded 4,000 times is the value (3/8 of a step above 1.0).
    value = torch.full((4000,), 1 + 3 * 2.0**-10)
    rounded = torch.empty(4000, dtype=torch.bfloat16)
    means = []
    for seed in range(50):
        stochastic_round_to_bf16(value, rounded, torch.tensor(seed * 7919))
        means.append(rounded.float().mean())
    assert abs(float(torch.stack(means).mean()) - (1 + 3 * 2.0**-10)) < 2e-5  # std of the mean: 2.7e-6


@needs("torchao")
def test_bf16_weights_round_torchaos_float32_update_to_one_of_its_two_bf16_neighbours(monkeypatch):
    # With stochastic rounding the row-chunked step takes torchao's update in float32 and rounds it with
    # `stochastic_round_to_bf16`: every weight is the float32 update truncated to bf16, or one bf16 step further
    # from zero; the bf16 states are torchao's (round to nearest).
    import torchao.optim
    from torchao.optim.adam import single_param_adam

    import grpokit.optim

    monkeypatch.setattr(grpokit.optim, "CHUNK_ELEMENTS", 1 << 16)
    g = torch.Generator().manual_seed(0)
    weights = torch.randn(600, 384, generator=g).bfloat16()
    gradient = torch.randn(600, 384, generator=g).bfloat16()
    parameter = torch.nn.Parameter(weights.clone())
    optimizer = grpokit.optim.row_chunked(torchao.optim._AdamW)([parameter], lr=1e-2, bf16_stochastic_round=True)
    assert len(grpokit.optim._row_blocks(parameter, [None])) == 4  # 170-row blocks
    parameter.grad = gradient.clone()
    optimizer.step()
    expected, m, v = weights.float(), torch.zeros_like(weights), torch.zeros_like(weights)
    with torch._dynamo.utils.disable_cache_limit():  # as the optimizer: other tests compiled it for other shapes
        torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
            expected, gradient, torch.tensor(1.0), m, v, None, torch.tensor(1e-2), 0.9, 0.999, 1e-2, 1e-8, True, False
        )
    towards_zero = (expected.view(torch.int32) & -0x10000).view(torch.float32)
    away = towards_zero + torch.sign(towards_zero) * 2.0 ** (torch.floor(torch.log2(towards_zero.abs())) - 7)
    result = parameter.detach().float()
    assert ((result == towards_zero) | (result == away)).all()
    # Away from zero with the probability of the dropped bits (round-to-nearest would give 0 below a half, 1 above).
    dropped = (expected.view(torch.int32) & 0xFFFF).float() / 2**16
    for low, high in ((0.0, 0.5), (0.5, 1.0)):
        rows = (dropped > low) & (dropped < high)
        away_rate = (result == away)[rows].float().mean()
        torch.testing.assert_close(away_rate, dropped[rows].mean(), atol=0.01, rtol=0)
    state = optimizer.state[parameter]
    assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v)


@pytest.mark.parametrize("options", [{}, {"weight_decay": 0.1}, {"amsgrad": True}, {"maximize": True}])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_row_blocked_torch_adam_is_torchs_update_bitwise(monkeypatch, cls, options):
    # torch's single-tensor update (its path on CPU tensors), a block of rows at a time: the same weights, states
    # and state dict bitwise, at one and two threads (which split torch's elementwise loops differently), on rows
    # whose length is no multiple of a vector.
    import grpokit.optim

    monkeypatch.setattr(grpokit.optim, "TORCH_ADAM_BLOCK_ELEMENTS", 1_000)
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            whole = torch.nn.Parameter(torch.randn(1001, 37, generator=generator))
            small = torch.nn.Parameter(torch.randn(7, 5, generator=generator))
            blocked, small_blocked = (torch.nn.Parameter(p.detach().clone()) for p in (whole, small))
            plain = cls([whole, small], lr=1e-2, **options)
            ours = grpokit.optim.row_chunked(cls)([blocked, small_blocked], lr=1e-2, **options)
            assert isinstance(ours, cls) and isinstance(ours, grpokit.optim.RowBlockedTorchAdam)
            assert len(grpokit.optim._row_blocks(blocked, [], 1_000)) == 38  # 27 rows (999 elements) a block
            for step in range(3):
                for a, b in ((whole, blocked), (small, small_blocked)):
                    a.grad = torch.randn(a.shape, generator=generator) * 10.0 ** (step - 1)
                    b.grad = a.grad.clone()
                plain.step()
                ours.step()
            assert torch.equal(whole, blocked) and torch.equal(small, small_blocked)
            expected, got = plain.state_dict(), ours.state_dict()
            assert expected["param_groups"] == got["param_groups"]
            for index in (0, 1):
                assert expected["state"][index].keys() == got["state"][index].keys()
                for key, value in expected["state"][index].items():
                    assert torch.equal(value, got["state"][index][key]), key
    finally:
        torch.set_num_threads(threads)


def test_row_blocked_torch_adam_leaves_foreach_and_fused_groups_to_torch():
    import grpokit.optim

    cls = grpokit.optim.row_chunked(torch.optim.AdamW)
    for options, ours in (({}, True), ({"foreach": False}, True), ({"foreach": True}, False), ({"fused": True}, False)):
        group = cls([torch.nn.Parameter(torch.zeros(2, 2))], **options).param_groups[0]
        assert grpokit.optim._single_tensor_update(group) is ours, options


def test_row_blocks_start_on_every_states_quantization_block(monkeypatch):
    import grpokit.optim

    class State:  # a quantized state's block size is all _row_blocks reads of it
        block_size = 256

    monkeypatch.setattr(grpokit.optim, "CHUNK_ELEMENTS", 10_000)
    p = torch.empty(151, 896)  # 896 = 3.5 blocks: a block of rows must hold an even number of rows
    blocks = grpokit.optim._row_blocks(p, [State(), None])
    assert [b.start for b in blocks] == list(range(0, 151, 10)) and blocks[-1].stop == 151
    assert all(b.start * 896 % 256 == 0 for b in blocks)
    assert grpokit.optim._row_blocks(torch.empty(10, 896), [State()]) == [slice(None)]  # small: whole
    assert grpokit.optim._row_blocks(torch.empty(100_000), [State()]) == [slice(None)]  # no rows


@pytest.mark.gpu
def test_the_reference_is_copied_on_the_gpu_not_in_host_memory(tmp_path, monkeypatch):
    """On a GPU the policy moves to the device before the frozen reference is copied from it, so the host never
    holds both copies (`distributed.place_before_reference_copy`; an H200 run at the 0.5B shape peaked at 4.8 GB of
    host RSS before it, against TRL's 3.3)."""
    from datasets import Dataset

    from grpokit import GRPOConfig, GRPOTrainer, models
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    devices = []
    original = models.frozen_copy
    monkeypatch.setattr(
        models,
        "frozen_copy",
        lambda model, dtype=None: devices.append(next(model.parameters()).device.type) or original(model, dtype),
    )
    tokenizer = build_char_tokenizer()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        beta=0.04,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        report_to=[],
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=build_tiny_model(len(tokenizer)),
        processing_class=tokenizer,
        args=args,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        train_dataset=Dataset.from_list([{"prompt": "ab"}] * 8),
    )
    assert devices == ["cuda"]
    assert next(trainer.reference.parameters()).device.type == "cuda"
