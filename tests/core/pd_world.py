"""A deterministic world for the PD managers: one producer, one consumer, a fake network that
drops, duplicates, reorders and delays messages, fake per-rank copies, engine block pools with
poison-on-free, and the checks every PD test shares (no block freed under a running copy, no
leak once quiet, commits only with P's KV of the right request).

Block contents are tags: P's block ``(g, b)`` on rank ``r`` holds ``(transfer_id, g, i, r)``
once its KV is fenced (``UNFENCED`` before: a streamed push of a chunk before its fence shows
up as wrong KV); a freed block is overwritten with ``POISON``, so a use-after-free does too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from attrs import define, field

from kvflow.core.hashing import BlockHash, hash_blocks
from kvflow.core.pd.common import (
    ANY_PEER,
    Action,
    CancelCopies,
    FinishedRecving,
    FinishedSending,
    FreeBlocks,
    LaunchCopies,
    Pairs,
    PDTimeouts,
    Send,
    flat,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.messages import Claim, GroupIds, Message, hashes_digest
from kvflow.core.pd.producer import ProducerManager

POISON = ("poison",)
UNFENCED = ("unfenced",)
TIMEOUTS = PDTimeouts(
    prefill_s=20.0,
    lease_s=6.0,
    claim_s=3.0,
    grant_window_s=2.0,
    copy_s=5.0,
    done_s=4.0,
    drain_retry_s=0.5,
    heartbeat_s=0.5,
    peer_timeout_s=4.0,
    tombstone_s=1000.0,
)
BLOCK_SIZE = 4


def sends(actions: list[Action]) -> list[Any]:
    """The messages among ``actions``."""
    return [a.message for a in actions if isinstance(a, Send)]


def of(actions: list[Action], kind: type) -> list[Any]:
    """The actions of one kind."""
    return [a for a in actions if isinstance(a, kind)]


def prompt_hashes(seed: int, num_blocks: int) -> tuple[BlockHash, ...]:
    """The chained hashes of a made-up prompt of ``num_blocks`` full blocks."""
    tokens = [(seed * 31 + i) % 50_000 for i in range(num_blocks * BLOCK_SIZE)]
    return tuple(hash_blocks(tokens, BLOCK_SIZE))


@define(eq=False)
class Op:
    """One rank's copies of one hand-off on one side."""

    side: str
    transfer_id: str
    epoch: int
    rank: int
    pairs: Pairs
    channel: int = 0
    cancelled: bool = False


@define
class Wire:
    src: str
    dst: str
    message: Message


@define
class Handoff:
    """What the test knows of one hand-off: the truth the managers are checked against."""

    transfer_id: str
    p_ids: GroupIds
    d_ids: GroupIds
    start: tuple[int, ...]
    right_request: bool
    expected: dict[tuple[int, int, int], object] = field(factory=dict)


class Violation(AssertionError):
    """A safety rule was broken."""


class World:
    """P ("P") and D ("D"), each with ``ranks`` ranks and ``groups`` KV cache groups. With
    ``unbound`` P's hand-offs name no D (ANY_PEER) and ``rival_claim`` lets a second D ("D2",
    which never answers anything) race D for one."""

    def __init__(
        self,
        *,
        ranks: int = 1,
        groups: int = 2,
        blocks: int = 24,
        timeouts: PDTimeouts = TIMEOUTS,
        max_inflight: int = 2,
        unbound: bool = False,
    ) -> None:
        self.now = 0.0
        self.p_peer = ANY_PEER if unbound else "D"  # what P's engine names as the hand-off's D
        self.rivals = 0
        self.ranks = ranks
        self.blocks = blocks
        self.groups = groups
        self.p = ProducerManager(
            "P", world_size=ranks, timeouts=timeouts, max_inflight=max_inflight
        )
        self.d = ConsumerManager(
            "D", world_size=ranks, timeouts=timeouts, max_inflight=max_inflight
        )
        self.alive = {"P": True, "D": True}
        self.free: dict[str, set[tuple[int, int]]] = {
            s: {(g, b) for g in range(groups) for b in range(blocks)} for s in ("P", "D")
        }
        self.data: dict[str, dict[tuple[int, int, int], object]] = {"P": {}, "D": {}}
        self.net: list[Wire] = []
        self.ops: list[Op] = []
        self.payload: dict[tuple[str, int, int, int], list[object]] = {}
        self.handoffs: dict[str, Handoff] = {}
        self.committed: set[str] = set()
        self.results: dict[str, str] = {}  # transfer id → how D ended: committed/recompute/freed
        self.sent: set[str] = set()  # hand-offs whose P blocks came back
        self.prefilling: set[str] = set()  # begun on P, kv_ready not called yet
        self.fenced: dict[str, int] = {}  # prefilling: P's blocks whose KV is fenced
        self.p_aborted: set[str] = set()  # aborted by P's engine while prefilling, draining
        self.channels: dict[tuple[str, str], set[int]] = {}  # (side, transfer id) → channels
        self._next = 0

    # -- building hand-offs -------------------------------------------------------------------

    def can_take(self, n: int) -> bool:
        """Whether both pools have ``n`` free blocks in every group."""
        return all(
            sum(1 for (gg, _) in self.free[s] if gg == g) >= n
            for s in ("P", "D")
            for g in range(self.groups)
        )

    def _take(self, side: str, n: int) -> GroupIds:
        out = []
        for g in range(self.groups):
            ids = sorted(b for (gg, b) in self.free[side] if gg == g)[:n]
            if len(ids) < n:
                raise LookupError("pool exhausted")
            out.append(tuple(ids))
            self.free[side] -= {(g, b) for b in ids}
        return tuple(out)

    def new_handoff(
        self,
        *,
        blocks: int = 3,
        skip: int = 0,
        right_request: bool = True,
        begin: bool = False,
        stream: bool = False,
    ) -> str:
        """P computes ``blocks`` blocks per group, D reserves all but the first ``skip`` of them
        (its own cache covers those) and claims; with ``begin`` P is still prefilling, and with
        ``stream`` too P knows the prompt's hashes: a claim is granted at once and chunks are
        pushed as ``kv_chunk`` fences them."""
        self._next += 1
        tid = f"t{self._next}"
        p_ids = self._take("P", blocks)
        d_ids = self._take("D", blocks - skip)
        h = Handoff(tid, p_ids, d_ids, tuple([skip] * self.groups), right_request)
        for g in range(self.groups):
            for b in p_ids[g]:
                for r in range(self.ranks):
                    self.data["P"][(g, b, r)] = UNFENCED
            for i, b in enumerate(d_ids[g]):
                for r in range(self.ranks):
                    h.expected[(g, b, r)] = (tid, g, i + skip, r)
        self.handoffs[tid] = h
        if begin:
            self.prefilling.add(tid)
            self.fenced[tid] = 0
            hashes = prompt_hashes(self._next, blocks) if stream else None
            self.do("P", self.p.begin(tid, 1, self.p_peer, self.now, block_hashes=hashes))
        else:
            self.kv_ready(tid)
        seed = self._next if right_request else self._next + 10_000
        self.do(
            "D",
            self.d.reserve(
                tid,
                1,
                "P",
                d_ids,
                h.start,
                blocks * BLOCK_SIZE,
                prompt_hashes(seed, blocks),
                self.now,
                claim_timeout_s=TIMEOUTS.prefill_s if begin else None,
            ),
        )
        return tid

    def preempt_p(self, tid: str) -> None:
        """P's engine preempts a request still prefilling: its hand-off stops, the request goes
        on (its kv_ready comes later and gets the blocks back through the tombstone)."""
        self.do("P", self.p.abort(tid, self.now, engine_waits=False))

    def abort_p(self, tid: str) -> None:
        """P's engine aborts the request: if it still prefills, the engine frees its blocks at
        once unless the hand-off is still live (a streamed push ran): then at FinishedSending."""
        prefilling = tid in self.prefilling
        self.prefilling.discard(tid)
        self.fenced.pop(tid, None)
        if prefilling:
            self.p_aborted.add(tid)
        self.do("P", self.p.abort(tid, self.now))
        if tid in self.p_aborted and tid not in self.p.transfers:
            # Released at once without a FinishedSending: nothing of P's read the blocks.
            self.p_aborted.discard(tid)
            self._free("P", self.handoffs[tid].p_ids)

    def _fence(self, tid: str, n: int) -> None:
        """P's first ``n`` blocks of the hand-off now hold their KV."""
        h = self.handoffs[tid]
        for g in range(self.groups):
            for i, b in enumerate(h.p_ids[g][:n]):
                for r in range(self.ranks):
                    self.data["P"][(g, b, r)] = (tid, g, i, r)

    def kv_chunk(self, tid: str, more: int) -> None:
        """One more prefill chunk of a hand-off still prefilling: ``more`` blocks fenced."""
        h = self.handoffs[tid]
        n = self.fenced[tid] = min(len(h.p_ids[0]), self.fenced[tid] + more)
        self._fence(tid, n)
        self.do("P", self.p.kv_chunk(tid, 1, h.p_ids, n, self.now))

    def kv_ready(self, tid: str) -> None:
        h = self.handoffs[tid]
        self.prefilling.discard(tid)
        self.fenced.pop(tid, None)
        self._fence(tid, len(h.p_ids[0]))
        hashes = prompt_hashes(int(tid[1:]), len(h.p_ids[0]))
        self.do("P", self.p.kv_ready(tid, 1, self.p_peer, h.p_ids, hashes, self.now))

    def rival_claim(self, tid: str) -> None:
        """D2 claims P's hand-off ``tid`` as D would (right prompt, its own blocks): an unbound
        one binds to whoever claims first, a bound one drops it."""
        h = self.handoffs[tid]
        if not self.alive["P"]:
            return
        n = len(h.p_ids[0])
        blocks = tuple(tuple(range(100, 100 + n - s)) for s in h.start)
        claim = Claim(
            tid, 1, blocks, h.start, n * BLOCK_SIZE, hashes_digest(prompt_hashes(int(tid[1:]), n))
        )
        self.rivals += 1
        self.do("P", self.p.on_message("D2", claim, self.now))

    # -- carrying out actions -----------------------------------------------------------------

    def do(self, side: str, actions: Iterable[Action]) -> None:
        for a in actions:
            if isinstance(a, Send | LaunchCopies) and a.peer == ANY_PEER:
                raise Violation(f"{side} addressed an unbound peer: {a}")
            if isinstance(a, Send):
                if self.alive[side]:
                    self.net.append(Wire(side, a.peer, a.message))
            elif isinstance(a, LaunchCopies):
                assert a.send == (side == "P")
                self.channels.setdefault((side, a.transfer_id), set()).add(a.channel)
                for r in range(self.ranks):
                    self.ops.append(Op(side, a.transfer_id, a.epoch, r, a.pairs, a.channel))
            elif isinstance(a, CancelCopies):
                for op in self.ops:
                    if (op.side, op.transfer_id, op.epoch) == (side, a.transfer_id, a.epoch):
                        op.cancelled = True
            elif isinstance(a, FinishedSending):
                if a.transfer_id in self.p_aborted:
                    # The request was aborted mid-prefill: the engine frees its whole table.
                    self.p_aborted.discard(a.transfer_id)
                    self._free(side, self.handoffs[a.transfer_id].p_ids)
                else:
                    self._free(side, a.block_ids)
                self.sent.add(a.transfer_id)
            elif isinstance(a, FreeBlocks):
                self._free(side, a.block_ids)
                self.results[a.transfer_id] = "freed"
            elif isinstance(a, FinishedRecving):
                self._finished_recving(a)

    def _free(self, side: str, ids: GroupIds) -> None:
        for key in flat(ids):
            for op in self.ops:
                if op.side == side and any(key[1] == pair[0] for pair in op.pairs[key[0]]):
                    raise Violation(f"{side} freed block {key} while copy {op} may still run")
            if key in self.free[side]:
                raise Violation(f"{side} freed block {key} twice")
            self.free[side].add(key)
            for r in range(self.ranks):
                self.data[side][(key[0], key[1], r)] = POISON

    def _finished_recving(self, a: FinishedRecving) -> None:
        h = self.handoffs[a.transfer_id]
        if a.ok:
            if not h.right_request and any(h.d_ids):
                raise Violation(f"{a.transfer_id}: committed KV of another request")
            for key, want in h.expected.items():
                if self.data["D"].get(key) != want:
                    raise Violation(f"{a.transfer_id}: block {key} holds {self.data['D'].get(key)}")
            self.committed.add(a.transfer_id)
            self.results[a.transfer_id] = "committed"
            # The request decodes and finishes: its blocks go back to D's pool.
            self._free("D", h.d_ids)
        else:
            assert a.invalid_block_ids == h.d_ids
            self.results[a.transfer_id] = "recompute"
            self._free("D", a.invalid_block_ids)  # recompute overwrites them

    # -- the network, copies and time ---------------------------------------------------------

    def deliver(self, i: int) -> None:
        w = self.net.pop(i)
        if w.dst == "D2" or not self.alive[w.dst]:  # the rival D never answers
            return
        mgr: Any = self.p if w.dst == "P" else self.d
        self.do(w.dst, mgr.on_message(w.src, w.message, self.now))

    def complete(self, i: int, ok: bool = True) -> bool:
        """Settle op ``i`` if it can settle now (a receive needs P's matching send first)."""
        op = self.ops[i]
        if not self.alive[op.side]:
            return False
        key = (op.transfer_id, op.epoch, op.rank, op.channel)
        if op.side == "P":
            ok = ok and not op.cancelled
            if ok:
                self.payload[key] = [
                    self.data["P"][(g, p, op.rank)]
                    for g, pairs in enumerate(op.pairs)
                    for p, _ in pairs
                ]
            self.ops.pop(i)
            self.do(
                "P", self.p.copy_done(op.transfer_id, op.epoch, op.rank, ok, self.now, op.channel)
            )
            return True
        if ok and not op.cancelled:
            if key not in self.payload:
                return False
            values = iter(self.payload[key])
            for g, pairs in enumerate(op.pairs):
                for d, _ in pairs:
                    self.data["D"][(g, d, op.rank)] = next(values)
        self.ops.pop(i)
        landed = ok and not op.cancelled
        self.do(
            "D",
            self.d.copy_done(op.transfer_id, op.epoch, op.rank, landed, self.now, op.channel),
        )
        return True

    def advance(self, dt: float) -> None:
        self.now += dt
        for side, mgr in (("P", self.p), ("D", self.d)):
            if self.alive[side]:
                self.do(side, mgr.tick(self.now))

    def kill(self, side: str) -> None:
        self.alive[side] = False
        self.ops = [op for op in self.ops if op.side != side]

    # -- checks -------------------------------------------------------------------------------

    def check_safety(self) -> None:
        """Every running copy's blocks are held by its hand-off; held and free blocks disjoint."""
        for side, mgr in (("P", self.p), ("D", self.d)):
            if not self.alive[side]:
                continue
            ledger: Any = mgr.ledger
            for op in self.ops:
                if op.side != side:
                    continue
                for g, pairs in enumerate(op.pairs):
                    for local, _ in pairs:
                        if ledger.owner(g, local) != op.transfer_id:
                            raise Violation(f"{side}: copy {op} runs on a block it does not hold")
                        if (g, local) in self.free[side]:
                            raise Violation(f"{side}: copy {op} runs on a free block")
            assert mgr.num_live <= len(self.handoffs)
            assert len(mgr.peers) <= (2 if self.rivals and side == "P" else 1)
        # D's copies of a hand-off use channels of P's copies of it (or P's not launched yet);
        # no two live sends share one.
        for (side, tid), chans in self.channels.items():
            if side == "D" and ("P", tid) in self.channels:
                assert chans <= self.channels[("P", tid)], tid
        live = [
            c
            for t in self.p.transfers
            if self.alive["P"] and ("P", t) in self.channels
            for c in self.channels[("P", t)]
        ]
        assert len(live) == len(set(live)), live

    def quiesce(self, max_rounds: int = 400) -> None:
        """Heal the network and run until no hand-off is live on a side that is alive."""
        for _ in range(max_rounds):
            if self.alive["P"]:
                for tid in sorted(self.prefilling):  # every prefill ends some time
                    self.kv_ready(tid)
            while self.net:
                self.deliver(0)
            progressed = True
            while progressed:
                progressed = False
                for i in range(len(self.ops) - 1, -1, -1):
                    if i < len(self.ops) and self.complete(i):
                        progressed = True
            live = (self.alive["P"] and self.p.num_live) or (self.alive["D"] and self.d.num_live)
            if not live and not self.net and not [o for o in self.ops if self.alive[o.side]]:
                return
            self.advance(0.5)
        raise Violation(
            f"not quiet after {max_rounds} rounds: P {self.p.transfers} D {self.d.transfers}"
        )

    def check_no_leaks(self) -> None:
        """Once quiet: no live hand-off, nothing held, every block of a live side free again."""
        for side, mgr in (("P", self.p), ("D", self.d)):
            if not self.alive[side]:
                continue
            ledger: Any = mgr.ledger
            assert mgr.num_live == 0, mgr.transfers
            assert ledger.num_blocks == 0
            assert len(mgr.peers) == 0
            total = self.groups * self.blocks
            assert len(self.free[side]) == total, f"{side} leaked blocks"
        self.now += TIMEOUTS.tombstone_s + 1
        for side, mgr in (("P", self.p), ("D", self.d)):
            if self.alive[side]:
                mgr.tick(self.now)
                assert len(mgr.tombstones) == 0
