"""Engines over a copy of the policy of their own, for the served-policy check (tests/test_served.py,
tests/test_served_distributed.py): one whose push works, and ones whose push silently fails."""

from __future__ import annotations

import copy

import torch

from grpokit.rollout import HFEngine
from grpokit.rollout.vllm import policy_weights


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


class CopyPushEngine:
    """A copy of the policy of its own (the in-process sampler inside) that takes every push as vLLM does: the
    policy's full weights (each gathered under FSDP2 / ZeRO-3, a collective every process takes part in) copied into
    the copy's, by name. Its log-probs are its copy's, so the served-policy check really compares two models. (Not
    an HFEngine subclass: a producer running ahead replaces an HFEngine with its own over the policy's copy.)"""

    logprobs_match_training = False

    def __init__(self, model: torch.nn.Module):
        self.inner = HFEngine(copy.deepcopy(model), logprobs_match_training=False)

    def sync_weights(self, model: torch.nn.Module) -> None:
        held = self.inner.model.state_dict()  # tensors sharing the copy's storage: copy_ updates its parameters
        with torch.no_grad(), policy_weights(model) as weights:
            for name, tensor in weights:
                held[name].copy_(tensor)

    def generate(self, prompts, params, seed):
        return self.inner.generate(prompts, params, seed)


class LostPushEngine(CopyPushEngine):
    """A push that is sent and lost (`lose`; otherwise `CopyPushEngine`'s): the weights are gathered (every process
    still takes part in the collectives) and never loaded, as when vLLM's sleep mode drops what it was sent (TRL
    #5312). One class on every process, losing pushes on some only: a fault of one node."""

    def __init__(self, model: torch.nn.Module, lose: bool = True):
        super().__init__(model)
        self.lose = lose

    def sync_weights(self, model: torch.nn.Module) -> None:
        if not self.lose:
            super().sync_weights(model)
            return
        with policy_weights(model) as weights:
            for _ in weights:
                pass
