"""What each rank runs in the two-process tensor-parallel tests, plus the fault wrappers.

Spawned ranks import this module by name, so everything here is module-level and picklable.
``DelayedReports`` holds a rank's ``StepReport``s back a number of steps; ``DuplicateOnce``
repeats a rank's first reported transfers once; ``CommitAudit`` wraps rank 0's scheduler-side
connector and records every point where a store could commit early or a CPU hit could be served
before all ranks had the block.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from functools import partial
from typing import Any

import torch
from attrs import define, field

from kvflow.connector.api import KVConnectorOutput, WorkerConnector
from kvflow.connector.offload import OffloadScheduler
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport, TransferSpec
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction, TransferState
from kvflow.engine.engine import EngineConfig
from kvflow.engine.tp import RankZeroResult, TPEngine, TPSpec, run_rank
from kvflow.engine.workload import run_multi_round
from kvflow.errors import ReportError
from tests.connector.test_offload_end_to_end import WORKLOAD

GPU_BLOCKS = 41
"""With ``WORKLOAD`` (the offload end-to-end tests' workload), histories are evicted and reloaded."""
ENGINE = EngineConfig(block_size=4, num_gpu_blocks=GPU_BLOCKS, max_num_batched_tokens=64)


# ---- wrappers -----------------------------------------------------------------------------------


@define(eq=False)
class ForwardingWorker:
    """A worker connector that passes every call to ``inner``; subclasses change one."""

    inner: WorkerConnector

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, meta: object) -> None:
        self.inner.bind_connector_metadata(meta)

    def handle_preemptions(self, meta: object) -> None:
        self.inner.handle_preemptions(meta)

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        self.inner.start_load_kv(layerwise=layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.inner.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.inner.get_block_ids_with_load_errors()

    def wait_for_progress(self, timeout: float) -> None:
        self.inner.wait_for_progress(timeout)

    def build_worker_report(self) -> StepReport | None:
        return self.inner.build_worker_report()

    def clear_connector_metadata(self) -> None:
        self.inner.clear_connector_metadata()

    def shutdown(self) -> None:
        self.inner.shutdown()


@define(eq=False)
class DelayedReports(ForwardingWorker):
    """Hands each report over ``delay`` steps late (an empty one in its place meanwhile)."""

    rank: int = 1
    delay: int = 4
    held: deque[StepReport] = field(factory=deque)
    delayed_transfers: int = 0

    def build_worker_report(self) -> StepReport | None:
        report = self.inner.build_worker_report()
        assert report is not None
        self.held.append(report)
        self.delayed_transfers += len(report.completed) + len(report.failed)
        if len(self.held) > self.delay:
            return self.held.popleft()
        return StepReport(rank=self.rank)


@define(eq=False)
class DuplicateOnce(ForwardingWorker):
    """Repeats the transfers of its first non-empty report in the next report, once."""

    repeat: tuple[int, ...] | None = None
    done: bool = False

    def build_worker_report(self) -> StepReport | None:
        report = self.inner.build_worker_report()
        assert report is not None
        if self.done or (not report.completed and self.repeat is None):
            return report
        if self.repeat is None:
            self.repeat = report.completed
            return report
        self.done = True
        return StepReport(
            rank=report.rank,
            completed=self.repeat + report.completed,
            failed=report.failed,
            invalid_block_ids=report.invalid_block_ids,
        )


@define(eq=False)
class CommitAudit:
    """Rank 0's scheduler connector, audited: a store stays live and uncached until every rank
    reported it, and a load only reads CPU blocks whose store every rank reported."""

    inner: OffloadScheduler
    world_size: int = 2
    reported: defaultdict[int, set[int]] = field(factory=lambda: defaultdict(set))
    stores: dict[int, TransferSpec] = field(factory=dict)
    writer: dict[tuple[int, int], int] = field(factory=dict)  # (group, CPU block) → store id
    violations: list[str] = field(factory=list)
    duplicates: list[tuple[int, int]] = field(factory=list)  # (rank, transfer id)
    partial_checks: int = 0  # times a store was seen reported by some ranks only, and held
    loads_checked: int = 0

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
        for load in plan.loads:
            for g, ids in enumerate(load.cpu_block_ids):
                for b in ids:
                    self.loads_checked += 1
                    w = self.writer.get((g, b))
                    if w is None or len(self.reported[w]) < self.world_size:
                        self.violations.append(
                            f"load {load.transfer_id} reads CPU block {g}/{b} of store {w}, "
                            f"reported by ranks {sorted(self.reported.get(w or -1, ()))}"
                        )
        for store in plan.stores:
            self.stores[store.transfer_id] = store
            for g, ids in enumerate(store.cpu_block_ids):
                for b in ids:
                    self.writer[(g, b)] = store.transfer_id
        return plan

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput:
        for report in output.reports:
            for tid in (*report.completed, *report.failed):
                if report.rank in self.reported[tid]:
                    self.duplicates.append((report.rank, tid))
        decided = self.inner.update_connector_output(output)
        # Only reached when the manager accepted the reports: record them, then audit.
        for report in output.reports:
            for tid in (*report.completed, *report.failed):
                self.reported[tid].add(report.rank)
        manager = self.inner.manager
        for tid, spec in self.stores.items():
            ranks = self.reported.get(tid, set())
            if not ranks or len(ranks) == self.world_size:
                continue
            self.partial_checks += 1
            if manager.transfer_state(tid) is None:
                self.violations.append(f"store {tid} settled with only ranks {sorted(ranks)}")
            for g, ids in enumerate(spec.cpu_block_ids):
                pool = manager.cpu_pools[g]
                cached = [b for b in ids if pool.block(b).block_hash is not None]
                if cached:
                    self.violations.append(f"store {tid}: CPU blocks {cached} cached early")
        return decided

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.inner.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self.inner.reset_cache()

    def has_pending_push_work(self) -> bool:
        return self.inner.has_pending_push_work()


def _wrap(kinds: dict[int, tuple[str, int]], rank: int, worker: WorkerConnector) -> WorkerConnector:
    if rank not in kinds:
        return worker
    kind, n = kinds[rank]
    if kind == "delay":
        return DelayedReports(worker, rank=rank, delay=n)
    return DuplicateOnce(worker)


# ---- leak checks --------------------------------------------------------------------------------


def leaks(tp: TPEngine) -> list[str]:
    """What rank 0 still holds after a run: must be nothing."""
    assert tp.scheduler is not None
    assert tp.worker is not None
    manager = tp.scheduler.manager
    out: list[str] = []
    if manager.num_live_transfers():
        out.append(f"{manager.num_live_transfers()} live transfers")
    if any(refs for refs in manager.cpu_refs()):
        out.append("CPU refs held by the manager")
    if any(b.ref_cnt for pool in manager.cpu_pools for b in pool.blocks):
        out.append("CPU blocks with references")
    blocks = tp.engine.blocks
    if blocks.num_free_blocks() != blocks.num_usable_blocks:
        out.append(f"GPU pool: {blocks.num_free_blocks()} of {blocks.num_usable_blocks} free")
    if tp.worker.runtime.runtime.in_flight:
        out.append(f"rank 0 runtime in flight {tp.worker.runtime.runtime.in_flight}")
    return out


# ---- rank bodies ----------------------------------------------------------------------------------


def _multi_round_job(tp: TPEngine) -> dict[str, Any]:
    result = run_multi_round(tp.engine, WORKLOAD)
    assert tp.scheduler is not None
    stats = tp.scheduler.stats().manager
    audit = tp.engine.scheduler_connector
    out: dict[str, Any] = {
        "outputs": result.outputs(),
        "blocks_stored": stats.blocks_stored,
        "blocks_loaded": stats.blocks_loaded,
        "external_loaded_tokens": result.total("external_loaded_tokens"),
        "leaks": leaks(tp),
    }
    if isinstance(audit, CommitAudit):
        out |= {
            "violations": audit.violations,
            "partial_checks": audit.partial_checks,
            "loads_checked": audit.loads_checked,
        }
    if isinstance(tp.engine.worker_connector, DelayedReports):
        out["rank0_delayed"] = tp.engine.worker_connector.delayed_transfers
    return out


def multi_round_rank(
    rank: int, world_size: int, spec: TPSpec, faults: dict[int, tuple[str, int]]
) -> RankZeroResult[dict[str, Any]] | None:
    """The multi-round workload on rank 0's engine over all ranks, audited, with ``faults``
    (rank → ("delay", steps)) on the ranks' workers."""
    return run_rank(
        rank,
        world_size,
        spec,
        _multi_round_job,
        wrap_worker=partial(_wrap, faults),
        wrap_scheduler=partial(CommitAudit, world_size=world_size),
    )


def _duplicate_job(tp: TPEngine) -> dict[str, Any]:
    engine = tp.engine
    audit = engine.scheduler_connector
    assert isinstance(audit, CommitAudit)
    assert tp.scheduler is not None
    for i in range(3):
        engine.add_request([(13 * i + j) % 1000 for j in range(40)], 4, request_id=f"d{i}")
    error = ""
    try:
        while engine.has_unfinished():
            engine.step()
    except ReportError as exc:
        error = str(exc)
    states = {tid: tp.scheduler.manager.transfer_state(tid) for _rank, tid in audit.duplicates}
    return {
        "error": error,
        "duplicates": audit.duplicates,
        "states": {
            tid: None if s is None else (s[0] is TransferState.IN_FLIGHT, sorted(s[1]))
            for tid, s in states.items()
        },
        "blocks_stored": tp.scheduler.stats().manager.blocks_stored,
        "violations": audit.violations,
    }


def duplicate_rank(
    rank: int, world_size: int, spec: TPSpec
) -> RankZeroResult[dict[str, Any]] | None:
    """Rank 0's reports are held back 50 steps (so the store is surely still live when rank 1
    repeats it); rank 1 names its first transfers twice."""
    return run_rank(
        rank,
        world_size,
        spec,
        _duplicate_job,
        wrap_worker=partial(_wrap, {0: ("delay", 50), 1: ("duplicate", 1)}),
        wrap_scheduler=partial(CommitAudit, world_size=world_size),
    )


# ---- what the scenarios must show (CPU and GPU tests alike) -------------------------------------


def rank_zero(results: list[Any]) -> RankZeroResult[dict[str, Any]]:
    """Rank 0's result of a ``launch``ed scenario; the other ranks return nothing."""
    first = results[0]
    assert isinstance(first, RankZeroResult)
    assert results[1:] == [None] * (len(results) - 1)
    return first


def check_tp2_matches_tp1(
    res: RankZeroResult[dict[str, Any]], tp1_outputs: dict[tuple[int, int], tuple[int, ...]]
) -> None:
    """Outputs equal to one rank's; both ranks stored and loaded the same bytes; nothing held."""
    got = res.value
    assert got["outputs"] == tp1_outputs
    assert got["blocks_stored"] > 0
    assert got["blocks_loaded"] > 0
    assert got["violations"] == []
    assert got["leaks"] == []
    assert [s.rank for s in res.statuses] == [0, 1]
    for status in res.statuses:
        assert status.in_flight == 0
        assert status.copies[Direction.STORE][0] > 0
        assert status.copies[Direction.LOAD][0] > 0
    # Both ranks ran the same plans over their halves of each block: the same bytes moved.
    (b0, b1) = ({d: s.copies[d][0] for d in Direction} for s in res.statuses)
    assert b0 == b1


def check_late_rank(
    res: RankZeroResult[dict[str, Any]], tp1_outputs: dict[tuple[int, int], tuple[int, ...]]
) -> None:
    """Outputs equal to one rank's; the audit saw stores reported by rank 0 only and each was
    still live and uncached then; loads were audited; nothing leaked or stayed in flight."""
    got = res.value
    assert got["outputs"] == tp1_outputs
    assert got["partial_checks"] > 0
    assert got["loads_checked"] > 0
    assert got["violations"] == []
    assert got["blocks_stored"] > 0
    assert got["blocks_loaded"] > 0
    assert got["leaks"] == []
    assert [s.in_flight for s in res.statuses] == [0, 0]


def raising_rank(rank: int, world_size: int) -> None:
    """Rank 1 fails while rank 0 waits for it forever (outside a collective, so rank 0 cannot
    fail first with a lost-peer error of its own)."""
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    threading.Event().wait()


def hanging_rank(rank: int, world_size: int) -> None:
    """Rank 1 never returns (a lost rank); rank 0 is done."""
    if rank == 1:
        threading.Event().wait()
