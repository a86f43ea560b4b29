"""Copy descriptors for the CUDA backend, built with numpy: no per-chunk Python loops.

Pure functions from block ids and a group's region table to the pointer/size arrays that
``cuMemcpyBatchAsync`` takes (and the 2D copies of a load's part, or of a store straight from
the KV cache), and to the run structure of the staged path. Nothing here touches a device, so
it is tested on any machine; ``ring_plan`` places the staged plans on the staging ring.

A step's common case (a whole-block staged batch whose CPU ids come in a few ascending runs, as
the CPU tier hands them out) is planned in plain Python instead: the batch is issued on the
engine's thread right after the forward's launch has left the caches cold, and there a numpy
call costs many times its warm price (docs/benchmarks.md, thirty-third session).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
from attrs import Factory, evolve, field, frozen

from kvflow.core.layout import GroupLayout
from kvflow.errors import ConfigError

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


@frozen
class RegionTable:
    """One KV cache group's regions as columns, ready for vectorized address arithmetic."""

    group: int
    num_blocks: int
    base: I64  # GPU address of page 0 of each region
    stride: I64  # bytes between consecutive GPU blocks of each region
    page: I64  # bytes of one page of each region
    cpu_offset: I64  # where each region's page sits inside one block-major CPU block
    block_bytes: int  # one whole block across all regions (one CPU block)
    # ``page`` and ``cpu_offset`` as ints, for the plans made in plain Python.
    _pages: list[int] = field(
        init=False,
        eq=False,
        repr=False,
        default=Factory(lambda t: t.page.tolist(), takes_self=True),
    )
    _offsets: list[int] = field(
        init=False,
        eq=False,
        repr=False,
        default=Factory(lambda t: t.cpu_offset.tolist(), takes_self=True),
    )

    @classmethod
    def from_group(cls, group: GroupLayout) -> RegionTable:
        regions = group.regions
        return cls(
            group=group.group,
            num_blocks=group.num_blocks,
            base=np.array([r.base_ptr for r in regions], dtype=np.int64),
            stride=np.array([r.block_stride_bytes for r in regions], dtype=np.int64),
            page=np.array([r.page_bytes for r in regions], dtype=np.int64),
            cpu_offset=np.array(group.cpu_offsets, dtype=np.int64),
            block_bytes=group.block_bytes,
        )

    @property
    def num_regions(self) -> int:
        return len(self.base)

    @property
    def min_page_bytes(self) -> int:
        return int(self.page.min())

    def span_bytes(self, lo: int, hi: int) -> int:
        """Bytes of regions ``lo .. hi - 1`` of one block (contiguous in a CPU block)."""
        return sum(self._pages[lo:hi])

    def span_offset(self, lo: int) -> int:
        """Where region ``lo``'s page sits inside a CPU block."""
        return self._offsets[lo]

    def subset(self, lo: int, hi: int, *, packed: bool = False) -> RegionTable:
        """Regions ``lo .. hi - 1`` only, at their places in the whole CPU block (a part's
        direct copies); ``packed``: as a block of their own, what a part's staging slot holds
        per block (offsets from the part's first page, ``block_bytes`` the part's bytes)."""
        offset = self.cpu_offset[lo:hi]
        return RegionTable(
            group=self.group,
            num_blocks=self.num_blocks,
            base=self.base[lo:hi],
            stride=self.stride[lo:hi],
            page=self.page[lo:hi],
            cpu_offset=offset - offset[0] if packed else offset,
            block_bytes=self.span_bytes(lo, hi) if packed else self.block_bytes,
        )

    def as_device_rows(self, max_page: int = 0) -> I64:
        """``(R', 4)`` rows ``(base, stride, page, cpu_offset)``: the gather kernel's region table.

        With ``max_page`` each page larger than that is cut into pieces of at most about that
        size (multiples of 16 bytes where the page is), each a row of its own: the kernel gives
        one warp to each row of each block, so a cross-layer block of a few MiB still spreads
        over many warps. The staging layout is the same either way.
        """
        rows = np.stack([self.base, self.stride, self.page, self.cpu_offset], axis=1)
        if max_page > 0 and int(self.page.max()) > max_page:
            pieces = []
            for base, stride, page, off in rows.tolist():
                k = -(-page // max_page)
                piece = -(-page // k)
                if page % 16 == 0:
                    piece = -(-piece // 16) * 16
                pieces += [
                    (base + lo, stride, min(piece, page - lo), off + lo)
                    for lo in range(0, page, piece)
                ]
            rows = np.array(pieces, dtype=np.int64)
        return np.ascontiguousarray(rows, dtype=np.int64)


def block_ids(ids: Sequence[int] | I64, limit: int, what: str) -> I64:
    """``ids`` as an int64 array; ``ConfigError`` naming ``what`` if any is outside ``[0, limit)``."""
    arr = (
        # A tuple of ints (what a CopyBatch holds): fromiter skips asarray's type discovery.
        np.fromiter(ids, np.int64, len(ids))
        if isinstance(ids, tuple)
        else np.asarray(ids, dtype=np.int64).reshape(-1)
    )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        bad = arr[(arr < 0) | (arr >= limit)][0]
        raise ConfigError(f"{what} block id {int(bad)} is outside 0..{limit - 1}")
    return arr


_INT = frozenset({int})


def id_tuple(ids: Sequence[int] | I64, limit: int, what: str) -> tuple[int, ...]:
    """``ids`` as a tuple of ints, each in ``[0, limit)``; ``ConfigError`` naming ``what`` for one
    outside. A tuple of ints (what a ``CopyBatch`` holds) is checked by a few C-level passes and
    returned as it is; anything else goes through ``block_ids``."""
    if type(ids) is tuple and _INT.issuperset(map(type, ids)):
        if ids and (min(ids) < 0 or max(ids) >= limit):
            bad = next(b for b in ids if b < 0 or b >= limit)
            raise ConfigError(f"{what} block id {bad} is outside 0..{limit - 1}")
        return ids
    return tuple(block_ids(ids, limit, what).tolist())


def as_i64(ids: Sequence[int]) -> I64:
    """Checked ids (``id_tuple``) as the int64 array the vectorized plans take."""
    return np.fromiter(ids, np.int64, len(ids))


def group_work(
    tables: Sequence[RegionTable],
    cpu_blocks: Sequence[int],
    gpu_ids: Sequence[Sequence[int] | I64],
    cpu_ids: Sequence[Sequence[int] | I64],
    *,
    checked: bool = False,
) -> list[tuple[int, RegionTable, tuple[int, ...], tuple[int, ...]]]:
    """A batch's block pairs, checked: ``(group, table, GPU ids, CPU ids)`` for each group with
    blocks, the ids as tuples of ints (``id_tuple``); ``ConfigError`` naming the group for a
    wrong group count, an id out of range, or unequal counts. ``checked`` (``CopyBatch.checked``):
    tuples are taken as they are, only the counts checked."""
    if len(gpu_ids) != len(tables) or len(cpu_ids) != len(tables):
        raise ConfigError(
            f"copy batch has {len(gpu_ids)}/{len(cpu_ids)} groups, layout has {len(tables)}"
        )
    work = []
    for g, table in enumerate(tables):
        gpu, cpu = gpu_ids[g], cpu_ids[g]
        if not (checked and type(gpu) is tuple and type(cpu) is tuple):
            gpu = id_tuple(gpu, table.num_blocks, f"group {g} GPU")
            cpu = id_tuple(cpu, cpu_blocks[g], f"group {g} CPU")
        if len(gpu) != len(cpu):
            raise ConfigError(f"group {g}: {len(gpu)} GPU blocks but {len(cpu)} CPU blocks")
        if len(gpu):
            work.append((g, table, gpu, cpu))
    return work


@frozen
class Descriptors:
    """Parallel arrays of one batched copy: ``size[i]`` bytes from ``src[i]`` to ``dst[i]``."""

    dst: U64
    src: U64
    size: U64

    def __len__(self) -> int:
        return len(self.size)

    @property
    def total_bytes(self) -> int:
        return int(self.size.sum())

    def slice(self, lo: int, hi: int) -> Descriptors:
        return Descriptors(self.dst[lo:hi], self.src[lo:hi], self.size[lo:hi])

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(dst, src, size)`` as lists of ints."""
        return self.dst.tolist(), self.src.tolist(), self.size.tolist()


@frozen
class CopyList:
    """``Descriptors`` as lists of ints: a few copies planned in plain Python (``ring_plan``'s
    common case), made arrays only for a batched driver call (``descriptors``)."""

    dst: list[int]
    src: list[int]
    size: list[int]

    def __len__(self) -> int:
        return len(self.size)

    @property
    def total_bytes(self) -> int:
        return sum(self.size)

    def slice(self, lo: int, hi: int) -> CopyList:
        return CopyList(self.dst[lo:hi], self.src[lo:hi], self.size[lo:hi])

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        return self.dst, self.src, self.size

    def descriptors(self) -> Descriptors:
        u64 = np.uint64
        return Descriptors(
            np.array(self.dst, dtype=u64), np.array(self.src, dtype=u64), np.array(self.size, u64)
        )


def _as_u64(a: I64) -> U64:
    return np.ascontiguousarray(a).view(np.uint64)


def direct_descriptors(
    table: RegionTable,
    gpu_ids: I64,
    cpu_ids: I64,
    cpu_base: int,
    *,
    store: bool,
    chunk_blocks: int = 0,
) -> Descriptors:
    """One descriptor per (block, region) page, block-major; runs of whole blocks merged.

    Where a group has a single region whose GPU pages are back to back (cross-layer layouts),
    consecutive ids on both sides make one larger copy instead of one per block; with
    ``chunk_blocks`` (the CPU tier's blocks per pinned chunk) such a copy ends where the CPU ids
    enter a new chunk: the driver refuses a copy over two separately pinned ranges.
    """
    if table.num_regions == 1 and table.stride[0] == table.page[0] == table.block_bytes:
        starts, lengths = runs(gpu_ids, cpu_ids, chunk_blocks)
        gpu = table.base[0] + gpu_ids[starts] * table.stride[0]
        cpu = cpu_base + cpu_ids[starts] * table.block_bytes
        size = lengths * table.block_bytes
    else:
        gpu = (table.base[None, :] + gpu_ids[:, None] * table.stride[None, :]).reshape(-1)
        cpu = (cpu_base + cpu_ids[:, None] * table.block_bytes + table.cpu_offset[None, :]).reshape(
            -1
        )
        size = np.broadcast_to(table.page[None, :], (len(gpu_ids), table.num_regions)).reshape(-1)
    dst, src = (cpu, gpu) if store else (gpu, cpu)
    return Descriptors(_as_u64(dst), _as_u64(src), _as_u64(np.asarray(size, dtype=np.int64)))


def runs(a: I64, b: I64, chunk_blocks: int = 0) -> tuple[I64, I64]:
    """Maximal runs over which ``a`` and ``b`` both step by +1: (start indices, lengths).

    With ``chunk_blocks`` a run also ends where ``b`` enters a new registration chunk, so that no
    copy spans two separately pinned ranges.
    """
    n = len(a)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    brk = (np.diff(a) != 1) | (np.diff(b) != 1)
    if chunk_blocks > 0:
        brk |= (b[1:] % chunk_blocks) == 0
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
    return starts, lengths


def runs_too_short(ids: Sequence[int], min_rows: int) -> bool:
    """Whether ``ids`` (a batch's GPU ids) step by +1 so rarely that their runs average fewer
    than ``min_rows`` blocks. ``pitched_direct`` then has no plan (its runs also break on the
    CPU side), so True spares a store of scattered blocks its arrays: the scan stops at the
    first break too many, a few comparisons for such a store."""
    n = len(ids)
    allowed = n // min_rows - 1  # breaks a batch may have: runs <= n / min_rows
    if allowed < 0:
        return True
    breaks = 0
    prev = ids[0]
    for x in itertools.islice(ids, 1, None):
        if x != prev + 1:
            breaks += 1
            if breaks > allowed:
                return True
        prev = x
    return False


@frozen
class StagedPlan:
    """A group's blocks cut into sub-batches that each fit one staging slot.

    Sub-batch ``k`` holds blocks ``bounds[k]:bounds[k + 1]``, gathered into its slot in that order;
    its DMA copies are ``dma.slice(desc_bounds[k], desc_bounds[k + 1])``, with staging-side
    addresses relative to the slot (add the slot's address before use).
    """

    bounds: I64
    dma: Descriptors | Pitched
    desc_bounds: I64

    @property
    def num_subbatches(self) -> int:
        return len(self.bounds) - 1


def subbatch_bounds(n: int, blocks_per_slot: int, ramp_blocks: int, *, store: bool) -> I64:
    """``subbatch_cuts`` as an array."""
    return np.asarray(subbatch_cuts(n, blocks_per_slot, ramp_blocks, store=store), dtype=np.int64)


def subbatch_cuts(n: int, blocks_per_slot: int, ramp_blocks: int, *, store: bool) -> list[int]:
    """Where ``n`` blocks are cut into sub-batches of at most ``blocks_per_slot``.

    With ``ramp_blocks`` (0 for none) a store's first sub-batch, and a load's last, holds at most
    that many blocks: a store's first gather and a load's last scatter are the parts of a batch
    that overlap no DMA, so making them short cuts the batch's fixed cost; every other
    sub-batch is a full slot.
    """
    if blocks_per_slot <= 0:
        raise ConfigError(f"blocks_per_slot must be positive, got {blocks_per_slot}")
    ramp = min(ramp_blocks, blocks_per_slot) if ramp_blocks > 0 else 0
    if n == 0:
        return [0]
    if not ramp or n <= ramp:
        cuts = list(range(0, n, blocks_per_slot))
    elif store:
        cuts = [0, *range(ramp, n, blocks_per_slot)]
    else:
        # Full slots from the start, then whatever is left before the short last one.
        body = n - ramp
        cuts = [*range(0, body, blocks_per_slot), body]
    cuts.append(n)
    return cuts


FEW_RUNS = 48
"""Below about this many DMA pieces (CPU-id runs, sub-batches, pinned-chunk crossings),
``staged_plan`` cuts them in Python: a handful of pieces cost less than the numpy path's few
dozen array calls (what a CPU pool that hands out ascending runs gives); more cost more
(``scripts/bench_transfer.py --plan-only``)."""


def run_pieces(
    cpu_ids: Sequence[int] | I64,
    run_starts: Iterable[int],
    cuts: list[int],
    chunk_blocks: int,
    *,
    slots: Sequence[int],
    bb: int,
    cpu_base: int,
    pitch: int,
    store: bool,
) -> tuple[list[int], list[int], list[int], list[int]]:
    """A staged batch's DMA pieces where its CPU ids come in runs (``run_starts``: where each
    run begins) and ``cuts`` are its sub-batches' bounds: a piece starts at a run or sub-batch
    start and ends at the next one, or where its CPU ids enter a new pinned chunk. Sub-batch
    ``k``'s blocks lie ``bb`` bytes apart from ``slots[k]``, CPU block ``i`` at ``cpu_base + i *
    pitch``. Returns each piece's ``dst``, ``src`` and blocks, and each sub-batch's first piece
    (``desc_bounds``). One loop for all of it: a comprehension per column costs more than its
    iterations with the caches cold, as a step's issue has them."""
    n = cuts[-1]
    starts = sorted({*run_starts, *cuts[:-1]})
    first_ids = (
        cpu_ids[starts].tolist()
        if isinstance(cpu_ids, np.ndarray)
        else [cpu_ids[a] for a in starts]
    )
    dst: list[int] = []
    src: list[int] = []
    blocks: list[int] = []
    desc_bounds = [0]
    k = 0  # the sub-batch of the piece at hand
    for at, end, cid in zip(starts, [*starts[1:], n], first_ids, strict=True):
        while at >= cuts[k + 1]:
            k += 1
            desc_bounds.append(len(blocks))
        staging = slots[k] + (at - cuts[k]) * bb
        while at < end:
            stop = end
            if chunk_blocks > 0:
                stop = min(stop, at + chunk_blocks - cid % chunk_blocks)
            cpu = cpu_base + cid * pitch
            dst.append(cpu if store else staging)
            src.append(staging if store else cpu)
            blocks.append(stop - at)
            staging += (stop - at) * bb
            cid += stop - at
            at = stop
    desc_bounds.extend([len(blocks)] * (len(cuts) - len(desc_bounds)))
    return dst, src, blocks, desc_bounds


def _staged_plan_runs(
    table: RegionTable,
    cpu_ids: I64,
    cpu_base: int,
    bounds: I64,
    run_starts: list[int],
    chunk_blocks: int,
    store: bool,
) -> StagedPlan:
    """``staged_plan`` for CPU ids in few ascending runs: the same pieces, cut in Python, their
    staging side relative to each slot."""
    bb = table.block_bytes
    cuts = bounds.tolist()
    dst, src, blocks, desc_bounds = run_pieces(
        cpu_ids,
        run_starts,
        cuts,
        chunk_blocks,
        slots=[0] * len(cuts),
        bb=bb,
        cpu_base=cpu_base,
        pitch=bb,
        store=store,
    )
    u64 = np.uint64
    return StagedPlan(
        bounds=bounds,
        dma=Descriptors(
            np.array(dst, dtype=u64),
            np.array(src, dtype=u64),
            np.array([b * bb for b in blocks], u64),
        ),
        desc_bounds=np.array(desc_bounds, dtype=np.int64),
    )


def staged_plan(
    table: RegionTable,
    cpu_ids: I64,
    cpu_base: int,
    *,
    blocks_per_slot: int,
    chunk_blocks: int,
    store: bool,
    ramp_blocks: int = 0,
) -> StagedPlan:
    """Sub-batches (``subbatch_bounds``) and whole-block DMA runs between slot and CPU.

    Inside a slot, block ``i`` of the sub-batch sits at ``i * block_bytes``; consecutive CPU ids
    therefore make one contiguous copy (split at registration-chunk and sub-batch boundaries).
    """
    n = len(cpu_ids)
    bounds = subbatch_bounds(n, blocks_per_slot, ramp_blocks, store=store)
    if n:
        run_starts = np.flatnonzero(np.diff(cpu_ids) != 1)
        # About how many pieces the loop would cut: runs, sub-batches, chunk crossings.
        pieces = len(run_starts) + len(bounds) + (n // chunk_blocks if chunk_blocks > 0 else 0)
        if pieces < FEW_RUNS:
            return _staged_plan_runs(
                table, cpu_ids, cpu_base, bounds, (run_starts + 1).tolist(), chunk_blocks, store
            )
    return _staged_plan_arrays(table, cpu_ids, cpu_base, bounds, chunk_blocks, store)


def _slot_positions(bounds: I64) -> I64:
    """Each block's place in its sub-batch's slot (``bounds`` from ``subbatch_bounds``)."""
    return np.arange(int(bounds[-1]), dtype=np.int64) - np.repeat(bounds[:-1], np.diff(bounds))


def _slot_runs(cpu_ids: I64, bounds: I64, chunk_blocks: int) -> tuple[I64, I64, I64, I64]:
    """``_slot_positions``, and the runs of blocks consecutive both there and in ``cpu_ids``
    (a new sub-batch restarts at slot offset 0, so runs break there; they break at pinned-chunk
    boundaries too): (slot places, run starts, run lengths, each sub-batch's first run, as
    ``StagedPlan.desc_bounds``)."""
    slot_pos = _slot_positions(bounds)
    starts, lengths = runs(slot_pos, cpu_ids, chunk_blocks)
    return slot_pos, starts, lengths, np.searchsorted(starts, bounds).astype(np.int64)


def _staged_plan_arrays(
    table: RegionTable,
    cpu_ids: I64,
    cpu_base: int,
    bounds: I64,
    chunk_blocks: int,
    store: bool,
) -> StagedPlan:
    """``staged_plan`` for any CPU ids, in numpy (no loop per block or per run)."""
    slot_pos, starts, lengths, desc_bounds = _slot_runs(cpu_ids, bounds, chunk_blocks)
    bb = table.block_bytes
    slot_off = slot_pos[starts] * bb
    cpu = cpu_base + cpu_ids[starts] * bb
    size = lengths * bb
    dst, src = (cpu, slot_off) if store else (slot_off, cpu)
    return StagedPlan(
        bounds=bounds,
        dma=Descriptors(_as_u64(dst), _as_u64(src), _as_u64(size)),
        desc_bounds=desc_bounds,
    )


PITCHED_MIN_ROWS = 4
"""``part_plan`` copies a part as 2D copies (``Pitched``: one per run of consecutive CPU blocks)
when the runs average at least this many blocks; with shorter runs one descriptor per block in
one batched call costs the host less than a driver call per run."""


@frozen
class Pitched:
    """2D copies between CPU blocks and the GPU: copy ``i`` moves ``rows[i]`` rows of ``width``
    bytes from ``src[i]`` to ``dst[i]``, the rows ``cpu_pitch`` apart on the CPU side and
    ``gpu_pitch`` apart on the GPU side, where 0 means back to back (a staging slot's rows: a
    part's pages of a run of consecutive CPU blocks, contiguous inside each block, a block apart
    from one block to the next; or a region's pages of a run of blocks straight from the KV
    cache, ``pitched_direct``)."""

    dst: U64
    src: U64
    rows: U64
    width: int
    cpu_pitch: int
    store: bool
    gpu_pitch: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def size(self) -> U64:
        """Bytes of each copy (its rows' bytes, however far apart the rows lie)."""
        return self.rows * np.uint64(self.width)

    @property
    def total_bytes(self) -> int:
        return int(self.rows.sum()) * self.width

    @property
    def pitches(self) -> tuple[int, int]:
        """(source pitch, destination pitch) in bytes: a store reads the GPU side."""
        gpu_pitch = self.gpu_pitch or self.width
        return (gpu_pitch, self.cpu_pitch) if self.store else (self.cpu_pitch, gpu_pitch)

    def slice(self, lo: int, hi: int) -> Pitched:
        return evolve(self, dst=self.dst[lo:hi], src=self.src[lo:hi], rows=self.rows[lo:hi])

    def row_copies(self) -> Descriptors:
        """The same copies as one plain descriptor per row."""
        rows = self.rows.astype(np.int64)
        first = np.repeat(np.cumsum(rows) - rows, rows)
        row = np.arange(int(rows.sum()), dtype=np.int64) - first
        cpu_step, slot_step = row * self.cpu_pitch, row * (self.gpu_pitch or self.width)
        dst_step, src_step = (cpu_step, slot_step) if self.store else (slot_step, cpu_step)
        dst = np.repeat(self.dst.view(np.int64), rows) + dst_step
        src = np.repeat(self.src.view(np.int64), rows) + src_step
        size = np.full(len(row), self.width, dtype=np.int64)
        return Descriptors(_as_u64(dst), _as_u64(src), _as_u64(size))


Copies = Descriptors | Pitched | CopyList


def part_plan(
    table: RegionTable,
    lo: int,
    hi: int,
    cpu_ids: I64,
    cpu_base: int,
    *,
    blocks_per_slot: int,
    store: bool,
    ramp_blocks: int = 0,
    chunk_blocks: int = 0,
    pitched: bool = True,
) -> StagedPlan:
    """``staged_plan`` for regions ``lo .. hi - 1`` of each block (one part of a load by
    layer): inside a slot, block ``i`` of the sub-batch sits at ``i * part_bytes``. The part's
    pages are contiguous inside each CPU block but not across consecutive blocks: a run of
    consecutive CPU blocks (split at sub-batch and pinned-chunk boundaries) is one 2D copy
    (``Pitched``) where runs are long enough (``PITCHED_MIN_ROWS``) and ``pitched``, otherwise
    each block is one copy."""
    if not 0 <= lo < hi <= table.num_regions:
        raise ConfigError(f"regions {lo}..{hi - 1} of a group of {table.num_regions}")
    part = table.span_bytes(lo, hi)
    n = len(cpu_ids)
    bounds = subbatch_bounds(n, blocks_per_slot, ramp_blocks, store=store)
    first_page = cpu_base + int(table.cpu_offset[lo])
    if pitched and n:
        slot_pos, starts, lengths, desc_bounds = _slot_runs(cpu_ids, bounds, chunk_blocks)
        if len(starts) * PITCHED_MIN_ROWS <= n:
            cpu = first_page + cpu_ids[starts] * table.block_bytes
            slot_off = slot_pos[starts] * part
            dst, src = (cpu, slot_off) if store else (slot_off, cpu)
            return StagedPlan(
                bounds=bounds,
                dma=Pitched(
                    _as_u64(dst),
                    _as_u64(src),
                    _as_u64(lengths),
                    width=part,
                    cpu_pitch=table.block_bytes,
                    store=store,
                ),
                desc_bounds=desc_bounds,
            )
    else:
        slot_pos = _slot_positions(bounds)
    cpu = first_page + cpu_ids * table.block_bytes
    slot_off = slot_pos * part
    size = np.full(n, part, dtype=np.int64)
    dst, src = (cpu, slot_off) if store else (slot_off, cpu)
    return StagedPlan(
        bounds=bounds,
        dma=Descriptors(_as_u64(dst), _as_u64(src), _as_u64(size)),
        desc_bounds=bounds.copy(),
    )


def pitched_direct(
    table: RegionTable,
    gpu_ids: I64,
    cpu_ids: I64,
    cpu_base: int,
    *,
    store: bool,
    chunk_blocks: int = 0,
    min_rows: int = PITCHED_MIN_ROWS,
) -> Pitched | None:
    """A batch's copies with no staging and no kernel: per run of blocks consecutive on both
    sides (cut where the CPU ids enter a new pinned chunk) and per region, one 2D copy of the
    run's pages, a GPU block's stride apart on the GPU and a CPU block apart on the CPU. None
    where the regions' pages or strides differ (one row shape per call) or the runs average
    fewer than ``min_rows`` blocks (then a driver call per run costs the host more than the
    staged path's few calls)."""
    n = len(gpu_ids)
    page, stride = table.page, table.stride
    if not n or bool((page != page[0]).any()) or bool((stride != stride[0]).any()):
        return None
    starts, lengths = runs(gpu_ids, cpu_ids, chunk_blocks)
    if len(starts) * min_rows > n:
        return None
    gpu = (table.base[None, :] + gpu_ids[starts][:, None] * stride[None, :]).reshape(-1)
    cpu = (
        cpu_base + cpu_ids[starts][:, None] * table.block_bytes + table.cpu_offset[None, :]
    ).reshape(-1)
    rows = np.repeat(lengths, table.num_regions)
    dst, src = (cpu, gpu) if store else (gpu, cpu)
    return Pitched(
        _as_u64(dst),
        _as_u64(src),
        _as_u64(rows),
        width=int(page[0]),
        cpu_pitch=table.block_bytes,
        store=store,
        gpu_pitch=int(stride[0]),
    )


__all__ = [
    "PITCHED_MIN_ROWS",
    "Copies",
    "CopyList",
    "Descriptors",
    "Pitched",
    "RegionTable",
    "StagedPlan",
    "as_i64",
    "block_ids",
    "direct_descriptors",
    "group_work",
    "id_tuple",
    "part_plan",
    "pitched_direct",
    "run_pieces",
    "runs",
    "runs_too_short",
    "staged_plan",
    "subbatch_bounds",
    "subbatch_cuts",
]
