"""Every wait has a deadline on the injected clock (issue 20, bug 7): a drain, a flush, a wait for
progress; past it a ``DeadlineError`` names what was waited for, and nothing leaks."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

from kvflow.backends.fake import FakeBackend
from kvflow.connector.config import OffloadConfig
from kvflow.core.layout import TensorDesc
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction, TransferState
from kvflow.errors import ClosedError, ConfigError, DeadlineError
from kvflow.runtime.clock import FakeClock
from kvflow.runtime.deadline import wait_or_timeout, within
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.threaded import ThreadedSyncWorker
from kvflow.runtime.timeouts import Timeouts
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

FACADES = pytest.mark.parametrize("facade", [ThreadedSyncWorker, InlineSyncWorker])
STORE = TransferSpec(1, "a", Direction.STORE, [[2, 3]], [[0, 1]])
TURNS = 20  # loop turns a sleep of SteppingClock yields first: a flush needs two or three


class SteppingClock(FakeClock):
    """A fake clock for a loop no test can step (a sync worker's): a sleep first lets the loop's
    other tasks run a few turns, then moves time to its deadline, so a wait that nothing ends
    runs into its deadline in no real time, and one that the loop can end is not cut short."""

    async def sleep_until(self, deadline: float) -> None:
        for _ in range(TURNS):
            await anyio.lowlevel.checkpoint()
        if deadline > self.now():
            self.jump(deadline - self.now())


def _registered(fake: FakeBackend) -> FakeBackend:
    descs = {"l0": TensorDesc("l0", (2, 8, 4, 8), (256, 32, 8, 1), 2, 0x1000, "cuda:0")}
    fake.register_kv_caches(descs, 8)
    return fake


@FACADES
def test_shutdown_drain_of_a_copy_that_never_finishes_is_bounded(facade: Any) -> None:
    """The sync workers' ``shutdown(drain=True)`` with a store stuck on the device raises
    DeadlineError naming the drain after ``drain_s`` on the clock; the worker is closed, the
    backend closed, and a second shutdown is a no-op."""
    fake = _registered(FakeBackend())  # never releases a fence
    clock = SteppingClock()
    rt = facade(fake, WorkerOptions(clock=clock, timeouts=Timeouts(drain_s=5.0)))
    rt.register_kv_caches(
        {"l0": TensorDesc("l0", (2, 8, 4, 8), (256, 32, 8, 1), 2, 0x1000, "cuda:0")}, 8
    )
    rt.allocate_cpu_tier(4)
    rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
    rt.wait_for_save()
    start = clock.now()
    with pytest.raises(DeadlineError, match=r"drain at shutdown .* still waiting after 5 s"):
        rt.shutdown()
    assert clock.now() - start >= 5.0
    assert fake.closed
    assert rt.runtime.transfer_state(1) is TransferState.ABANDONED
    rt.shutdown()
    with pytest.raises(ClosedError):
        rt.get_finished()


@FACADES
def test_a_preemption_flush_that_never_finishes_is_bounded(facade: Any) -> None:
    """``handle_preemptions`` with a flush and a copy stuck on the device raises DeadlineError
    naming the flush; once the device finishes, the runtime reports the copy and shuts down."""
    fake = _registered(FakeBackend())
    rt = facade(fake, WorkerOptions(clock=SteppingClock(), timeouts=Timeouts(flush_s=2.0)))
    rt.register_kv_caches(
        {"l0": TensorDesc("l0", (2, 8, 4, 8), (256, 32, 8, 1), 2, 0x1000, "cuda:0")}, 8
    )
    rt.allocate_cpu_tier(4)
    rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
    rt.wait_for_save()
    with pytest.raises(DeadlineError, match="flush of every copy handed over"):
        rt.handle_preemptions(StepPlan(2, flush=True))
    fake.release_all()
    rt.flush()
    assert rt.build_report().completed == (1,)
    rt.shutdown()


@FACADES
@pytest.mark.parametrize("timeout", [math.inf, math.nan, -1.0])
def test_wait_for_progress_refuses_an_unbounded_timeout(facade: Any, timeout: float) -> None:
    """``wait_for_progress`` with an infinite, NaN or negative timeout raises ConfigError
    instead of waiting forever (or not at all)."""
    with facade(_registered(FakeBackend(auto_complete=True))) as rt:
        with pytest.raises(ConfigError, match="wait_for_progress timeout"):
            rt.wait_for_progress(timeout)
        assert rt.wait_for_progress(0.0) is False


@pytest.mark.asyncio
async def test_within_raises_once_the_fake_clock_passes_the_deadline() -> None:
    """``within`` returns what finished in time and raises DeadlineError naming the wait once
    the clock passed the deadline (autojump: nothing else would ever end it)."""
    clock = FakeClock()
    never = anyio.Event()
    soon = anyio.Event()
    async with clock.autojump():
        async with anyio.create_task_group() as tg:

            async def set_soon() -> None:
                await clock.sleep(1.0)
                soon.set()

            tg.start_soon(set_soon)
            await within(clock, 3.0, "the soon event", soon.wait)
        assert clock.now() == 1.0
        with pytest.raises(DeadlineError, match="the never event: still waiting after 3 s"):
            await within(clock, 3.0, "the never event", never.wait)
        assert clock.now() == 4.0
        assert await wait_or_timeout(clock, 1.0, never.wait) is False


@pytest.mark.asyncio
async def test_runtime_flush_deadline_leaves_the_runtime_usable(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """An async ``WorkerRuntime.flush`` past ``flush_s`` raises DeadlineError; the copy stays in
    flight, and once the device finishes it commits and the next flush returns at once."""
    async with (
        clock.autojump(),
        WorkerRuntime.open(fake, WorkerOptions(clock=clock, timeouts=Timeouts(flush_s=1.0))) as rt,
    ):
        rt.bind(StepPlan(1, stores=(STORE,)))
        rt.wait_for_save()
        with pytest.raises(DeadlineError, match="flush"):
            await rt.flush()
        assert rt.transfer_state(1) is TransferState.IN_FLIGHT
        fake.release_all()
        await rt.flush()
        assert rt.build_report().completed == (1,)


@pytest.mark.parametrize("value", [math.inf, math.nan, -0.5, "10"])
def test_timeouts_must_be_finite_seconds(value: object) -> None:
    """Timeouts (runtime and connector config) refuse values that would make a wait unbounded."""
    with pytest.raises(ConfigError, match="drain_s"):
        Timeouts(drain_s=value)
    with pytest.raises(ConfigError, match="flush_timeout_s"):
        OffloadConfig(cpu_bytes="1MiB", flush_timeout_s=value)
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        OffloadConfig.from_mapping({"cpu_bytes": "1MiB", "drain_timeout_s": value})
