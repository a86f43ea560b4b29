"""CPU-side tests of a load's parts on the CUDA backend: ``part_plan``'s copies, one per block
or one 2D copy per run of CPU blocks, on a simulated address space, and their staging ring."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.backends.plan_helpers import (
    GPU_BASE,
    apply,
    flash_table,
    reference_block,
    run_ids,
    simulated_memory,
)

from kvflow.backends.cuda.plan import (
    PITCHED_MIN_ROWS,
    CopyList,
    Descriptors,
    Pitched,
    direct_descriptors,
    part_plan,
)
from kvflow.backends.cuda.ring_plan import ring_plan
from kvflow.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(2, 5),
    page=st.sampled_from([16, 48]),
    picks=st.lists(st.integers(0, 15), min_size=1, max_size=12, unique=True),
    blocks_per_slot=st.integers(1, 6),
    ramp_blocks=st.integers(0, 4),
    cut=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    in_runs=st.booleans(),
    chunk_blocks=st.sampled_from([0, 3, 8]),
)
def test_a_load_in_parts_lands_each_parts_layers_and_only_those(
    num_layers: int,
    page: int,
    picks: list[int],
    blocks_per_slot: int,
    ramp_blocks: int,
    cut: int,
    seed: int,
    in_runs: bool,
    chunk_blocks: int,
) -> None:
    """A load cut in two parts by region (``part_plan`` DMA into a slot, then the scatter over
    the packed ``subset``, in numpy): after the first part, exactly its regions of every block
    are back; after the second, every region; a part's direct copies (``subset``) do the same;
    with CPU ids scattered (a copy per block) or in one ascending run (2D copies)."""
    num_blocks = 16
    table = flash_table(num_layers, num_blocks, page)
    cut = 2 * min(cut, num_layers - 1)  # at a layer's edge: K and V together
    memory, cpu_base, cpu_blocks, staging = simulated_memory(table, blocks_per_slot)
    rng = np.random.default_rng(seed)
    memory[GPU_BASE:cpu_base] = rng.integers(0, 256, cpu_base - GPU_BASE, dtype=np.uint8)
    gpu = np.array(picks, dtype=np.int64)
    cpu = (
        np.arange(len(picks), dtype=np.int64) + int(rng.integers(0, cpu_blocks - len(picks) + 1))
        if in_runs
        else rng.permutation(cpu_blocks)[: len(picks)].astype(np.int64)
    )
    expected = [reference_block(memory, table, int(g)) for g in gpu]
    apply(memory, direct_descriptors(table, gpu, cpu, cpu_base, store=True))

    def region_ok(r: int) -> bool:
        b, st_, p = int(table.base[r]), int(table.stride[r]), int(table.page[r])
        off = int(table.cpu_offset[r])
        return all(
            np.array_equal(memory[b + int(g) * st_ : b + int(g) * st_ + p], e[off : off + p])
            for g, e in zip(gpu, expected, strict=True)
        )

    for staged in (True, False):
        memory[GPU_BASE:cpu_base] = 0
        for lo, hi in ((0, cut), (cut, table.num_regions)):
            if staged:
                packed = table.subset(lo, hi, packed=True)
                plan = part_plan(
                    table,
                    lo,
                    hi,
                    cpu,
                    cpu_base,
                    blocks_per_slot=blocks_per_slot,
                    store=False,
                    ramp_blocks=ramp_blocks,
                    chunk_blocks=chunk_blocks,
                )
                assert plan.bounds[-1] == len(gpu)
                for k in range(plan.num_subbatches):
                    a, z = int(plan.bounds[k]), int(plan.bounds[k + 1])
                    slot = staging + (k % 2) * blocks_per_slot * table.block_bytes
                    dma = plan.dma.slice(int(plan.desc_bounds[k]), int(plan.desc_bounds[k + 1]))
                    assert dma.total_bytes == (z - a) * packed.block_bytes
                    apply(memory, dma, slot)
                    for i, t in enumerate(gpu[a:z]):  # the scatter kernel's job, in numpy
                        block = memory[
                            slot + i * packed.block_bytes : slot + (i + 1) * packed.block_bytes
                        ]
                        for r in range(packed.num_regions):
                            off, p = int(packed.cpu_offset[r]), int(packed.page[r])
                            at = int(packed.base[r]) + int(t) * int(packed.stride[r])
                            memory[at : at + p] = block[off : off + p]
            else:
                apply(
                    memory,
                    direct_descriptors(table.subset(lo, hi), gpu, cpu, cpu_base, store=False),
                )
            landed = [region_ok(r) for r in range(table.num_regions)]
            assert landed == [r < hi for r in range(table.num_regions)]


def test_part_plan_refuses_regions_outside_the_group() -> None:
    """A part naming regions the group does not have is a ConfigError."""
    table = flash_table(2, 4, 16)
    with pytest.raises(ConfigError, match=r"regions 2\.\.4 of a group of 4"):
        part_plan(table, 2, 5, np.arange(2), 0, blocks_per_slot=2, store=False)


@pytest.mark.parametrize("ids", ["descending", "ascending", "ascending tuple"])
@pytest.mark.parametrize("regions", [None, (2, 6)])
@pytest.mark.parametrize("store", [True, False])
def test_ring_plan_places_sub_batches_on_the_slots_in_turn(
    regions: tuple[int, int] | None, store: bool, ids: str
) -> None:
    """A batch's sub-batches (a slot's worth of whole blocks, or of a part's pages, each)
    go to the ring's slots in turn from the next one, every staging address inside its slot;
    a part's 2D copies (CPU ids ascending) and whole blocks planned in plain Python (an
    ascending tuple) too."""
    table = flash_table(4, 16, 64)  # 512-byte blocks; regions 2..5: 256 bytes of them
    slot_bytes, base = 2048, 1 << 30
    ascending = ids != "descending"
    cpu: Sequence[int] | np.ndarray = (
        np.arange(9, dtype=np.int64) if ascending else np.arange(9, dtype=np.int64)[::-1].copy()
    )
    if ids == "ascending tuple":
        cpu = tuple(range(9))
    placed = ring_plan(
        table,
        cpu,
        0,
        regions=regions,
        ring=(base, slot_bytes, 2, 3),
        max_blocks=512,
        chunk_blocks=0,
        ramp_bytes=0,
        store=store,
    )
    per_block = 512 if regions is None else 256
    assert placed.block_bytes == per_block
    per_slot = slot_bytes // per_block
    assert np.diff(placed.bounds).tolist() == [per_slot] * (9 // per_slot) + (
        [9 % per_slot] if 9 % per_slot else []
    )
    n = placed.num_subbatches
    assert placed.slots == [(2 + k) % 3 for k in range(n)]
    assert placed.slot_ptrs == [base + s * slot_bytes for s in placed.slots]
    dma = placed.dma
    dst, src, size = (
        (dma.dst.tolist(), dma.src.tolist(), dma.size.tolist())
        if isinstance(dma, Pitched)
        else dma.lists()
    )
    staging = src if store else dst
    for k in range(n):
        lo, hi = placed.desc_bounds[k], placed.desc_bounds[k + 1]
        for at, nbytes in zip(staging[lo:hi], size[lo:hi], strict=True):
            assert placed.slot_ptrs[k] <= at
            assert at + nbytes <= placed.slot_ptrs[k] + slot_bytes
    assert dma.total_bytes == 9 * per_block
    assert isinstance(dma, Pitched) == (ascending and regions is not None)
    assert isinstance(dma, CopyList) == (ids == "ascending tuple" and regions is None)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    gaps=st.lists(st.integers(1, 3), min_size=6, max_size=6),
    blocks_per_slot=st.integers(1, 40),
    ramp_blocks=st.integers(0, 4),
    chunk_blocks=st.sampled_from([0, 2, 5, 16]),
    store=st.booleans(),
    regions=st.sampled_from([(0, 2), (2, 6), (4, 6)]),
)
def test_a_parts_2d_copies_are_its_per_block_copies_row_by_row(
    lengths: list[int],
    gaps: list[int],
    blocks_per_slot: int,
    ramp_blocks: int,
    chunk_blocks: int,
    store: bool,
    regions: tuple[int, int],
) -> None:
    """Where a part's CPU ids come in runs long enough, its plan is one 2D copy per run (cut at
    sub-batch and pinned-chunk boundaries) whose rows are exactly the per-block plan's copies,
    sub-batch by sub-batch, and no copy's CPU rows leave one pinned chunk."""
    table = flash_table(3, 128, 16)
    cpu = run_ids(lengths, gaps[: len(lengths)])
    n = len(cpu)
    plan, plain = (
        part_plan(
            table,
            *regions,
            cpu,
            1 << 20,
            blocks_per_slot=blocks_per_slot,
            store=store,
            ramp_blocks=ramp_blocks,
            chunk_blocks=chunk_blocks,
            pitched=pitched,
        )
        for pitched in (True, False)
    )
    assert isinstance(plain.dma, Descriptors)
    assert plan.bounds.tolist() == plain.bounds.tolist()
    if not isinstance(plan.dma, Pitched):
        assert len(plan.dma) == n
        return
    pitched = plan.dma
    assert len(pitched) * PITCHED_MIN_ROWS <= n
    assert pitched.total_bytes == plain.dma.total_bytes
    for k in range(plan.num_subbatches):
        mine = pitched.slice(int(plan.desc_bounds[k]), int(plan.desc_bounds[k + 1])).row_copies()
        theirs = plain.dma.slice(int(plain.desc_bounds[k]), int(plain.desc_bounds[k + 1]))
        for a, b in ((mine.dst, theirs.dst), (mine.src, theirs.src), (mine.size, theirs.size)):
            assert a.tolist() == b.tolist()
    cpu_side = pitched.dst if store else pitched.src
    first = (cpu_side.astype(np.int64) - (1 << 20)) // table.block_bytes
    last = first + pitched.rows.astype(np.int64) - 1
    if chunk_blocks:
        assert (first // chunk_blocks == last // chunk_blocks).all()
    # Every run starts a copy: the copies are the runs, cut only where a boundary falls.
    cuts = {0, *np.flatnonzero(np.diff(cpu) != 1) + 1, *plan.bounds[:-1].tolist()}
    if chunk_blocks:
        cuts |= {i for i in range(n) if cpu[i] % chunk_blocks == 0}
    assert len(pitched) == len(cuts)


def test_short_runs_keep_one_copy_per_block() -> None:
    """CPU ids whose runs average fewer than ``PITCHED_MIN_ROWS`` blocks get one copy per block
    (a batched call), not a 2D copy per run."""
    table = flash_table(2, 64, 16)
    cpu = run_ids([3, 3, 3, 3], [1, 1, 1, 1])
    plan = part_plan(table, 0, 2, cpu, 0, blocks_per_slot=64, store=False)
    assert isinstance(plan.dma, Descriptors)
    assert len(plan.dma) == len(cpu)
    long_runs = run_ids([8, 8], [1, 1])
    plan = part_plan(table, 0, 2, long_runs, 0, blocks_per_slot=64, store=False)
    assert isinstance(plan.dma, Pitched)
    assert plan.dma.rows.tolist() == [8, 8]
    assert plan.dma.cpu_pitch == table.block_bytes
    assert plan.dma.width == table.span_bytes(0, 2)
