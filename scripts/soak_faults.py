"""The soak's fault injectors and its tally: ``FaultyHost`` (the host backend with copies that
fail, run slow or report late, and the copy-level guarantees checked), ``LateRank`` (a simulated
second tensor-parallel rank that reports late and sometimes fails a copy), ``Tally`` (what the
soak did and every violation it saw). Used by ``scripts/soak.py``.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from attrs import define, field

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.host import HostBackend, HostFence
from kvflow.connector.api import KVConnectorOutput
from kvflow.connector.offload import OffloadScheduler
from kvflow.core.layout import LayerParts
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport
from kvflow.core.requests import (
    RequestLike,
    SchedulerOutput,
)
from kvflow.core.transfer import Direction


@define
class Tally:
    """What the soak did, and every violation it saw (appended from the copy thread too)."""

    rounds: int = 0
    requests: int = 0
    steps: int = 0
    outputs_checked: int = 0
    transfers: Counter[str] = field(factory=Counter)
    faults: Counter[str] = field(factory=Counter)
    rejected: Counter[str] = field(factory=Counter)
    checks: Counter[str] = field(factory=Counter)
    segments: Counter[str] = field(factory=Counter)  # rounds per (policy, worker loop, ranks)
    violations: list[str] = field(factory=list)
    near_ties: list[str] = field(factory=list)  # outputs that differ only at a float near tie

    segment: str = ""  # the segment running: named in its violations

    def violation(self, what: str) -> None:
        self.violations.append(f"[{self.segment}] {what}" if self.segment else what)


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).digest()


@define(eq=False)
class FaultyHost(HostBackend):
    """The host backend with faults injected and the copy-level guarantees checked."""

    rng: random.Random = field(factory=random.Random)
    tally: Tally = field(factory=Tally)
    p_fail: float = 0.0
    p_fail_load: float = 0.0
    p_slow: float = 0.0
    lazy: bool = False
    corrupt: bool = False  # sabotage: the soak's own check that its checks catch a bad copy
    p_late: float = 0.0
    cpu_refs: Callable[[int, int], int] | None = None  # (group, CPU block) → ref count
    gpu_held: Callable[[int], bool] | None = None  # GPU block → held by a request or a copy
    _late: dict[int, int] = field(factory=dict)  # fence id → queries still answered PENDING
    _slow: set[int] = field(factory=set)  # id(batch) of batches to slow down
    _cpu_digest: dict[tuple[int, int], bytes] = field(factory=dict)  # copy thread only
    _last_store: dict[tuple[int, int], HostFence] = field(factory=dict)  # (group, GPU block)
    _store_of: dict[int, tuple[HostFence, ...]] = field(factory=dict)  # id(batch) → stores
    _lock: threading.Lock = field(factory=threading.Lock)
    _failed: int = 0

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        return self._faulty_submit(batch, wait_for, None)[0]

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[HostFence, tuple[HostFence, ...]]:
        self.tally.checks["loads_in_parts"] += 1
        return self._faulty_submit(batch, wait_for, parts)

    def _faulty_submit(
        self, batch: CopyBatch, wait_for: Sequence[Fence], parts: LayerParts | None
    ) -> tuple[HostFence, tuple[HostFence, ...]]:
        self._check_refs(batch, "submit")
        # A load (and a lazy store) holds a reference on its GPU blocks; an eager store may read
        # blocks a preempted request just gave back: the plan's flush waits for it before the
        # engine writes them, and the reload and output checks catch a copy that raced.
        if self.gpu_held is not None and (batch.direction is Direction.LOAD or self.lazy):
            for g, ids in enumerate(batch.gpu_block_ids):
                for b in ids:
                    if not self.gpu_held(b):
                        self.tally.violation(f"copy submitted on free GPU block {g}/{b}")
        p_fail = self.p_fail_load if batch.direction is Direction.LOAD else self.p_fail
        if self.rng.random() < p_fail:
            failed = self._fail(batch)
            return failed, () if parts is None else (failed,) * parts.count
        if self.rng.random() < self.p_slow:
            self.tally.faults["copy_slowed"] += 1
            self._slow.add(id(batch))
        with self._lock:
            if batch.direction is Direction.LOAD:
                self._store_of[id(batch)] = tuple(
                    f
                    for g, ids in enumerate(batch.gpu_block_ids)
                    for b in ids
                    if (f := self._last_store.get((g, b))) is not None
                )
        part_fences: tuple[HostFence, ...] = ()
        if parts is None:
            fence = super().submit(batch, wait_for)
        else:
            fence, part_fences = super().submit_parts(batch, parts, wait_for)
        if batch.direction is Direction.STORE:
            with self._lock:
                for g, ids in enumerate(batch.gpu_block_ids):
                    for b in ids:
                        self._last_store[(g, b)] = fence
        if self.rng.random() < self.p_late:
            self.tally.faults["completion_reported_late"] += 1
            self._late[fence.fence_id] = self.rng.randint(1, 4)
        return fence, part_fences

    def _fail(self, batch: CopyBatch) -> HostFence:
        self._failed += 1
        self.tally.faults[f"{batch.direction.value}_failed_on_device"] += 1
        if batch.direction is Direction.LOAD:
            # What a failed load leaves behind: garbage the engine must recompute over.
            for g, ids in enumerate(batch.gpu_block_ids):
                for rc in self._regions[g]:
                    rc.view[list(ids)] = torch.randint(
                        0, 255, (len(ids), rc.page_bytes), dtype=torch.uint8
                    )
        fence = HostFence(-self._failed, FenceStatus.FAILED, error="injected copy failure")
        fence.finished.set()
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        if isinstance(fence, HostFence) and fence.fence_id < 0:
            return fence.status
        status = super().query(fence)
        if status is not FenceStatus.PENDING and isinstance(fence, HostFence):
            left = self._late.get(fence.fence_id, 0)
            if left:
                self._late[fence.fence_id] = left - 1
                return FenceStatus.PENDING
            self._late.pop(fence.fence_id, None)
        return status

    # -- on the copy thread -------------------------------------------------------------------
    def _check_refs(self, batch: CopyBatch, when: str) -> None:
        if self.cpu_refs is None:
            return
        for g, ids in enumerate(batch.cpu_block_ids):
            for b in ids:
                if self.cpu_refs(g, b) < 1:
                    self.tally.violation(f"{when}: CPU block {g}/{b} unreferenced under a copy")

    def _copy(self, batch: CopyBatch, spans: Sequence[tuple[int, int]] | None = None) -> None:
        self._check_refs(batch, "copy")
        first = spans is None or all(lo == 0 for lo, _ in spans)
        if spans is not None and not first and self.rng.random() < self.p_fail_load:
            # A part after the first fails on the device, the earlier ones landed: garbage
            # in its layers, and the batch fails.
            self.tally.faults["load_part_failed_on_device"] += 1
            for g, ids in enumerate(batch.gpu_block_ids):
                lo, hi = spans[g]
                for rc in self._regions[g][lo:hi]:
                    rc.view[list(ids)] = torch.randint(
                        0, 255, (len(ids), rc.page_bytes), dtype=torch.uint8
                    )
            raise RuntimeError("injected failure of a load's part")
        if id(batch) in self._slow and first:
            self._slow.discard(id(batch))
            # A slow device, simulated on the device's own thread (the copy thread).
            time.sleep(self.rng.uniform(0.001, 0.003))  # noqa: TID251
        if batch.direction is Direction.STORE:
            super()._copy(batch)
            for g, ids in enumerate(batch.cpu_block_ids):
                for cb in ids:
                    self._cpu_digest[(g, cb)] = _digest(self._cpu[g][cb])
                    if self.corrupt and self.rng.random() < 0.2:
                        self._cpu[g][cb, 0] ^= 0xFF
            return
        with self._lock:
            earlier = self._store_of.pop(id(batch), ()) if first else ()
        for f in earlier:
            if not f.finished.is_set():
                self.tally.violation("a load ran before an earlier store of its GPU block")
        for g, ids in enumerate(batch.cpu_block_ids):
            for cb in ids:
                want = self._cpu_digest.get((g, cb))
                if want is None or want != _digest(self._cpu[g][cb]):
                    self.tally.violation(f"load read CPU block {g}/{cb} not as its store wrote it")
        super()._copy(batch, spans)
        if first:
            self.tally.checks["blocks_reloaded_byte_identical"] += batch.num_blocks
        for g, (gids, cids) in enumerate(
            zip(batch.gpu_block_ids, batch.cpu_block_ids, strict=True)
        ):
            lo, hi = (0, len(self._regions[g])) if spans is None else spans[g]
            for gb, cb in zip(gids, cids, strict=True):
                for rc in self._regions[g][lo:hi]:
                    row = self._cpu[g][cb, rc.cpu_offset : rc.cpu_offset + rc.page_bytes]
                    if not torch.equal(rc.view[gb], row):
                        self.tally.violation(f"GPU block {g}/{gb} differs from CPU {cb} after load")


class LateRank:
    """The scheduler role with a simulated second tensor-parallel rank: rank 1 reports what rank
    0 reported, 0-3 steps late, and now and then reports a copy failed. Checks that no transfer
    settles before rank 1 reported it. With ``ranks`` 1 there is no second rank: reports pass
    as they are (fenced loads then run: docs/architecture.md)."""

    def __init__(
        self,
        inner: OffloadScheduler,
        rng: random.Random,
        p_fail: float,
        tally: Tally,
        ranks: int = 2,
    ):
        self.inner = inner
        self.ranks = ranks
        self.rng = rng
        self.p_fail = p_fail
        self.tally = tally
        self.steps = 0
        self.queue: list[tuple[int, StepReport]] = []
        self.last_plan: StepPlan | None = None

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        plan = self.inner.build_connector_meta(scheduler_output)
        for spec in (*plan.stores, *plan.loads):
            self.tally.transfers[f"{spec.direction.value}s_planned"] += 1
        if plan.fenced_loads:
            self.tally.transfers["loads_fenced"] += len(plan.fenced_loads)
        if plan.stores or plan.loads:
            self.last_plan = plan
        return plan

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput:
        self.steps += 1
        if self.ranks == 1:
            return self.inner.update_connector_output(output)
        for r in output.reports:
            if not (r.completed or r.failed):
                continue
            completed = [t for t in r.completed if self.rng.random() >= self.p_fail]
            failed = [*r.failed, *(t for t in r.completed if t not in completed)]
            if len(completed) < len(r.completed):
                self.tally.faults["rank1_reported_failure"] += len(r.completed) - len(completed)
            delay = self.rng.choice((0, 0, 1, 2, 3))
            if delay:
                self.tally.faults["rank1_reported_late"] += 1
            late = StepReport(1, tuple(completed), tuple(failed), r.invalid_block_ids)
            self.queue.append((self.steps + delay, late))
        due = [r for s, r in self.queue if s <= self.steps]
        self.queue = [(s, r) for s, r in self.queue if s > self.steps]
        out = self.inner.update_connector_output(KVConnectorOutput(reports=(*output.reports, *due)))
        manager = self.inner.manager
        for _, r in self.queue:
            for tid in (*r.completed, *r.failed):
                self.tally.checks["transfers_held_for_late_rank"] += 1
                if manager.transfer_state(tid) is None:
                    self.tally.violation(f"transfer {tid} settled before rank 1 reported it")
        return out

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self.inner.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work() or bool(self.queue)
