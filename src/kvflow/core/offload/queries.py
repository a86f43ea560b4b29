"""What an offload manager answers without changing anything: its CPU tier's pools, live
transfers, counters, stats and cache events, for engines' metrics, audits and tests.

``ManagerQueries`` is ``OffloadManager``'s read-only half; the manager sets the attributes it
declares.
"""

from __future__ import annotations

from collections import Counter

from attrs import asdict

from kvflow.core.block_pool import AllBlocksCleared, PoolEvent
from kvflow.core.offload.config import OffloadManagerConfig
from kvflow.core.offload.holds import GpuHolds
from kvflow.core.offload.ledger import TransferLedger
from kvflow.core.offload.state import RequestState
from kvflow.core.offload.stats import Counters, OffloadStats
from kvflow.core.run_pool import RunBlockPool
from kvflow.core.transfer import TransferState


class ManagerQueries:
    """The read-only queries of ``OffloadManager``."""

    config: OffloadManagerConfig
    _requests: dict[str, RequestState]
    _n: Counters
    _ledger: TransferLedger
    _cpu: list[RunBlockPool]
    _reset_pending: bool

    @property
    def cpu_pools(self) -> tuple[RunBlockPool, ...]:
        """The CPU tier, one pool per group (read-only use: tests and metrics)."""
        return tuple(self._cpu)

    @property
    def reset_pending(self) -> bool:
        """True between a ``reset_cache`` that found transfers in flight and their settling."""
        return self._reset_pending

    def num_live_transfers(self, request_id: str | None = None) -> int:
        """Transfers not yet released, of one request or of all."""
        if request_id is None:
            return len(self._ledger.xfers)
        st = self._requests.get(request_id)
        return 0 if st is None else len(self._ledger.live(st))

    def transfer_state(self, transfer_id: int) -> tuple[TransferState, frozenset[int]] | None:
        """A live transfer's state and the ranks that reported it so far; None once released
        (or never launched). For audits: a store must stay live until every rank reported."""
        x = self._ledger.xfers.get(transfer_id)
        return None if x is None else (x.transfer.state, frozenset(x.reported))

    def has_work(self) -> bool:
        """Whether the manager keeps state for a request (finished ones until their transfers
        settle) or has a transfer in flight: an engine steps again while this holds."""
        return bool(self._requests or self._ledger.xfers)

    def has_request(self, request_id: str) -> bool:
        """Whether the manager still keeps state for the request (finished ones: until their
        transfers settle)."""
        return request_id in self._requests

    @property
    def pd_holds(self) -> GpuHolds:
        """The PD hand-offs' GPU holds, on this manager's ledger (``connector.pd_offload``)."""
        return self._ledger.holds

    def cpu_refs(self) -> list[Counter[int]]:
        """Per group, how many references the manager holds on each CPU block (transfers and
        pinned hits): for consistency checks, it must equal the pools' ref counts."""
        return self._ledger.cpu_refs()

    def take_events(self) -> list[tuple[int, PoolEvent]]:
        """What entered and left the CPU prefix cache since the last call, as (group, event) in
        the order it happened per group (empty unless ``OffloadManagerConfig.enable_events``)."""
        if not self.config.enable_events:
            return []
        # Every pool is cleared by the same resets: the groups' events between two resets go
        # out together, then one AllBlocksCleared (group 0), so nothing stored before a reset
        # is reported after it.
        segments: list[list[tuple[int, PoolEvent]]] = [[]]
        for g, pool in enumerate(self._cpu):
            k = 0
            for e in pool.take_events():
                if isinstance(e, AllBlocksCleared):
                    k += 1
                    if k == len(segments):
                        segments.append([(0, e)])
                    continue
                segments[k].append((g, e))
        return [item for segment in segments for item in segment]

    @property
    def counters(self) -> Counters:
        """The live monotonic counters (read-only use): what ``stats`` copies, for an engine's
        metrics that look at them every step."""
        return self._n

    def stats(self) -> OffloadStats:
        """A frozen snapshot of the counters and of the CPU tier's occupancy."""
        return OffloadStats(
            **asdict(self._n),
            transfers_in_flight=len(self._ledger.xfers),
            cpu_blocks_used=sum(p.num_blocks - p.num_free_blocks for p in self._cpu),
            cpu_blocks_cached=sum(p.num_cached_blocks for p in self._cpu),
        )


__all__ = ["ManagerQueries"]
