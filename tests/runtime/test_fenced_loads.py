"""Fenced loads through the synchronous facades: ``start_load_kv`` returns with the engine's
compute held behind the step's fenced loads (on the host backend, the data is there)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from tests.runtime.fenced_helpers import FACADES, load_spec, stored

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend, HostFence
from kvflow.core.protocol import StepPlan
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, DeadlineError
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.timeouts import Timeouts
from kvflow.runtime.worker import WorkerOptions


@FACADES
def test_fenced_load_has_landed_when_start_load_kv_returns(facade: Any) -> None:
    """On the host backend a fenced load's bytes are in the engine's caches as soon as
    ``start_load_kv`` returns, with no flush or poll in between."""
    caches = {f"l{i}": torch.randn(2, 8, 4, 2, 8) for i in range(2)}
    with facade(HostBackend(), WorkerOptions()) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        want = stored(rt, caches)
        rt.bind_connector_metadata(
            StepPlan(2, loads=(load_spec(2, [5, 6], [0, 3]),), fenced_loads=(2,))
        )
        rt.start_load_kv()
        for n, t in caches.items():
            assert torch.equal(t[:, 5:7], want[n])
        rt.wait_for_save()
        _, recving = rt.get_finished()
        assert recving == {"r2"}, "the worker reports it; the manager keeps it from the engine"


@FACADES
def test_compute_waits_for_the_fenced_loads_batch_only(facade: Any) -> None:
    """The backend is asked to hold the compute behind the batch of the fenced loads, once; a
    step without fenced loads asks nothing."""
    backend = FakeBackend(auto_complete=True)
    caches = {"l0": torch.zeros(2, 8, 4, 2, 8)}
    with facade(backend, WorkerOptions()) as rt:
        rt.register_kv_caches(caches, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(StepPlan(1, loads=(load_spec(1, [1], [0]),)))
        rt.start_load_kv()
        rt.wait_for_save()
        rt.get_finished()
        assert backend.compute_waits == []
        plan = StepPlan(
            2, loads=(load_spec(2, [2], [1]), load_spec(3, [3], [2])), fenced_loads=(2, 3)
        )
        rt.bind_connector_metadata(plan)
        rt.start_load_kv()
        (waited,) = backend.compute_waits
        assert waited is backend.submitted[-1]
        assert waited.batch is not None
        assert waited.batch.gpu_block_ids == ((2, 3),)
        rt.wait_for_save()
        rt.get_finished()


@FACADES
def test_a_plan_fencing_a_transfer_it_does_not_load_is_refused(facade: Any) -> None:
    """``fenced_loads`` naming a transfer that is not one of the plan's loads raises a
    ConfigError at bind, and the next plan binds as if it never came."""
    with facade(FakeBackend(auto_complete=True), WorkerOptions()) as rt:
        rt.register_kv_caches({"l0": torch.zeros(2, 8, 4, 2, 8)}, 8)
        rt.allocate_cpu_tier(4)
        with pytest.raises(ConfigError, match=r"step 1: fenced loads \[9\] are not its loads"):
            rt.bind_connector_metadata(
                StepPlan(1, loads=(load_spec(1, [1], [0]),), fenced_loads=(1, 9))
            )
        rt.bind_connector_metadata(StepPlan(1, loads=(load_spec(1, [1], [0]),), fenced_loads=(1,)))
        rt.start_load_kv()
        rt.wait_for_save()
        rt.get_finished()


class _NeverLands(HostBackend):
    """The host backend, but a load's copies do not run until the test fails them."""

    stuck: ClassVar[list[HostFence]] = []

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        if batch.direction is Direction.LOAD:
            self.stuck.append(HostFence(10_000))
            return self.stuck[-1]
        return super().submit(batch, wait_for)


def test_a_fenced_load_that_never_lands_is_a_deadline_error() -> None:
    """The engine's wait for a fenced load is bounded by ``Timeouts.load_s``: past it,
    ``DeadlineError`` names what was waited for."""
    options = WorkerOptions(timeouts=Timeouts(load_s=0.0))
    with InlineSyncWorker(_NeverLands(), options) as rt:
        rt.register_kv_caches({"l0": torch.zeros(2, 8, 4, 2, 8)}, 8)
        rt.allocate_cpu_tier(4)
        rt.bind_connector_metadata(StepPlan(1, loads=(load_spec(1, [1], [0]),), fenced_loads=(1,)))
        with pytest.raises(DeadlineError, match=r"fenced load's copies not done after 0\.0 s"):
            rt.start_load_kv()
        for fence in _NeverLands.stuck:
            fence.status = FenceStatus.FAILED
            fence.finished.set()
