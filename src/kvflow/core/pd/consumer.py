"""The decode engine's (D's) side of PD hand-offs: a sans-IO manager of many transfers.

D reserves blocks for a request (``reserve``), claims P's KV for them, receives it on every rank
into those blocks, checks P's chained block hashes against its own and commits. Inputs: the
engine's events (``reserve``, ``abort``), P's messages (``on_message``), the transport's per-rank
completions (``copy_done``) and time (``tick``); each returns the actions to carry out.

The rules it keeps (PD.md §1): a block named in a claim that P has not answered never returns to
the pool: after an abort, a timeout or a failure the hand-off drains until P confirms (ABORT_ACK,
NACK or DONE) and every launched rank settled, or until a quarantine of grant window + longest
copy after P was declared dead. A receive never starts after the grant window. Every reservation
has a deadline, and a reservation with nothing to receive still reports. KV of another request
(hash mismatch) is a one-shot miss: its blocks are reported invalid and recomputed, never retried.
A hand-off commits only when every rank's part landed.

Streamed (the concurrent flow): P's GRANT may say ``streaming`` (P still prefills); then each
READY names a chunk of the claimed blocks and its channel, and D launches that chunk's receives
at once (never after the READY's arrival: no queue). The hand-off lands only once every claimed
block was received on every rank and P said DONE; an abort mid-way drains like any claimed
hand-off (every running chunk settles and P acks) before D's blocks go back.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define, field

from kvflow.core.hashing import BlockHash
from kvflow.core.pd.common import (
    CHANNELS,
    Action,
    BlockPairs,
    CancelCopies,
    FinishedRecving,
    FreeBlocks,
    HandoffSide,
    LaunchCopies,
    Send,
    drop_stale,
    log,
)
from kvflow.core.pd.machines import CONSUMER_MACHINE, DInput, DState
from kvflow.core.pd.messages import (
    Abort,
    AbortAck,
    Claim,
    Done,
    DoneStatus,
    Grant,
    GroupIds,
    Heartbeat,
    Message,
    Nack,
    Ready,
    Release,
    hashes_digest,
)
from kvflow.errors import ConfigError, ProtocolError

DI = DInput
_CLAIMED = (DState.CLAIMING, DState.GRANTED, DState.IN_FLIGHT)
"""States in which P may write the claimed blocks."""
_STREAMED = (DState.GRANTED, DState.IN_FLIGHT)
"""States in which a streamed hand-off takes P's next chunk."""


@define(eq=False)
class DTransfer:
    """One hand-off on D."""

    transfer_id: str
    epoch: int
    peer: str
    deadline: float
    block_ids: GroupIds
    start: tuple[int, ...]
    num_tokens: int
    digest: bytes
    claim_s: float
    state: DState = DState.RESERVED
    grant_deadline: float = 0.0
    pairs: tuple[BlockPairs, ...] = ()
    grant_hashes: tuple[BlockHash, ...] = ()
    launched: bool = False
    settled: set[int] = field(factory=set)
    ranks_ok: set[int] = field(factory=set)
    peer_done: bool = False  # P's DONE(ok): every write of P's finished
    peer_confirmed: bool = False  # P answered: nothing of P's touches the blocks any more
    lost_at: float | None = None
    aborted: bool = False  # the engine dropped the request: free the blocks, report nothing
    channel: int = 0
    chunks: dict[int, set[int]] = field(factory=dict)  # streamed: channel → settled ranks
    streaming: bool = False  # P's grant came while P prefills: chunks arrive with READY
    received: set[int] = field(factory=set)  # streamed: claimed indexes launched so far
    chunk_failed: bool = False


class ConsumerManager(HandoffSide[DTransfer]):
    """Every hand-off D is part of, keyed by the router's transfer id."""

    side = "consumer"

    # -- engine inputs ------------------------------------------------------------------------

    def reserve(
        self,
        transfer_id: str,
        epoch: int,
        peer: str,
        block_ids: GroupIds,
        start: Sequence[int],
        num_tokens: int,
        block_hashes: Sequence[BlockHash],
        now: float,
        *,
        claim: bool = True,
        claim_timeout_s: float | None = None,
    ) -> list[Action]:
        """Reserve ``block_ids`` (per group, from P's block ``start[g]`` on) for P's KV of a
        prompt whose chained block hashes D computed as ``block_hashes``; claim at once unless
        ``claim`` is False (the peer's HELLO is still pending: call ``claim`` later).
        ``claim_timeout_s`` replaces ``timeouts.claim_s`` for this hand-off: in the concurrent
        flow P grants only once its prefill is done, so the claim waits that long."""
        ids = tuple(tuple(g) for g in block_ids)
        starts = tuple(start)
        if transfer_id in self.transfers:
            raise ProtocolError(f"hand-off {transfer_id!r} already exists on D")
        wait = self.timeouts.claim_s if claim_timeout_s is None else claim_timeout_s
        if len(starts) != len(ids) or any(s < 0 for s in starts) or num_tokens < 0 or wait <= 0:
            raise ConfigError(
                f"reserve {transfer_id!r}: start {starts} must give one non-negative index per "
                f"group ({len(ids)}), num_tokens ({num_tokens}) must be non-negative and "
                f"claim_timeout_s ({wait}) positive"
            )
        self.ledger.check_free(transfer_id, ids)
        self.ledger.take(transfer_id, ids)
        t = DTransfer(
            transfer_id,
            epoch,
            peer,
            deadline=now + wait,
            block_ids=ids,
            start=starts,
            num_tokens=num_tokens,
            digest=hashes_digest(tuple(block_hashes)),
            claim_s=wait,
        )
        self.transfers[transfer_id] = t
        out: list[Action] = []
        if not any(ids):
            # Nothing to receive (D's own cache covers the prompt): still report, and free P.
            out.append(Send(peer, Release(transfer_id, epoch)))
            self._finish(t, DI.ABORT, "nothing_to_receive", now, out, ok=True)
        elif claim:
            out.extend(self.claim(transfer_id, now))
        return out

    def claim(self, transfer_id: str, now: float) -> list[Action]:
        """Send the CLAIM of a reserved hand-off: from now on P may write its blocks."""
        t = self._get(transfer_id)
        self._apply(t, DI.CLAIM_SENT, "claim")
        t.deadline = now + t.claim_s
        self.peers.watch(t.peer, now)
        msg = Claim(t.transfer_id, t.epoch, t.block_ids, t.start, t.num_tokens, t.digest)
        return [Send(t.peer, msg)]

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine dropped the request: its blocks come back once nothing can write them."""
        t = self._get(transfer_id)
        out: list[Action] = []
        t.aborted = True
        if t.state is DState.RESERVED:
            out.append(Send(t.peer, Release(t.transfer_id, t.epoch)))
            self._finish(t, DI.ABORT, "engine_abort", now, out)
        elif t.state in _CLAIMED:
            self._drain(t, DI.ABORT, "engine_abort", now, out)
        self._launch_waiting(now, out)
        return out

    # -- transport and time -------------------------------------------------------------------

    def copy_done(
        self, transfer_id: str, epoch: int, rank: int, ok: bool, now: float, channel: int = 0
    ) -> list[Action]:
        """Rank ``rank``'s receives of the hand-off (of its chunk on ``channel``, streamed)
        finished (``ok``) or failed / were cancelled."""
        t = self._settle_rank(transfer_id, epoch, rank, channel)
        if ok and not t.streaming:
            t.ranks_ok.add(rank)
        t.chunk_failed = t.chunk_failed or (t.streaming and not ok)
        out: list[Action] = []
        if t.state is DState.IN_FLIGHT and not ok:
            self._drain(t, DI.FAIL, f"rank_{rank}_failed", now, out)
        elif t.state is DState.IN_FLIGHT:
            self._maybe_landed(t, now, out)
        elif t.state is DState.DRAINING:
            self._try_drain(t, now, out)
        self._launch_waiting(now, out)
        return out

    def tick(self, now: float) -> list[Action]:
        """Fire every deadline that passed; heartbeats; peers gone silent; old tombstones."""
        out: list[Action] = []
        for t in self._due(now):
            if t.state is DState.RESERVED:
                self._finish(t, DI.TIMEOUT, "reserve_timeout", now, out)
            elif t.state is DState.DRAINING:
                self._apply(t, DI.TIMEOUT, "drain_overdue")
                self._try_drain(t, now, out)
                if t.transfer_id in self.transfers:
                    self._rearm_drain(t, now, out)
            else:
                self._drain(t, DI.TIMEOUT, f"{t.state.value}_timeout", now, out)
        out.extend(self._tick_peers(now, self.peer_lost))
        self._launch_waiting(now, out)
        return out

    def peer_lost(self, peer: str, now: float) -> list[Action]:
        """``peer`` is dead: its hand-offs drain; their blocks wait out the quarantine."""
        log.warning("pd_peer_lost", side="consumer", peer=peer)
        out: list[Action] = []
        for t in [t for t in self.transfers.values() if t.peer == peer]:
            if t.state is DState.RESERVED:
                self._finish(t, DI.PEER_LOST, "peer_lost", now, out)
            elif t.state in _CLAIMED:
                t.lost_at = now
                self._drain(t, DI.PEER_LOST, "peer_lost", now, out)
            elif t.state is DState.DRAINING and t.lost_at is None:
                t.lost_at = now
                t.deadline = now + self.timeouts.quarantine_s
        self._launch_waiting(now, out)
        return out

    # -- P's messages -------------------------------------------------------------------------

    def on_message(self, peer: str, msg: Message, now: float) -> list[Action]:
        """One control-plane message from P."""
        self.peers.heard(peer, now)
        out: list[Action] = []
        if isinstance(msg, Heartbeat):
            return out
        t = self.transfers.get(msg.transfer_id)
        if t is None or t.peer != peer or t.epoch != msg.epoch:
            why = "unknown" if t is None else "stale_epoch" if t.peer == peer else "wrong_peer"
            drop_stale("consumer", peer, msg, why)
            return out
        draining = t.state is DState.DRAINING
        if isinstance(msg, Grant) and t.state is DState.CLAIMING:
            self._on_grant(t, msg, now, out)
        elif isinstance(msg, Ready) and t.streaming and t.state in _STREAMED:
            self._on_ready(t, msg, now, out)
        elif isinstance(msg, Nack) and t.state is DState.CLAIMING:
            log.warning("pd_claim_nacked", transfer_id=t.transfer_id, reason=msg.reason.value)
            self._finish(t, DI.NACK, f"nack_{msg.reason.value}", now, out)
        elif isinstance(msg, Done) and msg.status is DoneStatus.OK and t.state in _CLAIMED:
            t.peer_done = True
            self._maybe_landed(t, now, out)
        elif isinstance(msg, Done) and t.state in _CLAIMED:
            t.peer_confirmed = True  # P stopped: it writes nothing more
            self._drain(t, DI.FAIL, "peer_failed", now, out)
        elif draining and isinstance(msg, AbortAck | Nack | Done):
            t.peer_confirmed = True
            self._try_drain(t, now, out)
        else:
            drop_stale("consumer", peer, msg, f"unexpected_in_{t.state.value}")
        self._launch_waiting(now, out)
        return out

    def _on_ready(self, t: DTransfer, ready: Ready, now: float, out: list[Action]) -> None:
        """A chunk P fenced and pushes: launch its receives now."""
        n = min(len(g) for g in t.block_ids)
        span = set(range(ready.start, ready.stop))
        ok_channel = (
            0 < ready.channel < CHANNELS
            and ready.channel != t.channel
            and ready.channel not in t.chunks
        )
        if not (0 <= ready.start < ready.stop <= n) or span & t.received or not ok_channel:
            drop_stale("consumer", t.peer, ready, "bad_or_duplicate_ready")
            return
        t.received |= span
        t.chunks[ready.channel] = set()
        pairs = tuple(
            BlockPairs(d[ready.start : ready.stop], range(s + ready.start, s + ready.stop))
            for s, d in zip(t.start, t.block_ids, strict=True)
        )
        self._apply(t, DI.LAUNCH, f"chunk_{ready.start}_{ready.stop}")
        t.deadline = now + self.timeouts.copy_s
        out.append(LaunchCopies(t.transfer_id, t.epoch, t.peer, False, pairs, ready.channel))

    def _on_grant(self, t: DTransfer, grant: Grant, now: float, out: list[Action]) -> None:
        if grant.streaming:
            if not 0 < grant.channel < CHANNELS or grant.window_s <= 0:
                log.warning("pd_grant_malformed", transfer_id=t.transfer_id)
                self._drain(t, DI.FAIL, "grant_malformed", now, out)
                return
            self._apply(t, DI.GRANT, "streaming_grant")
            t.streaming = True
            t.grant_hashes = grant.block_hashes
            t.channel = grant.channel
            t.deadline = now + t.claim_s  # P's first chunk comes as its prefill proceeds
            return
        shapes_match = len(grant.block_ids) == len(t.block_ids) and all(
            len(p) == len(d) for p, d in zip(grant.block_ids, t.block_ids, strict=False)
        )
        if not shapes_match or grant.window_s <= 0 or not 0 < grant.channel < CHANNELS:
            log.warning("pd_grant_malformed", transfer_id=t.transfer_id)
            self._drain(t, DI.FAIL, "grant_malformed", now, out)
            return
        self._apply(t, DI.GRANT, "grant")
        t.pairs = tuple(BlockPairs(d, p) for d, p in zip(t.block_ids, grant.block_ids, strict=True))
        t.grant_hashes = grant.block_hashes
        t.channel = grant.channel
        # The window counts from the grant's arrival: later than P's send, but D's receive
        # pairs with P's send, and P frees a granted hold only once its own sends settled.
        t.grant_deadline = now + min(grant.window_s, self.timeouts.grant_window_s)
        t.deadline = t.grant_deadline
        self._waiting.append(t.transfer_id)

    # -- internals ----------------------------------------------------------------------------

    def _get(self, transfer_id: str) -> DTransfer:
        t = self.transfers.get(transfer_id)
        if t is None:
            raise ProtocolError(f"unknown hand-off {transfer_id!r} on D")
        return t

    def _apply(self, t: DTransfer, event: DInput, cause: str) -> None:
        t.state = CONSUMER_MACHINE.apply(
            t.transfer_id, t.state, event, cause=cause, epoch=t.epoch, peer=t.peer
        )

    def _maybe_landed(self, t: DTransfer, now: float, out: list[Action]) -> None:
        if t.streaming:
            whole = len(t.received) == min(len(g) for g in t.block_ids)
            if not (t.peer_done and whole and not self._copies_running(t)):
                return
            if t.chunk_failed:
                self._drain(t, DI.FAIL, "chunk_failed", now, out)
                return
        elif not (t.peer_done and len(t.ranks_ok) == self.world_size):
            return
        self._apply(t, DI.LANDED, "every_rank_landed")
        t.peer_confirmed = True
        good = hashes_digest(t.grant_hashes) == t.digest
        if not good:
            log.error("pd_hash_mismatch", transfer_id=t.transfer_id, peer=t.peer)
        status = DoneStatus.OK if good else DoneStatus.FAILED
        out.append(Send(t.peer, Done(t.transfer_id, t.epoch, status)))
        event = DI.VERIFY_OK if good else DI.VERIFY_BAD
        self._finish(t, event, "verified" if good else "hash_mismatch", now, out, ok=good)

    def _drain(
        self, t: DTransfer, event: DInput, cause: str, now: float, out: list[Action]
    ) -> None:
        """Leave a claimed state: ABORT to P, cancel local receives, wait for both to settle."""
        self._apply(t, event, cause)
        self._unqueue(t)
        if self._copies_running(t):
            out.append(CancelCopies(t.transfer_id, t.epoch))
        self._rearm_drain(t, now, out)
        self._try_drain(t, now, out)

    def _rearm_drain(self, t: DTransfer, now: float, out: list[Action]) -> None:
        if t.lost_at is not None:
            t.deadline = t.lost_at + self.timeouts.quarantine_s
        else:
            t.deadline = now + self.timeouts.drain_retry_s
            if not t.peer_confirmed:
                out.append(Send(t.peer, Abort(t.transfer_id, t.epoch, "consumer_drain")))

    def _try_drain(self, t: DTransfer, now: float, out: list[Action]) -> None:
        if self._copies_running(t):
            return
        quarantined = t.lost_at is not None and now >= t.lost_at + self.timeouts.quarantine_s
        if t.peer_confirmed or quarantined:
            self._finish(t, DI.DRAIN_DONE, "drained", now, out)

    def _finish(
        self,
        t: DTransfer,
        event: DInput,
        cause: str,
        now: float,
        out: list[Action],
        *,
        ok: bool = False,
    ) -> None:
        self._apply(t, event, cause)
        self._forget(t, now, watching=lambda x: x.state is not DState.RESERVED)
        ids = self.ledger.give_back(t.transfer_id)
        if t.aborted:
            out.append(FreeBlocks(t.transfer_id, ids))
        else:
            out.append(FinishedRecving(t.transfer_id, ok, () if ok else ids))

    def _launch_waiting(self, now: float, out: list[Action]) -> None:
        while self._waiting and len(self._inflight) < self.max_inflight:
            head = self.transfers[self._waiting[0]]
            if now > head.grant_deadline:
                # Never start a receive after the grant window: drain instead.
                self._waiting.popleft()
                self._drain(head, DI.TIMEOUT, "grant_window_passed", now, out)
                continue
            t = self._next_launch(now)
            assert t is head
            self._apply(t, DI.LAUNCH, "receive_slot")
            out.append(LaunchCopies(t.transfer_id, t.epoch, t.peer, False, t.pairs, t.channel))


__all__ = ["ConsumerManager", "DTransfer"]
