"""Process supervision (DeepSeekMath §4.1.3): one reward per reasoning step.

A process reward function is marked with `@process_reward`; it keeps TRL's calling contract but returns, for each
completion, a list with one reward per step. Steps are the pieces of the completion text cut after each
`step_separator` (default a newline; an empty last piece does not count), and grpokit maps each step's end to a
token position so that `grpokit.process_advantages` can give every token the normalised rewards of the steps that
end after it. For token models without a tokenizer, `step_separator` is a token id and a step ends after each
occurrence of it.

How process and outcome rewards combine: outcome rewards (ordinary functions) are weighted, summed and normalised
per group into one advantage per completion, broadcast over its tokens; each process function's token advantages
are multiplied by its weight and added to that. A run with only process functions uses their advantages alone.
"""

from __future__ import annotations

from collections.abc import Callable


def process_reward(fn: Callable) -> Callable:
    """Mark a reward function as step-level: it returns list[list[float]] (one list of step rewards each)."""
    fn.is_process_reward = True
    return fn


def is_process_reward(fn) -> bool:
    return bool(getattr(fn, "is_process_reward", False))


def split_steps(text: str, separator: str = "\n") -> list[str]:
    """The steps of a completion: each piece keeps its separator; an empty last piece is dropped."""
    pieces = text.split(separator)
    steps = [piece + separator for piece in pieces[:-1]]
    if pieces[-1]:
        steps.append(pieces[-1])
    return steps


def step_token_ends(completion_ids: list[int], tokenizer, separator) -> list[int]:
    """Token position (exclusive) where each step of the decoded completion ends."""
    if tokenizer is None:  # token models: the separator is a token id
        ends = [i + 1 for i, token in enumerate(completion_ids) if token == separator]
        if not ends or ends[-1] != len(completion_ids):
            ends.append(len(completion_ids))
        return ends if completion_ids else []
    text = tokenizer.decode(completion_ids, skip_special_tokens=True)
    char_ends, position = [], 0
    for step in split_steps(text, separator):
        position += len(step)
        char_ends.append(position)
    # Length of the text decoded from the first k tokens, for every k: a step ends at the first k that covers it.
    prefix_lengths = [
        len(tokenizer.decode(completion_ids[:k], skip_special_tokens=True)) for k in range(1, len(completion_ids) + 1)
    ]
    ends, k = [], 0
    for char_end in char_ends:
        while k < len(prefix_lengths) and prefix_lengths[k] < char_end:
            k += 1
        ends.append(min(k + 1, len(completion_ids)))
    return ends


def soft_overlong_punishment(max_completion_length: int, buffer_length: int, penalty: float = 1.0):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) as a reward function on completion lengths.

    0 up to max_completion_length - buffer_length tokens, then falling linearly to -penalty at
    max_completion_length: r = penalty * ((L_max - L_buffer) - |y|) / L_buffer.
    """
    if not 0 < buffer_length <= max_completion_length:
        raise ValueError(
            f"buffer_length={buffer_length} must be in (0, max_completion_length={max_completion_length}]."
        )
    start = max_completion_length - buffer_length

    def soft_overlong_reward(completion_ids, **kwargs) -> list[float]:
        return [min(0.0, penalty * (start - len(ids)) / buffer_length) for ids in completion_ids]

    return soft_overlong_reward
