"""The block manager's per-request tables as the scheduler reads them each step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine.block_manager import BlockManager
from kvflow.engine.engine import EngineConfig, make_kv_cache_config
from kvflow.engine.model import model_config

Op = tuple[str, int, int]


def _manager(name: str, blocks: int) -> BlockManager:
    econf = EngineConfig(block_size=4, num_gpu_blocks=blocks, device="cpu")
    return BlockManager(make_kv_cache_config(model_config(name), econf))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["tiny", "tiny-swa6"]),
    st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 2), st.integers(1, 9)),
        max_size=40,
    ),
)
def test_block_ids_always_equal_the_tables_and_growth_without_blocks_adds_none(
    name: str, ops: list[Op]
) -> None:
    """After any admissions, growths (a new token, a chunk, sliding-window frees) and frees, a
    request's block ids are its tables as they are now; a growth its tables already cover adds
    nothing and takes no block."""
    mgr = _manager(name, 40)
    computed: dict[str, int] = {}
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in mgr.tables:
            if mgr.allocate(rid, 0, n, prefix_hit=[[] for _ in mgr.pools]) is not None:
                computed[rid] = 0
        elif op == "grow" and rid in mgr.tables:
            before = mgr.block_ids(rid)
            free = mgr.num_free_blocks()
            covered = all(len(t) * 4 >= computed[rid] + n for t in mgr.tables[rid])
            added = mgr.allocate(rid, computed[rid], n)
            if added is not None:
                computed[rid] += n
                if covered and name == "tiny":
                    assert added == ((),)
                    assert mgr.num_free_blocks() == free
                    assert mgr.block_ids(rid) is before
        elif op == "free":
            mgr.free(rid)
            computed.pop(rid, None)
        for r, tables in mgr.tables.items():
            assert mgr.block_ids(r) == tuple(tuple(t) for t in tables)
        assert mgr.block_ids(rid) == (
            tuple(tuple(t) for t in mgr.tables[rid])
            if rid in mgr.tables
            else tuple(() for _ in mgr.pools)
        )


def test_caches_more_only_when_a_block_completes() -> None:
    """Prefix caching is asked for a request's blocks only once a block is newly full."""
    mgr = _manager("tiny", 16)
    mgr.allocate("a", 0, 6, prefix_hit=[[]])
    assert mgr.caches_more("a", 4)
    mgr.cache_computed("a", [b"h" * 16, b"i" * 16], 4)
    assert not mgr.caches_more("a", 5)
    assert not mgr.caches_more("a", 7)
    assert mgr.caches_more("a", 8)
