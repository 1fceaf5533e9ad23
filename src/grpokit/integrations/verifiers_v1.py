"""verifiers 0.4's v1 environments, trained as they are: `GRPOTrainer(environment=env)` with a `verifiers.v1.Env`.

Each completion is one episode of the env (`Env.run_episode`), played by the env's own harness and scored by its
own `@reward`s, with the policy served by grpokit's endpoint (grpokit.integrations.endpoint) in the token-in/
token-out format verifiers' `TrainClient` speaks: the harness's chat requests reach the env's interception server,
whose `TrainClient` renders them with verifiers' renderers (the tokenizer saved to a temporary directory), bridges
each turn onto the previous one's token ids and calls `<base_url>/inference/v1/generate`, one session per episode.
The endpoint records each turn's tokens and log-probs; the episode's calls become the row's sequence (its sampled
turns trained, everything between attention-only) and the episode's reward its row's reward (`episode_reward`: the
mean of its traces' rewards; a single-agent env has one). An episode that fails (`Episode.ok` false) or outlives
`timeout` scores None and is counted (`endpoint/error_frequency`, `endpoint/timeout_frequency`).

The rows are the env's taskset (bounded), one per task, with the task's prompt as `prompt` (for the logs and
completions) and its position as `task_index`. All episodes of a generation run at once on one event loop, inside one
`Env.serving()` held for the trainer's life. The env's runtime must be one the trainer's machine can run (e.g.
`SubprocessConfig`, or docker); the harness's sampling settings are replaced by the trainer's (see the endpoint).
Multi-agent envs: every agent's turns land in the episode's one session; each agent's transcript starts a new segment,
so only the last one trained (the break is counted).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from .endpoint import HarnessDriver, PolicyEndpoint

API_KEY_VARIABLE = "GRPOKIT_ENDPOINT_API_KEY"  # unset: the client sends "EMPTY", which the endpoint ignores


def episode_reward(completions, episode_reward, **kwargs) -> list[float | None]:
    """The reward verifiers' env gave the row's episode (None where the episode failed or timed out)."""
    return [None if r is None else float(r) for r in episode_reward]


def adapt(environment) -> VerifiersV1Environment | None:
    """The adapter for a `verifiers.v1.Env`; None for anything else (e.g. classic verifiers' environments)."""
    from verifiers.v1 import Env

    return VerifiersV1Environment(environment) if isinstance(environment, Env) else None


class VerifiersV1Environment:
    """An `EnvironmentAdapter` (grpokit.integrations) for a `verifiers.v1.Env`.

    renderer: a `renderers.RendererConfig` for the env's `TrainClient` (None: picked from the model; set it for
        tool-using envs with a fine-tuned chat template, as verifiers' `TrainClientConfig.renderer` says).
    timeout: seconds a generation's episodes may take; an episode still running then scores None.
    """

    def __init__(self, env, *, renderer=None, timeout: float = 1800.0, model_name: str = "grpokit-policy"):
        self.env, self.renderer, self.timeout, self.model_name = env, renderer, timeout, model_name
        if not env.taskset.bounded:
            raise ValueError(f"{type(env.taskset).__name__} is infinite: bound it (taskset.take(n)) to train on it.")
        self.tasks = list(env.taskset)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = threading.Lock()
        self.renderer_model: str | None = None

    def train_dataset(self):
        from datasets import Dataset

        return Dataset.from_list(
            [{"prompt": task_prompt(task.data), "task_index": i} for i, task in enumerate(self.tasks)]
        )

    def reward_funcs(self) -> list[Callable]:
        return [episode_reward]

    def reward_weights(self) -> list[float] | None:
        return None

    def driver(self, tokenizer, args, max_prompt_length: int | None) -> HarnessDriver:
        # verifiers' renderers load the tokenizer by name: the trainer's own, saved once.
        self.renderer_model = tempfile.mkdtemp(prefix="grpokit-renderer-")
        tokenizer.save_pretrained(self.renderer_model)
        endpoint = PolicyEndpoint(
            tokenizer,
            max_completion_length=args.max_completion_length,
            chat_template_kwargs=args.chat_template_kwargs,
            model_name=self.model_name,
        )
        return HarnessDriver(endpoint, self.play, timeout=self.timeout, reward_column=episode_reward.__name__)

    def play(self, base_url: str, row: dict) -> float | None:
        """One episode of the row's task against the session at base_url; its reward."""
        from verifiers.v1 import ModelContext, TrainClientConfig

        client = TrainClientConfig(
            base_url=base_url,
            api_key_var=API_KEY_VARIABLE,
            renderer=self.renderer,
            renderer_model_name=self.renderer_model,
        )
        context = ModelContext(model=self.model_name, client=client)
        task = self.tasks[int(row["task_index"])]
        episode = asyncio.run_coroutine_threadsafe(self.env.run_episode(task, context), self._event_loop())
        episode = episode.result()
        if not episode.ok or not episode.traces:
            errors = [episode.last_error] + [trace.last_error for trace in episode.traces]
            shown = "; ".join(f"{e.type}: {e.message}" for e in errors if e is not None) or "no error recorded"
            raise RuntimeError(f"the episode failed ({shown})")
        return sum(trace.reward for trace in episode.traces) / len(episode.traces)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop all episodes run on, inside the env's `serving()` (its interception server and shared tools)."""
        with self.started:
            if self.loop is None:
                loop, ready = asyncio.new_event_loop(), threading.Event()

                async def hold():
                    async with self.env.serving():
                        ready.set()
                        await asyncio.Event().wait()  # for the life of the process (a daemon thread)

                threading.Thread(target=loop.run_forever, name="grpokit-verifiers-v1", daemon=True).start()
                serving = asyncio.run_coroutine_threadsafe(hold(), loop)
                while not ready.wait(0.05):
                    if serving.done():
                        serving.result()  # raises the env's start-up error
                self.loop = loop
                atexit.register(self._close, serving)
        return self.loop

    def _close(self, serving) -> None:
        """Leave the env's `serving()` (its interception server, its shared tools) before the process exits."""
        serving.cancel()
        with contextlib.suppress(BaseException):
            serving.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def task_prompt(data: Any) -> list[dict]:
    """A task's prompt as chat messages (its system prompt first)."""
    prompt = data.prompt
    messages = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
    if isinstance(prompt, str) or prompt is None:
        return [*messages, {"role": "user", "content": prompt or ""}]
    return messages + [
        message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message) for message in prompt
    ]
