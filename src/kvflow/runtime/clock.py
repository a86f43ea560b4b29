"""Time, injected: the ``Clock`` protocol, the real ``SystemClock`` and the test ``FakeClock``.

Nothing in kvflow reads or waits on time except through a ``Clock``. ``FakeClock`` only moves when
a test says so (``jump``) or, in autojump mode, when every task on the loop is blocked: it then
skips straight to the earliest sleeper's deadline, so timeouts and back-offs run in zero real time
and in a deterministic order. (anyio has no fake clock on asyncio, hence this module.)
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol, runtime_checkable

import anyio
from attrs import define, field

from kvflow.core.logs import get_logger
from kvflow.errors import ConfigError

log = get_logger("kvflow.clock")


@runtime_checkable
class Clock(Protocol):
    """Where kvflow gets the time and how it sleeps."""

    def now(self) -> float:
        """Seconds on a monotonic scale (the origin is arbitrary)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (≤ 0: just a checkpoint)."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Sleep until ``now() >= deadline``."""
        ...


class SystemClock:
    """Real monotonic time (``time.perf_counter``); sleeps on the event loop."""

    # The one sanctioned read of the system clock in kvflow's runtime. perf_counter, the
    # engine's and the backends' clock too: a worker's "landed" time compares with theirs. The
    # builtin itself, not a method calling it: the connector reads the time every step, and a
    # Python frame run cold costs more than the read.
    now = staticmethod(time.perf_counter)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(seconds, 0.0))

    async def sleep_until(self, deadline: float) -> None:
        await anyio.sleep(max(deadline - self.now(), 0.0))


async def wait_all_tasks_blocked(rounds: int = 2) -> None:
    """Return once no other task on this asyncio loop is runnable (all wait on something).

    asyncio has no public API for this; its ready queue (``loop._ready``) is the ground truth, as
    in trio's ``wait_all_tasks_blocked``. Seeing it empty on ``rounds`` consecutive checkpoints
    means the callbacks that woke tasks have run and those tasks blocked again. Only one task at
    a time may wait here (two would keep each other runnable forever), so a test body must not
    call it while ``FakeClock.autojump`` runs: it blocks on an event instead.
    """
    loop = asyncio.get_running_loop()
    empty = 0
    while empty < rounds:
        await asyncio.sleep(0)
        ready = getattr(loop, "_ready", None)
        if ready is None:
            raise ConfigError("wait_all_tasks_blocked needs a standard asyncio event loop")
        empty = empty + 1 if not ready else 0


@define(eq=False)
class _Sleeper:
    deadline: float
    event: anyio.Event
    cancelled: bool = False


@define(eq=False)
class FakeClock:
    """A clock that moves only when told: ``jump(dt)``, or ``autojump()`` when everything blocks."""

    _now: float = 0.0
    _heap: list[tuple[float, int, _Sleeper]] = field(factory=list)
    _seq: itertools.count[int] = field(factory=itertools.count)
    _new_sleeper: anyio.Event | None = None

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        await self.sleep_until(self._now + seconds)

    async def sleep_until(self, deadline: float) -> None:
        if math.isnan(deadline):
            raise ConfigError("cannot sleep until NaN")
        if deadline <= self._now:
            await anyio.lowlevel.checkpoint()
            return
        sleeper = _Sleeper(deadline, anyio.Event())
        heapq.heappush(self._heap, (deadline, next(self._seq), sleeper))
        if self._new_sleeper is not None:
            self._new_sleeper.set()
        try:
            await sleeper.event.wait()
        finally:
            # A cancelled sleeper stays in the heap (lazy deletion) but must not stop autojump.
            sleeper.cancelled = True

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline anyone still sleeps until, or None."""
        self._drop_cancelled()
        return self._heap[0][0] if self._heap else None

    def _drop_cancelled(self) -> None:
        while self._heap and self._heap[0][2].cancelled:
            heapq.heappop(self._heap)

    def jump(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleeper whose deadline has come."""
        if seconds < 0 or math.isnan(seconds):
            raise ConfigError(f"a clock only moves forward; cannot jump {seconds}")
        self._now += seconds
        while self._heap and self._heap[0][0] <= self._now:
            _, _, sleeper = heapq.heappop(self._heap)
            if not sleeper.cancelled:
                sleeper.event.set()

    async def _autojump_loop(self) -> None:
        while True:
            await wait_all_tasks_blocked()
            deadline = self.next_deadline
            if deadline is None:
                self._new_sleeper = anyio.Event()
                await self._new_sleeper.wait()
                self._new_sleeper = None
                continue
            log.debug("clock_autojump", to=deadline, by=deadline - self._now)
            self.jump(deadline - self._now)

    @asynccontextmanager
    async def autojump(self) -> AsyncIterator[FakeClock]:
        """While open, whenever every task is blocked, jump to the earliest sleeper's deadline."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._autojump_loop)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()


__all__ = ["Clock", "FakeClock", "SystemClock", "wait_all_tasks_blocked"]
