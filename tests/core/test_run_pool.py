"""The run-based CPU pool against the per-block one: same blocks, LRU order, hashes, events, errors."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvflow.core.block_pool import BlockPool, BlockRemoved, BlockStored, StoredBlockInfo
from kvflow.core.hashing import ROOT_HASH, hash_block
from kvflow.core.run_pool import RunBlockPool, _runs
from kvflow.errors import BlockPoolError, ConfigError


def h(i: int) -> bytes:
    return hash_block(ROOT_HASH, [i])


def state(pool: BlockPool | RunBlockPool) -> tuple[Any, ...]:
    """Everything observable: ref counts, hashes, eviction order, the hash map, counts."""
    blocks = pool.blocks
    order = (
        [b.block_id for b in pool.free_queue]
        if isinstance(pool, BlockPool)
        else list(pool.free_ids())
    )
    cached = {b.block_hash: pool.get_cached_block(b.block_hash) for b in blocks if b.block_hash}
    return (
        [b.ref_cnt for b in blocks],
        [b.block_hash for b in blocks],
        order,
        cached,
        pool.num_free_blocks,
        pool.num_cached_blocks,
    )


class RunPoolMachine(RuleBasedStateMachine):
    """Random sequences of the CPU tier's calls on both pools, which must agree after each."""

    N = 24

    def __init__(self) -> None:
        super().__init__()
        self.ref = BlockPool(self.N, enable_events=True, ascending_runs=True)
        self.run = RunBlockPool(self.N, enable_events=True)
        self.fresh: list[list[int]] = []  # allocations not committed: refs 1, uncached
        self.pinned: list[tuple[int, ...]] = []  # touch_cached results, one ref each
        self.next_hash = 0

    def _both(self, name: str, *args: Any) -> Any:
        """Call ``name`` on both pools: the same result, or the same error and no change."""
        before = state(self.ref)
        try:
            want = getattr(self.ref, name)(*args)
        except BlockPoolError:
            assert state(self.ref) == before
            with pytest.raises(BlockPoolError):
                getattr(self.run, name)(*args)
            assert state(self.run) == before
            return None
        got = getattr(self.run, name)(*args)
        assert got == want
        return got

    def _owned(self) -> set[int]:
        return {b for ids in self.fresh for b in ids}

    def _others(self) -> list[int]:
        """Ids outside the uncommitted allocations (the checked calls may use any of these)."""
        owned = self._owned()
        return [b for b in range(self.N) if b not in owned] or [-1]

    @rule(n=st.integers(0, 12))
    def allocate(self, n: int) -> None:
        got = self._both("get_new_blocks", n)
        if got:
            self.fresh.append(got)

    @precondition(lambda self: self.fresh)
    @rule(
        data=st.data(),
        kind=st.sampled_from(["new", "some_none", "dup", "cached", "none"]),
        events=st.booleans(),
    )
    def commit(self, data: st.DataObject, kind: str, events: bool) -> None:
        ids = self.fresh.pop(data.draw(st.integers(0, len(self.fresh) - 1)))
        hashes: list[bytes | None] = []
        for _ in ids:
            self.next_hash += 1
            hashes.append(h(self.next_hash))
        held = [b.block_hash for b in self.ref.blocks if b.block_hash is not None]
        if kind == "some_none":
            drop = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
            hashes = [None if d else x for x, d in zip(hashes, drop, strict=True)]
        elif kind == "dup" and len(ids) > 1:
            hashes[-1] = hashes[0]
        elif kind == "cached" and held:
            hashes[data.draw(st.integers(0, len(ids) - 1))] = data.draw(st.sampled_from(held))
        elif kind == "none":
            hashes = [None] * len(ids)
        infos = [StoredBlockInfo(None, (i,)) for i in range(len(ids))] if events else None
        self._both("release_owned", tuple(ids), hashes, infos)

    @rule(data=st.data(), whole=st.booleans(), order=st.sampled_from(["asc", "rev", "shuffle"]))
    def pin(self, data: st.DataObject, whole: bool, order: str) -> None:
        hashes = [b.block_hash for b in self.ref.blocks if b.block_hash is not None]
        if not hashes:
            return
        if not whole:
            hashes = data.draw(st.lists(st.sampled_from(hashes), max_size=8, unique=True))
        if order == "rev":
            hashes.reverse()
        elif order == "shuffle":
            hashes = data.draw(st.permutations(hashes))
        got = self._both("touch_cached", hashes)
        if got:
            self.pinned.append(got)

    @rule()
    def pin_missing(self) -> None:
        self._both("touch_cached", [h(10**6)])

    @precondition(lambda self: self.pinned)
    @rule(data=st.data(), reverse=st.booleans())
    def unpin(self, data: st.DataObject, reverse: bool) -> None:
        ids = self.pinned.pop(data.draw(st.integers(0, len(self.pinned) - 1)))
        self._both("free_owned", ids[::-1] if reverse else ids)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._others())))
        if self.pinned and set(ids) & {b for p in self.pinned for b in p}:
            return  # a pin's references are the pin's to drop
        self._both("free", ids)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._others())))
        self._both("touch", ids)

    @rule(i=st.integers(-1, N))
    def touch_checked(self, i: int) -> None:
        self._both("touch", [i])

    @rule(data=st.data(), reuse=st.booleans())
    def cache(self, data: st.DataObject, reuse: bool) -> None:
        owned = self._owned()
        live = [b.block_id for b in self.ref.blocks if b.ref_cnt and b.block_id not in owned]
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), max_size=3))
        self.next_hash += 1
        hashes = [h(self.next_hash + i) for i in range(len(ids))]
        self.next_hash += len(ids)
        held = [b.block_hash for b in self.ref.blocks if b.block_hash is not None]
        if reuse and held and hashes:
            hashes[0] = held[0]
        self._both("cache", ids, hashes)

    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self._others())))
        self._both("uncache", ids)

    @rule()
    def reset(self) -> None:
        self._both("reset_prefix_cache")

    @invariant()
    def agree(self) -> None:
        assert state(self.run) == state(self.ref)
        assert self.run.take_events() == self.ref.take_events()
        queue = list(self.run.free_ids())
        assert len(set(queue)) == len(queue) == self.run.num_free_blocks
        assert all(self.run.blocks[b].ref_cnt == 0 for b in queue)


RunPoolMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
test_run_pool_matches_the_block_pool = RunPoolMachine.TestCase


def test_a_store_comes_back_as_runs_and_lru_holds() -> None:
    """A store committed in reverse is one run of the queue; the next allocation takes the
    least recently used blocks, evicting their hashes with a BlockRemoved event."""
    pool = RunBlockPool(16, enable_events=True)
    a = pool.get_new_blocks(8)
    b = pool.get_new_blocks(8)
    pool.release_owned(tuple(b), [h(i) for i in b])
    pool.release_owned(tuple(a), [h(i) for i in a])
    assert list(pool.free_ids()) == [*range(15, 7, -1), *range(7, -1, -1)]
    assert pool.take_events() == [
        BlockStored(tuple(h(i) for i in b), tuple(b)),
        BlockStored(tuple(h(i) for i in a), tuple(a)),
    ]
    assert pool.get_new_blocks(4) == [12, 13, 14, 15]
    assert pool.take_events() == [BlockRemoved(tuple(h(i) for i in (15, 14, 13, 12)))]
    assert pool.is_cached(h(11))
    assert not pool.is_cached(h(12))


def test_pinning_and_freeing_a_run_keeps_its_place_rules() -> None:
    """A pinned run leaves the queue; freed again (cached) it joins the tail, in the order
    it was freed; an uncached run freed goes to the head."""
    pool = RunBlockPool(8)
    ids = pool.get_new_blocks(8)
    pool.release_owned(tuple(ids[:4]), [h(i) for i in range(4)])
    pool.release_owned(tuple(ids[4:]), [None] * 4)
    assert list(pool.free_ids()) == [4, 5, 6, 7, 3, 2, 1, 0]
    got = pool.touch_cached([h(i) for i in range(4)])
    assert got == (0, 1, 2, 3)
    assert pool.num_free_blocks == 4
    pool.free_owned(got[::-1])
    assert list(pool.free_ids()) == [4, 5, 6, 7, 3, 2, 1, 0]


@pytest.mark.parametrize("reverse", [False, True])
def test_a_pinned_run_uncached_then_freed_goes_to_the_head(reverse: bool) -> None:
    """A pinned run whose hashes were dropped joins the head when freed, in the order the
    per-block pool gives it."""
    pools = (BlockPool(12, ascending_runs=True), RunBlockPool(12))
    for pool in pools:
        ids = pool.get_new_blocks(12)
        pool.release_owned(tuple(ids[:4]), [None] * 4)
        pool.release_owned(tuple(ids[4:]), [h(i) for i in range(8)])
        got = pool.touch_cached([h(i) for i in range(2, 7)])
        pool.uncache(got)
        pool.free_owned(got[::-1] if reverse else got)
    assert state(pools[1]) == state(pools[0])


def test_queries_read_the_prefix_cache() -> None:
    """find_longest_prefix, is_cached, cached_hashes, block and usage read the pool."""
    pool = RunBlockPool(4)
    ids = pool.get_new_blocks(3)
    pool.release_owned(tuple(ids), [h(0), h(1), h(2)])
    assert pool.find_longest_prefix([h(0), h(1), h(9), h(2)]) == [0, 1]
    assert pool.is_cached(h(2))
    assert h(1) in pool.cached_hashes
    assert pool.block(1).block_hash == h(1)
    assert pool.usage == 0.0
    assert pool.ascending_runs
    pool.free_owned(())
    pool.touch([1])
    assert pool.usage == 0.25
    assert pool.release_owned((), []) == 0


def test_misuse_raises_and_changes_nothing() -> None:
    """Unknown ids, a double free, an uncached hash, too many blocks: BlockPoolError, no
    change; a pool of no blocks is a ConfigError."""
    pool = RunBlockPool(4)
    ids = pool.get_new_blocks(2)
    before = state(pool)
    for call in (
        lambda: pool.touch([4]),
        lambda: pool.free([2]),
        lambda: pool.free([0, 0]),
        lambda: pool.touch_cached([h(1)]),
        lambda: pool.get_new_blocks(3),
        lambda: pool.get_new_blocks(-1),
        lambda: pool.cache(ids, [h(1)]),
        lambda: pool.release_owned(tuple(ids), [h(1)]),
        lambda: pool.free_owned((ids[0], 3)),
        lambda: pool.block(9),
        lambda: pool.cache([3], [h(1)]),
        lambda: pool.cache(ids, [h(1), "x"]),  # type: ignore[list-item]
    ):
        with pytest.raises(BlockPoolError):
            call()
        assert state(pool) == before
    with pytest.raises(ConfigError):
        RunBlockPool(0)


@pytest.mark.parametrize(
    ("ids", "want"),
    [
        ([], []),
        ([3], [(3, 4, 0)]),
        ([0, 1, 2, 5, 6, 9], [(0, 3, 0), (5, 7, 3), (9, 10, 5)]),
        ((4, 5, 6, 7), [(4, 8, 0)]),
        ([1, 1, 2], None),
        ([0, 0, 3, 3], None),
        ([2, 1], None),
        ([0, 2, 1, 3], None),
        ([7, 8, 9, 10], None),  # past the pool
    ],
)
def test_runs_splits_only_strictly_ascending_ids(
    ids: list[int], want: list[tuple[int, int, int]] | None
) -> None:
    """_runs finds the consecutive runs of strictly ascending ids and refuses anything else."""
    assert _runs(ids, list(range(10))) == want
