"""The leak check every in-process PD test runs after itself: no thread, file descriptor (socket)
or zmq context it started is still there."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest


def _fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it left threads or file descriptors behind."""
    threads = set(threading.enumerate())
    fds = _fds()
    yield
    gc.collect()  # what only a reference cycle still holds (a torch store, say) is not a leak
    left = [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
    assert not left, f"threads left running: {left}"
    extra = _fds() - fds
    leaked = []
    for fd in sorted(extra):
        try:
            leaked.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
    assert not leaked, f"file descriptors left open: {leaked}"
