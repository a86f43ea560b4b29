"""What both sides of a PD hand-off share: timeouts, the actions a manager returns, the ledger of
which blocks each hand-off holds, peer liveness and tombstones of ended hand-offs.

The managers are sans-IO: each call takes inputs and the current time and returns a list of
actions for the runtime to carry out (send a message, launch or cancel copies, hand blocks back to
the engine). Nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import Generic, Protocol, TypeVar, overload

from attrs import define, field, frozen

from kvflow.core.logs import get_logger
from kvflow.core.pd.messages import GroupIds, Heartbeat, Message
from kvflow.errors import ConfigError, ProtocolError

log = get_logger("kvflow.pd")


class BlockPairs:
    """One KV cache group's (local block, remote block) pairs of a hand-off, kept as two columns.

    The managers cut both columns from the hand-off's id tuples by slicing, and a transport turns
    each column into an array in one pass, where a tuple per pair would cost a Python object to
    build and another to read for every block. It reads as the sequence of ``(local, remote)``
    pairs and compares equal to that sequence as a tuple."""

    __slots__ = ("local", "remote")

    def __init__(self, local: Sequence[int], remote: Sequence[int]) -> None:
        if len(local) != len(remote):
            raise ProtocolError(
                f"{len(local)} local blocks paired with {len(remote)} remote blocks"
            )
        self.local: tuple[int, ...] = tuple(local)
        self.remote: tuple[int, ...] = tuple(remote)

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> BlockPairs:
        """From ``(local, remote)`` pairs."""
        cols = tuple(zip(*pairs, strict=True))
        return cls(*cols) if cols else cls((), ())

    def __len__(self) -> int:
        return len(self.local)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.local, self.remote, strict=True)

    @overload
    def __getitem__(self, index: int) -> tuple[int, int]: ...
    @overload
    def __getitem__(self, index: slice) -> BlockPairs: ...
    def __getitem__(self, index: int | slice) -> tuple[int, int] | BlockPairs:
        if isinstance(index, slice):
            return BlockPairs(self.local[index], self.remote[index])
        return self.local[index], self.remote[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockPairs):
            return self.local == other.local and self.remote == other.remote
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockPairs({list(self)!r})"


GroupPairs = BlockPairs | tuple[tuple[int, int], ...]
"""One group's pairs: ``BlockPairs`` from the managers, or plain ``(local, remote)`` tuples."""

Pairs = tuple[GroupPairs, ...]
"""Per KV cache group, the (local block, remote block) pairs of one hand-off."""

OP_BITS = 16
"""A transport's wire tag is ``channel << OP_BITS | op``: up to ``1 << OP_BITS`` ops a hand-off
(64 GiB of staged chunks in 1 MiB slots), and the tag stays a positive 32-bit int."""

CHANNELS = 1 << (31 - OP_BITS)
"""Data-plane channels per producer (hand-offs live at once): 32,768."""


ANY_PEER = ""
"""A producer hand-off's peer before it is bound: the router named no D, so the first valid
CLAIM's sender becomes its peer (``ProducerManager``)."""


def _positive(_: object, attribute: object, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        name = getattr(attribute, "name", "?")
        raise ConfigError(f"PDTimeouts.{name} must be a positive number of seconds, got {value!r}")


@frozen
class PDTimeouts:
    """Every deadline of a hand-off, in seconds on the injected clock."""

    prefill_s: float = field(default=60.0, validator=_positive)  # P: PREFILLING
    lease_s: float = field(default=10.0, validator=_positive)  # P: an unclaimed hold (READY)
    claim_s: float = field(default=5.0, validator=_positive)  # D: RESERVED, CLAIMING
    grant_window_s: float = field(default=5.0, validator=_positive)  # GRANTED, both sides
    copy_s: float = field(default=30.0, validator=_positive)  # the longest copy: IN_FLIGHT
    done_s: float = field(default=10.0, validator=_positive)  # P: SENT, waiting for D's DONE
    drain_retry_s: float = field(default=1.0, validator=_positive)  # DRAINING: re-send, re-check
    heartbeat_s: float = field(default=1.0, validator=_positive)
    peer_timeout_s: float = field(default=10.0, validator=_positive)
    tombstone_s: float = field(default=60.0, validator=_positive)  # > the control plane's delay

    @property
    def quarantine_s(self) -> float:
        """After a peer's death, how long its claimed blocks stay out of the pool."""
        return self.grant_window_s + self.copy_s


@frozen
class Send:
    peer: str
    message: Message


@frozen
class LaunchCopies:
    """Start this side's copies of one hand-off on every rank; each rank reports ``copy_done``."""

    transfer_id: str
    epoch: int
    peer: str
    send: bool  # True on P (read local blocks), False on D (write local blocks)
    pairs: Pairs
    channel: int  # the GRANT's channel: both sides' copies of the hand-off match on it


@frozen
class CancelCopies:
    """Stop this side's copies of a hand-off; each launched rank still reports ``copy_done``."""

    transfer_id: str
    epoch: int


@frozen
class FinishedSending:
    """P: the engine may free the request's blocks now (exactly once per hand-off)."""

    transfer_id: str
    block_ids: GroupIds


@frozen
class FinishedRecving:
    """D: the request may run; ``invalid_block_ids`` hold no KV and are recomputed."""

    transfer_id: str
    ok: bool
    invalid_block_ids: GroupIds


@frozen
class FreeBlocks:
    """D: the request is gone; its reserved blocks go back to the pool (exactly once)."""

    transfer_id: str
    block_ids: GroupIds


Action = Send | LaunchCopies | CancelCopies | FinishedSending | FinishedRecving | FreeBlocks


def flat(ids: GroupIds) -> Iterator[tuple[int, int]]:
    """Every (group, block id) of ``ids``, in order, without a Python step per block (a
    16k-token prompt's hand-off names about a thousand)."""
    return chain.from_iterable(zip(repeat(g), group) for g, group in enumerate(ids))


class BlockRefs(Protocol):
    """Where a hand-off's hold becomes references on the engine's GPU blocks: the offload
    manager's ledger (``kvflow.core.offload.holds.GpuHolds``) when PD and the CPU tier share one
    engine, so one object owns every kvflow ref on a block. ``blocks`` are engine block ids."""

    def check(self, key: str, ids: GroupIds, blocks: Sequence[int], *, exclusive: bool) -> None:
        """Raise ``ProtocolError`` (nothing changed) if the hold cannot be taken."""
        ...

    def take(self, key: str, ids: GroupIds, blocks: Sequence[int], *, exclusive: bool) -> None: ...

    def give_back(self, key: str) -> GroupIds: ...


def _twice(ids: GroupIds) -> tuple[int, int] | None:
    """The first (group, block) that ``ids`` names twice, or None."""
    for g, group in enumerate(ids):
        if len(set(group)) != len(group):
            seen: set[int] = set()
            for b in group:
                if b in seen:
                    return (g, b)
                seen.add(b)
    return None


@define
class BlockLedger:
    """Who holds which block: each hand-off's blocks, taken once and given back exactly once.

    ``shared`` (P's): a block may be held by several hand-offs at once, because prefix-cached
    blocks are shared by requests that the engine ref-counts, and sends only read them; D's
    ledger is exclusive (a block receives one hand-off's KV). A manager's ids are wire blocks:
    ``rows_per_block`` of them make one engine block (``row // rows_per_block``), 1 unless the
    peer's block size is smaller. With ``refs`` every hold is also a hold there (in engine
    blocks), checked before anything changes here. Every check and update is a set operation
    over the hand-off's blocks: this runs on P's first-token step and on D's claim."""

    shared: bool = False
    side: str = ""
    rows_per_block: int = 1
    refs: BlockRefs | None = None
    _by_transfer: dict[str, GroupIds] = field(factory=dict)
    _held: set[tuple[int, int]] = field(factory=set)  # an exclusive ledger's held blocks
    _parts: dict[str, list[str]] = field(factory=dict)  # refs' keys of blocks added by ``grow``

    def engine_blocks(self, ids: GroupIds) -> list[int]:
        """The engine blocks ``ids`` lie in, each once, in order."""
        k = self.rows_per_block
        if k == 1 and len(ids) == 1:
            return list(dict.fromkeys(ids[0]))
        return list(dict.fromkeys(b // k for _, b in flat(ids)))

    def _key(self, transfer_id: str) -> str:
        return f"pd-{self.side}/{transfer_id}"

    def check_free(self, transfer_id: str, ids: GroupIds) -> None:
        """Raise ``ProtocolError`` (changing nothing) if ``ids`` cannot be taken for the hand-off."""
        if transfer_id in self._by_transfer:
            raise ProtocolError(f"hand-off {transfer_id!r} already holds blocks")
        if (key := _twice(ids)) is not None:
            raise ProtocolError(f"hand-off {transfer_id!r} names block {key} twice")
        if not self.shared and (clash := self._held.intersection(flat(ids))):
            key = next(k for k in flat(ids) if k in clash)
            raise ProtocolError(f"block {key} is already held by hand-off {self.owner(*key)!r}")
        if self.refs is not None:
            blocks = self.engine_blocks(ids)
            self.refs.check(self._key(transfer_id), ids, blocks, exclusive=not self.shared)

    def take(self, transfer_id: str, ids: GroupIds) -> None:
        self.check_free(transfer_id, ids)
        if self.refs is not None:
            blocks = self.engine_blocks(ids)
            self.refs.take(self._key(transfer_id), ids, blocks, exclusive=not self.shared)
        self._by_transfer[transfer_id] = ids
        if not self.shared:
            self._held.update(flat(ids))

    def grow(self, transfer_id: str, ids: GroupIds) -> None:
        """Hold ``ids``, a superset of what the hand-off holds (a streamed hand-off's blocks
        grow chunk by chunk); the new blocks are a hold of their own on ``refs``."""
        old = self._by_transfer.get(transfer_id)
        if old is None:
            self.take(transfer_id, ids)
            return
        if len(ids) != len(old):
            raise ProtocolError(f"hand-off {transfer_id!r}: {len(ids)} groups, held {len(old)}")
        had_sets = [set(had) for had in old]
        added = tuple(
            tuple(b for b in new if b not in had) for new, had in zip(ids, had_sets, strict=True)
        )
        if not any(added):
            return
        part = f"{transfer_id}#{sum(map(len, old))}"
        self.check_free(part, added)
        if self.refs is not None:
            blocks = self.engine_blocks(added)
            self.refs.take(self._key(part), added, blocks, exclusive=not self.shared)
            self._parts.setdefault(transfer_id, []).append(part)
        self._by_transfer[transfer_id] = tuple(
            had + new for had, new in zip(old, added, strict=True)
        )
        if not self.shared:
            self._held.update(flat(added))

    def attach(self, refs: BlockRefs) -> None:
        """Hold every block through ``refs`` from now on (only while nothing is held)."""
        if self._by_transfer:
            raise ProtocolError(f"{len(self._by_transfer)} hand-offs hold blocks: attach first")
        self.refs = refs

    def give_back(self, transfer_id: str) -> GroupIds:
        ids = self._by_transfer.pop(transfer_id, None)
        if ids is None:
            raise ProtocolError(f"hand-off {transfer_id!r} holds no blocks (given back twice?)")
        if self.refs is not None:
            self.refs.give_back(self._key(transfer_id))
            for part in self._parts.pop(transfer_id, ()):
                self.refs.give_back(self._key(part))
        if not self.shared:
            self._held.difference_update(flat(ids))
        return ids

    def holds(self, transfer_id: str) -> bool:
        return transfer_id in self._by_transfer

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held (counted on demand: a diagnostic, not on the hot path)."""
        if not self.shared:
            return len(self._held)
        return len(set(chain.from_iterable(map(flat, self._by_transfer.values()))))

    def owner(self, group: int, block: int) -> str | None:
        """The hand-off holding the block that took it first, or None."""
        for tid, ids in self._by_transfer.items():
            if group < len(ids) and block in ids[group]:
                return tid
        return None


@define
class Peers:
    """Liveness of the peers this side is in a claimed hand-off with: heartbeats out, silence in."""

    engine_id: str
    timeouts: PDTimeouts
    _heard: dict[str, float] = field(factory=dict)
    _beat: dict[str, float] = field(factory=dict)

    def heard(self, peer: str, now: float) -> None:
        if peer in self._heard:
            self._heard[peer] = max(self._heard[peer], now)

    def watch(self, peer: str, now: float) -> None:
        """Start watching ``peer`` (a claim names it); a peer already watched keeps its times."""
        self._heard.setdefault(peer, now)
        self._beat.setdefault(peer, now)

    def unwatch_except(self, active: set[str]) -> None:
        for peer in [p for p in self._heard if p not in active]:
            del self._heard[peer]
            del self._beat[peer]

    def tick(self, now: float) -> tuple[list[Send], list[str]]:
        """Heartbeats due now, and the peers silent past the timeout (no longer watched)."""
        sends: list[Send] = []
        lost: list[str] = []
        for peer, heard in list(self._heard.items()):
            if now - heard > self.timeouts.peer_timeout_s:
                lost.append(peer)
                del self._heard[peer]
                del self._beat[peer]
            elif now - self._beat[peer] >= self.timeouts.heartbeat_s:
                self._beat[peer] = now
                sends.append(Send(peer, Heartbeat("", 0, self.engine_id)))
        return sends, lost

    def __len__(self) -> int:
        return len(self._heard)


@define
class Tombstones:
    """(transfer_id, epoch) of ended or aborted hand-offs, kept ``tombstone_s`` so a late or
    duplicated message about them is recognised instead of starting anything."""

    ttl_s: float
    _until: dict[tuple[str, int], float] = field(factory=dict)

    def add(self, transfer_id: str, epoch: int, now: float) -> None:
        self._until[(transfer_id, epoch)] = now + self.ttl_s

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._until

    def expire(self, now: float) -> None:
        for key in [k for k, t in self._until.items() if t <= now]:
            del self._until[key]

    def __len__(self) -> int:
        return len(self._until)


class HandoffRecord(Protocol):
    """What both sides' per-hand-off records have."""

    transfer_id: str
    epoch: int
    peer: str
    deadline: float
    launched: bool
    settled: set[int]
    chunks: dict[int, set[int]]


R = TypeVar("R", bound=HandoffRecord)


class HandoffSide(Generic[R]):
    """The bookkeeping both managers share: live hand-offs, the block ledger, peers, tombstones,
    and the bounded copy slots (``max_inflight`` launches at once, the rest queued in order)."""

    side = ""

    def __init__(
        self,
        engine_id: str,
        *,
        world_size: int = 1,
        timeouts: PDTimeouts | None = None,
        max_inflight: int = 4,
    ) -> None:
        if world_size < 1 or max_inflight < 1:
            raise ConfigError(
                f"world_size and max_inflight must be positive, got {world_size}, {max_inflight}"
            )
        self.engine_id = engine_id
        self.world_size = world_size
        self.timeouts = timeouts or PDTimeouts()
        self.max_inflight = max_inflight
        self.transfers: dict[str, R] = {}
        self.ledger = BlockLedger(side=self.side)
        self.peers = Peers(engine_id, self.timeouts)
        self.tombstones = Tombstones(self.timeouts.tombstone_s)
        self._waiting: deque[str] = deque()  # granted, waiting for a copy slot, in grant order
        self._inflight: set[str] = set()  # holding a slot: launched, not every rank settled

    @property
    def num_live(self) -> int:
        return len(self.transfers)

    def _settle_rank(self, transfer_id: str, epoch: int, rank: int, channel: int = 0) -> R:
        """Record rank ``rank``'s copies of a launched hand-off as settled (those of the chunk
        pushed on ``channel``, for a streamed hand-off); frees the slot once nothing of the
        hand-off runs. Raises ``ProtocolError`` (nothing changed) for a bad report."""
        t = self.transfers.get(transfer_id)
        ranks = None
        if t is not None and t.epoch == epoch:
            ranks = t.chunks.get(channel) if channel in t.chunks else t.settled
            if ranks is t.settled and not t.launched:
                ranks = None
        if t is None or ranks is None:
            raise ProtocolError(f"{self.side}: copy_done for no running copy: {transfer_id!r}")
        if not 0 <= rank < self.world_size or rank in ranks:
            raise ProtocolError(
                f"{self.side}: copy_done rank {rank} unknown or reported twice ({transfer_id!r})"
            )
        ranks.add(rank)
        if not self._copies_running(t):
            self._inflight.discard(transfer_id)
        return t

    def _copies_running(self, t: R) -> bool:
        """Whether any rank still copies for the hand-off (its launch or a streamed chunk)."""
        n = self.world_size
        return (t.launched and len(t.settled) < n) or any(len(r) < n for r in t.chunks.values())

    def _unqueue(self, t: R) -> None:
        if t.transfer_id in self._waiting:
            self._waiting.remove(t.transfer_id)

    def _due(self, now: float) -> Iterator[R]:
        """The live hand-offs whose deadline passed (each still live when yielded)."""
        self.tombstones.expire(now)
        for t in [t for t in self.transfers.values() if t.deadline <= now]:
            if self.transfers.get(t.transfer_id) is t:
                yield t

    def _next_launch(self, now: float) -> R | None:
        """The next queued hand-off if a copy slot is free (the slot is taken for it)."""
        if not self._waiting or len(self._inflight) >= self.max_inflight:
            return None
        t = self.transfers[self._waiting.popleft()]
        t.launched = True
        t.deadline = now + self.timeouts.copy_s
        self._inflight.add(t.transfer_id)
        return t

    def _forget(self, t: R, now: float, *, watching: Callable[[R], bool]) -> None:
        """Drop an ended hand-off: tombstone it, unqueue it, stop watching idle peers."""
        del self.transfers[t.transfer_id]
        self.tombstones.add(t.transfer_id, t.epoch, now)
        self._unqueue(t)
        self.peers.unwatch_except({x.peer for x in self.transfers.values() if watching(x)})

    def _tick_peers(
        self, now: float, peer_lost: Callable[[str, float], list[Action]]
    ) -> list[Action]:
        sends, lost = self.peers.tick(now)
        out: list[Action] = list(sends)
        for peer in lost:
            out.extend(peer_lost(peer, now))
        return out


def drop_stale(side: str, peer: str, message: Message, why: str) -> None:
    """Log a message that matches no live hand-off (unknown, stale epoch, wrong state); drop it."""
    log.info(
        "pd_message_dropped",
        side=side,
        peer=peer,
        message=type(message).__name__,
        transfer_id=message.transfer_id,
        epoch=message.epoch,
        why=why,
    )


__all__ = [
    "ANY_PEER",
    "Action",
    "BlockLedger",
    "BlockPairs",
    "BlockRefs",
    "CancelCopies",
    "FinishedRecving",
    "FinishedSending",
    "FreeBlocks",
    "GroupPairs",
    "HandoffRecord",
    "HandoffSide",
    "LaunchCopies",
    "PDTimeouts",
    "Pairs",
    "Peers",
    "Send",
    "Tombstones",
    "drop_stale",
    "flat",
]
