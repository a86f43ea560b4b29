"""A launch's pairs reach the transports as the same arrays whether they come as columns or tuples."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.backends.pd.rendezvous import Region, SideLayout, check_launch, pair_array
from kvflow.core.pd.common import BlockPairs
from kvflow.errors import ConfigError


@given(st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99)), max_size=50))
def test_columns_and_tuples_give_the_same_pair_array(pairs: list[tuple[int, int]]) -> None:
    """``pair_array`` of ``BlockPairs`` equals that of the same pairs as tuples, row by row."""
    a = pair_array(BlockPairs.of(pairs))
    b = pair_array(tuple(pairs))
    assert a.dtype == b.dtype == np.int64
    assert a.shape == b.shape == (len(pairs), 2)
    assert np.array_equal(a, b)


def _layout(num_blocks: int) -> SideLayout:
    return SideLayout(((Region(0, 64, 64, num_blocks, -1),),))


def test_check_launch_names_a_block_out_of_range_in_block_pairs() -> None:
    """A remote block past the peer's registered blocks, or a negative local one, is a
    ``ConfigError`` naming it."""
    with pytest.raises(ConfigError, match=re.escape("remote block 8 is outside 0..7")):
        check_launch((BlockPairs((0, 1), (2, 8)),), _layout(16), _layout(8), 1, what="t")
    with pytest.raises(ConfigError, match=re.escape("local block -3 is outside 0..15")):
        check_launch((BlockPairs((0, -3), (2, 1)),), _layout(16), _layout(8), 1, what="t")


def test_pair_arrays_of_block_pairs_are_packed_and_fall_back_to_numpy() -> None:
    """Columns of numpy integers pack like Python ints; a value past int64 takes numpy's
    conversion (which refuses it); an empty group is an empty (0, 2) array."""
    cols: tuple[Any, ...] = ((np.int64(4), 5), (6, np.int32(7)))
    arr = pair_array(BlockPairs(*cols))
    assert arr.tolist() == [[4, 6], [5, 7]]
    with pytest.raises(OverflowError):
        pair_array(BlockPairs((1 << 70,), (0,)))
    (empty,) = check_launch((BlockPairs((), ()),), _layout(4), _layout(4), 1, what="t")
    assert empty.shape == (0, 2)
