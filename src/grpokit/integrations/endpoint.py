"""The policy as an HTTP endpoint, for agent harnesses that run outside grpokit (an agent written with the OpenAI
SDK, verifiers v1's environments), and the driver that turns what they asked of it into a `Rollout`.

`PolicyEndpoint` serves whatever `RolloutEngine` the trainer holds on 127.0.0.1, while a generation is open
(`serving`), in two wire formats:

- `POST /v1/chat/completions` (OpenAI): messages and optional tools, rendered with the tokenizer's chat template,
  sampled by the engine, tool calls parsed with `grpokit.agents.chat.parse_completion`; an OpenAI-shaped reply.
- `POST /inference/v1/generate` (vLLM's token-in/token-out route, which verifiers 0.4's v1 `TrainClient` calls
  through `renderers.client.generate`): `{"token_ids", "sampling_params"}` in; `{"prompt_token_ids", "choices":
  [{"token_ids", "logprobs": {"content": [{"token": "token_id:<id>", "logprob"}]}, "finish_reason"}]}` out; and
  `GET /v1/models` with the model's `max_model_len`.

Calls of one rollout are joined by a session: its base URL, `http://127.0.0.1:<port>/s/<session>/v1`, which any
OpenAI-SDK client takes as `base_url` (an `X-Session-ID` header on the bare routes works too). Each call records
the prompt ids, the sampled ids, their log-probs and the policy version.

Sampling uses the trainer's settings (temperature, top-p, ...), whatever the request asks, so that the recorded
log-probs are the ones the loss is computed with; a request's `max_tokens` and stop token ids only shorten a turn,
and every session shares the completion budget `max_completion_length`. Engine calls are refused outside the
`serving` window their session was opened in, and leaving a window waits for its calls in flight: the in-process
engine samples from the very model being trained, so no call may run while it trains (a harness that outlives its
rollout gets HTTP 404). Calls take turns on the engine, in the order they come, each seeded by its session and
turn (`rollout.batching`, Flush.ONE_AT_A_TIME); under asynchronous generation, where several windows (groups) are
open at once and the engine is already a `BatchingEngine` that merges what arrived while it was busy, calls that
arrive together go into one engine call.

Stitching (`stitch`): a rollout is trained as one sequence, prompt + completion, so each call's prompt must extend
the previous call's prompt + completion token for token; what lies between (tool results, later user turns) is
attention-only. The chat route keeps that true where the harness re-sends the transcript it was given: a request
whose messages are the previous request's, the reply it got and new tool or user messages is rendered as the
previous ids plus the chat template's rendering of the new messages (`tool_result_ids`), never re-tokenized (as
verifiers' renderers bridge turns and TRL appends tool results). Where a harness rewrites its history (drops turns,
edits a message), the prefix breaks: as AReaL's and prime-rl's interleaving do, the transcript starts a new segment
there. grpokit trains one sequence per row, so it keeps the last segment (the one that reached the answer the reward
judges) and counts the break (`endpoint/prefix_break_frequency`); the earlier segments are not trained on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

import torch

from ..agents.chat import parse_completion, render_prompt, response_template, tool_result_ids
from ..agents.loop import Transcript, transcripts_rollout
from ..agents.tools import in_daemon_thread
from ..data import is_conversational
from ..json_http import JSONError, JSONHandler
from ..rollout.batching import BatchingEngine, Flush
from ..rollout.engine import PromptBatch, Rollout, RolloutEngine, SamplingParams

SESSION_HEADER = "X-Session-ID"  # verifiers' header name (HTTP header names are case-insensitive)
ROUTE = re.compile(
    r"^(?:/s/(?P<session>[A-Za-z0-9_.-]+))?(?P<route>/v1/chat/completions|/inference/v1/generate"
    r"|/v1/models)/?$"
)


class EndpointError(JSONError):
    """A request the endpoint refuses, with its HTTP status (OpenAI's "invalid_request_error")."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)


@dataclasses.dataclass
class Call:
    """One engine call of a session."""

    prompt_ids: list[int]  # the context the turn was sampled in
    completion_ids: list[int]  # the sampled tokens
    logprobs: list[float] | None  # their log-probs under the engine's policy; None where it reports none
    version: int | None  # the policy version (training step) that sampled them
    truncated: bool  # ended by the token budget, not a stop token
    messages: list[dict] | None = None  # chat route: the request's messages, tools and the reply (for bridging)
    tools: list | None = None
    reply: dict | None = None
    # each token's kept set and the penalty / suppressed tokens, where the engine returned a sampling mask
    kept: list[list[int]] | None = None
    mask_settings: tuple | None = None


@dataclasses.dataclass(eq=False)
class Window:
    """One `serving` window: the engine and what its calls are sampled with, and its calls in flight."""

    engine: BatchingEngine
    params: SamplingParams
    seed: int
    version: int | None
    open: bool = True
    in_flight: int = 0


@dataclasses.dataclass
class Session:
    index: int  # the row it plays (seeds its calls)
    window: Window
    calls: list[Call] = dataclasses.field(default_factory=list)
    closed: bool = False


class PolicyEndpoint:
    """The engine behind HTTP on 127.0.0.1 (see the module docstring). `start()` once; then per generation
    `with endpoint.serving(engine, params, seed, version) as window:` open sessions in it, let harnesses call,
    close them. Windows may be open at once (groups streamed under asynchronous generation)."""

    def __init__(
        self,
        tokenizer,
        *,
        max_completion_length: int,
        chat_template_kwargs: dict | None = None,
        model_name: str = "grpokit-policy",
        max_model_length: int | None = None,
        port: int = 0,
    ):
        self.tokenizer, self.max_completion_length = tokenizer, max_completion_length
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.model_name, self.max_model_length, self.port = model_name, max_model_length, port
        try:
            self.template = response_template(tokenizer)
        except ValueError:  # no tool-call format known: replies are the decoded text
            self.template = None
        self.lock = threading.Lock()  # the sessions and windows (not held during engine calls)
        self.idle = threading.Condition(self.lock)  # notified when a call in flight ends
        self.one_at_a_time: BatchingEngine | None = None  # the latest plain engine served, its calls taking turns
        self.sessions: dict[str, Session] = {}
        self.server: ThreadingHTTPServer | None = None

    # ------------------------------------------------------------------------------------------- lifetime

    def start(self) -> PolicyEndpoint:
        if self.server is None:
            self.server = EndpointServer(("127.0.0.1", self.port), handler_for(self))
            threading.Thread(target=self.server.serve_forever, name="grpokit-endpoint", daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def base_url(self, session: str) -> str:
        """The OpenAI `base_url` of one session."""
        return f"{self.url}/s/{session}/v1"

    @contextlib.contextmanager
    def serving(self, engine: RolloutEngine, params: SamplingParams, seed: int, version: int | None):
        """The window's sessions may call the engine inside this block only; leaving it waits for their calls in
        flight and closes them."""
        window = Window(self._batching(engine), params, seed, version)
        try:
            yield window
        finally:
            with self.lock:
                window.open = False
                while window.in_flight:
                    self.idle.wait()
                for name in [n for n, s in self.sessions.items() if s.window is window]:
                    self.sessions.pop(name).closed = True

    def _batching(self, engine: RolloutEngine) -> BatchingEngine:
        """The engine as the sessions call it. A plain one answers one call at a time, each alone with its own
        seed, so that a call's sample is a function of its session and turn, not of the calls it met; a
        BatchingEngine (asynchronous generation) as it is, merging the calls that arrive while it is busy."""
        if isinstance(engine, BatchingEngine):
            return engine
        with self.lock:
            if self.one_at_a_time is None or self.one_at_a_time.engine is not engine:
                self.one_at_a_time = BatchingEngine(engine, flush=Flush.ONE_AT_A_TIME)
            return self.one_at_a_time

    def open_session(self, index: int, window: Window) -> str:
        """A session of `window` playing row `index`."""
        if not window.open:
            raise RuntimeError("open_session: open sessions inside `with endpoint.serving(...) as window`.")
        name = uuid.uuid4().hex[:16]
        with self.lock:
            self.sessions[name] = Session(index, window)
        return name

    def close_session(self, name: str) -> list[Call]:
        """The session's calls; later calls to it are refused, and a call in flight is not recorded."""
        with self.lock:
            session = self.sessions.pop(name, None)
            if session is None:
                return []
            session.closed = True
            return list(session.calls)

    # ------------------------------------------------------------------------------------------- routes

    def _session(self, name: str | None) -> Session:
        if name is None:
            raise EndpointError(
                400,
                f"No session: call the base URL of a session (/s/<session>/v1) or send the {SESSION_HEADER} header.",
            )
        session = self.sessions.get(name)
        if session is None:
            raise EndpointError(404, f"Session {name!r} is not open (its rollout has ended, or timed out).")
        return session

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "owned_by": "grpokit"}
        if self.max_model_length is not None:
            card["max_model_len"] = self.max_model_length
        return {"object": "list", "data": [card]}

    def chat(self, session_name: str | None, body: dict) -> dict:
        """OpenAI chat completions: one assistant turn for `body["messages"]` (and `body["tools"]`)."""
        session = self._session(session_name)
        messages, tools = [as_template_message(m) for m in body.get("messages") or []], body.get("tools") or None
        if not messages:
            raise EndpointError(400, "messages must be a non-empty list of chat messages.")
        prompt_ids = self._bridged(session, messages, tools)
        if prompt_ids is None:
            prompt_ids = render_prompt(self.tokenizer, messages, tools, self.chat_template_kwargs)
        call = self._sample(session, prompt_ids, body.get("max_completion_tokens") or body.get("max_tokens"), ())
        reply = parse_completion(self.tokenizer, self.template, call.completion_ids, prompt_ids, tools or [])
        call.messages, call.tools, call.reply = messages, tools, reply
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"])
                    if not isinstance(c["function"]["arguments"], str)
                    else c["function"]["arguments"],
                },
            }
            for c in reply.get("tool_calls") or []
        ]
        message = {"role": "assistant", "content": reply.get("content") or None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "length" if call.truncated else "tool_calls" if tool_calls else "stop"
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage(call),
        }

    def generate(self, session_name: str | None, body: dict) -> dict:
        """vLLM's /inference/v1/generate, as renderers.client.generate (verifiers 0.4's TrainClient) calls it."""
        session = self._session(session_name)
        prompt_ids, sampling = body.get("token_ids"), body.get("sampling_params") or {}
        if not isinstance(prompt_ids, list) or not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
            raise EndpointError(400, "token_ids must be a non-empty list of token ids.")
        stop_ids = tuple(sampling.get("stop_token_ids") or ())
        call = self._sample(session, prompt_ids, sampling.get("max_tokens"), stop_ids)
        logprobs = call.logprobs if call.logprobs is not None else [0.0] * len(call.completion_ids)  # wire: a number
        return {
            "request_id": f"gen-{uuid.uuid4().hex}",
            "prompt_token_ids": prompt_ids,
            "usage": usage(call),
            "choices": [
                {
                    "index": 0,
                    "token_ids": call.completion_ids,
                    "logprobs": {
                        "content": [
                            {"token": f"token_id:{t}", "logprob": p} for t, p in zip(call.completion_ids, logprobs)
                        ]
                    },
                    "finish_reason": "length" if call.truncated else "stop",
                }
            ],
        }

    # ------------------------------------------------------------------------------------------- sampling

    def _bridged(self, session: Session, messages: list[dict], tools) -> list[int] | None:
        """The previous call's ids plus the rendering of the new tool/user messages, when `messages` extend the
        previous request and its reply (None otherwise: render the whole conversation)."""
        previous = session.calls[-1] if session.calls else None
        if previous is None or previous.messages is None or previous.truncated or previous.tools != tools:
            return None
        before = [*previous.messages, previous.reply]
        tail = messages[len(before) :]
        same = len(messages) > len(before) and all(same_message(a, b) for a, b in zip(messages, before))
        if not same or any(m.get("role") not in ("tool", "user") for m in tail):
            return None
        if self.tokenizer.eos_token_id not in previous.completion_ids[-1:]:
            return None
        return (
            previous.prompt_ids
            + previous.completion_ids
            + tool_result_ids(self.tokenizer, tail, self.chat_template_kwargs)
        )

    def _sample(self, session: Session, prompt_ids: list[int], max_tokens, stop_ids: tuple) -> Call:
        window = session.window
        with self.lock:
            if not window.open or session.closed:
                raise EndpointError(
                    404,
                    "No rollout is being played: the endpoint samples only while the trainer waits for its harnesses.",
                )
            first = session.calls[0].prompt_ids if session.calls else prompt_ids
            used = max(len(prompt_ids) - len(first), 0)  # the session's completion budget spent so far
            budget = self.max_completion_length - used
            if self.max_model_length is not None:
                budget = min(budget, self.max_model_length - len(prompt_ids))
            if max_tokens is not None:
                budget = min(budget, int(max_tokens))
            if budget <= 0:  # nothing left to sample: an empty, truncated turn, recorded as no call
                return Call(list(prompt_ids), [], [], window.version, True)
            stops = tuple(window.params.eos_token_ids) + tuple(stop_ids)
            params = dataclasses.replace(window.params, max_new_tokens=budget, eos_token_ids=stops)
            seed = window.seed + 1009 * session.index + 7919 * len(session.calls)
            window.in_flight += 1
        try:
            prompts = PromptBatch(ids=[list(prompt_ids)], counts=[1], raw=[None])
            out = window.engine.generate(prompts, params, seed)
        finally:
            with self.lock:
                window.in_flight -= 1
                self.idle.notify_all()
        ids = out.completion_id_lists()[0]
        logprobs = None if out.sampling_logprobs is None else out.sampling_logprobs[0, : len(ids)].tolist()
        call = Call(list(prompt_ids), ids, logprobs, window.version, bool(out.is_truncated[0]))
        if out.sampling_mask is not None:
            mask = out.sampling_mask
            call.kept = [[int(v) for v in row if v >= 0] for row in mask.kept_ids[0, : len(ids)].tolist()]
            call.mask_settings = (mask.repetition_penalty, mask.suppressed_ids)
        with self.lock:
            if session.closed:  # its rollout ended (timed out) while the engine sampled: nothing to record into
                raise EndpointError(404, "The session closed while its call was sampled (its rollout timed out).")
            session.calls.append(call)
        return call


def as_template_message(message: dict) -> dict:
    """An OpenAI message as chat templates take it: tool-call arguments as objects (OpenAI sends JSON strings),
    content None as ""."""
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function", {}))
            if isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    function["arguments"] = json.loads(function["arguments"])
            calls.append({"type": call.get("type", "function"), "function": function})
        message["tool_calls"] = calls
    return message


def same_message(a: dict, b: dict) -> bool:
    """Whether two messages render the same: role, content and tool calls (names and arguments), nothing else (a
    harness adds ids, names and fields of its own)."""

    def key(m: dict) -> tuple:
        calls = [(c["function"]["name"], c["function"].get("arguments")) for c in m.get("tool_calls") or []]
        return m.get("role"), m.get("content") or "", calls

    return key(a) == key(b)


def usage(call: Call) -> dict:
    return {
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": len(call.completion_ids),
        "total_tokens": len(call.prompt_ids) + len(call.completion_ids),
    }


class EndpointServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # every rollout of a generation connects at once (http.server's default backlog: 5)


def handler_for(endpoint: PolicyEndpoint):
    class Handler(JSONHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an SDK client reuses its connection turn after turn

        def route(self, method: str, path: str) -> dict:
            match = ROUTE.match(path.split("?")[0])
            if match is None or (method == "GET") != (match["route"] == "/v1/models"):
                raise EndpointError(404, f"No route {method} {path}.")
            session = match["session"] or self.headers.get(SESSION_HEADER)
            if method == "GET":
                return endpoint.models()
            route = endpoint.chat if match["route"] == "/v1/chat/completions" else endpoint.generate
            return route(session, self.json_body())

    return Handler


# ----------------------------------------------------------------------------------------------- stitching


def stitch(prompt_ids: list[int], calls: list[Call], max_completion_length: int) -> tuple[Transcript, int]:
    """A session's calls as one transcript (see the module docstring), and the number of prefix breaks. Without
    calls, the row's prompt with an empty completion."""
    segments = [Transcript(list(prompt_ids), {})] if not calls else []
    for call in calls:
        current = segments[-1] if segments else None
        context = None if current is None else current.prompt_ids + current.ids
        if context is None or call.prompt_ids[: len(context)] != context:
            current = Transcript(list(call.prompt_ids), {})
            segments.append(current)
        else:
            current.add(call.prompt_ids[len(context) :], 0)
        current.add(call.completion_ids, 1, call.logprobs, call.kept)
        current.truncated = call.truncated
        current.mask_settings = call.mask_settings or current.mask_settings
    last = segments[-1]
    if len(last.ids) > max_completion_length:
        last.ids, last.trained = last.ids[:max_completion_length], last.trained[:max_completion_length]
        last.logprobs, last.truncated = last.logprobs[:max_completion_length], True
        last.kept = last.kept[:max_completion_length]
    return last, len(segments) - 1 if calls else 0


# ----------------------------------------------------------------------------------------------- the driver


@dataclasses.dataclass
class HarnessStats:
    rollouts: int = 0
    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    prefix_breaks: int = 0

    def metrics(self, accelerator) -> dict[str, float]:
        """Per rollout: harnesses that timed out or raised, and engine calls; per call: prefix breaks. Summed over
        processes (a collective)."""
        totals = torch.tensor(
            [
                float(self.rollouts),
                float(self.calls),
                float(self.timeouts),
                float(self.errors),
                float(self.prefix_breaks),
            ],
            dtype=torch.float64,
            device=accelerator.device,
        )
        if accelerator.num_processes > 1:
            totals = accelerator.reduce(totals, "sum")
        rollouts, calls, timeouts, errors, breaks = totals.tolist()
        self.rollouts = self.calls = self.timeouts = self.errors = self.prefix_breaks = 0
        if not rollouts:  # none ended since the last record (groups streamed: they end between batches)
            return {}
        return {
            "endpoint/timeout_frequency": timeouts / rollouts,
            "endpoint/error_frequency": errors / rollouts,
            "endpoint/calls_per_rollout": calls / rollouts,
            "endpoint/prefix_break_frequency": breaks / calls if calls else 0.0,
        }


class HarnessDriver:
    """A `MultiTurnDriver` whose turns a harness plays through the endpoint: `play(base_url, row)` per row, each
    in a thread of its own, all at once, returns the row's reward (or raises). A harness that has not returned after
    `timeout` seconds is abandoned: its session closes, the row scores None (as a timed-out tool's row scores
    nothing) and `endpoint/timeout_frequency` counts it; one that raises scores None and counts in
    `endpoint/error_frequency`. Training goes on with what the other rows sampled.

    Rows come back with their reward in the column `reward_column` (read by the adapter's reward function) and the
    oldest policy version their calls were sampled at in `policy_version`."""

    logprobs_match_training = True  # every sampled token's log-prob is the engine's own
    concurrent_rollouts = True  # each rollout is a serving window of its own: groups may play at once (streaming)

    def __init__(
        self, endpoint: PolicyEndpoint, play: Callable[[str, dict], Any], *, timeout: float, reward_column: str
    ):
        self.endpoint, self.play, self.timeout, self.reward_column = endpoint, play, timeout, reward_column
        self.stats = HarnessStats()
        self.stats_lock = threading.Lock()  # rollouts running at once count into the same stats
        self.warned: set[str] = set()

    def metrics(self, accelerator) -> dict[str, float]:
        with self.stats_lock:
            return self.stats.metrics(accelerator)

    def rollout(
        self, engine: RolloutEngine, rows: list[dict], params: SamplingParams, seed: int, host: Any
    ) -> tuple[Rollout, None]:
        version = getattr(getattr(host, "state", None), "global_step", None)
        self.endpoint.start()
        with self.endpoint.serving(engine, params, seed, version) as window:
            sessions = [self.endpoint.open_session(index, window) for index in range(len(rows))]
            futures = [
                in_daemon_thread(self.play, {"base_url": self.endpoint.base_url(s), "row": row}, "harness")
                for s, row in zip(sessions, rows)
            ]
            deadline = time.monotonic() + self.timeout
            failures = HarnessStats()  # this rollout's timeouts and errors, counted with it below
            rewards = [self._outcome(future, deadline, failures) for future in futures]
            calls = [self.endpoint.close_session(s) for s in sessions]
        transcripts, breaks = [], 0
        for row, row_calls in zip(rows, calls):
            transcript, row_breaks = stitch(self._prompt_ids(row), row_calls, self.endpoint.max_completion_length)
            transcripts.append(transcript)
            breaks += row_breaks
        with self.stats_lock:  # the rollouts with their calls, as one record (streamed groups count at once)
            self.stats.rollouts += len(rows)
            self.stats.calls += sum(len(row_calls) for row_calls in calls)
            self.stats.prefix_breaks += breaks
            self.stats.timeouts += failures.timeouts
            self.stats.errors += failures.errors
        versions = [
            min((c.version for c in row_calls if c.version is not None), default=version) for row_calls in calls
        ]
        extra = {self.reward_column: rewards, "policy_version": versions}
        rollout = transcripts_rollout(transcripts, params.pad_token_id, extra)
        if any(call.logprobs is None for row_calls in calls for call in row_calls):
            rollout.sampling_logprobs = None  # an engine that reports none (the trainer computes π_old itself)
        return rollout, None

    def _outcome(self, future: concurrent.futures.Future, deadline: float, failures: HarnessStats):
        try:
            return future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            failures.timeouts += 1
            self._warn_once(
                "timeout",
                f"An agent harness did not return within {self.timeout:g} s (timeout): its "
                f"row scores None, and later calls from it are refused. Counted in "
                f"endpoint/timeout_frequency.",
            )
        except Exception as error:
            failures.errors += 1
            self._warn_once(
                type(error).__name__,
                f"An agent harness raised {type(error).__name__}: {error}. Its row "
                f"scores None; counted in endpoint/error_frequency.",
            )
        return None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _prompt_ids(self, row: dict) -> list[int]:
        """The row's prompt as tokens: the prompt of a row whose harness never called (an empty completion)."""
        prompt = row.get("prompt", "")
        if is_conversational(prompt):
            return render_prompt(self.endpoint.tokenizer, prompt, [], self.endpoint.chat_template_kwargs)
        ids = self.endpoint.tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
        return ids or [self.endpoint.tokenizer.eos_token_id]
