"""FakeClock and SystemClock: time moves only when told, sleepers wake in deadline order."""

from __future__ import annotations

import anyio
import pytest

from kvflow.errors import ConfigError
from kvflow.runtime.clock import Clock, FakeClock, SystemClock, wait_all_tasks_blocked

pytestmark = pytest.mark.asyncio


async def test_jump_wakes_sleepers_in_deadline_order() -> None:
    """jump() wakes exactly the sleepers whose deadline has come, earliest first."""
    clock = FakeClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper, "late", 3.0)
        tg.start_soon(sleeper, "early", 1.0)
        tg.start_soon(sleeper, "mid", 2.0)
        await wait_all_tasks_blocked()
        assert clock.next_deadline == 1.0
        clock.jump(2.5)
        await wait_all_tasks_blocked()
        assert woke == [("early", 2.5), ("mid", 2.5)]
        clock.jump(0.5)
    assert woke[-1] == ("late", 3.0)


async def test_jump_rejects_going_backwards() -> None:
    """A clock never moves backwards."""
    clock = FakeClock()
    with pytest.raises(ConfigError):
        clock.jump(-1.0)
    assert clock.now() == 0.0


async def test_autojump_skips_to_next_deadline_when_all_blocked() -> None:
    """With autojump on, an hour of sleeping takes no real time and ends at exactly one hour."""
    clock = FakeClock()
    async with clock.autojump():
        await clock.sleep(3600.0)
        assert clock.now() == 3600.0
        await clock.sleep_until(3601.5)
    assert clock.now() == 3601.5


async def test_cancelled_sleeper_does_not_hold_autojump() -> None:
    """A sleep cancelled early leaves no deadline behind for autojump to jump to."""
    clock = FakeClock()
    with anyio.CancelScope() as scope:
        scope.cancel()
        await clock.sleep(100.0)
    assert clock.next_deadline is None
    async with clock.autojump():
        await clock.sleep(1.0)
    assert clock.now() == 1.0


async def test_sleep_in_the_past_is_a_checkpoint() -> None:
    """Sleeping until a deadline already passed returns without moving the clock."""
    clock = FakeClock()
    clock.jump(5.0)
    await clock.sleep_until(1.0)
    await clock.sleep(0.0)
    assert clock.now() == 5.0


async def test_system_clock_is_monotonic_and_a_clock() -> None:
    """SystemClock satisfies the Clock protocol and never goes backwards."""
    clock = SystemClock()
    assert isinstance(clock, Clock)
    assert isinstance(FakeClock(), Clock)
    a = clock.now()
    await clock.sleep(0)
    await clock.sleep_until(a)
    assert clock.now() >= a
