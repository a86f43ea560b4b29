"""PD in vLLM, what crosses between the scheduler and the workers: the copies the scheduler's
``PDDriver`` launches travel to the workers in the connector metadata (``PDLaunch`` /
``PDCancel``, ``KVFlowPDConnectorMetadata``) and their settled fences come back in the worker
metadata (``KVFlowPDWorkerMetadata``); ``RelayTransport`` is the driver's transport on the
scheduler side that does this. ``CountingProducer`` / ``CountingDriver`` feed ``PDStats`` what
only they see (D's DONE and ABORT on P, the reports the connector takes).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorWorkerMetadata,
)

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.ports import free_port
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import ANY_PEER, Action, LaunchCopies
from kvflow.core.pd.messages import Abort, Claim, Done, DoneStatus, Message
from kvflow.core.pd.producer import ProducerManager
from kvflow.core.protocol import StepReport
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.pd_stats import PDStats
from kvflow.integrations.vllm.relay import KVFlowConnectorMetadata, KVFlowWorkerMetadata
from kvflow.runtime.pd_driver import PDDriver, Report

log = get_logger("kvflow.integrations.vllm.pd")


# ---- what crosses to the workers and back -----------------------------------------------------


@dataclass(frozen=True)
class PDLaunch:
    """One launch for the workers' transport: ``side`` ``producer`` (the worker hosts the pair at
    ``data``) or ``consumer`` (it joins P's pair at ``data``)."""

    fence_id: int
    op: LaunchCopies
    data: str
    side: str = "producer"


@dataclass(frozen=True)
class PDCancel:
    fence_id: int


class KVFlowPDConnectorMetadata(KVFlowConnectorMetadata):
    """The CPU tier's plan plus the PD copies to start or cancel; ``want_reply``: a hand-off is
    live, so the workers answer this step even with nothing to say (vLLM calls the scheduler's
    ``update_connector_output`` only when some worker output came back)."""

    def __init__(
        self,
        base: KVFlowConnectorMetadata,
        pd_ops: tuple[PDLaunch | PDCancel, ...],
        want_reply: bool,
    ) -> None:
        super().__init__(base.plan, base.echo_invalid_block_ids, base.echo_failed_request_ids)
        self.pd_ops = pd_ops
        self.want_reply = want_reply


class KVFlowPDWorkerMetadata(KVFlowWorkerMetadata):
    """A worker's reports plus its settled PD copies: (fence id, ok)."""

    def __init__(
        self, reports: tuple[StepReport, ...], pd_results: tuple[tuple[int, bool], ...]
    ) -> None:
        super().__init__(reports)
        self.pd_results = pd_results

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVFlowPDWorkerMetadata:
        if not isinstance(other, KVFlowWorkerMetadata):
            raise ConfigError(f"cannot merge kvflow worker metadata with {type(other).__name__}")
        theirs = other.pd_results if isinstance(other, KVFlowPDWorkerMetadata) else ()
        return KVFlowPDWorkerMetadata(self.reports + other.reports, self.pd_results + theirs)


@dataclass
class KVFlowHandshake(KVConnectorHandshakeMetadata):
    """A worker's data-plane endpoint, collected by vLLM's engine core for the scheduler."""

    transport: str
    host: str
    port: int


# ---- the scheduler's transport: copies relayed to the workers ---------------------------------


@dataclass(eq=False)
class RelayFence:
    fence_id: int
    op: LaunchCopies
    launched_at: float
    status: FenceStatus = FenceStatus.PENDING


class RelayTransport:
    """The scheduler-side ``KVTransport`` of a ``PDDriver``: a launch becomes a ``PDLaunch`` in
    the next metadata, its fence settles when a worker reports it (TP 1: one rank). A
    ``kv_both`` instance has one per side, drawing fence ids from one counter (``ids``)."""

    name = "vllm-relay"
    pushes_completions = False

    def __init__(
        self,
        data_of: Callable[[LaunchCopies], str],
        *,
        side: str,
        stats: PDStats,
        now: Callable[[], float],
        ids: Iterator[int] | None = None,
    ) -> None:
        self._data_of = data_of  # a launch → the data endpoint of its (P, D) pair
        self.side = side
        self._stats = stats
        self._now = now
        self._ids = ids or itertools.count(1)
        self._outbox: list[PDLaunch | PDCancel] = []
        self._fences: dict[int, RelayFence] = {}

    def register(self, groups: Sequence[Sequence[Any]]) -> None:
        raise ConfigError("the scheduler has no KV tensors: the workers register theirs")

    def launch(self, op: LaunchCopies) -> RelayFence:
        fence = RelayFence(next(self._ids), op, self._now())
        self._fences[fence.fence_id] = fence
        self._stats.copy_launched(op)
        self._outbox.append(PDLaunch(fence.fence_id, op, self._data_of(op), self.side))
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        assert isinstance(fence, RelayFence)
        return fence.status

    def cancel(self, fence: Fence) -> None:
        assert isinstance(fence, RelayFence)
        if fence.status is FenceStatus.PENDING:
            self._outbox.append(PDCancel(fence.fence_id))

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        return None

    def close(self) -> None:
        self._fences.clear()

    def settle(self, results: Sequence[tuple[int, bool]]) -> None:
        """The workers' settled copies (ids of the other side's relay are not this one's)."""
        now = self._now()
        for fence_id, ok in results:
            fence = self._fences.pop(fence_id, None)
            if fence is not None:
                fence.status = FenceStatus.DONE if ok else FenceStatus.FAILED
                self._stats.copy_settled(fence.op, ok, now - fence.launched_at)

    def take_ops(self) -> tuple[PDLaunch | PDCancel, ...]:
        out, self._outbox = tuple(self._outbox), []
        return out


class CountingProducer(ProducerManager):
    """P's ``ProducerManager`` that tells ``pd_stats`` when D says a hand-off failed (a DONE
    that is not ok, or an ABORT: D's receive or check went wrong while P's sends were fine).

    It also releases an unbound hand-off whose claim was refused: the proxy sent its params to
    one D, and that D cannot take it, so nobody will (P's blocks come back now, not at the
    lease's end)."""

    pd_stats: PDStats | None = None

    def on_message(self, peer: str, msg: Message, now: float) -> list[Action]:
        failed = isinstance(msg, Abort) or (isinstance(msg, Done) and msg.status != DoneStatus.OK)
        if failed and self.pd_stats is not None:
            self.pd_stats.peer_failed(msg.transfer_id)
        out = super().on_message(peer, msg, now)
        t = self.transfers.get(msg.transfer_id)
        if isinstance(msg, Claim) and t is not None and t.peer == ANY_PEER and t.epoch == msg.epoch:
            log.info("pd_unbound_released", transfer_id=t.transfer_id, peer=peer)
            out.extend(self.abort(t.transfer_id, now))
        return out


class CountingDriver(PDDriver):
    """A ``PDDriver`` whose reports, as the connector takes them, also count in ``pd_stats``."""

    pd_stats: PDStats | None = None

    def take_reports(self) -> list[Report]:
        out = super().take_reports()
        if out and self.pd_stats is not None:
            self.pd_stats.reports(out)
        return out


__all__ = [
    "CountingDriver",
    "CountingProducer",
    "KVFlowHandshake",
    "KVFlowPDConnectorMetadata",
    "KVFlowPDWorkerMetadata",
    "PDCancel",
    "PDLaunch",
    "RelayFence",
    "RelayTransport",
    "free_port",
]
