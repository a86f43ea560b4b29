"""Decode steps handed to the offload manager whole (``OffloadManager.decode_step``): which requests
are due (``DecodePhases``), what the fused step stores, and its input checks (bad input raises a
typed error and changes nothing)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.offload import GroupSpec
from kvflow.core.offload.decode import DecodePhases
from kvflow.core.protocol import StepPlan
from kvflow.core.requests import KVRequest, SchedulerOutput
from kvflow.errors import ConfigError, KVFlowError, ProtocolError
from tests.core.conftest import MakeSim
from tests.core.scheduler_harness import Sim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=64, block_bytes=1024)]


# ---- DecodePhases ------------------------------------------------------------------------------

# One engine step of a decode run: ("steady", per-request count moves) takes every count up by
# one unless its move says it went back (an engine recomputing after a failed load); "gap" is a
# step the general path handled (anything may change); "leave" / "join" change the batch. Only
# what an engine can do after a steady step: no count grows by more than one.
_steady_step = st.tuples(
    st.just("steady"),
    st.lists(st.sampled_from([0] * 20 + [-1, -3]), min_size=6, max_size=6),
)
_phase_scripts = st.lists(
    st.one_of(
        _steady_step,
        _steady_step,
        _steady_step,
        _steady_step,
        st.tuples(st.just("gap"), st.lists(st.integers(-3, 5), min_size=6, max_size=6)),
        st.tuples(st.just("leave"), st.lists(st.integers(0, 5), min_size=1, max_size=1)),
        st.tuples(st.just("join"), st.lists(st.integers(0, 40), min_size=1, max_size=1)),
    ),
    min_size=4,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), _phase_scripts, st.integers(1, 5))
def test_phases_find_the_due_requests_of_a_steady_run_as_a_full_pass_does(
    start: list[int], script: list[tuple[str, list[int]]], boundary: int
) -> None:
    """Over random runs of steady steps (counts up by one, some going back), gaps, and requests
    leaving and joining, the residue shortcut returns the requests a pass over the batch finds
    (count one short of a multiple of the boundary), at every step."""
    phases = DecodePhases(boundary)
    rids = [f"r{i}" for i in range(len(start))]
    counts = list(start)
    step, joined = 0, len(start)
    for kind, moves in script:
        step += 1
        if kind == "steady":
            counts = [
                c + 1 if moves[i % 6] == 0 else max(0, c + moves[i % 6])
                for i, c in enumerate(counts)
            ]
        elif kind == "gap":
            counts = [max(0, c + moves[i % 6]) for i, c in enumerate(counts)]
            continue  # the general path ran: the phases were not asked this step
        elif kind == "leave":
            if len(rids) > 1:
                k = moves[0] % len(rids)
                del rids[k], counts[k]
            continue
        else:
            rids.append(f"r{joined}")
            counts.append(moves[0])
            joined += 1
            continue
        got = phases.due(step, list(rids), list(counts))
        assert got == [i for i, c in enumerate(counts) if c % boundary == boundary - 1]
        assert phases.states == [None] * len(rids) or len(phases.states) == len(rids)


def test_phases_use_the_residue_shortcut_over_a_steady_run() -> None:
    """Over the same requests decoding one token a step, the second step on finds its due
    requests from the residues indexed then, and a request whose count went back breaks the run
    (the next step makes a full pass again)."""
    phases = DecodePhases(4)
    rids, counts = ["a", "b", "c"], [1, 2, 3]
    for step in range(1, 4):
        assert phases.due(step, rids, counts) == [i for i, c in enumerate(counts) if c % 4 == 3]
        assert (phases._phases is not None) == (step >= 2)
        counts = [c + 1 for c in counts]
    counts[0] -= 2  # the engine recomputes part of request a
    phases.due(4, rids, counts)
    assert phases._phases is None


def test_phases_refuse_a_request_listed_twice() -> None:
    """A batch that lists a request twice is a ``ProtocolError`` naming it, and the next call
    starts a run afresh."""
    phases = DecodePhases(4)
    with pytest.raises(ProtocolError, match="'a' scheduled twice"):
        phases.due(1, ["a", "b", "a"], [0, 1, 2])
    assert phases.due(2, ["a", "b"], [3, 1]) == [0]


# ---- the fused step ----------------------------------------------------------------------------


def _running(sim: Sim, lengths: dict[str, int]) -> list[KVRequest]:
    """Requests prefilled (one step) and their stores settled: decode-ready."""
    reqs = []
    for rid, n in lengths.items():
        req = sim.add(rid, range(ord(rid) * 100, ord(rid) * 100 + n))
        sim.match(req)
        reqs.append(req)
    sim.step(new=[(r, len(r.all_token_ids)) for r in reqs])
    sim.complete()
    return reqs


def _spy_general_path(sim: Sim) -> list[SchedulerOutput]:
    """The steps ``build_step_plan`` plans from now on, as a list that grows."""
    general: list[SchedulerOutput] = []
    plan_step = sim.mgr.build_step_plan

    def spy(so: SchedulerOutput) -> StepPlan:
        general.append(so)
        return plan_step(so)

    sim.mgr.build_step_plan = spy  # type: ignore[method-assign,assignment]
    return general


def _decode(sim: Sim, reqs: list[KVRequest]) -> StepPlan:
    """One steady step: each request samples a token and schedules it."""
    for r in reqs:
        r.all_token_ids.append(7)
    return sim.step(cached=[(r, 1) for r in reqs])


def test_decode_steps_store_each_completed_block_without_the_general_path(
    make_sim: MakeSim,
) -> None:
    """Steady steps handed whole to ``decode_step`` store each block as its last token is
    computed, with the blocks allocated since, and never go through ``build_step_plan``."""
    sim = make_sim(ONE_GROUP, decode_steps=True)
    a, b = _running(sim, {"a": 6, "b": 8})
    general = _spy_general_path(sim)
    stored: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(5):
        plan = _decode(sim, [a, b])
        stored += [(s.request_id, s.gpu_block_ids[0]) for s in plan.stores]
        sim.complete()
    assert general == []
    # a: token 7 completes block 1 at the second step; b: block 2, allocated at the first step
    # for token 8, completes with token 11 at the fourth.
    assert stored == [("a", (sim.tables["a"][0][1],)), ("b", (sim.tables["b"][0][2],))]
    assert sim.on_cpu(a) == [True, True]
    assert sim.on_cpu(b) == [True, True, True]


def test_decode_steps_coalesce_stores_over_the_store_interval(make_sim: MakeSim) -> None:
    """With ``eager_store_interval`` 3, the blocks completed by decode steps are stored
    together on the third plan after the first of them completed, as one store."""
    sim = make_sim(ONE_GROUP, decode_steps=True, eager_store_interval=3)
    a, b = _running(sim, {"a": 7, "b": 6})
    plans = [_decode(sim, [a, b]) for _ in range(4)]
    assert [len(p.stores) for p in plans] == [0, 0, 1, 0]
    (store,) = plans[2].stores
    assert store.gpu_block_ids == ((sim.tables["a"][0][1], sim.tables["b"][0][1]),)
    sim.complete()


def test_a_count_that_went_back_takes_the_general_path(make_sim: MakeSim) -> None:
    """A decode step whose count for a request is below what it confirmed (the engine
    recomputes) is planned by ``build_step_plan`` with the step's news as columns."""
    sim = make_sim(ONE_GROUP, decode_steps=True)
    (a,) = _running(sim, {"a": 8})
    general = _spy_general_path(sim)
    for _ in range(4):
        _decode(sim, [a])
    sim.complete()
    plan = sim.mgr.decode_step(50, ["a"], [3], [None])  # confirmed 12, the step says 4
    assert plan.stores == ()
    assert [so.decode_requests.request_ids for so in general] == [("a",)]


# ---- input checks ------------------------------------------------------------------------------


def _snapshot(sim: Sim) -> Any:
    mgr = sim.mgr
    return (
        {
            rid: ([list(g) for g in st.table], list(st.cursor), st.confirmed, st.next_boundary)
            for rid, st in mgr._requests.items()
        },
        mgr.stats(),
        mgr.num_live_transfers(),
        [[(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks] for pool in mgr.cpu_pools],
        [list(pool.free_ids()) for pool in mgr.cpu_pools],
    )


BAD_STEPS: list[tuple[str, Any, type[KVFlowError], str]] = [
    ("columns of two lengths", (9, ["a", "b"], [11], [None, None]), ConfigError, "2 request ids"),
    ("a step that is not an int", ("9", ["a"], [11], [None]), ConfigError, "step must be an int"),
    ("an unknown request completing", (9, ["a", "x"], [11, 3], [None, None]), ProtocolError, "'x'"),
    (
        "an unknown request allocating",
        (9, ["a", "x"], [11, 4], [None, ([5],)]),
        ProtocolError,
        "'x'",
    ),
    ("a request listed twice", (9, ["a", "a"], [11, 11], [None, None]), ProtocolError, "twice"),
    ("a block id out of range", (9, ["a"], [12], [([99],)]), ConfigError, "99 out of range"),
    ("a negative block id", (9, ["a"], [12], [([-1],)]), ConfigError, "out of range"),
    ("a block id that is not an int", (9, ["a"], [12], [(["5"],)]), ConfigError, "not an int"),
    ("a block id given twice", (9, ["a"], [12], [([5, 5],)]), ConfigError, "5 given twice"),
    ("two groups for one", (9, ["a"], [12], [([5], [6])]), ConfigError, "2 block groups"),
    ("a table too short", (9, ["a"], [15], [None]), ConfigError, "cannot hold 16 computed"),
    ("a count that is not an int", (9, ["a"], [11.0], [None]), ConfigError, "must be an int"),
]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [pytest.param(args, error, match, id=name) for name, args, error, match in BAD_STEPS],
)
def test_bad_decode_steps_are_refused_and_change_nothing(
    make_sim: MakeSim, args: Any, error: type[KVFlowError], match: str
) -> None:
    """Each malformed decode step raises a typed error naming the problem before anything
    changes: tables, cursors, counters, live transfers and CPU blocks are as they were, and the
    next good step plans as if the bad one never came."""
    sim = make_sim(ONE_GROUP, decode_steps=True, gpu_blocks=32)
    (a,) = _running(sim, {"a": 9})  # three blocks allocated, tokens 0..8 computed
    a.all_token_ids.extend(range(500, 507))  # 16 tokens: the counts below are within them
    for _ in range(2):
        sim.step(cached=[(a, 1)])  # tokens 9 and 10: a run of decode steps under way
    before = _snapshot(sim)
    with pytest.raises(error, match=match):
        sim.mgr.decode_step(*args)
    assert _snapshot(sim) == before
    (store,) = sim.step(cached=[(a, 1)]).stores  # token 11 completes block 2
    assert store.gpu_block_ids == ((sim.tables["a"][0][2],),)
    sim.complete()
    assert sim.on_cpu(a) == [True, True, True, False]


# ---- quiet steps (lazy over a keyed view) -------------------------------------------------------


def test_quiet_steps_refuse_policies_whose_running_requests_have_news(make_sim: MakeSim) -> None:
    """``quiet_step`` is for the lazy policy over a keyed view only: under eager, or lazy over
    content records, a step without its running requests would lose their blocks' news."""
    for kwargs in ({}, {"store_policy": "lazy"}):
        sim = make_sim(ONE_GROUP, **kwargs)
        with pytest.raises(ConfigError, match="quiet_step needs the lazy store policy"):
            sim.mgr.quiet_step(1)


def test_a_bad_quiet_step_number_is_refused(make_sim: MakeSim) -> None:
    """A step number that is not an int >= 0 is a ConfigError naming the step."""
    sim = make_sim(ONE_GROUP, store_policy="lazy", keyed=True, quiet_steps=True)
    for bad in (-1, 1.0, "2", True):
        with pytest.raises(ConfigError, match="step"):
            sim.mgr.quiet_step(bad)  # type: ignore[arg-type]


def test_a_quiet_step_launches_an_allocated_hit_as_a_load(make_sim: MakeSim) -> None:
    """A hit allocated since the last step still becomes a load at a quiet step (the general
    path plans it), and the lazy walk then stores what a finished request freed."""
    sim = make_sim(
        ONE_GROUP,
        store_policy="lazy",
        keyed=True,
        quiet_steps=True,
        lazy_watermark=16,
        gpu_blocks=16,
    )
    a = sim.add("a", list(range(12)))
    sim.match(a)
    sim.step(new=[(a, 12)])
    sim.finish(a)
    (store,) = sim.step().stores
    assert len(store.gpu_block_ids[0]) == 3
    sim.complete()
    b = sim.add("b", [*range(12), 99])
    assert sim.match(b) == (12, True)
    sim.alloc(b, 12, 12)
    plan = sim.mgr.quiet_step(sim.step_no + 1)
    assert plan is not None
    (load,) = plan.loads
    assert load.request_id == "b"
    assert len(load.gpu_block_ids[0]) == 3
    sim.workers.run(plan)
    sim.complete()
