"""Weights from the trainer to a `grpokit vllm-serve` server through a process group of two, TRL's
`vllm_group_port`: NCCL between GPUs, gloo between CPUs (the transport the tests run).

The group is torch's own backend object over a TCPStore that the server hosts at the group port (rank 0); the
trainer joins as rank 1 and is the root of every broadcast. It is separate from the trainer's default process
group (DDP / FSDP2 / DeepSpeed), so only the pushing process takes part. The server is told, over HTTP, the names,
dtypes and shapes to expect, in order; then each tensor is one broadcast, received into a fresh tensor on the
server's device and handed to vLLM as the HTTP transport's safetensors would be.
"""

from __future__ import annotations

from datetime import timedelta

import torch

TRAINER_RANK = 1


def open_group(backend: str, host: str, port: int, rank: int, timeout: float):
    """This side's end of the two-process group: rank 0 (the server) hosts the store at host:port, rank 1 (the
    trainer) connects to it. Returns once both have joined."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight broadcast backend {backend!r}: use 'nccl' (GPUs) or 'gloo' (CPUs).")
    store = dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=timedelta(seconds=timeout))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=timeout)
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def describe(weights) -> list[list]:
    """[name, dtype name, shape] of each (name, tensor): what the server allocates to receive."""
    return [[name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)] for name, tensor in weights]


def send(group, weights) -> None:
    """Broadcast each tensor of `weights` ((name, tensor) pairs, in the order `describe` listed them)."""
    for _, tensor in weights:
        group.broadcast(tensor.detach().contiguous(), TRAINER_RANK).wait()


def receive(group, specs: list[list], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `specs` announced, received in order from the trainer."""
    weights = {}
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        group.broadcast(tensor, TRAINER_RANK).wait()
        weights[name] = tensor
    return weights
