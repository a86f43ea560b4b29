"""Tests of the block pool: allocation, LRU eviction, prefix cache, events, typed misuse errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.core.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored
from kvflow.core.hashing import ROOT_HASH, hash_block
from kvflow.errors import BlockPoolError, ConfigError

Snapshot = tuple[list[int], list[bytes | None], list[int], dict[bytes, int]]


def h(i: int) -> bytes:
    return hash_block(ROOT_HASH, [i])


def snapshot(pool: BlockPool) -> Snapshot:
    return (
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        {bh: pool.get_cached_block(bh) or 0 for b in pool.blocks if (bh := b.block_hash)},
    )


def test_new_pool_hands_out_blocks_in_order() -> None:
    """A fresh pool allocates ids 0.. in order with ref count 1."""
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_freed_cached_blocks_are_evicted_least_recently_used_first() -> None:
    """Hashed blocks join the tail when freed, so the first freed is the first evicted."""
    pool = BlockPool(3, enable_events=True)
    ids = pool.get_new_blocks(3)
    pool.cache(ids, [h(0), h(1), h(2)])
    pool.free([1])
    pool.free([0])
    pool.free([2])
    assert [b.block_id for b in pool.free_queue] == [1, 0, 2]
    pool.take_events()
    assert pool.get_new_blocks(2) == [1, 0]
    assert not pool.is_cached(h(1))
    assert not pool.is_cached(h(0))
    assert pool.is_cached(h(2))
    assert pool.take_events() == [BlockRemoved((h(1), h(0)))]


def test_unhashed_freed_blocks_go_to_the_head() -> None:
    """A freed block with no hash is reused before any cached block is evicted."""
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache([a], [h(0)])
    pool.free([a])
    pool.free([b])
    assert pool.free_queue.first() is pool.block(b)
    assert pool.get_new_blocks(1) == [b]
    assert pool.is_cached(h(0))
    assert c == 2


def test_touch_pins_a_cached_block_against_eviction() -> None:
    """A touched (hit) block leaves the free queue and survives allocations of every other block."""
    pool = BlockPool(3)
    ids = pool.get_new_blocks(3)
    pool.cache(ids, [h(0), h(1), h(2)])
    pool.free(ids)
    hit = pool.find_longest_prefix([h(0), h(1), h(9)])
    assert hit == [0, 1]
    pool.touch(hit)
    assert pool.get_new_blocks(1) == [2]
    with pytest.raises(BlockPoolError, match="only 0 free"):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(h(0)) == 0
    pool.free(hit)
    assert pool.num_free_blocks == 2


def test_longest_prefix_stops_at_first_miss() -> None:
    """Lookup returns the cached prefix only, never blocks after a gap."""
    pool = BlockPool(4)
    ids = pool.get_new_blocks(3)
    pool.cache([ids[0], ids[2]], [h(0), h(2)])
    assert pool.find_longest_prefix([h(0), h(1), h(2)]) == [ids[0]]
    assert pool.find_longest_prefix([h(5)]) == []


def test_double_free_raises_and_leaves_pool_unchanged() -> None:
    """Freeing a block more times than it is referenced raises and changes nothing."""
    pool = BlockPool(4)
    ids = pool.get_new_blocks(2)
    pool.free([ids[0]])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="double free of block 0"):
        pool.free([ids[1], ids[0]])
    with pytest.raises(BlockPoolError, match="double free of block 1"):
        pool.free([ids[1], ids[1]])
    assert snapshot(pool) == before


@pytest.mark.parametrize("bad", [-1, 4, 99, "1", 1.0, None])
def test_unknown_block_ids_raise_and_leave_pool_unchanged(bad: object) -> None:
    """touch/free/cache/uncache of an unknown id raise BlockPoolError and change nothing."""
    pool = BlockPool(4)
    ids = pool.get_new_blocks(2)
    before = snapshot(pool)
    calls: list[Callable[[], object]] = [
        lambda: pool.touch([ids[0], bad]),  # type: ignore[list-item]
        lambda: pool.free([ids[0], bad]),  # type: ignore[list-item]
        lambda: pool.cache([ids[0], bad], [h(0), h(1)]),  # type: ignore[list-item]
        lambda: pool.uncache([bad]),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(BlockPoolError, match="unknown block id"):
            call()
        assert snapshot(pool) == before


def test_caching_a_block_twice_raises_and_leaves_pool_unchanged() -> None:
    """A block already holding a hash cannot be cached again, in one call or two."""
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache([a], [h(0)])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="already cached"):
        pool.cache([b, a], [h(1), h(2)])
    with pytest.raises(BlockPoolError, match="already cached"):
        pool.cache([b, b], [h(1), h(2)])
    assert snapshot(pool) == before


def test_caching_a_free_block_raises() -> None:
    """Only in-use blocks may be cached: a free block may be reallocated at any moment."""
    pool = BlockPool(2)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="free block 0"):
        pool.cache([0], [h(0)])
    assert snapshot(pool) == before


def test_mismatched_cache_arguments_raise() -> None:
    """cache() needs one hash per block and bytes hashes."""
    pool = BlockPool(2)
    ids = pool.get_new_blocks(2)
    with pytest.raises(BlockPoolError, match="2 blocks but 1 hashes"):
        pool.cache(ids, [h(0)])
    with pytest.raises(BlockPoolError, match="must be bytes"):
        pool.cache(ids[:1], ["abc"])  # type: ignore[list-item]


def test_duplicate_hash_keeps_the_first_block() -> None:
    """Caching a hash another block holds leaves the new block uncached (evicted first later)."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache([a], [h(0)]) == [True]
    assert pool.cache([b], [h(0)]) == [False]
    assert pool.get_cached_block(h(0)) == a
    assert pool.block(b).block_hash is None


def test_allocation_beyond_free_raises_and_leaves_pool_unchanged() -> None:
    """Asking for more blocks than are free (or a negative count) raises and changes nothing."""
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="asked for 3 blocks, only 2 free"):
        pool.get_new_blocks(3)
    with pytest.raises(BlockPoolError):
        pool.get_new_blocks(-1)
    assert snapshot(pool) == before


def test_uncache_moves_a_free_block_to_the_head() -> None:
    """Dropping a free block's hash makes it the next block handed out."""
    pool = BlockPool(3, enable_events=True)
    ids = pool.get_new_blocks(3)
    pool.cache(ids, [h(0), h(1), h(2)])
    pool.free(ids)
    pool.take_events()
    pool.uncache([2])
    assert pool.free_queue.first() is pool.block(2)
    assert not pool.is_cached(h(2))
    assert pool.take_events() == [BlockRemoved((h(2),))]


def test_reset_refuses_while_blocks_are_in_use() -> None:
    """reset_prefix_cache returns False and keeps the cache while any block is referenced."""
    pool = BlockPool(2, enable_events=True)
    ids = pool.get_new_blocks(2)
    pool.cache(ids, [h(0), h(1)])
    pool.free(ids[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 2
    pool.free(ids[1:])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [BlockStored((h(0), h(1)), (0, 1)), AllBlocksCleared()]


def test_events_are_off_by_default_and_drained() -> None:
    """Without enable_events nothing is recorded; take_events drains what was recorded."""
    quiet = BlockPool(2)
    ids = quiet.get_new_blocks(1)
    quiet.cache(ids, [h(0)])
    assert quiet.take_events() == []
    loud = BlockPool(2, enable_events=True)
    ids = loud.get_new_blocks(1)
    loud.cache(ids, [h(0)])
    assert loud.take_events() == [BlockStored((h(0),), (0,))]
    assert loud.take_events() == []


def test_pool_needs_a_positive_size() -> None:
    """A pool of zero blocks is a configuration error."""
    with pytest.raises(ConfigError, match="num_blocks must be positive"):
        BlockPool(0, name="cpu")


class PoolMachine(RuleBasedStateMachine):
    """Random sequences of pool calls against a reference model of refs, hashes and LRU order."""

    N = 8
    ASCENDING = False

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.N, enable_events=True, ascending_runs=self.ASCENDING)
        self.refs = [0] * self.N
        self.hashes: list[bytes | None] = [None] * self.N
        self.order = list(range(self.N))  # expected free queue, head first
        self.next_hash = 0

    def _live(self) -> list[int]:
        return [i for i in range(self.N) if self.refs[i] > 0]

    @rule(n=st.integers(0, 3))
    def allocate(self, n: int) -> None:
        if n > len(self.order):
            before = snapshot(self.pool)
            with pytest.raises(BlockPoolError):
                self.pool.get_new_blocks(n)
            assert snapshot(self.pool) == before
            return
        got = self.pool.get_new_blocks(n)
        # The first n in eviction order either way; ascending_runs only sorts them.
        assert got == (sorted(self.order[:n]) if self.ASCENDING else self.order[:n])
        for i in got:
            self.order.remove(i)
            self.refs[i] = 1
            self.hashes[i] = None

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self._live()))
        self.pool.free([i])
        self.refs[i] -= 1
        if self.refs[i] == 0:
            if self.hashes[i] is None:
                self.order.insert(0, i)
            else:
                self.order.append(i)

    @rule(i=st.integers(0, N - 1))
    def double_free_is_rejected(self, i: int) -> None:
        if self.refs[i] == 0:
            before = snapshot(self.pool)
            with pytest.raises(BlockPoolError):
                self.pool.free([i])
            assert snapshot(self.pool) == before

    @rule(i=st.integers(0, N - 1))
    def touch(self, i: int) -> None:
        self.pool.touch([i])
        if self.refs[i] == 0:
            self.order.remove(i)
        self.refs[i] += 1

    @precondition(lambda self: any(r > 0 for r in self.refs))
    @rule(data=st.data(), reuse=st.booleans())
    def cache(self, data: st.DataObject, reuse: bool) -> None:
        i = data.draw(st.sampled_from(self._live()))
        if self.hashes[i] is not None:
            with pytest.raises(BlockPoolError):
                self.pool.cache([i], [h(10_000)])
            return
        held = [x for x in self.hashes if x is not None]
        if reuse and held:
            assert self.pool.cache([i], [held[0]]) == [False]
            return
        self.next_hash += 1
        assert self.pool.cache([i], [h(self.next_hash)]) == [True]
        self.hashes[i] = h(self.next_hash)

    @rule(i=st.integers(0, N - 1))
    def uncache(self, i: int) -> None:
        self.pool.uncache([i])
        if self.hashes[i] is not None:
            self.hashes[i] = None
            if self.refs[i] == 0:
                self.order.remove(i)
                self.order.insert(0, i)

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == all(r == 0 for r in self.refs)
        if ok:
            self.hashes = [None] * self.N

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        assert [b.ref_cnt for b in pool.blocks] == self.refs
        assert all(r >= 0 for r in self.refs)
        assert [b.block_hash for b in pool.blocks] == self.hashes
        assert [b.block_id for b in pool.free_queue] == self.order
        assert pool.num_free_blocks == len(self.order)

    @invariant()
    def each_block_in_exactly_one_class(self) -> None:
        pool = self.pool
        free_ids = {b.block_id for b in pool.free_queue}
        free_uncached = {i for i in free_ids if pool.blocks[i].block_hash is None}
        free_cached = free_ids - free_uncached
        in_use = {b.block_id for b in pool.blocks if b.ref_cnt > 0}
        assert not (free_ids & in_use)
        assert free_uncached | free_cached | in_use == set(range(self.N))
        for bh, bid in ((b.block_hash, b.block_id) for b in pool.blocks if b.block_hash):
            assert pool.get_cached_block(bh) == bid
        assert pool.num_cached_blocks == sum(x is not None for x in self.hashes)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_pool_invariants = PoolMachine.TestCase


class AscendingPoolMachine(PoolMachine):
    """The same model with ``ascending_runs``: the same blocks leave the free queue (LRU holds),
    handed out in ascending id order."""

    ASCENDING = True


AscendingPoolMachine.TestCase.settings = PoolMachine.TestCase.settings
test_ascending_block_pool_invariants = AscendingPoolMachine.TestCase


def test_ascending_pool_gives_a_store_freed_in_reverse_back_as_one_run() -> None:
    """Blocks freed in reverse (as a committed store's are) come back as one ascending run,
    and the least recently used blocks are still the ones taken."""
    pool = BlockPool(16, ascending_runs=True)
    a = pool.get_new_blocks(4)
    b = pool.get_new_blocks(4)
    assert (a, b) == ([0, 1, 2, 3], [4, 5, 6, 7])
    pool.release_owned(b, [h(i) for i in b])  # b is freed first: least recently used
    pool.release_owned(a, [h(10 + i) for i in a])
    rest = pool.get_new_blocks(8)
    assert rest == list(range(8, 16))
    assert pool.get_new_blocks(4) == [4, 5, 6, 7]  # b's hashes are evicted before a's
    assert pool.is_cached(h(10))
    assert not pool.is_cached(h(4))
    assert pool.get_new_blocks(2) == [2, 3]  # a part of a run: still in order


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(0, 9), min_size=6, max_size=6)),
        max_size=8,
    )
)
def test_owned_free_matches_the_checked_one(rounds: list[tuple[int, list[int]]]) -> None:
    """free_owned, on cached blocks fresh from get_new_blocks, leaves a pool exactly as free
    does (LRU order, cached hashes, ref counts)."""
    checked, owned = BlockPool(12), BlockPool(12)
    for n, keys in rounds:
        n = min(n, checked.num_free_blocks)
        ids = checked.get_new_blocks(n)
        assert owned.get_new_blocks(n) == ids
        hashes = [h(k) for k in keys[:n]]
        assert checked.cache(ids, hashes) == owned.cache(ids, hashes)
        checked.free(ids[::-1])
        owned.free_owned(ids[::-1])
        assert snapshot(owned) == snapshot(checked)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 6),
            st.lists(st.integers(0, 9), min_size=6, max_size=6, unique=True),
            st.lists(st.booleans(), min_size=6, max_size=6),
        ),
        max_size=8,
    )
)
def test_release_owned_matches_cache_then_reverse_free(
    rounds: list[tuple[int, list[int], list[bool]]],
) -> None:
    """release_owned (distinct hashes, None for blocks not to cache) leaves a pool exactly as
    cache of the kept blocks, then free in reverse order, do."""
    checked, owned = BlockPool(12), BlockPool(12)
    for n, keys, drop in rounds:
        n = min(n, checked.num_free_blocks)
        ids = checked.get_new_blocks(n)
        assert owned.get_new_blocks(n) == ids
        hashes = [None if d else h(k) for k, d in zip(keys[:n], drop, strict=False)]
        kept = [(b, x) for b, x in zip(ids, hashes, strict=True) if x is not None]
        done = checked.cache([b for b, _ in kept], [x for _, x in kept]).count(True)
        checked.free(ids[::-1])
        assert owned.release_owned(ids, hashes) == done
        assert snapshot(owned) == snapshot(checked)


def test_owned_free_of_a_free_block_raises() -> None:
    """free_owned still refuses to drop a reference nobody holds."""
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_owned([b])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_owned([b])


def test_owned_free_links_what_came_before_a_double_free() -> None:
    """A double free inside free_owned raises after the blocks before it joined the queue: the
    free count matches the queue, hashed blocks at the tail and unhashed ones at the head."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache([a], [h(1)])
    pool.free_owned([c])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_owned([a, b, c])
    assert [blk.block_id for blk in pool.free_queue] == [b, c, 3, a]
    assert pool.num_free_blocks == 4


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(0, 9), min_size=6, max_size=6)),
        max_size=8,
    ),
    st.integers(0, 12),
)
def test_touch_cached_matches_find_then_touch(
    rounds: list[tuple[int, list[int]]], start: int
) -> None:
    """touch_cached of cached hashes (free or in use) returns the ids find_longest_prefix
    names and leaves a pool exactly as touch of them does."""
    checked, fast = BlockPool(12), BlockPool(12)
    for n, keys in rounds:
        n = min(n, checked.num_free_blocks)
        ids = checked.get_new_blocks(n)
        assert fast.get_new_blocks(n) == ids
        hashes = [h(k) for k in keys[:n]]
        assert checked.cache(ids, hashes) == fast.cache(ids, hashes)
        keep = len(ids) // 2  # some stay in use, the rest is freed
        checked.free(ids[keep:][::-1])
        fast.free(ids[keep:][::-1])
    cached = [h(k) for k in range(10) if checked.is_cached(h(k))][start % 11 :]
    want = checked.find_longest_prefix(cached)
    checked.touch(want)
    assert fast.touch_cached(cached) == tuple(want)
    assert snapshot(fast) == snapshot(checked)


def test_touch_cached_of_a_missing_hash_raises_and_touches_nothing() -> None:
    """touch_cached refuses hashes that are not all cached and leaves the pool as it was."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache([a, b], [h(1), h(2)])
    pool.free([b, a])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match="not cached"):
        pool.touch_cached([h(1), h(3)])
    assert snapshot(pool) == before


def test_release_owned_links_what_came_before_a_double_free() -> None:
    """A double free inside release_owned raises after the blocks released before it (in
    reverse order) joined the queue, the uncached one at the head: none is lost."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.free_owned([a])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.release_owned([a, b, c], [h(1), None, h(3)])
    assert [blk.block_id for blk in pool.free_queue] == [b, a, 3, c]
    assert pool.num_free_blocks == 4
    assert pool.is_cached(h(3))
