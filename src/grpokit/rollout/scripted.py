"""An engine that returns given completions: for tests and for replaying recorded rollouts through the trainer.

    engine = ScriptedEngine(lambda prompt_ids: [3, 4, 1])          # every completion: tokens 3 4 1
    GRPOTrainer(..., rollout_engine=engine)

`script(prompt_ids, index)` returns one completion for the prompt's `index`-th sample: a list of token ids (all
sampled by the policy), or a `ScriptedCompletion` whose `trained` flags mark tokens that were inserted (attended to,
not trained on), as a tool's output is. A completion ends at its first EOS if it has one; one longer than
max_new_tokens is cut there and counts as truncated, like a sampled one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .engine import PromptBatch, Rollout, SamplingParams


@dataclass
class ScriptedCompletion:
    ids: list[int]
    trained: list[bool]  # per token: sampled by the policy (True) or inserted (False)


class ScriptedEngine:
    """`RolloutEngine` returning `script`'s completions; it reports no sampling log-probs, so the trainer computes
    π_old with its own forward whenever it needs one."""

    logprobs_match_training = False

    def __init__(self, script: Callable[[list[int], int], list[int] | ScriptedCompletion]):
        self.script = script
        self.calls: list[PromptBatch] = []  # what the trainer asked for, in order
        self.syncs = 0

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.syncs += 1

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        self.calls.append(prompts)
        prompt_ids, prompt_mask = prompts.padded(params.pad_token_id)
        completions, truncated = [], []
        for prompt, count in zip(prompts.ids, prompts.counts):
            for index in range(count):
                completion = self.script(list(prompt), index)
                if not isinstance(completion, ScriptedCompletion):
                    completion = ScriptedCompletion(list(completion), [True] * len(completion))
                ids, trained = completion.ids, completion.trained
                ends = [i + 1 for i, token in enumerate(ids) if token in params.eos_token_ids and trained[i]]
                end = min(ends[0] if ends else len(ids), params.max_new_tokens)
                truncated.append(not ends or ends[0] > params.max_new_tokens)
                completions.append((ids[:end], trained[:end]))
        width = max([len(ids) for ids, _ in completions] + [1])
        n = len(completions)
        completion_ids = torch.full((n, width), params.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        loss_mask = torch.zeros((n, width), dtype=torch.long)
        for row, (ids, trained) in enumerate(completions):
            completion_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
            loss_mask[row, : len(ids)] = torch.tensor(trained, dtype=torch.long)
        return Rollout(
            prompt_ids,
            prompt_mask,
            completion_ids,
            attention_mask,
            loss_mask,
            attention_mask.sum(-1),
            torch.tensor(truncated),
            sampling_logprobs=None,
        )
