"""Static-shape decoding (`cache_implementation="static"`, `grpokit/rollout/static.py`): the same tokens and
log-probs as the default decoder, eagerly and compiled, one compiled step for every rollout of one shape, the
refusals, and a trainer run that ends where the default sampler's run ends."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from grpokit.rollout import SamplingParams
from grpokit.rollout.hf import generate
from grpokit.rollout.static import StaticDecoding
from grpokit.testing import build_tiny_model_of_type

VOCAB = 16  # small: EOS (id 2) is sampled within a rollout, so rows finish early
LOGPROB_ATOL = 1e-5  # float32: attention over the whole static capacity (unwritten positions masked) vs the filled part


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def prompts(vocab_size: int = VOCAB, seed: int = 1):
    """3 prompts × 2 rows each, two of them left-padded (the mask reaches the decode steps)."""
    ids = torch.randint(3, vocab_size, (3, 5), generator=seeded(seed)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    ids[:2, :2], mask[:2, :2] = 0, 0
    return ids, mask


PARAMS = SamplingParams(max_new_tokens=24, eos_token_ids=(2,), pad_token_id=0)


def sample(model, static=None, ids_mask=None, params=PARAMS, seed=2, autocast=False):
    ids, mask = ids_mask or prompts()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        return generate(model, ids, mask, params, generator=seeded(seed), num_generations=2, static=static)


def assert_same_rollout(got, expected, atol=LOGPROB_ATOL):
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.lengths, expected.lengths)
    assert (got.sampling_logprobs - expected.sampling_logprobs).abs().max() <= atol


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama", "qwen2", "qwen3_moe"])
def test_static_decoding_samples_what_the_default_decoder_samples(model_type):
    # GQA, MLA (key size != value size), MoE; rows that finish early keep decoding in the static batch and are
    # masked out afterwards, so the rollout is the default decoder's (which drops them).
    model = build_tiny_model_of_type(model_type, num_layers=2, vocab_size=VOCAB)
    default = sample(model)
    assert (default.lengths < PARAMS.max_new_tokens).any()  # some rows finished early: the masking is exercised
    static = sample(model, StaticDecoding(model, compile=False))
    assert_same_rollout(static, default)


def test_static_decoding_under_autocast_samples_what_the_default_decoder_samples():
    # As the default decoder's cache, the static buffers hold bf16 keys and values (SDPA and the one-token path
    # round them to bf16 anyway): bitwise the same rollout.
    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB)
    decoding = StaticDecoding(model, compile=False)
    assert_same_rollout(sample(model, decoding, autocast=True), sample(model, autocast=True), atol=0.0)
    assert {(layer.keys.dtype, layer.values.dtype) for layer in decoding.cache.layers} == {
        (torch.bfloat16, torch.bfloat16)
    }


def test_compiled_static_step_samples_the_same_and_compiles_once_per_shape():
    # The compiled step (inductor on CPU; CUDA graphs on a GPU): the same rollout, and a second rollout of the same
    # shape (other prompts, other seed) reuses the cache and the compiled step: no recompilation.
    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB)
    decoding = StaticDecoding(model, compile=True)
    torch._dynamo.reset()
    assert_same_rollout(sample(model, decoding), sample(model))
    cache = decoding.cache
    other = prompts(seed=5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        second = sample(model, decoding, ids_mask=other, seed=7)
    assert decoding.cache is cache
    assert_same_rollout(second, sample(model, ids_mask=other, seed=7))
    # An optimizer step updates the weights in place: the compiled step reads the new values (parameters are
    # inputs of the compiled graph, not constants baked into it).
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=seeded(9)) * 0.5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        third = sample(model, decoding, seed=11)
    updated = sample(model, seed=11)
    assert_same_rollout(third, updated)
    assert not torch.equal(
        updated.sampling_logprobs,
        sample(build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB), seed=11).sampling_logprobs,
    )


@pytest.mark.parametrize("static", [True, False], ids=["static", "default"])
def test_static_decoding_takes_the_packed_one_token_attention_on_accelerators_too(static):
    # On a GPU the compiled static step would otherwise run transformers' SDPA path, which copies the cache once per
    # query head of a group (repeat_kv) over the whole capacity; the default eager decoder keeps SDPA there. (The
    # switch only renames the config's attention implementation: no GPU is needed to check it.)
    from grpokit.rollout.fast import ONE_TOKEN_ATTENTION, one_token_attention

    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB)
    with one_token_attention(model, torch.device("cuda"), static=static):
        assert model.config._attn_implementation == (ONE_TOKEN_ATTENTION if static else "sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_static_cache_is_reused_while_it_fits_and_replaced_when_not():
    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB)
    decoding = StaticDecoding(model, compile=False)
    sample(model, decoding)
    first = decoding.cache
    assert first.layers[0].max_cache_len == 64  # 5 + 24 positions, rounded up to CAPACITY_MULTIPLE
    sample(model, decoding, params=SamplingParams(max_new_tokens=40, eos_token_ids=(2,), pad_token_id=0))
    assert decoding.cache is first  # 45 positions still fit
    longer = SamplingParams(max_new_tokens=70, eos_token_ids=(2,), pad_token_id=0)
    assert_same_rollout(sample(model, decoding, params=longer), sample(model, params=longer))
    assert decoding.cache is not first and decoding.cache.layers[0].max_cache_len == 128


def test_lora_model_decodes_statically():
    peft = pytest.importorskip("peft")
    model = build_tiny_model_of_type("llama", num_layers=2, vocab_size=VOCAB)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, config).eval()
    assert_same_rollout(sample(model, StaticDecoding(model, compile=False)), sample(model))


def test_models_without_full_attention_everywhere_are_refused():
    model = build_tiny_model_of_type("gemma3_text", vocab_size=VOCAB)  # sliding-window layers
    with pytest.raises(ValueError, match=r"full attention.*Leave cache_implementation unset"):
        StaticDecoding(model)
    with pytest.raises(ValueError, match="no transformers config"):
        StaticDecoding(torch.nn.Linear(2, 2))


def test_engine_and_config_refuse_what_they_cannot_do():
    from grpokit import GRPOConfig, HFEngine

    model = build_tiny_model_of_type("qwen2", vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"'offloaded'.*'static'"):
        HFEngine(model, cache_implementation="offloaded")
    with pytest.raises(ValueError, match="sharded"):
        HFEngine(model, cache_implementation="static", all_done=lambda done: done)
    with pytest.raises(ValueError, match="cache_implementation='hybrid'"):
        GRPOConfig(cache_implementation="hybrid")
    with pytest.warns(UserWarning, match="no effect with use_vllm"):
        GRPOConfig(cache_implementation="static", use_vllm=True)
    with pytest.raises(ValueError, match="disable_compile='yes'"):
        GRPOConfig(generation_kwargs={"disable_compile": "yes"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig(cache_implementation="static", generation_kwargs={"disable_compile": True})


def test_trainer_with_a_static_cache_ends_where_the_default_sampler_ends(tmp_path):
    # Same seeds, same tokens: the two runs' losses and weights agree to float rounding (the static step attends
    # over the whole capacity, with the unwritten positions masked).
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.testing import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    dataset = [{"prompt": p} for p in ["ab", "abc", "b", "cab"]]

    def reward(completions, **kwargs):
        return [float(c.count("a")) for c in completions]

    def run(name, **extra):
        model = build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0)
        args = GRPOConfig(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=3,
            **extra,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
        trainer.train()
        return trainer, model

    static_trainer, static_model = run("static", cache_implementation="static")
    assert static_trainer.engine.static is not None and static_trainer.engine.static.cache is not None
    _, default_model = run("default")
    for (name, got), expected in zip(static_model.named_parameters(), default_model.parameters()):
        assert (got - expected).abs().max() <= 1e-5, name
    assert any(
        (p != q).any()
        for p, q in zip(
            static_model.parameters(),
            build_tiny_model(len(tokenizer), hidden_size=32, num_layers=2, seed=0).parameters(),
        )
    )


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_cuda_graph_decoding_samples_what_the_default_decoder_samples(autocast):
    # On CUDA the static step is compiled with mode 'reduce-overhead' (CUDA graphs): the same tokens and log-probs
    # (float rounding; bf16 autocast: the compiled kernels may round otherwise, so tokens are compared where the
    # log-probs agree to 1e-2), one compilation for rollouts of one shape, and in-place weight updates seen.
    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB).cuda()
    ids, mask = (t.cuda() for t in prompts())
    torch._dynamo.reset()
    decoding = StaticDecoding(model)

    def run(static, seed):
        context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            return generate(
                model,
                ids,
                mask,
                PARAMS,
                generator=torch.Generator("cuda").manual_seed(seed),
                num_generations=2,
                static=static,
            )

    for seed in (2, 3):
        context = torch._dynamo.config.patch(error_on_recompile=True) if seed == 3 else contextlib.nullcontext()
        with context:
            static = run(decoding, seed)
        assert decoding.uses_cuda_graphs
        default = run(None, seed)
        assert_same_rollout(static, default, atol=2e-2 if autocast else LOGPROB_ATOL)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.05)


@pytest.mark.parametrize("decoder", ["dropping", "static", "all_done"])
def test_checking_for_finished_rows_every_few_steps_samples_the_same(monkeypatch, decoder):
    # On an accelerator the loop asks whether rows finished every FINISHED_CHECK_EVERY steps only (each ask waits
    # for the device): finished rows decode a few steps longer, masked out, and rows leave the batch later. Forced
    # here on the CPU: the same rollout as checking at every step, bitwise for the static decoder (its batch never
    # changes). The other decoders run some steps with more rows, and on some CPUs (an AMD EPYC, AVX-512) a gemm of
    # another row count rounds a last bit otherwise: their log-probs agree to 1e-6 (seen: 2.4e-7).
    from grpokit.rollout import hf

    model = build_tiny_model_of_type("qwen2", num_layers=2, vocab_size=VOCAB)
    ids, mask = prompts()
    options = {"static": StaticDecoding(model, compile=False)} if decoder == "static" else {}
    if decoder == "all_done":
        options["all_done"] = lambda done: done

    def run():
        return generate(model, ids, mask, PARAMS, generator=seeded(2), num_generations=2, **options)

    every_step = run()
    assert (every_step.lengths < PARAMS.max_new_tokens).any()
    monkeypatch.setattr(hf, "finished_check_interval", lambda device: 5)
    sparse = run()
    for name in ("completion_ids", "lengths", "attention_mask", "is_truncated"):
        assert torch.equal(getattr(sparse, name), getattr(every_step, name)), name
    if decoder == "static":
        assert torch.equal(sparse.sampling_logprobs, every_step.sampling_logprobs)
    else:
        assert (sparse.sampling_logprobs - every_step.sampling_logprobs).abs().max() <= 1e-6
