"""grpokit.compat: each touch of another library's internals, checked against the installed versions."""

import pytest
import torch

from grpokit import compat
from grpokit.testing import build_tiny_model, build_tiny_model_of_type


def test_accumulation_boundary_flips_accelerates_sync_flag():
    from accelerate import Accelerator

    compat.reset_accelerate_state()
    accelerator = Accelerator(cpu=True)
    compat.set_accumulation_boundary(accelerator, False)
    assert accelerator.sync_gradients is False
    compat.set_accumulation_boundary(accelerator, True)
    assert accelerator.sync_gradients is True


def test_reset_lets_a_second_accelerator_take_another_precision():
    from accelerate import Accelerator

    compat.reset_accelerate_state()
    Accelerator(cpu=True, mixed_precision="no")
    with pytest.raises(ValueError):
        Accelerator(cpu=True, mixed_precision="bf16")
    compat.reset_accelerate_state()
    assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
    compat.reset_accelerate_state()


def test_deepspeed_config_of_reads_either_spelling():
    class New:
        config = {"zero_optimization": {"stage": 2}}

    class Old:
        config = "a path"

        class _config:
            _param_dict = {"zero_optimization": {"stage": 3}}

    assert compat.deepspeed_config_of(New())["zero_optimization"]["stage"] == 2
    assert compat.deepspeed_config_of(Old())["zero_optimization"]["stage"] == 3


def test_activation_checkpointing_flag():
    model = build_tiny_model(16)
    assert compat.is_activation_checkpointing(model) is False
    model.gradient_checkpointing_enable()
    assert compat.is_activation_checkpointing(model) is True


def test_cache_from_layers_keeps_the_tensors_in_the_graph():
    keys = torch.randn(2, 1, 3, 4, requires_grad=True)
    values = torch.randn(2, 1, 3, 4, requires_grad=True)
    cache = compat.cache_from_layers([(keys * 2, values)])
    assert cache.get_seq_length() == 3
    cache.layers[0].keys.sum().backward()
    assert torch.equal(keys.grad, torch.full_like(keys, 2.0))


def test_replicated_layers_come_from_the_factory():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Marked(DynamicLayer):
        pass

    model = build_tiny_model(16)
    cache = DynamicCache()
    compat.replicate_layers_with(cache, Marked)
    model(torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    assert len(cache.layers) == 2 and all(type(layer) is Marked for layer in cache.layers)


def test_attention_implementation_is_switched_and_restored():
    model = build_tiny_model(16)
    before = compat.attention_implementation(model.config)
    assert before == "sdpa"
    with compat.attention_implementation_set_to(model.config, "eager"):
        assert compat.attention_implementation(model.config) == "eager"
        model(torch.tensor([[1, 2, 3]]))  # the layers read it at every call
    assert compat.attention_implementation(model.config) == before


def test_tied_weight_keys():
    assert "lm_head.weight" in compat.tied_weight_keys(build_tiny_model(16, tie_word_embeddings=True))


def test_a_replaced_cache_layer_is_the_one_the_model_writes():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class Marked(DynamicLayer):
        pass

    model = build_tiny_model_of_type("gemma3_text", vocab_size=16)  # a sliding-window layer, then a full one
    cache = DynamicCache(config=model.config)
    assert cache.is_sliding == [True, False]
    compat.replace_cache_layer(cache, 0, Marked())
    assert cache.is_sliding == [False, False]  # the cache's per-layer properties read the new layer
    model(torch.tensor([[3, 4, 5]]), past_key_values=cache, use_cache=True)
    assert type(cache.layers[0]) is Marked and cache.layers[0].get_seq_length() == 3


def test_select_cache_rows_moves_every_state_of_every_layer_kind():
    # NemotronH's cache holds a Mamba layer's convolution and SSM states, an attention layer's keys and values and
    # nothing for a MoE block: every state follows the rows, kept, dropped and repeated.
    from transformers import DynamicCache

    model = build_tiny_model_of_type("nemotron_h", vocab_size=16)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            torch.randint(3, 16, (3, 5), generator=torch.Generator().manual_seed(0)),
            past_key_values=cache,
            use_cache=True,
        )

    def states():
        mamba, attention, _ = cache.layers
        return [mamba.conv_states[0], mamba.recurrent_states[0], attention.keys, attention.values]

    before = states()
    rows = torch.tensor([2, 2, 0])
    compat.select_cache_rows(cache, rows)
    for old, new in zip(before, states(), strict=True):
        assert torch.equal(new, old[rows])


def test_parameter_versions_change_with_an_optimizer_step_and_only_then():
    from grpokit.compat import parameter_versions

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = parameter_versions(model)
    with torch.no_grad():
        model(torch.ones(1, 3))  # reading the weights writes nothing
    assert parameter_versions(model) == before
    model(torch.ones(1, 3)).sum().backward()
    assert parameter_versions(model) == before  # gradients are not weights
    optimizer.step()
    after = parameter_versions(model)
    assert after != before
    with torch.no_grad():
        model.weight.mul_(1.0)  # any in-place write
    assert parameter_versions(model) != after


def test_cache_argument_and_output_cache_follow_the_installed_transformers():
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (and the output field with it). Both
    names must be read right, or every sampler call silently falls back to re-running the whole sequence."""
    import inspect

    from grpokit.rollout.hf import supports_kv_cache

    peft = pytest.importorskip("peft")
    model = build_tiny_model(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1).eval()
    name = compat.cache_argument(model)
    assert name in inspect.signature(model.forward).parameters
    assert supports_kv_cache(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert compat.cache_argument(lora) == name  # a PeftModel forwards **kwargs to the model it wraps
    assert compat.cache_argument(torch.nn.Linear(2, 2)) is None

    from transformers import DynamicCache

    ids = torch.tensor([[1, 2, 3]])
    out = model(input_ids=ids, use_cache=True, **{name: DynamicCache()})
    cache = compat.output_cache(out)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 3
