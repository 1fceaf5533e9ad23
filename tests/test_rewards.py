"""Reward functions (`grpokit.rewards`): TRL's calling contract, weighting, async concurrency, the checks on what
a function returns, error reporting, required columns, and the built-ins."""

from __future__ import annotations

import asyncio
import math
import sys
import time

import pytest
import torch

from grpokit.rewards.base import (
    RewardFunction,
    RewardFunctionError,
    check_required_columns,
    combine_rewards,
    compute_rewards,
)
from grpokit.rewards.builtin import BUILTIN_REWARDS, accuracy_reward, resolve_reward, think_format_reward

# N = 4 completions: 2 prompts x G = 2. Row 2's prompt is long, to check that errors quote an excerpt of it.
LONG_PROMPT = "Compute the sum of the first one hundred positive integers, then explain each step in detail. " * 3
PROMPTS = ["What is 1+1?", "What is 1+1?", LONG_PROMPT, LONG_PROMPT]
COMPLETIONS = ["2", "3", "5050", "5000"]
COMPLETION_IDS = [[10], [11], [13, 12, 13, 12], [13, 12, 12, 12]]
COLUMNS = {"answer": ["2", "2", "5050", "5050"], "difficulty": [1, 1, 3, 3]}


def score(functions, on_error="raise", columns=COLUMNS):
    wrapped = [RewardFunction(f.__name__, f) for f in functions]
    return compute_rewards(wrapped, PROMPTS, COMPLETIONS, COMPLETION_IDS, columns, on_error=on_error)[:2]


def exact_answer(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def nan_list(values):
    return [None if math.isnan(v) else v for v in values]


# ------------------------------------------------------------------------------------------ the contract


def test_functions_receive_trl_keyword_arguments():
    received = {}

    def recorder(**kwargs):
        received.update(kwargs)
        return [0.0] * len(kwargs["completions"])

    scores, failures = score([recorder])
    assert received == {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "completion_ids": COMPLETION_IDS,
        "answer": ["2", "2", "5050", "5050"],
        "difficulty": [1, 1, 3, 3],
    }
    assert scores.tolist() == [[0.0]] * 4 and failures == {}


def test_scores_have_one_column_per_function_in_order():
    def length(completions, **kwargs):
        return [len(c) for c in completions]  # ints are fine

    def maybe(completions, difficulty, **kwargs):
        return [None if d == 1 else 0.5 for d in difficulty]

    scores, _ = score([exact_answer, length, maybe])
    assert scores.dtype == torch.float32 and scores.shape == (4, 3)
    assert scores[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores[:, 1].tolist() == [1.0, 1.0, 4.0, 4.0]
    assert nan_list(scores[:, 2].tolist()) == [None, None, 0.5, 0.5]


def test_tuples_and_tensors_are_accepted():
    def as_tuple(completions, **kwargs):
        return tuple(0.25 for _ in completions)

    def as_tensor(completions, **kwargs):
        return torch.tensor([1.0, 2.0, 3.0, 4.0])

    scores, _ = score([as_tuple, as_tensor])
    assert scores.tolist() == [[0.25, 1.0], [0.25, 2.0], [0.25, 3.0], [0.25, 4.0]]


def test_combine_rewards_weighted_sum_skips_none():
    nan = float("nan")
    scores = torch.tensor([[1.0, nan, 2.0], [nan, nan, nan], [0.5, 1.0, nan], [-1.0, 2.0, 0.25]])
    weights = torch.tensor([1.0, 0.5, 2.0])
    combined = combine_rewards(scores, weights)
    # 1 + 2·2 = 5; all None; 0.5 + 0.5·1 = 1; -1 + 0.5·2 + 2·0.25 = 0.5
    assert nan_list(combined.tolist()) == [5.0, None, 1.0, 0.5]


def test_combine_after_compute_end_to_end():
    def only_long(prompts, **kwargs):
        return [1.0 if len(p) > 50 else None for p in prompts]

    def nothing(completions, **kwargs):
        return [None] * len(completions)

    scores, _ = score([exact_answer, only_long, nothing])
    combined = combine_rewards(scores, torch.tensor([2.0, 0.5, 10.0]))
    assert combined.tolist() == [2.0, 0.0, 2.5, 0.5]

    scores, _ = score([nothing])
    assert combine_rewards(scores, torch.tensor([1.0])).isnan().all()


# ------------------------------------------------------------------------------------------------- async


def test_async_functions_run_concurrently():
    async def slow_length(completions, **kwargs):
        await asyncio.sleep(0.5)
        return [float(len(c)) for c in completions]

    async def slow_constant(completions, **kwargs):
        await asyncio.sleep(0.5)
        return [0.5] * len(completions)

    def slow_sync(completions, answer, **kwargs):
        time.sleep(0.5)
        return [float(c == a) for c, a in zip(completions, answer)]

    functions = [slow_length, slow_sync, slow_constant]
    assert [RewardFunction(f.__name__, f).is_async for f in functions] == [True, False, True]
    start = time.perf_counter()
    scores, failures = score(functions)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.9, f"took {elapsed:.2f} s: the three 0.5 s functions did not overlap"
    assert scores.tolist() == [[1.0, 1.0, 0.5], [1.0, 0.0, 0.5], [4.0, 1.0, 0.5], [4.0, 0.0, 0.5]]
    assert failures == {}


def test_async_callable_object_is_detected():
    class Judge:
        async def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    judge = RewardFunction("judge", Judge())
    assert judge.is_async
    scores, _, _ = compute_rewards([judge], PROMPTS, COMPLETIONS, COMPLETION_IDS, COLUMNS)
    assert scores.tolist() == [[1.0]] * 4


# --------------------------------------------------------------------------------------------- bad returns


def wrong_length(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def string_value(completions, **kwargs):
    return [1.0, "0.5", 1.0, 1.0]


def nan_value(completions, **kwargs):
    return [1.0, 1.0, float("nan"), 1.0]


def inf_value(completions, **kwargs):
    return [1.0, float("inf"), 1.0, 1.0]


def bool_value(completions, **kwargs):
    return [True, False, True, False]


def not_a_list(completions, **kwargs):
    return 1.0


def a_dict(completions, **kwargs):
    return {"reward": [1.0] * len(completions)}


def a_string(completions, **kwargs):
    return "1111"  # four characters, but not four rewards


@pytest.mark.parametrize(
    "function, words",
    [
        (wrong_length, ["3 values for 4 completions"]),
        (string_value, ["'0.5'", "row 1"]),
        (nan_value, ["nan", "row 2", "finite"]),
        (inf_value, ["inf", "row 1", "finite"]),
        (bool_value, ["True", "row 0"]),
        (not_a_list, ["returned float", "list"]),
        (a_dict, ["returned dict", "list"]),
        (a_string, ["returned str", "list"]),
    ],
    ids=lambda value: value.__name__ if callable(value) else None,
)
def test_bad_returns_raise_naming_the_function(function, words):
    with pytest.raises(RewardFunctionError) as error:
        score([exact_answer, function])
    message = str(error.value)
    assert f"Reward function {function.__name__!r}" in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# ------------------------------------------------------------------------------------ a function that raises


def fails_on_long_prompts(prompts, completions, **kwargs):
    if "5050" in completions:  # only row 2
        raise ZeroDivisionError("cannot score 5050")
    return [0.75] * len(completions)


async def async_fails_on_long_prompts(prompts, completions, **kwargs):
    return fails_on_long_prompts(prompts, completions, **kwargs)


@pytest.mark.parametrize("function", [fails_on_long_prompts, async_fails_on_long_prompts], ids=["sync", "async"])
def test_raising_function_is_named_with_row_and_prompt(function):
    with pytest.raises(RewardFunctionError) as error:
        score([exact_answer, function])
    message = str(error.value)
    assert f"Reward function {function.__name__!r}" in message
    assert "ZeroDivisionError: cannot score 5050" in message
    assert "on row 2" in message
    assert LONG_PROMPT[:60] in message  # an excerpt of the row's prompt ...
    assert LONG_PROMPT not in message  # ... not the whole of it
    assert isinstance(error.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("function", [fails_on_long_prompts, async_fails_on_long_prompts], ids=["sync", "async"])
def test_on_error_none_scores_the_failing_row_none(function):
    scores, failures = score([exact_answer, function], on_error="none")
    assert failures == {function.__name__: 1}
    assert scores[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # the other function is untouched
    assert nan_list(scores[:, 1].tolist()) == [0.75, 0.75, None, 0.75]


# ------------------------------------------------------------------------------------------ required columns


def needs_answer(completions, answer, **kwargs):
    return [0.0] * len(completions)


def answer_optional(completions, answer=None, **kwargs):
    return [0.0] * len(completions)


def keyword_only_answer(completions, *, answer, **kwargs):
    return [0.0] * len(completions)


def test_missing_required_column_names_column_and_function():
    functions = [RewardFunction("answer_optional", answer_optional), RewardFunction("needs_answer", needs_answer)]
    with pytest.raises(ValueError) as error:
        check_required_columns(functions, ["prompt", "solution"])
    message = str(error.value)
    assert "'needs_answer'" in message and "['answer']" in message and "'solution'" in message
    assert "default" in message  # says how to fix it

    with pytest.raises(ValueError, match="keyword_only_answer"):
        check_required_columns([RewardFunction("keyword_only_answer", keyword_only_answer)], ["prompt"])


def test_present_or_optional_columns_pass():
    check_required_columns([RewardFunction("needs_answer", needs_answer)], ["prompt", "answer"])
    check_required_columns([RewardFunction("answer_optional", answer_optional)], ["prompt"])
    # Standard arguments are never dataset columns.
    standard = RewardFunction("standard", lambda prompts, completions, completion_ids: [0.0] * len(completions))
    assert standard.required_columns() == []
    check_required_columns([standard], ["prompt"])
    assert RewardFunction("needs_answer", needs_answer).required_columns() == ["answer"]


# ---------------------------------------------------------------------------------------------- built-ins


def assistant(text):
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_hand_cases():
    completions = [
        r"The answer is $\boxed{0.5}$.",  # 1/2 written as a decimal
        r"So we get \boxed{\frac{2}{4}}",  # an equivalent fraction
        r"The answer is $\boxed{3}$.",  # wrong
        "I do not know",  # nothing to extract
    ]
    assert accuracy_reward(completions, solution=[r"\frac{1}{2}"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert accuracy_reward([r"$\frac{1}{2}$", r"$\frac{1}{3}$"], solution=["0.5", "$0.5$"]) == [1.0, 0.0]


def test_accuracy_reward_conversational_completions():
    completions = [assistant(r"Thus $\boxed{0.5}$"), assistant(r"Thus $\boxed{7}$"), []]
    assert accuracy_reward(completions, solution=[r"\frac{1}{2}"] * 3) == [1.0, 0.0, 0.0]


def test_accuracy_reward_empty_gold_is_none():
    assert accuracy_reward([r"$\boxed{1}$", r"$\boxed{1}$"], solution=["", "1"]) == [None, 1.0]


@pytest.mark.parametrize("gold", ["???", r"\frac{"])
def test_accuracy_reward_unparsable_gold_is_none(gold):
    # math-verify finds no expression in these; the row is not scored rather than punished for a bad label.
    assert accuracy_reward([r"$\boxed{1}$"], solution=[gold]) == [None]


def test_accuracy_reward_none_survives_compute_rewards():
    scores, _, _ = compute_rewards(
        [RewardFunction("accuracy", accuracy_reward)],
        ["p"] * 2,
        [r"$\boxed{2}$", r"$\boxed{2}$"],
        [[1], [1]],
        {"solution": ["2", ""]},
    )
    assert nan_list(scores[:, 0].tolist()) == [1.0, None]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>2 + 2 is 4</think>The answer is 4.", 1.0),
        ("<think>\nline one\nline two\n</think>\n4", 1.0),  # newlines inside and after the block
        ("<think></think>4", 1.0),
        ("The answer is 4.", 0.0),
        (" <think>late</think>4", 0.0),  # must open the completion
        ("<think>one<think>two</think>4", 0.0),  # a second <think>
        ("<think>never closed", 0.0),
        ("</think>4", 0.0),
        (assistant("<think>chat</think>4"), 1.0),
        (assistant("no think"), 0.0),
    ],
)
def test_think_format_reward(completion, expected):
    assert think_format_reward([completion]) == [expected]


# ------------------------------------------------------------------------------------------ resolve_reward


def test_resolve_builtin_names():
    # a built-in named on the command line logs under that name; its function is TRL's
    accuracy = resolve_reward("accuracy")
    assert accuracy.__wrapped__ is accuracy_reward and accuracy.__name__ == "accuracy"
    assert resolve_reward("think_format").__wrapped__ is think_format_reward
    assert resolve_reward("exact_match").__name__ == "exact_match"
    assert set(BUILTIN_REWARDS) >= {"accuracy", "think_format", "length", "code_execution"}


REWARD_MODULE = """
def shout_reward(completions, **kwargs):
    return [float(c.isupper()) for c in completions]
"""


def test_resolve_module_function(tmp_path, monkeypatch):
    (tmp_path / "grpokit_test_reward_module.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "grpokit_test_reward_module", raising=False)
    function = resolve_reward("grpokit_test_reward_module:shout_reward")
    assert function.__name__ == "shout_reward"
    assert function(["YES", "no"]) == [1.0, 0.0]
    monkeypatch.delitem(sys.modules, "grpokit_test_reward_module", raising=False)


def test_resolve_file_function(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    function = resolve_reward(f"{path}:shout_reward")
    assert function(["LOUD", "quiet", "MiXeD"]) == [1.0, 0.0, 0.0]


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError) as error:
        resolve_reward("acuracy")
    assert "'acuracy'" in str(error.value) and "accuracy" in str(error.value).replace("'acuracy'", "")
    with pytest.raises(FileNotFoundError, match=r"missing.py"):
        resolve_reward(f"{tmp_path / 'missing.py'}:f")
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    with pytest.raises(AttributeError, match="no function 'whisper_reward'"):
        resolve_reward(f"{path}:whisper_reward")
    with pytest.raises(ModuleNotFoundError):
        resolve_reward("grpokit_no_such_module_anywhere:f")


# ------------------------------------------------------------------------------------ a missing package


def test_a_missing_math_verify_says_install_it_not_score_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(ImportError, match="pip install math-verify"):
        resolve_reward("accuracy")  # the command line names it before loading any model
    with pytest.raises(RewardFunctionError) as error:
        compute_rewards(
            [RewardFunction("accuracy", accuracy_reward)],
            PROMPTS,
            COMPLETIONS,
            COMPLETION_IDS,
            {"solution": ["2", "2", "5050", "5050"]},
        )
    message = str(error.value)
    assert "pip install math-verify" in message and "Install the missing package" in message
    assert "reward_fn_errors" not in message  # scoring every row None would train on nothing
