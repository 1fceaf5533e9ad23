"""The scorer: every reward function of a run over one generation's rows, with reward routing, process rewards and
what the functions report through `log_metric` / `log_extra`.

Training and evaluation score through the same object, so a completion gets the same scores in both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .base import RewardFunction, combine_rewards, compute_rewards, routes_from_column
from .context import RewardLogs
from .process import step_token_ends

logger = logging.getLogger(__name__)  # TRL's warnings go through its logger; so do these


@dataclass
class Scores:
    """What the reward functions made of N completions (F functions)."""

    prompts: list[Any]  # [N] as the reward functions received them
    scores: torch.Tensor  # [N, F] one column per function, NaN = None ("does not apply")
    failures: dict[str, int]  # function name -> rows whose call raised (reward_fn_errors='none')
    step_rewards: dict[int, list[list[float]]]  # process function index -> per row, one reward per step
    step_ends: list[list[int]]  # [N] the token position where each step ends


class RewardScorer:
    """Scores completions with a run's reward functions and weights (one weight per function).

    `on_error` is reward_fn_errors; `routing_column` the dataset column that names, per row, the functions that
    apply (reward_routing_column); `step_separator` splits a completion into steps for process rewards (an agent's
    steps are its turns: the `turn_ends` column)."""

    def __init__(
        self,
        functions: list[RewardFunction],
        weights: torch.Tensor,
        tokenizer,
        *,
        on_error: str = "raise",
        routing_column: str | None = None,
        step_separator: str | None = None,
    ):
        self.functions, self.weights, self.tokenizer = functions, weights, tokenizer
        self.on_error, self.routing_column, self.step_separator = on_error, routing_column, step_separator
        self.logs = RewardLogs()  # what the functions report through log_metric / log_extra

    def fresh(self) -> RewardScorer:
        """The same functions and settings with logs of its own (a producer thread scores beside evaluation)."""
        return RewardScorer(
            self.functions,
            self.weights,
            self.tokenizer,
            on_error=self.on_error,
            routing_column=self.routing_column,
            step_separator=self.step_separator,
        )

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    @property
    def process_indices(self) -> list[int]:
        """The process reward functions (one reward per step): they enter as token advantages."""
        return [i for i, f in enumerate(self.functions) if f.is_process]

    def outcome_rewards(self, scores: torch.Tensor) -> torch.Tensor:
        """[N] the weighted sum of the outcome functions' scores (NaN = None skipped): TRL's `reward`."""
        weights = self.weights.clone()
        weights[self.process_indices] = 0.0  # process rewards enter as token advantages, not here
        return combine_rewards(scores, weights)

    def score(self, rows: list[dict], completions: list, completion_ids: list[list[int]], trainer_state=None) -> Scores:
        """Scores of the completions of rows (one row per completion); `trainer_state` is what reward functions
        receive as their `trainer_state` argument (TRL's)."""
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt",)}
        prompts = [r.get("prompt", r.get("prompt_ids")) for r in rows]
        routes = (
            routes_from_column(columns[self.routing_column], self.names, self.routing_column)
            if self.routing_column in columns
            else None
        )
        process = self.process_indices
        step_ends = (
            [step_token_ends(ids, self.tokenizer, self.step_separator) for ids in completion_ids]
            if process
            else [[] for _ in rows]
        )
        if process and "turn_ends" in columns:  # an agent's steps are its turns (grpokit.agents)
            step_ends = [list(ends) for ends in columns["turn_ends"]]
        context = {"trainer_state": trainer_state, "log_metric": self.logs.log_metric, "log_extra": self.logs.log_extra}
        scores, failures, step_rewards = compute_rewards(
            self.functions,
            prompts,
            completions,
            completion_ids,
            columns,
            on_error=self.on_error,
            routes=routes,
            step_counts=[len(e) for e in step_ends],
            context=context,
        )
        unscored = torch.isnan(scores).all(dim=1).nonzero().flatten().tolist() if scores.shape[1] else []
        if unscored:  # TRL's warning (its words and the first such row's kwargs): a completion with no reward
            row = unscored[0]
            kwargs = {
                **{k: _short(v[row]) for k, v in columns.items()},
                "prompt": _short(prompts[row]),
                "completion": _short(completions[row]),
            }
            logger.warning(
                f"All reward functions returned None for the following kwargs:\n{kwargs}\nPlease ensure "
                f"that at least one reward function returns a valid reward. ({len(unscored)} "
                f"completion(s) of this batch got none: they get no advantage.)"
            )
        return Scores(prompts, scores, failures, step_rewards, step_ends)


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
