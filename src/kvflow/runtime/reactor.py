"""The event reactor: turns backend fences into awaitables.

``await reactor.wait(fence)`` parks a task until its fence finishes. ``poll()`` is the only code in
kvflow that asks the device (``backend.query``); ``process()`` only dispatches what ``poll``
found. The reactor's task polls only while some fence is watched, backing off exponentially from
``min_backoff`` to ``max_backoff``; with nothing watched it waits on an event and costs nothing.
A backend that learns of completions by callback (``set_wakeup``) makes it poll at once, from any
thread, through ``loop.call_soon_threadsafe``. A backend whose ``pushes_completions`` is true
calls it for every finished fence, so the timed polls are only a safety net: they start at
``max_backoff`` and grow to ``push_backoff``. Every timed poll takes the GIL from whatever thread
drives the engine, which is what a serving process can least afford.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import anyio
from attrs import define, field

from kvflow.backends.base import Backend, Fence, FenceStatus
from kvflow.core.logs import get_logger
from kvflow.errors import ClosedError, ConfigError, ProtocolError
from kvflow.runtime.clock import Clock

log = get_logger("kvflow.reactor")


@define(eq=False, slots=True)
class _Watch:
    """Every waiter on one fence; the fence is queried once per poll however many wait."""

    fence: Fence
    waiters: list[Callable[[FenceStatus], None]] = field(factory=list)


@define(eq=False)
class Reactor:
    """Watches fences of one backend and wakes their waiters; run ``run()`` in a task."""

    backend: Backend
    clock: Clock
    min_backoff: float = 20e-6
    max_backoff: float = 1e-3
    push_backoff: float = 20e-3
    _watches: dict[int, _Watch] = field(factory=dict)
    _has_work: anyio.Event = field(factory=anyio.Event)
    _sleep_scope: anyio.CancelScope | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _loop_thread: int | None = None
    _wake_pending: bool = False
    _closed: bool = False
    polls: int = 0  # how many times poll() ran: tests and the benchmark read it

    def __attrs_post_init__(self) -> None:
        if not 0 < self.min_backoff <= self.max_backoff:
            raise ConfigError(
                f"reactor back-off must satisfy 0 < min ≤ max, got {self.min_backoff}, "
                f"{self.max_backoff}"
            )

    @property
    def in_flight(self) -> int:
        """Fences being watched."""
        return len(self._watches)

    # -- the device side -------------------------------------------------------------------
    def poll(self) -> list[tuple[_Watch, FenceStatus]]:
        """Query every watched fence once; return the finished ones (removed from the watch set)."""
        self.polls += 1
        query = self.backend.query
        done: list[tuple[_Watch, FenceStatus]] = []
        for key, watch in list(self._watches.items()):
            status = query(watch.fence)
            if status is not FenceStatus.PENDING:
                del self._watches[key]
                done.append((watch, status))
        return done

    def process(self, done: list[tuple[_Watch, FenceStatus]]) -> None:
        """Hand each finished fence's status to its waiters. Pure dispatch; never queries."""
        for watch, status in done:
            for waiter in watch.waiters:
                try:
                    waiter(status)
                except Exception:
                    # One broken waiter must not strand the others' completions.
                    log.exception("reactor_waiter_failed", status=status.value)

    def poll_now(self) -> int:
        """Poll every watched fence once and dispatch the finished ones; returns how many. For a
        loop driven from the engine's thread (``InlineSyncWorker``), which polls at each of
        the engine's calls rather than waiting for the polling task's next timer."""
        if not self._watches:
            return 0
        done = self.poll()
        if done:
            self.process(done)
        return len(done)

    # -- the waiting side ------------------------------------------------------------------
    def watch(self, fence: Fence, callback: Callable[[FenceStatus], None]) -> None:
        """Call ``callback(status)`` on the loop thread once ``fence`` finishes."""
        if self._closed:
            raise ClosedError("reactor is closed")
        key = id(fence)
        w = self._watches.get(key)
        if w is None:
            w = self._watches[key] = _Watch(fence)
        w.waiters.append(callback)
        if not self._has_work.is_set():
            self._has_work.set()

    async def wait(self, fence: Fence) -> FenceStatus:
        """Wait until ``fence`` finishes; return ``DONE`` or ``FAILED``."""
        event = anyio.Event()
        result: list[FenceStatus] = []

        def _done(status: FenceStatus) -> None:
            result.append(status)
            event.set()

        self.watch(fence, _done)
        await event.wait()
        return result[0]

    # -- wakeups -----------------------------------------------------------------------------
    def _on_wakeup(self) -> None:
        self._wake_pending = False
        if self._watches:
            self.process(self.poll())
        if self._sleep_scope is not None:
            # The polling task restarts its back-off from the shortest step.
            self._sleep_scope.cancel()

    def wakeup_threadsafe(self) -> None:
        """Make the reactor poll now; callable from any thread (backends' completion callbacks)."""
        loop = self._loop
        if loop is None or self._wake_pending or self._closed:
            return
        # A benign race: at worst two wakeups are queued, never none after a completion.
        self._wake_pending = True
        if threading.get_ident() == self._loop_thread:
            # Called from a backend method on the loop itself: no need to write the self-pipe.
            loop.call_soon(self._on_wakeup)
            return
        try:
            loop.call_soon_threadsafe(self._on_wakeup)
        except RuntimeError:
            self._wake_pending = False  # the loop is closed: nobody left to wake

    # -- the task ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Poll while fences are watched, back off, sleep when idle; until cancelled or closed."""
        if self._loop is not None:
            raise ProtocolError("reactor.run() is already running")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.backend.set_wakeup(self.wakeup_threadsafe)
        log.debug("reactor_started", backend=self.backend.name)
        pushed = bool(getattr(self.backend, "pushes_completions", False))
        first, longest = (
            (self.max_backoff, max(self.push_backoff, self.max_backoff))
            if pushed
            else (self.min_backoff, self.max_backoff)
        )
        try:
            backoff = first
            while not self._closed:
                if not self._watches:
                    self._has_work = anyio.Event()
                    await self._has_work.wait()
                    backoff = first
                    continue
                done = self.poll()
                if done:
                    self.process(done)
                    backoff = first
                    await anyio.lowlevel.checkpoint()
                    continue
                with anyio.CancelScope() as scope:
                    self._sleep_scope = scope
                    await self.clock.sleep(backoff)
                self._sleep_scope = None
                backoff = first if scope.cancel_called else min(backoff * 2, longest)
        finally:
            self.backend.set_wakeup(None)
            self._loop = None
            log.debug("reactor_stopped", watched=len(self._watches), polls=self.polls)

    def close(self) -> None:
        """Stop the task; fences still watched are abandoned (their waiters never wake)."""
        self._closed = True
        self._has_work.set()
        if self._sleep_scope is not None:
            self._sleep_scope.cancel()


__all__ = ["Reactor"]
