"""``JobThread``: one thread that runs the CUDA backend's jobs in order, with the device's
context current (the launch thread, and a waiter thread per direction)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from kvflow.backends.cuda import driver as drv


class JobThread:
    """One thread that runs the jobs put to it, in order, with the device's context current.

    The launch thread takes the driver calls of submitted batches, so the driver's
    per-descriptor cost of ``cuMemcpyBatchAsync`` (large for a step's scattered blocks:
    docs/benchmarks.md) and any wait for a CPU chunk still being pinned happen off the event loop; the
    driver calls release the GIL. A waiter thread per direction takes fence waits (``_await``).
    """

    def __init__(self, ctx: drv.Context, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(ctx,), name=name, daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        """Block until every job put so far has run."""
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self, ctx: drv.Context) -> None:
        ctx.enter()
        while (job := self._jobs.get()) is not None:
            job()
            del job  # drop what it holds (a fence's event) now, not at the next get()


__all__ = ["JobThread"]
