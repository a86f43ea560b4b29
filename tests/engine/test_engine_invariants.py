"""Property: however small the cache and budget, the engine's greedy tokens never change and every
block comes back."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest, make_kv_cache_config
from kvflow.engine.model import model_config
from tests.engine.fake_connector import FakeConnector
from tests.engine.helpers import make_engine, shared_model

_REFERENCE: dict[tuple[str, tuple[int, ...], int], tuple[int, ...]] = {}


def _reference(name: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    key = (name, prompt, max_tokens)
    if key not in _REFERENCE:
        engine = make_engine(name, num_gpu_blocks=64, enable_prefix_caching=False)
        (res,) = engine.run_to_completion([GenerationRequest(prompt, max_tokens)])
        _REFERENCE[key] = res.output_token_ids
    return _REFERENCE[key]


def _fake_engine(
    case: tuple[str, list[tuple[tuple[int, ...], int]], int, int, bool],
    ahead: bool,
    **fake: Any,
) -> Engine:
    """An engine for ``case`` (model, cache, budget, prefix caching) with the test connector
    built from ``fake``; stuck, it fails after 200 steps without progress."""
    name, _, blocks, budget, caching = case
    cfg = model_config(name)
    econf = EngineConfig(
        block_size=4,
        num_gpu_blocks=blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        max_idle_steps=200,  # a stuck engine fails fast instead of spinning
        async_scheduling=ahead,
    )
    conn = FakeConnector(make_kv_cache_config(cfg, econf), **fake)
    return Engine(
        cfg, econf, scheduler_connector=conn, worker_connector=conn, model=shared_model(name)
    )


@st.composite
def workloads(draw: st.DrawFn) -> tuple[str, list[tuple[tuple[int, ...], int]], int, int, bool]:
    name = draw(st.sampled_from(["tiny", "tiny-swa6"]))
    prefix = tuple(draw(st.lists(st.integers(0, 63), min_size=0, max_size=16)))
    reqs = draw(
        st.lists(
            st.tuples(
                st.lists(st.integers(0, 63), min_size=1, max_size=14).map(
                    lambda tail: prefix + tuple(tail)
                ),
                st.integers(1, 5),
            ),
            min_size=1,
            max_size=5,
        )
    )
    groups = 2 if name == "tiny-swa6" else 1  # both groups share one pool
    need = groups * max(-(-(len(p) + m) // 4) for p, m in reqs)
    blocks = draw(st.integers(need + 1, need + 12))
    budget = draw(st.integers(1, 24))
    caching = draw(st.booleans())
    return name, reqs, blocks, budget, caching


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans())
def test_outputs_and_blocks_survive_any_cache_and_budget(
    case: tuple[str, list[tuple[tuple[int, ...], int]], int, int, bool],
    ahead: bool,
) -> None:
    """Tokens equal a roomy run's, with steps scheduled ahead or not; afterwards every block
    but the null one is free."""
    name, reqs, blocks, budget, caching = case
    engine = make_engine(
        name,
        num_gpu_blocks=blocks,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        async_scheduling=ahead,
    )
    results = engine.run_to_completion([GenerationRequest(p, m) for p, m in reqs])
    for (p, m), r in zip(reqs, results, strict=True):
        assert r.output_token_ids == _reference(name, p, m)
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks() == blocks - 1  # one pool for every group
    assert not engine.blocks.tables


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.booleans(),
    st.integers(0, 2),
    st.integers(0, 3),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
)
def test_connector_paths_keep_outputs_and_blocks(
    case: tuple[str, list[tuple[tuple[int, ...], int]], int, int, bool],
    load_async: bool,
    fail_loads: int,
    fail_index: int,
    load_delay: int,
    store_eagerly: bool,
    ahead: bool,
) -> None:
    """With external hits (sync or async, some failing) and steps scheduled ahead or not,
    tokens still equal a roomy run's and every block comes back once the connector reported
    its sends."""
    name, reqs, blocks, _, _ = case
    engine = _fake_engine(
        case,
        ahead,
        load_async=load_async,
        load_delay_steps=load_delay,
        fail_loads=fail_loads,
        fail_index=fail_index,
        store_eagerly=store_eagerly,
    )
    for _ in range(2):  # the second pass finds the first one's blocks in the fake's store
        results = engine.run_to_completion([GenerationRequest(p, m) for p, m in reqs])
        for (p, m), r in zip(reqs, results, strict=True):
            assert r.output_token_ids == _reference(name, p, m)
    assert engine.blocks.num_free_blocks() == blocks - 1
    assert not engine.blocks.tables


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=3),
    st.booleans(),
    st.booleans(),
)
def test_aborts_at_any_step_leave_the_others_tokens_and_every_block(
    case: tuple[str, list[tuple[tuple[int, ...], int]], int, int, bool],
    aborts: list[tuple[int, int]],
    ahead: bool,
    store: bool,
) -> None:
    """Requests aborted at any step (their step in flight or not, scheduled ahead or not, their
    blocks held by a connector's save or not) yield a prefix of their tokens; every other
    request yields all of its reference tokens, and every block comes back."""
    name, reqs, blocks, _, _ = case
    engine = _fake_engine(case, ahead, store_eagerly=store)
    ids = [engine.add_request(p, m, request_id=f"r{i}") for i, (p, m) in enumerate(reqs)]
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    aborted: set[str] = set()
    step = 0
    while engine.has_unfinished():
        for at, which in aborts:
            rid = ids[which % len(ids)]
            flying = engine._inflight is not None and any(
                c.request_id == rid for c in engine._inflight.batch.chunks
            )
            if at == step and engine.abort_request(rid):
                aborted.add(rid)
                event("an abort while its step is in flight" if flying else "an abort")
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        step += 1
    for rid, (p, m) in zip(ids, reqs, strict=True):
        want = _reference(name, p, m)
        if rid in aborted:
            assert tuple(got[rid]) == want[: len(got[rid])]
        else:
            assert tuple(got[rid]) == want
    assert engine.blocks.num_free_blocks() == blocks - 1
    assert not engine.blocks.tables
    assert not engine.scheduler.requests
