"""PD's numbers for vLLM's connector stats: hand-offs committed, failed and aborted, what the
copies moved and how long they took, the prompt tokens D got from P, the holds still open.

``PDStats`` is fed by the scheduler role of a P, D or ``kv_both`` instance: the relay reports each
copy the workers settled (blocks, bytes, launch → settled seconds), the driver each hand-off the
connector takes a report of. A hand-off's outcome is counted on both sides: on D from its
``FinishedRecving`` (ok or not) or ``FreeBlocks`` (the request went away: aborted); on P from its
``FinishedSending``, the copies it ran and D's DONE or ABORT: every copy ok → committed, a copy
failed or D said it failed after P's copies → failed, no copy at all (D pulled nothing, released it, or the lease ran out) →
aborted. ``take`` turns the
counters' change since the last call into a ``KVFlowConnectorStats`` (None when nothing moved),
so the stats and the Prometheus hook of the CPU tier carry PD's too (``telemetry.PD_COUNTERS``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvflow.core.pd.common import FinishedRecving, FinishedSending, FreeBlocks, LaunchCopies
from kvflow.integrations.vllm.telemetry import PD_COUNTERS, PD_LATENCY, KVFlowConnectorStats

Report = FinishedSending | FinishedRecving | FreeBlocks


class PDStats:
    """Cumulative PD counters of one instance, and the copy latencies since the last ``take``."""

    def __init__(self, block_bytes: Sequence[int]) -> None:
        self.block_bytes = list(block_bytes)  # per group: bytes of one block on this rank
        self.totals: dict[str, int] = dict.fromkeys(PD_COUNTERS, 0)
        self._latencies: list[float] = []
        self._copies: dict[str, bool] = {}  # P: transfer id → every copy so far ok
        self._tokens: dict[str, int] = {}  # D: transfer id → prompt tokens claimed from P
        self._last: tuple[int, ...] = (0,) * len(PD_COUNTERS)
        self._last_gauges: tuple[int, int] | None = None

    def add(self, name: str, n: int = 1) -> None:
        self.totals[name] += n

    def claimed(self, transfer_id: str, tokens: int) -> None:
        """D reserved blocks for ``tokens`` prompt tokens from P under ``transfer_id``."""
        self._tokens[transfer_id] = tokens

    def copy_launched(self, op: LaunchCopies) -> None:
        if op.send:
            self._copies.setdefault(op.transfer_id, True)

    def copy_settled(self, op: LaunchCopies, ok: bool, seconds: float) -> None:
        """A copy the workers ran for a hand-off settled (on P a send, on D a receive)."""
        if op.send:
            self._copies[op.transfer_id] = self._copies.get(op.transfer_id, True) and ok
        if not ok:
            return
        blocks = sum(len(pairs) for pairs in op.pairs)
        moved = sum(
            len(pairs) * self.block_bytes[g]
            for g, pairs in enumerate(op.pairs)
            if g < len(self.block_bytes)
        )
        self.totals["pd_blocks_moved"] += blocks
        self.totals["pd_bytes_moved"] += moved
        self._latencies.append(seconds)

    def peer_failed(self, transfer_id: str) -> None:
        """P: D reported the hand-off failed or aborted it; after copies ran, it failed (before
        any copy it stays an abort: nothing moved)."""
        if transfer_id in self._copies:
            self._copies[transfer_id] = False

    def reports(self, reports: Iterable[Report]) -> None:
        """Count the hand-offs these reports end."""
        for r in reports:
            if isinstance(r, FinishedRecving):
                tokens = self._tokens.pop(r.transfer_id, 0)
                if r.ok:
                    self.totals["pd_handoffs_committed"] += 1
                    self.totals["pd_remote_prefill_tokens"] += tokens
                else:
                    self.totals["pd_handoffs_failed"] += 1
            elif isinstance(r, FreeBlocks):
                self._tokens.pop(r.transfer_id, None)
                self.totals["pd_handoffs_aborted"] += 1
            else:
                ok = self._copies.pop(r.transfer_id, None)
                name = "aborted" if ok is None else "committed" if ok else "failed"
                self.totals[f"pd_handoffs_{name}"] += 1

    def take(self, holds: int, reservations: int) -> KVFlowConnectorStats | None:
        """The change since the last call, with P's open holds and D's open reservations as
        gauges; None when nothing changed."""
        now = tuple(self.totals[n] for n in PD_COUNTERS)
        gauges = (holds, reservations)
        if now == self._last and gauges == self._last_gauges and not self._latencies:
            return None
        stats = KVFlowConnectorStats()
        for name, v, last in zip(PD_COUNTERS, now, self._last, strict=True):
            stats.add(name, v - last)
        stats.gauges.update(pd_holds_outstanding=holds, pd_reservations_outstanding=reservations)
        if self._latencies:
            stats.latencies[PD_LATENCY] = self._latencies
            self._latencies = []
        self._last, self._last_gauges = now, gauges
        return stats


__all__ = ["PDStats", "Report"]
