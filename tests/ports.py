"""Ports for the servers and launchers the tests start (torchrun's master, vLLM servers, weight groups)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range. A port from bind(("", 0)) is one the kernel hands out
    again to any socket bound to port 0 before the caller binds it for good: vLLM's engine inside a server binds its
    own ports that way while it loads, before the server binds its HTTP port, and took one once ("Address already in
    use"); torchrun's workers bind gloo's ports that way beside the master's store."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.Random()
    for _ in range(200 if low > 12_000 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
