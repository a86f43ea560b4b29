"""A pool of fixed-size KV blocks for one tier (the engine's GPU cache or kvflow's CPU tier).

Blocks carry ref counts. Free blocks sit in an intrusive doubly linked list with sentinels, in
eviction order: the head is evicted first. A freed block that holds a cached hash goes to the tail
(least recently used first out); a freed block with no hash goes to the head (nothing to lose).
``get_new_blocks`` takes from the head and evicts the hash of any cached block it takes; a pool
built with ``ascending_runs`` hands those same blocks out in ascending id order, so that a CPU tier's
store lands in contiguous runs (fewer, larger copies) while eviction stays exactly LRU.

Every mutating call validates all its arguments before changing anything, so a misuse raises
``BlockPoolError`` and leaves the pool exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any, NoReturn

from attrs import define, frozen

from kvflow.core.hashing import BlockHash
from kvflow.errors import BlockPoolError, ConfigError


@define(eq=False, weakref_slot=False)
class Block:
    """One block of a tier. Slotted: pools hold 10^5-10^6 of these."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Intrusive free-list links; both None while the block is in use.
    prev_free: Block | None = None
    next_free: Block | None = None

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0


class FreeBlockQueue:
    """Doubly linked list of free blocks with head/tail sentinels: O(1) remove, append, popleft."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self.num_free = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise BlockPoolError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockPoolError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: Block) -> None:
        first = self._head.next_free
        assert first is not None
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free += 1

    # The two batch operations below do the pool's per-block bookkeeping (ref counts, the hash
    # map) in the same pass as the relinking: the blocks are cold, and a second pass over them
    # (or a list of them) costs more than the rest (docs/benchmarks.md, issue 19).

    def claim_front(
        self, n: int, cached: dict[BlockHash, Block], *, record: bool = True
    ) -> tuple[list[int], list[BlockHash]]:
        """Unlink the first ``n`` blocks (the caller checked there are that many) in one relink
        of the head and give each a ref count of 1, dropping its hash from ``cached``. Returns
        their ids in eviction order and the hashes evicted (none listed unless ``record``)."""
        out: list[int] = []
        evicted: list[BlockHash] = []
        head = self._head
        block = head.next_free
        for _ in range(n):
            assert block is not None
            h = block.block_hash
            if h is not None:
                if record:
                    evicted.append(h)
                del cached[h]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block.block_id)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        head.next_free = block
        block.prev_free = head
        self.num_free -= n
        return out, evicted

    def release_owned(
        self,
        blocks: Sequence[Block],
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash | None],
        cached: dict[BlockHash, Block],
        on_double_free: Callable[[int], NoReturn],
    ) -> int:
        """Drop one ref on each listed block, in reverse order, caching (in ``cached``) those
        whose hash is not None and not held by another block; blocks reaching zero join the
        queue, hashed at the tail as one run, unhashed at the head. Returns how many were
        cached. A block without a ref calls ``on_double_free`` (which raises) after what came
        before it is linked in."""
        # The hashed blocks join the tail as one run (no call per block); unhashed ones go to
        # the head afterwards, which commutes with appending at the tail.
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        unhashed: list[Block] = []
        n = appended = 0
        bad = -1
        for block_id, h in zip(reversed(block_ids), reversed(block_hashes), strict=True):
            block = blocks[block_id]
            refs = block.ref_cnt - 1
            if refs < 0:
                bad = block_id
                break
            if h is not None and h not in cached:
                block.block_hash = h
                cached[h] = block
                n += 1
            block.ref_cnt = refs
            if refs == 0:
                if block.block_hash is None:
                    unhashed.append(block)
                else:
                    last.next_free = block
                    block.prev_free = last
                    last = block
                    appended += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free += appended
        for block in unhashed:
            self.appendleft(block)
        if bad >= 0:
            on_double_free(bad)
        return n

    def first(self) -> Block | None:
        """The block that would be evicted next, or None."""
        block = self._head.next_free
        return None if block is self._tail else block

    def next_of(self, block: Block) -> Block | None:
        """The block after ``block`` in eviction order, or None at the end (or if not free)."""
        nxt = block.next_free
        return None if nxt is None or nxt is self._tail else nxt

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free


@frozen
class StoredBlockInfo:
    """What a caller knows of a block it caches: its parent's hash (None for a first block), its
    tokens and whose block it was (an opaque request object), for KV-aware routers."""

    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    request: object | None = None


@frozen
class BlockStored:
    """Blocks entered the prefix cache (one event per ``cache`` or ``release_owned`` call);
    ``infos``: per block, what the caller described (empty when it described nothing)."""

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    infos: tuple[StoredBlockInfo, ...] = ()


@frozen
class BlockRemoved:
    """Hashes left the prefix cache (evicted or dropped)."""

    block_hashes: tuple[BlockHash, ...]


@frozen
class AllBlocksCleared:
    """The prefix cache was reset."""


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


def check_cache_input(
    name: str,
    block_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
    refs: Callable[[int], int],
    held: Callable[[int], bool],
) -> None:
    """``cache``'s checks, shared by both pools: as many hashes as blocks, each block in use
    (``refs``), not cached (``held``) nor listed twice, each hash bytes."""
    if len(block_ids) != len(block_hashes):
        raise BlockPoolError(f"{name}: {len(block_ids)} blocks but {len(block_hashes)} hashes")
    seen: set[int] = set()
    for b, h in zip(block_ids, block_hashes, strict=True):
        if refs(b) == 0:
            raise BlockPoolError(f"{name}: cannot cache free block {b}")
        if held(b) or b in seen:
            raise BlockPoolError(f"{name}: block {b} is already cached")
        if not isinstance(h, bytes):
            raise BlockPoolError(f"{name}: block hash must be bytes, got {type(h).__name__}")
        seen.add(b)


def stored_event(
    block_ids: Sequence[int], block_hashes: Sequence[BlockHash], done: Sequence[bool]
) -> BlockStored:
    """The ``BlockStored`` of a ``cache`` call: the blocks it cached (``done``)."""
    stored = [(b, h) for b, h, ok in zip(block_ids, block_hashes, done, strict=True) if ok]
    return BlockStored(tuple(h for _, h in stored), tuple(b for b, _ in stored))


def double_free_error(name: str, block_id: int, refs: int, count: int) -> BlockPoolError:
    return BlockPoolError(
        f"{name}: double free of block {block_id} (ref count {refs}, freeing {count})"
    )


class PrefixCacheQueries:
    """What both pools (``BlockPool``, the CPU tier's ``RunBlockPool``) answer alike from their
    hash map (``_cached``, hash → block or id) and their event list."""

    __slots__ = ()
    _cached: dict[BlockHash, Any]
    _events: list[PoolEvent]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def is_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self._cached

    @property
    def cached_hashes(self) -> Container[BlockHash]:
        """The hashes cached now (live, read-only use): ``h in pool.cached_hashes`` is
        ``is_cached(h)`` without a call, for loops over many blocks."""
        return self._cached

    def take_events(self) -> list[PoolEvent]:
        """Drain the events recorded since the last call."""
        events = list(self._events)
        self._events.clear()
        return events


class BlockPool(PrefixCacheQueries):
    """Ref-counted blocks, an LRU free queue and a hash → block prefix cache for one tier."""

    __slots__ = (
        "_cached",
        "_events",
        "ascending_runs",
        "blocks",
        "enable_events",
        "free_queue",
        "name",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        name: str = "pool",
        enable_events: bool = False,
        ascending_runs: bool = False,
    ) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"{name}: num_blocks must be positive, got {num_blocks}")
        self.name = name
        self.ascending_runs = ascending_runs
        """``get_new_blocks`` returns its blocks sorted by id: the same blocks (the first ``n``
        in eviction order), in the order that makes the most contiguous runs. A store freed in
        reverse joins the free queue as one descending run and so comes back as one run."""
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.enable_events = enable_events
        self._events: list[PoolEvent] = []

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.free_queue.num_free / len(self.blocks)

    def block(self, block_id: int) -> Block:
        """The block with this id; raises ``BlockPoolError`` for an unknown id."""
        if type(block_id) is not int or not 0 <= block_id < len(self.blocks):
            raise BlockPoolError(f"{self.name}: unknown block id {block_id!r}")
        return self.blocks[block_id]

    def _lookup(self, block_ids: Iterable[int]) -> list[Block]:
        """``block`` for each id, validated before any is returned (one call for many ids)."""
        # kvflow passes tuples and lists: no copy of those.
        ids = block_ids if isinstance(block_ids, tuple | list) else list(block_ids)
        n = len(self.blocks)
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < n:
                raise BlockPoolError(f"{self.name}: unknown block id {block_id!r}")
        blocks = self.blocks
        return [blocks[i] for i in ids]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Id of the block caching ``block_hash``, or None."""
        block = self._cached.get(block_hash)
        return None if block is None else block.block_id

    def find_longest_prefix(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """Ids of the cached blocks for the longest prefix of ``block_hashes`` (does not touch)."""
        out: list[int] = []
        cached = self._cached
        for h in block_hashes:
            block = cached.get(h)
            if block is None:
                break
            out.append(block.block_id)
        return out

    # ---- mutations -----------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1), evicting the least recently used cached ones; in
        eviction order, or ascending by id with ``ascending_runs``."""
        if n < 0:
            raise BlockPoolError(f"{self.name}: cannot allocate {n} blocks")
        if n > self.free_queue.num_free:
            raise BlockPoolError(
                f"{self.name}: asked for {n} blocks, only {self.free_queue.num_free} free"
            )
        out, evicted = self.free_queue.claim_front(n, self._cached, record=self.enable_events)
        if self.ascending_runs:
            out.sort()
        if evicted and self.enable_events:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block, taking free ones out of the free queue (a cache hit)."""
        blocks = self._lookup(block_ids)
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def touch_cached(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """``touch`` of the blocks caching ``block_hashes`` (a hit being pinned), in one pass
        and without id checks (the blocks are the pool's own); returns their ids. Every hash
        must be cached: else ``BlockPoolError``, nothing touched."""
        cached = self._cached
        try:
            blocks = [cached[h] for h in block_hashes]
        except KeyError:
            raise BlockPoolError(f"{self.name}: a hash to touch is not cached") from None
        queue = self.free_queue
        for block in blocks:
            if block.ref_cnt == 0:
                prev, nxt = block.prev_free, block.next_free
                assert prev is not None, "a free block off the free queue"
                assert nxt is not None, "a free block off the free queue"
                prev.next_free = nxt
                nxt.prev_free = prev
                block.prev_free = block.next_free = None
                queue.num_free -= 1
            block.ref_cnt += 1
        return tuple([block.block_id for block in blocks])

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed block; blocks reaching zero join the free queue in order.

        Callers free a request's blocks in reverse so its tail blocks are evicted first.
        """
        blocks = self._lookup(block_ids)
        # Blocks hash by identity: a set of them, without an int per block for its id.
        if len(set(blocks)) == len(blocks):
            # Each block once (the usual case): a ref count of 1 is enough.
            for block in blocks:
                if block.ref_cnt < 1:
                    self._double_free(block.block_id, 1)
        else:
            want: dict[int, int] = {}
            for block in blocks:
                want[block.block_id] = want.get(block.block_id, 0) + 1
            for bid, count in want.items():
                if self.blocks[bid].ref_cnt < count:
                    self._double_free(bid, count)
        queue = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def free_owned(self, block_ids: Sequence[int]) -> None:
        """``free`` for a caller that holds one reference on each of these distinct, valid ids
        (kvflow's manager releasing a transfer's CPU blocks): no id checks, one pass."""
        # ``release_owned`` with nothing to cache: it walks the ids in reverse, so reverse them.
        ids = block_ids if isinstance(block_ids, tuple | list) else list(block_ids)
        self.free_queue.release_owned(
            self.blocks, ids[::-1], [None] * len(ids), self._cached, self._double_free_one
        )

    def _double_free_one(self, block_id: int) -> NoReturn:
        self._double_free(block_id, 1)

    def _double_free(self, block_id: int, count: int) -> NoReturn:
        raise double_free_error(self.name, block_id, self.blocks[block_id].ref_cnt, count)

    def cache(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Enter in-use blocks into the prefix cache under the given hashes.

        Returns, per block, whether it was cached: a hash already held by another block is left
        with that block (the new block stays uncached and is evicted first once freed).
        """
        blocks = self._lookup(block_ids) if len(block_ids) == len(block_hashes) else []
        every = self.blocks
        check_cache_input(
            self.name,
            block_ids,
            block_hashes,
            lambda b: every[b].ref_cnt,
            lambda b: every[b].block_hash is not None,
        )
        done: list[bool] = []
        cached = self._cached
        for block, h in zip(blocks, block_hashes, strict=True):
            if h in cached:
                done.append(False)
                continue
            block.block_hash = h
            cached[h] = block
            done.append(True)
        if self.enable_events and True in done:
            self._events.append(stored_event([b.block_id for b in blocks], block_hashes, done))
        return done

    def release_owned(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash | None],
        infos: Sequence[StoredBlockInfo] | None = None,
    ) -> int:
        """``cache`` of the blocks whose hash is not None, then ``free_owned`` of all of them in
        reverse order (a committed store's CPU blocks, fresh from ``get_new_blocks``: in use and
        uncached), in one pass and without per-block checks. Returns how many were cached. The
        hashes must be distinct (a store's are): the pass caches in reverse order, so of two
        blocks with one hash the last would win. ``infos`` (per block) go into the event."""
        if len(block_ids) != len(block_hashes):
            raise BlockPoolError(
                f"{self.name}: {len(block_ids)} blocks but {len(block_hashes)} hashes"
            )
        blocks = self.blocks
        cached = self._cached
        n = self.free_queue.release_owned(
            blocks, block_ids, block_hashes, cached, self._double_free_one
        )
        if n and self.enable_events:
            # The blocks cached above, in block order (the pass ran in reverse).
            picked: list[int] = []
            hashes: list[BlockHash] = []
            for i, (b, h) in enumerate(zip(block_ids, block_hashes, strict=True)):
                if h is not None and cached.get(h) is blocks[b]:
                    picked.append(i)
                    hashes.append(h)
            self._events.append(
                BlockStored(
                    tuple(hashes),
                    tuple(block_ids[i] for i in picked),
                    () if infos is None else tuple(infos[i] for i in picked),
                )
            )
        return n

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each listed block (e.g. its data turned out invalid)."""
        blocks = self._lookup(block_ids)
        removed: list[BlockHash] = []
        for block in blocks:
            h = block.block_hash
            if h is None:
                continue
            del self._cached[h]
            block.block_hash = None
            removed.append(h)
            if block.ref_cnt == 0:
                # An unhashed free block belongs at the head: it has nothing left to lose.
                self.free_queue.remove(block)
                self.free_queue.appendleft(block)
        if removed and self.enable_events:
            self._events.append(BlockRemoved(tuple(removed)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False, changes nothing) while blocks are in use."""
        if self.free_queue.num_free != len(self.blocks):
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True


__all__ = [
    "AllBlocksCleared",
    "Block",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeBlockQueue",
    "PoolEvent",
    "PrefixCacheQueries",
    "StoredBlockInfo",
    "check_cache_input",
    "double_free_error",
    "stored_event",
]
