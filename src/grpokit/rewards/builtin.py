"""Built-in reward functions, usable by name from the CLI (`--reward accuracy`)."""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any

_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of a completion, plain or conversational ([{"role": "assistant", "content": ...}])."""
    if isinstance(completion, list):
        return completion[-1]["content"] if completion else ""
    return completion


def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer is mathematically equal to `solution`, else 0.0.

    Parsing and comparison are math-verify's (LaTeX, fractions, sets, intervals, units). A solution that cannot
    be parsed gives None: the row is not scored rather than punished for a bad label.
    """
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as error:
        raise ImportError("accuracy_reward needs math-verify: pip install math-verify") from error
    scores: list[float | None] = []
    for completion, answer in zip(completions, solution):
        # math-verify returns [expression, text] on success and only the raw text when it understood nothing.
        gold = parse(str(answer), extraction_mode="first_match")
        if not any(not isinstance(g, str) for g in gold):
            gold = parse(f"${answer}$", extraction_mode="first_match")
        if not any(not isinstance(g, str) for g in gold):
            scores.append(None)
            continue
        predicted = parse(
            completion_text(completion),
            extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
            extraction_mode="first_match",
        )
        scores.append(float(verify(gold, predicted)) if predicted else 0.0)
    return scores


def think_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion opens with one <think>...</think> block, else 0.0."""
    return [float(bool(_THINK_FORMAT.match(completion_text(c)))) for c in completions]


def length_reward(completions, **kwargs) -> list[float]:
    """Minus the completion's length in characters divided by 1000 (a mild push towards brevity)."""
    return [-len(completion_text(c)) / 1000 for c in completions]


def _code_execution(completions, tests, **kwargs):
    from .code import code_execution_reward

    return code_execution_reward(completions, tests, **kwargs)


_code_execution.__name__ = "code_execution_reward"


def exact_match(completions, target, **kwargs) -> list[float]:
    """1.0 where a completion, stripped of surrounding white space, is its row's `target` exactly."""
    return [float(c.strip() == t) for c, t in zip(completions, target)]


def _exact_match(completions, target, **kwargs):
    return exact_match([completion_text(c) for c in completions], target)


_exact_match.__name__ = "exact_match"

BUILTIN_REWARDS = {
    "accuracy": accuracy_reward,
    "think_format": think_format_reward,
    "length": length_reward,
    "code_execution": _code_execution,
    "exact_match": _exact_match,
}


def named(function, name: str):
    """`function` under another name, which its metrics take (`rewards/<name>/mean`): a built-in reward named on the
    command line logs under that name (`--reward length`, not length_reward); the Python names stay TRL's."""
    if function.__name__ == name:
        return function

    @functools.wraps(function)
    def reward(*args, **kwargs):
        return function(*args, **kwargs)

    reward.__name__ = reward.__qualname__ = name
    return reward


def resolve_reward(spec: str):
    """A built-in reward's name, or `module:function` (a module on the path or a .py file)."""
    if spec == "accuracy":
        try:  # named now, not after the model has loaded
            import math_verify  # noqa: F401
        except ImportError:
            raise ImportError("the accuracy reward needs math-verify: pip install math-verify") from None
    if spec in BUILTIN_REWARDS:
        return named(BUILTIN_REWARDS[spec], spec)
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise ValueError(
            f"Unknown reward {spec!r}:{hint} Use a built-in name ({', '.join(BUILTIN_REWARDS)}) or 'module:function'."
        )
    import importlib
    import importlib.util
    from pathlib import Path

    module_name, _, function_name = spec.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"Reward {spec!r}: no file {path}.")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, function_name):
        close = difflib.get_close_matches(function_name, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f" Did you mean {module_name}:{close[0]}?" if close else ""
        raise AttributeError(f"Reward {spec!r}: module {module_name!r} has no function {function_name!r}.{hint}")
    return getattr(module, function_name)
