"""Runs of consecutive ids: the split, the shared id list, and the plan check that uses them."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.core import validate
from kvflow.core.idruns import EVERY_CAP, ascending_runs, every

N = 64


def test_every_grows_and_keeps_its_ints() -> None:
    """every(n) covers n ids, is shared, and a larger n makes a new list (the old one intact)."""
    small = every(10)
    assert small[:10] == list(range(10))
    assert every(5) is small
    big = every(len(small) + 1)
    assert big[: len(small)] == small
    assert every(len(small)) is big
    with pytest.raises(ValueError, match="more than"):
        every(EVERY_CAP + 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-2, N + 2), max_size=40)
    | st.builds(sorted, st.sets(st.integers(0, N - 1)))
)
def test_runs_cover_exactly_the_strictly_ascending_in_range_lists(ids: list[int]) -> None:
    """ascending_runs answers for exactly the strictly ascending lists in range, and its runs
    give back the list."""
    runs = ascending_runs(ids, every(N), N)
    ok = all(0 <= b < N for b in ids) and all(a < b for a, b in pairwise(ids))
    assert (runs is not None) == ok
    if runs is not None:
        assert [b for lo, hi, _ in runs for b in range(lo, hi)] == ids
        assert [at for _, _, at in runs] == [
            i for i, b in enumerate(ids) if i == 0 or ids[i - 1] != b - 1
        ]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(-1, N), min_size=16, max_size=40)
    | st.builds(lambda a, n: list(range(a, a + n)), st.integers(-2, N), st.integers(16, 30))
)
def test_the_plan_id_check_is_the_same_with_runs(ids: list[int]) -> None:
    """id_problem (which tries runs first for long ascending lists) flags exactly the lists
    with an id out of range or given twice."""
    bad = len(set(ids)) != len(ids) or any(not 0 <= b < N for b in ids)
    assert (validate.id_problem(ids, N, None) is not None) == bad
