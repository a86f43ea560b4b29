"""Shared pieces of the fenced-load tests (whole and in parts) on the synchronous facades."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.threaded import ThreadedSyncWorker

FACADES = pytest.mark.parametrize("facade", [ThreadedSyncWorker, InlineSyncWorker])


def load_spec(tid: int, gpu: list[int], cpu: list[int]) -> TransferSpec:
    """Load transfer ``tid`` of request ``r{tid}``, one group."""
    return TransferSpec(tid, f"r{tid}", Direction.LOAD, [gpu], [cpu])


def stored(rt: Any, caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store GPU blocks 1, 2 into CPU blocks 0, 3 (step 1) and zero the caches; returns the
    stored blocks' bytes per tensor."""
    rt.bind_connector_metadata(
        StepPlan(1, stores=(TransferSpec(1, "a", Direction.STORE, [[1, 2]], [[0, 3]]),))
    )
    rt.start_load_kv()
    rt.wait_for_save()
    rt.flush()
    rt.get_finished()
    want = {n: t[:, 1:3].clone() for n, t in caches.items()}
    for t in caches.values():
        t.zero_()
    return want
