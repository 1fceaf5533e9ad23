"""One seam for every rollout the trainer asks for: dataset rows in, a `DecodedRollout` out, whether one engine call
samples each completion (single-turn) or a multi-turn driver (grpokit.agents: tools, environments, a user's
rollout_func) calls the engine turn after turn.

The runner owns what both cases share: encoding the prompts once per group, putting the rollout on the training
device, decoding the completions as reward functions receive them, joining the per-row fields an engine or driver
reports (`Rollout.extra`) to the rows, and saying whether the rollout's sampling log-probs equal the training
forward's (`logprobs_match_training`). It samples from whatever weights the engine holds: `sync_weights` is a
separate call, so that a producer running ahead of training can choose when to take new weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..data import with_prompt
from .engine import Rollout, RolloutEngine, SamplingParams, engine_logprobs_match_training
from .prompts import PromptCodec


@dataclass
class DecodedRollout:
    """One rollout of rows, decoded. N rows, one per completion."""

    rollout: Rollout  # on the training device
    rows: list[dict]  # [N] the dataset rows, with the fields the engine or driver reported per row joined
    completions: list[Any]  # [N] as reward functions receive them (text, messages or ids)
    completion_ids: list[list[int]]  # [N] the real completion tokens
    # [N] the tokens the model wrote: with tools, a tool result inserted into the transcript does not count (TRL's
    # completion lengths); otherwise the rollout's lengths
    model_lengths: torch.Tensor

    @staticmethod
    def concat(parts: list[DecodedRollout]) -> DecodedRollout:
        """Decoded rollouts of separate rows as one (rows in the order of `parts`)."""
        return DecodedRollout(
            Rollout.concat([p.rollout for p in parts]),
            [r for p in parts for r in p.rows],
            [c for p in parts for c in p.completions],
            [i for p in parts for i in p.completion_ids],
            torch.cat([p.model_lengths for p in parts]),
        )


class MultiTurnDriver(Protocol):
    """What drives a multi-turn rollout over an engine (grpokit.agents.Agents).

    A driver whose `concurrent_rollouts` is True (an optional attribute) may run several `rollout` calls at once
    from different threads, on disjoint rows: an asynchronous producer then streams its rollouts group by group. An
    optional `scored(rollout)` is called once the rollout's rewards are computed (to take back what it lent). A
    streamed rollout gets its group's view of the engine (`batching.CallerEngine`): once its `stop` is set (the group
    is abandoned as too stale) the next engine call raises `Abandoned`; a driver may end its own waits on `stop`."""

    logprobs_match_training: bool  # False when the driver's log-probs are not the engine's (a user's rollout_func)

    def rollout(
        self, engine: RolloutEngine, rows: list[dict], params: SamplingParams, seed: int, host: Any
    ) -> tuple[Rollout, list | None]:
        """(the rollout, each row's completion as reward functions receive it, or None to decode it)."""
        ...

    def metrics(self, accelerator) -> dict[str, float]: ...


class RolloutRunner:
    """Rows → `DecodedRollout`, single-turn or through a multi-turn driver, on any `RolloutEngine`.

    `host` is what a user's rollout_func receives as its `trainer` argument (TRL's contract)."""

    def __init__(
        self,
        engine: RolloutEngine,
        codec: PromptCodec,
        params: SamplingParams,
        device: torch.device,
        driver: MultiTurnDriver | None = None,
        host: Any = None,
    ):
        self.engine, self.codec, self.params, self.device = engine, codec, params, device
        self.driver, self.host = driver, host

    @property
    def logprobs_match_training(self) -> bool:
        """Whether a rollout's sampling log-probs are the training forward's (so they may serve as π_old)."""
        return engine_logprobs_match_training(self.engine) and (
            self.driver is None or self.driver.logprobs_match_training
        )

    def sync_weights(self, policy: torch.nn.Module) -> None:
        self.engine.sync_weights(policy)

    def scored(self, decoded: DecodedRollout) -> None:
        """`decoded`'s rewards are computed: what its driver lent it (environments) may be lent again."""
        if self.driver is not None and hasattr(self.driver, "scored"):
            self.driver.scored(decoded.rollout)

    def run(self, rows: list[dict], counts: list[int], seed: int, stop=None) -> DecodedRollout:
        """Sample rows (consecutive runs of counts[i] rows share a prompt) reproducibly from seed. `stop` (a
        threading.Event; the engine must be a `BatchingEngine`): set, the rollout stops at its next engine or tool
        call with `Abandoned` (a streamed group too stale to train)."""
        starts = [sum(counts[:i]) for i in range(len(counts))]
        prompts = self.codec.encode([with_prompt(rows[s]) for s in starts], counts)
        engine = self.engine if stop is None else self.engine.caller(stop)
        if self.driver is not None:
            rollout, completions = self.driver.rollout(engine, rows, self.params, seed, self.host)
            rollout = rollout.to(self.device)
            decoded, completion_ids = self.codec.decode(rollout, prompts.raw)
            completions = decoded if completions is None else completions
            model_lengths = rollout.loss_mask.sum(1)
        else:
            rollout = engine.generate(prompts, self.params, seed).to(self.device)
            completions, completion_ids = self.codec.decode(rollout, prompts.raw)
            model_lengths = rollout.lengths
            if prompts.images is not None:  # reward functions receive the messages with their images, as in TRL
                rows = [
                    {**row, "prompt": prompts.raw[b]} if prompts.images[b] else row
                    for row, b in zip(rows, prompts.rows())
                ]
        if rollout.extra:
            rows = [
                {**row, **{name: values[i] for name, values in rollout.extra.items()}} for i, row in enumerate(rows)
            ]
        return DecodedRollout(rollout, rows, completions, completion_ids, model_lengths)

    def metrics(self, accelerator) -> dict[str, float]:
        """The driver's counters since the last call (tools/...), reduced over processes; {} for single-turn."""
        return self.driver.metrics(accelerator) if self.driver is not None else {}
