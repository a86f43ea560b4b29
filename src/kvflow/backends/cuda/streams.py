"""The CUDA backend's fences and streams: ``CudaFence`` (an event and what the launch thread
knows of it), a direction's lane of streams with its staging ring, and how a batch enters a
stream (after the fences it waits for) and ends on one (the others joined into it)."""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from attrs import define

from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.timing import Timing

if TYPE_CHECKING:
    from kvflow.backends.cuda.backend import CudaBackend


class CudaFence:
    """A CUDA event; created by one backend and only meaningful to it.

    ``launched`` turns true once the event is recorded after its copies (at once, or on the
    launch thread); until then the fence is pending whatever the event says. ``timing`` (with
    ``CudaConfig.time_copies``) times the copies; ``prev_timing`` is the previous batch of the
    same direction's, so that time both were copying counts once. It is dropped once the fence
    is settled, so fences never chain.
    """

    __slots__ = (
        "error",
        "event",
        "issued",
        "launched",
        "owner",
        "pool",
        "prev_timing",
        "timing",
    )

    def __init__(
        self,
        event: Any,
        owner: CudaBackend,
        *,
        launched: bool = True,
        pool: drv.EventPool | None = None,
    ) -> None:
        self.event = event
        self.owner = owner
        self.launched = launched
        self.pool = pool
        """Where the event goes back when the fence goes (None: it is destroyed)."""
        self.error: str | None = None
        self.timing: Timing | None = None
        self.prev_timing: Timing | None = None
        self.issued: threading.Event | None = None
        """A load part's: set once the launch thread recorded its event (or failed)."""

    def __del__(self) -> None:
        # At interpreter shutdown the driver may already be gone.
        with contextlib.suppress(Exception):
            if self.pool is not None:
                self.pool.give(self.event)
            else:
                drv.cu.cuEventDestroy(self.event)


@define(eq=False)
class Ring:
    """One direction's staging slots, each with the stream that runs its kernel and its DMA."""

    base: int
    slot_bytes: int
    streams: list[Any]
    next: int = 0


@define(eq=False)
class Lane:
    """One direction's streams: ``dma`` runs the direct path's copies, the ring the staged path."""

    dma: Any
    attrs: drv.CopyAttributes
    ring: Ring | None = None


def enter_stream(
    used: list[Any],
    stream: Any,
    waits: list[Any],
    timing: Timing | None,
    mine: list[Any] | None = None,
) -> None:
    """Before a batch's first work on ``stream``: the stream waits for the batch's fences,
    and the batch's first stream records its timing start (after those waits). ``mine``
    (a part's streams, or the batch's own ``used``) notes the stream too."""
    if mine is not None and mine is not used and not any(s is stream for s in mine):
        mine.append(stream)
    for s in used:
        if s is stream:
            return
    for waited in waits:
        drv.wait(stream, waited.event)
    if timing is not None and not used:
        drv.record(timing.start, stream)
    used.append(stream)


def join_streams(join: Any, streams: list[Any]) -> Any:
    """The last of ``streams``, made to wait (through the event ``join``) for the work queued
    on the others."""
    last = streams[-1]
    for stream in streams[:-1]:
        drv.record(join, stream)
        drv.wait(last, join)
    return last


__all__ = ["CudaFence", "Lane", "Ring", "enter_stream", "join_streams"]
