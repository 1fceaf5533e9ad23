"""Tools and environments that misbehave (issue 39): a hung call costs its own row and nothing else, never the
process's exit; an environment whose call timed out never scores another rollout; a huge result is cut before it is
tokenized; a result that cannot become text is a failure."""

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from agents_helpers import TABLE, call_text, key_of, lookup, tiny_agent_model, tool_call_script

from grpokit.agents import Agents, EnvironmentPool, ToolRunner, ToolStats

ROOT = Path(__file__).resolve().parents[1]


class FakeAccelerator:  # ToolStats.metrics needs only these in one process
    num_processes, device = 1, "cpu"


def params(tokenizer, max_new_tokens=64):
    from grpokit.rollout import SamplingParams

    return SamplingParams(
        max_new_tokens=max_new_tokens, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id
    )


@pytest.fixture
def released():
    """An event the hanging tools wait on, set when the test ends (so their threads end too)."""
    event = threading.Event()
    yield event
    event.set()


def test_a_hung_sync_tool_never_makes_a_healthy_tool_fail(released):
    def hang(key: str) -> str:
        """Never answers (until the test ends).

        Args:
            key: anything
        """
        released.wait()
        return "late"

    runner, stats = ToolRunner(timeout=0.2), ToolStats()
    tools = {"hang": hang, "lookup": lookup}
    started = time.perf_counter()
    for turn in range(12):  # more hung calls than the 8 workers the shared pool had
        messages = runner.run([("hang", {"key": "k1"}), ("lookup", {"key": f"k{turn}"})], tools, stats)
        assert messages[1]["content"] == TABLE[f"k{turn}"]
    # Each turn waits for its own hung call only: 12 x 0.2 s, not queued behind the earlier hung calls.
    assert time.perf_counter() - started < 12 * 0.2 + 2.0
    metrics = stats.metrics(FakeAccelerator(), ["hang", "lookup"])
    assert metrics["tools/lookup/failure_frequency"] == 0.0 and metrics["tools/hang/failure_frequency"] == 1.0


def test_an_async_tool_that_blocks_the_loop_is_named_and_moved_off_it(released):
    async def blocking(key: str) -> str:
        """Blocks its event loop (a blocking call inside async def).

        Args:
            key: anything
        """
        released.wait()
        return "late"

    async def async_lookup(key: str) -> str:
        """Look up a value, asynchronously.

        Args:
            key: the key to look up
        """
        await asyncio.sleep(0.01)
        return TABLE[key]

    runner, stats = ToolRunner(timeout=0.3), ToolStats()
    tools = {"blocking": blocking, "async_lookup": async_lookup}
    with pytest.warns(UserWarning, match="The async tool 'blocking' blocked the event loop"):
        first = runner.run([("blocking", {"key": "k1"})], tools, stats)
    assert "timed out" in first[0]["content"]
    for turn in range(6):  # the healthy async tool beside the blocking one, on a loop the blocking one left
        messages = runner.run([("blocking", {"key": "k1"}), ("async_lookup", {"key": f"k{turn}"})], tools, stats)
        assert messages[1]["content"] == TABLE[f"k{turn}"]
    metrics = stats.metrics(FakeAccelerator(), ["blocking", "async_lookup"])
    assert metrics["tools/async_lookup/failure_frequency"] == 0.0 and metrics["tools/blocking/failure_frequency"] == 1.0


def test_the_process_exits_promptly_with_tools_that_never_return(tmp_path):
    script = textwrap.dedent('''
        import threading, time
        from grpokit.agents.tools import ToolRunner, ToolStats

        def forever(key: str) -> str:
            """Never returns.

            Args:
                key: anything
            """
            threading.Event().wait()

        async def forever_async(key: str) -> str:
            """Blocks its event loop forever.

            Args:
                key: anything
            """
            threading.Event().wait()

        runner = ToolRunner(timeout=0.2)
        tools = {"forever": forever, "forever_async": forever_async}
        for _ in range(3):
            runner.run([("forever", {"key": "a"}), ("forever_async", {"key": "b"})], tools, ToolStats())
        print("ran", time.monotonic(), flush=True)
    ''')
    (tmp_path / "hang.py").write_text(script)
    process = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(tmp_path / "hang.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=120)  # imports on a loaded machine; a hang is forever
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("the process did not exit: a tool call that never returns held it")
    assert process.returncode == 0, stderr
    ran_at = float(stdout.split()[-1])
    assert time.monotonic() - ran_at < 10.0  # from the last line to the exit: nothing waited for the hung threads


class Unprintable:
    def __str__(self):
        raise ValueError("no text for this")


def test_a_result_that_str_fails_on_is_a_failure_not_a_crash():
    def odd(key: str) -> object:
        """Returns an object that cannot become text.

        Args:
            key: anything
        """
        return Unprintable()

    runner, stats = ToolRunner(timeout=5.0), ToolStats()
    messages = runner.run([("odd", {"key": "k1"}), ("lookup", {"key": "k2"})], {"odd": odd, "lookup": lookup}, stats)
    assert "returned a Unprintable that str() fails on: ValueError('no text for this')" in messages[0]["content"]
    assert messages[1]["content"] == TABLE["k2"]
    assert stats.failures == {"odd": 1}


def huge(key: str) -> str:
    """Returns a lot of text.

    Args:
        key: anything
    """
    return "x" * 5_000_000


def test_a_long_result_is_cut_before_tokenizing_and_counted():
    _, tokenizer = tiny_agent_model()
    runner = Agents(tokenizer, tools=[huge, lookup], max_completion_length=2000, max_tool_output_chars=300)
    turns = {"k1": call_text("huge", {"key": "k1"}), "k2": call_text("lookup", {"key": "k2"})}
    engine = tool_call_script(
        tokenizer, lambda user, results, index: turns[key_of(user)] if not results else "answer<|im_end|>"
    )
    rows = [{"prompt": [{"role": "user", "content": f"key {k}"}]} for k in turns]
    _, completions = runner.rollout(engine, rows, params(tokenizer, 2000), seed=0)
    assert completions[0][1]["content"] == "x" * 300 + "\n[... 4999700 more characters cut: max_tool_output_chars=300]"
    assert completions[1][1]["content"] == TABLE["k2"]
    metrics = runner.metrics(FakeAccelerator())
    assert metrics["tools/truncated_frequency"] == 0.5 and metrics["tools/failure_frequency"] == 0.0


def test_peak_memory_stays_bounded_with_a_5_mb_tool_result(tmp_path):
    """In a process of its own, so that its peak resident memory is this rollout's."""
    script = textwrap.dedent("""
        import json, resource, sys
        sys.path.insert(0, "tests")
        from agents_helpers import call_text, tiny_agent_model, tool_call_script
        from test_agent_faults import FakeAccelerator, huge, params
        from grpokit.agents import Agents

        _, tokenizer = tiny_agent_model()
        runner = Agents(tokenizer, tools=[huge], max_completion_length=64, max_tool_output_chars=100_000)
        engine = tool_call_script(tokenizer, lambda user, results, index: call_text("huge", {"key": "k"}))
        rows = [{"prompt": [{"role": "user", "content": "key k1"}]}]
        runner.rollout(engine, rows, params(tokenizer), seed=0)  # warm: the tokenizer's and the loop's first use
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        runner.rollout(engine, rows * 4, params(tokenizer), seed=1)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"grown_mb": (after - before) / 1024, **runner.metrics(FakeAccelerator())}))
    """)
    (tmp_path / "memory.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(tmp_path / "memory.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    # Tokenizing the whole 5 MB would take ~2 GB (and ~15 s); cut at 100,000 characters it stays under 150 MB.
    assert out["grown_mb"] < 150, out
    assert out["tools/truncated_frequency"] == 1.0


# ------------------------------------------------------------------------------------------- environments


class Switch:
    """Scores 1 when its button was pressed in this rollout; pressing takes `delay` seconds."""

    def reset(self, **row):
        self.pressed = False

    def press(self, delay: float) -> str:
        """Press the button.

        Args:
            delay: seconds the press takes
        """
        time.sleep(delay)
        self.pressed = True
        return "pressed"

    def get_reward(self) -> float:
        return float(self.pressed)


def test_a_timed_out_environment_call_never_scores_another_rollout():
    _, tokenizer = tiny_agent_model()
    pool = EnvironmentPool(Switch)
    runner = Agents(tokenizer, environments=pool, tool_timeout=0.2, max_completion_length=256)
    reward = pool.reward_functions()[0]
    turns = {
        "slow": call_text("press", {"delay": 0.8}),
        "quick": call_text("press", {"delay": 0.0}),
        "none": "no button<|im_end|>",
    }

    def rollout(*kinds, seed):
        engine = tool_call_script(
            tokenizer, lambda user, results, index: turns[user] if not results else "done<|im_end|>"
        )
        rows = [{"prompt": [{"role": "user", "content": kind}]} for kind in kinds]
        return runner.rollout(engine, rows, params(tokenizer), seed=seed)[0].extra["environments"]

    first = rollout("slow", "quick", seed=0)  # the slow press times out and goes on in its thread
    assert first[0] not in pool.pool[None] and first[1] in pool.pool[None]
    second = rollout("none", "none", seed=1)  # the abandoned press lands during this rollout
    time.sleep(1.2)
    assert first[0].pressed and not {id(e) for e in second} & {id(first[0])}  # it landed in the retired instance
    assert reward(environments=second) == [0.0, 0.0]  # no stale press scores a rollout that pressed nothing
    # Nor its own rollout: what the instance holds depends on when the abandoned call ended, not on the transcript
    # (where the press timed out). A press that ended in time scores.
    assert reward(environments=first[:1]) == [None]
    assert reward(environments=rollout("quick", seed=2)) == [1.0]


def test_an_environment_whose_reset_raises_is_named_with_its_row():
    class Broken(Switch):
        def reset(self, **row):
            if row["level"] == 3:
                raise KeyError("level 3 is missing")

    _, tokenizer = tiny_agent_model()
    runner = Agents(tokenizer, environments=EnvironmentPool(Broken), max_completion_length=64)
    engine = tool_call_script(tokenizer, lambda user, results, index: "done<|im_end|>")
    rows = [{"prompt": [{"role": "user", "content": f"level {level}"}], "level": level} for level in (1, 3)]
    with pytest.raises(
        RuntimeError,
        match=r"The environment Broken's reset\(\) raised KeyError: 'level 3 is "
        r"missing' \(row 1 of this generation's 2, columns \['level', 'prompt'\]",
    ):
        runner.rollout(engine, rows, params(tokenizer), seed=0)
