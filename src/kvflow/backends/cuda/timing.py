"""How long the CUDA backend's copies took: timing events around a batch, the host time spent
issuing batches, and marks that put device events on the host's clock, for ``CudaBackend``
(importing it needs no GPU)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from attrs import define

from kvflow.backends.cuda import driver as drv
from kvflow.core.logs import get_logger
from kvflow.errors import BackendError

log = get_logger("kvflow.backends.cuda")


class Timing:
    """Two timing events around one batch's copies: ``start`` after its waits, ``end`` after
    its last work. Taken from ``pool``; they go back to it when the last fence referring to
    them goes. ``seen_done``: a poll saw the batch's fence complete, so ``end`` has passed."""

    __slots__ = ("end", "pool", "seen_done", "start")

    def __init__(self, pool: drv.EventPool) -> None:
        self.pool = pool
        self.start = pool.take()
        self.end = pool.take()
        self.seen_done = False

    @staticmethod
    def overlapping(prev: Timing | None) -> Timing | None:
        """The previous batch's timing as a batch issued now must subtract it: None where a
        poll saw that batch done before now. Its end then came before anything of the new
        batch was queued, so nothing overlapped and no driver call need say so (the common
        case: one batch of a direction at a time)."""
        return None if prev is None or prev.seen_done else prev

    def seconds_beyond(self, prev: Timing | None) -> float | None:
        """Device seconds from ``start`` to ``end`` (both completed), less the part ``prev``
        (the previous batch of the direction) overlapped, which was counted already; None when
        the driver cannot say."""
        seconds = drv.elapsed_s(self.start, self.end)
        if seconds is None:
            return None
        if prev is not None:
            # The previous batch's span relative to this one's start. Where it ended before
            # this one began (batches one after another, the usual case) nothing overlapped,
            # and its start need not be read: each driver call costs a few µs of the poll that
            # settles the batch.
            prev_end = drv.elapsed_s(self.start, prev.end)
            if prev_end is not None and prev_end > 0.0:
                prev_start = drv.elapsed_s(self.start, prev.start)
                if prev_start is not None:
                    overlap = min(seconds, prev_end) - max(0.0, prev_start)
                    seconds -= max(0.0, overlap)
        return max(0.0, seconds)

    def __del__(self) -> None:
        # At interpreter shutdown the driver may already be gone.
        with contextlib.suppress(Exception):
            self.pool.give(self.start)
        with contextlib.suppress(Exception):
            self.pool.give(self.end)


MARK_WAIT_S = 1.0
"""How long a clock mark waits for an idle stream's event before it gives up."""


class ClockMark:
    """A timing event recorded on an idle stream, and ``time.perf_counter()`` right after the
    record call: a later device event's host-clock time is the mark's plus the device time
    between them (the mark waits for its event, so it can be placed against at once). The event
    is recorded and waited for once first: a device that idled takes tens of µs to reach a
    record (all placed events would read that much early), an awake one a few µs. On a busy
    stream the mark would be as late as its queue."""

    __slots__ = ("event", "host", "pool")

    def __init__(self, pool: drv.EventPool, stream: Any) -> None:
        self.pool = pool
        self.event = pool.take()
        drv.record(self.event, stream)
        self._reached()
        drv.record(self.event, stream)
        self.host = time.perf_counter()
        # Placing an event against the mark needs the mark's event completed.
        self._reached()

    def _reached(self) -> None:
        """Wait until the device has reached the mark's event. Polled, not synchronized: a
        device that never reaches it must not hang the caller (the runtime's loop, for
        ``copy_landed_ago``)."""
        deadline = time.perf_counter() + MARK_WAIT_S
        while (err := drv.event_query(self.event)) == drv.NOT_READY:
            if time.perf_counter() > deadline:
                raise BackendError(
                    f"clock mark: the device did not reach its event within {MARK_WAIT_S} s"
                )
        if err:
            raise BackendError(f"clock mark: waiting for its event failed (CUresult {err})")

    def place(self, event: Any) -> float | None:
        """``event``'s time on the host's ``perf_counter`` clock, or None if the driver cannot
        say (either event not completed, or not a timing event)."""
        seconds = drv.elapsed_s(self.event, event)
        return None if seconds is None else self.host + seconds

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.give(self.event)


MARK_MAX_AGE_S = 1.0
"""How long ``LandingClock`` uses one clock mark before it takes a new one."""

MARK_RETRY_S = 60.0
"""After a clock mark could not be taken, how long ``LandingClock`` takes none (each try may
hold the runtime's loop for ``MARK_WAIT_S``): meanwhile loads go undated."""


class LandingClock:
    """Places finished batches' end events on ``time.perf_counter`` (``copy_landed_ago``)
    against a clock mark it keeps, renewed once older than ``MARK_MAX_AGE_S`` so the two clocks
    cannot drift apart. A mark that cannot be taken leaves loads undated, never failed, and
    none is tried again for ``MARK_RETRY_S``."""

    __slots__ = ("_failed_at", "_make", "mark")

    def __init__(self, make: Callable[[], ClockMark]) -> None:
        self._make = make
        self.mark: ClockMark | None = None
        self._failed_at: float | None = None

    def ago(self, end: Any) -> float | None:
        """Seconds since the completed event ``end``, or None if no mark can say."""
        now = time.perf_counter()
        mark = self.mark
        if mark is None or now - mark.host > MARK_MAX_AGE_S:
            if self._failed_at is not None and now - self._failed_at < MARK_RETRY_S:
                return None
            self.mark = None
            try:
                mark = self.mark = self._make()
            except BackendError as exc:
                self._failed_at = now
                log.warning("cuda_clock_mark_failed", error=str(exc), retry_in_s=MARK_RETRY_S)
                return None
            self._failed_at = None
            now = time.perf_counter()
        ended = mark.place(end)
        return None if ended is None else max(0.0, now - ended)


@define(eq=False)
class IssueStats:
    """Batches issued in one direction and the host seconds issuing them took (the planning and
    every driver call, on the launch thread or, without one, inside ``submit``), and when the
    last one began and ended on ``time.perf_counter``'s clock."""

    batches: int = 0
    seconds: float = 0.0
    last_began: float = 0.0
    last_ended: float = 0.0

    def observe(self, began: float, ended: float) -> None:
        self.batches += 1
        self.seconds += ended - began
        self.last_began, self.last_ended = began, ended


__all__ = [
    "MARK_MAX_AGE_S",
    "MARK_RETRY_S",
    "MARK_WAIT_S",
    "ClockMark",
    "IssueStats",
    "LandingClock",
    "Timing",
]
