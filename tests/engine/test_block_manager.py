"""The block manager's per-request tables as the scheduler reads them each step."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec
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


@settings(max_examples=80, deadline=None)
@given(
    num_groups=st.integers(1, 3),
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=6),
    computed=st.lists(st.integers(0, 32), min_size=6, max_size=6),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    extra_tokens=st.integers(1, 4),
    invalid=st.lists(st.integers(1, 23), max_size=3),
)
def test_a_full_attention_prefix_hit_is_every_groups_cached_prefix_cut_to_the_shortest(
    num_groups: int,
    prompts: list[list[int]],
    computed: list[int],
    query: list[int],
    extra_tokens: int,
    invalid: list[int],
) -> None:
    """With every group full attention, a prefix hit is, per group, the ids cached under that
    group's keys for the longest prefix every group has cached (leaving a token to compute),
    whatever requests computed, cached, freed and evicted before and whichever blocks were
    reported invalid; a block cached for one group never answers for another."""
    kv = KVCacheConfig(
        block_size=4,
        num_blocks=24,
        groups=tuple(KVCacheGroupSpec(g, (f"layer{g}",)) for g in range(num_groups)),
    )
    mgr = BlockManager(kv)
    # Blocks chosen from 4 hash values chain into few distinct prefixes: hits are frequent.
    hashes = [bytes([v]) * 16 for v in range(4)]
    for i, (prompt, done) in enumerate(zip(prompts, computed, strict=False)):
        blocks = [hashes[v] for v in prompt]
        if mgr.allocate(f"r{i}", 0, len(blocks) * 4, prefix_hit=[[] for _ in mgr.pools]) is None:
            break
        mgr.cache_computed(f"r{i}", blocks, min(done, len(blocks) * 4))
        if i % 2:  # its cached blocks go to the free queue; later requests evict some of them
            mgr.free(f"r{i}")
    mgr.uncache(invalid)  # any group's blocks: a group may hold a shorter prefix than group 0
    asked = [hashes[v] for v in query]
    num_tokens = len(asked) * 4 + extra_tokens - 4  # the last block may be the prompt's tail
    hit = mgr.find_prefix_hit(asked, num_tokens)
    limit = min(len(asked), (num_tokens - 1) // 4)
    n = limit
    for g in range(num_groups):
        k = 0
        while k < n and mgr.pool.get_cached_block(mgr.cache_key(g, asked[k])) is not None:
            k += 1
        n = k
    expected = [
        [mgr.pool.get_cached_block(mgr.cache_key(g, h)) for h in asked[:n]]
        for g in range(num_groups)
    ]
    assert hit == expected
    keys = {mgr.cache_key(g, h) for g in range(num_groups) for h in hashes}
    assert len(keys) == num_groups * len(hashes)
