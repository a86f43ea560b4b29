"""The prefill engine's (P's) side of PD hand-offs: a sans-IO manager of many transfers.

Inputs: the engine's events (``begin`` when a request that D will decode is admitted,
``kv_ready`` when its KV is complete and its blocks are held with ``delay_free``, ``abort``), D's
messages (``on_message``), the transport's per-rank completions (``copy_done``) and time
(``tick``). Each returns the actions to carry out. P pushes: on a claim it grants, and launches
its sends as soon as one of ``max_inflight`` send slots (the bounded staging ring) is free.

Streaming (the concurrent flow): a hand-off whose prompt hashes P knows before its KV is
complete (``begin(..., block_hashes=...)`` or ``set_prompt``) answers a claim that arrives while
it prefills with a streaming GRANT at once (PREFILLING → STREAMING); from then on each chunk of
the claimed blocks is pushed as soon as its KV is fenced (``kv_chunk``): a READY names the
chunk and its channel, and the chunk's sends launch (not bounded by the send slots: a chunk is
what one prefill step computed). ``kv_ready`` pushes what is left (STREAMING → IN_FLIGHT); the
usual SENT → DONE → RELEASED follows once every chunk's sends settled. The blocks read so far
are held from the first push on, so an abort mid-way drains (every running push settles)
before P's blocks go back.

The rules it keeps (PD.md §1): only a hold that was never granted expires (READY's lease); a
granted hold is freed only after every rank's send settled; a claim for an ended or aborted
attempt is refused (tombstones), and anything about an unknown or stale ``(transfer_id, epoch)``
is logged and dropped.

Unbound hand-offs: a request whose router did not say which D will decode it (vLLM's stock
proxy) begins with ``peer=ANY_PEER``. The first valid CLAIM binds it to the claiming peer
(``pd_peer_bound``; a peer reaches ``on_message`` only after HELLO), and from then on it is an
ordinary hand-off with that peer. Until then nothing is sent to, watched for or launched toward
it: any other message about it is dropped as stale, its lease expiry releases its blocks with
no peer to tell, and ``peer_lost`` never matches it. ``may_bind`` lets the caller refuse a
binding (NACK ``unknown_transfer``; the hand-off stays unbound).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from attrs import define, field

from kvflow.core.hashing import BlockHash
from kvflow.core.pd.common import (
    ANY_PEER,
    CHANNELS,
    Action,
    BlockLedger,
    BlockPairs,
    CancelCopies,
    FinishedSending,
    HandoffSide,
    LaunchCopies,
    PDTimeouts,
    Send,
    drop_stale,
    log,
)
from kvflow.core.pd.machines import PRODUCER_MACHINE, PInput, PState
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
    NackReason,
    Ready,
    Release,
    hashes_digest,
)
from kvflow.errors import ProtocolError

PI = PInput


@define(eq=False)
class PTransfer:
    """One hand-off on P."""

    transfer_id: str
    epoch: int
    peer: str  # ANY_PEER until the first valid claim binds it
    deadline: float
    state: PState = PState.PREFILLING
    block_ids: GroupIds = ()
    block_hashes: tuple[BlockHash, ...] = ()
    digest: bytes = b""
    pending_claim: Claim | None = None
    pairs: tuple[BlockPairs, ...] = ()
    launched: bool = False
    settled: set[int] = field(factory=set)
    failed: bool = False
    peer_done: bool = False
    ack_owed: bool = False
    done_owed: bool = False
    channel: int = 0
    chunks: dict[int, set[int]] = field(factory=dict)  # streamed: channel → settled ranks
    claim: Claim | None = None  # streamed: the claim granted while prefilling
    fenced: int = 0  # streamed: P's blocks whose KV is fenced (per group, from the start)
    pushed: int = 0  # streamed: claimed blocks pushed so far (an index into the claim)
    # The engine handed the request's blocks to the hand-off (kv_ready, or an abort while a
    # streamed push ran): its end is FinishedSending. Before that the running request owns them.
    engine_waits: bool = False
    any_peer: bool = False  # begun unbound: the engine's later calls still name ANY_PEER

    def __attrs_post_init__(self) -> None:
        self.any_peer = self.peer == ANY_PEER

    def is_peer(self, peer: str) -> bool:
        """Whether the engine's ``peer`` names this hand-off's (ANY_PEER if it began unbound)."""
        return peer == self.peer or (self.any_peer and peer == ANY_PEER)


class ProducerManager(HandoffSide[PTransfer]):
    """Every hand-off P is part of, keyed by the router's transfer id."""

    side = "producer"

    def __init__(
        self,
        engine_id: str,
        *,
        world_size: int = 1,
        timeouts: PDTimeouts | None = None,
        max_inflight: int = 4,
        may_bind: Callable[[str, str], bool] | None = None,
    ) -> None:
        super().__init__(
            engine_id, world_size=world_size, timeouts=timeouts, max_inflight=max_inflight
        )
        self.may_bind = may_bind  # (transfer_id, peer) → whether an unbound hand-off may bind
        self.ledger = BlockLedger(
            shared=True, side=self.side
        )  # prefix-cached blocks serve several hand-offs
        self._channels: set[int] = set()  # held from grant to release
        self._next_channel = 1

    # -- engine inputs ------------------------------------------------------------------------

    def begin(
        self,
        transfer_id: str,
        epoch: int,
        peer: str,
        now: float,
        *,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> list[Action]:
        """A request whose KV D will receive started prefilling (the concurrent flow); with the
        prompt's ``block_hashes`` a claim can be granted before the KV is complete. ``peer``
        ANY_PEER: the first valid claim binds the hand-off to its sender."""
        if transfer_id in self.transfers:
            raise ProtocolError(f"hand-off {transfer_id!r} already exists on P")
        self.transfers[transfer_id] = PTransfer(
            transfer_id, epoch, peer, deadline=now + self.timeouts.prefill_s
        )
        if block_hashes is None:
            return []
        return self.set_prompt(transfer_id, block_hashes, now)

    def set_prompt(
        self, transfer_id: str, block_hashes: Sequence[BlockHash], now: float
    ) -> list[Action]:
        """The prompt's chained block hashes of a hand-off still prefilling: from now on a claim
        is granted at once and chunks are pushed as they are fenced. Once only."""
        t = self.transfers.get(transfer_id)
        if t is None or t.state is not PState.PREFILLING or t.digest:
            raise ProtocolError(f"set_prompt for {transfer_id!r}: not a hand-off prefilling")
        t.block_hashes = tuple(block_hashes)
        t.digest = hashes_digest(t.block_hashes)
        out: list[Action] = []
        if t.pending_claim is not None:
            claim, t.pending_claim = t.pending_claim, None
            self._on_claim(t, claim, now, out)
        return out

    def kv_chunk(
        self, transfer_id: str, epoch: int, block_ids: GroupIds, fenced: int, now: float
    ) -> list[Action]:
        """The KV of the prompt's first ``fenced`` blocks (of ``block_ids``, per group) is
        fenced; a streamed hand-off pushes the claimed ones not pushed yet. Anything else (not
        streaming, ended, aborted) ignores it: ``kv_ready`` still comes."""
        ids = tuple(tuple(g) for g in block_ids)
        t = self.transfers.get(transfer_id)
        if t is None or t.epoch != epoch:
            return []
        if any(len(g) < fenced for g in ids) or fenced < t.fenced:
            raise ProtocolError(
                f"kv_chunk {transfer_id!r}: {fenced} fenced blocks of {[len(g) for g in ids]}, "
                f"{t.fenced} before"
            )
        out: list[Action] = []
        if t.state in (PState.PREFILLING, PState.STREAMING):
            t.block_ids, t.fenced = ids, fenced
            if t.state is PState.STREAMING:
                self._push(t, now, out)
        return out

    def kv_ready(
        self,
        transfer_id: str,
        epoch: int,
        peer: str,
        block_ids: GroupIds,
        block_hashes: Sequence[BlockHash],
        now: float,
    ) -> list[Action]:
        """The request's KV is complete in ``block_ids``; P holds them for D until released."""
        ids = tuple(tuple(g) for g in block_ids)
        t = self.transfers.get(transfer_id)
        same = t is not None and t.epoch == epoch and t.is_peer(peer)
        if t is not None and t.state is PState.STREAMING and same:
            return self._streamed_ready(t, ids, block_hashes, now)
        if t is not None and t.state is PState.DRAINING and same:
            # A streamed hand-off stopped mid-way: its drain's FinishedSending frees the blocks,
            # all the request's (the hold had only the chunks pushed, or none).
            self.ledger.grow(transfer_id, ids)
            t.engine_waits = True
            t.block_ids = ids
            return []
        if t is not None and (t.state is not PState.PREFILLING or not same):
            raise ProtocolError(
                f"kv_ready for hand-off {transfer_id!r} (epoch {epoch}, peer {peer!r}) does not "
                f"match its state {t.state.value} (epoch {t.epoch}, peer {t.peer!r})"
            )
        self.ledger.check_free(transfer_id, ids)
        if (transfer_id, epoch) in self.tombstones:
            # D aborted or released this attempt while P was prefilling: nothing to hold.
            if t is not None:
                self._apply(t, PI.ABORT, "aborted_while_prefilling")
                del self.transfers[transfer_id]
            log.info("pd_kv_ready_after_abort", transfer_id=transfer_id, epoch=epoch)
            return [FinishedSending(transfer_id, ids)]
        if t is None:
            t = PTransfer(transfer_id, epoch, peer, deadline=now)
            self.transfers[transfer_id] = t
        hashes = tuple(block_hashes)
        digest = hashes_digest(hashes)
        if t.digest and digest != t.digest:
            raise ProtocolError(f"kv_ready {transfer_id!r}: hashes differ from set_prompt's")
        self.ledger.take(transfer_id, ids)
        t.engine_waits = True
        t.block_ids, t.block_hashes, t.digest = ids, hashes, digest
        self._apply(t, PI.KV_READY, "kv_ready")
        t.deadline = now + self.timeouts.lease_s
        out: list[Action] = []
        if t.pending_claim is not None:
            claim, t.pending_claim = t.pending_claim, None
            self._on_claim(t, claim, now, out)
            self._launch_waiting(now, out)
        return out

    def abort(self, transfer_id: str, now: float, *, engine_waits: bool = True) -> list[Action]:
        """The router or engine abandoned the hand-off; P's blocks come back once safe (named
        in FinishedSending, unless ``engine_waits`` is False: a preempted request's blocks are
        the engine's already, and its kv_ready comes later)."""
        t = self.transfers.get(transfer_id)
        if t is None:
            raise ProtocolError(f"abort of unknown hand-off {transfer_id!r} on P")
        out: list[Action] = []
        t.engine_waits = t.engine_waits or engine_waits  # the engine frees once this says so
        if t.state is PState.DRAINING:
            return out
        # Past the claim D must hear that P stops; in SENT every send already finished.
        t.done_owed = t.state in (PState.GRANTED, PState.IN_FLIGHT, PState.STREAMING)
        self._stop(t, PI.ABORT, "engine_abort", now, out)
        return out

    # -- transport and time -------------------------------------------------------------------

    def copy_done(
        self, transfer_id: str, epoch: int, rank: int, ok: bool, now: float, channel: int = 0
    ) -> list[Action]:
        """Rank ``rank``'s sends of the hand-off (of its chunk on ``channel``, streamed)
        finished (``ok``) or failed / were cancelled."""
        t = self._settle_rank(transfer_id, epoch, rank, channel)
        t.failed = t.failed or not ok
        out: list[Action] = []
        all_settled = not self._copies_running(t)
        if t.state in (PState.IN_FLIGHT, PState.STREAMING) and not ok:
            t.done_owed = True
            self._stop(t, PI.FAIL, "send_failed", now, out)
        elif t.state is PState.IN_FLIGHT and all_settled:
            self._apply(t, PI.LOCAL_DONE, "every_rank_sent")
            t.deadline = now + self.timeouts.done_s
            out.append(Send(t.peer, Done(t.transfer_id, t.epoch, DoneStatus.OK)))
            if t.peer_done:
                self._finish(t, PI.PEER_DONE, "peer_done", now, out)
        elif t.state is PState.DRAINING:
            self._try_drain(t, now, out)
        self._launch_waiting(now, out)
        return out

    def tick(self, now: float) -> list[Action]:
        """Fire every deadline that passed; heartbeats; forget old tombstones."""
        out: list[Action] = []
        for t in self._due(now):
            if t.state is PState.READY:
                self._finish(t, PI.LEASE_EXPIRED, "unclaimed_lease", now, out)
            elif t.state is PState.DRAINING:
                self._apply(t, PI.TIMEOUT, "drain_overdue")
                log.warning("pd_drain_overdue", side="producer", transfer_id=t.transfer_id)
                t.deadline = now + self.timeouts.drain_retry_s
            elif t.state in (PState.PREFILLING, PState.SENT):
                self._finish(t, PI.TIMEOUT, f"{t.state.value}_timeout", now, out)
            else:
                t.done_owed = True
                self._stop(t, PI.TIMEOUT, f"{t.state.value}_timeout", now, out)
        out.extend(self._tick_peers(now, self.peer_lost))
        self._launch_waiting(now, out)
        return out

    def peer_lost(self, peer: str, now: float) -> list[Action]:
        """``peer`` is dead: its claimed hand-offs drain, its unclaimed holds are released
        (never an unbound one: it has no peer yet)."""
        log.warning("pd_peer_lost", side="producer", peer=peer)
        out: list[Action] = []
        if peer == ANY_PEER:
            return out
        for t in [t for t in self.transfers.values() if t.peer == peer]:
            if PRODUCER_MACHINE.next_state(t.state, PI.PEER_LOST) is not None:
                self._stop(t, PI.PEER_LOST, "peer_lost", now, out)
        return out

    # -- D's messages -------------------------------------------------------------------------

    def on_message(self, peer: str, msg: Message, now: float) -> list[Action]:
        """One control-plane message from D."""
        self.peers.heard(peer, now)
        out: list[Action] = []
        if isinstance(msg, Heartbeat):
            return out
        t = self.transfers.get(msg.transfer_id)
        if peer == ANY_PEER:  # no engine is named so: never one an unbound hand-off binds to
            drop_stale("producer", peer, msg, "unnamed_peer")
            return out
        if t is not None and t.peer == ANY_PEER:
            if (
                isinstance(msg, Release)
                and msg.epoch == t.epoch
                and t.state in (PState.PREFILLING, PState.READY)
            ):
                # The D the proxy sent this request to needs none of it (a full local hit):
                # P lets go now rather than at the lease's end. Nothing was granted to anyone.
                t.peer = peer
                log.info(
                    "pd_peer_bound", transfer_id=t.transfer_id, epoch=t.epoch, peer=peer,
                    cause="release",
                )  # fmt: skip
            elif not isinstance(msg, Claim) or msg.epoch != t.epoch:
                self._not_yours(peer, msg, "unbound", out)
                return out
            elif not self._bind(t, msg, peer, out):
                return out
        if t is not None and t.peer != peer:
            self._not_yours(peer, msg, "wrong_peer", out)
            return out
        if t is not None and t.epoch != msg.epoch:
            if isinstance(msg, Abort):  # an attempt P no longer runs: nothing of it writes
                self.tombstones.add(msg.transfer_id, msg.epoch, now)
                out.append(Send(peer, AbortAck(msg.transfer_id, msg.epoch)))
            else:
                drop_stale("producer", peer, msg, "stale_epoch")
            return out
        if isinstance(msg, Claim):
            if t is None:
                gone = (msg.transfer_id, msg.epoch) in self.tombstones
                reason = NackReason.EXPIRED if gone else NackReason.UNKNOWN_TRANSFER
                out.append(Send(peer, Nack(msg.transfer_id, msg.epoch, reason)))
            else:
                self._on_claim(t, msg, now, out)
        elif isinstance(msg, Abort | Release):
            self._on_abort(peer, t, msg, now, out)
        elif isinstance(msg, Done) and t is not None:
            if t.state is PState.SENT:
                self._finish(t, PI.PEER_DONE, "peer_done", now, out)
            elif t.state is PState.IN_FLIGHT:
                t.peer_done = True  # D's receive finished before P's send fence was seen
            else:
                drop_stale("producer", peer, msg, f"in_{t.state.value}")
        else:
            drop_stale("producer", peer, msg, "unknown" if t is None else "unexpected")
        self._launch_waiting(now, out)
        return out

    @staticmethod
    def _not_yours(peer: str, msg: Message, why: str, out: list[Action]) -> None:
        """A message about a hand-off that is not ``peer``'s: dropped; an ABORT is acked (P
        never writes blocks of a peer its hand-off is not bound to), so that peer's drain
        ends instead of re-sending while P heartbeats it for other hand-offs."""
        drop_stale("producer", peer, msg, why)
        if isinstance(msg, Abort):
            out.append(Send(peer, AbortAck(msg.transfer_id, msg.epoch)))

    def _bind(self, t: PTransfer, claim: Claim, peer: str, out: list[Action]) -> bool:
        """Bind an unbound hand-off to the sender of a valid ``claim``; False (with a NACK to
        the sender, the hand-off still unbound) if the claim is refused."""
        # A claim while P prefills with no prompt known waits for kv_ready: checked then.
        check = t.state is not PState.PREFILLING or bool(t.digest)
        reason = self._claim_problem(t, claim) if check else None
        if reason is None and self.may_bind is not None and not self.may_bind(t.transfer_id, peer):
            log.warning("pd_bind_refused", transfer_id=t.transfer_id, peer=peer)
            reason = NackReason.UNKNOWN_TRANSFER
        if reason is not None:
            log.warning("pd_claim_refused", transfer_id=t.transfer_id, reason=reason.value)
            out.append(Send(peer, Nack(t.transfer_id, t.epoch, reason)))
            return False
        t.peer = peer
        log.info("pd_peer_bound", transfer_id=t.transfer_id, epoch=t.epoch, peer=peer)
        return True

    def _on_claim(self, t: PTransfer, claim: Claim, now: float, out: list[Action]) -> None:
        if t.state is PState.PREFILLING and t.digest:
            self._stream(t, claim, now, out)
            return
        if t.state is PState.PREFILLING:
            t.pending_claim = claim  # the concurrent flow: granted at kv_ready
            self.peers.watch(t.peer, now)
            return
        if t.state is not PState.READY:
            drop_stale("producer", t.peer, claim, f"duplicate_claim_in_{t.state.value}")
            return
        reason = self._claim_problem(t, claim)
        if reason is not None:
            log.warning("pd_claim_refused", transfer_id=t.transfer_id, reason=reason.value)
            out.append(Send(t.peer, Nack(t.transfer_id, t.epoch, reason)))
            return
        t.pairs = tuple(
            BlockPairs(t.block_ids[g][s : s + len(d)], d)
            for g, (s, d) in enumerate(zip(claim.start, claim.block_ids, strict=True))
        )
        self._apply(t, PI.CLAIM, "claim")
        t.channel = self._take_channel()
        t.deadline = now + self.timeouts.grant_window_s
        self.peers.watch(t.peer, now)
        mine = tuple(g.local for g in t.pairs)
        out.append(
            Send(
                t.peer,
                Grant(
                    t.transfer_id,
                    t.epoch,
                    mine,
                    t.block_hashes,
                    self.timeouts.grant_window_s,
                    t.channel,
                ),
            )
        )
        self._waiting.append(t.transfer_id)

    def _stream(self, t: PTransfer, claim: Claim, now: float, out: list[Action]) -> None:
        """Grant a claim while prefilling: chunks are pushed as their KV is fenced."""
        reason = self._claim_problem(t, claim)
        if reason is not None:
            log.warning("pd_claim_refused", transfer_id=t.transfer_id, reason=reason.value)
            out.append(Send(t.peer, Nack(t.transfer_id, t.epoch, reason)))
            return
        self._apply(t, PI.CLAIM, "claim_while_prefilling")
        t.claim = claim
        t.channel = self._take_channel()
        self.peers.watch(t.peer, now)
        grant = Grant(
            t.transfer_id,
            t.epoch,
            tuple(() for _ in claim.block_ids),
            t.block_hashes,
            self.timeouts.grant_window_s,
            t.channel,
            streaming=True,
        )
        out.append(Send(t.peer, grant))
        self._push(t, now, out)

    def _push(self, t: PTransfer, now: float, out: list[Action]) -> None:
        """Push the claimed blocks fenced since the last push: READY, then their sends."""
        claim = t.claim
        assert claim is not None
        stop = min(
            max(0, min(t.fenced - s, len(d)))
            for s, d in zip(claim.start, claim.block_ids, strict=True)
        )
        if stop <= t.pushed:
            return
        start, t.pushed = t.pushed, stop
        held = tuple(g[: t.fenced] for g in t.block_ids)
        self.ledger.grow(t.transfer_id, held)
        pairs = tuple(
            BlockPairs(t.block_ids[g][s + start : s + stop], d[start:stop])
            for g, (s, d) in enumerate(zip(claim.start, claim.block_ids, strict=True))
        )
        channel = self._take_channel()
        t.chunks[channel] = set()
        self._apply(t, PI.LAUNCH, f"chunk_{start}_{stop}")
        t.deadline = max(t.deadline, now + self.timeouts.copy_s)
        out.append(Send(t.peer, Ready(t.transfer_id, t.epoch, start, stop, channel)))
        out.append(LaunchCopies(t.transfer_id, t.epoch, t.peer, True, pairs, channel))

    def _streamed_ready(
        self, t: PTransfer, ids: GroupIds, block_hashes: Sequence[BlockHash], now: float
    ) -> list[Action]:
        """``kv_ready`` of a streamed hand-off: push the rest; SENT once every push settled."""
        if hashes_digest(tuple(block_hashes)) != t.digest:
            raise ProtocolError(f"kv_ready {t.transfer_id!r}: hashes differ from set_prompt's")
        if any(len(g) < t.fenced for g in ids):
            raise ProtocolError(f"kv_ready {t.transfer_id!r}: fewer blocks than fenced before")
        out: list[Action] = []
        t.engine_waits = True
        t.block_ids, t.fenced = ids, min(len(g) for g in ids)
        self._push(t, now, out)
        self.ledger.grow(t.transfer_id, ids)
        self._apply(t, PI.KV_READY, "kv_ready")
        t.deadline = now + self.timeouts.copy_s
        if not self._copies_running(t):
            self._apply(t, PI.LOCAL_DONE, "every_chunk_sent")
            t.deadline = now + self.timeouts.done_s
            out.append(Send(t.peer, Done(t.transfer_id, t.epoch, DoneStatus.OK)))
        return out

    def _take_channel(self) -> int:
        """A channel no live hand-off uses: two hand-offs' copies never match each other's."""
        if len(self._channels) >= CHANNELS - 1:
            raise ProtocolError(f"P has {len(self._channels)} live hand-offs: no channel left")
        while self._next_channel in self._channels:
            self._next_channel = self._next_channel % (CHANNELS - 1) + 1
        channel = self._next_channel
        self._channels.add(channel)
        self._next_channel = channel % (CHANNELS - 1) + 1
        return channel

    def _claim_problem(self, t: PTransfer, claim: Claim) -> NackReason | None:
        if claim.digest != t.digest:
            return NackReason.HASH_MISMATCH
        if t.state is PState.PREFILLING:
            # Streamed: P's blocks are not all known yet; the prompt has one hash per block.
            if len(claim.start) != len(claim.block_ids) or not claim.block_ids:
                return NackReason.SHAPE
            n = len(t.block_hashes)
            if any(
                s < 0 or s + len(d) > n for s, d in zip(claim.start, claim.block_ids, strict=True)
            ):
                return NackReason.SHAPE
            return None
        if len(claim.start) != len(t.block_ids) or len(claim.block_ids) != len(t.block_ids):
            return NackReason.SHAPE
        for s, d, mine in zip(claim.start, claim.block_ids, t.block_ids, strict=True):
            if s < 0 or s + len(d) > len(mine):
                return NackReason.SHAPE
        return None

    def _on_abort(
        self, peer: str, t: PTransfer | None, msg: Abort | Release, now: float, out: list[Action]
    ) -> None:
        self.tombstones.add(msg.transfer_id, msg.epoch, now)
        ack = isinstance(msg, Abort)
        if t is None or t.state is PState.SENT:
            if t is not None:
                self._finish(t, PI.ABORT, "peer_abort", now, out)
            if ack:
                out.append(Send(peer, AbortAck(msg.transfer_id, msg.epoch)))
            return
        if t.state is PState.DRAINING:
            t.ack_owed = t.ack_owed or ack
            self._try_drain(t, now, out)
            return
        if isinstance(msg, Release) and t.state not in (PState.PREFILLING, PState.READY):
            drop_stale("producer", peer, msg, f"release_in_{t.state.value}")
            return
        t.ack_owed = ack
        self._stop(t, PI.ABORT, "peer_abort", now, out)

    # -- internals ----------------------------------------------------------------------------

    def _apply(self, t: PTransfer, event: PInput, cause: str) -> None:
        t.state = PRODUCER_MACHINE.apply(
            t.transfer_id, t.state, event, cause=cause, epoch=t.epoch, peer=t.peer
        )

    def _stop(self, t: PTransfer, event: PInput, cause: str, now: float, out: list[Action]) -> None:
        """Apply a failure-class input: to RELEASED if nothing was granted, else to DRAINING."""
        if PRODUCER_MACHINE.next_state(t.state, event) is PState.RELEASED:
            if t.ack_owed:
                out.append(Send(t.peer, AbortAck(t.transfer_id, t.epoch)))
            self._finish(t, event, cause, now, out)
            return
        was_launched = self._copies_running(t)
        self._apply(t, event, cause)
        self._unqueue(t)
        if was_launched:
            out.append(CancelCopies(t.transfer_id, t.epoch))
        t.deadline = now + self.timeouts.drain_retry_s
        self._try_drain(t, now, out)

    def _try_drain(self, t: PTransfer, now: float, out: list[Action]) -> None:
        if self._copies_running(t):
            return
        if t.ack_owed:
            out.append(Send(t.peer, AbortAck(t.transfer_id, t.epoch)))
        elif t.done_owed:
            out.append(Send(t.peer, Done(t.transfer_id, t.epoch, DoneStatus.FAILED)))
        self._finish(t, PI.DRAIN_DONE, "drained", now, out)

    def _finish(
        self, t: PTransfer, event: PInput, cause: str, now: float, out: list[Action]
    ) -> None:
        self._apply(t, event, cause)
        assert t.state is PState.RELEASED
        self._channels.discard(t.channel)
        self._channels.difference_update(t.chunks)
        self._forget(t, now, watching=lambda x: x.state is not PState.READY)
        if self.ledger.holds(t.transfer_id):
            ids = self.ledger.give_back(t.transfer_id)
            if t.engine_waits:
                out.append(FinishedSending(t.transfer_id, ids))
            # else: a streamed hand-off ended while its request still prefills; the request's
            # kv_ready (the tombstone's path) or its abort hands the blocks back.

    def _launch_waiting(self, now: float, out: list[Action]) -> None:
        while (t := self._next_launch(now)) is not None:
            self._apply(t, PI.LAUNCH, "send_slot")
            out.append(LaunchCopies(t.transfer_id, t.epoch, t.peer, True, t.pairs, t.channel))


__all__ = ["PTransfer", "ProducerManager"]
