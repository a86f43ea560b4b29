"""The manager's CPU-tier cache events (what an engine publishes to KV-aware routers) and requests
that must not read cached KV."""

from __future__ import annotations

from kvflow.core.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from kvflow.core.offload import GroupSpec
from kvflow.core.requests import KVRequest
from tests.core.conftest import MakeSim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=4, block_bytes=1024)]
TWO_GROUPS = [
    GroupSpec(block_size=BS, num_cpu_blocks=8, block_bytes=1024),
    GroupSpec(block_size=BS, num_cpu_blocks=8, block_bytes=1024),
]


def test_committed_store_is_one_stored_event_with_the_blocks_hashes(make_sim: MakeSim) -> None:
    """A store reports nothing until every rank reported it, then one BlockStored with its
    hashes in block order, the CPU blocks that hold them, and each block's parent hash, tokens
    and request."""
    sim = make_sim(ONE_GROUP, enable_events=True, world_size=2)
    a = sim.add("a", range(10))
    sim.match(a)
    sim.step(new=[(a, 10)])
    assert sim.mgr.take_events() == []
    sim.complete(ranks=[0])
    assert sim.mgr.take_events() == []
    sim.complete(ranks=[1])
    ((g, event),) = sim.mgr.take_events()
    assert g == 0
    assert isinstance(event, BlockStored)
    assert list(event.block_hashes) == sim.hashes(a, 0)
    pool = sim.mgr.cpu_pools[0]
    assert [pool.get_cached_block(h) for h in event.block_hashes] == list(event.block_ids)
    hashes = sim.hashes(a, 0)
    assert [i.parent_hash for i in event.infos] == [None, hashes[0]]
    assert [i.token_ids for i in event.infos] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(i.request is a for i in event.infos)
    assert sim.mgr.take_events() == [], "drained"


def test_eviction_is_a_removed_event_for_the_evicted_hashes(make_sim: MakeSim) -> None:
    """Filling the 4-block CPU tier past its size evicts the least recently used blocks: their
    hashes leave in one BlockRemoved, before the new blocks' BlockStored."""
    sim = make_sim(ONE_GROUP, enable_events=True)
    a = sim.stored("a", range(16))
    sim.mgr.take_events()
    b = sim.stored("b", range(100, 108))
    events = [e for _, e in sim.mgr.take_events()]
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    removed = events[0]
    assert isinstance(removed, BlockRemoved)
    assert set(removed.block_hashes) <= set(sim.hashes(a, 0))
    assert len(removed.block_hashes) == 2
    assert list(events[1].block_hashes) == sim.hashes(b, 0)  # type: ignore[union-attr]


def test_reset_is_one_cleared_event_after_every_group_stored_before_it(make_sim: MakeSim) -> None:
    """Two groups: what both stored before a reset comes first, then one AllBlocksCleared, then
    what was stored after it, so a router never keeps a block the reset dropped."""
    sim = make_sim(TWO_GROUPS, enable_events=True)
    sim.stored("a", range(8))
    sim.mgr.reset_cache()
    sim.stored("b", range(100, 108))
    events = sim.mgr.take_events()
    kinds = [(g, type(e).__name__) for g, e in events]
    assert kinds == [
        (0, "BlockStored"),
        (1, "BlockStored"),
        (0, "AllBlocksCleared"),
        (0, "BlockStored"),
        (1, "BlockStored"),
    ]
    assert isinstance(events[2][1], AllBlocksCleared)


def test_no_events_are_kept_unless_enabled(make_sim: MakeSim) -> None:
    """Without enable_events the pools record nothing (no cost, nothing grows)."""
    sim = make_sim(ONE_GROUP)
    sim.stored("a", range(8))
    assert sim.mgr.take_events() == []
    assert all(not pool.take_events() for pool in sim.mgr.cpu_pools)


def test_a_request_that_reads_no_cached_kv_gets_no_hit_and_takes_no_pin(
    make_sim: MakeSim,
) -> None:
    """skip_reading_prefix_cache: a stored prompt is no hit (no counter moves, no CPU block
    pinned), and the request's own blocks are still stored."""
    sim = make_sim([GroupSpec(block_size=BS, num_cpu_blocks=16, block_bytes=1024)])
    sim.stored("a", range(8))
    before = sim.mgr.stats()
    b = KVRequest.from_prompt("b", [*range(8), *range(50, 58)])
    b.skip_reading_prefix_cache = True
    sim.requests["b"] = b
    assert sim.match(b) == (0, False)
    after = sim.mgr.stats()
    assert (after.lookups, after.hits, after.hit_tokens) == (
        before.lookups,
        before.hits,
        before.hit_tokens,
    )
    assert all(not refs for refs in sim.mgr.cpu_refs())
    sim.step(new=[(b, 16)])
    sim.complete()
    assert sim.on_cpu(b) == [True] * 4
