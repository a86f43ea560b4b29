"""The heterogeneous-TP plan of a hand-off: every D rank's kv heads come from the P ranks that
hold them, exactly once, for every pair of TP sizes; what cannot be sharded is refused."""

from __future__ import annotations

import itertools

import pytest

from kvflow.core.pd.messages import Compat
from kvflow.core.pd.tp import (
    HeadSlice,
    plan_head_slices,
    rank_heads,
    rank_slices,
    tp_refusal,
)
from kvflow.errors import ConfigError

SIZES = (1, 2, 3, 4, 6, 8)
HEADS = (1, 2, 3, 4, 6, 8, 12, 16)


def _holdable(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


def _check(plan: tuple[HeadSlice, ...], heads: int, p_tp: int, d_tp: int, layout: str) -> None:
    p_heads = rank_heads(heads, p_tp, layout)
    d_heads = rank_heads(heads, d_tp, layout)
    assert list(plan) == sorted(plan, key=lambda s: (s.p_rank, s.d_rank, s.heads))
    for d, (dlo, dhi) in enumerate(d_heads):
        mine = sorted((s for s in plan if s.d_rank == d), key=lambda s: s.heads)
        # D's shard covered exactly once, in order, with no gap or overlap.
        assert mine[0].heads[0] == dlo
        assert mine[-1].heads[1] == dhi
        for a, b in itertools.pairwise(mine):
            assert a.heads[1] == b.heads[0]
        for s in mine:
            plo, phi = p_heads[s.p_rank]
            assert plo <= s.heads[0] < s.heads[1] <= phi  # the heads lie on that P rank
            assert s.p_local == (s.heads[0] - plo, s.heads[1] - plo)
            assert s.d_local == (s.heads[0] - dlo, s.heads[1] - dlo)
            assert s.p_shard == phi - plo
            assert s.d_shard == dhi - dlo
            full = s.p_local == (0, s.p_shard) and s.d_local == (0, s.d_shard)
            assert s.sliced is not full
    # Each pair of ranks is at most one part (one wire pair per rank pair).
    assert len({(s.p_rank, s.d_rank) for s in plan}) == len(plan)


@pytest.mark.parametrize("layout", ["flash_attn", "mla"])
def test_every_pair_of_tp_sizes_covers_each_d_rank_exactly_once(layout: str) -> None:
    """Over every TP pair and head count that can be held, each D rank's heads come from P
    ranks holding them, once, in order; local ranges and ``sliced`` agree with the shards."""
    checked = 0
    for heads, p_tp, d_tp in itertools.product(HEADS, SIZES, SIZES):
        if layout != "mla" and not (_holdable(heads, p_tp) and _holdable(heads, d_tp)):
            continue
        _check(plan_head_slices(heads, p_tp, d_tp, layout), heads, p_tp, d_tp, layout)
        checked += 1
    assert checked > 100


def test_tp1_to_tp2_splits_p_s_heads_between_d_s_ranks() -> None:
    """P tp1 → D tp2 with 4 kv heads: P's rank sends heads 0-1 to D rank 0, 2-3 to D rank 1."""
    assert plan_head_slices(4, 1, 2) == (
        HeadSlice(0, 0, (0, 2), (0, 2), (0, 2), 4, 2),
        HeadSlice(0, 1, (2, 4), (2, 4), (0, 2), 4, 2),
    )


def test_tp2_to_tp1_gathers_d_s_heads_from_both_p_ranks() -> None:
    """P tp2 → D tp1: D's one rank takes heads 0-1 from P rank 0 and 2-3 from P rank 1."""
    plan = plan_head_slices(4, 2, 1)
    assert plan == (
        HeadSlice(0, 0, (0, 2), (0, 2), (0, 2), 2, 4),
        HeadSlice(1, 0, (2, 4), (0, 2), (2, 4), 2, 4),
    )
    assert all(s.sliced for s in plan)
    assert rank_slices(plan, 0, producer=False) == [0, 1]
    assert rank_slices(plan, 1, producer=True) == [1]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (4, 4)])
def test_equal_tp_sizes_pair_rank_r_with_rank_r_unsliced(p_tp: int, d_tp: int) -> None:
    """Equal TP sizes: rank r sends its whole shard to rank r, nothing sliced."""
    plan = plan_head_slices(8, p_tp, d_tp)
    assert [(s.p_rank, s.d_rank) for s in plan] == [(r, r) for r in range(p_tp)]
    assert not any(s.sliced for s in plan)


def test_tp2_to_tp4_and_tp4_to_tp2() -> None:
    """2 ↔ 4 with 8 heads: each P rank of tp2 feeds two D ranks; each D rank of tp2 two P."""
    up = plan_head_slices(8, 2, 4)
    assert [(s.p_rank, s.d_rank, s.p_local) for s in up] == [
        (0, 0, (0, 2)), (0, 1, (2, 4)), (1, 2, (0, 2)), (1, 3, (2, 4)),
    ]  # fmt: skip
    down = plan_head_slices(8, 4, 2)
    assert [(s.p_rank, s.d_rank, s.d_local) for s in down] == [
        (0, 0, (0, 2)), (1, 0, (2, 4)), (2, 1, (0, 2)), (3, 1, (2, 4)),
    ]  # fmt: skip


def test_replicated_heads_spread_d_s_reads_over_the_p_ranks_that_hold_them() -> None:
    """2 kv heads on P tp4 (each head on two P ranks) → D tp4: D ranks 0 and 1 both need head
    0 and read it from different P ranks; an MLA layout is whole on every rank."""
    plan = plan_head_slices(2, 4, 4)
    assert [(s.p_rank, s.d_rank, s.heads) for s in plan] == [
        (0, 0, (0, 1)), (1, 1, (0, 1)), (2, 2, (1, 2)), (3, 3, (1, 2)),
    ]  # fmt: skip
    mla = plan_head_slices(1, 2, 4, "mla")
    assert [(s.p_rank, s.d_rank) for s in mla] == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert not any(s.sliced for s in mla)


def test_heads_that_tp_cannot_hold_are_refused() -> None:
    """6 kv heads on tp4 (neither divisible nor replicated): a reason, and ConfigError."""
    assert tp_refusal(6, 4) is not None
    assert tp_refusal(6, 4, "mla") is None
    assert tp_refusal(4, 0) is not None
    with pytest.raises(ConfigError, match="tp 4"):
        plan_head_slices(6, 1, 4)


def _compat(**kw: object) -> Compat:
    base: dict[str, object] = {
        "model": "m", "dtype": "float32", "block_size": 16, "layout": "flash_attn",
        "num_kv_heads": 4, "head_dim": 8, "num_layers": 2, "shard": "tp1",
        "kvflow_version": "x",
    }  # fmt: skip
    base.update(kw)
    return Compat(**base)  # type: ignore[arg-type]


def test_compat_accepts_different_tp_sizes_that_hold_the_heads() -> None:
    """tp1 vs tp2 vs tp4 with 4 kv heads: no refusal; the digest ignores the TP size."""
    one, two, four = _compat(), _compat(shard="tp2"), _compat(shard="tp4/3")
    assert one.refusals(two) == two.refusals(one) == one.refusals(four) == []
    assert one.digest() == two.digest()


def test_compat_refuses_a_peer_whose_tp_cannot_hold_the_heads() -> None:
    """A peer at tp3 with 4 kv heads: refused, naming both TP sizes and why."""
    (why,) = _compat().refusals(_compat(shard="tp3"))
    assert why.startswith("shard (tp1 vs tp3")
    assert "neither divisible by tp 3" in why


def test_a_layout_that_does_not_map_heads_is_refused_only_when_tp_sizes_differ() -> None:
    """vLLM's layout (``num_kv_heads`` per rank): tp1 vs tp2 refused naming the layout; equal
    TP sizes accepted whatever the heads (3 heads on each of 2 ranks)."""
    (why,) = _compat(layout="vllm").refusals(_compat(layout="vllm", shard="tp2"))
    assert "layout 'vllm' does not map kv heads" in why
    both = _compat(layout="vllm", num_kv_heads=3, shard="tp2/0")
    assert both.refusals(_compat(layout="vllm", num_kv_heads=3, shard="tp2/1")) == []
