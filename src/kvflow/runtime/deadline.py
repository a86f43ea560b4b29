"""Deadlines on the injected clock: every wait of the worker runtime is bounded.

``within(clock, seconds, what, wait)`` awaits ``wait()`` and raises ``DeadlineError`` naming
``what`` once ``seconds`` have passed on ``clock`` (a ``FakeClock`` in tests: the deadline passes
when the test jumps it, or when autojump finds everything blocked). ``Timeouts`` holds the
runtime's configurable bounds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from attrs import field, frozen

from kvflow.core.validate import timeout_s
from kvflow.errors import DeadlineError
from kvflow.runtime.clock import Clock

T = TypeVar("T")

DRAIN_TIMEOUT_S = 60.0
"""Default bound on a drain at shutdown: every queued copy submitted and finished."""
FLUSH_TIMEOUT_S = 60.0
"""Default bound on a flush (a preemption waits for every copy handed over)."""


def _drain(value: object) -> float:
    return timeout_s("drain_s", value)


def _flush(value: object) -> float:
    return timeout_s("flush_s", value)


@frozen
class Timeouts:
    """Bounds, in seconds on the runtime's clock, of the waits a worker runtime makes."""

    drain_s: float = field(default=DRAIN_TIMEOUT_S, converter=_drain)
    flush_s: float = field(default=FLUSH_TIMEOUT_S, converter=_flush)


async def wait_or_timeout(clock: Clock, seconds: float, wait: Callable[[], Awaitable[T]]) -> bool:
    """Await ``wait()`` for at most ``seconds`` on ``clock``; return whether it finished. An
    error ``wait()`` raises is raised as is (not wrapped in an exception group)."""
    done = False
    error: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            nonlocal done
            try:
                await wait()
                done = True
            except Exception as exc:
                error.append(exc)
            tg.cancel_scope.cancel()

        async def alarm() -> None:
            await clock.sleep(seconds)
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(alarm)
    if error:
        raise error[0]
    return done


async def within(clock: Clock, seconds: float, what: str, wait: Callable[[], Awaitable[T]]) -> None:
    """Await ``wait()``; raise ``DeadlineError`` naming ``what`` after ``seconds`` on ``clock``."""
    if not await wait_or_timeout(clock, seconds, wait):
        raise DeadlineError(f"{what}: still waiting after {seconds:g} s")


__all__ = ["DRAIN_TIMEOUT_S", "FLUSH_TIMEOUT_S", "Timeouts", "wait_or_timeout", "within"]
