"""The synchronous facades: a synchronous engine loop drives the runtime through vLLM-named calls,
with the runtime's loop on a thread of its own (``ThreadedSyncWorker``) or stepped on the engine's
thread (``InlineSyncWorker``: its own behaviour is in ``test_inline.py``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvflow.backends.base import CopyBatch, Fence
from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend, HostFence
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError, ProtocolError
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.threaded import ThreadedSyncWorker
from kvflow.runtime.worker import WorkerOptions

FACADES = pytest.mark.parametrize("facade", [ThreadedSyncWorker, InlineSyncWorker])


class _RefusesBlock7(HostBackend):
    """The host backend, but a load into GPU block 7 is refused by the device."""

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        if batch.direction is Direction.LOAD and 7 in batch.gpu_block_ids[0]:
            raise BackendError("injected: GPU block 7 is unreachable")
        return super().submit(batch, wait_for)


@FACADES
def test_sync_facade_round_trip_and_load_errors(facade: Any) -> None:
    """Store, evict, load through the facade: bytes match, a failed load's blocks are reported,
    a plan naming a CPU block out of range is refused whole at bind."""
    caches = {f"l{i}": torch.randn(2, 8, 4, 2, 8) for i in range(2)}
    with facade(_RefusesBlock7(), WorkerOptions(rank=1)) as rt:
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
        with pytest.raises(ConfigError, match=r"CPU block id 4 out of range 0\.\.3"):
            rt.bind_connector_metadata(
                StepPlan(2, loads=(TransferSpec(2, "a", Direction.LOAD, [[5]], [[4]]),))
            )
        rt.bind_connector_metadata(
            StepPlan(
                2,
                loads=(
                    TransferSpec(2, "a", Direction.LOAD, [[5, 6]], [[0, 3]]),
                    TransferSpec(3, "b", Direction.LOAD, [[7]], [[2]]),
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


@FACADES
def test_finish_step_returns_finished_requests_and_report_in_one_call(facade: Any) -> None:
    """``finish_step`` gives the finished requests and the report together, and a failed load's
    blocks reach ``get_block_ids_with_load_errors`` in the same step."""
    caches = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with facade(_RefusesBlock7()) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(
            StepPlan(
                1,
                stores=(TransferSpec(1, "a", Direction.STORE, [[1]], [[0]]),),
                loads=(TransferSpec(2, "b", Direction.LOAD, [[7]], [[2]]),),
            )
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.flush()
        sending, recving, report = rt.finish_step()
        assert (sending, recving) == ({"a"}, {"b"})
        assert report.completed == (1,)
        assert report.failed == (2,)
        assert rt.get_block_ids_with_load_errors() == {7}
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))


def test_a_step_wakes_the_loop_only_for_work_and_keeps_posted_calls_in_order() -> None:
    """A step without copies never wakes the runtime's loop (``finish_step`` needs no round
    trip); loads wake it at ``start_load_kv``, stores at ``wait_for_save``, and the calls queued
    meanwhile run first, in order. Steps without copies run their queued binds now and then."""
    caches = {"l0": torch.randn(2, 8, 4, 2, 8)}
    with ThreadedSyncWorker(HostBackend()) as rt:
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
            assert rt.finish_step() == (set(), set(), StepReport(rank=0))
            assert wakes == []
            store = TransferSpec(1, "a", Direction.STORE, [[1]], [[0]])
            rt.bind_connector_metadata(StepPlan(2, stores=(store,)))
            rt.start_load_kv()
            assert wakes == []
            rt.wait_for_save()
            assert wakes == ["_run_posted"]  # binds 1 and 2, then the store, in order
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
            before = len(wakes)
            for step in range(4, 4 + 40):
                rt.bind_connector_metadata(StepPlan(step))
                rt.start_load_kv()
                rt.wait_for_save()
                rt.finish_step()
            assert 1 <= len(wakes) - before <= 3  # a wake-up per 16 queued binds
        finally:
            loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        assert torch.equal(caches["l0"][:, 2], caches["l0"][:, 1])


def test_finish_step_reports_a_copy_once_the_loop_has_seen_it_settle() -> None:
    """Without a round trip, ``finish_step`` reports what has settled so far: a copy still in
    flight is not in it, and once it settled it is reported by one later call, exactly once."""
    fake = FakeBackend()
    with ThreadedSyncWorker(fake) as rt:
        rt.register_kv_caches({"l0": torch.randn(2, 8, 4, 2, 8)}, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(
            StepPlan(1, stores=(TransferSpec(1, "a", Direction.STORE, [[1]], [[0]]),))
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.portal.call(lambda: None)  # the posted store has been submitted
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))
        rt.portal.call(fake.release_all)  # on the loop's thread, where the backend lives
        rt.flush()
        sending, recving, report = rt.finish_step()
        assert (sending, recving, report.completed) == ({"a"}, set(), (1,))
        assert rt.finish_step() == (set(), set(), StepReport(rank=0))


def test_posted_call_error_is_raised_by_the_next_call() -> None:
    """A plan the runtime refuses on the loop (bound while the last one's stores were never
    launched), posted without waiting, raises its ProtocolError at the next call, once."""
    with ThreadedSyncWorker(HostBackend()) as rt:
        rt.register_kv_caches({"kv": torch.zeros(4, 16)}, 4)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(
            StepPlan(1, stores=(TransferSpec(1, "a", Direction.STORE, [[0]], [[0]]),))
        )
        rt.bind_connector_metadata(
            StepPlan(2, stores=(TransferSpec(2, "a", Direction.STORE, [[1]], [[1]]),))
        )
        with pytest.raises(ProtocolError, match="unlaunched"):
            rt.get_finished()
        assert rt.get_finished() == (set(), set())


class _Recording(HostBackend):
    """The host backend, noting every batch submitted to it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[CopyBatch] = []

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        self.batches.append(batch)
        return super().submit(batch, wait_for)


@FACADES
def test_the_facades_batches_are_marked_checked_by_the_plan_gate(facade: Any) -> None:
    """A plan bound through a sync facade (checked whole by its ``PlanGate``) reaches the
    backend as batches marked ``checked``, one and several transfers alike; a plan the gate
    refuses submits nothing."""
    backend = _Recording()
    with facade(backend, WorkerOptions()) as rt:
        rt.register_kv_caches({"l0": torch.randn(2, 8, 4, 2, 8)}, 8)
        rt.allocate_cpu_tier(4)
        with pytest.raises(ConfigError, match="GPU block id 9 out of range"):
            rt.bind_connector_metadata(
                StepPlan(1, stores=(TransferSpec(1, "a", Direction.STORE, [[9]], [[0]]),))
            )
        rt.bind_connector_metadata(
            StepPlan(
                2,
                stores=(
                    TransferSpec(2, "a", Direction.STORE, [[1, 2]], [[0, 1]]),
                    TransferSpec(3, "b", Direction.STORE, [[3]], [[2]]),
                ),
            )
        )
        rt.start_load_kv()
        rt.wait_for_save()
        rt.flush()
        rt.bind_connector_metadata(
            StepPlan(3, loads=(TransferSpec(4, "a", Direction.LOAD, [[5]], [[0]]),))
        )
        rt.start_load_kv()
        rt.flush()
    assert [(b.gpu_block_ids, b.checked) for b in backend.batches] == [
        (((1, 2, 3),), True),
        (((5,),), True),
    ]
