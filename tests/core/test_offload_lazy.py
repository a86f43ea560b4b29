"""Deterministic scenarios of the lazy store policy (blocks stored as they near the GPU free
queue's eviction end): round trips, duplicates, CPU eviction under the cursor, refilled blocks,
the cursor across steps, and the walk over a keyed view whose engine takes blocks untold.

Every test that builds a simulation uses ``make_sim``; after the test the fixture finishes every
request, settles every copy and checks that no block reference leaked.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable

from structlog.testing import capture_logs

from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import hash_block
from kvflow.core.offload import (
    GroupSpec,
    OffloadManagerConfig,
)
from kvflow.core.offload.config import Geometry
from kvflow.core.offload.lazy import LazyCursor
from kvflow.core.run_pool import RunBlockPool
from tests.core.conftest import MakeSim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=16, block_bytes=1024)]


def test_lazy_round_trip(make_sim: MakeSim) -> None:
    """Lazy: only blocks reaching the eviction end of the GPU free queue are stored, then reloaded."""
    sim = make_sim(ONE_GROUP, store_policy="lazy", lazy_watermark=4, gpu_blocks=12)
    a = sim.add("a", range(16))
    sim.match(a)
    assert sim.step(new=[(a, 16)]).stores == (), "lazy stores nothing a running request holds"
    a_blocks = list(sim.tables["a"][0])
    sim.finish(a)
    assert sim.step().stores == (), "fresh free blocks are ahead of a's blocks in the queue"

    b = sim.add("b", range(100, 124))
    sim.match(b)
    (store,) = sim.step(new=[(b, 24)]).stores  # b takes 6 blocks: 2 of a's reach the watermark
    assert set(store.gpu_block_ids[0]) == {a_blocks[3], a_blocks[2]}
    assert all(sim.gpu.block(blk).ref_cnt == 1 for blk in store.gpu_block_ids[0]), "held mid-copy"
    sim.complete()
    (store2,) = sim.step().stores
    assert set(store2.gpu_block_ids[0]) == {a_blocks[1], a_blocks[0]}
    sim.complete()
    assert sim.on_cpu(a) == [True] * 4
    assert sim.step().stores == (), "everything near eviction is covered"

    sim.finish(b)
    c = sim.add("c", range(200, 248))
    sim.match(c)
    sim.step(new=[(c, 44)])  # evicts a's blocks from the GPU
    sim.complete()
    a2 = sim.add("a2", [*range(16), 7])
    assert sim.match(a2) == (16, True)
    sim.finish(c)
    sim.alloc(a2, 16, 16)
    sim.step()
    assert sim.complete().finished_recving == {"a2"}
    assert [sim.gpu_data[blk] for blk in sim.tables["a2"][0][:4]] == sim.hashes(a, 0)


def test_duplicate_stores_skipped_lazy(make_sim: MakeSim) -> None:
    """Lazy: two GPU blocks with the same content near eviction are stored once."""
    sim = make_sim(ONE_GROUP, store_policy="lazy", lazy_watermark=8, gpu_blocks=8)
    a, b = sim.add("a", range(8)), sim.add("b", range(8))
    sim.match(a)
    sim.match(b)
    sim.step(new=[(a, 8), (b, 8)])
    sim.finish(a)
    sim.finish(b)
    (store,) = sim.step().stores
    assert len(store.gpu_block_ids[0]) == 2
    sim.complete()
    assert sim.step().stores == ()
    assert sim.mgr.stats().blocks_stored == 2


def test_lazy_restores_block_whose_cpu_copy_was_evicted(make_sim: MakeSim) -> None:
    """Lazy: a block near eviction whose CPU copy was evicted is stored again (no stale cursor)."""
    sim = make_sim(
        [GroupSpec(block_size=BS, num_cpu_blocks=2)],
        store_policy="lazy",
        lazy_watermark=4,
        gpu_blocks=6,
    )
    a = sim.add("a", range(8))
    sim.match(a)
    sim.step(new=[(a, 8)])
    a_blocks = set(sim.tables["a"][0])
    sim.finish(a)  # free queue: 4 fresh blocks, then a's 2
    b = sim.add("b", range(100, 116))
    sim.match(b)
    (store,) = sim.step(new=[(b, 16)]).stores  # b takes the fresh ones: a's lead the queue
    assert set(store.gpu_block_ids[0]) == a_blocks
    sim.complete()
    assert sim.on_cpu(a) == [True, True]
    b_blocks = set(sim.tables["b"][0])
    sim.finish(b)
    (store,) = sim.step().stores  # two of b's reach the watermark: a's CPU copies are evicted
    assert set(store.gpu_block_ids[0]) < b_blocks
    sim.complete()
    assert sim.on_cpu(a) == [False, False]
    (store,) = sim.step().stores
    assert set(store.gpu_block_ids[0]) == a_blocks, "a's blocks are not believed stored"
    sim.complete()
    assert sim.on_cpu(a) == [True, True]


def test_lazy_never_stores_a_refilled_block_under_its_old_hash(make_sim: MakeSim) -> None:
    """Lazy: a block kvflow saw computed for one request, then handed to another as a load
    target and freed again before kvflow saw that request's tokens, is not stored under the
    first request's hash (its content is the loaded one)."""
    sim = make_sim(
        [GroupSpec(block_size=BS, num_cpu_blocks=16)],
        store_policy="lazy",
        lazy_watermark=2,
        gpu_blocks=12,
    )
    c = sim.add("c", range(100, 108))
    sim.match(c)
    sim.step(new=[(c, 8)])
    c_blocks = set(sim.tables["c"][0])
    sim.finish(c)  # the queue: 10 fresh blocks, then c's 2
    d = sim.add("d", range(200, 240))
    sim.match(d)
    (store,) = sim.step(new=[(d, 40)]).stores  # d takes the fresh ones: c's lead the queue
    assert set(store.gpu_block_ids[0]) == c_blocks
    sim.complete()
    assert sim.on_cpu(c) == [True, True]
    a = sim.add("a", range(300, 308))
    sim.match(a)
    sim.step(new=[(a, 8)])  # a computes into c's old blocks; kvflow records them as a's
    a_blocks = list(sim.tables["a"][0])
    sim.finish(a)
    b = sim.add("b", [*range(100, 108), 7])
    assert sim.match(b) == (8, True)
    sim.alloc(b, 8, 8)  # b's load targets are a's blocks, before any walk stored them
    assert sorted(sim.tables["b"][0][:2]) == sorted(a_blocks)
    assert len(sim.step().loads) == 1
    sim.complete()
    # The engine enters loaded blocks into its prefix cache under their new content's hash.
    hashes = sim.hashes(b, 0)
    for i, blk in enumerate(sim.tables["b"][0][:2]):
        sim.gpu.cache([blk], [hash_block(hashes[i], [0])])
    plan = sim.step(preempted=["b"])  # b leaves before it ran: its blocks are free, hashed
    for spec in plan.stores:
        assert not set(spec.gpu_block_ids[0]) & set(a_blocks), "stored under a's hash"
    sim.complete()
    pool = sim.mgr.cpu_pools[0]
    for h in sim.hashes(a, 0):
        bid = pool.get_cached_block(h)
        assert bid is None or sim.cpu_data[0][bid] == h, "a's hash maps to other content"
    assert sim.on_cpu(c) == [True, True]


class CountingView:
    """A ``GpuCacheView`` that counts the free-queue steps the manager takes."""

    def __init__(self, inner: GpuCacheView) -> None:
        self.inner = inner
        self.steps = 0

    def first_free(self) -> int | None:
        self.steps += 1
        return self.inner.first_free()

    def next_free(self, block_id: int) -> int | None:
        self.steps += 1
        return self.inner.next_free(block_id)

    def is_free(self, block_id: int) -> bool:
        return self.inner.is_free(block_id)

    def block_hash(self, block_id: int) -> Hashable | None:
        return self.inner.block_hash(block_id)

    def touch(self, block_ids: Iterable[int]) -> None:
        self.inner.touch(block_ids)

    def free(self, block_ids: Iterable[int]) -> None:
        self.inner.free(block_ids)


def test_lazy_cursor_survives_steps_and_resets_when_its_block_is_reused(make_sim: MakeSim) -> None:
    """The lazy walk resumes at its cursor (work ∝ blocks that entered the window) and restarts
    from the queue head when the engine takes the cursor's block."""
    views: list[CountingView] = []

    def wrap(inner: GpuCacheView) -> GpuCacheView:
        views.append(CountingView(inner))
        return views[0]

    sim = make_sim(ONE_GROUP, store_policy="lazy", lazy_watermark=4, gpu_blocks=12, wrap_view=wrap)
    (view,) = views
    a = sim.add("a", range(16))
    sim.match(a)
    sim.step(new=[(a, 16)])
    a_blocks = sim.tables["a"][0]
    sim.finish(a)  # queue: 8 fresh blocks, then a's 4
    assert sim.step().stores == ()
    view.steps = 0
    sim.step()
    assert view.steps == 0, "a covered window costs nothing"
    b = sim.add("b", range(100, 108))
    sim.match(b)
    sim.step(new=[(b, 8)])  # takes the first 2 covered blocks
    assert view.steps == 2, "the walk resumed at the cursor for the 2 blocks that entered"
    c = sim.add("c", range(200, 216))
    sim.match(c)
    with capture_logs() as logs:
        (store,) = sim.step(new=[(c, 16)]).stores  # takes the cursor's block
    assert {"event": "offload_lazy_cursor_reset", "cause": "cursor_block_taken"}.items() <= next(
        e for e in logs if e["event"] == "offload_lazy_cursor_reset"
    ).items()
    assert set(store.gpu_block_ids[0]) == {a_blocks[3], a_blocks[2]}
    sim.complete()
    assert sim.on_cpu(a) == [False, False, True, True]


class ListKeyedView:
    """A keyed GPU view over a free queue held as a list: blocks leave it when the engine takes
    them (``take``, untold) or a store touches them, and go back to its tail when freed."""

    def __init__(self, num_blocks: int, keys: dict[int, tuple[int, bytes]]) -> None:
        self.queue = list(range(num_blocks))
        self.keys = keys

    def take(self, n: int) -> None:
        del self.queue[:n]

    def first_free(self) -> int | None:
        return self.queue[0] if self.queue else None

    def next_free(self, block_id: int) -> int | None:
        if block_id not in self.queue:
            return None
        i = self.queue.index(block_id) + 1
        return self.queue[i] if i < len(self.queue) else None

    def is_free(self, block_id: int) -> bool:
        return block_id in self.queue

    def block_hash(self, block_id: int) -> Hashable | None:
        key = self.keys.get(block_id)
        return None if key is None else key[1]

    def block_key(self, block_id: int) -> tuple[int, bytes] | None:
        return self.keys.get(block_id)

    def touch(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self.queue.remove(b)

    def free(self, block_ids: Iterable[int]) -> None:
        self.queue.extend(block_ids)

    def scan_free(
        self, after: int | None, limit: int
    ) -> tuple[list[int], list[tuple[int, tuple[int, bytes]]]]:
        if after is not None and after not in self.queue:
            return [], []
        start = 0 if after is None else self.queue.index(after) + 1
        ids = self.queue[start : start + limit]
        return ids, [(b, self.keys[b]) for b in ids if b in self.keys]

    def first_free_in(self, block_ids: Container[int]) -> int | None:
        return next((b for b in self.queue if b in block_ids), None)

    def keyed_blocks(self) -> Iterable[tuple[int, tuple[int, bytes]]]:
        return list(self.keys.items())


def test_keyed_walk_covers_the_watermark_after_untold_takes() -> None:
    """Over a keyed view, blocks the engine took from the queue head without telling do not
    count as covered: after a walk that picked a block (so fewer than the watermark are
    covered) and two untold takes, the next walk still reaches the watermark's last block."""
    config = OffloadManagerConfig(
        groups=(GroupSpec(block_size=4, num_cpu_blocks=8),), store_policy="lazy"
    )
    view = ListKeyedView(12, {2: (0, b"h2"), 6: (0, b"h6")})
    cursor = LazyCursor(
        Geometry.of(config),
        [RunBlockPool(8, name="cpu")],
        [{}],
        view,
        null_block_id=None,
        watermark=4,
    )
    first = cursor.walk()
    assert first is not None
    assert first.blocks == [{b"h2": 2}]
    view.touch([2])  # the store holds it while it copies
    view.take(2)  # blocks 0 and 1, for a running request's decode: untold
    second = cursor.walk()
    assert view.queue[:4] == [3, 4, 5, 6]
    assert second is not None
    assert second.blocks == [{b"h6": 6}], "block 6 is 4th from the head"
    view.touch([6])
    assert cursor.walk() is None, "the window is covered"


def _gpu_hit_after_reset(make_sim: MakeSim, *, keyed: bool) -> None:
    """a computes four blocks and finishes; the connector's cache is reset before any walk (the
    engine's GPU prefix cache stays); b hits a's first three blocks on the GPU, computes two more
    and finishes; the walks after must store none of the pre-reset blocks."""
    sim = make_sim(ONE_GROUP, store_policy="lazy", lazy_watermark=16, gpu_blocks=16, keyed=keyed)
    a = sim.add("a", range(16))
    sim.match(a)
    sim.step(new=[(a, 16)])
    hit = list(sim.tables["a"][0][:3])
    sim.finish(a)
    sim.reset_cache()
    b = sim.add("b", [*range(12), *range(200, 208)])
    sim.gpu.touch(hit)  # the engine's GPU prefix hit on a's first three blocks
    sim.tables["b"] = [list(hit)]
    sim.computed["b"] = 12
    assert sim.match(b, gpu_computed=12) == (0, False)
    sim.step(new=[(b, 8)])
    sim.finish(b)
    for _ in range(3):
        plan = sim.step()
        sim.complete()
        for spec in plan.stores:
            for blk in spec.gpu_block_ids[0]:
                assert sim.epoch[blk] == sim.resets, f"GPU block {blk}: pre-reset content stored"
    assert not any(sim.on_cpu(b)[:3])
    assert all(sim.on_cpu(b)[3:]), "b's own blocks, computed after the reset, are stored"


def test_a_gpu_prefix_hit_on_a_pre_reset_block_keeps_it_out_of_the_cpu_tier(
    make_sim: MakeSim,
) -> None:
    """Over a keyed view, blocks a request hit in the engine's GPU prefix cache after a
    connector reset keep their pre-reset mark: freed again, they are never stored."""
    _gpu_hit_after_reset(make_sim, keyed=True)


def test_a_gpu_prefix_hit_on_a_pre_reset_block_is_not_stored_over_a_recorded_view(
    make_sim: MakeSim,
) -> None:
    """Over a recorded view the same: blocks hit on the GPU after a connector reset are never
    stored."""
    _gpu_hit_after_reset(make_sim, keyed=False)
