"""``InlineSyncWorker``: the runtime's loop stepped on the engine's thread, no thread of its own."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError, ConfigError
from kvflow.runtime.clock import FakeClock
from kvflow.runtime.executor import CopyOrder, DmaExecutor
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.reactor import Reactor

STORE = TransferSpec(1, "a", Direction.STORE, [[1]], [[0]])


def _opened(backend: FakeBackend | HostBackend) -> InlineSyncWorker:
    rt = InlineSyncWorker(backend)
    rt.register_kv_caches({"l0": torch.randn(2, 8, 4, 2, 8)}, 8)
    rt.allocate_cpu_tier(4)
    return rt


def test_no_thread_and_copies_submitted_within_the_call() -> None:
    """With a backend that has no threads, the facade starts none; ``wait_for_save`` returns with
    its store submitted, and the next call after the copy finished reports it, once."""
    before = threading.active_count()
    fake = FakeBackend()
    with _opened(fake) as rt:
        assert threading.active_count() == before
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        rt.start_load_kv()
        assert rt.runtime.executor.submits == 0
        rt.wait_for_save()
        assert rt.runtime.executor.submits == 1
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))
        fake.release_all()
        sending, recving, report = rt.finish_step()
        assert (sending, recving, report.completed) == ({"a"}, set(), (1,))
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))
    assert threading.active_count() == before


def test_calls_run_no_loop_turn_while_copies_are_only_in_flight() -> None:
    """A launch with nothing queued submits without a loop turn; with a copy in flight a call
    polls the fences without one, and the call after the fence finished dispatches it (still
    without a turn) and reports the store."""
    fake = FakeBackend()
    with _opened(fake) as rt:
        turns = [0]
        run = rt._loop.run_until_complete

        def counted(awaitable: Any) -> Any:
            turns[0] += 1
            return run(awaitable)

        rt._loop.run_until_complete = counted  # type: ignore[method-assign,assignment]
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        rt.wait_for_save()
        assert turns[0] == 0  # submitted on this thread: nothing was queued ahead
        assert rt.runtime.executor.submits == 1
        polls = rt.runtime.reactor.polls
        for _ in range(3):
            assert rt.finish_step() == (set(), set(), StepReport(rank=0))
        assert turns[0] == 0
        assert rt.runtime.reactor.polls == polls + 3
        fake.release_all()
        assert rt.finish_step()[0] == {"a"}
        assert turns[0] == 0
        assert rt.runtime.in_flight == 0


def test_a_bad_plan_raises_at_once_and_changes_nothing() -> None:
    """A plan listing a transfer twice raises its ConfigError from ``bind`` itself, and the
    runtime goes on with the next plan."""
    with _opened(FakeBackend(auto_complete=True)) as rt:
        with pytest.raises(ConfigError, match="twice"):
            rt.bind_connector_metadata(StepPlan(1, stores=(STORE, STORE)))
        rt.bind_connector_metadata(StepPlan(2, stores=(STORE,)))
        rt.wait_for_save()
        rt.flush()
        assert rt.build_report().completed == (1,)


def test_wait_for_progress_blocks_until_a_copy_settles() -> None:
    """``wait_for_progress`` returns False at once with nothing in flight, and True once a copy
    running on the host backend's thread has settled (the reactor polls meanwhile)."""
    with _opened(HostBackend()) as rt:
        assert rt.wait_for_progress(5.0) is False
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        rt.wait_for_save()
        assert rt.wait_for_progress(5.0) is True
        assert rt.finish_step()[0] == {"a"}


def test_preemption_flush_waits_for_the_copies() -> None:
    """``handle_preemptions`` with a flush returns only once every copy handed over finished."""
    fake = FakeBackend(auto_complete=True)
    with _opened(fake) as rt:
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        rt.wait_for_save()
        with capture_logs() as logs:
            rt.handle_preemptions(StepPlan(2, flush=True))
        assert any(e["event"] == "preemption_flush" for e in logs)
        assert rt.runtime.in_flight == 0
        assert rt.finish_step()[0] == {"a"}


def test_shut_down_runtime_refuses_calls() -> None:
    """After ``shutdown`` every call raises ClosedError; shutting down again is a no-op."""
    rt = _opened(FakeBackend())
    rt.shutdown()
    rt.shutdown()
    with pytest.raises(ClosedError):
        rt.bind_connector_metadata(StepPlan(1))
    with pytest.raises(ClosedError):
        rt.finish_step()


@pytest.mark.asyncio
async def test_built_and_stepped_from_async_code() -> None:
    """Built, stepped and shut down from a thread that runs an event loop of its own (async
    code), the facade steps its own loop on a helper thread instead of failing."""
    fake = FakeBackend()
    with _opened(fake) as rt:
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        rt.wait_for_save()
        fake.release_all()
        await anyio.sleep(0)
        assert rt.finish_step()[0] == {"a"}


def test_submit_now_only_with_nothing_queued_ahead() -> None:
    """``DmaExecutor.submit_now`` submits at once while the inbox is empty, and refuses (state
    unchanged) while an order is queued ahead of it or once the executor is closed."""
    fake = FakeBackend()
    fake.register_kv_caches({"l0": torch.randn(2, 8, 4, 2, 8)}, 8)
    fake.allocate_cpu_tier([4])
    done: list[tuple[int, ...]] = []
    executor = DmaExecutor(
        fake,
        Reactor(fake, FakeClock()),
        lambda specs, status, cause, landed: done.append(tuple(s.transfer_id for s in specs)),
    )
    order = CopyOrder(1, Direction.STORE, (STORE,))
    assert executor.can_submit_now
    executor.submit_now(order)
    assert (executor.submits, executor.outstanding) == (1, 1)
    executor.enqueue(order)
    assert not executor.can_submit_now
    with pytest.raises(ClosedError, match="overtake"):
        executor.submit_now(order)
    assert executor.submits == 1
    executor.close()
    assert not executor.can_submit_now


class _RefusingBackend(FakeBackend):
    def submit(self, batch: Any, wait_for: Any = ()) -> Any:
        raise RuntimeError("device gone")


def test_a_refused_submit_at_launch_fails_its_transfers_not_the_call() -> None:
    """A store submitted at launch that the backend refuses is launched, then failed at once
    (logged ``copy_submit_failed``): the engine's call returns and the next report says so."""
    with _opened(_RefusingBackend()) as rt:
        rt.bind_connector_metadata(StepPlan(1, stores=(STORE,)))
        with capture_logs() as logs:
            rt.wait_for_save()
        assert any(e["event"] == "copy_submit_failed" for e in logs)
        sending, _, report = rt.finish_step()
        assert (sending, report.failed, report.completed) == ({"a"}, (1,), ())
        assert rt.runtime.in_flight == 0
