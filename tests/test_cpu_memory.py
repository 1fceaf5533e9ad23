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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_leave_the_process_only_with_large_allocations_mapped():
    pytest.importorskip("psutil")
    released = {}
    for mode in ("default", "fixed"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        released[mode] = float(out.stdout.strip().splitlines()[-1])
    assert released["fixed"] > 7, released  # the 8 MiB tensor went back to the OS
    assert released["default"] < 1, released  # glibc kept it: what the fix is for


def test_the_trainer_fixes_the_threshold_on_the_cpu(monkeypatch, tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer, trainer
    from grpokit.testing import save_tiny_model

    calls = []
    monkeypatch.setattr(trainer, "keep_large_allocations_mapped", lambda: calls.append(1) or True)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, use_cpu=True, report_to="none")
    GRPOTrainer(model=str(save_tiny_model(tmp_path / "tiny")), args=args, train_dataset=[{"prompt": "ab"}] * 4,
                reward_funcs=lambda completions, **kw: [0.0] * len(completions))  # fmt: skip
    assert calls == [1]


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
    out = subprocess.run([sys.executable, "-c", IMPORTS_SCRIPT, model, str(tmp_path / "out")], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "[]"
