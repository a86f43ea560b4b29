"""Deterministic scenarios of the offload manager (multi-group hits, inputs and their validation,
decode columns, the eager store interval, GPU refs, engine hashes), each against fake workers
that report on command.

Every test builds its simulation with ``make_sim``; after the test the fixture finishes every
request, settles every copy and checks that no block reference leaked on the CPU or GPU pool.
"""

from __future__ import annotations

from typing import Any

import pytest
from attrs import define, field
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from kvflow.core.hashing import hash_blocks
from kvflow.core.offload import (
    GroupSpec,
    OffloadManager,
    OffloadManagerConfig,
    StorePolicy,
)
from kvflow.core.protocol import StepPlan
from kvflow.core.requests import CachedRequest, KVRequest, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError, ReportError
from tests.core.conftest import MakeSim
from tests.core.scheduler_harness import Sim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=16, block_bytes=1024)]


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
    """Misuse raises ProtocolError, ConfigError or ReportError naming the problem, leaving the
    manager usable."""
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
        OffloadManagerConfig(groups=())
    with pytest.raises(ConfigError, match="world_size"):
        OffloadManagerConfig(groups=ONE_GROUP, world_size=0)
    with pytest.raises(ConfigError, match="sometimes"):
        OffloadManagerConfig(groups=ONE_GROUP, store_policy="sometimes")
    with pytest.raises(ConfigError, match="gpu_view"):
        OffloadManager(OffloadManagerConfig(groups=ONE_GROUP, store_policy=StorePolicy.LAZY))


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


def test_ids_checked_at_allocation_are_not_checked_again_unchanged(
    make_sim: MakeSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new request scheduled with the very ids update_state_after_alloc validated has its
    store planned without a second id check; scheduled with other ids, they are checked (a
    repeated id is a ConfigError and the step changes nothing)."""
    from kvflow.core import validate
    from kvflow.core.requests import NewRequest

    seen: list[Any] = []
    checked = validate.step_entries

    def spy(entries: Any, *args: Any) -> None:
        seen.append([e[2] for e in entries])
        checked(entries, *args)

    monkeypatch.setattr(validate, "step_entries", spy)
    sim = make_sim(ONE_GROUP)
    a = sim.add("a", list(range(8)))
    sim.match(a)
    table = sim.alloc(a, 8, 0)
    plan = sim.mgr.build_step_plan(SchedulerOutput(1, (NewRequest("a", [list(table[0])], 0, 8),)))
    assert seen[-1] == [((),)], "the allocation's ids are not checked twice"
    assert len(plan.stores) == 1
    sim.workers.run(plan)
    sim._compute(a, 8)
    b = sim.add("b", list(range(100, 108)))
    sim.match(b)
    sim.alloc(b, 8, 0)
    bad = [sim.tables["b"][0][0]] * 2
    with pytest.raises(ConfigError, match="given twice"):
        sim.mgr.build_step_plan(SchedulerOutput(2, (NewRequest("b", [bad], 0, 8),)))
    assert seen[-1] == [(tuple(bad),)]
    sim.complete()
    assert sim.on_cpu(a) == [True, True]
