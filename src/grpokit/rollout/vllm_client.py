"""The trainer's side of server mode: a `RolloutEngine` that samples with a `grpokit vllm-serve` server
(`grpokit.vllm_server`) and pushes the policy's weights to it over HTTP. No vLLM is needed on the trainer's side.

With several training processes every process asks the one server for its own prompts; only the main process
pushes the weights, and the others wait for its push (a barrier) before they sample.

Failure is loud and early: no server answering within `timeout` seconds, a server serving another model (any config
field that shapes a weight: architecture, width, depth, MLP width, heads, key-value heads, tying...) or another
vocabulary, a server whose max_model_len leaves no room for a whole completion (and, when a batch comes, for its
longest prompt + completion; a warning at start when max_prompt_length + max_completion_length exceeds it), a server
that fails a request, are errors that say what to do.

`timeout` (vllm_server_timeout) bounds the wait for the server to come up, and each request in all, its retries
included, unless `request_timeout` / `weight_sync_timeout` (TRL AsyncGRPOConfig's fields) bound the sampling
requests / the weight pushes instead: a request that fails on the connection (refused, reset, or no answer in time)
is tried again after pauses of 2, 4, 8 s (10 s from then on; up to `retries` more tries), each try waiting at most
the time left, so that a frozen server stops the trainer after about `timeout` seconds (not `retries + 1` times it),
and a killed one after the pauses (~14 s). A server that restarted (its instance id changed) gets the weights pushed
again. Checkpoints are written atomically by the trainer, so a run that stops here can resume from its last
one.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import http.client
import io
import itertools
import json
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings

import torch

from ..compat import parameter_versions
from ..distributed import all_processes_done, barrier, is_sharded
from ..json_http import error_of
from ..multimodal import is_vision_language_model, text_config_of, ties_word_embeddings
from .engine import PromptBatch, Rollout, SamplingParams
from .vllm import base_model_of, policy_weights, prompt_seeds, refuse_images, rollout_from_completions
from .weight_broadcast import TRAINER_RANK, describe, open_group, send

logger = logging.getLogger(__name__)

CONNECTION_ERRORS = (urllib.error.URLError, ConnectionError, socket.timeout, http.client.HTTPException, OSError)


class ServerError(RuntimeError):
    """The vLLM server answered with an error."""


class VLLMServerEngine:
    """`RolloutEngine` over a running `grpokit vllm-serve` at `base_url` (e.g. "http://127.0.0.1:8000")."""

    logprobs_match_training = False

    def __init__(
        self,
        model: torch.nn.Module,
        base_url: str,
        timeout: float = 240.0,
        retries: int = 3,
        process_index: int = 0,
        num_processes: int = 1,
        group_port: int | None = None,
        structured_outputs_regex: str | None = None,
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        request_timeout: float | None = None,
        weight_sync_timeout: float | None = None,
    ):
        """group_port: push the weights through a process group with the server at that port (NCCL between GPUs,
        gloo between CPUs; TRL's vllm_group_port) instead of as safetensors over HTTP. structured_outputs_regex:
        every completion matches this regex (the server needs the tokenizer in its checkpoint directory).
        max_prompt_length, max_completion_length: the trainer's budget, checked against the server's
        max_model_len. request_timeout, weight_sync_timeout: seconds a request / a weight push may take in all
        (None: `timeout`, as for everything else)."""
        self.base_url, self.timeout, self.retries = base_url.rstrip("/"), timeout, retries
        # (seconds, the config field that set them): the field is named in the error when a request runs out.
        self.request_timeout = (
            (request_timeout, "request_timeout") if request_timeout else (timeout, "vllm_server_timeout")
        )
        self.weight_sync_timeout = (
            (weight_sync_timeout, "weight_sync_timeout") if weight_sync_timeout else (timeout, "vllm_server_timeout")
        )
        self.group_port, self.group, self.group_instance = group_port, None, None
        self.process_index, self.num_processes = process_index, num_processes
        self.structured_outputs_regex = structured_outputs_regex
        # FSDP2 / ZeRO-3: each push gathers the weights, a collective every process takes part in.
        self.sharded = is_sharded(model)
        self.wait_until_up()
        self.info = self.request("GET", "/info")
        config = base_model_of(model).config
        check_same_model(config, self.info, self.base_url)
        check_context_fits(
            self.info.get("max_model_len"),
            max_prompt_length,
            max_completion_length,
            getattr(text_config_of(config), "max_position_embeddings", None),
            self.base_url,
        )
        if is_vision_language_model(config) and not self.info.get("images"):
            raise ValueError(
                f"The vLLM server at {self.base_url} does not take images ({self.info.get('model')}): "
                f"start it with the vision-language policy's checkpoint and processor (`grpokit "
                f"vllm-serve --model DIR`, DIR holding both)."
            )
        if structured_outputs_regex is not None and not self.info.get("structured_outputs"):
            raise ValueError(
                f"vllm_structured_outputs_regex needs a vLLM server with the tokenizer (vLLM masks the "
                f"tokens that cannot continue a match), and the one at {self.base_url} has none: save "
                f"the tokenizer into its --model directory (tokenizer.save_pretrained(DIR)) and restart "
                f"it."
            )
        self.tied = bool(self.info.get("tie_word_embeddings"))
        self.pushed_versions = None  # the server's weights are not known to be the policy's: push at the first sync

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        args,
        process_index: int = 0,
        num_processes: int = 1,
        base_url: str | None = None,
        group_port: int | None = None,
    ) -> VLLMServerEngine:
        """The engine of the config's server (`base_url`: one of several, see `server_urls`)."""
        base_url = base_url or server_urls(args)[0]
        return cls(
            model,
            base_url,
            timeout=args.vllm_server_timeout,
            process_index=process_index,
            num_processes=num_processes,
            group_port=group_port if group_port is not None else args.vllm_group_port,
            structured_outputs_regex=args.vllm_structured_outputs_regex,
            max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length,
            # AsyncGRPOConfig's (TRL's async trainer's); GRPOConfig has neither: vllm_server_timeout bounds all
            request_timeout=getattr(args, "request_timeout", None),
            weight_sync_timeout=getattr(args, "weight_sync_timeout", None),
        )

    # ------------------------------------------------------------------------------------------ the protocol

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the weights if they changed since the last push; with several processes the main process pushes
        and every process waits for it (a sharded model's processes all gather, the main one sends). They all
        decide alike: each runs the same optimizer steps on its own replica or shard, so they reach the gathers and
        the barrier together."""
        versions = parameter_versions(model)
        if versions is not None and versions == self.pushed_versions:
            return
        self._model = model
        self._push_together(model)
        if self.num_processes > 1:  # on the producers' own group when a producer pushes (distributed.barrier)
            barrier()
        self.pushed_versions = parameter_versions(model)  # after the merge / unmerge of a LoRA adapter

    @property
    def samplers(self) -> list[str]:
        """What samples behind this URL, by name (`RolloutEngine`): the server, or each engine of a data-parallel
        one (`Rollout.sampler` says which sampled a row, from the server's answer)."""
        engines = int(self.info.get("data_parallel_size") or 1)
        if engines == 1:
            return [f"the vLLM server at {self.base_url}"]
        return [f"engine {i} of {engines} of the vLLM server at {self.base_url}" for i in range(engines)]

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        rows, engines = self.completions(prompts, params, seed)
        rollout = rollout_from_completions(prompts, rows, params)
        rollout.sampler = torch.tensor(engines, dtype=torch.long)
        return rollout

    def completions(
        self, prompts: PromptBatch, params: SamplingParams, seed: int, seeds: list[int] | None = None
    ) -> tuple[list[tuple], list[int]]:
        """The server's (ids, log-probs, finish reason) of each row of `prompts`, prompt b's sampled with seeds[b]
        (default: the server draws them from `seed`, as `prompt_seeds` does), and the index of the engine of a
        data-parallel server that sampled each row (one engine: 0)."""
        images = None
        if prompts.images is not None and any(prompts.images):
            if not self.info.get("images"):
                refuse_images(prompts)
            images = [[image_to_wire(image) for image in row] for row in prompts.images]
        check_prompts_fit(prompts, params.max_new_tokens, self.info.get("max_model_len"), self.base_url)
        body = {
            "prompt_ids": prompts.ids,
            "counts": prompts.counts,
            "seed": seed,
            "prompt_seeds": seeds,
            "params": {**params.__dict__, "eos_token_ids": list(params.eos_token_ids)},
            "structured_outputs_regex": self.structured_outputs_regex,
            "images": images,
            "unexpanded_ids": prompts.unexpanded_ids if images is not None else None,
        }
        answer = None
        try:
            answer = self.request("POST", "/generate", {**body, "instance": self.info["instance"]})
        except ServerRestarted as restarted:  # a new server: same model, but it lost the pushed weights
            if self._model is None:
                raise
            self.info["instance"] = restarted.instance
            if not self.sharded:  # any process may be the first to see it; the replicas hold the same weights
                self.push(self._model)
        if self.sharded and self._model is not None:
            self._repush_after_restart(answer is None)
        if answer is None:
            answer = self.request("POST", "/generate", {**body, "instance": self.info["instance"]})
        rows = [tuple(entry) for entry in answer["completions"]]  # ids, log-probs, finish reason, kept sets or None
        return rows, self._engines_of(answer, len(rows))

    def _engines_of(self, answer: dict, rows: int) -> list[int]:
        """Which engine sampled each row, as a data-parallel server's answer says (`engines`); 0 for every row of a
        server that samples as one."""
        engines = answer.get("engines")
        if engines is None:
            return [0] * rows
        count = len(self.samplers)
        if len(engines) != rows or any(not 0 <= e < count for e in engines):
            raise ServerError(
                f"The vLLM server at {self.base_url} answered {rows} completions with the engines {engines} "
                f"(its /info says data_parallel_size={count}): restart it, and the trainer with it."
            )
        return list(engines)

    def _repush_after_restart(self, restarted_here: bool) -> None:
        """A sharded model's push is a collective: when any process met a restarted server, they all learn of it
        (an all-reduce every generation; the processes generate together) and push together, the main process
        sending."""
        if all_processes_done(not restarted_here):
            return
        self.info["instance"] = self.request("GET", "/info")["instance"]
        self._push_together(self._model)

    # ------------------------------------------------------------------------------------------ transport

    _model = None

    def _push_together(self, model: torch.nn.Module) -> None:
        """The main process pushes; with a sharded model, every other process takes part in the push's gathers."""
        if self.process_index == 0:
            self.push(model)
        elif self.sharded:
            self.take_part_in_push(model)

    def push(self, model: torch.nn.Module) -> None:
        """Send the policy's weights (LoRA: merged) to the server. A sharded model's are gathered one parameter at a
        time, a collective: the other processes take part at the same time (`take_part_in_push`)."""
        from safetensors.torch import save

        with policy_weights(model) as weights:
            tensors, seen = {}, set()
            for name, tensor in weights:
                key = (tensor.data_ptr(), tuple(tensor.shape))
                if key not in seen:  # a tied weight once (the server ties it back)
                    seen.add(key)
                    tensors[name] = tensor.detach().contiguous()
            if self.group_port is None:
                self.request(
                    "POST", "/update_weights", save({k: v.cpu() for k, v in tensors.items()}), self.weight_sync_timeout
                )
            else:
                self._broadcast(list(tensors.items()))
        self._model = model

    def take_part_in_push(self, model: torch.nn.Module) -> None:
        """A sharded model's part in the main process's push: each parameter's gather, nothing kept or sent."""
        with policy_weights(model) as weights:
            for _ in weights:
                pass

    def _broadcast(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """The weights through the process group (joined at the first push, and again with a restarted server)."""
        # NCCL between two GPUs; gloo (CPU tensors) when either end has none, e.g. a GPU trainer and a CPU server.
        backend = "nccl" if torch.cuda.is_available() and self.info.get("device") == "cuda" else "gloo"
        if self.group is None or self.group_instance != self.info["instance"]:
            self.request(
                "POST",
                "/init_communicator",
                {"port": self.group_port, "backend": backend, "timeout": self.weight_sync_timeout[0]},
            )
            host = urllib.parse.urlparse(self.base_url).hostname
            self.group = open_group(backend, host, self.group_port, TRAINER_RANK, self.weight_sync_timeout[0])
            self.group_instance = self.info["instance"]
        device = torch.device("cuda" if backend == "nccl" else "cpu")
        weights = [(name, tensor.to(device)) for name, tensor in weights]
        self.request("POST", "/update_weights_collective", {"params": describe(weights)}, self.weight_sync_timeout)
        send(self.group, weights)
        self.request("POST", "/weights_received", timeout=self.weight_sync_timeout)

    def wait_until_up(self) -> None:
        """Waits up to `timeout` s for the server's /health; says at once that it waits, for what, and the ways out."""
        deadline, said = time.monotonic() + self.timeout, False
        port = urllib.parse.urlparse(self.base_url).port or "PORT"
        ways_out = (
            f"start one with `grpokit vllm-serve --model MODEL_DIR --port {port}` (or check "
            "vllm_server_base_url / vllm_server_host / vllm_server_port), or sample in this process instead "
            "with use_vllm=False"
        )
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        if said:
                            logger.warning(f"The vLLM server at {self.base_url} answers: training starts.")
                        return
            except CONNECTION_ERRORS:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"No vLLM server answers at {self.base_url} after {self.timeout:g} s "
                    f"(vllm_server_timeout): {ways_out}."
                )
            if not said:
                logger.warning(
                    f"Waiting up to {self.timeout:g} s (vllm_server_timeout) for a vLLM server at "
                    f"{self.base_url} (use_vllm=True, vllm_mode='server'): none answers yet. Either "
                    f"{ways_out}."
                )
                said = True
            time.sleep(1.0)

    def request(self, method: str, path: str, payload=None, timeout: tuple[float, str] | None = None):
        """One request, tried again on connection errors (after pauses of 2, 4, 8, 10... s) until `timeout`
        seconds (and the config field that set them; default `request_timeout`) have passed in all; the answer's
        JSON."""
        timeout_s, timeout_field = timeout or self.request_timeout
        data, headers = None, auth_headers()
        if isinstance(payload, bytes):
            data, headers = payload, {**headers, "Content-Type": "application/octet-stream"}
        elif payload is not None:
            data, headers = json.dumps(payload).encode(), {**headers, "Content-Type": "application/json"}
        started = time.monotonic()
        deadline, last_error, tries = started + timeout_s, None, 0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(max(min(2.0**attempt, 10.0, deadline - time.monotonic()), 0.0))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            tries += 1
            request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=left) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:  # the server answered: no retry
                detail = error_of(json.loads(error.read() or b"{}"))
                if error.code == 409:
                    raise ServerRestarted(detail.get("instance")) from None
                raise ServerError(
                    f"The vLLM server at {self.base_url} failed {method} {path}: {detail.get('message', error)}"
                ) from None
            except CONNECTION_ERRORS as error:
                last_error = error
        raise ConnectionError(
            f"The vLLM server at {self.base_url} stopped answering ({method} {path}, {tries} tries in "
            f"{time.monotonic() - started:.0f} s, {timeout_field}={timeout_s:g}: {last_error}). "
            f"Restart it (`grpokit vllm-serve --model MODEL_DIR ...`) and resume the run from its "
            f"last checkpoint (`trainer.train(resume_from_checkpoint=True)`)."
        )


def server_urls(args) -> list[str]:
    """The servers of the config: vllm_server_base_url, one URL or several separated by commas (each server a
    `grpokit vllm-serve` of the same model), else vllm_server_host:vllm_server_port."""
    if not args.vllm_server_base_url:
        return [f"http://{args.vllm_server_host}:{args.vllm_server_port}"]
    urls = [url.strip() for url in str(args.vllm_server_base_url).split(",")]
    if any(not url for url in urls) or len(set(urls)) != len(urls):
        raise ValueError(
            f"vllm_server_base_url={args.vllm_server_base_url!r}: give one URL, or several distinct ones "
            f"separated by commas (e.g. 'http://host1:8000,http://host2:8000')."
        )
    return urls


class VLLMServers:
    """`RolloutEngine` over several `grpokit vllm-serve` servers of the same model (vllm_server_base_url with several
    URLs). Every server gets the weights; each generation's prompts are cut into pieces of whole prompts (each with
    its completions), and a server takes the next piece as soon as it has answered its last, so that a slow server
    samples less (spread by load, not in turn). Each prompt's seed comes from the generation's seed and the prompt's
    place (`prompt_seeds`, as one server draws them for a whole request), never from the server that takes it nor
    from how the batch was cut: the servers hold the same weights, so which one samples a piece changes nothing but
    timing (and the last bits of the arithmetic, which vary with a batch's size), and every batch is sampled by one
    version of the weights. A server may itself be data-parallel (`grpokit vllm-serve --data-parallel-size`), which
    splits each piece over its engines by the same rule. Each row says which server (and which engine of a
    data-parallel one) sampled it (`samplers`, `Rollout.sampler`): the served-policy check takes each one's own gap
    (grpokit.served).

    A server that fails (stops answering, answers with an error) stops the generation with its URL; the run stops with
    a good checkpoint and resumes once the server is back. With `failover` (vllm_server_failover) its piece goes to
    the others instead, and it is left out for the rest of the run, with a warning; the run stops only when none is
    left."""

    logprobs_match_training = False

    def __init__(self, servers: list[VLLMServerEngine], failover: bool = False, pieces_per_server: int = 4):
        self.servers, self.failover, self.pieces_per_server = list(servers), failover, pieces_per_server
        if any(server.sharded for server in self.servers):
            raise NotImplementedError(
                "Several vLLM servers with a sharded model (FSDP2, ZeRO-3): each push gathers "
                "the weights in a collective, and a restarted server's push is decided by all "
                "processes together, which one generation spread over servers in threads "
                "cannot do in step. Use one server, or DDP / ZeRO-1/2."
            )
        self.dead: dict[str, BaseException] = {}  # URL -> what stopped it (failover)
        self.pushed_versions = None
        self.pieces_taken = {server.base_url: 0 for server in self.servers}  # by server, over the run: the load

    @classmethod
    def from_config(
        cls, model: torch.nn.Module, args, process_index: int = 0, num_processes: int = 1
    ) -> VLLMServers | VLLMServerEngine:
        """One engine per URL of vllm_server_base_url (one URL: the plain `VLLMServerEngine`). With
        vllm_group_port, server i is reached through the process group at vllm_group_port + i."""
        urls = server_urls(args)
        if len(urls) == 1:
            return VLLMServerEngine.from_config(model, args, process_index, num_processes)
        port = args.vllm_group_port
        servers = [
            VLLMServerEngine.from_config(
                model, args, process_index, num_processes, base_url=url, group_port=None if port is None else port + i
            )
            for i, url in enumerate(urls)
        ]
        return cls(servers, failover=getattr(args, "vllm_server_failover", False))

    @property
    def samplers(self) -> list[str]:
        """Every server's samplers (`VLLMServerEngine.samplers`), in the servers' order, a dead one's kept: the
        index of a row's in `Rollout.sampler`."""
        return [name for server in self.servers for name in server.samplers]

    @property
    def live(self) -> list[VLLMServerEngine]:
        return [server for server in self.servers if server.base_url not in self.dead]

    def sync_weights(self, model: torch.nn.Module) -> None:
        """The weights into every live server (the main process sends, in parallel), then, with several processes,
        a barrier as for one server."""
        versions = parameter_versions(model)
        if versions is not None and versions == self.pushed_versions:
            return
        servers = self.live
        for server in servers:
            server._model = model  # a restarted server gets them again at its next request
        if servers and servers[0].process_index == 0:
            with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
                failures = dict(zip(servers, pool.map(lambda s: _failure_of(s.push, model), servers)))
            for server, error in failures.items():
                if error is not None:
                    self._lose(server, error, "taking the weights")
        if servers and servers[0].num_processes > 1:
            barrier()
        self.pushed_versions = parameter_versions(model)

    def generate(self, prompts: PromptBatch, params: SamplingParams, seed: int) -> Rollout:
        size = math.ceil(len(prompts.ids) / max(1, len(self.live) * self.pieces_per_server))
        pieces = [range(start, min(start + size, len(prompts.ids))) for start in range(0, len(prompts.ids), size)]
        seeds = prompt_seeds(seed, len(prompts.ids))
        results: list[tuple | None] = [None] * len(pieces)  # each piece's rows and their samplers (`samplers`)
        first = dict(zip(self.servers, itertools.accumulate([len(s.samplers) for s in self.servers], initial=0)))
        waiting = collections.deque(range(len(pieces)))
        lock, stopped = threading.Lock(), []

        def serve(server: VLLMServerEngine) -> None:
            while True:
                with lock:
                    if stopped or not waiting:
                        return
                    index = waiting.popleft()
                try:
                    rows = pieces[index]
                    completions, engines = server.completions(
                        _piece(prompts, rows), params, seeds[rows[0]], [seeds[row] for row in rows]
                    )
                    results[index] = completions, [first[server] + engine for engine in engines]
                except (ConnectionError, ServerError) as error:
                    with lock:
                        waiting.appendleft(index)
                        if self.failover:
                            self._lose(server, error, "sampling")
                        else:
                            stopped.append(error)
                    return
                with lock:
                    self.pieces_taken[server.base_url] += 1

        # One thread per server, each taking pieces until none is left; a piece a failed server gave back goes to
        # the servers still up (another round, should they all have finished before it came back).
        while waiting and self.live and not stopped:
            threads = [
                threading.Thread(target=serve, args=(server,), name=f"grpokit-vllm-{i}", daemon=True)
                for i, server in enumerate(self.live)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if stopped:
            raise stopped[0]
        if waiting:
            lost = "; ".join(f"{url}: {error}" for url, error in self.dead.items())
            raise ConnectionError(
                f"No vLLM server is left to sample with (vllm_server_failover): {lost}. Restart "
                f"them and resume the run from its last checkpoint."
            )
        rollout = rollout_from_completions(prompts, [row for rows, _ in results for row in rows], params)
        rollout.sampler = torch.tensor([sampler for _, samplers in results for sampler in samplers], dtype=torch.long)
        return rollout

    def _lose(self, server: VLLMServerEngine, error: BaseException, doing: str) -> None:
        if not self.failover:
            raise error
        if server.base_url not in self.dead:
            self.dead[server.base_url] = error
            logger.warning(
                f"The vLLM server at {server.base_url} failed while {doing} ({error}): it is left out for "
                f"the rest of the run (vllm_server_failover); {len(self.live)} server(s) remain."
            )


def _failure_of(function, *args) -> BaseException | None:
    try:
        function(*args)
    except (ConnectionError, ServerError) as error:
        return error
    return None


def _piece(prompts: PromptBatch, rows: range) -> PromptBatch:
    """The prompts `rows` of a batch (each with its completions count)."""

    def part(values):
        return None if values is None else [values[i] for i in rows]

    return PromptBatch(
        part(prompts.ids),
        part(prompts.counts),
        part(prompts.raw),
        part(prompts.images),
        part(prompts.processed),
        part(prompts.unexpanded_ids),
    )


class ServerRestarted(Exception):
    def __init__(self, instance):
        super().__init__(instance)
        self.instance = instance


def auth_headers() -> dict[str, str]:
    """The server's shared token, from this process's GRPOKIT_VLLM_TOKEN (grpokit.vllm_server), as a header."""
    token = os.environ.get("GRPOKIT_VLLM_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def image_to_wire(image) -> str:
    """A prompt's image (PIL) as the server takes it: PNG (lossless), base64."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def image_from_wire(data: str):
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data)))
    image.load()
    return image


# Config fields that fix a weight's shape or how the weights are wired: by name, so that every architecture's own
# (moe_intermediate_size, kv_lora_rank, qk_rope_head_dim, n_routed_experts, ...) is covered without a list per model.
SHAPE_FIELDS = re.compile(
    r"^(num_|n_)|_(size|dim|dims|rank|bias|heads|layers|experts)$|^(head_dim|vocab_size|"
    r"tie_word_embeddings|layer_types|first_k_dense_replace|decoder_sparse_step)$"
)
NOT_SHAPE_FIELDS = {
    "chunk_size_feed_forward",
    "num_beams",
    "num_beam_groups",
    "num_return_sequences",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "max_window_layers",
}


def weight_shape_config(config) -> dict:
    """The fields of a model's (a vision-language model's: its text model's) config that determine its weights'
    shapes: what the server reports in /info and the trainer compares with its policy's (issue 39: a server whose
    model differs only in intermediate_size took the pushed weights into wrong-sized layers without an error)."""
    text = text_config_of(config)
    fields = {
        k: v
        for k, v in text.to_dict().items()
        if SHAPE_FIELDS.search(k) and k not in NOT_SHAPE_FIELDS and v is not None
    }
    for name in ("head_dim", "num_key_value_heads"):  # attributes some configs derive rather than store
        value = getattr(text, name, None)
        if isinstance(value, int) and name not in fields:
            fields[name] = value
    fields["tie_word_embeddings"] = ties_word_embeddings(config)
    return json.loads(json.dumps(fields, default=str))  # as it travels (tuples become lists)


def shape_differences(policy: dict, served: dict) -> dict:
    """{field: (served, policy)} for the weight-shape fields both sides report with different values (a field one
    side's transformers does not write is not compared)."""
    return {k: (served[k], v) for k, v in policy.items() if k in served and served[k] != v}


def check_same_model(config, info: dict, base_url: str) -> None:
    """The served model must be the policy's architecture with its vocabulary (a vision-language model's: its
    text model's), down to every field that shapes a weight; say which differs."""
    model_type, text = config.model_type, text_config_of(config)
    if info.get("vocab_size") != text.vocab_size:
        raise ValueError(
            f"The vLLM server at {base_url} serves a model with a vocabulary of {info.get('vocab_size')} "
            f"tokens; the policy's has {text.vocab_size}: start the server with the policy's "
            f"checkpoint (`grpokit vllm-serve --model ...`)."
        )
    ours = {
        "model_type": model_type,
        "hidden_size": getattr(text, "hidden_size", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
    }
    different = {k: (info.get(k), v) for k, v in ours.items() if info.get(k) != v}
    if not different and "shape" in info:
        different = shape_differences(weight_shape_config(config), info["shape"])
    if different:
        shown = ", ".join(f"{k}: server {a!r}, policy {b!r}" for k, (a, b) in different.items())
        raise ValueError(
            f"The vLLM server at {base_url} serves another model ({shown}) ({info.get('model')}): "
            f"its weights have other shapes than the policy's, which it would take without an error "
            f"and sample wrongly. Start it with the policy's checkpoint."
        )


def check_context_fits(
    max_model_len: int | None,
    max_prompt_length: int | None,
    max_completion_length: int | None,
    max_positions: int | None,
    base_url: str,
) -> None:
    """When the trainer connects: the server must take a whole completion after a prompt (an error otherwise), and
    should take the longest prompt the trainer may send, max_prompt_length (as cut to the model's positions), plus
    max_completion_length (a warning otherwise: the run works while the dataset's prompts are shorter, and a longer
    one is refused by `check_prompts_fit` when it comes)."""
    if max_model_len is None or max_completion_length is None:
        return
    if max_completion_length >= max_model_len:
        raise ValueError(
            f"The vLLM server at {base_url} takes at most {max_model_len} tokens of prompt + completion "
            f"(its max_model_len), which leaves no room for a prompt before a completion of "
            f"max_completion_length={max_completion_length} tokens: restart it with a larger "
            f"`grpokit vllm-serve --max-model-len`, or lower max_completion_length."
        )
    if max_prompt_length is None:
        return
    longest = max_prompt_length + max_completion_length
    if max_positions is not None:
        longest = min(longest, max_positions)
    if longest > max_model_len:
        warnings.warn(
            f"The vLLM server at {base_url} takes at most {max_model_len} tokens of prompt + completion "
            f"(its max_model_len), and this run may send up to {longest} (max_prompt_length="
            f"{max_prompt_length} + max_completion_length={max_completion_length}): a prompt longer than "
            f"{max_model_len - max_completion_length} tokens will stop the run. Restart the server with "
            f"`grpokit vllm-serve --max-model-len {longest}`, or set max_prompt_length="
            f"{max_model_len - max_completion_length}.",
            UserWarning,
            stacklevel=4,
        )


def check_prompts_fit(prompts: PromptBatch, max_new_tokens: int, max_model_len: int | None, base_url: str) -> None:
    """Before a request: every prompt leaves room for max_new_tokens in the server's max_model_len (vLLM would
    refuse the whole request with a validation error); name the prompt and the fixes."""
    if max_model_len is None:
        return
    for index, ids in enumerate(prompts.ids):
        if len(ids) + max_new_tokens > max_model_len:
            raise ValueError(
                f"Prompt {index} of this generation has {len(ids)} tokens, and with max_completion_length"
                f"={max_new_tokens} it does not fit the {max_model_len} tokens the vLLM server at "
                f"{base_url} takes (its max_model_len): restart the server with `grpokit vllm-serve "
                f"--max-model-len {len(ids) + max_new_tokens}` (or more), set max_prompt_length="
                f"{max_model_len - max_new_tokens} to cut prompts, or filter long prompts out of the "
                f"dataset."
            )
