"""OpenEnv environments (openenv-core 0.3): `GRPOTrainer(environment=OpenEnvEnvironment(url_or_server, ...))`.

An OpenEnv environment is a server (`openenv.core.env_server.create_app` over an `Environment` subclass with
`reset()`, `step(action)` and `state`) that clients reach over a WebSocket (`EnvClient`, one server-side session
per connection). Here every rollout opens a session of its own, resets it and plays it turn by turn:

    prompt (+ the reset observation, appended to the last user message as TRL does with environments)
    → the model's turn, sampled by the trainer's engine on token ids (loss mask 1, its sampling log-probs)
    → the turn's text → `parse_action` → `step(action)` over the session → StepResult(observation, reward, done)
    → the observation, rendered by `render_observation` as a user message and appended as the chat template's
      tokens for it (attention only, loss mask 0) → the next turn … until `done`, `max_turns` steps, or the
      completion budget (max_completion_length) runs out.

The rollouts of a generation run in parallel: their resets, then each round of steps, go out together and each
call has `step_timeout` seconds (the tool runner of grpokit.agents: the same time limits and failure counts as
tools). A rollout's reward is what the environment's steps gave:

- `rewards="turns"` (default): the reward of each step credits its turn as a process reward (grpokit.rewards.process:
  an agent's steps are its turns), so a token's advantage is built from the rewards of its turn and the turns after
  it; `rewards/<reward_name>/mean` logs the mean step reward.
- `rewards="sum"`: the steps' rewards summed, one outcome reward per rollout (the usual GRPO reward).

What goes wrong is counted and training goes on:
- a turn whose action does not parse (`parse_action` raises ValueError/TypeError/KeyError or returns None, or the
  action does not validate against `action_class` when it is known), or a turn cut at the token budget, ends the
  rollout without a step; that turn is rewarded `invalid_action_reward` (`openenv/action/failure_frequency`).
  Ending, rather than showing the model an error and letting it retry, keeps a rollout's reward the environment's.
- a reset or step that raises on the server, cannot reach it, or takes longer than `step_timeout` ends the rollout
  and leaves it unscored (reward None: "does not apply", as TRL's OpenEnv harness does with a failed session) —
  what the session holds after a failure is not the outcome of the model's actions
  (`environment/error_frequency`, `environment/timeout_frequency` per rollout; `openenv/<reset|step>/
  failure_frequency` per call).

Every group's G rollouts face the same task: the rows of the dataset are repeated G times and `reset_kwargs(row)`
(default: the row's `seed` column) picks the episode.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from ..agents.chat import appended_message_ids, render_prompt
from ..agents.loop import Transcript, sample_turns, transcripts_rollout, with_observation
from ..agents.tools import ToolRunner, ToolStats, summed_over_processes
from ..data import PromptLimit
from ..rewards.process import process_reward
from ..rollout.batching import SEED_STRIDE
from ..rollout.engine import Rollout, RolloutEngine, SamplingParams

INSTALL = 'pip install "grpokit[openenv]"'
REWARDS_COLUMN = "openenv_rewards"  # per row: the reward of each of its turns, or None when its session failed
PARSE_ERRORS = (ValueError, TypeError, KeyError)  # what a parser raises for an action it cannot read


def require_openenv() -> None:
    """An ImportError that says how to install openenv-core when it is missing."""
    try:
        import openenv.core  # noqa: F401
    except ImportError as error:
        raise ImportError(f"OpenEnv environments need openenv-core (0.3): {INSTALL}") from error


# ------------------------------------------------------------------------------------------- actions, observations


def json_action(text: str) -> dict:
    """The default action parser: the last JSON object in the turn's text (bare, or in a ```json fence)."""
    decoder, found, position = json.JSONDecoder(), None, text.find("{")
    while position != -1:
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            position = text.find("{", position + 1)
            continue
        found = value if isinstance(value, dict) else found
        position = text.find("{", end)
    if found is None:
        raise ValueError("no JSON object in the turn")
    return found


def text_action(field: str) -> Callable[[str], dict]:
    """A parser that sends the whole turn's text (stripped) as the action's `field`, e.g. the echo environment's
    `text_action("message")`."""

    def parse(text: str) -> dict:
        return {field: text.strip()}

    return parse


def render_observation(observation: Any) -> str:
    """The default rendering: an observation (a dict from the generic client, or a typed one) with one non-empty
    field is that field's text; with several, their JSON."""
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump(exclude={"reward", "done", "metadata"})
    if not isinstance(observation, dict):
        return str(observation)
    fields = {name: value for name, value in observation.items() if value not in (None, "", [], {})}
    if len(fields) == 1:
        value = next(iter(fields.values()))
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(fields, default=str)


# ------------------------------------------------------------------------------------------- a local server


class LocalServer:
    """An OpenEnv environment served by openenv's own app (`create_app`) on 127.0.0.1, in a thread of this process:
    for tests, examples and environments that live in the training script."""

    def __init__(
        self,
        environment: Callable,
        action_class: type,
        observation_class: type,
        max_concurrent_envs: int = 256,
        log_level: str = "warning",
    ):
        require_openenv()
        import uvicorn
        from openenv.core.env_server.http_server import create_app

        if not getattr(environment, "SUPPORTS_CONCURRENT_SESSIONS", True):
            raise ValueError(
                f"{environment.__name__} does not set SUPPORTS_CONCURRENT_SESSIONS = True, so openenv's "
                f"server gives it one session at a time; grpokit plays every rollout of a generation in "
                f"a session of its own, at once. Set it on the class when its instances share no "
                f"state."
            )
        app = create_app(environment, action_class, observation_class, max_concurrent_envs=max_concurrent_envs)
        self.action_class = action_class
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))  # a free port, held from now on (no race with another server)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="grpokit-openenv-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"The OpenEnv server for {getattr(environment, '__name__', environment)} did not "
                    f"start on {self.url}; see the log above."
                )
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._socket.close()


# ------------------------------------------------------------------------------------------- the adapter


class OpenEnvEnvironment:
    """An OpenEnv environment for `GRPOTrainer(environment=...)` (the grpokit.integrations adapter).

    Args:
        server: the environment server's URL (http://… or ws://…), or a `LocalServer`; `OpenEnvEnvironment.serve`
            starts one from an `Environment` class.
        prompt: the instruction each rollout starts from (a string: one user message; or a list of messages), the
            reset observation appended to its last message. Ignored when `dataset` is given.
        dataset: the rows to train on (a `datasets.Dataset` with a conversational `prompt` column and whatever
            `reset_kwargs` reads); default: one row per seed in `seeds`.
        seeds: the episodes of the default dataset (reset(seed=...)).
        reset_kwargs: row → keyword arguments of reset(); default: `seed` (and `episode_id`) when the row has them.
        parse_action: turn text → the action (a dict, or an openenv `Action`); raising ValueError/TypeError/KeyError
            or returning None makes it a bad action. Default `json_action`; `text_action(field)` sends the text.
        action_class: the environment's `Action` class, to validate actions before they are sent (a bad action
            then costs the turn, not the session); known when the server is a `LocalServer`.
        client_class: the `EnvClient` subclass that talks to the server; default `GenericEnvClient` (dicts).
        render_observation: observation → the text the model sees; `observation_role`: "user" or "tool".
        rewards: "turns" (each step's reward credits its turn: process rewards) or "sum" (one reward per rollout).
        max_turns: the most steps in one rollout. step_timeout: seconds each reset and step may take.
        invalid_action_reward: the reward of a turn that does not become a step. reward_name: in the metrics.
    """

    def __init__(
        self,
        server: str | LocalServer,
        *,
        prompt: str | list[dict] = "",
        dataset=None,
        seeds: range | list[int] = range(64),
        reset_kwargs: Callable[[dict], dict] | None = None,
        parse_action: Callable[[str], Any] = json_action,
        action_class: type | None = None,
        client_class: type | None = None,
        render_observation: Callable[[Any], str] = render_observation,
        observation_role: Literal["user", "tool"] = "user",
        rewards: Literal["turns", "sum"] = "turns",
        max_turns: int = 8,
        step_timeout: float = 30.0,
        invalid_action_reward: float = 0.0,
        reward_name: str = "openenv",
    ):
        require_openenv()
        if rewards not in ("turns", "sum"):
            raise ValueError(
                f"rewards={rewards!r}: use 'turns' (each step's reward credits its turn) or 'sum' (the "
                f"steps' rewards summed into one reward per rollout)."
            )
        if observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role={observation_role!r}: use 'user' or 'tool'.")
        if max_turns < 1:
            raise ValueError(f"max_turns={max_turns}: a rollout needs at least one step.")
        self.local = server if isinstance(server, LocalServer) else None
        self.url = server.url if self.local is not None else server
        self.action_class = action_class or (self.local.action_class if self.local is not None else None)
        if client_class is None:
            from openenv.core import GenericEnvClient

            client_class = GenericEnvClient
        self.client_class, self.parse_action, self.render_observation = client_class, parse_action, render_observation
        self.prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        self.dataset, self.seeds, self.reset_kwargs_of = dataset, list(seeds), reset_kwargs or default_reset_kwargs
        self.observation_role, self.rewards, self.max_turns = observation_role, rewards, max_turns
        self.step_timeout, self.invalid_action_reward = step_timeout, invalid_action_reward
        self.reward_name = reward_name

    @classmethod
    def serve(
        cls,
        environment: Callable,
        action_class: type,
        observation_class: type,
        *,
        max_concurrent_envs: int = 256,
        **options,
    ) -> OpenEnvEnvironment:
        """Serve `environment` (an openenv `Environment` class or factory) on 127.0.0.1 with openenv's server and
        train on it; `close()` stops the server."""
        server = LocalServer(environment, action_class, observation_class, max_concurrent_envs)
        return cls(server, **options)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()

    def __enter__(self) -> OpenEnvEnvironment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # EnvironmentAdapter

    def train_dataset(self):
        if self.dataset is not None:
            return self.dataset
        from datasets import Dataset

        return Dataset.from_list([{"prompt": self.prompt, "seed": seed} for seed in self.seeds])

    def reward_funcs(self) -> list[Callable]:
        if self.rewards == "turns":

            def reward(openenv_rewards, **kwargs):
                return [None if steps is None else list(steps) for steps in openenv_rewards]

            reward = process_reward(reward)
        else:

            def reward(openenv_rewards, **kwargs):
                return [None if steps is None else float(sum(steps)) for steps in openenv_rewards]

        reward.__name__ = self.reward_name
        return [reward]

    def reward_weights(self) -> list[float] | None:
        return None

    def driver(self, tokenizer, args, max_prompt_length: int | None) -> OpenEnvDriver:
        return OpenEnvDriver(
            self,
            tokenizer,
            max_completion_length=args.max_completion_length,
            max_prompt_length=max_prompt_length,
            chat_template_kwargs=args.chat_template_kwargs,
        )

    # one session

    def client(self):
        return self.client_class(base_url=self.url, message_timeout_s=self.step_timeout + 5.0)

    def action_of(self, text: str):
        """The action a turn's text asks for, or None when it is not a valid one."""
        try:
            action = self.parse_action(text)
            if action is not None and self.action_class is not None:
                values = action.model_dump() if hasattr(action, "model_dump") else action
                self.action_class.model_validate(values)
        except PARSE_ERRORS:  # pydantic's ValidationError is a ValueError
            return None
        return action


def default_reset_kwargs(row: dict) -> dict:
    return {key: row[key] for key in ("seed", "episode_id") if row.get(key) is not None}


async def open_session(client, **kwargs):
    await client.connect()
    return await client.reset(**kwargs)


async def step_session(client, action):
    return await client.step(action)


async def close_session(client, graceful: bool):
    """End a session. openenv 0.3's `EnvClient.close()` sends "close" and closes the socket at once, so the server
    then closes a closed socket and logs an error for every session: here the client sends "close" and lets the
    server close the socket first (private parts of EnvClient, looked up, used only when there). A session whose
    call failed or timed out is closed at once (its server side may still be busy)."""
    connection, send = getattr(client, "_ws", None), getattr(client, "_send", None)
    if graceful and connection is not None and send is not None:
        try:
            await send({"type": "close"})
            await asyncio.wait_for(connection.wait_closed(), timeout=5.0)
        except Exception:
            pass
    await client.close()


class OpenEnvDriver:
    """`MultiTurnDriver` that plays OpenEnv sessions turn by turn on the trainer's engine: every row's turn sampled
    in one engine call (grpokit.agents.loop.sample_turns), the sessions' resets and steps sent together."""

    logprobs_match_training = (
        True  # every trained token is sampled by the engine, on the context the training forward sees
    )
    concurrent_rollouts = True  # each rollout has a session of its own: groups may play at once (grpokit.streaming)

    def __init__(
        self,
        environment: OpenEnvEnvironment,
        tokenizer,
        *,
        max_completion_length: int,
        max_prompt_length: int | None,
        chat_template_kwargs: dict | None = None,
    ):
        self.environment, self.tokenizer = environment, tokenizer
        self.max_completion_length, self.max_prompt_length = max_completion_length, PromptLimit.of(max_prompt_length)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.runner = ToolRunner(environment.step_timeout)  # the sessions' calls, under the tools' time limits
        # Since the last metrics(), each rollout's counts added under the lock: calls and failures of reset, step and
        # action (a turn parsed into an action); rollouts done, failed with an error, timed out.
        self.stats, self.counts, self.lock = ToolStats(), Counter(), threading.Lock()

    def rollout(
        self, engine: RolloutEngine, rows: list[dict], params: SamplingParams, seed: int, host: Any = None
    ) -> tuple[Rollout, list]:
        """rows: one per completion, a prompt's G rows consecutive. The rollout (`openenv_rewards`: each row's step
        rewards, None for a failed session) and each row's completion as messages."""
        env, n = self.environment, len(rows)
        clients = [env.client() for _ in rows]
        stats, counts = ToolStats(rows=n), Counter()  # this rollout's
        failed = [None] * n  # why a row's session failed: "error" or "timeout"
        resets = self._call(
            "reset",
            [functools.partial(open_session, c, **env.reset_kwargs_of(row)) for c, row in zip(clients, rows)],
            range(n),
            failed,
            stats,
        )
        transcripts = [self._start(row, result) for row, result in zip(rows, resets)]
        step_rewards: list[list[float]] = [[] for _ in rows]
        playing = list(range(n))  # rows that sample a turn now; a row whose reset failed samples one, unscored
        for turn in range(env.max_turns):
            sample_turns(
                engine,
                self.tokenizer,
                None,
                transcripts,
                playing,
                params,
                seed + SEED_STRIDE * turn,
                self.max_completion_length,
            )
            stepping, actions = [], []
            for i in playing:
                if failed[i]:
                    continue
                stats.calls["action"] += 1
                action = None if transcripts[i].truncated else env.action_of(transcripts[i].messages[-1]["content"])
                if action is None:  # a bad action (or a turn cut at the budget) ends the rollout without a step
                    stats.failures["action"] += 1
                    step_rewards[i].append(env.invalid_action_reward)
                else:
                    stepping.append(i)
                    actions.append(action)
            results = self._call(
                "step",
                [functools.partial(step_session, clients[i], action) for i, action in zip(stepping, actions)],
                stepping,
                failed,
                stats,
            )
            playing = []
            for i, result in zip(stepping, results):
                if failed[i]:
                    continue
                step_rewards[i].append(float(result.reward or 0.0))
                counts["done"] += bool(result.done)
                if not result.done and turn + 1 < env.max_turns and self._add_observation(transcripts[i], result):
                    playing.append(i)
            if not playing:
                break
        self.runner.call(
            [("close", functools.partial(close_session, c, graceful=not f), {}, None) for c, f in zip(clients, failed)],
            ToolStats(),
        )
        counts.update(reason for reason in failed if reason)
        with self.lock:
            self.stats.rows += stats.rows
            self.stats.calls.update(stats.calls)
            self.stats.failures.update(stats.failures)
            self.counts.update(counts)
        extra = {REWARDS_COLUMN: [None if failed[i] else step_rewards[i] for i in range(n)]}
        return transcripts_rollout(transcripts, params.pad_token_id, extra), [t.messages for t in transcripts]

    def _call(self, name: str, calls: list[Callable], rows, failed: list, stats: ToolStats) -> list:
        """Run the sessions' calls (coroutine functions) of `rows` together, each within step_timeout; their results
        (None for a failed one, whose row is marked in `failed`), counted under name."""
        timed_out = []
        outcomes = self.runner.call([(name, call, {}, None) for call in calls], stats, on_timeout=timed_out.append)
        for row, call, (_, problem) in zip(rows, calls, outcomes):
            if problem is not None:
                failed[row] = "timeout" if call in timed_out else "error"
        return [result for result, _ in outcomes]

    def _start(self, row: dict, reset) -> Transcript:
        """A row's transcript: its prompt with the reset observation appended to the last message (TRL)."""
        prompt = row.get("prompt") or self.environment.prompt
        if reset is not None and reset.observation is not None:
            text = self.environment.render_observation(reset.observation)
            prompt = with_observation(prompt, ("\n\n" if prompt[-1]["content"] else "") + text)
        ids = render_prompt(self.tokenizer, prompt, [], self.chat_template_kwargs)
        return Transcript(self.max_prompt_length.cut([ids])[0] if self.max_prompt_length else ids, {})

    def _add_observation(self, transcript: Transcript, result) -> bool:
        """Append the step's observation as the chat template renders it (a user message, or a tool result); False
        when it does not fit the completion budget (the rollout ends there)."""
        message = {
            "role": self.environment.observation_role,
            "content": self.environment.render_observation(result.observation),
        }
        if message["role"] == "tool":
            message["name"] = "step"
        ids = appended_message_ids(self.tokenizer, [message], self.chat_template_kwargs)
        if len(transcript.ids) + len(ids) >= self.max_completion_length:
            return False
        transcript.add(ids, 0)
        transcript.messages.append(message)
        return True

    def metrics(self, accelerator) -> dict[str, float]:
        """`environment/error_frequency` and `environment/timeout_frequency` (rollouts whose session failed, as the
        other environment integrations count them); `openenv/<reset|step|action>/call_frequency` (per rollout) and
        `failure_frequency` (per call: resets and steps that raised or timed out; turns that were no valid action);
        `openenv/done_frequency` (rollouts the environment ended). A collective."""
        with self.lock:
            values = [float(self.stats.rows)] + [float(self.counts[key]) for key in ("done", "error", "timeout")]
            tool_metrics = self.stats.metrics(accelerator, ["reset", "step", "action"])
            self.counts.clear()
        rows, done, errors, timeouts = summed_over_processes(accelerator, values)
        if not any((rows, done, errors, timeouts)):  # no rollout ended since the last record (streamed groups)
            return {}
        out = {
            key.replace("tools/", "openenv/", 1): value for key, value in tool_metrics.items() if key.count("/") == 2
        }
        rows = max(rows, 1.0)
        out.update(
            {
                "environment/error_frequency": errors / rows,
                "environment/timeout_frequency": timeouts / rows,
                "openenv/done_frequency": done / rows,
            }
        )
        return out


def adapter(environment) -> OpenEnvEnvironment | None:
    """`GRPOTrainer(environment=client)` with an openenv `EnvClient` (or its `.sync()` wrapper): train on the server it
    points at, each rollout with a session of its own from a client of the same class."""
    client = getattr(environment, "_async", environment)  # SyncEnvClient wraps the async client
    url = getattr(client, "_ws_url", None)
    if url is None:
        return None
    return OpenEnvEnvironment(url.removesuffix("/ws"), client_class=type(client))


__all__ = ["LocalServer", "OpenEnvDriver", "OpenEnvEnvironment", "json_action", "render_observation", "text_action"]
