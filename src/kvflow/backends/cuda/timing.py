"""How long the CUDA backend's copies took: timing events around a batch, and the host time
spent issuing batches, for ``CudaBackend`` (importing it needs no GPU)."""

from __future__ import annotations

import contextlib

from attrs import define

from kvflow.backends.cuda import driver as drv


class Timing:
    """Two timing events around one batch's copies: ``start`` after its waits, ``end`` after
    its last work. Taken from ``pool``; they go back to it when the last fence referring to
    them goes."""

    __slots__ = ("end", "pool", "start")

    def __init__(self, pool: drv.EventPool) -> None:
        self.pool = pool
        self.start = pool.take()
        self.end = pool.take()

    def __del__(self) -> None:
        # At interpreter shutdown the driver may already be gone.
        with contextlib.suppress(Exception):
            self.pool.give(self.start)
        with contextlib.suppress(Exception):
            self.pool.give(self.end)


@define(eq=False)
class IssueStats:
    """Batches issued in one direction and the host seconds issuing them took (the planning and
    every driver call, on the launch thread or, without one, inside ``submit``)."""

    batches: int = 0
    seconds: float = 0.0

    def observe(self, seconds: float) -> None:
        self.batches += 1
        self.seconds += seconds


__all__ = ["IssueStats", "Timing"]
