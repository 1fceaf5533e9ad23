"""A vLLM server for grpokit's server mode: it samples for a trainer in another process (or on another machine)
and takes the trainer's weight updates.

    grpokit vllm-serve --model DIR [--host 127.0.0.1] [--port 8000] [--dtype bfloat16] [--max-model-len 4096]
    grpokit vllm-serve --model DIR --data-parallel-size 4          # 4 engines behind one URL (TRL's option)
    python -m grpokit.vllm_server --model DIR ...                  # the same

With `--data-parallel-size N` (N > 1) the server runs N vLLM engines, each in a child process of its own (on GPUs:
`--tensor-parallel-size` GPUs each, engine i on the i-th group of the visible GPUs; on the CPU: its share of the
cores' threads). The trainer sees one server, whose /info says `data_parallel_size`: each request's prompts are cut
into N contiguous parts of near-equal completion counts, one for each engine, sampled at once and answered in the
request's order; every weight push reaches every engine before the push is answered, so a request is sampled by one
version of the weights on all of them. Each prompt keeps the seed it has in one request (`prompt_seeds`), so the
samples do not depend on N (up to the last bits of the engines' arithmetic, which vary with a batch's size). An
engine that dies fails the requests from then on, naming it (`/health` answers 503 with the same message): restart
the server and resume the run.

It listens on the loopback unless `--host` says otherwise (`--host 0.0.0.0`: every interface, for a trainer on
another machine). Whoever reaches the port can replace the policy's weights and sample from it, so a server on the
network should take a shared token: `--token TOKEN` or the environment variable GRPOKIT_VLLM_TOKEN. With one, every
POST without `Authorization: Bearer TOKEN` is refused with 401; the trainer sends the token it finds in its own
GRPOKIT_VLLM_TOKEN (`/health` and `/info` stay open: they carry no weights and no samples).

and in the trainer: `GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://HOST:PORT")` (or
vllm_server_host / vllm_server_port). DIR is the policy's checkpoint (config and weights). Its tokenizer, when DIR
holds one, is loaded for structured outputs (`vllm_structured_outputs_regex`); token ids in and out need none. A
vision-language model's DIR must hold its processor too (`processor.save_pretrained(DIR)`): vLLM preprocesses the
prompts' images itself.

The protocol is plain HTTP with JSON (stdlib on both sides; one request at a time):

    GET  /health          {"status": "ok"}
    GET  /info            the served model's shape (model_type, vocab_size, hidden_size, num_hidden_layers,
                          tie_word_embeddings; `shape`: every config field that shapes a weight, and
                          `max_model_len`: the longest prompt + completion vLLM takes), logprobs_mode, this server's
                          `instance` id, weight `version`, `data_parallel_size` and its `engines` (pid, prompts
                          sampled),
                          `device` ("cuda" / "cpu"), `structured_outputs` (whether it has the tokenizer) and
                          `images` (a vision-language model with its processor)
    POST /generate        {"prompt_ids": [[...]], "counts": [...], "params": {SamplingParams}, "seed": int,
                           "prompt_seeds": [int, ...] | null (each prompt's; default: drawn from `seed`),
                           "instance": id, "structured_outputs_regex": str | null,
                           "images": [[PNG, base64], ...] | null, "unexpanded_ids": [[...]] | null}
                          -> {"completions": [[ids, logprobs, finish_reason], ...], "engines": [int, ...] (with
                          --data-parallel-size: the engine that sampled each completion)}; 409 when `instance` is
                          not this server's (it restarted and lost the pushed weights)
                          images: each prompt's, with its ids before the processor expanded the image placeholders
                          (vLLM expands them itself and must arrive at prompt_ids, or the request fails)
    POST /update_weights  body: the weights as safetensors bytes, checkpoint names -> {"version": int}; a tensor
                          whose shape is not the checkpoint's (another model) is refused, as it is when announced
                          to /update_weights_collective

and, for weights broadcast through a process group (the trainer's `vllm_group_port`, as TRL's; NCCL between GPUs,
gloo between CPUs: `grpokit.rollout.weight_broadcast`):

    POST /init_communicator          {"port": int, "backend": "nccl" | "gloo", "timeout": s} -> the server hosts the
                                     group's store at that port and waits, in the background, for the trainer
    POST /update_weights_collective  {"params": [[name, dtype, shape], ...]} -> the server receives them, in the
                                     background, as the trainer broadcasts them
    POST /weights_received           -> {"version": int} once they are received and loaded into vLLM

Without a group port, weights travel as safetensors over HTTP (on one machine over the loopback). A data-parallel
server receives them in its main process (a group broadcast there over gloo, into CPU memory: its /info says
"device": "cpu") and hands them to its engines through one block of shared memory.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import itertools
import os
import signal
import sys
import threading
import traceback
import uuid
from http.server import HTTPServer
from pathlib import Path

from .json_http import JSONError, JSONHandler


class ServedWeights:
    """What every server does with the trainer's weights, whatever samples with them: takes a push (safetensors over
    HTTP, or a broadcast through a process group), checks its shapes against the served checkpoint's, hands it to
    `_load` and counts the version. The sampling side (`VLLMService`: one engine in this process;
    `DataParallelService`: N engines in child processes) implements `_load`."""

    def __init__(self, model_dir, host: str):
        self.version = 0  # the checkpoint's own weights
        self.shapes = checkpoint_shapes(model_dir)  # what every push must match, name by name
        self.host, self.group, self.backend = host, None, None
        self._background, self._outcome = None, {}  # the group's joining or a receiving thread; its outcome

    def _load(self, weights: dict) -> None:
        raise NotImplementedError

    def health(self) -> dict:
        return {"status": "ok"}

    def update_weights(self, body: bytes) -> dict:
        from safetensors.torch import load

        weights = load(body)
        check_pushed_shapes(self.shapes, {name: tensor.shape for name, tensor in weights.items()})
        self._load(weights)
        self.version += 1
        return {"version": self.version}

    # ---------------------------------------------------------------------- weights through a process group

    def _run_in_background(self, work) -> None:
        """Start `work` in a thread (the trainer's side of it starts once this request is answered); its result
        or error is kept for `_finish_background`."""
        self._finish_background()
        outcome = {}

        def run():
            try:
                outcome["result"] = work()
            except BaseException as error:  # reported to the trainer by the next request that waits for it
                outcome["error"] = error

        self._background, self._outcome = threading.Thread(target=run, daemon=True), outcome
        self._background.start()

    def _finish_background(self):
        if self._background is None:
            return None
        self._background.join()
        self._background, outcome = None, self._outcome
        if "error" in outcome:
            raise RuntimeError(f"weight broadcast failed on the server: {outcome['error']!r}") from outcome["error"]
        return outcome.get("result")

    def init_communicator(self, request: dict) -> dict:
        from .rollout.weight_broadcast import open_group

        self.group, self.backend = None, request["backend"]

        def join():
            self.group = open_group(self.backend, self.host, int(request["port"]), 0, float(request["timeout"]))

        self._run_in_background(join)
        return {"status": "joining", "port": request["port"]}

    def update_weights_collective(self, request: dict) -> dict:
        import torch

        from .rollout.weight_broadcast import receive

        self._finish_background()  # the group has been joined
        if self.group is None:
            raise RuntimeError("no process group: POST /init_communicator first")
        check_pushed_shapes(self.shapes, {name: shape for name, _, shape in request["params"]})
        device = torch.device("cuda" if self.backend == "nccl" else "cpu")
        self._run_in_background(lambda: receive(self.group, request["params"], device))
        return {"status": "receiving", "tensors": len(request["params"])}

    def weights_received(self) -> dict:
        weights = self._finish_background()
        if weights is None:
            raise RuntimeError("no weights were announced: POST /update_weights_collective first")
        self._load(weights)
        self.version += 1
        return {"version": self.version}


class VLLMService(ServedWeights):
    """The state behind the HTTP handler: one vLLM engine, its weight version and instance id."""

    def __init__(self, model_dir: str, host: str = "127.0.0.1", **llm_options):
        from .rollout.vllm import multimodal_options, start_llm

        self.multimodal, self.info = served_model_info(model_dir)
        import torch

        # "device": where a weight broadcast can land; NCCL only when both ends have a GPU, gloo otherwise.
        self.info.update(
            logprobs_mode="processed_logprobs",
            instance=uuid.uuid4().hex,
            model=str(model_dir),
            device="cuda" if torch.cuda.is_available() else "cpu",
            data_parallel_size=1,
        )
        # With the tokenizer in DIR, vLLM loads it: structured outputs need it (token ids in and out need none), and
        # so does a vision-language model's processor.
        tokenizer = has_tokenizer(model_dir)
        self.info["structured_outputs"] = tokenizer
        self.info["images"] = self.multimodal
        # A vision-language checkpoint saved by transformers 5 names its vision tower as transformers 5 does, which
        # vLLM's loader does not take: such a model starts from dummy weights and the checkpoint's are pushed in, as
        # the trainer's are, under vLLM's names (`vllm_names`).
        if self.multimodal:
            llm_options = {**multimodal_options(True, llm_options), **llm_options, "load_format": "dummy"}
        self.llm, _ = start_llm(model_dir, tokenizer_files=tokenizer, **llm_options)
        # The longest prompt + completion vLLM takes (--max-model-len, or the model's): the trainer checks its
        # budget against it when it connects.
        self.info["max_model_len"] = getattr(getattr(self.llm.llm_engine, "model_config", None), "max_model_len", None)
        if self.multimodal:
            self._load(checkpoint_weights(model_dir))
        super().__init__(model_dir, host)

    def describe(self) -> dict:
        return {**self.info, "version": self.version}

    def generate(self, request: dict) -> dict:
        from .rollout.engine import SamplingParams
        from .rollout.vllm import guarded_process_state, sample

        params = SamplingParams(**{**request["params"], "eos_token_ids": tuple(request["params"]["eos_token_ids"])})
        regex = request.get("structured_outputs_regex")
        if regex is not None and not self.info["structured_outputs"]:
            raise ValueError(
                "structured outputs need the tokenizer: this server's --model directory has none "
                "(save it there and restart the server)"
            )
        images = request.get("images")
        if images is not None:
            if not self.multimodal:
                raise ValueError(f"this server's model ({self.info['model_type']}) takes no images")
            from .rollout.vllm_client import image_from_wire

            images = [[image_from_wire(data) for data in row] for row in images]
        with guarded_process_state():
            completions = sample(
                self.llm,
                request["prompt_ids"],
                request["counts"],
                params,
                int(request["seed"]),
                self.info["vocab_size"],
                regex,
                images,
                request.get("unexpanded_ids"),
                request.get("prompt_seeds"),
            )
        return {"completions": completions, "version": self.version}

    def _load(self, weights: dict) -> None:
        """Checkpoint-named weights into vLLM (a vision-language model's vision tower renamed to vLLM's)."""
        from .rollout.vllm import guarded_process_state, push_weights, vllm_names

        named = iter(weights.items())
        with guarded_process_state():
            push_weights(
                self.llm, vllm_names(named) if self.multimodal else named, bool(self.info["tie_word_embeddings"])
            )


# ------------------------------------------------------------------------------------ data parallel


class EngineDied(RuntimeError):
    """An engine process of a data-parallel server ended."""


class EngineProcess:
    """One `VLLMService` in a child process of a data-parallel server, spoken to through a pipe: ("generate",
    request) -> ("ok", completions); ("load", shared memory name, size) -> ("ok", None); ("stop",). The server's main
    thread owns it and sends one message at a time; `close` stops it (asked, then killed) within a bounded time. The
    child also ends when the server does: its end of the pipe closes."""

    def __init__(
        self,
        index: int,
        count: int,
        model_dir: str,
        llm_options: dict,
        environment: dict[str, str],
        service: type | None = None,
    ):
        """service: the class the child builds over (model_dir, **llm_options) (None: `VLLMService`); a test's
        stand-in samples without vLLM."""
        import multiprocessing

        self.name = f"engine {index} of {count}"
        context = multiprocessing.get_context("spawn")  # a new interpreter: vLLM and CUDA start clean in each
        self.connection, child_end = context.Pipe()
        # Not a daemon: vLLM may start processes of its own (tensor parallelism), which a daemon may not.
        self.process = context.Process(
            target=_serve_engine,
            args=(child_end, service or VLLMService, str(model_dir), llm_options, environment),
            name=f"grpokit-vllm-engine-{index}",
        )
        self.process.start()
        child_end.close()
        self.prompts = 0  # prompts this engine sampled, for /info

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, *message) -> None:
        try:
            self.connection.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.check_alive(wait=True)
            raise

    def reply(self, poll_s: float = 0.5):
        """The child's next reply; `EngineDied`, naming it and how it ended, if it dies meanwhile."""
        while not self.connection.poll(poll_s):
            self.check_alive()
        try:
            status, payload = self.connection.recv()
        except (EOFError, ConnectionResetError, OSError):
            self.check_alive(wait=True)
            raise
        if status == "error":
            raise RuntimeError(f"{self.name} (pid {self.pid}): {payload}")
        return payload

    def check_alive(self, wait: bool = False) -> None:
        if wait:
            self.process.join(1.0)
        if self.process.is_alive():
            return
        code = self.process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        memory = " (the system may be out of memory: see dmesg)" if code == -signal.SIGKILL else ""
        raise EngineDied(
            f"vLLM {self.name} (pid {self.pid}) {how}{memory}: this server cannot sample. Restart "
            f"`grpokit vllm-serve` and resume the run from its last checkpoint."
        )

    def close(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(OSError):
            self.connection.send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.connection.close()


def _serve_engine(connection, service_class: type, model_dir: str, llm_options: dict, environment: dict) -> None:
    """An engine process: ("ready", its /info) or ("error", why) once vLLM has started, then one reply a message
    until ("stop",) or the server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it stops its engines
    os.environ.update(environment)  # before vLLM (and torch) start: the GPUs and threads this engine may use
    try:
        service = service_class(model_dir, **llm_options)
        connection.send(("ready", service.describe()))
    except BaseException as error:
        traceback.print_exc()
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    from multiprocessing import shared_memory

    from safetensors.torch import load

    while True:
        try:
            message = connection.recv()
        except EOFError:  # the server is gone
            break
        if message[0] == "stop":
            break
        try:
            if message[0] == "generate":
                reply = ("ok", service.generate(message[1])["completions"])
            else:  # ("load", name, size): the weights, as safetensors bytes, in shared memory
                block = shared_memory.SharedMemory(name=message[1])
                try:
                    weights = load(bytes(block.buf[: message[2]]))
                finally:
                    block.close()
                service._load(weights)
                reply = ("ok", None)
        except Exception as error:
            traceback.print_exc()
            reply = ("error", f"{type(error).__name__}: {error}")
        connection.send(reply)


def split_rows(counts: list[int], parts: int) -> list[range]:
    """`parts` contiguous ranges of rows (prompts), part k ending at the row boundary whose running count of
    completions is nearest k/parts of the total: parts as near equal as whole rows allow. With fewer rows than parts,
    some ranges are empty."""
    total, running = sum(counts), [0, *itertools.accumulate(counts)]
    starts = [0] * parts + [len(counts)]
    for k in range(1, parts):
        starts[k] = min(range(starts[k - 1], len(counts) + 1), key=lambda i: abs(running[i] * parts - total * k))
    return [range(starts[k], starts[k + 1]) for k in range(parts)]


def engine_environments(
    count: int, tensor_parallel_size: int, gpus: list[str] | None, cpus: int
) -> list[dict[str, str]]:
    """Each engine's environment: on GPUs (`gpus`: the visible devices' ids) its own `tensor_parallel_size` of them;
    on the CPU (`gpus` None) its share of the `cpus` cores as threads."""
    if gpus is None:
        return [{"OMP_NUM_THREADS": str(max(1, cpus // count))} for _ in range(count)]
    if len(gpus) < count * tensor_parallel_size:
        raise ValueError(
            f"--data-parallel-size {count} with --tensor-parallel-size {tensor_parallel_size} needs "
            f"{count * tensor_parallel_size} GPUs, and {len(gpus)} are visible (CUDA_VISIBLE_DEVICES): lower "
            f"either, or make more GPUs visible."
        )
    step = tensor_parallel_size
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * step : (i + 1) * step])} for i in range(count)]


def visible_gpus() -> list[str] | None:
    """The ids of the GPUs this process may use (CUDA_VISIBLE_DEVICES, or all), or None without any."""
    import torch

    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]


def start_engines(model_dir: str, count: int, llm_options: dict, service: type | None = None) -> list[EngineProcess]:
    """`count` engine processes over the checkpoint, each on its share of the GPUs or CPU cores (they start at once;
    `DataParallelService` waits for them)."""
    environments = engine_environments(
        count, llm_options.get("tensor_parallel_size", 1), visible_gpus(), os.cpu_count() or 1
    )
    return [
        EngineProcess(i, count, model_dir, llm_options, environment, service)
        for i, environment in enumerate(environments)
    ]


class DataParallelService(ServedWeights):
    """The HTTP handler's state for `--data-parallel-size N`: N `EngineProcess`es of the same checkpoint
    (`start_engines`), one instance id and weight version for all of them. The server's main thread owns the engines
    (one request at a time): a request's parts go to all engines before any reply is read, so they sample at once."""

    def __init__(self, model_dir: str, engines: list[EngineProcess], host: str = "127.0.0.1"):
        served_model_info(model_dir)  # refuses a vision-language model without its processor, before the engines do
        self.engines = engines
        self.dead: EngineDied | None = None  # the first engine found dead: every request fails with it from then on
        try:
            described = self._all([()] * len(self.engines))  # each engine's /info once it is up
        except BaseException:
            self.close()
            raise
        self.info = {
            **described[0],
            "instance": uuid.uuid4().hex,
            # The weights are received here, in CPU memory, and handed to the engines through shared memory.
            "device": "cpu",
            "data_parallel_size": len(engines),
        }
        self.info.pop("version", None)
        super().__init__(model_dir, host)

    def describe(self) -> dict:
        engines = [{"pid": engine.pid, "prompts": engine.prompts} for engine in self.engines]
        return {**self.info, "version": self.version, "engines": engines}

    def health(self) -> dict:
        if self.dead is None:
            for engine in self.engines:
                try:
                    engine.check_alive()
                except EngineDied as error:
                    self.dead = error
        if self.dead is not None:
            raise JSONError(503, str(self.dead), "server_error")
        return {"status": "ok"}

    def generate(self, request: dict) -> dict:
        from .rollout.vllm import prompt_seeds

        rows = len(request["prompt_ids"])
        seeds = request.get("prompt_seeds") or prompt_seeds(int(request["seed"]), rows)
        parts = split_rows(request["counts"], len(self.engines))

        def piece(part: range) -> dict:
            taken = {
                name: None if request.get(name) is None else [request[name][i] for i in part]
                for name in ("prompt_ids", "counts", "images", "unexpanded_ids")
            }
            return {**request, **taken, "prompt_seeds": [seeds[i] for i in part]}

        answers = self._all([("generate", piece(part)) if part else None for part in parts])
        for engine, part in zip(self.engines, parts):
            engine.prompts += len(part)
        return {
            "completions": [row for answer in answers if answer for row in answer],
            # which engine sampled each row: the trainer checks each one's served-policy gap (grpokit.served)
            "engines": [index for index, answer in enumerate(answers) if answer for _ in answer],
            "version": self.version,
        }

    def _load(self, weights: dict) -> None:
        """The weights to every engine, as safetensors bytes in one block of shared memory that each engine reads."""
        from multiprocessing import shared_memory

        from safetensors.torch import save

        data = save({name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()})
        block = shared_memory.SharedMemory(create=True, size=len(data))
        try:
            block.buf[: len(data)] = data
            self._all([("load", block.name, len(data))] * len(self.engines))
        finally:
            block.close()
            block.unlink()

    def _all(self, messages: list[tuple | None]) -> list:
        """Each engine's message sent (None: none, and no reply; `()`: none, but a reply is due, the start-up's), then
        each engine's reply (None where none is due), in the engines' order. Every reply due is read before an error
        is raised, so that none is left in a pipe for the next request; an engine found dead fails this request and
        every later one."""
        if self.dead is not None:
            raise self.dead
        due, replies, errors = [], [], []
        for engine, message in zip(self.engines, messages):
            try:
                if message:
                    engine.send(*message)
                due.append(message is not None)
            except (EngineDied, OSError) as error:
                due.append(False)
                errors.append(error)
        for engine, waiting in zip(self.engines, due):
            reply = None
            if waiting:
                try:
                    reply = engine.reply()
                except (EngineDied, RuntimeError, OSError) as error:
                    errors.append(error)
            replies.append(reply)
        died = [error for error in errors if isinstance(error, EngineDied)]
        if died:
            self.dead = died[0]
            raise self.dead
        if errors:
            raise errors[0]
        return replies

    def close(self, timeout: float = 10.0) -> None:
        for engine in self.engines:
            engine.close(timeout)


def served_model_info(model_dir) -> tuple[bool, dict]:
    """(whether DIR holds a vision-language model, what /info says of its shape: the text model's sizes, which the
    trainer checks against the policy's). A vision-language model without its processor is refused here, before
    vLLM starts."""
    from transformers import AutoConfig

    from .multimodal import is_vision_language_model, text_config_of, ties_word_embeddings
    from .rollout.vllm_client import weight_shape_config

    config = AutoConfig.from_pretrained(model_dir)
    text = text_config_of(config)
    info = {
        "model_type": config.model_type,
        "vocab_size": getattr(text, "vocab_size", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_hidden_layers": getattr(text, "num_hidden_layers", None),
        "tie_word_embeddings": ties_word_embeddings(config),
        "shape": weight_shape_config(config),
    }
    multimodal = is_vision_language_model(config)
    if multimodal and not has_processor(model_dir):
        raise ValueError(
            f"{model_dir} holds a vision-language model ({config.model_type}) without its processor, "
            f"which vLLM needs to preprocess the prompts' images: save it there "
            f"(AutoProcessor.from_pretrained(...).save_pretrained(DIR)) and start the server again."
        )
    return multimodal, info


def checkpoint_shapes(model_dir) -> dict[str, list[int]]:
    """The shape of every tensor of a checkpoint directory's safetensors files, by name (read from their headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, "pt") as opened:
            shapes.update({name: list(opened.get_slice(name).get_shape()) for name in opened.keys()})  # noqa: SIM118
    return shapes


def check_pushed_shapes(expected: dict[str, list[int]], pushed: dict) -> None:
    """Pushed weights must have the served checkpoint's shapes (vLLM copies a weight into a larger parameter
    without an error): a second check, by the tensors themselves, behind the client's comparison of the configs.
    Names the checkpoint does not hold (a tied head it left out, a renamed vision tower) are vLLM's to place."""
    wrong = {
        name: (expected[name], list(shape))
        for name, shape in pushed.items()
        if name in expected and expected[name] != list(shape)
    }
    if wrong:
        shown = ", ".join(f"{name}: served {a}, pushed {b}" for name, (a, b) in list(wrong.items())[:4])
        raise ValueError(
            f"pushed weights have other shapes than the served model's ({len(wrong)} tensors; {shown}): "
            f"the server serves another model than the trainer's policy; start it with the policy's "
            f"checkpoint"
        )


def checkpoint_weights(model_dir) -> dict:
    """The tensors of a checkpoint directory's safetensors files, by name."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no .safetensors weights (save the model with save_pretrained)")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def has_processor(model_dir) -> bool:
    """Whether a checkpoint directory holds a multimodal processor (what a processor's `save_pretrained` writes)."""
    return any((Path(model_dir) / name).exists() for name in ("processor_config.json", "preprocessor_config.json"))


def has_tokenizer(model_dir) -> bool:
    """Whether a checkpoint directory holds a tokenizer (what transformers' `save_pretrained` writes)."""
    return any((Path(model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))


TOKEN_VARIABLE = "GRPOKIT_VLLM_TOKEN"


def handler_for(service: VLLMService | DataParallelService, token: str | None = None):
    """The HTTP handler over `service`; with `token`, POST requests must carry it (Authorization: Bearer)."""

    class Handler(JSONHandler):
        def route(self, method: str, path: str) -> dict:
            if method == "GET" and path == "/health":
                return service.health()
            if method == "GET" and path == "/info":
                return service.describe()
            if method == "POST":
                given = self.headers.get("Authorization", "")
                if token is not None and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    raise JSONError(
                        401,
                        f"this server takes a token: set {TOKEN_VARIABLE} in the trainer's environment to the server's",
                        "authentication_error",
                    )
                if path == "/generate":
                    request = self.json_body()
                    if request.get("instance") != service.info["instance"]:
                        raise JSONError(
                            409, "this server restarted: push the weights again", instance=service.info["instance"]
                        )
                    return service.generate(request)
                if path == "/update_weights":
                    return service.update_weights(self.body())
                if path == "/init_communicator":
                    return service.init_communicator(self.json_body())
                if path == "/update_weights_collective":
                    return service.update_weights_collective(self.json_body())
                if path == "/weights_received":
                    return service.weights_received()
            raise JSONError(404, f"no such endpoint {method} {path}")

    return Handler


def arguments() -> argparse.ArgumentParser:
    """`grpokit vllm-serve`'s options."""
    parser = argparse.ArgumentParser(
        prog="grpokit vllm-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="the policy's checkpoint directory (config + weights)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: the loopback; 0.0.0.0 for every interface)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_VARIABLE) or None,
        help=f"a shared secret every POST must carry (default: ${TOKEN_VARIABLE}); the trainer "
        f"sends its own ${TOKEN_VARIABLE}",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--dtype", default="auto", help="vLLM's compute dtype (auto: vLLM's choice, 16 bits for a float32 checkpoint)"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs each engine is split over")
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="vLLM engines behind this one URL, each in a process of its own (on GPUs: --tensor-parallel-size GPUs "
        "each); each request's prompts are split among them and every weight push reaches all of them (TRL's "
        "--data_parallel_size)",
    )
    parser.add_argument("--model-impl", default="vllm", choices=("vllm", "transformers"))
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="CPU only: VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = arguments().parse_args(argv)
    if options.data_parallel_size < 1:
        raise SystemExit(f"--data-parallel-size {options.data_parallel_size}: give 1 or more engines")
    llm_options = dict(
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        gpu_memory_utilization=options.gpu_memory_utilization,
        tensor_parallel_size=options.tensor_parallel_size,
        model_impl=options.model_impl,
        kv_cache_gib=options.kv_cache_gib,
        seed=options.seed,
    )
    if options.data_parallel_size == 1:
        service = VLLMService(options.model, host=options.host, **llm_options)
    else:
        engines = start_engines(options.model, options.data_parallel_size, llm_options)
        service = DataParallelService(options.model, engines, host=options.host)
    try:
        serve(service, options)
    finally:
        if isinstance(service, DataParallelService):
            service.close()
    return 0


def serve(service: VLLMService | DataParallelService, options: argparse.Namespace) -> None:
    """Answer requests until Ctrl-C or SIGTERM (which end here, so that the caller stops the engines)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if options.token is None and options.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"WARNING: listening on {options.host} without a token: anyone who reaches port {options.port} can "
            f"replace the policy's weights. Set --token (or {TOKEN_VARIABLE}) here and {TOKEN_VARIABLE} in the "
            f"trainer's environment.",
            file=sys.stderr,
            flush=True,
        )
    server = HTTPServer((options.host, options.port), handler_for(service, options.token))
    engines = f", {options.data_parallel_size} engines" if options.data_parallel_size > 1 else ""
    print(
        f"grpokit vLLM server: {options.model} at http://{options.host}:{options.port} "
        f"(instance {service.info['instance']}{engines})",
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
