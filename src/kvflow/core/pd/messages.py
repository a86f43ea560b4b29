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
    for b in hashes:
        h.update(b)
    return h.digest()


@frozen
class Compat:
    """What two engines must agree on for one's KV blocks to be valid in the other's cache."""

    model: str
    dtype: str
    block_size: int
    layout: str
    num_kv_heads: int
    head_dim: int
    num_layers: int
    shard: str
    kvflow_version: str

    def digest(self) -> str:
        """A stable hex digest of every field (the HELLO's compatibility hash)."""
        parts = [
            self.model,
            self.dtype,
            str(self.block_size),
            self.layout,
            str(self.num_kv_heads),
            str(self.head_dim),
            str(self.num_layers),
            self.shard,
            self.kvflow_version,
        ]
        data = b"".join(struct.pack("<I", len(p.encode())) + p.encode() for p in parts)
        return xxhash.xxh3_128_hexdigest(b"kvflow/pd-compat/v1" + data)

    def differences(self, other: Compat) -> list[str]:
        """The names of the fields that differ (empty when compatible)."""
        names = [f.name for f in attrs.fields(Compat)]
        return [n for n in names if getattr(self, n) != getattr(other, n)]


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


@frozen
class Nack:
    transfer_id: str
    epoch: int
    reason: NackReason


@frozen
class Ready:
    """P → D (concurrent flow): the KV of blocks ``[start, stop)`` is fenced and may be sent."""

    transfer_id: str
    epoch: int
    start: int
    stop: int


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
]
