"""Deterministic scenarios of the offload manager (round trips, store policies, CPU eviction,
request lifecycle, reports), each against fake workers that report on command.

Every test builds its simulation with ``make_sim``; after the test the fixture finishes every
request, settles every copy and checks that no block reference leaked on the CPU or GPU pool.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvflow.core.offload import (
    NO_OUTCOME,
    GroupSpec,
    ResetStatus,
)
from kvflow.core.protocol import StepReport
from kvflow.core.transfer import Direction, TransferState
from kvflow.errors import ReportError
from tests.core.conftest import MakeSim

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


def test_lru_order_inside_one_store_of_several_requests(make_sim: MakeSim) -> None:
    """One step's store carries a's and b's blocks: evictions take b's tail first, then b's
    head, then a's tail; a's first block goes last (each request's blocks freed in reverse,
    the requests in reverse order of the step), as docs/vllm.md states."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=4)])
    a, b = sim.add("a", range(8)), sim.add("b", range(100, 108))
    sim.match(a)
    sim.match(b)
    assert len(sim.step(new=[(a, 8), (b, 8)]).stores) == 1
    sim.complete()
    assert sim.on_cpu(a) == [True, True]
    assert sim.on_cpu(b) == [True, True]
    sim.stored("c", range(200, 204))
    assert (sim.on_cpu(a), sim.on_cpu(b)) == ([True, True], [True, False])
    sim.stored("d", range(300, 304))
    assert (sim.on_cpu(a), sim.on_cpu(b)) == ([True, True], [False, False])
    sim.stored("e", range(400, 404))
    assert (sim.on_cpu(a), sim.on_cpu(b)) == ([True, False], [False, False])


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
    """A request finishing mid-store keeps its GPU blocks until the store commits; the manager
    has work (``has_work``) until then, and none after."""
    sim = make_sim(ONE_GROUP)
    assert not sim.mgr.has_work()
    a = sim.add("a", range(8))
    sim.match(a)
    (store,) = sim.step(new=[(a, 8)]).stores
    assert sim.finish(a) is True
    assert sim.mgr.has_request("a")
    assert sim.mgr.has_work()
    assert sim.complete(ranks=[]).finished_sending == frozenset()
    out = sim.complete()
    assert out.committed == (store.transfer_id,)
    assert out.finished_sending == {"a"}
    assert not sim.mgr.has_request("a")
    assert not sim.mgr.has_work()
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


def test_a_failed_eager_store_is_rearmed_and_stored_again(make_sim: MakeSim) -> None:
    """A failed eager store is reported by the ledger and re-armed by the manager: the blocks it
    carried are stored again at the request's next step."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(9))
    sim.match(a)
    (store,) = sim.step(new=[(a, 9)]).stores
    with capture_logs() as logs:
        out = sim.report([sim.workers.report(0, failed=[store.transfer_id])])
    assert out.failed == (store.transfer_id,)
    assert [e["requests"] for e in logs if e["event"] == "offload_store_rearmed"] == [1]
    a.all_token_ids.append(100)
    (again,) = sim.step(cached=[(a, 1)]).stores
    assert again.gpu_block_ids == store.gpu_block_ids
    sim.complete()
    assert sim.on_cpu(a)[:2] == [True, True]


def test_a_step_where_nothing_settled_gets_the_one_empty_outcome(make_sim: MakeSim) -> None:
    """Reports that settle nothing (most steps) return the shared empty outcome, and a step
    that settles a transfer returns its own."""
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", range(10))
    sim.match(a)
    sim.step(new=[(a, 10)])
    assert sim.mgr.update_from_reports([StepReport(0)]) is NO_OUTCOME
    assert sim.mgr.update_from_reports([]) is NO_OUTCOME
    out = sim.complete()
    assert out is not NO_OUTCOME
    assert len(out.committed) == 1
    assert sim.mgr.update_from_reports([StepReport(0)]) is NO_OUTCOME


def test_a_planned_load_names_the_gpu_blocks_it_writes_and_its_first_token(
    make_sim: MakeSim,
) -> None:
    """The debug event of a planned load says which GPU blocks it writes and from which
    computed token, the load's own ids: what a trace needs to find a load that wrote where
    another request read."""
    sim = make_sim(ONE_GROUP, fence_loads="never")
    sim.stored("a", range(10))
    b = sim.add("b", [*range(10), 99])
    with capture_logs() as logs:
        assert sim.match(b) == (8, True)
        sim.alloc(b, 8, 8)
        (load,) = sim.step(new=[(b, 0)]).loads
    (planned,) = [e for e in logs if e["event"] == "offload_load_planned"]
    assert planned["gpu_block_ids"] == load.gpu_block_ids
    assert planned["num_computed_tokens"] == 0
    assert planned["transfer_id"] == load.transfer_id
