"""``BlockPairs``: a group's hand-off pairs as two columns that read as (local, remote) pairs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.pd.common import BlockPairs
from kvflow.errors import ProtocolError

pair_lists = st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=40)


@given(pair_lists)
def test_block_pairs_read_as_the_pairs_they_hold(pairs: list[tuple[int, int]]) -> None:
    """Length, iteration, indexing and equality match the tuple of pairs they were built from."""
    bp = BlockPairs.of(pairs)
    assert len(bp) == len(pairs)
    assert list(bp) == pairs
    assert bp == tuple(pairs)
    assert bp == BlockPairs([p for p, _ in pairs], [r for _, r in pairs])
    assert hash(bp) == hash(tuple(pairs))
    for i in range(len(pairs)):
        assert bp[i] == pairs[i]


@given(pair_lists, st.integers(-45, 45), st.integers(-45, 45))
def test_a_slice_of_block_pairs_is_the_slice_of_the_pairs(
    pairs: list[tuple[int, int]], lo: int, hi: int
) -> None:
    """Slicing gives ``BlockPairs`` of the same pairs a tuple slice gives."""
    part = BlockPairs.of(pairs)[lo:hi]
    assert isinstance(part, BlockPairs)
    assert part == tuple(pairs[lo:hi])


def test_columns_of_different_lengths_are_refused() -> None:
    """A local column and a remote column of different lengths raise ``ProtocolError``."""
    with pytest.raises(ProtocolError, match="3 local blocks paired with 2 remote blocks"):
        BlockPairs((1, 2, 3), (4, 5))


def test_block_pairs_differ_from_other_pairs_and_other_types() -> None:
    """Different pairs, or an object that is no sequence of pairs, compare unequal."""
    bp = BlockPairs((1, 2), (3, 4))
    assert bp != BlockPairs((1, 2), (4, 3))
    assert bp != ((1, 3),)
    assert bp != [(1, 3), (2, 4)]
    assert BlockPairs.of([]) == ()
