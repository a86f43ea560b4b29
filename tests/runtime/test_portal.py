"""The synchronous facade: a synchronous engine loop drives the runtime through vLLM-named calls."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvflow.backends.host import HostBackend
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError, ConfigError
from kvflow.runtime.portal import SyncWorkerRuntime


def test_sync_facade_round_trip_and_load_errors() -> None:
    """Store, evict, load through the facade: bytes match, a bad load's blocks are reported."""
    caches = {f"l{i}": torch.randn(2, 8, 4, 2, 8) for i in range(2)}
    with SyncWorkerRuntime(HostBackend(), rank=1) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(
            StepPlan(1, stores=(TransferSpec(1, "a", Direction.STORE, [[1, 2]], [[0, 3]]),))
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.flush()
        assert rt.get_finished() == ({"a"}, set())
        assert rt.build_report().completed == (1,)
        before = {n: t[:, 1:3].clone() for n, t in caches.items()}
        for t in caches.values():
            t.zero_()
        rt.bind_connector_metadata(
            StepPlan(
                2,
                loads=(
                    TransferSpec(2, "a", Direction.LOAD, [[5, 6]], [[0, 3]]),
                    TransferSpec(3, "b", Direction.LOAD, [[7]], [[4]]),
                ),
            )
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.handle_preemptions(StepPlan(3, flush=True))
        _, recving = rt.get_finished()
        assert recving == {"a", "b"}
        report = rt.build_report()
        assert report.rank == 1
        # Coalesced: the bad block id fails the whole batch, so both loads are recomputed.
        assert sorted(report.failed) == [2, 3]
        assert rt.get_block_ids_with_load_errors() == {5, 6, 7}
        assert rt.get_block_ids_with_load_errors() == set()
        rt.bind_connector_metadata(
            StepPlan(4, loads=(TransferSpec(4, "a", Direction.LOAD, [[5, 6]], [[0, 3]]),))
        )
        rt.start_load_kv()
        rt.flush()
        assert rt.build_report().completed == (4,)
        for n, t in caches.items():
            assert torch.equal(t[:, 5:7], before[n])
    with pytest.raises(ClosedError):
        rt.get_finished()
    rt.shutdown()


def test_finish_step_returns_finished_requests_and_report_in_one_call() -> None:
    """``finish_step`` gives the finished requests and the report together, and a failed load's
    blocks reach ``get_block_ids_with_load_errors`` in the same step."""
    caches = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with SyncWorkerRuntime(HostBackend()) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(
            StepPlan(
                1,
                stores=(TransferSpec(1, "a", Direction.STORE, [[1]], [[0]]),),
                loads=(TransferSpec(2, "b", Direction.LOAD, [[2]], [[9]]),),
            )
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.flush()
        sending, recving, report = rt.finish_step()
        assert (sending, recving) == ({"a"}, {"b"})
        assert report.completed == (1,)
        assert report.failed == (2,)
        assert rt.get_block_ids_with_load_errors() == {2}
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))


def test_a_step_wakes_the_loop_only_for_work_and_keeps_posted_calls_in_order() -> None:
    """Posting a plan without copies wakes the runtime's loop not at all (the calls run, in
    order, with the step's blocking call); loads wake it at ``start_load_kv`` and stores at
    ``wait_for_save``."""
    caches = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with SyncWorkerRuntime(HostBackend()) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        loop = rt._loop
        real = loop.call_soon_threadsafe
        main = threading.get_ident()
        wakes: list[str] = []

        def counting(callback: Any, *args: Any) -> Any:
            if threading.get_ident() == main:
                wakes.append(getattr(callback, "__name__", "?"))
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign, assignment]
        try:
            rt.bind_connector_metadata(StepPlan(1))
            rt.start_load_kv()
            rt.wait_for_save()
            assert wakes == []
            assert rt.finish_step() == (set(), set(), StepReport(rank=0))
            assert wakes == ["run"]  # the blocking call carried the three posted ones
            store = TransferSpec(1, "a", Direction.STORE, [[1]], [[0]])
            rt.bind_connector_metadata(StepPlan(2, stores=(store,)))
            rt.start_load_kv()
            assert wakes == ["run"]
            rt.wait_for_save()
            assert wakes == ["run", "_run_posted"]
            rt.flush()
            load = TransferSpec(2, "a", Direction.LOAD, [[2]], [[0]])
            rt.bind_connector_metadata(StepPlan(3, loads=(load,)))
            rt.start_load_kv()
            assert wakes[-1] == "_run_posted"
            rt.wait_for_save()
            rt.flush()
            sending, recving, report = rt.finish_step()
            assert (sending, recving) == ({"a"}, {"a"})
            assert sorted(report.completed) == [1, 2]
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        assert torch.equal(caches["l0"][:, 2], caches["l0"][:, 1])


def test_posted_call_error_is_raised_by_the_next_call() -> None:
    """A bad plan bound without waiting raises its ConfigError at the next facade call, once."""
    with SyncWorkerRuntime(HostBackend()) as rt:
        rt.register_kv_caches({"kv": torch.zeros(4, 16)}, 4)
        rt.allocate_cpu_tier(4)
        twice = TransferSpec(1, "a", Direction.STORE, [[0]], [[0]])
        rt.bind_connector_metadata(StepPlan(1, stores=(twice, twice)))
        with pytest.raises(ConfigError, match="twice"):
            rt.get_finished()
        assert rt.get_finished() == (set(), set())
