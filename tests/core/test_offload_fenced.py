"""Fenced loads (``FenceLoads``): a CPU hit loaded in the step that computes its request, the
forward waiting for the copies, instead of the request waiting in the scheduler."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvflow.core.offload import FenceLoads, GroupSpec, OffloadManagerConfig
from kvflow.core.protocol import TransferSpec
from kvflow.core.requests import KVRequest
from kvflow.errors import ConfigError
from tests.core.conftest import MakeSim
from tests.core.scheduler_harness import Sim

BS = 4
ONE_GROUP = [GroupSpec(block_size=BS, num_cpu_blocks=16, block_bytes=1024)]


def _fenced_load(sim: Sim) -> tuple[KVRequest, TransferSpec]:
    """Request b's 8-token CPU hit, fenced, launched in the step computing its last 3 tokens."""
    sim.stored("a", range(10))
    b = sim.add("b", [*range(10), 99])
    assert sim.match(b) == (8, False)
    sim.alloc(b, 8, 8)
    (load,) = sim.step(new=[(b, 3)]).loads
    return b, load


def test_idle_engine_fences_the_load_and_reports_no_finished_recving(make_sim: MakeSim) -> None:
    """With no request running, a hit is synchronous: the plan of the step that computes the
    request names its load as fenced, the load commits without a ``finished_recving``, the
    data lands and every pin is released."""
    sim = make_sim(ONE_GROUP, fence_loads="idle")
    a = sim.stored("a", range(10))
    assert sim.finish(a) is False
    b = sim.add("b", [*range(10), 99])
    with capture_logs() as logs:
        assert sim.match(b) == (8, False)
    assert [e["fenced"] for e in logs if e["event"] == "offload_hit"] == [True]
    sim.alloc(b, 8, 8)
    plan = sim.step(new=[(b, 3)])
    (load,) = plan.loads
    assert plan.fenced_loads == (load.transfer_id,)
    out = sim.complete([load.transfer_id])
    assert out.committed == (load.transfer_id,)
    assert out.finished_recving == frozenset()
    assert [sim.gpu_data[blk] for blk in sim.tables["b"][0][:2]] == sim.hashes(b, 0)


def test_a_running_request_keeps_loads_asynchronous(make_sim: MakeSim) -> None:
    """Under ``idle``, a hit found while another request runs loads asynchronously (its step
    would otherwise wait for the copies) and is reported in ``finished_recving``."""
    sim = make_sim(ONE_GROUP, fence_loads="idle")
    sim.stored("a", range(10))
    c = sim.add("c", range(50, 55))
    sim.match(c)
    sim.step(new=[(c, 5)])  # c runs from now on
    b = sim.add("b", [*range(10), 99])
    assert sim.match(b) == (8, True)
    sim.alloc(b, 8, 8)
    plan = sim.decode(c, 7)
    assert plan.fenced_loads == ()
    (load,) = plan.loads
    assert sim.complete([load.transfer_id]).finished_recving == {"b"}


def test_the_engine_is_idle_again_once_its_running_requests_finish(make_sim: MakeSim) -> None:
    """Requests the last step scheduled that have all finished since leave the engine idle: the
    next hit is fenced; one of two still running keeps it asynchronous."""
    sim = make_sim(ONE_GROUP, fence_loads="idle")
    sim.stored("a", range(10))
    c = sim.add("c", range(50, 55))
    d = sim.add("d", range(60, 65))
    for r in (c, d):
        sim.match(r)
    sim.step(new=[(c, 5), (d, 5)])
    sim.finish(c)
    b = sim.add("b", [*range(10), 99])
    assert sim.match(b) == (8, True), "d still runs"
    sim.finish(d)
    assert sim.match(b) == (8, False), "nobody runs: the load is fenced"


def test_never_and_always(make_sim: MakeSim) -> None:
    """``never`` keeps every hit asynchronous even on an idle engine; ``always`` fences every
    hit even while others run."""
    never = make_sim(ONE_GROUP, fence_loads="never")
    never.stored("a", range(10))
    assert never.match(never.add("b", [*range(10), 99])) == (8, True)
    always = make_sim(ONE_GROUP, fence_loads="always")
    always.stored("a", range(10))
    c = always.add("c", range(50, 55))
    always.match(c)
    always.step(new=[(c, 5)])
    b = always.add("b", [*range(10), 99])
    assert always.match(b) == (8, False)
    always.alloc(b, 8, 8)
    c.all_token_ids.append(7)
    plan = always.step(new=[(b, 3)], cached=[(c, 1)])
    assert plan.fenced_loads == tuple(t.transfer_id for t in plan.loads)


def test_a_failed_fenced_load_names_its_blocks_invalid_without_finished_recving(
    make_sim: MakeSim,
) -> None:
    """A fenced load that fails reports its GPU blocks invalid (the engine rolls the running
    request back) and no ``finished_recving`` (the request is not waiting for it)."""
    sim = make_sim(ONE_GROUP, fence_loads="always")
    _, load = _fenced_load(sim)
    out = sim.report([sim.workers.report(0, failed=[load.transfer_id])])
    assert out.failed == (load.transfer_id,)
    assert out.invalid_block_ids == frozenset(sim.tables["b"][0][:2])
    assert out.finished_recving == frozenset()


def test_fence_loads_takes_only_its_choices() -> None:
    """A bad ``fence_loads`` raises a ConfigError naming the option and its choices."""
    with pytest.raises(ConfigError, match=r"fence_loads must be one of \['never', 'idle'"):
        OffloadManagerConfig(groups=ONE_GROUP, fence_loads="sometimes")
    assert OffloadManagerConfig(groups=ONE_GROUP).fence_loads is FenceLoads.NEVER


def test_a_request_finishing_under_its_fenced_load_lets_it_commit(make_sim: MakeSim) -> None:
    """A fenced load was read by the step that launched it: a request finishing before the copy
    is reported keeps its blocks until then, and the load commits (counted as loaded) instead
    of being abandoned, with no ``finished_recving``."""
    sim = make_sim(ONE_GROUP, fence_loads="always")
    b, load = _fenced_load(sim)
    assert sim.finish(b) is True
    assert sim.step().abandoned == ()
    out = sim.complete([load.transfer_id])
    assert out.committed == (load.transfer_id,)
    assert out.finished_recving == frozenset()
    assert out.finished_sending == {"b"}
    assert sim.mgr.stats().blocks_loaded == 2


def test_several_ranks_keep_every_load_asynchronous(make_sim: MakeSim) -> None:
    """With two ranks no load is fenced, even under ``always``: a copy failing on the other
    rank is known only from its report, after the step's tokens would have been taken."""
    sim = make_sim(ONE_GROUP, fence_loads="always", world_size=2)
    sim.stored("a", range(10))
    assert sim.match(sim.add("b", [*range(10), 99])) == (8, True)


def test_a_failed_fenced_load_keeps_its_steps_stores_out_of_the_cpu_cache(
    make_sim: MakeSim,
) -> None:
    """The step that read a failed fenced load computed its request's next blocks from garbage:
    that step's store of them completes but is not cached (a later hit would serve it), while
    the same store's blocks of another request are."""
    sim = make_sim(ONE_GROUP, fence_loads="always")
    sim.stored("a", range(10))
    c = sim.add("c", range(40, 48))
    sim.match(c)
    b = sim.add("b", [*range(10), 99, 98, 97, 96, 95])
    assert sim.match(b) == (8, False)
    sim.alloc(b, 8, 8)
    plan = sim.step(new=[(b, 7), (c, 8)])
    (load,) = plan.loads
    assert plan.stores, "the step stores b's block 2 (tokens 8-11) and c's two blocks"
    out = sim.report([sim.workers.report(0, failed=[load.transfer_id])])
    assert out.invalid_block_ids == frozenset(sim.tables["b"][0][:2])
    sim.complete()
    assert sim.on_cpu(b) == [True, True, False]
    assert sim.on_cpu(c) == [True, True]
