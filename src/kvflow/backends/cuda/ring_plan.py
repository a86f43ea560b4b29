"""Staged plans placed on a staging ring: which slot each sub-batch fills, with every
staging-side address absolute, as the issue path hands them to the copy streams.

A step's common case (whole blocks, or a load part's pages, whose CPU ids come in a few
ascending runs) is placed in plain Python (``_ring_runs``); anything else goes through the
numpy plans of ``plan`` and is placed with arrays. Both give the same copies (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from attrs import evolve, frozen

from kvflow.backends.cuda.plan import (
    FEW_RUNS,
    I64,
    PITCHED_MIN_ROWS,
    Copies,
    CopyList,
    Pitched,
    RegionTable,
    as_i64,
    part_plan,
    run_pieces,
    staged_plan,
    subbatch_cuts,
)
from kvflow.core.idruns import EVERY_CAP, ascending_runs, every


@frozen
class RingPlan:
    """A group's staged plan placed on a staging ring: sub-batch ``k`` holds blocks
    ``bounds[k]:bounds[k + 1]`` in slot ``slots[k]`` at ``slot_ptrs[k]``, its DMA copies
    ``dma.slice(desc_bounds[k], desc_bounds[k + 1])``, every staging-side address absolute;
    ``block_bytes`` of one block in a slot (the whole block's, or a part's)."""

    bounds: list[int]
    desc_bounds: list[int]
    slots: list[int]
    slot_ptrs: list[int]
    dma: Copies
    block_bytes: int

    @property
    def num_subbatches(self) -> int:
        return len(self.bounds) - 1


def ring_plan(
    table: RegionTable,
    cpu_ids: Sequence[int] | I64,
    cpu_base: int,
    *,
    regions: tuple[int, int] | None,
    ring: tuple[int, int, int, int],
    max_blocks: int,
    chunk_blocks: int,
    ramp_bytes: int,
    store: bool,
    pitched: bool = True,
) -> RingPlan:
    """``staged_plan`` (or ``part_plan`` for ``regions``, with ``pitched``) over a ring of
    ``(base, slot bytes, next slot, slots)``: sub-batches of at most a slot's worth of blocks
    and ``max_blocks`` (the kernel's ids per launch), placed on the slots in turn from the next
    one. Whole blocks whose CPU ids come in a few ascending runs are planned in plain Python
    (``_ring_runs``), the same copies."""
    base, slot_bytes, first, nslots = ring
    bb = table.block_bytes if regions is None else table.span_bytes(*regions)
    per_slot = min(max_blocks, slot_bytes // bb)
    ramp = max(1, ramp_bytes // bb) if ramp_bytes else 0
    if type(cpu_ids) is tuple and (regions is None or pitched):
        placed = _ring_runs(
            cpu_ids,
            bb,
            cpu_base if regions is None else cpu_base + table.span_offset(regions[0]),
            ring,
            per_slot,
            ramp,
            chunk_blocks,
            store,
            None if regions is None else table.block_bytes,
        )
        if placed is not None:
            return placed
    ids = cpu_ids if isinstance(cpu_ids, np.ndarray) else as_i64(cpu_ids)
    plan = (
        staged_plan(
            table,
            ids,
            cpu_base,
            blocks_per_slot=per_slot,
            chunk_blocks=chunk_blocks,
            store=store,
            ramp_blocks=ramp,
        )
        if regions is None
        else part_plan(
            table,
            *regions,
            ids,
            cpu_base,
            blocks_per_slot=per_slot,
            store=store,
            ramp_blocks=ramp,
            chunk_blocks=chunk_blocks,
            pitched=pitched,
        )
    )
    slots = (first + np.arange(plan.num_subbatches)) % nslots
    slot_ptrs = (base + slots * slot_bytes).astype(np.uint64)
    # Every staging-side address at once: each descriptor's slot base plus its offset in it.
    staging = plan.dma.src if store else plan.dma.dst
    staging = staging + np.repeat(slot_ptrs, np.diff(plan.desc_bounds))
    dma = evolve(plan.dma, src=staging) if store else evolve(plan.dma, dst=staging)
    return RingPlan(
        plan.bounds.tolist(), plan.desc_bounds.tolist(), slots.tolist(), slot_ptrs.tolist(), dma, bb
    )


def _ring_runs(
    cpu_ids: tuple[int, ...],
    bb: int,
    cpu_base: int,
    ring: tuple[int, int, int, int],
    per_slot: int,
    ramp: int,
    chunk_blocks: int,
    store: bool,
    cpu_pitch: int | None = None,
) -> RingPlan | None:
    """``ring_plan`` in plain Python, or None unless the CPU ids are ascending runs that cut
    into fewer than ``FEW_RUNS`` pieces (then the arrays are cheaper). ``bb`` bytes of each
    block go to a slot: whole blocks (``cpu_pitch`` None), or a part's pages, ``cpu_pitch``
    (a whole CPU block) apart on the CPU side from ``cpu_base`` (the tier's base plus the
    part's offset in a block), each piece one 2D copy (``Pitched``) as ``part_plan`` makes them
    where its pieces average ``PITCHED_MIN_ROWS`` blocks or more (else None)."""
    n = len(cpu_ids)
    if not n or cpu_ids[-1] >= EVERY_CAP or per_slot <= 0:
        return None  # per_slot: the arrays' plan names a slot too small for a block
    runs = ascending_runs(cpu_ids, every(cpu_ids[-1] + 1), cpu_ids[-1] + 1)
    if (
        runs is None
        or len(runs) + n // per_slot + (n // chunk_blocks if chunk_blocks > 0 else 0) >= FEW_RUNS
    ):
        return None
    cuts = subbatch_cuts(n, per_slot, ramp, store=store)
    if cpu_pitch is not None and (len(runs) + len(cuts)) * PITCHED_MIN_ROWS > n:
        return None  # maybe too many pieces for 2D copies: part_plan decides
    base, slot_bytes, first, nslots = ring
    slots = [(first + k) % nslots for k in range(len(cuts) - 1)]
    slot_ptrs = [base + s * slot_bytes for s in slots]
    pitch = bb if cpu_pitch is None else cpu_pitch
    dst, src, blocks, desc_bounds = run_pieces(
        cpu_ids,
        (r[2] for r in runs),
        cuts,
        chunk_blocks,
        slots=slot_ptrs,
        bb=bb,
        cpu_base=cpu_base,
        pitch=pitch,
        store=store,
    )
    dma: Copies
    if cpu_pitch is None:
        dma = CopyList(dst, src, [b * bb for b in blocks])
    else:
        if len(blocks) * PITCHED_MIN_ROWS > n:
            return None  # part_plan: one copy per block
        u64 = np.uint64
        rows = np.array(blocks, dtype=u64)
        dma = Pitched(np.array(dst, dtype=u64), np.array(src, dtype=u64), rows, bb, pitch, store)
    return RingPlan(cuts, desc_bounds, slots, slot_ptrs, dma, bb)


__all__ = ["RingPlan", "ring_plan"]
