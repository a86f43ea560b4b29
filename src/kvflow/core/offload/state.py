"""Per-request and per-transfer state of the offload manager, and the small helpers over it.

``RequestState`` is what the manager knows of one request (hashes, GPU block table, store
cursors, pinned hit, live transfers); ``LiveTransfer`` is one transfer not yet released and the
refs it holds; ``StoreBatch`` carries blocks from a store policy to the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from attrs import define, field

from kvflow.core.hashing import BlockHash, EngineBlockHashes, HashChain
from kvflow.core.protocol import GroupBlockIds, TransferSpec
from kvflow.core.requests import RequestLike
from kvflow.core.transfer import Transfer

NO_BOUNDARY = 1 << 62
"""A token count beyond any request: the start of a minimum over group boundaries."""

NOTHING: frozenset[Any] = frozenset()


@define(eq=False)
class StoreBatch:
    """The blocks one step (or one finishing request, or one lazy walk) hands to the store,
    before CPU allocation.

    Per group, ``blocks`` maps each hash to its GPU block in the order they were picked (a hash
    is picked once per batch) and ``owners`` lists each block's request in the same order.
    """

    blocks: list[dict[BlockHash, int]]
    owners: list[list[RequestState | None]]
    reqs: list[RequestState] = field(factory=list)

    @classmethod
    def empty(cls, num_groups: int) -> StoreBatch:
        return cls([{} for _ in range(num_groups)], [[] for _ in range(num_groups)])


@define(eq=False)
class PinnedHit:
    """A CPU hit pinned by ``get_num_new_matched_tokens``, waiting for the engine's allocation."""

    num_computed_tokens: int
    num_external_tokens: int
    first: tuple[int, ...]  # per group: first block index to load
    cpu_block_ids: tuple[tuple[int, ...], ...]  # per group: pinned CPU blocks from ``first`` on
    load: tuple[GroupBlockIds, GroupBlockIds] | None = None  # (GPU, CPU) ids once allocated
    fenced: bool = False  # its load is read by the forward of the step that launches it


@define(eq=False)
class RequestState:
    """The manager's state of one request: hashes, GPU block table, store cursors, transfers."""

    request: RequestLike
    hashers: list[HashChain]  # per distinct block size: kvflow's own, or the engine's
    hashing: tuple[HashChain, ...]  # those of ``hashers`` kvflow extends (none: the engine's)
    hash_lists: tuple[Sequence[BlockHash], ...]  # each hasher's live list: one object to touch
    # Per group, the request's GPU block ids; a tuple (its items inline, one object less to
    # reach, cold, on every block completion) of growing lists.
    table: tuple[list[int], ...]
    cursor: list[int]  # per group: blocks already handed to the store policy
    confirmed: int = 0  # tokens whose KV is computed and not speculative
    next_boundary: int = 0  # confirmed-token count at which some group completes a block
    match: PinnedHit | None = None
    # Tokens the engine's own prefix cache held at the last match: their blocks are GPU hits,
    # whose content the engine keeps (it may predate a cache reset).
    gpu_hit: int = 0
    # Live (not yet released) transfers, but for step stores (``LiveTransfer.shared``):
    # registering the request in each would touch every storing request's state twice per store.
    transfers: dict[int, LiveTransfer] = field(factory=dict)
    # The table ``update_state_after_alloc`` validated: the step that schedules the request
    # with these same ids need not check them again (read and cleared by that step).
    checked_table: GroupBlockIds | None = None
    finishing: bool = False  # gone for the engine; state kept until its transfers settle
    delay_free: bool = False  # the engine waits for finished_sending to free its GPU blocks

    def set_request(self, request: RequestLike, hashers: list[HashChain]) -> None:
        """Hash from ``request`` from now on, with ``hashers`` (its own or kvflow's)."""
        self.request = request
        self.hashers = hashers
        self.hashing = own_hashers(hashers)
        self.hash_lists = tuple(h.hashes for h in hashers)

    def hash_confirmed(self) -> None:
        """Extend kvflow's own hashers over the confirmed tokens (an engine's are kept current
        by the engine; not reading the tokens then saves a cold request view per call)."""
        if self.hashing:
            tokens = self.request.all_token_ids
            for hasher in self.hashing:
                hasher.extend_to(tokens, self.confirmed)

    def forget_blocks(self, num_groups: int) -> None:
        """The request's GPU blocks are gone (preempted): an empty table, cursors at 0."""
        self.table = tuple([] for _ in range(num_groups))
        self.cursor = [0] * num_groups
        self.confirmed = 0
        self.next_boundary = 0


@define(eq=False)
class LiveTransfer:
    """One live transfer: its state machine, what the workers see, and the refs it holds."""

    transfer: Transfer
    spec: TransferSpec
    reqs: list[RequestState]  # the requests waiting on it (none for lazy stores)
    hashes: tuple[tuple[BlockHash, ...], ...] = ()  # stores: per group, the hashes being stored
    owners: tuple[tuple[RequestState | None, ...], ...] = ()  # stores: each block's request
    # GPU blocks freed: don't cache theirs (a set once one is; most transfers never need one)
    dropped: AbstractSet[RequestState] = NOTHING
    holds_gpu: bool = False  # holds a ref on its GPU blocks (see TransferLedger.store_refs)
    reported: dict[int, bool] = field(factory=dict)  # rank → success
    reset: bool = False  # abandoned by reset_cache (a load's blocks then become invalid)
    shared: bool = False  # a step's store: not in its requests' ``transfers``
    fenced: bool = False  # a load the launching step's forward reads: no ``finished_recving``


def confirmed_tokens(st: RequestState, end: int) -> int:
    """Tokens whose KV is computed and not speculative: ``end`` capped by the request's tokens."""
    num_tokens = len(st.request.all_token_ids)
    return end if end < num_tokens else num_tokens


def next_boundary(confirmed: int, block_sizes: Sequence[int]) -> int:
    """The smallest token count above ``confirmed`` at which some group completes a block."""
    boundary = NO_BOUNDARY
    for bs in block_sizes:
        end = (confirmed // bs + 1) * bs
        if end < boundary:
            boundary = end
    return boundary


def own_hashers(hashers: Sequence[HashChain]) -> tuple[HashChain, ...]:
    """The hashers kvflow must extend itself: an engine's hashes are kept current by the engine."""
    return tuple(h for h in hashers if not isinstance(h, EngineBlockHashes))


def all_ids(ids: GroupBlockIds) -> Sequence[int]:
    """Every group's block ids in one sequence (the one group's own tuple: no copy)."""
    return ids[0] if len(ids) == 1 else [b for group in ids for b in group]


def take(items: set[Any]) -> frozenset[Any]:
    """The set's items, frozen, and the set emptied (no new frozenset when there are none)."""
    if not items:
        return NOTHING
    out = frozenset(items)
    items.clear()
    return out


__all__ = [
    "NO_BOUNDARY",
    "LiveTransfer",
    "PinnedHit",
    "RequestState",
    "StoreBatch",
    "all_ids",
    "confirmed_tokens",
    "next_boundary",
    "own_hashers",
    "take",
]
