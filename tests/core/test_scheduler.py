"""Deterministic scenarios of the offload manager, each against fake workers that report on command.

Every test builds its simulation with ``make_sim``; after the test the fixture finishes every
request, settles every copy and checks that no block reference leaked on the CPU or GPU pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import pytest
from attrs import define, field
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import hash_block, hash_blocks
from kvflow.core.protocol import StepPlan
from kvflow.core.requests import CachedRequest, KVRequest, SchedulerOutput
from kvflow.core.scheduler import (
    GroupSpec,
    OffloadManager,
    ResetStatus,
    SchedulerConfig,
    StorePolicy,
)
from kvflow.core.transfer import Direction, TransferState
from kvflow.errors import ConfigError, ProtocolError, ReportError
from tests.core.conftest import MakeSim
from tests.core.scheduler_harness import Sim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=16, block_bytes=1024)]


# ---- round trips -------------------------------------------------------------------------------


def test_eager_round_trip(make_sim: MakeSim) -> None:
    """Eager: blocks are stored when computed, matched by a later request and loaded back intact."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(10))
    assert sim.match(a) == (0, False)
    plan = sim.step(new=[(a, 10)])
    (store,) = plan.stores
    assert store.direction is Direction.STORE
    assert store.gpu_block_ids == (tuple(sim.tables["a"][0][:2]),)
    assert sim.on_cpu(a) == [False, False], "not cached before every rank reported"
    out = sim.complete()
    assert out.committed == (store.transfer_id,)
    assert sim.on_cpu(a) == [True, True]
    assert sim.finish(a) is False

    b = sim.add("b", [*range(10), 99])
    assert sim.match(b) == (8, True)
    sim.alloc(b, 8, 8)
    (load,) = sim.step().loads
    assert load.gpu_block_ids == (tuple(sim.tables["b"][0][:2]),)
    out = sim.complete()
    assert out.finished_recving == {"b"}
    assert out.committed == (load.transfer_id,)
    assert [sim.gpu_data[blk] for blk in sim.tables["b"][0][:2]] == sim.hashes(b, 0)
    stats = sim.mgr.stats()
    assert (stats.blocks_stored, stats.blocks_loaded) == (2, 2)
    assert (stats.bytes_stored, stats.bytes_loaded) == (2048, 2048)
    assert (stats.hits, stats.misses, stats.hit_tokens) == (1, 1, 8)


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


def test_full_prompt_hit_recomputes_last_token(make_sim: MakeSim) -> None:
    """A hit covering the whole prompt is capped one token short; the last block still loads."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    b = sim.add("b", range(8))
    assert sim.match(b) == (7, True)
    sim.alloc(b, 7, 7)
    (load,) = sim.step().loads
    assert len(load.gpu_block_ids[0]) == 2


# ---- duplicates --------------------------------------------------------------------------------


def test_duplicate_stores_skipped_eager(make_sim: MakeSim) -> None:
    """Eager: two requests computing the same blocks in one step store them once; cached ones never."""
    sim = make_sim(ONE_GROUP)
    a, b = sim.add("a", range(9)), sim.add("b", range(9))
    sim.match(a)
    sim.match(b)
    plan = sim.step(new=[(a, 9), (b, 9)])
    assert sum(len(s.gpu_block_ids[0]) for s in plan.stores) == 2
    sim.complete()
    c = sim.add("c", [*range(8), 50, 51, 52, 53])
    sim.match(c, gpu_computed=8)
    sim.alloc(c, 8, 0)
    (store,) = sim.step(new=[(c, 4)]).stores
    assert store.gpu_block_ids == ((sim.tables["c"][0][2],),), "only the block not yet on CPU"
    sim.complete()
    assert sim.mgr.stats().blocks_stored == 3


def test_duplicate_stores_skipped_across_steps_while_in_flight(make_sim: MakeSim) -> None:
    """A block whose store is still in flight is not stored again by a later step."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(8))
    sim.match(a)
    (first,) = sim.step(new=[(a, 8)]).stores
    b = sim.add("b", range(8))
    assert sim.match(b) == (0, False), "in flight is not a hit yet"
    plan = sim.step(new=[(b, 8)])
    assert plan.stores == ()
    out = sim.complete()
    assert out.committed == (first.transfer_id,)
    assert sim.mgr.stats().blocks_stored == 2


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


# ---- CPU pool pressure -------------------------------------------------------------------------


def test_cpu_eviction_is_lru(make_sim: MakeSim) -> None:
    """A full CPU pool evicts its least recently used blocks; a loaded hit counts as a use."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=4)])
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    for req in (a, b):
        sim.match(req)
        sim.step(new=[(req, 8)])
        sim.complete()
    a2 = sim.add("a2", [*range(8), 1])
    assert sim.match(a2) == (8, True)
    sim.alloc(a2, 8, 8)
    sim.step()
    sim.complete()
    c = sim.stored("c", range(200, 208))
    assert sim.on_cpu(a) == [True, True]
    assert sim.on_cpu(b) == [False, False]
    assert sim.on_cpu(c) == [True, True]


def test_pinned_hit_survives_eviction_between_match_and_load(make_sim: MakeSim) -> None:
    """Blocks matched but not yet loaded are pinned: a store needing space evicts others or skips."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=4)])
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    for req in (a, b):
        sim.match(req)
        sim.step(new=[(req, 8)])
        sim.complete()
    a2 = sim.add("a2", [*range(8), 1])
    assert sim.match(a2) == (8, True)  # a's blocks are pinned from here on
    c = sim.add("c", range(200, 216))
    sim.match(c)
    (store,) = sim.step(new=[(c, 16)]).stores
    assert len(store.cpu_block_ids[0]) == 2, "only b's two blocks could be evicted"
    assert sim.mgr.stats().skipped_stores == 2
    sim.complete()
    assert sim.on_cpu(a) == [True, True]
    sim.alloc(a2, 8, 8)
    sim.step()
    assert sim.complete().finished_recving == {"a2"}
    assert [sim.gpu_data[blk] for blk in sim.tables["a2"][0][:2]] == sim.hashes(a, 0)


def test_cpu_pool_full_skips_store_and_counts_it(make_sim: MakeSim) -> None:
    """With every CPU block held by transfers, a store is skipped and counted instead of blocking."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=2)])
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    sim.match(a)
    sim.match(b)
    (store,) = sim.step(new=[(a, 8)]).stores
    with capture_logs() as logs:
        plan = sim.step(new=[(b, 8)])
    assert plan.stores == ()
    assert sim.mgr.stats().skipped_stores == 2
    assert any(e["event"] == "offload_store_skipped" for e in logs)
    assert sim.complete().committed == (store.transfer_id,)


def test_store_whose_cpu_copy_was_evicted_is_not_believed_stored(make_sim: MakeSim) -> None:
    """Once a stored block's CPU copy is evicted, it is neither matched nor skipped as stored."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=2)])
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    for req in (a, b):
        sim.match(req)
        sim.step(new=[(req, 8)])
        sim.complete()
    assert sim.on_cpu(a) == [False, False]
    a2 = sim.add("a2", [*range(8), 3])
    assert sim.match(a2) == (0, False)
    (store,) = sim.step(new=[(a2, 9)]).stores
    assert len(store.gpu_block_ids[0]) == 2, "a's blocks are stored again"


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


# ---- finishing, preemption, reset --------------------------------------------------------------


def test_last_full_block_of_finishing_request_is_stored(make_sim: MakeSim) -> None:
    """The block completed by a request's final decode step is stored before its GPU blocks go."""
    sim = make_sim(ONE_GROUP)
    a = sim.stored("a", range(6))
    assert sim.decode(a, 6).stores == ()
    (store,) = sim.decode(a, 7).stores  # computes token 7: block 1 is full
    assert store.gpu_block_ids == ((sim.tables["a"][0][1],),)
    a.all_token_ids.append(8)  # sampled, never computed
    assert sim.finish(a) is True, "GPU blocks must wait for the store"
    last = sim.gpu.block(store.gpu_block_ids[0][0])
    assert last.ref_cnt == 1, "the request's, kept by delay_free; an eager store holds none"
    out = sim.complete()
    assert out.finished_sending == {"a"}
    assert sim.on_cpu(a) == [True, True]
    assert last.ref_cnt == 0


def test_finishing_with_load_in_flight_cleans_up_after_transfer(make_sim: MakeSim) -> None:
    """A request finishing mid-load keeps its blocks until the device finishes; nothing is loaded."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    b, load = sim.loading("b", [*range(8), 1])
    assert sim.finish(b) is True
    plan = sim.step()
    assert plan.abandoned == (load.transfer_id,)
    assert sim.mgr.cpu_pools[0].num_free_blocks == 14, "CPU blocks stay pinned under the copy"
    out = sim.complete()
    assert out.finished_sending == {"b"}
    assert out.finished_recving == frozenset()
    assert out.committed == ()
    assert not sim.mgr.has_request("b")


def test_finishing_with_store_in_flight_cleans_up_after_transfer(make_sim: MakeSim) -> None:
    """A request finishing mid-store keeps its GPU blocks until the store commits."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    assert sim.finish(a) is True
    assert sim.mgr.has_request("a")
    assert sim.complete(ranks=[]).finished_sending == frozenset()
    out = sim.complete()
    assert out.committed == (store.transfer_id,)
    assert out.finished_sending == {"a"}
    assert not sim.mgr.has_request("a")
    assert sim.on_cpu(a) == [True, True]


def test_preemption_with_transfers_in_flight(make_sim: MakeSim) -> None:
    """Preemption flushes: in-flight stores still commit (their copies finish before the engine
    writes the freed blocks), in-flight loads are abandoned and keep their GPU blocks."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    base = sim.add("base", range(100, 108))
    sim.match(base)
    sim.step(new=[(base, 8)])
    sim.complete([t for t in sim.workers.in_flight() if t != store.transfer_id])
    _b, load = sim.loading("b", [*range(100, 108), 5])
    plan = sim.step(preempted=["a", "b"])  # the engine frees a's and b's GPU blocks at once
    assert plan.flush is True
    assert plan.abandoned == (load.transfer_id,)
    assert set(sim.workers.in_flight()) == sim.flushed == {store.transfer_id, load.transfer_id}
    freed = [sim.gpu.block(blk) for blk in store.gpu_block_ids[0]]
    held = [sim.gpu.block(blk) for blk in load.gpu_block_ids[0]]
    assert all(blk.ref_cnt == 0 for blk in freed), "an eager store holds no GPU ref"
    assert all(blk.ref_cnt == 1 for blk in held), "a load in flight keeps its GPU blocks"
    out = sim.complete()
    assert all(blk.ref_cnt == 0 for blk in held)
    assert out.committed == (store.transfer_id,)
    assert out.finished_recving == frozenset()
    assert sim.on_cpu(a) == [True, True]
    assert sim.match(a) == (7, True)


def test_get_num_new_matched_tokens_waits_while_own_load_in_flight(make_sim: MakeSim) -> None:
    """A request whose abandoned load is still on the device is told to ask again (None)."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    b, _ = sim.loading("b", [*range(8), 1])
    sim.step(preempted=["b"])
    assert sim.match(b) == (None, False)
    sim.complete()
    assert sim.match(b) == (8, True)


def test_reset_with_pending_stores_and_loads(make_sim: MakeSim) -> None:
    """Reset abandons in-flight copies, is pending until they settle, then empties the CPU tier."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    b = sim.add("b", [*range(8), 1])
    sim.match(b)
    sim.alloc(b, 8, 8)
    c = sim.add("c", range(100, 108))
    sim.match(c)
    plan = sim.step(new=[(c, 8)])
    (load,), (store,) = plan.loads, plan.stores
    d = sim.add("d", [*range(8), 2])
    assert sim.match(d) == (8, True)  # pinned, never allocated
    with capture_logs() as logs:
        assert sim.mgr.reset_cache() is ResetStatus.PENDING
    assert any(e["event"] == "offload_reset" and e["status"] == "pending" for e in logs)
    assert sim.match(sim.add("e", [*range(8), 3])) == (0, False), "no hits while resetting"
    assert set(sim.step().abandoned) == {load.transfer_id, store.transfer_id}
    out = sim.complete()
    assert out.reset_complete is True
    assert out.committed == ()
    assert out.finished_recving == {"b"}
    assert out.invalid_block_ids == set(load.gpu_block_ids[0])
    assert sim.mgr.cpu_pools[0].num_cached_blocks == 0
    assert sim.mgr.reset_cache() is ResetStatus.COMPLETE
    assert sim.match(sim.add("f", [*range(8), 4])) == (0, False)


# ---- ranks -------------------------------------------------------------------------------------


def test_rank_reporting_late(make_sim: MakeSim) -> None:
    """A store reported by one of two ranks stays in flight and uncached until the other reports."""
    sim = make_sim(ONE_GROUP, world_size=2)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    out = sim.complete(ranks=[1])
    assert out.committed == ()
    assert sim.mgr.num_live_transfers() == 1
    assert sim.on_cpu(a) == [False, False]
    sim.step()
    out = sim.complete(ranks=[0])
    assert out.committed == (store.transfer_id,)
    assert sim.on_cpu(a) == [True, True]


def test_rank_reporting_twice_is_rejected(make_sim: MakeSim) -> None:
    """A rank naming a transfer again raises ReportError and changes nothing; no double count."""
    sim = make_sim(ONE_GROUP, world_size=2)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    tid = store.transfer_id
    sim.report([sim.workers.report(0, completed=[tid])])
    with pytest.raises(ReportError, match="twice"):
        sim.report([sim.workers.report(0, completed=[tid])])
    with pytest.raises(ReportError, match="twice"):
        sim.report([sim.workers.report(1, completed=[tid]), sim.workers.report(1, failed=[tid])])
    assert sim.mgr.num_live_transfers() == 1
    out = sim.report([sim.workers.report(1, completed=[tid])])
    assert out.committed == (tid,)
    assert sim.mgr.stats().blocks_stored == 2
    with pytest.raises(ReportError, match="unknown or settled"):
        sim.mgr.update_from_reports([sim.workers.report(1, completed=[tid])])


def test_transfer_state_shows_the_ranks_reported_until_release(make_sim: MakeSim) -> None:
    """transfer_state names a live transfer's state and reporting ranks, and None once released."""
    sim = make_sim(ONE_GROUP, world_size=2)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    tid = store.transfer_id
    assert sim.mgr.transfer_state(tid) == (TransferState.IN_FLIGHT, frozenset())
    sim.report([sim.workers.report(1, completed=[tid])])
    assert sim.mgr.transfer_state(tid) == (TransferState.IN_FLIGHT, frozenset({1}))
    sim.report([sim.workers.report(0, completed=[tid])])
    assert sim.mgr.transfer_state(tid) is None
    assert sim.mgr.transfer_state(10_000) is None


def test_rank_never_reporting_keeps_transfer_in_flight(make_sim: MakeSim) -> None:
    """Without every rank's report a transfer never commits, and its refs stay held."""
    sim = make_sim(ONE_GROUP, world_size=3)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    for _ in range(5):
        sim.step()
        assert sim.complete(ranks=[0, 1]).committed == ()
    assert sim.finish(a) is True
    assert sim.mgr.cpu_pools[0].num_free_blocks == 14
    assert sim.mgr.stats().transfers_in_flight == 1
    out = sim.complete(ranks=[2])
    assert out.committed == (store.transfer_id,)
    assert out.finished_sending == {"a"}


# ---- failures ----------------------------------------------------------------------------------


def test_failed_load_reports_invalid_blocks_and_keeps_valid_prefix(make_sim: MakeSim) -> None:
    """A load failing on one rank settles as failed; only its blocks are invalid, the rest stay."""
    sim = make_sim(ONE_GROUP, world_size=2)
    a = sim.stored("a", range(16))
    b = sim.add("b", [*range(16), 9])
    assert sim.match(b, gpu_computed=4) == (12, True)  # block 0 is a GPU prefix hit
    sim.alloc(b, 16, 12)
    (load,) = sim.step().loads
    loaded = load.gpu_block_ids[0]
    assert loaded == tuple(sim.tables["b"][0][1:4])
    with capture_logs() as logs:
        out = sim.report(
            [
                sim.workers.report(0, completed=[load.transfer_id]),
                sim.workers.report(1, failed=[load.transfer_id], invalid=[loaded[1]]),
            ]
        )
    assert out.failed == (load.transfer_id,)
    assert out.finished_recving == {"b"}
    assert out.invalid_block_ids == {loaded[1]}
    assert sim.tables["b"][0][0] not in out.invalid_block_ids
    assert any(e["event"] == "offload_transfer_failed" for e in logs)
    assert sim.mgr.stats().failed_transfers == 1
    assert sim.on_cpu(a) == [True] * 4, "a failed load leaves the CPU copies valid"


def test_failed_load_without_block_detail_invalidates_all_its_blocks(make_sim: MakeSim) -> None:
    """A failure report naming no blocks makes every block of the load invalid."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    _b, load = sim.loading("b", [*range(8), 1])
    out = sim.report([sim.workers.report(0, failed=[load.transfer_id])])
    assert out.invalid_block_ids == set(load.gpu_block_ids[0])


def test_failed_store_is_discarded(make_sim: MakeSim) -> None:
    """A store failing on any rank never enters the CPU prefix cache."""
    sim = make_sim(ONE_GROUP, world_size=2)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    out = sim.report(
        [
            sim.workers.report(0, failed=[store.transfer_id]),
            sim.workers.report(1, completed=[store.transfer_id]),
        ]
    )
    assert out.failed == (store.transfer_id,)
    assert sim.on_cpu(a) == [False, False]
    assert sim.mgr.cpu_pools[0].num_cached_blocks == 0


# ---- models ------------------------------------------------------------------------------------

HYBRID = [
    GroupSpec(block_size=4, num_cpu_blocks=32),
    GroupSpec(block_size=8, num_cpu_blocks=32, sliding_window=8),
]


def test_multi_group_hits_with_sliding_window(make_sim: MakeSim) -> None:
    """Hits agree across groups; the sliding-window group loads only the blocks in its window."""
    sim = make_sim(HYBRID)
    a = sim.add("a", range(33))
    sim.match(a)
    plan = sim.step(new=[(a, 33)])
    (store,) = plan.stores
    assert [len(g) for g in store.gpu_block_ids] == [8, 4]
    sim.complete()
    b = sim.add("b", range(33))
    assert sim.match(b) == (32, True)
    sim.alloc(b, 32, 32)
    (load,) = sim.step().loads
    assert [len(g) for g in load.gpu_block_ids] == [8, 1]
    assert load.gpu_block_ids[1] == (sim.tables["b"][1][3],)
    sim.complete()
    assert sim.gpu_data[sim.tables["b"][1][3]] == sim.hashes(a, 1)[3]
    # Without the window's block 3 on CPU, the hit shrinks to one the window group can serve.
    sim.mgr.cpu_pools[1].uncache([sim.mgr.cpu_pools[1].get_cached_block(sim.hashes(a, 1)[3]) or 0])
    c = sim.add("c", range(33))
    assert sim.match(c) == (24, True)
    sim.alloc(c, 24, 24)
    (load,) = sim.step().loads
    assert [len(g) for g in load.gpu_block_ids] == [6, 1]
    assert load.gpu_block_ids[1] == (sim.tables["c"][1][2],)


def test_null_blocks_never_transferred(make_sim: MakeSim) -> None:
    """The null/padding block of sliding-window groups is never stored or loaded."""
    sim = make_sim(HYBRID, null_block=True)
    a = sim.add("a", range(33))
    sim.null_prefix[("a", 1)] = 2  # SW blocks 0 and 1 fell out of the window
    sim.match(a)
    (store,) = sim.step(new=[(a, 33)]).stores
    assert store.gpu_block_ids[1] == tuple(sim.tables["a"][1][2:4])
    sim.complete()
    b = sim.add("b", range(33))
    sim.null_prefix[("b", 1)] = 3
    assert sim.match(b) == (32, True)
    sim.alloc(b, 32, 32)
    (load,) = sim.step().loads
    assert load.gpu_block_ids[1] == (sim.tables["b"][1][3],)
    sim.complete()
    for plan in sim.workers.plans:
        for spec in (*plan.stores, *plan.loads):
            assert all(sim.null not in ids for ids in spec.gpu_block_ids)


def test_chunked_prefill_stores_only_newly_computed_blocks(make_sim: MakeSim) -> None:
    """Each prefill chunk stores exactly the blocks it completed."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(20))
    sim.match(a)
    got = []
    for plan in (sim.step(new=[(a, 6)]), sim.step(cached=[(a, 6)]), sim.step(cached=[(a, 8)])):
        got.append([ids for s in plan.stores for ids in s.gpu_block_ids[0]])
    table = sim.tables["a"][0]
    assert got == [[table[0]], [table[1], table[2]], [table[3], table[4]]]


def test_speculative_tokens_are_not_stored(make_sim: MakeSim) -> None:
    """Blocks completed only by speculative tokens are not stored until the tokens are confirmed."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(7))
    sim.match(a)
    sim.step(new=[(a, 6)])
    a.all_token_ids.append(7)
    assert sim.step(cached=[(a, 3, 2)]).stores == (), "token 7 is a draft"
    sim.computed["a"] = 7
    (store,) = sim.step(cached=[(a, 1)]).stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][1],),)


def test_extra_keys_separate_cache_entries(make_sim: MakeSim) -> None:
    """The same tokens under different extra keys (e.g. LoRA) never hit each other."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8), extra_keys=("lora-1",))
    assert sim.match(sim.add("b", [*range(8), 1], extra_keys=("lora-2",))) == (0, False)
    assert sim.match(sim.add("c", [*range(8), 1], extra_keys=("lora-1",))) == (8, True)


# ---- API contract ------------------------------------------------------------------------------


def test_update_state_after_alloc_called_again_replaces_the_load(make_sim: MakeSim) -> None:
    """A second allocation before planning replaces the first; zero drops the pin."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(12))
    b = sim.add("b", [*range(12), 1])
    assert sim.match(b) == (12, True)
    sim.alloc(b, 12, 12)
    sim.mgr.update_state_after_alloc(b, sim.tables["b"], 4)
    (load,) = sim.step().loads
    assert load.gpu_block_ids == ((sim.tables["b"][0][0],),)
    sim.complete()
    c = sim.add("c", [*range(12), 2])
    sim.match(c)
    assert sim.mgr.cpu_pools[0].num_free_blocks == 16 - 3, "pinned blocks are out of the queue"
    sim.mgr.update_state_after_alloc(c, [], 0)
    assert sim.mgr.cpu_pools[0].num_free_blocks == 16
    assert sim.step().loads == ()


def test_bad_calls_raise_typed_errors_and_change_nothing(make_sim: MakeSim) -> None:
    """Misuse raises ConfigError, ProtocolError or ReportError naming the problem, leaving the manager usable."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(8))
    with pytest.raises(ProtocolError, match="no pinned CPU hit"):
        sim.mgr.update_state_after_alloc(a, [[1, 2]], 4)
    with pytest.raises(ConfigError, match="num_computed_tokens"):
        sim.mgr.get_num_new_matched_tokens(a, -1)
    with pytest.raises(ReportError, match="unknown"):
        sim.mgr.update_from_reports([sim.workers.report(0, completed=[12345])])
    with pytest.raises(ReportError, match="rank 3"):
        sim.mgr.update_from_reports([sim.workers.report(3)])
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    assert sim.complete().committed == (store.transfer_id,)


def test_config_validation() -> None:
    """Invalid configurations are rejected with ConfigError."""
    with pytest.raises(ConfigError, match="block_size"):
        GroupSpec(block_size=0, num_cpu_blocks=1)
    with pytest.raises(ConfigError, match="at least one"):
        SchedulerConfig(groups=())
    with pytest.raises(ConfigError, match="world_size"):
        SchedulerConfig(groups=ONE_GROUP, world_size=0)
    with pytest.raises(ConfigError, match="sometimes"):
        SchedulerConfig(groups=ONE_GROUP, store_policy="sometimes")
    with pytest.raises(ConfigError, match="gpu_view"):
        OffloadManager(SchedulerConfig(groups=ONE_GROUP, store_policy=StorePolicy.LAZY))


def test_transfer_transitions_are_logged(make_sim: MakeSim) -> None:
    """Every store goes pending → in_flight → committed → released through the transfer table."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(4))
    sim.match(a)
    with capture_logs() as logs:
        (store,) = sim.step(new=[(a, 4)]).stores
        sim.complete()
    path = [
        (e["from"], e["to"])
        for e in logs
        if e["event"] == "transfer_transition" and e["transfer_id"] == store.transfer_id
    ]
    assert path == [("pending", "in_flight"), ("in_flight", "committed"), ("committed", "released")]


def test_request_dropped_by_engine_mid_store_keeps_other_requests_blocks(make_sim: MakeSim) -> None:
    """A request the engine drops without request_finished loses its share of a step's store only."""
    sim = make_sim(ONE_GROUP)
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    sim.match(a)
    sim.match(b)
    (store,) = sim.step(new=[(a, 8), (b, 8)]).stores
    assert len(store.gpu_block_ids[0]) == 4, "one store carries the whole step"
    sim.step(finished=["b"])
    out = sim.complete()
    assert out.committed == (store.transfer_id,)
    assert out.finished_sending == frozenset(), "b never asked for a delayed free"
    assert sim.on_cpu(a) == [True, True]
    assert sim.mgr.cpu_pools[0].num_cached_blocks == 2


def test_invalid_step_or_report_is_rejected_whole(make_sim: MakeSim) -> None:
    """A bad scheduler output or report raises before any of it is applied."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    tid = store.transfer_id
    with pytest.raises(ReportError, match="unknown"):
        sim.mgr.update_from_reports([sim.workers.report(0, completed=[tid, tid + 100])])
    assert sim.on_cpu(a) == [False, False], "the valid half of the report was not applied"
    bad = SchedulerOutput(
        99,
        cached_requests=(CachedRequest("a", [[]], 8, 1), CachedRequest("ghost", [[]], 0, 1)),
        preempted_request_ids=frozenset({"a"}),
    )
    with pytest.raises(ProtocolError, match="ghost"):
        sim.mgr.build_step_plan(bad)
    a.all_token_ids.extend(range(8, 16))
    short = SchedulerOutput(99, cached_requests=(CachedRequest("a", [[]], 8, 8),))
    with pytest.raises(ConfigError, match="cannot hold"):
        sim.mgr.build_step_plan(short)
    assert sim.mgr.num_live_transfers("a") == 1, "the preemption in the bad output was not applied"
    assert sim.complete().committed == (tid,)
    assert sim.on_cpu(a)[:2] == [True, True]


def test_decode_columns_plan_exactly_what_cached_requests_plan(make_sim: MakeSim) -> None:
    """One-token decode steps passed as DecodeRequests give the same plans, step by step, as the
    same steps passed as CachedRequests, through block completions and a finishing request."""
    sims = [make_sim(ONE_GROUP, decode_columns=columns) for columns in (False, True)]
    plans: list[list[StepPlan]] = [[], []]
    for sim, out in zip(sims, plans, strict=True):
        reqs = [sim.add(f"r{i}", range(10 * i, 10 * i + 5 + i)) for i in range(3)]
        for req in reqs:
            sim.match(req)
        out.append(sim.step(new=[(req, len(req.all_token_ids)) for req in reqs]))
        sim.complete()
        for t in range(9):
            for req in reqs:
                req.all_token_ids.append(500 + t)
            out.append(sim.step(cached=[(req, 1) for req in reqs]))
            sim.complete()
        sim.finish(reqs[0])
    assert plans[0] == plans[1]
    assert sum(len(p.stores) for p in plans[1]) >= 3


def test_decode_columns_must_have_equal_lengths() -> None:
    """DecodeRequests with columns of different lengths raise ConfigError naming the counts."""
    from kvflow.core.requests import DecodeRequests

    with pytest.raises(ConfigError, match="2 request ids, 1 computed counts"):
        DecodeRequests(["a", "b"], [3], [((),), ((),)])
    columns = DecodeRequests(["a"], [3], [[[4, 5]]])
    assert columns.new_block_ids == (((4, 5),),)
    assert len(columns) == 1


_ids_columns = st.lists(
    st.tuples(
        st.text(max_size=4),
        st.integers(0, 1 << 40),
        st.lists(
            st.lists(st.integers(0, 1 << 20), max_size=3).map(tuple), min_size=1, max_size=3
        ).map(tuple),
    ),
    max_size=6,
)


@settings(max_examples=100, deadline=None)
@given(_ids_columns)
def test_trusted_decode_columns_equal_the_checked_ones(rows: list[tuple[str, int, Any]]) -> None:
    """DecodeRequests.trusted over valid columns equals the checking constructor's result."""
    from kvflow.core.requests import DecodeRequests

    rids, computed, ids = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    trusted = DecodeRequests.trusted(rids, computed, ids)
    assert trusted == DecodeRequests(rids, computed, ids)
    assert type(trusted.request_ids) is tuple
    assert type(trusted.new_block_ids) is tuple
    assert len(trusted) == len(rows)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 1 << 30),
    st.lists(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20)), max_size=4)),
)
def test_trusted_transfer_spec_equals_the_checked_one(
    tid: int, groups: list[list[tuple[int, int]]]
) -> None:
    """TransferSpec.trusted over tuples of paired ids equals the checking constructor's spec."""
    from kvflow.core.protocol import TransferSpec

    gpu = tuple(tuple(p[0] for p in g) for g in groups)
    cpu = tuple(tuple(p[1] for p in g) for g in groups)
    trusted = TransferSpec.trusted(tid, "r", Direction.STORE, gpu, cpu)
    assert trusted == TransferSpec(tid, "r", Direction.STORE, gpu, cpu)
    assert trusted.num_blocks == sum(len(g) for g in groups)


# ---- eager stores coalesced over decode steps ---------------------------------------------------


def _decode_all(sim: Sim, reqs: list[KVRequest], token: int) -> StepPlan:
    """One decode step of every request in ``reqs`` (one sampled token each)."""
    for req in reqs:
        req.all_token_ids.append(token)
    return sim.step(cached=[(req, 1) for req in reqs])


def test_eager_stores_coalesce_over_the_interval(make_sim: MakeSim) -> None:
    """With an interval of 3, blocks completed in 3 decode steps go out as one store on the
    third step, and each is cached once every rank reported it."""
    sim = make_sim(ONE_GROUP, eager_store_interval=3)
    a = sim.stored("a", range(3))  # 3 tokens: block 0 completes at the first decode step
    b = sim.stored("b", range(100, 105))  # 5 tokens: block 1 completes at the third
    assert _decode_all(sim, [a, b], 7).stores == ()  # a's block 0 completes: deferred
    assert _decode_all(sim, [a, b], 8).stores == ()
    (store,) = _decode_all(sim, [a, b], 9).stores  # b's block 1 completes; the interval is up
    assert store.gpu_block_ids == ((sim.tables["a"][0][0], sim.tables["b"][0][1]),)
    assert sim.on_cpu(a)[:1] == [False]
    sim.complete()
    assert sim.on_cpu(a)[:1] == [True]
    assert sim.on_cpu(b)[:2] == [True, True]


def test_a_step_with_a_new_request_stores_the_deferred_blocks_at_once(make_sim: MakeSim) -> None:
    """A prefill step is not deferred, and it takes the blocks deferred so far along."""
    sim = make_sim(ONE_GROUP, eager_store_interval=8)
    a = sim.stored("a", range(3))
    assert _decode_all(sim, [a], 7).stores == ()
    c = sim.add("c", range(200, 208))
    sim.match(c)
    (store,) = sim.step(new=[(c, 8)]).stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][0], *sim.tables["c"][0][:2]),)
    sim.complete()
    assert sim.on_cpu(a)[:1] == [True]


def test_a_finishing_request_stores_its_deferred_blocks_and_holds_them(make_sim: MakeSim) -> None:
    """A request finishing with deferred blocks has them stored at once and its GPU blocks held
    until the store commits; the other request's deferred blocks wait for the interval."""
    sim = make_sim(ONE_GROUP, eager_store_interval=4)
    a = sim.stored("a", range(3))
    b = sim.stored("b", range(100, 103))
    assert _decode_all(sim, [a, b], 7).stores == ()  # both complete block 0: deferred
    assert sim.finish(a) is True
    (store,) = sim.step().stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][0],),)
    out = sim.complete()
    assert out.finished_sending == {"a"}
    assert sim.on_cpu(a)[:1] == [True]
    assert sim.on_cpu(b)[:1] == [False], "b's block waits for the interval"
    assert _decode_all(sim, [b], 8).stores == ()
    (later,) = _decode_all(sim, [b], 9).stores
    assert later.gpu_block_ids == ((sim.tables["b"][0][0],),)


def test_a_preempted_request_drops_its_deferred_blocks(make_sim: MakeSim) -> None:
    """Deferred blocks of a preempted request are never stored (its GPU blocks are gone); the
    other requests' deferred blocks still are."""
    sim = make_sim(ONE_GROUP, eager_store_interval=2)
    a = sim.stored("a", range(3))
    b = sim.stored("b", range(100, 103))
    assert _decode_all(sim, [a, b], 7).stores == ()
    b_block = sim.tables["b"][0][0]
    (store,) = sim.step(preempted=["a"], cached=[(b, 0)]).stores
    assert store.gpu_block_ids == ((b_block,),)
    sim.complete()
    assert sim.on_cpu(a)[:1] == [False]
    assert sim.on_cpu(b)[:1] == [True]


def test_a_sliding_window_group_stores_every_step(make_sim: MakeSim) -> None:
    """With a sliding-window group the interval does not apply: the engine may free a block that
    leaves the window before a later step would store it."""
    groups = [
        GroupSpec(block_size=BS, num_cpu_blocks=16),
        GroupSpec(block_size=BS, num_cpu_blocks=16, sliding_window=8),
    ]
    sim = make_sim(groups, eager_store_interval=4)
    a = sim.stored("a", range(3))
    (store,) = _decode_all(sim, [a], 7).stores
    assert store.gpu_block_ids[0] == (sim.tables["a"][0][0],)


def test_stores_hold_gpu_refs_only_where_the_engine_may_free_blocks_under_them(
    make_sim: MakeSim,
) -> None:
    """An eager store of full-attention blocks takes no GPU ref (the request keeps its blocks);
    with a sliding-window group every block of the store is held until the copy settles."""
    full = make_sim(ONE_GROUP)
    a = full.add("a", range(8))
    full.match(a)
    (store,) = full.step(new=[(a, 8)]).stores
    assert {full.gpu.block(b).ref_cnt for b in store.gpu_block_ids[0]} == {1}
    hybrid = make_sim(HYBRID)
    b = hybrid.add("b", range(33))
    hybrid.match(b)
    (store,) = hybrid.step(new=[(b, 33)]).stores
    ids = [blk for g in store.gpu_block_ids for blk in g]
    assert {hybrid.gpu.block(blk).ref_cnt for blk in ids} == {2}, "request + store"
    hybrid.complete()
    assert {hybrid.gpu.block(blk).ref_cnt for blk in ids} == {1}


def test_a_request_finishing_without_block_ids_still_stores_its_deferred_blocks(
    make_sim: MakeSim,
) -> None:
    """An engine that passes no block ids to request_finished still gets the deferred blocks
    stored (from the manager's own table) and the free delayed until they are."""
    sim = make_sim(ONE_GROUP, eager_store_interval=4)
    a = sim.stored("a", range(3))
    assert _decode_all(sim, [a], 7).stores == ()
    delay, _params = sim.mgr.request_finished(a, None)
    assert delay is True
    sim.delayed.add("a")
    (store,) = sim.step().stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][0],),)
    assert sim.complete().finished_sending == {"a"}
    assert sim.on_cpu(a)[:1] == [True]


def test_a_bad_finish_changes_nothing(make_sim: MakeSim) -> None:
    """request_finished with the wrong number of block groups raises ConfigError and leaves the
    request's deferred blocks and transfers as they were."""
    sim = make_sim(ONE_GROUP, eager_store_interval=4)
    a = sim.stored("a", range(3))
    assert _decode_all(sim, [a], 7).stores == ()
    with pytest.raises(ConfigError, match="2 block groups, expected 1"):
        sim.mgr.request_finished(a, [[], []])
    assert sim.mgr.has_request("a")
    assert sim.finish(a) is True
    (store,) = sim.step().stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][0],),)
    sim.complete()


# ---- an engine's own block hashes ----------------------------------------------------------------


@define(eq=False)
class EngineHashed(KVRequest):
    """A request whose engine hashes its blocks at block size ``hashed_at`` (as vLLM does)."""

    engine_hashes: list[bytes] = field(factory=list)
    hashed_at: int = BS

    def engine_block_hashes(self, block_size: int) -> list[bytes] | None:
        return self.engine_hashes if block_size == self.hashed_at else None


def _engine_hashed(sim: Sim, rid: str, tokens: list[int], hashes: list[bytes]) -> EngineHashed:
    req = EngineHashed(rid, tokens, len(tokens), engine_hashes=hashes)
    sim.requests[rid] = req
    return req


def test_the_cpu_tier_is_keyed_by_the_engines_hashes_when_it_has_them(make_sim: MakeSim) -> None:
    """A request with engine hashes is stored under them and hashed by kvflow not at all: another
    request with the same engine hashes hits, whatever its tokens."""
    sim = make_sim(ONE_GROUP)
    engine = [bytes([1]) * 16, bytes([2]) * 16]
    a = _engine_hashed(sim, "a", list(range(8)), engine)
    sim.match(a)
    sim.step(new=[(a, 8)])
    sim.complete()
    pool = sim.mgr.cpu_pools[0]
    assert all(pool.get_cached_block(h) is not None for h in engine)
    assert all(pool.get_cached_block(h) is None for h in sim.hashes(a, 0))
    b = _engine_hashed(sim, "b", [*range(100, 108), 5], engine)
    assert sim.match(b) == (8, True)
    c = _engine_hashed(sim, "c", [*range(8), 5], [bytes([3]) * 16, bytes([4]) * 16])
    assert sim.match(c) == (0, False), "same tokens, other engine hashes: no hit"
    sim.finish(b)
    sim.finish(c)


def test_a_block_size_the_engine_does_not_hash_is_hashed_by_kvflow(make_sim: MakeSim) -> None:
    """With groups of two block sizes and engine hashes at one of them, the other group's blocks
    are keyed by kvflow's own hashes of the tokens."""
    groups = [
        GroupSpec(block_size=BS, num_cpu_blocks=16),
        GroupSpec(block_size=8, num_cpu_blocks=16),
    ]
    sim = make_sim(groups)
    engine = [bytes([9 + i]) * 16 for i in range(4)]
    a = _engine_hashed(sim, "a", list(range(16)), engine)
    sim.match(a)
    sim.step(new=[(a, 16)])
    sim.complete()
    small, large = sim.mgr.cpu_pools
    assert all(small.get_cached_block(h) is not None for h in engine)
    assert all(large.get_cached_block(h) is not None for h in hash_blocks(list(range(16)), 8))
