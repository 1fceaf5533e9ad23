"""glibc's malloc keeps freed tensor memory in the process unless large allocations stay mapped
(grpokit/cpu_memory.py): a freed tensor below a live one is returned to the OS only with the fix."""

import subprocess
import sys

import pytest

SCRIPT = """
import sys, psutil, torch
from grpokit.cpu_memory import keep_large_allocations_mapped
if sys.argv[1] == "fixed":
    assert keep_large_allocations_mapped()
rss = lambda: psutil.Process().memory_info().rss / 2**20
first = torch.ones(16 * 2**18); del first  # 16 MiB: glibc raises its mmap threshold to that on this free
below = torch.ones(8 * 2**18)  # 8 MiB: from the heap, unless fixed
above = torch.ones(2**18)  # 1 MiB after it
before = rss()
del below
print(before - rss())
"""


def script_numbers(script: str, mode: str) -> list[float]:
    """The numbers on the last line a script prints, run in a fresh interpreter (the allocator's settings are the
    whole process's)."""
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
    return [float(value) for value in out.stdout.strip().splitlines()[-1].split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_leave_the_process_only_with_large_allocations_mapped():
    pytest.importorskip("psutil")
    released = {mode: script_numbers(SCRIPT, mode)[0] for mode in ("default", "fixed")}
    assert released["fixed"] > 7, released  # the 8 MiB tensor went back to the OS
    assert released["default"] < 1, released  # glibc kept it: what the fix is for


def test_the_trainer_fixes_the_threshold_on_the_cpu(monkeypatch, tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer, build
    from grpokit.testing import save_tiny_model

    calls = []
    monkeypatch.setattr(build, "keep_large_allocations_mapped", lambda: calls.append(1) or True)  # the set-up's call
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        report_to="none",
    )
    GRPOTrainer(
        model=str(save_tiny_model(tmp_path / "tiny")),
        args=args,
        train_dataset=[{"prompt": "ab"}] * 4,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
    )
    assert calls == [1]


REUSE_SCRIPT = """
import resource, sys, psutil, torch
from grpokit.cpu_memory import keep_large_allocations_mapped, reuse_activation_memory
rss = lambda: psutil.Process().memory_info().rss / 2**20
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
assert keep_large_allocations_mapped()  # the set-up's setting
pieces = [torch.ones(2**17) for _ in range(400)]  # 200 MiB of 512 KiB tensors: from the heap
kept = pieces[1::2]  # every other one stays: the freed ones lie between live ones, which brk cannot return
del pieces
before = rss()
assert reuse_activation_memory()
released = before - rss()

def new_faults():  # page faults of writing a new 8 MiB tensor, the size of a layer's activations
    start = faults()
    torch.ones(2**21)
    return faults() - start

if sys.argv[1] == "setup":
    keep_large_allocations_mapped()  # back to 1 MiB: each new 8 MiB tensor is a fresh mapping
new_faults()
print(released, min(new_faults() for _ in range(5)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_training_returns_the_setups_free_heap_and_reuses_activation_memory():
    pytest.importorskip("psutil")
    runs = {mode: script_numbers(REUSE_SCRIPT, mode) for mode in ("training", "setup")}
    released, training_faults = runs["training"]
    assert released > 80, runs  # most of the 100 MiB freed between live tensors went back to the OS
    assert training_faults < 64, runs  # heap memory reused: no fault per 4 KiB page
    assert runs["setup"][1] >= 2048, runs  # a fresh mapping: one fault per 4 KiB page of 8 MiB


def test_the_trainer_reuses_activation_memory_when_training_starts_on_the_cpu(monkeypatch, tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer, trainer
    from grpokit.testing import save_tiny_model

    calls = []
    monkeypatch.setattr(trainer, "reuse_activation_memory", lambda: calls.append(1) or True)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    run = GRPOTrainer(
        model=str(save_tiny_model(tmp_path / "tiny")),
        args=args,
        train_dataset=[{"prompt": "ab"}] * 4,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
    )
    assert calls == []  # not while the weights load
    run.train()
    assert calls == [1]


HOLES_SCRIPT = """
import sys, psutil, torch
from grpokit.cpu_memory import keep_large_allocations_mapped, return_free_memory, reuse_activation_memory
rss = lambda: psutil.Process().memory_info().rss / 2**20
assert keep_large_allocations_mapped() and reuse_activation_memory()  # the training loop's setting
pieces = [torch.ones(2**17) for _ in range(400)]  # 200 MiB of 512 KiB tensors (a rollout's): from the heap
kept = pieces[1::2]  # every other one lives on: the freed ones are holes between live tensors
del pieces
before = rss()
if sys.argv[1] == "return":
    assert return_free_memory()
print(before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_return_free_memory_gives_back_the_holes_between_live_tensors_in_the_training_loop():
    pytest.importorskip("psutil")
    released = {mode: script_numbers(HOLES_SCRIPT, mode)[0] for mode in ("return", "keep")}
    assert released["return"] > 80, released  # most of the 100 MiB of holes went back to the OS
    assert released["keep"] < 5, released  # the loop's setting keeps them otherwise: what the trainer's calls are for


@pytest.mark.parametrize("model_bytes_over_threshold", [True, False])
def test_the_trainer_returns_free_memory_after_the_rollout_and_the_no_grad_forwards_for_a_large_model(
    monkeypatch, tmp_path, model_bytes_over_threshold
):
    from transformers import AutoModelForCausalLM

    from grpokit import GRPOConfig, GRPOTrainer, cpu_memory, experience
    from grpokit.testing import save_tiny_model

    model = str(save_tiny_model(tmp_path / "tiny"))
    model_bytes = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    monkeypatch.setattr(
        cpu_memory, "PHASE_TRIM_MIN_MODEL_BYTES", model_bytes + (0 if model_bytes_over_threshold else 1)
    )
    events = []
    monkeypatch.setattr(experience, "return_free_memory", lambda: events.append("free") or True)
    logprobs_in_chunks = experience.logprobs_in_chunks
    monkeypatch.setattr(
        experience,
        "logprobs_in_chunks",
        lambda *a, **k: events.append("logprobs_in_chunks") or logprobs_in_chunks(*a, **k),
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        beta=0.04,
    )
    run = GRPOTrainer(
        model=model,
        args=args,
        train_dataset=[{"prompt": "ab"}] * 8,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
    )
    sample = run.experience.sample
    monkeypatch.setattr(run.experience, "sample", lambda *a, **k: events.append("sample") or sample(*a, **k))
    run.train()
    # Per step: the rollout, its free pages returned, the reference's forward, its free pages returned; for a model
    # below the threshold, nothing returned.
    expected = ["sample", "free", "logprobs_in_chunks", "free"] * 2
    assert events == (expected if model_bytes_over_threshold else [e for e in expected if e != "free"])


IMPORTS_SCRIPT = """
import sys
from grpokit import GRPOConfig, GRPOTrainer
args = GRPOConfig(output_dir=sys.argv[2], per_device_train_batch_size=4, num_generations=4, max_completion_length=2,
                  max_steps=2, save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True)
trainer = GRPOTrainer(model=sys.argv[1], args=args, train_dataset=[{"prompt": "ab"}] * 8,
                      reward_funcs=lambda completions, **kw: [0.0] * len(completions))
trainer.train()
print(sorted(name for name in ("deepspeed", "mlflow") if name in sys.modules))
"""


def test_a_run_without_deepspeed_does_not_import_it(tmp_path):
    # accelerate's unwrap_model imports DeepSpeed wherever it is installed, and DeepSpeed imports MLflow: ~55 MiB
    # resident in a run that uses neither (grpokit.distributed.unwrap_model). transformers' save_pretrained still
    # does, so a run that saves pays it at its first checkpoint.
    pytest.importorskip("deepspeed")
    from grpokit.testing import save_tiny_model

    model = str(save_tiny_model(tmp_path / "tiny"))
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS_SCRIPT, model, str(tmp_path / "out")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_chunked_head_returns_free_memory_first_on_the_cpu(monkeypatch):
    import torch

    from grpokit import logprobs

    calls = []
    monkeypatch.setattr(logprobs, "return_free_memory", lambda: calls.append(1) or True)
    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(32, 8)
    expected = torch.log_softmax(hidden @ weight.t(), -1)[torch.arange(6), torch.arange(6)]
    # One chunk of 6 rows x 32 float32 logits is 768 bytes: trimmed for when that reaches HEAD_TRIM_MIN_BYTES.
    for min_bytes, trims in ((768, [1]), (769, [])):
        monkeypatch.setattr(logprobs, "HEAD_TRIM_MIN_BYTES", min_bytes)
        calls.clear()
        values, _ = logprobs.chunked_token_logprobs(hidden, weight, torch.arange(6))
        assert calls == trims  # before the head's [c, V] tensors, once per call
        torch.testing.assert_close(values, expected)
    # A chunk of 4 rows is 512 bytes, whatever the number of rows.
    monkeypatch.setattr(logprobs, "HEAD_TRIM_MIN_BYTES", 513)
    calls.clear()
    logprobs.chunked_token_logprobs(hidden, weight, torch.arange(6), chunk_rows=4)
    assert calls == []


def test_the_backward_trims_only_where_the_gradients_are_large(monkeypatch):
    import torch

    from grpokit import cpu_memory
    from grpokit.testing import build_tiny_model

    model = build_tiny_model(16, hidden_size=32, num_layers=2)
    gradient_bytes = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(cpu_memory, "BACKWARD_TRIM_MIN_GRADIENT_BYTES", gradient_bytes + 1)
    assert cpu_memory.trim_heap_in_backward(model) == 0
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters have no gradient
    monkeypatch.setattr(cpu_memory, "BACKWARD_TRIM_MIN_GRADIENT_BYTES", gradient_bytes - 16 * 32 * 4 + 1)
    assert cpu_memory.trim_heap_in_backward(model) == 0
    model.model.embed_tokens.weight.requires_grad_(True)
    assert cpu_memory.trim_heap_in_backward(model) == 2  # a hook per decoder layer
    trims = []
    monkeypatch.setattr(cpu_memory, "return_free_memory", lambda: trims.append(1) or True)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert trims == [1, 1]
