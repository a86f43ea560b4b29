"""CPU-side tests of the staged plans of CPU ids in ascending runs, planned in plain Python and
placed on the staging ring: the same copies as the numpy plans, however the runs meet sub-batch,
slot and pinned-chunk boundaries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.backends.plan_helpers import flash_table

from kvflow.backends.cuda.plan import (
    FEW_RUNS,
    CopyList,
    Descriptors,
    Pitched,
    staged_plan,
    subbatch_bounds,
)
from kvflow.backends.cuda.ring_plan import RingPlan, ring_plan
from kvflow.errors import ConfigError


@settings(max_examples=120, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=6),
    blocks_per_slot=st.integers(1, 40),
    chunk_blocks=st.integers(0, 17),
    ramp_blocks=st.integers(0, 9),
    store=st.booleans(),
)
def test_few_runs_plan_equals_the_array_plan(
    pieces: list[tuple[int, int]],
    blocks_per_slot: int,
    chunk_blocks: int,
    ramp_blocks: int,
    store: bool,
) -> None:
    """CPU ids in a few ascending runs (however they meet sub-batch and chunk boundaries) get
    exactly the descriptors and bounds of the numpy path."""
    from kvflow.backends.cuda import plan as p

    ids = ids_in_runs(pieces)
    cpu = np.array(ids, dtype=np.int64)
    table = flash_table(1, 4, 16)
    base = 1 << 30
    bounds = subbatch_bounds(len(cpu), blocks_per_slot, ramp_blocks, store=store)
    starts = (np.flatnonzero(np.diff(cpu) != 1) + 1).tolist()
    fast = p._staged_plan_runs(table, cpu, base, bounds, starts, chunk_blocks, store)
    slow = p._staged_plan_arrays(table, cpu, base, bounds, chunk_blocks, store)
    chosen = staged_plan(
        table,
        cpu,
        base,
        blocks_per_slot=blocks_per_slot,
        chunk_blocks=chunk_blocks,
        store=store,
        ramp_blocks=ramp_blocks,
    )
    assert chosen.dma.size.tolist() == slow.dma.size.tolist()
    assert fast.bounds.tolist() == slow.bounds.tolist()
    assert fast.desc_bounds.tolist() == slow.desc_bounds.tolist()
    for a, b in ((fast.dma.dst, slow.dma.dst), (fast.dma.src, slow.dma.src)):
        assert a.tolist() == b.tolist()
    assert fast.dma.size.tolist() == slow.dma.size.tolist()


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=8),
    slot_blocks=st.integers(1, 40),
    max_blocks=st.integers(1, 64),
    chunk_blocks=st.integers(0, 17),
    ramp_blocks=st.integers(0, 9),
    first=st.integers(0, 3),
    store=st.booleans(),
)
def test_ring_plan_in_plain_python_places_the_same_copies_as_the_arrays(
    pieces: list[tuple[int, int]],
    slot_blocks: int,
    max_blocks: int,
    chunk_blocks: int,
    ramp_blocks: int,
    first: int,
    store: bool,
) -> None:
    """A batch's CPU ids as a tuple of ascending runs (what the issue path passes) get the
    same sub-batches, slots and absolute copies from the plain-Python plan as the same ids as
    an array get from the numpy plan, whichever of the two the tuple's runs choose."""
    ids = ids_in_runs(pieces)
    table = flash_table(1, 4, 16)
    bb = table.block_bytes

    def place(cpu: Sequence[int] | np.ndarray) -> RingPlan:
        return ring_plan(
            table,
            cpu,
            1 << 30,
            regions=None,
            ring=(1 << 40, slot_blocks * bb, first, 4),
            max_blocks=max_blocks,
            chunk_blocks=chunk_blocks,
            ramp_bytes=ramp_blocks * bb,
            store=store,
        )

    mine, theirs = place(tuple(ids)), place(np.array(ids, dtype=np.int64))
    assert isinstance(theirs.dma, Descriptors)
    pieces_cut = len(ascending_runs_of(ids)) + len(ids) // min(slot_blocks, max_blocks)
    if chunk_blocks:
        pieces_cut += len(ids) // chunk_blocks
    assert isinstance(mine.dma, CopyList) == (pieces_cut < FEW_RUNS)
    assert_same_placement(mine, theirs)
    assert not isinstance(mine.dma, Pitched)
    assert mine.dma.lists() == theirs.dma.lists()
    assert mine.dma.total_bytes == theirs.dma.total_bytes == len(ids) * bb


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=6),
    regions=st.tuples(st.integers(0, 3), st.integers(1, 4)),
    slot_parts=st.integers(1, 40),
    chunk_blocks=st.integers(0, 17),
    ramp_blocks=st.integers(0, 9),
    first=st.integers(0, 3),
    store=st.booleans(),
)
def test_a_parts_2d_copies_in_plain_python_are_the_arrays_ones(
    pieces: list[tuple[int, int]],
    regions: tuple[int, int],
    slot_parts: int,
    chunk_blocks: int,
    ramp_blocks: int,
    first: int,
    store: bool,
) -> None:
    """A load's part (some regions of each block) over CPU ids in ascending runs: where the
    plain-Python plan makes it, its 2D copies, sub-batches and slots are exactly those of the
    numpy plan of the same ids as an array, and ``ring_plan`` of the tuple gives the same."""
    from kvflow.backends.cuda import ring_plan as rp

    ids = ids_in_runs(pieces)
    table = flash_table(2, 4, 16)  # four regions
    lo, hi = regions[0], min(4, regions[0] + regions[1])
    part = table.span_bytes(lo, hi)
    ring = (1 << 40, slot_parts * part, first, 4)

    def place(cpu: Sequence[int] | np.ndarray) -> RingPlan:
        return ring_plan(
            table,
            cpu,
            1 << 30,
            regions=(lo, hi),
            ring=ring,
            max_blocks=512,
            chunk_blocks=chunk_blocks,
            ramp_bytes=ramp_blocks * part,
            store=store,
        )

    theirs = place(np.array(ids, dtype=np.int64))
    ramp = max(1, ramp_blocks) if ramp_blocks else 0
    base = (1 << 30) + table.span_offset(lo)
    fast = rp._ring_runs(
        tuple(ids), part, base, ring, slot_parts, ramp, chunk_blocks, store, table.block_bytes
    )
    for mine in (place(tuple(ids)), *([] if fast is None else [fast])):
        assert_same_placement(mine, theirs)
        assert type(mine.dma) is type(theirs.dma)
        if isinstance(mine.dma, Pitched):
            assert isinstance(theirs.dma, Pitched)
            for a, b in ((mine.dma.dst, theirs.dma.dst), (mine.dma.src, theirs.dma.src)):
                assert a.dtype == b.dtype == np.uint64
                assert a.tolist() == b.tolist()
            assert mine.dma.rows.tolist() == theirs.dma.rows.tolist()
            assert (mine.dma.width, mine.dma.cpu_pitch, mine.dma.store) == (
                part,
                table.block_bytes,
                store,
            )
    if fast is not None:
        assert isinstance(theirs.dma, Pitched)


@pytest.mark.parametrize("regions", [None, (1, 3)])
def test_a_slot_smaller_than_a_block_is_a_config_error_either_way(
    regions: tuple[int, int] | None,
) -> None:
    """A staging slot that cannot hold one block (or one part of it) is a ConfigError naming the
    slot's capacity, whether the ids come as a tuple of runs or as an array."""
    table = flash_table(2, 4, 16)
    for cpu in ((1, 2, 3), np.array([1, 2, 3])):
        with pytest.raises(ConfigError, match="blocks_per_slot must be positive"):
            ring_plan(
                table,
                cpu,
                0,
                regions=regions,
                ring=(1 << 40, 8, 0, 2),
                max_blocks=512,
                chunk_blocks=0,
                ramp_bytes=0,
                store=True,
            )


def test_a_parts_few_long_runs_are_planned_in_plain_python() -> None:
    """Two long runs of CPU ids (what a load of one request's history has) take the
    plain-Python part plan: 2D copies, one per run and sub-batch."""
    from kvflow.backends.cuda import ring_plan as rp

    table = flash_table(2, 4, 16)
    ids = (*range(10, 40), *range(50, 90))
    part = table.span_bytes(1, 3)
    fast = rp._ring_runs(ids, part, 1 << 30, (1 << 40, 64 * part, 0, 2), 64, 0, 0, False, 64)
    assert fast is not None
    assert isinstance(fast.dma, Pitched)
    assert fast.dma.rows.tolist() == [30, 34, 6]
    assert fast.bounds == [0, 64, 70]


def ids_in_runs(pieces: list[tuple[int, int]]) -> list[int]:
    """Ascending ids: per ``(gap, length)``, ``gap`` ids skipped, then a run of ``length``."""
    ids: list[int] = []
    at = 0
    for gap, length in pieces:
        at += gap
        ids += range(at, at + length)
        at += length
    return ids


def assert_same_placement(mine: RingPlan, theirs: RingPlan) -> None:
    """The two plans cut the same sub-batches onto the same slots."""
    assert (mine.bounds, mine.desc_bounds) == (theirs.bounds, theirs.desc_bounds)
    assert (mine.slots, mine.slot_ptrs, mine.block_bytes) == (
        theirs.slots,
        theirs.slot_ptrs,
        theirs.block_bytes,
    )


def ascending_runs_of(ids: list[int]) -> list[list[int]]:
    """``ids`` cut where consecutive ids stop stepping by one."""
    out: list[list[int]] = []
    for b in ids:
        if out and out[-1][-1] + 1 == b:
            out[-1].append(b)
        else:
            out.append([b])
    return out
