"""``make_sync_worker``: the one place a synchronous engine's worker runtime is built.

The connector and the vLLM adapter both call it; ``WorkerLoop`` picks who drives the loop.
"""

from __future__ import annotations

from kvflow.backends.base import Backend
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.sync_worker import SyncWorker, WorkerLoop
from kvflow.runtime.threaded import ThreadedSyncWorker
from kvflow.runtime.worker import WorkerOptions


def make_sync_worker(
    backend: Backend, options: WorkerOptions | None = None, *, loop: WorkerLoop | str
) -> SyncWorker:
    """A started worker runtime over ``backend``, its loop on a thread of its own (``thread``)
    or stepped on the engine's thread (``inline``); use it as a context manager or shut it down."""
    if WorkerLoop(loop) is WorkerLoop.INLINE:
        return InlineSyncWorker(backend, options)
    return ThreadedSyncWorker(backend, options)


__all__ = ["make_sync_worker"]
