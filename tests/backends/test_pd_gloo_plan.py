"""The gloo transport's wire plan (no processes): both sides cut a launch into the same chunks,
runs consecutive on both sides go straight between the tensors, the rest fits the slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.backends.pd.gloo import plan_wire
from kvflow.backends.pd.transport import MAX_OPS, geometry
from kvflow.core.pd.common import OP_BITS
from kvflow.errors import ConfigError

GEO = geometry(
    [
        [torch.zeros(64, 64, dtype=torch.int64)],  # one region of 512 B
        [torch.zeros(64, 32, dtype=torch.int64), torch.zeros(64, 32, dtype=torch.int64)],
    ]
)


@st.composite
def mirrored_pairs(draw: st.DrawFn) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per group, distinct source and destination ids; some stretches consecutive on both."""
    groups = []
    for _ in GEO:
        n = draw(st.integers(0, 24))
        src = draw(st.permutations(range(64)))[:n]
        dst = draw(st.permutations(range(64)))[:n]
        if n and draw(st.booleans()):  # a run on both sides
            k = draw(st.integers(1, min(n, 16)))
            a, b = draw(st.integers(0, 64 - k)), draw(st.integers(0, 64 - k))
            src = [*range(a, a + k), *(s for s in src if not a <= s < a + k)][:n]
            dst = [*range(b, b + k), *(d for d in dst if not b <= d < b + k)][:n]
            n = min(len(src), len(dst))
        groups.append(tuple(zip(src[:n], dst[:n], strict=True)))
    return tuple(groups)


@settings(max_examples=200, deadline=None)
@given(
    pairs=mirrored_pairs(),
    slot=st.sampled_from([512, 1024, 4096]),
    direct=st.sampled_from([None, 512, 1024, 2048]),
)
def test_both_sides_plan_the_same_wire_and_cover_every_pair_once(
    pairs: tuple[tuple[tuple[int, int], ...], ...], slot: int, direct: int | None
) -> None:
    """The sender's and the receiver's plans (mirrored pairs) agree chunk by chunk; every pair is
    in exactly one chunk, in order; staged chunks fit a slot, run chunks are consecutive on both
    sides and long enough; tags are unique and carry the channel."""
    mirror = tuple(tuple((d, s) for s, d in g) for g in pairs)
    a = plan_wire(5, pairs, GEO, slot, direct)
    b = plan_wire(5, mirror, GEO, slot, direct)
    assert [(c.index, c.group, c.tag, c.run, c.remote) for c in a] == [
        (c.index, c.group, c.tag, c.run, c.local) for c in b
    ]
    for g, gp in enumerate(pairs):
        got = [p for c in a if c.group == g for p in zip(c.local, c.remote, strict=True)]
        assert got == list(gp)
    for c in a:
        geo = GEO[c.group]
        if c.run:
            assert direct is not None
            assert list(c.local) == list(range(c.local[0], c.local[0] + len(c.local)))
            assert list(c.remote) == list(range(c.remote[0], c.remote[0] + len(c.remote)))
            assert len(c.local) * min(v.shape[1] * 8 for v in geo.views) >= direct
        else:
            assert len(c.local) * geo.block_bytes <= slot
        assert c.tag >> OP_BITS == 5
    ops = [c.tag + (len(GEO[c.group].views) if c.run else 1) for c in a]
    assert len(set(ops)) == len(ops)


def test_a_run_on_both_sides_is_one_op_per_region_and_the_rest_is_staged() -> None:
    """Blocks 10-19 → 30-39 go as one run (one op per region); the scattered pairs around it are
    packed into slot-sized staged chunks."""
    pairs = (((1, 7), *((10 + i, 30 + i) for i in range(10)), (3, 2), (5, 60)), ())
    chunks = plan_wire(1, pairs, GEO, 1024, 1024)
    assert [(c.run, len(c.local)) for c in chunks] == [(False, 1), (True, 10), (False, 2)]
    two_regions = plan_wire(1, ((), tuple((10 + i, 30 + i) for i in range(8))), GEO, 512, 1024)
    assert [(c.run, len(c.local), c.tag & 0xFFF) for c in two_regions] == [(True, 8, 0)]


def test_bad_plans_are_typed_errors() -> None:
    """An unregistered block, a bad channel, a block larger than a slot without the direct path
    and a plan past the wire-op budget are ``ConfigError``s."""
    with pytest.raises(ConfigError):
        plan_wire(1, (((64, 0),),), GEO, 1024, None)
    with pytest.raises(ConfigError):
        plan_wire(0, ((), ()), GEO, 1024, None)
    with pytest.raises(ConfigError):
        plan_wire(1, (((0, 0),),), GEO, 256, None)
    many = geometry([[torch.zeros(2 * MAX_OPS + 2, 1, dtype=torch.int64)]])
    with pytest.raises(ConfigError):
        plan_wire(1, (tuple((2 * i, 2 * i) for i in range(MAX_OPS + 1)),), many, 8, None)


def test_a_side_whose_chunk_lies_in_a_row_knows_it() -> None:
    """``local_in_a_row`` is this side's own: P's consecutive blocks sent to D's scattered ones
    are in a row on P, not on D (mirrored plans differ only there)."""
    pairs = (((4, 9), (5, 2), (6, 30)), ())
    (p,) = plan_wire(1, pairs, GEO, 4096, None)
    (d,) = plan_wire(1, (tuple((b, a) for a, b in pairs[0]), ()), GEO, 4096, None)
    assert p.local_in_a_row
    assert not d.local_in_a_row
