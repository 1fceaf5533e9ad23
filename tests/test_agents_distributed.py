"""Agents in two processes (torchrun, gloo, CPU) against one: the same update from the same multi-turn rollouts,
and the tool metrics counted over both processes."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from ports import free_port
from test_distributed import load, max_difference, run_in_this_process, run_launcher

# Several training processes: `python -m pytest -m distributed` runs them (.ci/run does, after the default suite).
pytestmark = pytest.mark.distributed

TESTS = str(Path(__file__).resolve().parent)

SCRIPT = textwrap.dedent(
    f'''
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {TESTS!r})

    import torch
    from datasets import Dataset

    from agents_helpers import TABLE, call_text, key_of, lookup, tiny_agent_model, tool_call_script
    from grpokit import GRPOConfig, GRPOTrainer

    RANK = int(os.environ.get("RANK", 0))


    class Scratchpad:
        """An environment whose note tool the scripted policy calls on some rows; its reward counts the notes."""

        def reset(self, **row):
            self.notes = []

        def note(self, text: str) -> str:
            """Write a note.

            Args:
                text: what to write
            """
            self.notes.append(text)
            return "noted"

        def get_reward(self) -> float:
            return float(len(self.notes))


    def turns(user, results, index):
        if not results:
            return call_text("lookup", {{"key": key_of(user)}}) if index % 2 == 0 else \\
                call_text("note", {{"text": key_of(user)}}) if index == 1 else "v00<|im_end|>"
        return f"{{results[-1]}}<|im_end|>" if index < 2 else "v1<|im_end|>"


    def main(spec_path):
        spec = json.loads(Path(spec_path).read_text())[0]
        model, tokenizer = tiny_agent_model()
        engine = tool_call_script(tokenizer, turns)

        def correct(completions, key, **kwargs):
            return [float(c[-1]["content"] == TABLE[k]) for c, k in zip(completions, key)]

        args = GRPOConfig(output_dir=spec["out"], per_device_train_batch_size=spec["batch"], num_generations=4,
                          max_steps=1, max_completion_length=48, learning_rate=1e6, adam_epsilon=1e6,
                          max_grad_norm=0.0, lr_scheduler_type="constant", loss_type="dapo", logging_steps=1,
                          save_strategy="no", disable_tqdm=True, report_to="none", seed=0, shuffle_dataset=False)
        data = Dataset.from_list([{{"prompt": [{{"role": "user", "content": f"key {{k}}"}}], "key": k}}
                                  for k in ("k3", "k12")])
        trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data,
                              processing_class=tokenizer, tools=[lookup], environment_factory=Scratchpad,
                              rollout_engine=engine)
        trainer.train()
        torch.save({{"weights": {{k: v.detach().clone() for k, v in trainer.unwrapped_model.state_dict().items()}},
                    "log": trainer.state.log_history[0]}}, Path(spec["out"]) / f"weights_{{RANK}}.pt")


    if __name__ == "__main__":
        main(sys.argv[1])
    '''
)


def write(directory, spec):
    (directory / "run.py").write_text(SCRIPT)
    (directory / "spec.json").write_text(json.dumps([spec]))
    return str(directory / "run.py"), str(directory / "spec.json")


def test_two_processes_make_the_update_of_one_from_multi_turn_rollouts(tmp_path):
    from grpokit.testing import build_tiny_model  # noqa: F401  (the script builds the same seeded model)

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    script, spec = write(two, {"out": str(two), "batch": 4})
    run_launcher(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            script,
            spec,
        ],
        env={"PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])},
    )
    # the single-process reference runs the same script in this process
    run_in_this_process(one, {"out": str(one), "batch": 8}, script=SCRIPT)
    reference, rank0, rank1 = (
        load(path) for path in (one / "weights_0.pt", two / "weights_0.pt", two / "weights_1.pt")
    )
    from agents_helpers import tiny_agent_model

    initial = tiny_agent_model()[0].state_dict()
    moved = max_difference(reference["weights"], initial)
    assert moved > 1e-2
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(rank0["weights"], reference["weights"]) < 1e-5 * moved
    for name in (
        "loss",
        "reward",
        "tools/call_frequency",
        "tools/failure_frequency",
        "tools/lookup/call_frequency",
        "tools/note/call_frequency",
        "rewards/Scratchpad/mean",
        "rewards/correct/mean",
    ):
        assert rank0["log"][name] == pytest.approx(reference["log"][name], abs=1e-6), name
    assert reference["log"]["tools/call_frequency"] == 0.75 and reference["log"]["rewards/Scratchpad/mean"] == 0.25
