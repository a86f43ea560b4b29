"""The PD control plane's messages: typed, frozen, each naming its hand-off by
``(transfer_id, epoch)``.

``transfer_id`` is the router's id of one prefill → decode hand-off (never an engine-local request
id); ``epoch`` counts the router's attempts at that id, so a message of an earlier attempt is
recognised as stale. Per-peer messages (HELLO, HELLO_ACK, HEARTBEAT) carry ``transfer_id=""``
and the sender's incarnation as ``epoch``. The wire encoding lives in ``kvflow.runtime`` (msgspec);
these structs are what the sans-IO managers take and return.
"""

from __future__ import annotations

import enum
import struct

import attrs
import xxhash
from attrs import field, frozen

from kvflow.core.hashing import BlockHash
from kvflow.core.pd.tp import TP_MAPPED_LAYOUTS, tp_refusal
from kvflow.errors import ConfigError

GroupIds = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group: ``ids[g][i]`` is the i-th block of group ``g``."""

PEER_TRANSFER = ""
"""The ``transfer_id`` of messages about a peer rather than one hand-off."""


def _group_ids(value: object) -> GroupIds:
    groups = tuple(tuple(int(b) for b in g) for g in value)  # type: ignore[attr-defined]
    for g in groups:
        if any(b < 0 for b in g):
            raise ConfigError(f"block ids must be non-negative, got {g}")
    return groups


def hashes_digest(hashes: tuple[BlockHash, ...]) -> bytes:
    """One 16-byte digest of a chain of block hashes (CLAIM carries it instead of the chain)."""
    h = xxhash.xxh3_128()
    h.update(struct.pack("<I", len(hashes)))
    h.update(b"".join(hashes))  # one call: the same digest as one update per hash
    return h.digest()


_STRICT = ("model", "dtype", "layout", "num_kv_heads", "head_dim", "num_layers", "kvflow_version")
"""The ``Compat`` fields two engines must have equal; block size and shard are mapped."""


def tp_size_of(shard: str) -> int:
    """The TP size of a ``shard`` string (``"tp2"``, ``"tp2/0"``); ``ConfigError`` otherwise."""
    head = shard.split("/", 1)[0]
    if not head.startswith("tp") or not head[2:].isdigit() or int(head[2:]) < 1:
        raise ConfigError(f"shard {shard!r}: expected 'tp<size>' or 'tp<size>/<rank>'")
    return int(head[2:])


@frozen
class Compat:
    """What two engines must agree on for one's KV blocks to be valid in the other's cache.

    ``wire_block_size`` is the unit a hand-off moves (0: the block size): each side's blocks
    are whole numbers of it, so engines whose block sizes differ (16 and 32) exchange KV when
    both name the same unit (16). ``num_kv_heads`` is the model's, not a rank's."""

    model: str
    dtype: str
    block_size: int
    layout: str
    num_kv_heads: int
    head_dim: int
    num_layers: int
    shard: str
    kvflow_version: str
    wire_block_size: int = 0

    def __attrs_post_init__(self) -> None:
        tp_size_of(self.shard)
        if self.block_size < 1 or self.wire < 1 or self.block_size % self.wire:
            raise ConfigError(
                f"block size {self.block_size} must be a positive multiple of the wire block "
                f"size {self.wire}"
            )

    @property
    def wire(self) -> int:
        """The hand-off's unit in tokens."""
        return self.wire_block_size or self.block_size

    @property
    def tp_size(self) -> int:
        return tp_size_of(self.shard)

    def digest(self) -> str:
        """A stable hex digest of what two peers must share (the HELLO's compatibility hash):
        the strict fields and the wire unit, not the block size or the TP size."""
        parts = [str(getattr(self, n)) for n in _STRICT] + [str(self.wire)]
        data = b"".join(struct.pack("<I", len(p.encode())) + p.encode() for p in parts)
        return xxhash.xxh3_128_hexdigest(b"kvflow/pd-compat/v2" + data)

    def differences(self, other: Compat) -> list[str]:
        """The names of the fields that differ (empty when identical)."""
        names = [f.name for f in attrs.fields(Compat)]
        return [n for n in names if getattr(self, n) != getattr(other, n)]

    def refusals(self, other: Compat) -> list[str]:
        """Why this engine cannot exchange KV with ``other`` (empty when it can): a strict field
        that differs, wire units that differ, or TP sizes that differ where the layout does not
        map kv heads between them or a size cannot hold the model's kv heads (different TP
        sizes are mapped head slice by head slice, ``core.pd.tp``)."""
        out = [n for n in _STRICT if getattr(self, n) != getattr(other, n)]
        if self.wire != other.wire:
            out.append(
                f"wire_block_size ({self.wire} vs {other.wire}; block sizes {self.block_size} "
                f"and {other.block_size} need one unit dividing both)"
            )
        if self.tp_size != other.tp_size:
            why = None
            if self.layout not in TP_MAPPED_LAYOUTS:
                why = f"layout {self.layout!r} does not map kv heads between TP sizes"
            for side in (self, other):
                why = why or tp_refusal(side.num_kv_heads, side.tp_size, side.layout)
            if why is not None:
                out.append(f"shard (tp{self.tp_size} vs tp{other.tp_size}: {why})")
        return out


class NackReason(enum.StrEnum):
    UNKNOWN_TRANSFER = "unknown_transfer"  # P holds nothing under this id (or never did)
    EXPIRED = "expired"  # P's unclaimed hold expired, or D aborted this attempt before
    HASH_MISMATCH = "hash_mismatch"  # the claim's digest is not P's prompt: a different request
    SHAPE = "shape"  # the claimed blocks do not fit P's blocks
    INCOMPATIBLE = "incompatible"  # the peers' compatibility hashes differ


class DoneStatus(enum.StrEnum):
    OK = "ok"  # sender: every write finished; receiver: verified and committed
    FAILED = "failed"  # the hand-off ended without usable KV; the sender touches nothing more


@frozen
class Hello:
    """First message to a peer: who I am and what my KV looks like (answered by HELLO_ACK)."""

    transfer_id: str
    epoch: int
    engine_id: str
    address: str  # the sender's control-plane endpoint, for the answer
    compat_hash: str
    compat: Compat
    tp_size: int
    endpoints: tuple[str, ...]  # one data-plane endpoint per rank


@frozen
class HelloAck:
    transfer_id: str
    epoch: int
    engine_id: str
    address: str
    compat_hash: str
    compat: Compat
    tp_size: int
    endpoints: tuple[str, ...]
    accepted: bool
    reason: str = ""


@frozen
class Claim:
    """D → P: these reserved blocks of mine will receive your blocks from ``start[g]`` on."""

    transfer_id: str
    epoch: int
    block_ids: GroupIds = field(converter=_group_ids)
    start: tuple[int, ...]  # per group: the index in P's blocks of the first claimed block
    num_tokens: int
    digest: bytes  # hashes_digest of the prompt's chained block hashes, as D computed them


@frozen
class Grant:
    """P → D: granted; these are my blocks and their hashes; use the grant within the window."""

    transfer_id: str
    epoch: int
    block_ids: GroupIds = field(converter=_group_ids)
    block_hashes: tuple[BlockHash, ...]
    window_s: float  # a duration, so clock skew between the engines errs long
    channel: int = 0  # P's data-plane channel for this hand-off, unique among its live ones
    # The concurrent flow: granted while P prefills (``block_ids`` empty); P pushes each chunk
    # as its KV is fenced, announcing it with READY.
    streaming: bool = False


@frozen
class Nack:
    transfer_id: str
    epoch: int
    reason: NackReason


@frozen
class Ready:
    """P → D (concurrent flow): the KV of claimed blocks ``[start, stop)`` (indexes into the
    CLAIM's blocks, the same in every group) is fenced and P's push of it runs on ``channel``."""

    transfer_id: str
    epoch: int
    start: int
    stop: int
    channel: int = 0


@frozen
class Done:
    transfer_id: str
    epoch: int
    status: DoneStatus


@frozen
class Abort:
    """Stop this hand-off; answer with ABORT_ACK once nothing of yours touches my blocks."""

    transfer_id: str
    epoch: int
    reason: str


@frozen
class AbortAck:
    transfer_id: str
    epoch: int


@frozen
class Release:
    """D → P before any claim: D gave up (rejected or aborted the request); free your hold."""

    transfer_id: str
    epoch: int


@frozen
class Heartbeat:
    transfer_id: str
    epoch: int
    engine_id: str


Message = (
    Hello | HelloAck | Claim | Grant | Nack | Ready | Done | Abort | AbortAck | Release | Heartbeat
)
"""Every control-plane message."""

MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    HelloAck,
    Claim,
    Grant,
    Nack,
    Ready,
    Done,
    Abort,
    AbortAck,
    Release,
    Heartbeat,
)

__all__ = [
    "MESSAGE_TYPES",
    "PEER_TRANSFER",
    "Abort",
    "AbortAck",
    "Claim",
    "Compat",
    "Done",
    "DoneStatus",
    "Grant",
    "GroupIds",
    "Hello",
    "HelloAck",
    "Message",
    "Nack",
    "NackReason",
    "Ready",
    "Release",
    "hashes_digest",
    "tp_size_of",
]
