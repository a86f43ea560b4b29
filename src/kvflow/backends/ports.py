"""Free TCP ports for the rendezvous of the processes kvflow starts (PD pairs, tensor-parallel
groups), picked where no process's outgoing connection can take them first."""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

_FLOOR = 10_000
"""The lowest port picked (below it lie well-known services)."""

_given: deque[int] = deque(maxlen=1024)
"""Ports handed out lately: two rendezvous of one launch never get the same one."""


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None where it cannot say."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` nothing listens on now, not handed out lately by this process.

    Taken below the kernel's ephemeral range where it is known: a port from that range (what
    binding port 0 gives) can be taken by any process's outgoing connection between this call
    and its listener's bind, which made a gloo pair's store fail with EADDRINUSE in CI.
    """
    low = _ephemeral_low()
    if low is not None and low > _FLOOR + 1000:
        pick = random.SystemRandom()
        for _ in range(256):
            port = pick.randrange(_FLOOR, low)
            if port not in _given and _bindable(host, port):
                _given.append(port)
                return port
    for _ in range(16):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _given:
            _given.append(port)
            return port
    _given.append(port)
    return port


__all__ = ["free_port"]
