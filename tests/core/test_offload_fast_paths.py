"""Property tests of the lazy cursor's, the ledger's and the manager's fast paths: each gives what
the general path gives (the one-group record, the batched take, the single-rank report, the
one-group reading of decode columns)."""

from __future__ import annotations

from functools import partial
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core.block_pool import BlockPool
from kvflow.core.gpu_view import BlockPoolGpuView
from kvflow.core.offload.config import Geometry, GroupSpec, OffloadManagerConfig
from kvflow.core.offload.lazy import LazyCursor
from kvflow.core.offload.state import RequestState
from kvflow.core.protocol import StepReport
from kvflow.core.run_pool import RunBlockPool
from kvflow.errors import ReportError
from tests.core.scheduler_harness import Sim
from tests.core.test_offload_eager import BS, NULL, _hash, _request, _states

GPU_BLOCKS = 8


def _cursor(engine_hashed: list[int]) -> LazyCursor:
    """A one-group cursor over a GPU pool whose blocks ``engine_hashed`` hold an engine hash."""
    config = OffloadManagerConfig(
        groups=(GroupSpec(block_size=BS, num_cpu_blocks=16),), store_policy="lazy"
    )
    gpu = BlockPool(GPU_BLOCKS, name="gpu")
    ids = gpu.get_new_blocks(GPU_BLOCKS)
    for b in dict.fromkeys(engine_hashed):
        gpu.cache([b], [_hash(100 + b)])
    gpu.free(ids)
    return LazyCursor(
        Geometry.of(config),
        [RunBlockPool(16, name="cpu")],
        [{}],
        BlockPoolGpuView(gpu),
        null_block_id=NULL,
        watermark=4,
    )


def _ids(specs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The request specs with GPU block ids inside the pool."""
    return [([b % GPU_BLOCKS for b in s[0]], *s[1:]) for s in specs]


def _states_after(sts: list[RequestState]) -> list[tuple[Any, ...]]:
    return [(s.cursor, s.next_boundary, list(s.hash_lists[0])) for s in sts]


@settings(max_examples=300, deadline=None)
@given(st.lists(_request, max_size=4), st.lists(st.integers(0, GPU_BLOCKS - 1), max_size=6))
def test_one_group_record_equals_the_general_one(
    specs: list[tuple[Any, ...]], engine_hashed: list[int]
) -> None:
    """For one KV cache group, the unrolled record leaves the same records, cursors, boundaries
    and hashes as the loop over groups, null blocks and repeated blocks included."""
    specs = _ids(specs)
    one, general = _states(specs), _states(specs)
    a, b = _cursor(engine_hashed), _cursor(engine_hashed)
    a._record_one(one)
    b._record_groups(general)
    assert a._record == b._record
    assert _states_after(one) == _states_after(general)


_tables = st.lists(
    st.lists(st.integers(0, GPU_BLOCKS - 1), max_size=3).map(lambda ids: (tuple(ids),)),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    _tables,
    st.sets(st.integers(0, GPU_BLOCKS - 1)),
    st.none() | st.integers(0, GPU_BLOCKS - 1),
    st.sets(st.integers(0, GPU_BLOCKS - 1)),
)
def test_taken_tables_equals_taken_per_group(
    tables: list[tuple[tuple[int, ...], ...]],
    ahead: set[int],
    cursor: int | None,
    recorded: set[int],
) -> None:
    """Taking every table in one call leaves the same records, covered blocks and cursor as
    taking each group's ids in turn, whether or not the cursor's block is among them."""
    a, b = _cursor([]), _cursor([])
    for c in (a, b):
        c._ahead = set(ahead) | ({cursor} if cursor is not None else set())
        c._cursor = cursor
        c._record = {blk: (0, _hash(blk), None) for blk in recorded}
    a.taken_tables(tables)
    for ids in tables:
        for group_ids in ids:
            b.taken(group_ids)
    assert (a._record, a._ahead, a._cursor) == (b._record, b._ahead, b._cursor)


_report = st.tuples(
    st.lists(st.integers(0, 7), max_size=4),  # picks among the in-flight ids (by index)
    st.lists(st.integers(0, 40), max_size=2),  # ids the manager may not know or has settled
)


def _apply(sim: Sim, completed: tuple[int, ...], general: bool) -> object:
    """One rank-0 report; ``general`` appends an empty report, which forces the general path."""
    reports = [StepReport(0, completed)]
    if general:
        reports.append(StepReport(0))
    try:
        out = sim.report(reports)
    except ReportError as e:
        return ("error", str(e))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["eager", "lazy"]),
    st.lists(st.integers(1, 12), min_size=1, max_size=4),
    st.lists(_report, min_size=1, max_size=6),
)
def test_single_rank_fast_path_equals_the_general_one(
    policy: str, prompts: list[int], reports: list[tuple[list[int], list[int]]]
) -> None:
    """A single rank's report of completed transfers settles through the fast path exactly as
    through the general one: the same outcomes, errors, counters and CPU references."""
    groups = [GroupSpec(block_size=BS, num_cpu_blocks=6, block_bytes=64)]
    sims = [
        Sim(groups, store_policy=policy, lazy_watermark=4, gpu_blocks=24),
        Sim(groups, store_policy=policy, lazy_watermark=4, gpu_blocks=24),
    ]
    results: list[list[object]] = [[], []]
    for k, (sim, out) in enumerate(zip(sims, results, strict=True)):
        for n, length in enumerate(prompts):
            req = sim.add(f"r{n}", range(n * 100, n * 100 + length))
            sim.match(req)
            sim.step(new=[(req, length)])
            if n % 2:
                sim.finish(req)
        for picks, extra in reports:
            live = sim.workers.in_flight()
            chosen = [live[i] for i in picks if i < len(live)]
            tids = tuple(dict.fromkeys([*chosen, *extra]))
            out.append(_apply(sim, tids, general=bool(k)))
            out.append(sim.mgr.stats())
            out.append(sim.mgr.cpu_refs())
            sim.step()
        sim.drain()
    assert results[0] == results[1]


_column = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c", "unknown"]),
        st.integers(0, 6 * BS),
        st.lists(st.lists(st.integers(-1, 40), max_size=3).map(tuple), min_size=1, max_size=2),
    ),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(_column)
def test_one_group_decode_news_equal_the_general_ones(
    column: list[tuple[str, int, list[tuple[int, ...]]]],
) -> None:
    """For one KV cache group, the unrolled reading of the decode columns gives the same
    entries as the loop over groups, or raises the same error: unknown requests, tables too
    short for the tokens, wrong group counts, ids out of range or repeated."""
    from kvflow.core.requests import DecodeRequests
    from kvflow.errors import KVFlowError

    sim = Sim([GroupSpec(block_size=BS, num_cpu_blocks=16)], gpu_blocks=32, decode_columns=True)
    for rid, n in (("a", BS + 1), ("b", 2 * BS), ("c", 3)):
        req = sim.add(rid, range(ord(rid) * 100, ord(rid) * 100 + n))
        sim.match(req)
        sim.step(new=[(req, n)])
    decode = DecodeRequests.trusted(
        [c[0] for c in column], [c[1] for c in column], [tuple(c[2]) for c in column]
    )

    def entries(read: Any) -> object:
        out: list[Any] = []
        try:
            read(decode, out)
        except KVFlowError as e:
            return (type(e).__name__, str(e))
        return [(e[0].request.request_id, *e[1:]) for e in out]

    one = entries(partial(sim.mgr._decode_news, one=True))
    assert one == entries(partial(sim.mgr._decode_news, one=False))
