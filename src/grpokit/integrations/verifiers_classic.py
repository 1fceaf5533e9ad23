"""Classic verifiers environments (verifiers 0.3, `verifiers.legacy`: `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv` and
their subclasses), trained on as they are: `GRPOTrainer(model, args=..., environment=vf_env)`.

- Prompts: the environment's dataset (`env.get_dataset()`), formatted by the environment itself (system prompt,
  few-shot, `question` → `prompt`); its `answer`, `info`, `task` columns travel with each row.
- Turns: the environment's own `rollout` runs each row (setup_state, stop conditions, env_response, tool calls,
  timeout_seconds, cleanup). Only the model call is grpokit's: the environment talks to an `EngineClient` (a
  `vf.Client`) that samples on token ids with any `RolloutEngine`. Each continuation is sampled on the prompt ids
  plus the transcript ids so far (never re-tokenized text); the environment's messages in between are the chat
  template's rendering of them (loss mask 0). The model calls of all rows wait for one another and run as one
  engine call (`rollout.batching.AsyncBatcher`, Flush.EVERY_CALLER_WAITS), as grpokit's own tool loop samples a turn
  of every row at once.
- Rewards: the rubric's functions and weights, metrics included (weight 0: logged, not rewarded). The rubric
  scores each group of a prompt's rollouts with its own `score_group` (async functions run concurrently,
  asyncio.gather); the reward functions the trainer sees read those scores back, named as the rubric names them.
- Failures never stop training: a rollout whose environment raised (any exception, in env_response, setup or a
  tool) ends there; one past the environment's `timeout_seconds` likewise. Either scores None in every rubric
  function (excluded from its group's baseline, no advantage: grpokit's rule for a failed environment or harness
  rollout in every driver, docs/guides/agents.md) and is counted (`environment/error_frequency`,
  `environment/timeout_frequency`): a broken environment is not the policy's fault, so it is not punished for it.
  A ToolEnv's calls are counted as grpokit's tools are (`tools/call_frequency`, `tools/failure_frequency` for calls
  of unknown tools).

verifiers' v1 API (`verifiers.v1`) is another module's (this adapter returns None for it). Touches of verifiers'
internals are all here: `State`, `Response`/`ResponseMessage`/`ResponseTokens`, `Client`, `OverlongPromptError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ..agents.chat import appended_message_ids, check_tool_calling, render_prompt
from ..agents.loop import Transcript, add_turn, transcripts_rollout, turn_request
from ..agents.tools import ToolStats, summed_over_processes
from ..data import PromptLimit
from ..rollout.batching import AsyncBatcher
from ..rollout.engine import Rollout, RolloutEngine, SamplingParams

try:
    import verifiers
    from verifiers.legacy import Environment, MultiTurnEnv, ToolEnv
    from verifiers.legacy.clients import Client
    from verifiers.legacy.errors import OverlongPromptError
    from verifiers.legacy.types import Response, ResponseMessage, ResponseTokens, ToolCall, Usage
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        'Training on a verifiers environment needs verifiers 0.3 (the classic API): pip install "grpokit[verifiers]"'
    ) from error

STATE_COLUMN = "verifiers_state"  # the per-row column that carries each rollout's verifiers State to the rewards


def adapt(environment) -> ClassicEnvironment | None:
    """The adapter for a classic verifiers environment; None for anything else (verifiers.v1 objects included)."""
    if not isinstance(environment, Environment):
        return None
    if not isinstance(environment, MultiTurnEnv):
        raise TypeError(
            f"GRPOTrainer(environment=...) trains on classic verifiers environments built on MultiTurnEnv "
            f"(SingleTurnEnv, MultiTurnEnv, ToolEnv and their subclasses); a "
            f"{type(environment).__name__} (verifiers {verifiers.__version__}) runs its rollouts some "
            f"other way, so grpokit cannot play its turns on its engine."
        )
    return ClassicEnvironment(environment)


def rubric_functions(rubric) -> list[tuple[Callable, float]]:
    """(function, weight) of a rubric, its RubricGroup's rubrics flattened in order."""
    if hasattr(rubric, "rubrics"):
        return [pair for inner in rubric.rubrics for pair in rubric_functions(inner)]
    return list(zip(rubric.funcs, rubric.weights))


class ClassicEnvironment:
    """`EnvironmentAdapter` for a classic verifiers environment."""

    def __init__(self, environment):
        self.environment = environment
        self.pairs = rubric_functions(environment.rubric)
        names = [getattr(f, "__name__", repr(f)) for f, _ in self.pairs]
        doubles = sorted({n for n in names if names.count(n) > 1})
        if doubles:  # the rubric sums same-named scores; grpokit logs and weights each function by name
            raise ValueError(
                f"The environment's rubric has several reward functions named {doubles}; give each a "
                f"name of its own (__name__), so that each is logged and weighted as itself."
            )
        self.names = names

    def train_dataset(self):
        return self.environment.get_dataset()

    def reward_funcs(self) -> list[Callable]:
        return [scored(name) for name in self.names]

    def reward_weights(self) -> list[float]:
        return [float(w) for _, w in self.pairs]

    def driver(self, tokenizer, args, max_prompt_length: int | None) -> ClassicDriver:
        return ClassicDriver(
            self.environment,
            tokenizer,
            max_completion_length=args.max_completion_length,
            max_prompt_length=max_prompt_length,
            chat_template_kwargs=args.chat_template_kwargs,
        )


def failed(state) -> bool:
    """Whether a rollout's environment raised or ran past its `timeout_seconds` (`ClassicDriver._play`)."""
    return state.get("error") is not None or bool(state.get("timed_out"))


def scored(name: str) -> Callable:
    """The reward function that reads the rubric's score `name` off each row's scored State: None for a failed
    rollout (`failed`), which then takes no part in its group's advantage."""

    def reward(completions, **columns) -> list[float | None]:
        return [None if failed(state) else float(state["metrics"][name]) for state in columns[STATE_COLUMN]]

    reward.__name__ = reward.__qualname__ = name
    return reward


class ClassicDriver:
    """`MultiTurnDriver` that runs a classic verifiers environment's rollouts on a grpokit engine."""

    logprobs_match_training = (
        True  # every trained token is sampled by the engine, on the context the training forward sees
    )

    def __init__(
        self,
        environment,
        tokenizer,
        *,
        max_completion_length: int,
        max_prompt_length: int | None,
        chat_template_kwargs: dict | None = None,
    ):
        self.environment, self.tokenizer = environment, tokenizer
        self.max_completion_length, self.max_prompt_length = max_completion_length, PromptLimit.of(max_prompt_length)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tools = dict(getattr(environment, "tool_map", {})) if isinstance(environment, ToolEnv) else {}
        self.template = check_tool_calling(tokenizer) if self.tools else None
        self.tool_stats = ToolStats()
        self.rows = self.errors = self.timeouts = 0
        # One event loop for the driver's lifetime: environments may hold loop-bound resources across rollouts.
        self.loop = asyncio.new_event_loop()

    def rollout(
        self, engine: RolloutEngine, rows: list[dict], params: SamplingParams, seed: int, host: Any = None
    ) -> tuple[Rollout, list]:
        """rows: one per completion, a prompt's G rows consecutive. The rollout, and each row's completion as the
        environment renders it (messages)."""
        batcher = AsyncBatcher(engine, len(rows), seed)
        clients = [EngineClient(self, batcher, row, params) for row in range(len(rows))]
        states = self.loop.run_until_complete(self._play_and_score(rows, clients))
        transcripts = [
            client.transcript or Transcript(client.prompt_ids(states[i]), {}) for i, client in enumerate(clients)
        ]
        self.rows += len(rows)
        self.tool_stats.rows += len(rows)
        self.errors += sum(state.get("error") is not None for state in states)
        self.timeouts += sum(bool(state.get("timed_out")) for state in states)
        for state in states:
            for message in state.get("completion") or []:
                for call in message_field(message, "tool_calls") or []:
                    self.tool_stats.calls[call.name] += 1
                    self.tool_stats.failures[call.name] += call.name not in self.tools
        rollout = transcripts_rollout(transcripts, params.pad_token_id, {STATE_COLUMN: states})
        return rollout, [[chat_message(m) for m in state.get("completion") or []] for state in states]

    async def _play_and_score(self, rows: list[dict], clients: list[EngineClient]) -> list:
        states = await asyncio.gather(*(self._play(row, client) for row, client in zip(rows, clients)))
        # The rubric scores each prompt's group together (group reward functions see the group), all groups at once.
        keys = [row.get("example_id", str(row.get("prompt"))) for row in rows]
        starts = [i for i in range(len(rows)) if i == 0 or keys[i] != keys[i - 1]]
        groups = [states[a:b] for a, b in zip(starts, [*starts[1:], len(rows)])]
        await asyncio.gather(*(self.environment.rubric.score_group(group) for group in groups))
        await asyncio.gather(*(self.environment.rubric.cleanup(state) for state in states))
        return states

    async def _play(self, row: dict, client: EngineClient):
        """One row through the environment's own rollout; an environment that raises ends the row there."""
        environment = self.environment
        try:
            return await environment.rollout(dict(row), client, "grpokit", environment.sampling_args)
        except Exception as error:  # an environment's failure costs its row, never training
            if error is client.batcher.failure:
                raise
            state = client.state
            if state is None:  # it raised before the first model call: a state to score, with an empty completion
                state = await environment.init_state(dict(row), client, "grpokit", environment.sampling_args)
            state["error"] = error
            if state.get("completion") is None:
                await environment.render_completion(state)
            return state
        finally:
            client.batcher.finished(client.row)

    def metrics(self, accelerator) -> dict[str, float]:
        rows, errors, timeouts = summed_over_processes(
            accelerator, [float(self.rows), float(self.errors), float(self.timeouts)]
        )
        self.rows = self.errors = self.timeouts = 0
        out = {
            "environment/error_frequency": errors / max(rows, 1.0),
            "environment/timeout_frequency": timeouts / max(rows, 1.0),
        }
        if self.tools:
            out.update(self.tool_stats.metrics(accelerator, list(self.tools)))
        return out


class EngineClient(Client):
    """The `vf.Client` one row's rollout talks to: it keeps the row's transcript as token ids and samples each turn
    through the driver's `AsyncBatcher` (as caller `row`), on the prompt ids plus the transcript ids so far."""

    def __init__(self, driver: ClassicDriver, batcher: AsyncBatcher, row: int, params: SamplingParams):
        super().__init__(None)
        self.driver, self.batcher, self.row, self.params = driver, batcher, row, params
        self.transcript: Transcript | None = None
        self.seen = 0  # how many of the rollout's messages the transcript holds (prompt and every turn so far)
        self.state = None  # the row's verifiers State, from its first model call

    def prompt_ids(self, state) -> list[int]:
        driver = self.driver
        prompt = [chat_message(m) for m in state["prompt"]]
        tools = [tool_schema(t) for t in state.get("tool_defs") or []]
        ids = render_prompt(driver.tokenizer, prompt, tools, driver.chat_template_kwargs)
        return driver.max_prompt_length.cut([ids])[0] if driver.max_prompt_length is not None else ids

    async def get_response(self, prompt, model: str, sampling_args, tools=None, **kwargs) -> Response:
        state, driver = kwargs.get("state"), self.driver
        self.state = state if state is not None else self.state
        messages = list(prompt)
        if self.transcript is None:
            self.transcript = Transcript(self.prompt_ids(state), driver.tools)
        else:
            transcript = self.transcript
            new = [chat_message(m) for m in messages[self.seen :]]
            if len(messages) < self.seen or not new:
                raise NotImplementedError(
                    "grpokit trains on environments whose turns extend the conversation (each "
                    "model call sees the previous one's messages and the environment's "
                    "reply); this environment's get_prompt_messages rewrites the history."
                )
            ids = appended_message_ids(driver.tokenizer, new, driver.chat_template_kwargs)
            # No room left for the environment's reply and another turn (or the last turn was cut): the rollout
            # ends here, as verifiers ends one whose prompt outgrew the model (OverlongPromptError).
            if transcript.truncated or len(transcript.ids) + len(ids) >= driver.max_completion_length:
                raise OverlongPromptError("the completion budget (max_completion_length) is spent")
            transcript.add(ids, 0)
        self.seen = len(messages) + 1  # the prompt and the turn about to be sampled
        start = len(self.transcript.ids)
        request = turn_request(self.transcript, self.params, driver.max_completion_length, caller=self.row)
        add_turn(driver.tokenizer, driver.template, self.transcript, await self.batcher.generate(request))
        return as_response(self.transcript, start, model)

    # The rest of vf.Client's interface speaks to an HTTP API; the engine needs none of it.
    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        raise NotImplementedError("EngineClient answers get_response itself")

    async def raise_from_native_response(self, response) -> None:
        return None

    async def from_native_response(self, response):
        raise NotImplementedError("EngineClient answers get_response itself")

    async def close(self) -> None:
        return None


def as_response(transcript: Transcript, start: int, model: str) -> Response:
    """The turn just sampled (transcript.ids[start:]) as verifiers' Response, with its tokens and log-probs."""
    message, turn = transcript.messages[-1], transcript.ids[start:]
    calls = [
        ToolCall(id=f"call_{i}", name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"]))
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    context = transcript.prompt_ids + transcript.ids[:start]
    reason = "length" if transcript.truncated else "tool_calls" if calls else "stop"
    tokens = ResponseTokens(
        prompt_ids=context,
        prompt_mask=[0] * len(context),
        completion_ids=turn,
        completion_mask=[1] * len(turn),
        completion_logprobs=transcript.logprobs[start:],
    )
    usage = Usage(
        prompt_tokens=len(context),
        reasoning_tokens=0,
        completion_tokens=len(turn),
        total_tokens=len(context) + len(turn),
    )
    return Response(
        id=f"grpokit-{start}",
        created=0,
        model=model,
        usage=usage,
        message=ResponseMessage(
            content=message.get("content") or "",
            tool_calls=calls or None,
            finish_reason=reason,
            is_truncated=transcript.truncated,
            tokens=tokens,
        ),
    )


def message_field(message, name: str, default=None):
    """A field of a message, whether a dict or one of verifiers' pydantic messages."""
    return message.get(name, default) if isinstance(message, dict) else getattr(message, name, default)


def chat_message(message) -> dict:
    """A verifiers message (pydantic or dict) as the chat template takes it; tool calls in the nested form."""
    role, content = message_field(message, "role"), message_field(message, "content")
    if not isinstance(content, (str, type(None))):
        content = [part if isinstance(part, dict) else part.model_dump(exclude_none=True) for part in content]
    out = {"role": role, "content": content if content is not None else ""}
    calls = message_field(message, "tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "function": {
                    "name": message_field(c, "name"),
                    "arguments": json.loads(message_field(c, "arguments") or "{}"),
                },
            }
            for c in calls
        ]
    return out


def tool_schema(tool) -> dict:
    """A verifiers Tool (name, description, parameters) as the chat template's tool schema."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


__all__ = ["ClassicDriver", "ClassicEnvironment", "EngineClient", "adapt"]
