"""What of the vLLM engines runs without vLLM: server mode's client (`grpokit.rollout.vllm_client`), its checks of
the served model and its errors; what a sharded policy pushes (a LoRA layer merged from its gathered pieces).
Against a real server and vLLM: tests/test_vllm_server.py and tests/test_vllm_distributed.py (`-m vllm`)."""

import contextlib
import json
import socket
import time

import pytest

from grpokit.rollout import SamplingParams
from grpokit.rollout.vllm_client import VLLMServerEngine, check_context_fits, check_same_model, weight_shape_config
from grpokit.testing import build_tiny_model


def served(config, **changes):
    info = {
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "model": "/srv/model",
    }
    return {**info, **changes}


def test_the_served_model_must_be_the_policys():
    config = build_tiny_model(40, hidden_size=32).config
    check_same_model(config, served(config), "http://h:1")  # the same: no error
    with pytest.raises(ValueError, match="serves a model with a vocabulary of 41 tokens; the policy's has 40"):
        check_same_model(config, served(config, vocab_size=41), "http://h:1")
    with pytest.raises(
        ValueError,
        match=r"another model \(hidden_size: server 64, policy 32, num_hidden_layers: "
        r"server 3, policy 2\) \(/srv/model\)",
    ):
        check_same_model(config, served(config, hidden_size=64, num_hidden_layers=3), "http://h:1")
    with pytest.raises(ValueError, match="model_type: server 'llama', policy 'qwen2'"):
        check_same_model(config, served(config, model_type="llama"), "http://h:1")


def test_a_server_whose_weights_have_other_shapes_is_refused(tmp_path):
    """Issue 39: the same type, width, depth and vocabulary but another MLP width (or heads, key-value heads,
    tying...) is another model, whose pushed weights vLLM would take without an error. The server reports every
    config field that shapes a weight (/info's `shape`, from the checkpoint) and the client compares them all."""
    from grpokit.vllm_server import served_model_info

    policy = build_tiny_model(40, hidden_size=32)
    shape = weight_shape_config(policy.config)
    assert {
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }.items() <= shape.items()
    for changes, shown in (
        ({"intermediate_size": 64}, "intermediate_size: server 64, policy 128"),
        ({"num_heads": 2}, "num_attention_heads: server 2, policy 4"),
        ({"num_kv_heads": 4}, "num_key_value_heads: server 4, policy 2"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings: server False, policy True"),
    ):
        other = build_tiny_model(40, hidden_size=32, **changes)
        other.save_pretrained(tmp_path / "served")
        _, info = served_model_info(tmp_path / "served")
        assert info["hidden_size"] == 32 and info["num_hidden_layers"] == 2 and info["vocab_size"] == 40
        with pytest.raises(ValueError, match=rf"serves another model \({shown}\).*its weights have other shapes"):
            check_same_model(policy.config, {**info, "model": "/srv/model"}, "http://h:1")
    policy.save_pretrained(tmp_path / "same")
    check_same_model(policy.config, served_model_info(tmp_path / "same")[1], "http://h:1")  # the same: no error
    # A field only one side's transformers writes is not compared (the server may run another version).
    check_same_model(policy.config, {**served(policy.config), "shape": {"rope_layers_unknown": 3}}, "http://h:1")


def test_the_server_refuses_pushed_weights_of_other_shapes(tmp_path):
    """The server's second check, on the tensors of a push (HTTP or a process group's announced shapes), against
    its checkpoint's, read from the safetensors headers."""
    from grpokit.vllm_server import check_pushed_shapes, checkpoint_shapes

    served_model = build_tiny_model(40, hidden_size=32)
    served_model.save_pretrained(tmp_path / "served")
    shapes = checkpoint_shapes(tmp_path / "served")
    assert shapes["model.layers.0.mlp.down_proj.weight"] == [32, 128]
    policy = dict(build_tiny_model(40, hidden_size=32, seed=1).named_parameters())
    check_pushed_shapes(shapes, {name: tensor.shape for name, tensor in policy.items()})  # same shapes: fine
    narrower = dict(build_tiny_model(40, hidden_size=32, intermediate_size=64).named_parameters())
    with pytest.raises(
        ValueError,
        match=r"pushed weights have other shapes than the served model's \(6 tensors; "
        r"model.layers.0.mlp.gate_proj.weight: served \[128, 32\], pushed \[64, 32\]",
    ):
        check_pushed_shapes(shapes, {name: tensor.shape for name, tensor in narrower.items()})


def test_a_server_shorter_than_the_trainers_budget_is_found_at_start():
    """Issue 39: found when the trainer connects (it was a validation error when a long prompt first came): no room
    for a whole completion is an error; a prompt budget beyond the server's is a warning (prompts may all be short),
    and a prompt that does not fit is named before the request is sent."""
    import warnings

    from grpokit.rollout import PromptBatch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_context_fits(1024, 512, 512, 2048, "http://h:1")  # fits exactly
        check_context_fits(None, 512, 512, 2048, "http://h:1")  # a server that does not say: nothing to check
        check_context_fits(512, 512, 256, 512, "http://h:1")  # prompts are cut to the model's 512 positions anyway
        check_context_fits(512, None, 256, 2048, "http://h:1")  # uncut prompts: only the completion is known
    with pytest.raises(
        ValueError,
        match=r"takes at most 512 tokens of prompt \+ completion \(its max_model_len\), "
        r"which leaves no room for a prompt before a completion of "
        r"max_completion_length=512 tokens",
    ):
        check_context_fits(512, None, 512, 2048, "http://h:1")
    with pytest.warns(
        UserWarning,
        match=r"takes at most 512 tokens .* may send up to 768 \(max_prompt_length=512 "
        r"\+ max_completion_length=256\): a prompt longer than 256 tokens will stop "
        r"the run. Restart the server with `grpokit vllm-serve --max-model-len 768`",
    ):
        check_context_fits(512, 512, 256, 2048, "http://h:1")
    model = build_tiny_model(40, hidden_size=32)
    with stand_in_server({**served(model.config), "instance": "i", "max_model_len": 256}) as url:
        with pytest.raises(ValueError, match="takes at most 256 tokens"):
            VLLMServerEngine(model, url, timeout=10, max_prompt_length=None, max_completion_length=256)
        engine = VLLMServerEngine(model, url, timeout=10, max_prompt_length=100, max_completion_length=100)
        params = SamplingParams(max_new_tokens=100, eos_token_ids=(1,), pad_token_id=0)
        long_prompts = PromptBatch(ids=[[3] * 10, [4] * 157], counts=[1, 1], raw=[None, None])
        with pytest.raises(
            ValueError,
            match=r"Prompt 1 of this generation has 157 tokens, and with "
            r"max_completion_length=100 it does not fit the 256 tokens",
        ):
            engine.generate(long_prompts, params, seed=0)


@pytest.mark.parametrize(
    "options, limit, name",
    [
        ({"timeout": 3, "retries": 3}, 3, "vllm_server_timeout"),  # was 4 x 3 s + 2 + 4 + 8 s of pauses
        ({"timeout": 30, "request_timeout": 2}, 2, "request_timeout"),  # AsyncGRPOConfig's bound on one request
    ],
)
def test_a_frozen_server_stops_the_trainer_within_the_timeout(options, limit, name):
    """A server that takes requests and never answers: every try of a request, retries included, ends within
    the request's time limit in all (it was retries + 1 times that, plus the pauses)."""
    import threading

    model = build_tiny_model(40, hidden_size=32)
    thawed = threading.Event()
    with stand_in_server({**served(model.config), "instance": "i"}, on_post=thawed.wait) as url:
        try:
            engine = VLLMServerEngine(model, url, **options)
            started = time.monotonic()
            with pytest.raises(
                ConnectionError,
                match=rf"stopped answering \(POST /generate, \d tries in {limit} s, "
                rf"{name}={limit}:",
            ):
                engine.request("POST", "/generate", {"prompt_ids": [[3]]})
            assert time.monotonic() - started < limit + 1.5
        finally:
            thawed.set()


def test_no_server_is_a_clear_error_after_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    started = time.monotonic()
    with pytest.raises(
        ConnectionError,
        match=rf"No vLLM server answers at http://127.0.0.1:{port} after 2 s "
        r"\(vllm_server_timeout\): start one with `grpokit vllm-serve",
    ):
        VLLMServerEngine(build_tiny_model(40, hidden_size=32), f"http://127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - started < 15


def test_what_vllm_does_not_do_yet_is_refused_with_the_way_out():
    """No vLLM needed: these are refused before vLLM would be started or a server asked."""
    from grpokit.rollout import PromptBatch
    from grpokit.rollout.vllm import external_launcher_options, refuse_images

    # Image prompts for a model that takes none: refused rather than sampled blind.
    refuse_images(PromptBatch(ids=[[3, 4]], counts=[2], raw=["text"], images=[[]]))  # no image: fine
    with pytest.raises(ValueError, match="These prompts have images, and the model vLLM serves takes none"):
        refuse_images(PromptBatch(ids=[[3, 4]], counts=[2], raw=["x"], images=[[object()]]))
    # Several training processes run one whole engine each: no tensor-parallel groups across them.
    with pytest.raises(NotImplementedError, match="vllm_tensor_parallel_size=2 with several training processes"):
        external_launcher_options(0, 0, 2, tensor_parallel_size=2)


@contextlib.contextmanager
def stand_in_server(info: dict, on_post=None):
    """A stand-in that answers /health and /info as `grpokit vllm-serve` does (the real server's side:
    tests/test_vllm_server.py), and calls `on_post` for a POST (a frozen server: one that never returns); yields its
    URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok"} if self.path == "/health" else info).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            if on_post is not None:
                on_post()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def test_structured_outputs_need_a_server_with_the_tokenizer(tmp_path):
    """A server whose checkpoint directory has no tokenizer cannot mask by a regex: refused when the client starts,
    with the fix."""
    from grpokit import GRPOConfig
    from grpokit.build import build_vllm_engine

    model = build_tiny_model(40, hidden_size=32)
    info = {**served(model.config), "instance": "i", "structured_outputs": False}
    with stand_in_server(info) as url:
        args = GRPOConfig(
            output_dir=str(tmp_path),
            use_vllm=True,
            vllm_mode="server",
            vllm_server_timeout=10,
            vllm_server_base_url=url,
        )
        assert build_vllm_engine(model, args).structured_outputs_regex is None  # without a regex: fine
        args.vllm_structured_outputs_regex = "a+"
        with pytest.raises(
            ValueError,
            match=r"needs a vLLM server with the tokenizer .* has none: save the "
            r"tokenizer into its --model directory",
        ):
            build_vllm_engine(model, args)
        info["structured_outputs"] = True
        assert build_vllm_engine(model, args).structured_outputs_regex == "a+"


def test_a_vision_language_policy_needs_a_server_that_takes_images(tmp_path):
    """The served model is checked by its text model's sizes (a vision-language config keeps them in text_config),
    and a server that does not take images is refused for a vision-language policy when the client starts."""
    from grpokit.testing import build_tiny_vlm

    model, _ = build_tiny_vlm("llava", for_vllm=True)
    text = model.config.get_text_config()
    info = {
        "model_type": "llava",
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "instance": "i",
        "model": "/srv/vlm",
        "images": False,
    }
    check_same_model(model.config, info, "http://h:1")
    with pytest.raises(ValueError, match="model_type: server 'gemma3', policy 'llava'"):
        check_same_model(model.config, {**info, "model_type": "gemma3"}, "http://h:1")
    with stand_in_server(info) as url:
        with pytest.raises(
            ValueError,
            match=r"does not take images \(/srv/vlm\): start it with the "
            r"vision-language policy's checkpoint and processor",
        ):
            VLLMServerEngine(model, url, timeout=10)
        info["images"] = True
        assert VLLMServerEngine(model, url, timeout=10).info["images"]


def test_the_server_refuses_a_vision_language_checkpoint_without_its_processor(tmp_path):
    """`grpokit vllm-serve` reads the checkpoint's config before vLLM starts: a vision-language model without its
    processor (vLLM preprocesses the images) is refused with the fix; /info reports the text model's sizes."""
    from grpokit.testing import build_tiny_vlm
    from grpokit.vllm_server import served_model_info

    model, processor = build_tiny_vlm("gemma3", for_vllm=True)
    model.save_pretrained(tmp_path / "vlm")
    with pytest.raises(
        ValueError,
        match=r"holds a vision-language model \(gemma3\) without its processor.*"
        r"save_pretrained\(DIR\)",
    ):
        served_model_info(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    multimodal, info = served_model_info(tmp_path / "vlm")
    text = model.config.get_text_config()
    assert multimodal and info == {
        "model_type": "gemma3",
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "tie_word_embeddings": True,
        "shape": weight_shape_config(model.config),
    }
    text_model = build_tiny_model(40, hidden_size=32)
    text_model.save_pretrained(tmp_path / "text")
    assert served_model_info(tmp_path / "text") == (
        False,
        {
            "model_type": "qwen2",
            "vocab_size": 40,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "tie_word_embeddings": text_model.config.tie_word_embeddings,
            "shape": weight_shape_config(text_model.config),
        },
    )


def test_images_travel_to_the_server_losslessly():
    import numpy as np
    from PIL import Image

    from grpokit.rollout.vllm_client import image_from_wire, image_to_wire
    from grpokit.testing import solid_image

    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8))
    for image in (solid_image((220, 20, 20)), noisy, noisy.convert("L"), noisy.convert("RGBA")):
        back = image_from_wire(image_to_wire(image))
        assert back.mode == image.mode and back.size == image.size
        assert np.array_equal(np.asarray(back), np.asarray(image))


def lora_model(dtype=None, **lora):
    """A tiny Qwen2 with a LoRA adapter whose B is non-zero (peft starts it at zero: the merge would change nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model(40, hidden_size=32)
    if dtype is not None:
        model = model.to(dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_layers_weight_merged_from_its_pieces_is_peft_merge_bit_for_bit(dtype):
    """What a sharded policy pushes to vLLM (`gathered_weights`: each LoRA layer's W + scaling · B A computed from
    the gathered pieces, the model untouched) is what peft's merge_adapter writes into the weights of a whole model
    (`merged_weights`), bit for bit, with float32 and with bfloat16 weights (peft merges 16-bit adapters on CPU in
    float32). Gathering is the identity on a model that is not sharded, so this is the merge itself."""
    import torch

    from grpokit.rollout.vllm import gathered_weights, merged_weights

    model = lora_model(getattr(torch, dtype), target_modules=["q_proj", "v_proj", "down_proj"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = dict(gathered_weights(model))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is not changed
    with merged_weights(model) as weights:
        peft = {k: v.clone() for k, v in weights}
    assert set(peft) - set(ours) == {"lm_head.weight"}  # tied to the embedding: pushed once, vLLM ties it back
    merged = [k for k in ours if k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))]
    assert len(merged) == 6 and all(k.startswith("model.layers.") for k in ours if "layers" in k)
    for key in ours:
        assert torch.equal(ours[key], peft[key]), key
    # The merge shows: the merged weights differ from the base's.
    base = dict(model.get_base_model().named_parameters())
    assert all(not torch.equal(ours[k], base[k.replace(".weight", ".base_layer.weight")]) for k in merged)


def test_adapters_a_sharded_push_cannot_merge_are_refused():
    from grpokit.rollout.vllm import gathered_weights

    with pytest.raises(
        NotImplementedError,
        match="merges plain LoRA linear layers only; this adapter has a Linear layer with DoRA or a LoRA bias",
    ):
        dict(gathered_weights(lora_model(target_modules=["q_proj"], use_dora=True)))
