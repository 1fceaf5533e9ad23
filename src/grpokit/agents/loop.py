"""Multi-turn rollouts on any `RolloutEngine`: the model calls tools (or acts in environments), sees their results
and goes on, up to `max_tool_calling_iterations` tool turns and `max_completion_length` tokens in all; or a user's
`rollout_func` does the whole rollout. TRL 1.16's `_tool_call_loop`, on grpokit's engine seam.

A row's completion is the whole transcript after the prompt: sampled turns (loss mask 1, with the engine's sampling
log-probs) and the chat template's rendering of the tool results between them (attention mask 1, loss mask 0,
log-prob 0). Each continuation is sampled by `engine.generate` on the prompt plus the transcript so far, as token
ids (never re-tokenized text), so the training forward over prompt + completion sees exactly the context every
sampled token was drawn in, and its log-probs equal the sampling ones (the in-process engine in float32).

As in TRL: tool results that would take the transcript past max_completion_length are dropped and the row ends
there; the turn after a tool result is cut at the remaining budget (and then counts as truncated); a turn whose
tool call does not parse is plain text and ends the row.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch

from ..data import EMPTY_PROMPT, PromptLimit, is_conversational, pad_left
from ..rollout.batching import SEED_STRIDE, Request, answer
from ..rollout.engine import PromptBatch, Rollout, RolloutEngine, SamplingParams
from ..sampling_mask import PADDING, SamplingMask
from .chat import check_chat_template, parse_completion, render_prompt, tool_result_ids
from .environments import EnvironmentPool, public_methods
from .tools import ToolRunner, ToolStats, check_tools, tool_name

ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")
TURN_ENDS = "turn_ends"  # the column that gives process reward functions (and their advantages) the turns


@dataclasses.dataclass
class Transcript:
    """One row's rollout so far."""

    prompt_ids: list[int]
    tools: dict[str, Callable]
    ids: list[int] = dataclasses.field(default_factory=list)
    trained: list[int] = dataclasses.field(default_factory=list)  # 1: sampled by the policy, 0: inserted
    logprobs: list[float] = dataclasses.field(default_factory=list)
    messages: list[dict] = dataclasses.field(default_factory=list)
    truncated: bool = False
    # Each token's kept set (`SamplingMask`: [] for the whole vocabulary, and for inserted tokens), and the
    # penalty / suppressed tokens it was sampled with, where the engine's turns came with a sampling mask.
    kept: list[list[int]] = dataclasses.field(default_factory=list)
    mask_settings: tuple | None = None
    unreported: bool = False  # a sampled turn came without the engine's log-probs (its zeros are no log-probs)

    def add(self, ids: list[int], trained: int, logprobs: list[float] | None = None, kept=None) -> None:
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.kept += kept if kept is not None else [[] for _ in ids]
        self.unreported = self.unreported or bool(trained and ids and logprobs is None)


class Agents:
    """Everything multi-turn, built once per trainer: the tools, the environment pool, the tool runner and its
    counters, or the user's rollout_func. `rollout()` runs one generation's rows."""

    def __init__(
        self,
        tokenizer,
        *,
        tools=None,
        environments: EnvironmentPool | None = None,
        rollout_func=None,
        max_tool_calling_iterations: int | None = None,
        max_completion_length: int = 256,
        max_prompt_length: int | None = None,
        chat_template_kwargs: dict | None = None,
        tool_timeout: float = 30.0,
        max_model_length: int | None = None,
        max_tool_output_chars: int | None = None,
        stop_ids: tuple[int, ...] | None = None,
    ):
        self.tokenizer, self.rollout_func = tokenizer, rollout_func
        self.stop_ids = stop_ids  # the engine's EOS tokens: a sampled turn ends at one (chat.appended_message_ids)
        self.standalone_tools = list(tools or [])
        check_tools(self.standalone_tools)
        self.environments = environments
        self.latest_environments: list | None = None  # one per row of the latest rollout call
        self.uses_tools = bool(self.standalone_tools) or self.environments is not None
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.template = check_chat_template(tokenizer, self.chat_template_kwargs, stop_ids) if self.uses_tools else None
        self.max_iterations = max_tool_calling_iterations if max_tool_calling_iterations is not None else 2**62
        self.max_completion_length, self.max_prompt_length = max_completion_length, PromptLimit.of(max_prompt_length)
        self.max_model_length = max_model_length
        self.runner = ToolRunner(tool_timeout, max_tool_output_chars) if self.uses_tools else None
        self.stats = ToolStats()
        self.stats_lock = threading.Lock()  # rollouts may run at once (concurrent_rollouts): each counts on its own
        # TRL's `trainer.tools`: the standalone tools, then each environment's (its probe instance's methods); a row
        # is shown the standalone tools and its own environment's. Metrics are keyed by name, each name once.
        self.tools = list(self.standalone_tools)
        for env_tools in self.environments.tools.values() if self.environments else []:
            self.tools += [t for t in env_tools if t not in self.tools]
        self.tool_names = list(dict.fromkeys(tool_name(t) for t in self.tools))
        # The engine's log-probs are the training forward's only for rollouts this module sampled with it.
        self.logprobs_match_training = rollout_func is None
        # Rollouts of disjoint rows may run at once (a streaming producer; the environment pool lends each rollout
        # its own instances until it is scored), except a user's rollout_func, which is not known to allow it.
        self.concurrent_rollouts = rollout_func is None

    @property
    def tools_by_environment(self) -> dict:
        """Environment name (None for a single factory) -> the tools its rows are shown: the standalone tools, then
        the probe instance's methods (TRL's `_env_tools`). Empty without environments."""
        if self.environments is None:
            return {}
        return {name: self.standalone_tools + methods for name, methods in self.environments.tools.items()}

    def scored(self, rollout: Rollout) -> None:
        """A rollout's rewards are computed: its environments go back to the pool."""
        if self.environments is not None and "environments" in rollout.extra:
            self.environments.give_back(rollout.extra["environments"])

    def calls_in_progress(self) -> list[tuple[str, float]]:
        """The tool calls rollouts wait for now: (tool name, seconds running), oldest first."""
        return self.runner.calls_in_progress() if self.runner is not None else []

    def reward_functions(self) -> list[Callable]:
        return self.environments.reward_functions() if self.environments is not None else []

    def metrics(self, accelerator) -> dict[str, float]:
        with self.stats_lock:
            return self.stats.metrics(accelerator, self.tool_names) if self.uses_tools else {}

    # ------------------------------------------------------------------------------------------- one rollout

    def rollout(
        self, engine: RolloutEngine, rows: list[dict], params: SamplingParams, seed: int, trainer=None
    ) -> tuple[Rollout, list]:
        """rows: one per completion (a prompt's G rows consecutive). Returns the rollout and each row's
        completion as reward functions receive it (a list of messages for conversational prompts: the assistant
        turns and tool results, TRL's form). `Rollout.extra['environments']` holds each row's environment."""
        if self.rollout_func is not None:
            return self._custom_rollout(rows, trainer)
        prompts = [row.get("prompt", EMPTY_PROMPT) for row in rows]  # without one, reset() supplies it (TRL)
        if not all(is_conversational(p) for p in prompts):
            raise ValueError(
                "Tools and environments need conversational prompts (lists of {'role', 'content'} "
                "messages), so that the chat template can render the tools and their results; a row's "
                f"prompt is {str(prompts[0])[:80]!r}."
            )
        extra = {}
        tools_of = [list(self.standalone_tools) for _ in rows]
        if self.environments is None:
            return self._play(engine, rows, prompts, tools_of, params, seed, extra)
        environments = self.environments.take(self.environments.names_of(rows))
        self.latest_environments = environments  # TRL's `trainer.environments`: the latest rollouts' instances
        try:
            return self._play(engine, rows, prompts, tools_of, params, seed, {"environments": environments})
        except BaseException:  # never scored (an engine closed to it, a failure): its environments go back
            self.environments.give_back(environments)
            raise

    def _play(
        self,
        engine: RolloutEngine,
        rows: list[dict],
        prompts: list,
        tools_of: list[list],
        params,
        seed: int,
        extra: dict,
    ) -> tuple[Rollout, list]:
        """The turns of `rollout`, with each row's environment (extra['environments']) reset on its row."""
        if "environments" in extra:
            environments = extra["environments"]
            observations = self.environments.reset(environments, rows)
            prompts = [with_observation(p, o) for p, o in zip(prompts, observations)]
            tools_of = [tools + public_methods(env) for tools, env in zip(tools_of, environments)]
            # TRL's reward functions receive the prompt the model saw: the row's (or an empty user turn, when the
            # environment owns the data) with reset()'s observation appended. Rollout.extra replaces the row's.
            extra = {**extra, "prompt": prompts}
        rendered = [
            render_prompt(self.tokenizer, prompt, tools, self.chat_template_kwargs)
            for prompt, tools in zip(prompts, tools_of)
        ]
        if self.max_prompt_length is not None:
            rendered = self.max_prompt_length.cut(rendered)
        transcripts = [Transcript(ids, {tool_name(t): t for t in tools}) for ids, tools in zip(rendered, tools_of)]
        stats = ToolStats(rows=len(rows))
        self._sample(engine, transcripts, list(range(len(rows))), params, seed)
        waiting = [i for i, t in enumerate(transcripts) if t.messages[-1].get("tool_calls")]
        iteration, stop = 0, getattr(engine, "stop", None)  # a streamed group's engine: set once it is abandoned
        while waiting and iteration < self.max_iterations:
            waiting = self._add_tool_results(transcripts, waiting, stats, stop)
            if waiting:
                self._sample(engine, transcripts, waiting, params, seed + SEED_STRIDE * (iteration + 1))
            waiting = [i for i in waiting if transcripts[i].messages[-1].get("tool_calls")]
            iteration += 1
        with self.stats_lock:
            self.stats.add(stats)
        return transcripts_rollout(transcripts, params.pad_token_id, extra), [t.messages for t in transcripts]

    def _sample(
        self, engine, transcripts: list[Transcript], indices: list[int], params: SamplingParams, seed: int
    ) -> None:
        sample_turns(
            engine, self.tokenizer, self.template, transcripts, indices, params, seed, self.max_completion_length
        )

    def _add_tool_results(
        self, transcripts: list[Transcript], indices: list[int], stats: ToolStats, stop=None
    ) -> list[int]:
        """Run the last turn's tool calls of transcripts[indices] all at once (each row waits for the slowest call of
        the turn, not for the calls of the rows before it) and append each row's results, in row order; returns the
        rows whose results fit (the others get nothing appended and end). `stop`: see ToolRunner.call."""
        turns = [
            ([(c["function"]["name"], c["function"]["arguments"]) for c in t.messages[-1]["tool_calls"]], t.tools)
            for t in (transcripts[i] for i in indices)
        ]
        results = self.runner.run_turns(turns, stats, on_timeout=self._retire_environment, stop=stop)
        return [i for i, messages in zip(indices, results) if self._append_results(transcripts[i], messages)]

    def _append_results(self, transcript: Transcript, results: list[dict]) -> bool:
        """Append a turn's tool results; False (and nothing appended) when they would not fit in the completion
        budget or the model's context."""
        ids = tool_result_ids(self.tokenizer, results, self.chat_template_kwargs, self.stop_ids)
        total = len(transcript.prompt_ids) + len(transcript.ids) + len(ids)
        if len(transcript.ids) + len(ids) >= self.max_completion_length or (
            self.max_model_length is not None and total >= self.max_model_length
        ):
            return False
        transcript.add(ids, 0)
        transcript.messages += results
        return True

    def _retire_environment(self, tool: Callable) -> None:
        """A timed-out call of an environment's tool may still write into the instance: retire it from the pool."""
        owner = getattr(tool, "__self__", None)
        if self.environments is not None and owner is not None:
            self.environments.retire(owner)

    # ------------------------------------------------------------------------------------------- rollout_func

    def _custom_rollout(self, rows: list[dict], trainer) -> tuple[Rollout, list]:
        """TRL's `rollout_func(prompts, trainer)` contract: one prompt per row in, and a dict with `prompt_ids`,
        `completion_ids` and `logprobs` (lists, one entry per row) out; an optional `env_mask` (1 for the model's
        tokens, 0 for inserted ones) becomes the loss mask; every other key is a per-row field reward functions
        receive as a column."""
        prompts = [row.get("prompt", row.get("prompt_ids")) for row in rows]
        output = self.rollout_func(prompts, trainer)
        if not isinstance(output, dict):
            raise TypeError(
                f"rollout_func must return a dict with keys {list(ROLLOUT_FUNC_KEYS)}; it returned "
                f"{type(output).__name__}."
            )
        missing = [key for key in ROLLOUT_FUNC_KEYS if key not in output]
        if missing:
            raise ValueError(
                f"rollout_func must return keys {missing} in its output dict (it returned "
                f"{sorted(output)}); each is a list with one entry per prompt it was given."
            )
        n = len(rows)
        for key, values in output.items():
            if not isinstance(values, (list, tuple)) or len(values) != n:
                raise ValueError(
                    f"rollout_func's {key!r} must be a list with one entry per prompt ({n} prompts, one "
                    f"per completion: each prompt comes num_generations times); got "
                    f"{type(values).__name__} of length {len(values) if hasattr(values, '__len__') else '?'}."
                )
        prompt_ids, completion_ids = (
            [list(x) for x in output["prompt_ids"]],
            [list(x) for x in output["completion_ids"]],
        )
        logprobs, env_mask = output["logprobs"], output.get("env_mask")
        for row in range(n):
            if not prompt_ids[row]:
                raise ValueError(f"rollout_func returned empty prompt_ids for row {row}; every prompt needs a token.")
            for key, values in (("logprobs", logprobs), ("env_mask", env_mask)):
                if values is not None and values[row] is not None and len(values[row]) != len(completion_ids[row]):
                    raise ValueError(
                        f"rollout_func's {key}[{row}] has {len(values[row])} entries for "
                        f"{len(completion_ids[row])} completion tokens; give one per completion token."
                    )
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        eos = {self.tokenizer.eos_token_id, pad} if self.tokenizer is not None else {pad}
        transcripts = []
        for row in range(n):
            t = Transcript(prompt_ids[row], {})
            t.ids, t.logprobs = completion_ids[row], [float(x) for x in (logprobs[row] or [0.0] * len(t.ids))]
            t.trained = [int(bool(x)) for x in env_mask[row]] if env_mask is not None else [1] * len(t.ids)
            t.truncated = not t.ids or t.ids[-1] not in eos  # TRL's rule: a completion that did not end in EOS
            transcripts.append(t)
        extra = {k: list(v) for k, v in output.items() if k not in ROLLOUT_FUNC_KEYS and k != "env_mask"}
        params = SamplingParams(max_new_tokens=0, pad_token_id=pad or 0)
        rollout = transcripts_rollout(transcripts, params.pad_token_id, extra)
        if all(x is None for x in logprobs):
            rollout.sampling_logprobs = None
        return rollout, None


def transcripts_rollout(transcripts: list[Transcript], pad_token_id: int, extra: dict) -> Rollout:
    """Rows' transcripts as one Rollout: left-padded prompts, right-padded completions (attention mask 1 on every
    transcript token, loss mask 1 on the sampled ones), and each row's turn ends for process rewards. Its sampling
    log-probs are None where a sampled turn came without them (an engine that reports none)."""
    prompt_ids, prompt_mask = pad_left([t.prompt_ids for t in transcripts], pad_token_id)
    n, width = len(transcripts), max([len(t.ids) for t in transcripts] + [1])
    completion_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for row, t in enumerate(transcripts):
        length = len(t.ids)
        completion_ids[row, :length] = torch.tensor(t.ids, dtype=torch.long)
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.tensor(t.trained, dtype=torch.long)
        logprobs[row, :length] = torch.tensor(t.logprobs, dtype=torch.float32)
    # Each policy turn is a step for process rewards (grpokit.rewards.process): a per-turn reward credits
    # the tokens of its turn and of the turns before it.
    extra = {**extra, TURN_ENDS: [turn_ends(t.trained) for t in transcripts]}
    rollout = Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        attention_mask,
        loss_mask,
        attention_mask.sum(-1),
        torch.tensor([t.truncated for t in transcripts]),
        None if any(t.unreported for t in transcripts) else logprobs,
        extra,
    )
    rollout.sampling_mask = transcripts_sampling_mask(transcripts, width)
    return rollout


def transcripts_sampling_mask(transcripts: list[Transcript], width: int) -> SamplingMask | None:
    """The transcripts' kept sets as one SamplingMask [N, width, K] (a row of PADDING for a token without one), or
    None where no turn came with a sampling mask."""
    settings = {t.mask_settings for t in transcripts if t.mask_settings is not None}
    if not settings:
        return None
    if len(settings) > 1:
        raise ValueError(
            f"The turns of one batch were sampled with different penalties / suppressed tokens: {settings}"
        )
    kept_width = max([len(kept) for t in transcripts for kept in t.kept] + [1])
    kept_ids = torch.full((len(transcripts), width, kept_width), PADDING, dtype=torch.int32)
    for row, t in enumerate(transcripts):
        for position, kept in enumerate(t.kept):
            if kept:
                kept_ids[row, position, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    penalty, suppressed = settings.pop()
    return SamplingMask(kept_ids, penalty, suppressed)


def sample_turns(
    engine: RolloutEngine,
    tokenizer,
    template: dict | None,
    transcripts: list[Transcript],
    indices: list[int],
    params: SamplingParams,
    seed: int,
    max_completion_length: int,
) -> None:
    """Sample the next assistant turn of transcripts[indices] in one engine call (`rollout.batching.answer`: every
    row waits on the model, the rows in order) and append each (`add_turn`)."""
    requests = [turn_request(transcripts[i], params, max_completion_length) for i in indices]
    answer(engine, requests, seed)
    if requests and requests[0].error is not None:
        raise requests[0].error
    for i, request in zip(indices, requests):
        add_turn(tokenizer, template, transcripts[i], request.rollout)


def turn_request(transcript: Transcript, params: SamplingParams, max_completion_length: int, caller: int = 0):
    """The request for a transcript's next turn: sampled on its prompt + transcript ids so far (never re-tokenized
    text), within its remaining token budget."""
    context = transcript.prompt_ids + transcript.ids
    budget = max_completion_length - len(transcript.ids)
    prompts = PromptBatch(ids=[context], counts=[1], raw=[None])
    return Request(prompts, dataclasses.replace(params, max_new_tokens=budget), caller=caller)


def add_turn(tokenizer, template: dict | None, transcript: Transcript, turn: Rollout) -> None:
    """Append the turn sampled for `turn_request` (loss mask 1, the engine's log-probs; truncated where the budget
    cut it) and its message (parsed for tool calls with `template`, plain text without one)."""
    ids = turn.completion_id_lists()[0]
    logprobs = None if turn.sampling_logprobs is None else turn.sampling_logprobs[0, : len(ids)].tolist()
    transcript.truncated = bool(turn.is_truncated[0])
    context = transcript.prompt_ids + transcript.ids
    kept = None
    if turn.sampling_mask is not None:
        mask = turn.sampling_mask
        transcript.mask_settings = (mask.repetition_penalty, mask.suppressed_ids)
        kept = [[int(v) for v in row if v >= 0] for row in mask.kept_ids[0, : len(ids)].tolist()]
    transcript.add(ids, 1, logprobs, kept)
    transcript.messages.append(parse_completion(tokenizer, template, ids, context, list(transcript.tools.values())))


def turn_ends(trained: list[int]) -> list[int]:
    """Where each policy turn ends (exclusive token positions): the ends of the runs of 1s of the loss mask."""
    return [i + 1 for i, flag in enumerate(trained) if flag and (i + 1 == len(trained) or not trained[i + 1])]


def with_observation(prompt: list[dict], observation) -> list[dict]:
    """TRL: an environment's first observation is appended to the prompt's last message (a new list; the row's
    prompt is left untouched)."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    return [*prompt[:-1], {**prompt[-1], "content": content + observation}]
