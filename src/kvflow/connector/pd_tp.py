"""PD over a tensor-parallel engine: every rank moves its own kv heads, rank 0 decides.

Rank 0 runs the engine, the PD connector, its driver and manager. Its transport is a
``RankZeroTransport``: each launch (and cancel) the driver makes runs on rank 0's own transport
and is queued, under an op id, for the other ranks; the PD connector hands the queue to them as
the next step's connector metadata (``RankOps``), as TP's step messages carry any connector's.
Each other rank runs a ``PDRankWorker``: it launches the ops on its own transport and reports
each op's end in its ``StepReport`` (completed / failed op ids), which reach rank 0 merged into
the step's output; the PD connector turns them into the manager's ``copy_done(rank)``. So a
hand-off commits only when every rank's part landed, and a failure on any rank fails it, through
the managers' existing per-rank reports.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from attrs import frozen

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import KVTransport
from kvflow.connector.api import KVCacheConfig, NullConnector
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies
from kvflow.core.protocol import StepReport
from kvflow.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = get_logger("kvflow.pd.tp")


@frozen
class RankOp:
    """Launch ``launch`` under ``op_id`` on this rank, or (``launch`` None) cancel that op."""

    op_id: int
    launch: LaunchCopies | None = None


@frozen
class RankOps:
    """The connector metadata rank 0 sends the other ranks: their launches and cancels."""

    ops: tuple[RankOp, ...]


class RankZeroTransport:
    """Rank 0's transport on a TP engine: runs every launch locally and queues it for the
    other ranks (``take``); ``pending`` maps the op ids the other ranks still run to their
    launches and the ranks that reported them."""

    def __init__(self, local: KVTransport, world_size: int) -> None:
        if world_size < 2:
            raise ConfigError(f"a rank-0 transport needs other ranks, got world size {world_size}")
        self.local = local
        self.world_size = world_size
        self.name = local.name
        self.pushes_completions = local.pushes_completions
        self._ids = itertools.count(1)
        self._outbox: list[RankOp] = []
        self._of_fence: dict[int, int] = {}  # id(rank 0's unsettled fence) → op id
        self.pending: dict[int, tuple[LaunchCopies, set[int]]] = {}

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        self.local.register(groups)

    def launch(self, op: LaunchCopies) -> Fence:
        fence = self.local.launch(op)
        op_id = next(self._ids)
        self._of_fence[id(fence)] = op_id
        self.pending[op_id] = (op, set())
        self._outbox.append(RankOp(op_id, op))
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        status = self.local.query(fence)
        if status is not FenceStatus.PENDING:
            self._of_fence.pop(id(fence), None)
        return status

    def cancel(self, fence: Fence) -> None:
        self.local.cancel(fence)
        op_id = self._of_fence.get(id(fence))
        if op_id is not None and op_id in self.pending:
            self._outbox.append(RankOp(op_id))

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self.local.set_wakeup(wakeup)

    def close(self) -> None:
        self.local.close()

    @property
    def stats(self) -> Any:
        return getattr(self.local, "stats", None)

    def take(self) -> RankOps | None:
        """What the other ranks must do next step (None: nothing)."""
        if not self._outbox:
            return None
        out, self._outbox = RankOps(tuple(self._outbox)), []
        return out

    def reported(self, rank: int, op_id: int) -> LaunchCopies | None:
        """Rank ``rank`` ended op ``op_id``: its launch (None for an op not pending, or a rank
        that reported it before: logged, dropped)."""
        entry = self.pending.get(op_id)
        if entry is None or rank in entry[1] or not 0 < rank < self.world_size:
            log.warning("pd_rank_report_dropped", rank=rank, op_id=op_id)
            return None
        entry[1].add(rank)
        if len(entry[1]) == self.world_size - 1:
            del self.pending[op_id]
        return entry[0]


def wire_groups(
    kv: KVCacheConfig, kv_caches: dict[str, torch.Tensor], rows_per_block: int
) -> list[list[torch.Tensor]]:
    """Per KV cache group, the tensors a transport registers: each layer's K and V as wire rows,
    ``rows_per_block`` consecutive token slices of each block (a view, no copy)."""
    k = rows_per_block
    return [
        [
            t.view(t.shape[0] * k, t.shape[1] // k, *t.shape[2:])
            for name in g.layer_names
            for t in (kv_caches[name][0], kv_caches[name][1])
        ]
        for g in kv.groups
    ]


class PDRankWorker(NullConnector):
    """The worker role of a PD engine's rank other than 0: runs rank 0's ops on this rank's
    transport, reports each op's end in its ``StepReport``."""

    def __init__(
        self, transport: KVTransport, rank: int, kv: KVCacheConfig, rows_per_block: int = 1
    ) -> None:
        if rank < 1:
            raise ConfigError(f"a PD rank worker serves a rank other than 0, got {rank}")
        self.transport = transport
        self.rank = rank
        self.kv = kv
        self.rows_per_block = rows_per_block
        self._fences: dict[int, Fence] = {}
        self._ended: list[tuple[int, bool]] = []

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.transport.register(wire_groups(self.kv, kv_caches, self.rows_per_block))

    def bind_connector_metadata(self, meta: object) -> None:
        if not isinstance(meta, RankOps):
            return
        for op in meta.ops:
            if op.launch is not None:
                try:
                    self._fences[op.op_id] = self.transport.launch(op.launch)
                except Exception as e:  # this rank's part failed: the hand-off fails
                    log.error("pd_rank_launch_failed", rank=self.rank, error=str(e)[:200])
                    self._ended.append((op.op_id, False))
            elif (fence := self._fences.get(op.op_id)) is not None:
                self.transport.cancel(fence)

    def build_worker_report(self) -> StepReport | None:
        for op_id, fence in list(self._fences.items()):
            status = self.transport.query(fence)
            if status is not FenceStatus.PENDING:
                del self._fences[op_id]
                self._ended.append((op_id, status is FenceStatus.DONE))
        if not self._ended:
            return None
        ended, self._ended = self._ended, []
        return StepReport(
            self.rank,
            completed=tuple(i for i, ok in ended if ok),
            failed=tuple(i for i, ok in ended if not ok),
        )

    @property
    def in_flight(self) -> int:
        return len(self._fences)

    def shutdown(self) -> None:
        self.transport.close()


__all__ = ["PDRankWorker", "RankOp", "RankOps", "RankZeroTransport", "wire_groups"]
