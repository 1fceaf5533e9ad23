"""Engines whose weight push silently fails, for the served-policy check (tests/test_served.py)."""

from __future__ import annotations

import copy

import torch

from grpokit.rollout import HFEngine


class NoOpPushEngine:
    """An engine over a copy of the policy of its own (the in-process sampler inside), whose weight push does
    nothing: it samples with the initial weights for the whole run, and declares, as vLLM does, that its log-probs
    are not the training forward's."""

    logprobs_match_training = False

    def __init__(self, model: torch.nn.Module):
        self.inner = HFEngine(copy.deepcopy(model), logprobs_match_training=False)

    def sync_weights(self, model: torch.nn.Module) -> None:
        pass

    def generate(self, prompts, params, seed):
        return self.inner.generate(prompts, params, seed)


class UnmergedLoraEngine(HFEngine):
    """A copy of the LoRA policy that receives every push but samples with its adapter off: the adapter never
    reaches the engine (verl #7495)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model, logprobs_match_training=False)
        self.copy = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        if self.copy is None:
            self.copy = copy.deepcopy(model)
        self.copy.load_state_dict(model.state_dict())
        self.model = self.copy

    def generate(self, prompts, params, seed):
        with self.copy.disable_adapter():
            return super().generate(prompts, params, seed)
