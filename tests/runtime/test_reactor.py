"""The reactor: fences become awaitables; it polls only while something is watched, backs off,
and a backend's wakeup makes it see a completion at once."""

from __future__ import annotations

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from kvflow.backends.base import CopyBatch, FenceStatus
from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError, ConfigError
from kvflow.runtime.clock import FakeClock, SystemClock, wait_all_tasks_blocked
from kvflow.runtime.reactor import Reactor

pytestmark = pytest.mark.asyncio

STORE_0_TO_0 = CopyBatch(Direction.STORE, ((0,),), ((0,),))


async def test_wait_returns_done_and_failed(fake: FakeBackend, clock: FakeClock) -> None:
    """wait() returns each fence's final status once the backend finishes it."""
    reactor = Reactor(fake, clock)
    ok, bad = fake.submit(STORE_0_TO_0), fake.submit(STORE_0_TO_0)
    results: dict[str, FenceStatus] = {}

    async def waiter(name: str, fence: object) -> None:
        results[name] = await reactor.wait(fence)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        tg.start_soon(waiter, "ok", ok)
        tg.start_soon(waiter, "bad", bad)
        await wait_all_tasks_blocked()
        assert results == {}
        fake.fail(bad)
        await wait_all_tasks_blocked()
        assert results == {"bad": FenceStatus.FAILED}
        fake.release(ok)
        await wait_all_tasks_blocked()
        assert results == {"bad": FenceStatus.FAILED, "ok": FenceStatus.DONE}
        assert reactor.in_flight == 0
        reactor.close()


async def test_idle_reactor_never_polls(fake: FakeBackend, clock: FakeClock) -> None:
    """With nothing watched the reactor sleeps on an event: a day passes without one query."""
    reactor = Reactor(fake, clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        await wait_all_tasks_blocked()
        clock.jump(86400.0)
        await wait_all_tasks_blocked()
        assert reactor.polls == 0
        assert fake.queries == 0
        reactor.close()


async def test_polling_backs_off_to_the_cap(fake: FakeBackend, clock: FakeClock) -> None:
    """While a fence is pending the interval doubles from min to max back-off, then stays."""
    reactor = Reactor(fake, clock, min_backoff=1e-3, max_backoff=8e-3)
    fence = fake.submit(STORE_0_TO_0)
    fake.release_at(fence, 0.1)
    seen: list[float] = []
    done = anyio.Event()

    async def waiter() -> None:
        assert await reactor.wait(fence) is FenceStatus.DONE
        seen.append(clock.now())
        done.set()

    async with clock.autojump(), anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        tg.start_soon(waiter)
        await done.wait()
        reactor.close()
    # Sleeps of 1, 2, 4 ms then 8 ms each: found at the first poll at or after 100 ms.
    assert 0.1 <= seen[0] < 0.1 + 8e-3
    assert reactor.polls == 4 + 12  # at 0, 1, 3, 7 ms, then every 8 ms from 15 to 103 ms


async def test_a_backend_that_pushes_completions_is_polled_only_as_a_safety_net(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """With ``pushes_completions`` the timed polls start at the max back-off and grow to the push
    back-off, and a wakeup still makes the reactor see the completion at once."""
    fake.pushes_completions = True
    reactor = Reactor(fake, clock, min_backoff=1e-3, max_backoff=8e-3, push_backoff=32e-3)
    fence = fake.submit(STORE_0_TO_0)
    seen: list[float] = []

    async def waiter() -> None:
        assert await reactor.wait(fence) is FenceStatus.DONE
        seen.append(clock.now())

    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        tg.start_soon(waiter)
        await wait_all_tasks_blocked()
        for _ in range(30):  # 100 ms of simulated time, in 3.33 ms steps
            clock.jump(0.1 / 30)
            await wait_all_tasks_blocked()
        assert reactor.polls == 5  # at 0, 8, 24, 56 and 88 ms: 8, 16, then 32 ms apart
        fake.release(fence)  # the fake backend calls the wakeup, as a waiter thread would
        await wait_all_tasks_blocked()
        assert seen == [pytest.approx(0.1)]
        reactor.close()


async def test_many_waiters_on_one_fence_query_it_once(fake: FakeBackend, clock: FakeClock) -> None:
    """However many tasks wait on a fence, each poll queries it once and wakes them all."""
    reactor = Reactor(fake, clock)
    fence = fake.submit(STORE_0_TO_0)
    woke: list[int] = []

    async def waiter(i: int) -> None:
        await reactor.wait(fence)
        woke.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        for i in range(5):
            tg.start_soon(waiter, i)
        await wait_all_tasks_blocked()
        polls, queries = reactor.polls, fake.queries
        assert queries == polls
        fake.release(fence)
        await wait_all_tasks_blocked()
        assert sorted(woke) == list(range(5))
        reactor.close()


async def test_wakeup_from_another_thread_is_seen_at_once() -> None:
    """The host backend's copy thread wakes the reactor: done well before a 1-hour back-off."""
    backend = HostBackend()
    backend.register_kv_caches({"kv": torch.ones(4, 16)}, 4)
    backend.allocate_cpu_tier([4])
    reactor = Reactor(backend, SystemClock(), min_backoff=3600.0, max_backoff=3600.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        await wait_all_tasks_blocked()
        with anyio.fail_after(10):
            status = await reactor.wait(backend.submit(STORE_0_TO_0))
        assert status is FenceStatus.DONE
        assert backend.cpu_tier(0)[0].view(torch.float32).tolist() == [1.0] * 16
        reactor.close()
    backend.close()


async def test_bad_backoff_and_closed_reactor_raise(fake: FakeBackend, clock: FakeClock) -> None:
    """A back-off range with min > max is refused; a closed reactor refuses new watches."""
    with pytest.raises(ConfigError):
        Reactor(fake, clock, min_backoff=1.0, max_backoff=0.5)
    reactor = Reactor(fake, clock)
    reactor.close()
    with pytest.raises(ClosedError):
        reactor.watch(fake.submit(STORE_0_TO_0), lambda status: None)


async def test_a_failing_waiter_does_not_strand_the_others(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """A waiter callback that raises is logged; the other waiters still get their status."""
    reactor = Reactor(fake, clock)
    fence = fake.submit(STORE_0_TO_0)
    got: list[FenceStatus] = []

    def broken(status: FenceStatus) -> None:
        raise RuntimeError("bug in a waiter")

    reactor.watch(fence, broken)
    reactor.watch(fence, got.append)
    fake.release(fence)
    with capture_logs() as logs:
        reactor.process(reactor.poll())
    assert got == [FenceStatus.DONE]
    assert [e["event"] for e in logs] == ["reactor_waiter_failed"]
