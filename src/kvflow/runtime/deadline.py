"""Deadlines on the injected clock: every wait of the worker runtime is bounded.

``within(clock, seconds, what, wait)`` awaits ``wait()`` and raises ``DeadlineError`` naming
``what`` once ``seconds`` have passed on ``clock`` (a ``FakeClock`` in tests: the deadline passes
when the test jumps it, or when autojump finds everything blocked). The runtime's configurable
bounds are ``kvflow.runtime.timeouts.Timeouts``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from kvflow.errors import DeadlineError
from kvflow.runtime.clock import Clock

T = TypeVar("T")


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


__all__ = ["wait_or_timeout", "within"]
