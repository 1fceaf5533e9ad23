"""Vision-language models: images in prompts through the codec, the sampler, the training forward, the rewards and
the trainer, on tiny random-weight models of real VLM architectures with their real processors
(`grpokit.testing.build_tiny_vlm`: Gemma 3 and LLaVA).

Shapes: N rows, P prompt tokens (left-padded), T completion tokens.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.batch import TrainBatch
from grpokit.logprobs import can_share_prompts, supports_chunked_head, token_logprobs
from grpokit.multimodal import (
    MultimodalInputs,
    prepare_multimodal_messages,
    vision_module_prefixes,
    vision_parameter_names,
)
from grpokit.rollout import HFEngine, PromptCodec
from grpokit.testing import QWEN_VL_TYPES, VLM_TYPES, build_tiny_qwen_vl, build_tiny_vlm, solid_image

LOGPROB_ATOL = 1e-5  # float32: sampling forwards (KV cache) vs training forward (one pass)
COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220)}
QUESTION = [{"role": "user", "content": "colour?"}]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def colour_rows(copies: int = 1, colours=COLOURS) -> list[dict]:
    """One row per colour; the second image is twice as wide (LLaVA-NeXT tiles it: more image tokens, a longer
    prompt, left padding, pixel tensors of other sizes)."""
    from PIL import Image

    images = [solid_image(rgb) if i == 0 else Image.new("RGB", (32, 16), rgb) for i, rgb in enumerate(colours.values())]
    return [{"prompt": QUESTION, "image": image, "answer": name} for name, image in zip(colours, images)] * copies


def sample(model, processor, rows, generations: int = 3, max_new_tokens: int = 5, seed: int = 0):
    codec = PromptCodec(processor, model)
    prompts = codec.encode(rows, [generations] * len(rows))
    return HFEngine(model).generate(prompts, codec.sampling_params(max_new_tokens), seed), prompts


def training_forward(model, rollout, **options):
    """The training forward's log-probs of the rollout's tokens, renormalised over its sampling mask (the image token
    is suppressed when sampling: the distribution drawn from is the rest of the vocabulary)."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.attention_mask], 1)
    options = {"multimodal": rollout.multimodal, "sampling_mask": rollout.sampling_mask, **options}
    return token_logprobs(model, ids, mask, rollout.completion_ids.shape[1], **options)[0]


def suppressed_ids(rollout) -> torch.Tensor:
    """The tokens the rollout was sampled without (the image token), as an index."""
    mask = rollout.sampling_mask
    return torch.tensor(() if mask is None else mask.suppressed_ids, dtype=torch.long)


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_sampling_logprobs_equal_training_forward(model_type):
    """The sampler's log-probs (prefill once per group with the images, decode from the KV cache) equal the training
    forward's on each path: chunked head or plain logits, prompts shared or not."""
    model, processor = build_tiny_vlm(model_type)
    assert supports_chunked_head(model) and can_share_prompts(model)
    rollout, prompts = sample(model, processor, colour_rows())
    assert rollout.multimodal is not None and len(rollout.multimodal.prompts) == 2  # stored once per prompt
    assert prompts.images is not None and all(len(images) == 1 for images in prompts.images)
    for chunked in (True, False):
        for share in (True, False):
            logprobs = training_forward(model, rollout, chunked=chunked, share_prompts=share)
            difference = ((logprobs - rollout.sampling_logprobs) * rollout.attention_mask).abs().max().item()
            assert difference < LOGPROB_ATOL, (chunked, share, difference)


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_training_forward_equals_model_forward_and_sees_the_image(model_type):
    """Each row's log-probs equal those of the model's own forward on that row alone (unpadded, the processor's
    tensors as it returns them); the shared-prompt forward gives the plain one's gradients; another image changes
    them."""
    model, processor = build_tiny_vlm(model_type)
    rollout, prompts = sample(model, processor, colour_rows(), generations=2)
    logprobs = training_forward(model, rollout)
    for row in range(len(rollout)):
        prompt = prompts.rows()[row]
        completion = rollout.completion_ids[row, : rollout.lengths[row]]
        ids = torch.cat([torch.tensor(prompts.ids[prompt]), completion])[None]
        extra = dict(prompts.processed[prompt])
        if "token_type_ids" in extra:
            extra["token_type_ids"] = torch.cat([extra["token_type_ids"], torch.zeros_like(completion)[None]], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, -len(completion) - 1 : -1]
        logits = logits.index_fill(-1, suppressed_ids(rollout), float("-inf"))  # never sampled
        expected = logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[row, : len(completion)], expected, atol=LOGPROB_ATOL, rtol=0)

    gradients = []
    for share in (True, False):
        model.zero_grad()
        (training_forward(model, rollout, share_prompts=share) * rollout.attention_mask).sum().backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys() and any("vision" in n for n in gradients[0])
    for name in gradients[0]:
        torch.testing.assert_close(gradients[0][name], gradients[1][name], atol=1e-5, rtol=1e-4, msg=name)

    swapped = MultimodalInputs(rollout.multimodal.prompts[::-1], rollout.multimodal.index)
    with torch.no_grad():
        other = training_forward(model, rollout.select(range(len(rollout))))  # the same images: the same values
        torch.testing.assert_close(other, logprobs.detach(), atol=LOGPROB_ATOL, rtol=0)
        rollout.multimodal = swapped
        other = training_forward(model, rollout)
    assert ((other - logprobs.detach()) * rollout.attention_mask).abs().max() > 1e-3


def test_multimodal_inputs_collate_by_hand():
    """Per-token fields are left-padded to the prompt and zero over the completion; per-image tensors are
    concatenated in row order, zero-padded where their sizes differ (as processors pad a batch)."""
    first = {"pixel_values": torch.ones(1, 2, 3), "token_type_ids": torch.tensor([[0, 1, 1]])}
    second = {"pixel_values": torch.full((2, 1, 3), 2.0), "token_type_ids": torch.tensor([[1, 0]])}
    inputs = MultimodalInputs([first, second], torch.tensor([1, 0, 1]))
    out = inputs.model_inputs(None, prompt_width=4, total_width=6)
    assert out["token_type_ids"].tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0]]
    pixels = out["pixel_values"]
    assert pixels.shape == (5, 2, 3)
    assert pixels[:2, 0].eq(2).all() and pixels[:2, 1].eq(0).all() and pixels[2].eq(1).all()
    assert inputs.select(torch.tensor([2, 0])).index.tolist() == [1, 1]
    joined = MultimodalInputs.concat([inputs, MultimodalInputs([first], torch.tensor([0]))])
    assert joined.index.tolist() == [1, 0, 1, 2] and len(joined.prompts) == 3


def test_train_batch_keeps_images_through_select_split_and_checkpoint(tmp_path):
    inputs = MultimodalInputs(
        [{"pixel_values": torch.randn(1, 3, 4, 4)}, {"pixel_values": torch.randn(1, 3, 4, 4)}],
        torch.tensor([0, 0, 1, 1]),
    )
    batch = TrainBatch(
        torch.ones(4, 3, dtype=torch.long),
        torch.ones(4, 3, dtype=torch.long),
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 2, dtype=torch.long),
        torch.ones(4, 2, dtype=torch.long),
        torch.full((4,), 2),
        torch.zeros(4, 2),
        multimodal=inputs,
    )
    shuffled = batch.select(torch.tensor([3, 0, 2, 1]))
    assert [part.multimodal.index.tolist() for part in shuffled.split(2)] == [[1, 0], [1, 0]]
    torch.save(shuffled.state_dict(), tmp_path / "batch.pt")
    restored = TrainBatch.from_state_dict(torch.load(tmp_path / "batch.pt", weights_only=False))
    assert restored.multimodal.index.tolist() == [1, 0, 1, 0]
    assert torch.equal(restored.multimodal.prompts[1]["pixel_values"], inputs.prompts[1]["pixel_values"])


def test_prepare_multimodal_messages_follows_trl():
    image = solid_image((1, 2, 3))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what?"}]
    prepared = prepare_multimodal_messages(messages, [image])
    assert prepared[0]["content"] == [{"type": "text", "text": "be brief"}]
    assert prepared[1]["content"] == [{"type": "image", "image": image}, {"type": "text", "text": "what?"}]
    assert messages[1]["content"] == "what?"  # the dataset's rows are untouched
    with pytest.raises(ValueError, match="placeholder"):
        prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}], [image])


def vlm_config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=3,
        learning_rate=1e-2,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to=[],
        seed=0,
    )
    return GRPOConfig(**{**values, **overrides})


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_trl_style_training_from_a_checkpoint(tmp_path, model_type):
    """TRL's script shape: the checkpoint path loads the VLM class and its processor (AutoProcessor); rewards
    receive the images as a column and the prompts with their image parts; the vision tower stays as it was
    (freeze_vision_tower=True), the language model trains; the reference forward (beta > 0) takes the images too."""
    model, processor = build_tiny_vlm(model_type)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    seen = []

    def colour_reward(completions, completion_ids, answer, image, prompts, **kwargs):
        seen.append((image, prompts))  # right answer, and a varying part so that the weights move in two steps
        rows = zip(completions, completion_ids, answer)
        return [float(c[0]["content"][:1] == a[:1]) + ids[0] / 100 for c, ids, a in rows]

    dataset = Dataset.from_list(colour_rows(copies=2))
    trainer = GRPOTrainer(
        model=str(tmp_path / "vlm"),
        reward_funcs=colour_reward,
        train_dataset=dataset,
        args=vlm_config(tmp_path, beta=0.1, freeze_vision_tower=True),
    )
    assert type(trainer.model) is type(model) and type(trainer.processing_class) is type(processor)
    vision = set(vision_parameter_names(trainer.model))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["kl"])) for r in trainer.state.log_history if "kl" in r)
    images, prompts = seen[0]
    assert len(images) == 4 and images[0].getpixel((0, 0)) in COLOURS.values()
    assert prompts[0][0]["content"][0]["type"] == "image" and prompts[0][0]["content"][0]["image"] is images[0]
    after = dict(trainer.model.named_parameters())
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    assert any(not torch.equal(before[n], p) for n, p in after.items() if n not in vision)


def test_lora_adapts_the_language_model_only(tmp_path):
    """peft's target_modules='all-linear' would adapt the vision tower too; by default grpokit excludes it (the
    vision weights stay bit-identical) with freeze_vision_tower=True; by default (False, as TRL) peft adapts it."""
    from peft import LoraConfig

    model, processor = build_tiny_vlm("gemma3")
    vision_before = {n: p.detach().clone() for n, p in model.named_parameters() if n in vision_parameter_names(model)}
    dataset = Dataset.from_list(colour_rows(copies=2))
    reward = lambda completions, **kwargs: [float(len(c[0]["content"])) for c in completions]  # noqa: E731
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        train_dataset=dataset,
        processing_class=processor,
        args=vlm_config(tmp_path, beta=0.1, freeze_vision_tower=True),
        peft_config=LoraConfig(target_modules="all-linear"),
    )
    adapted = [n for n, _ in trainer.model.named_modules() if n.endswith("lora_A")]
    assert adapted and not any(".vision_tower." in n or ".multi_modal_projector." in n for n in adapted)
    trainer.train()
    base = trainer.model.get_base_model()
    for name, value in vision_before.items():
        assert torch.equal(base.get_parameter(name), value), name

    model, processor = build_tiny_vlm("gemma3")
    assert vision_module_prefixes(model) == ["model.vision_tower", "model.multi_modal_projector"]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        train_dataset=dataset,
        processing_class=processor,
        args=vlm_config(tmp_path),
        peft_config=LoraConfig(target_modules="all-linear"),
    )
    assert any(".vision_tower." in n for n, _ in trainer.model.named_modules() if n.endswith("lora_A"))


def test_image_errors(tmp_path):
    from tests.letters import tiny_letter_model

    dataset = Dataset.from_list(colour_rows())
    reward = lambda completions, **kwargs: [0.0] * len(completions)  # noqa: E731
    model, tokenizer = tiny_letter_model()
    with pytest.raises(ValueError, match=r"image column .*text tokenizer"):
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            train_dataset=dataset,
            processing_class=tokenizer,
            args=vlm_config(tmp_path),
        )
    model, processor = build_tiny_vlm("llava")
    codec = PromptCodec(processor, model, max_prompt_length=8)  # cut text prompts; keep those with images whole
    with pytest.warns(UserWarning, match="not cut"):
        kept = codec.encode([*colour_rows()[:1], {"prompt": [{"role": "user", "content": "a" * 20}]}], [1, 1])
    assert len(kept.ids[0]) == len(PromptCodec(processor, model).encode(colour_rows()[:1], [1]).ids[0]) > 8
    assert len(kept.ids[1]) == 8
    codec = PromptCodec(processor, model)
    with pytest.raises(ValueError, match="conversational prompts"):
        codec.encode([{"prompt": "colour?", "image": solid_image((0, 0, 0))}], [1])


# Learning: the answer depends on the image only (the prompt's text is the same for every row).
TRAIN_SHADES = {
    "red": [(220, 20, 20), (250, 60, 40), (200, 0, 30)],
    "blue": [(20, 20, 220), (40, 60, 250), (0, 30, 200)],
}
HELD_OUT_SHADES = {"red": [(180, 40, 40), (240, 30, 70)], "blue": [(40, 40, 180), (70, 30, 240)]}


def shade_rows(table) -> list[dict]:
    return [
        {"prompt": QUESTION, "image": solid_image(rgb), "answer": name}
        for name, shades in table.items()
        for rgb in shades
    ]


def warm_up(model, processor, steps: int = 30) -> None:
    """A short supervised warm-up: answer 'r' or 'b' whatever the image (chance, 0.5, is where GRPO starts)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION[0]["content"]}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        losses = []
        for letter in "rb":
            for rgb in (TRAIN_SHADES["red"][0], TRAIN_SHADES["blue"][0]):
                inputs = processor(text=[text + letter], images=[[solid_image(rgb)]], return_tensors="pt")
                logits = model(**inputs).logits[0, -2]
                losses.append(torch.nn.functional.cross_entropy(logits[None], inputs["input_ids"][0, -1:]))
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()


def colour_letter(completions, answer, **kwargs):
    return [float(c[0]["content"][:1] == a[:1]) for c, a in zip(completions, answer)]


def learn_colours(tmp_path, model_type: str, model=None, processor=None, steps: int = 30, **config):
    """The colour task from a warmed-up model (`build_tiny_vlm(model_type)` unless given): (held-out reward before,
    after, the training rewards, the trainer). `config`: more GRPOConfig fields (use_vllm=True, ...)."""
    if model is None:
        model, processor = build_tiny_vlm(model_type)
    warm_up(model, processor)
    args = vlm_config(
        tmp_path,
        per_device_train_batch_size=24,
        num_generations=8,
        max_completion_length=1,
        max_steps=steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        num_generations_eval=16,
        per_device_eval_batch_size=64,
        **config,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=processor,
        reward_funcs=colour_letter,
        args=args,
        train_dataset=Dataset.from_list(shade_rows(TRAIN_SHADES)),
        eval_dataset=Dataset.from_list(shade_rows(HELD_OUT_SHADES)),
    )
    before = trainer.evaluate()["eval/reward"]
    trainer.train()
    after = trainer.evaluate()["eval/reward"]
    return before, after, [r["reward"] for r in trainer.state.log_history if "reward" in r], trainer


@pytest.mark.parametrize("model_type", ["gemma3", pytest.param("llava", marks=pytest.mark.slow)])
def test_learns_the_colour_of_the_image(tmp_path, model_type):
    """Name the colour of a solid image (first letter: r / b): held-out shades go from chance to >= 0.65 in 30
    steps (measured: Gemma 3 0.52 -> 0.88, LLaVA 0.55 -> 0.75)."""
    before, after, rewards, _ = learn_colours(tmp_path, model_type)
    assert before <= 0.6 and after >= 0.65, (before, after)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


@pytest.mark.parametrize("model_type", QWEN_VL_TYPES)
def test_qwen_vl_positions_sampling_and_training_forward(model_type):
    """Qwen2-VL / Qwen2.5-VL place tokens with 3D M-RoPE positions computed from the image grids: the sampler
    (prefill once per group, then text positions continuing from the largest 3D one) and the training forward
    (every path) give the model's own forward's log-probs. Their processors cannot be built here (torchvision), so
    the prompts are encoded as the processor would (`build_tiny_qwen_vl`)."""
    from grpokit.rollout import PromptBatch, SamplingParams

    model, encode = build_tiny_qwen_vl(model_type)
    assert supports_chunked_head(model) and can_share_prompts(model)
    encoded = [encode([3, 10, 11], [solid_image(rgb)]) for rgb in COLOURS.values()]
    encoded.append(encode([3, 12], [solid_image((0, 200, 0)), solid_image((90, 90, 90))]))  # two images, shorter
    prompts = PromptBatch(
        ids=[ids for ids, _ in encoded],
        counts=[2, 2, 2],
        raw=[None] * 3,
        images=[[], [], []],
        processed=[tensors for _, tensors in encoded],
    )
    params = SamplingParams(max_new_tokens=4, eos_token_ids=(1,), pad_token_id=0, suppress_token_ids=(60,))
    rollout = HFEngine(model).generate(prompts, params, seed=0)
    for chunked in (True, False):
        for share in (True, False):
            logprobs = training_forward(model, rollout, chunked=chunked, share_prompts=share)
            difference = ((logprobs - rollout.sampling_logprobs) * rollout.attention_mask).abs().max().item()
            assert difference < LOGPROB_ATOL, (chunked, share, difference)
    for row in range(len(rollout)):  # the model's own forward: it computes its 3D positions itself
        prompt = prompts.rows()[row]
        completion = rollout.completion_ids[row, : rollout.lengths[row]]
        ids = torch.cat([torch.tensor(prompts.ids[prompt]), completion])[None]
        extra = dict(prompts.processed[prompt])
        extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"], torch.zeros_like(completion)[None]], 1)
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, -len(completion) - 1 : -1]
        logits = logits.index_fill(-1, suppressed_ids(rollout), float("-inf"))  # never sampled
        expected = logits.log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[row, : len(completion)], expected, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("log_multimodal", [True, False])
def test_log_multimodal_writes_images_to_the_completions_log_and_report(tmp_path, log_multimodal):
    import json

    from grpokit.report import write_report

    model, processor = build_tiny_vlm("llava")
    reward = lambda completions, **kwargs: [float(len(c[0]["content"])) for c in completions]  # noqa: E731
    args = vlm_config(tmp_path, max_steps=1, log_completions=True, log_multimodal=log_multimodal)
    GRPOTrainer(
        model=model,
        reward_funcs=reward,
        train_dataset=Dataset.from_list(colour_rows(copies=2)),
        processing_class=processor,
        args=args,
    ).train()
    output = tmp_path / "out"
    records = [json.loads(line) for line in (output / "completions.jsonl").read_text().splitlines()]
    assert records and all(r["prompt"][0]["content"][0] == {"type": "image"} for r in records)  # no pixels inlined
    html = write_report(output).read_text()
    if not log_multimodal:
        assert not any("images" in r for r in records) and 'class="prompt-image"' not in html
        return
    from PIL import Image

    for record in records:
        (name,) = record["images"]
        with Image.open(output / name) as image:
            assert image.getpixel((0, 0)) in COLOURS.values()
    assert html.count('class="prompt-image"') == min(len(records), 4)


def test_example_script_trains_two_steps_and_saves(tmp_path):
    """examples/grpo_vlm.py (TRL's script shape) with --tiny: two steps, then the model and its processor are saved
    and load back as the VLM class and AutoProcessor."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_vlm.py"
    spec = importlib.util.spec_from_file_location("grpo_vlm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    output = tmp_path / "run"
    trainer = example.main(["--tiny", "--max_steps", "2", "--output_dir", str(output)])
    assert trainer.state.global_step == 2
    reloaded = AutoModelForImageTextToText.from_pretrained(output)
    assert (
        type(reloaded) is type(trainer.model)
        and type(AutoProcessor.from_pretrained(output)).__name__ == "Gemma3Processor"
    )
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def test_images_are_encoded_once_per_group():
    """The vision tower sees each prompt's image once in the sampling prefill and once in the shared-prompt
    training forward (G times without sharing)."""
    model, processor = build_tiny_vlm("gemma3")
    encoded = []

    def count(module, args, kwargs, output):
        encoded.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    model.model.vision_tower.register_forward_hook(count, with_kwargs=True)
    rollout, _ = sample(model, processor, colour_rows(), generations=4)
    assert encoded == [2]  # one prefill for the two groups of 4 rows
    for share, expected in ((True, 2), (False, 8)):
        encoded.clear()
        training_forward(model, rollout, share_prompts=share)
        assert encoded == [expected], share


def test_every_vlm_with_a_chunked_head_is_compared_with_its_plain_head_here():
    from grpokit.logprobs import CHUNKED_HEAD_VLM_TYPES

    assert set(VLM_TYPES) | set(QWEN_VL_TYPES) == CHUNKED_HEAD_VLM_TYPES


@pytest.mark.parametrize("model_type", ["gemma3", "llava"])
def test_rows_without_images_mix_with_rows_with_images(model_type):
    """A row whose image is None is a text prompt; in one batch with image rows, each row's log-probs are still
    the model's own forward's (the images go to the image rows' tokens, in order)."""
    model, processor = build_tiny_vlm(model_type)
    rows = [{"prompt": QUESTION, "image": None}, *colour_rows()]
    rollout, prompts = sample(model, processor, rows, generations=2)
    assert prompts.processed[0] == {} and prompts.images[0] == [] and len(prompts.images[1]) == 1
    logprobs = training_forward(model, rollout, share_prompts=False)
    difference = ((logprobs - rollout.sampling_logprobs) * rollout.attention_mask).abs().max().item()
    assert difference < LOGPROB_ATOL
    completion = rollout.completion_ids[0, : rollout.lengths[0]]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([torch.tensor(prompts.ids[0]), completion])[None]).logits[0]
    logits = logits.index_fill(-1, suppressed_ids(rollout), float("-inf"))  # never sampled
    expected = logits[-len(completion) - 1 : -1].log_softmax(-1).gather(-1, completion[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[0, : len(completion)], expected, atol=LOGPROB_ATOL, rtol=0)


def test_images_given_as_paths_or_bytes_encode_as_the_images_themselves(tmp_path):
    import io

    model, processor = build_tiny_vlm("llava")
    image = solid_image((10, 200, 30))
    image.save(tmp_path / "green.png")
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    codec = PromptCodec(processor, model)
    batches = [
        codec.encode([{"prompt": QUESTION, "images": [source]}], [1])
        for source in (image, str(tmp_path / "green.png"), {"bytes": encoded.getvalue(), "path": None})
    ]
    for batch in batches[1:]:
        assert batch.ids == batches[0].ids
        torch.testing.assert_close(batch.processed[0]["pixel_values"], batches[0].processed[0]["pixel_values"])
    with pytest.raises(TypeError, match="PIL image or a path"):
        codec.encode([{"prompt": QUESTION, "image": 3}], [1])
    # Issue 39: an image that cannot be decoded is named by its row and column (it was PIL's "cannot identify image
    # file <_io.BytesIO ...>", naming neither).
    rows = [{"prompt": QUESTION, "images": [image]}, {"prompt": QUESTION, "images": [image, b"\x89PNG broken"]}]
    with pytest.raises(
        ValueError,
        match=r"The image at row 1 of this batch \(prompt .*colour\?.*\), column 'images' "
        r"\(item 1\) cannot be read \(11 bytes: cannot identify image file",
    ):
        codec.encode(rows, [1, 1])
    with pytest.raises(ValueError, match=r"row 0 of this batch .*column 'image' cannot be read \(.*missing.png"):
        codec.encode([{"prompt": QUESTION, "image": str(tmp_path / "missing.png")}], [1])


@pytest.mark.parametrize("model_type", VLM_TYPES)
def test_context_length_is_the_language_models(model_type):
    """A VLM's config keeps max_position_embeddings in its text config: a completion longer than that is refused
    before anything runs, and prompts are cut so that prompt + completion fits."""
    from grpokit.models import prompt_length_limit

    model, _ = build_tiny_vlm(model_type)
    positions = model.config.get_text_config().max_position_embeddings
    with pytest.raises(ValueError, match=f"{positions} positions"):
        prompt_length_limit(model, GRPOConfig(max_completion_length=positions, max_prompt_length=None))
    limit = prompt_length_limit(model, GRPOConfig(max_completion_length=12))
    assert limit == positions - 12 and f"the model's {positions} positions" in limit.reason


@pytest.mark.vllm  # needs torchvision (Qwen-VL processors build a video processor), which only the vLLM environment has
@pytest.mark.parametrize("model_type", QWEN_VL_TYPES)
def test_qwen_vl_learns_the_colour_through_its_real_processor(tmp_path, model_type):
    """Qwen2-VL / Qwen2.5-VL with their real processor and chat template through GRPOTrainer (in-process engine):
    the processor expands each image into its merged patches, the trainer's forwards take 3D M-RoPE positions, and
    the colour task is learned: held-out accuracy up by 0.2 or more to >= 0.9 in 40 steps."""
    from grpokit.testing import build_tiny_qwen_vl_with_processor

    model, processor = build_tiny_qwen_vl_with_processor(model_type)
    before, after, _, _ = learn_colours(tmp_path, model_type, model, processor, steps=40)
    print(f"{model_type} (real processor, in-process engine): held-out reward {before:.2f} -> {after:.2f}")
    assert after >= 0.9 and after >= before + 0.2, (before, after)


@pytest.mark.parametrize("model_type", [*VLM_TYPES, "qwen2_vl"])
def test_static_decoding_with_images_samples_what_the_default_decoder_samples(model_type, monkeypatch):
    """cache_implementation='static' (`rollout/static.py`) with image prompts: the prefill (eager, with the images,
    M-RoPE positions for Qwen2-VL) is copied into the static cache and the decode steps continue from it; the same
    tokens as the default decoder and log-probs within float32 rounding. The decode steps take the packed one-token
    attention through the text config (what the compiled step runs on a GPU); the vision tower keeps SDPA."""
    from grpokit.rollout import PromptBatch, SamplingParams, fast

    query_lengths = []
    original = fast.one_token_attention_forward
    monkeypatch.setattr(
        fast, "one_token_attention_forward", lambda *a, **k: query_lengths.append(a[1].shape[2]) or original(*a, **k)
    )
    fast._register_one_token_attention.cache_clear()  # registers the spy

    if model_type != "qwen2_vl":
        model, processor = build_tiny_vlm(model_type)
        codec = PromptCodec(processor, model)
        prompts = codec.encode(colour_rows(), [3, 3])
        params = codec.sampling_params(6)
    else:
        model, encode = build_tiny_qwen_vl(model_type)
        encoded = [encode([3, 10, 11], [solid_image(rgb)]) for rgb in COLOURS.values()]
        prompts = PromptBatch(
            ids=[ids for ids, _ in encoded],
            counts=[3, 3],
            raw=[None] * 2,
            images=[[], []],
            processed=[tensors for _, tensors in encoded],
        )
        params = SamplingParams(max_new_tokens=6, eos_token_ids=(1,), pad_token_id=0, suppress_token_ids=(60,))
    default = HFEngine(model).generate(prompts, params, seed=0)
    assert not query_lengths  # the default decoder leaves multimodal models on SDPA
    engine = HFEngine(model, cache_implementation="static")
    try:
        static = engine.generate(prompts, params, seed=0)
    finally:
        monkeypatch.setattr(fast, "one_token_attention_forward", original)
        fast._register_one_token_attention.cache_clear()
        fast._register_one_token_attention()  # the real function again
    assert engine.static.cache is not None
    assert 1 in query_lengths and model.config.get_text_config()._attn_implementation == "sdpa"
    assert torch.equal(static.completion_ids, default.completion_ids)
    assert (static.sampling_logprobs - default.sampling_logprobs).abs().max() <= LOGPROB_ATOL
