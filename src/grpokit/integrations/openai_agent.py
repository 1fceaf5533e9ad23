"""Agents written with the OpenAI SDK, trained as they are: `GRPOTrainer(environment=OpenAIAgentEnvironment(agent,
dataset))`.

`agent(base_url, row) -> reward` is the user's code: it builds `openai.OpenAI(base_url=base_url, api_key="-")`, runs
its loop (chat.completions calls, its own tools, its own parsing) on the dataset row and returns the row's reward
(a float, or None where the reward does not apply). grpokit runs it once per completion, all rows of a generation at
once, each in a thread of its own, against the policy endpoint (grpokit.integrations.endpoint), and trains on the
tokens the policy sampled there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .endpoint import HarnessDriver, PolicyEndpoint


def agent_reward(completions, agent_reward, **kwargs) -> list[float | None]:
    """The reward the agent returned for its row (None where it timed out or raised)."""
    return [None if r is None else float(r) for r in agent_reward]


class OpenAIAgentEnvironment:
    """An `EnvironmentAdapter` (grpokit.integrations) for an OpenAI-SDK agent.

    agent: `agent(base_url, row) -> reward`, called per completion, in threads.
    dataset: the rows (a `datasets.Dataset` with a `prompt` column; the agent reads whatever columns it needs), or
        None to pass `train_dataset=` to the trainer.
    timeout: seconds a rollout's agents may take; an agent still running then is abandoned and its row scores None.
    """

    def __init__(self, agent: Callable[[str, dict], Any], dataset=None, *, timeout: float = 600.0):
        if not callable(agent):
            raise TypeError(f"agent must be a function agent(base_url, row) -> reward, got {agent!r}.")
        self.agent, self.dataset, self.timeout = agent, dataset, timeout

    def train_dataset(self):
        return self.dataset

    def reward_funcs(self) -> list[Callable]:
        return [agent_reward]

    def reward_weights(self) -> list[float] | None:
        return None

    def driver(self, tokenizer, args, max_prompt_length: int | None) -> HarnessDriver:
        endpoint = PolicyEndpoint(
            tokenizer, max_completion_length=args.max_completion_length, chat_template_kwargs=args.chat_template_kwargs
        )
        return HarnessDriver(endpoint, self.agent, timeout=self.timeout, reward_column=agent_reward.__name__)
