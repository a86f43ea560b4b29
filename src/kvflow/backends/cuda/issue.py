"""How one batch's copies are issued on the CUDA backend's streams (``BatchIssue``).

The backend's ``submit`` checks a batch and hands it here, on its launch thread or the caller's:
each KV cache group's copies go on the lane of the batch's direction (the direct path's one
``cuMemcpyBatchAsync``, or the staged path's ring of gather/scatter kernels and DMAs), then the
fence's event after every stream the batch used. A load in parts issues part by part, an event
after each. A failure part-way leaves the copies already issued to run, and the fence failed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.config import CudaConfig
from kvflow.backends.cuda.jobs import JobThread
from kvflow.backends.cuda.kernels import MAX_IDS, PIECE_BYTES, StageKernel
from kvflow.backends.cuda.pinned import PinnedTier
from kvflow.backends.cuda.pitched_copy import PitchedCopier
from kvflow.backends.cuda.plan import (
    Copies,
    CopyList,
    Pitched,
    RegionTable,
    as_i64,
    direct_descriptors,
    pitched_direct,
    runs_too_short,
)
from kvflow.backends.cuda.ring_plan import ring_plan
from kvflow.backends.cuda.streams import CudaFence, Lane, enter_stream, join_streams
from kvflow.backends.cuda.timing import IssueStats, Timing
from kvflow.core.logs import get_logger
from kvflow.core.transfer import Direction

log = get_logger("kvflow.backends.cuda")


class BatchIssue:
    """The issue half of ``CudaBackend``: the state it reads is the backend's, made there."""

    config: CudaConfig
    device: int
    issue_stats: dict[Direction, IssueStats]
    _torch: Any
    _tier: PinnedTier | None
    _tables: list[RegionTable]
    _lanes: dict[Direction, Lane]
    _timing_events: drv.EventPool
    _staged: list[bool]
    _join: Any
    _dma_done: Any
    _last_timing: dict[Direction, Timing | None]
    _launcher: JobThread | None
    _waiters: dict[Direction, JobThread]
    _wakeup: Callable[[], None] | None
    _batch: drv.BatchMemcpy | None
    _memcpy2d: PitchedCopier
    _kernel: StageKernel | None
    _table_dev: list[Any]
    _kernel_rows: list[int]
    _part_tables: dict[tuple[int, int, int], tuple[Any, int]]

    def _part_rows(self, g: int, lo: int, hi: int) -> tuple[int, int]:
        """The gather/scatter kernel's region table for regions ``lo .. hi - 1`` of group
        ``g`` as a block of their own: (device address, rows), uploaded once."""
        key = (g, lo, hi)
        found = self._part_tables.get(key)
        if found is None:
            rows = self._tables[g].subset(lo, hi, packed=True).as_device_rows(PIECE_BYTES)
            dev = self._torch.from_numpy(rows).to(f"cuda:{self.device}")
            found = self._part_tables[key] = (dev, len(rows))
        dev, nrows = found
        return int(dev.data_ptr()), nrows

    def _issue(
        self,
        direction: Direction,
        work: list[Any],
        waits: list[Any],
        fence: CudaFence,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
        part_fences: Sequence[CudaFence] = (),
    ) -> None:
        """Queue one batch's copies after ``waits`` and record ``fence`` after them; with
        ``spans``, part by part, each part's fence recorded after its own copies."""
        deque(self._issue_steps(direction, work, waits, fence, spans, part_fences), 0)

    def _issue_steps(
        self,
        direction: Direction,
        work: list[Any],
        waits: list[Any],
        fence: CudaFence,
        spans: Sequence[Sequence[tuple[int, int]]] | None,
        part_fences: Sequence[CudaFence],
        *,
        defer: bool = False,
    ) -> Generator[int, None, None]:
        # ``waits`` holds CudaFence objects (checked by ``submit``), kept alive until used here.
        """``_issue``, yielding each part's index once it is issued. ``defer``: the caller
        resumes it later (``DeferredIssue``), so a failure is recorded on the fences, not
        raised."""
        began = time.perf_counter()
        tier = self._tier
        assert tier is not None
        store = direction is Direction.STORE
        lane = self._lanes[direction]
        used: list[Any] = []  # the batch's streams, in the order of their first work
        # Read before this batch's first event is queued: see ``Timing.overlapping``.
        prev = Timing.overlapping(self._last_timing[direction])
        try:
            # Made here, not in ``submit``: the caller's thread does as little as it can.
            timing = fence.timing = Timing(self._timing_events) if self.config.time_copies else None
            for g, _, _, cpu in work:
                tier.ensure(g, max(cpu))
            if spans is None:
                for item in work:
                    self._copy_group(lane, item, tier, used, waits, timing, store, None, used)
            else:
                for k, (part_spans, part) in enumerate(zip(spans, part_fences, strict=True)):
                    mine: list[Any] = []  # this part's streams
                    for item in work:
                        lo, hi = part_spans[item[0]]
                        if lo < hi:
                            self._copy_group(
                                lane, item, tier, used, waits, timing, store, (lo, hi), mine
                            )
                    if not mine:
                        enter_stream(used, lane.dma, waits, timing, mine)
                    drv.record(part.event, join_streams(self._join, mine))
                    part.launched = True
                    assert part.issued is not None
                    part.issued.set()
                    yield k
            if not used:  # nothing to copy: the fence completes once its waits have
                enter_stream(used, lane.dma, waits, timing)
            # Every other stream of the batch joins the last one, which then marks the end.
            last = join_streams(self._join, used)
            if timing is not None:
                drv.record(timing.end, last)
            drv.record(fence.event, last)
        except Exception as exc:
            fence.error = str(exc)
            for part in part_fences:
                if not part.launched:
                    part.error = fence.error
                if part.issued is not None:
                    part.issued.set()
            if used:
                # Copies issued before the failure still run: the batch reads failed only once
                # they are done, so that its blocks are not given back under them.
                with contextlib.suppress(Exception):
                    drv.record(fence.event, join_streams(self._join, used))
                    fence.launched = True
            log.error("cuda_submit_failed", direction=str(direction), error=str(exc))
            self._notify(direction, fence)  # the failure
            if self._launcher is None and not defer:
                raise
            return
        if timing is not None:
            fence.prev_timing = prev
            self._last_timing[direction] = timing
        self.issue_stats[direction].observe(began, time.perf_counter())
        fence.launched = True
        self._notify(direction, fence)

    def _copy_group(
        self,
        lane: Lane,
        item: tuple[int, RegionTable, tuple[int, ...], tuple[int, ...]],
        tier: PinnedTier,
        used: list[Any],
        waits: list[Any],
        timing: Timing | None,
        store: bool,
        regions: tuple[int, int] | None,
        mine: list[Any],
    ) -> None:
        """Queue one group's copies of a batch (``regions``: only those of each block)."""
        g, table, gpu, cpu = item
        desc: Copies | None = None
        min_run = self.config.store_dma_min_run
        if store and regions is None and self.config.store_dma and not runs_too_short(gpu, min_run):
            desc = pitched_direct(
                table,
                as_i64(gpu),
                as_i64(cpu),
                tier.ptr(g),
                store=True,
                chunk_blocks=tier.chunk_blocks(g),
                min_rows=min_run,
            )
        if desc is None and self._staged[g]:
            self._staged_copy(
                lane,
                g,
                table,
                gpu,
                cpu,
                tier,
                used,
                waits,
                timing,
                store=store,
                regions=regions,
                mine=mine,
            )
            return
        if desc is None:
            desc = direct_descriptors(
                table if regions is None else table.subset(*regions),
                as_i64(gpu),
                as_i64(cpu),
                tier.ptr(g),
                store=store,
                chunk_blocks=tier.chunk_blocks(g),
            )
        enter_stream(used, lane.dma, waits, timing, mine)
        self._copy(desc, lane, lane.dma)

    def _notify(self, direction: Direction, fence: CudaFence) -> None:
        """Have ``fence``'s waiter thread wake the reactor when it finishes (if there is one)."""
        waiter = self._waiters.get(direction)
        if waiter is not None:
            waiter.put(functools.partial(self._await, fence))

    def _copy(self, desc: Copies, lane: Lane, stream: Any, lo: int = 0, hi: int = -1) -> None:
        """Copy ``lo:hi`` of ``desc`` on ``stream``: 2D copies through ``PitchedCopier``; plain
        descriptors in one batched driver call, or for a few copies (or without
        ``cuMemcpyBatchAsync``) one ``cuMemcpyAsync`` each."""
        hi = len(desc) if hi < 0 else hi
        if isinstance(desc, Pitched):
            self._memcpy2d(desc, stream, lo, hi)
            return
        if self._batch is not None and hi - lo >= self.config.batch_min_copies:
            if isinstance(desc, CopyList):
                desc = desc.descriptors()  # alive until the call returns: it reads the arrays
            self._batch.raw(
                desc.dst.ctypes.data + 8 * lo,
                desc.src.ctypes.data + 8 * lo,
                desc.size.ctypes.data + 8 * lo,
                hi - lo,
                lane.attrs,
                stream,
            )
        else:
            drv.memcpy_each(desc.slice(lo, hi), stream)

    def _staged_copy(
        self,
        lane: Lane,
        g: int,
        table: RegionTable,
        gpu: tuple[int, ...],
        cpu: tuple[int, ...],
        tier: PinnedTier,
        used: list[Any],
        waits: list[Any],
        timing: Timing | None,
        *,
        store: bool,
        regions: tuple[int, int] | None = None,
        mine: list[Any] | None = None,
    ) -> None:
        ring = lane.ring
        kernel = self._kernel
        assert ring is not None
        assert kernel is not None
        if regions is None:
            regions_ptr, nreg = int(self._table_dev[g].data_ptr()), self._kernel_rows[g]
        else:
            regions_ptr, nreg = self._part_rows(g, *regions)
        streams = ring.streams
        placed = ring_plan(
            table,
            cpu,
            tier.ptr(g),
            regions=regions,
            ring=(ring.base, ring.slot_bytes, ring.next, len(streams)),
            max_blocks=MAX_IDS,
            chunk_blocks=tier.chunk_blocks(g),
            ramp_bytes=self.config.ramp_bytes,
            store=store,
            pitched=self.config.pitched_parts,
        )
        dma, bb = placed.dma, placed.block_bytes
        # One conversion for the batch: the kernel's parameter block then takes each sub-batch's
        # ids as a copy of a view, not int by int from a tuple.
        ids = as_i64(gpu)
        nsub = placed.num_subbatches
        ring.next = (ring.next + nsub) % len(streams)
        bounds, dbounds = placed.bounds, placed.desc_bounds
        for k, (slot, slot_ptr) in enumerate(zip(placed.slots, placed.slot_ptrs, strict=True)):
            lo, hi, dlo, dhi = bounds[k], bounds[k + 1], dbounds[k], dbounds[k + 1]
            # The slot's stream ran its previous DMA (store) or scatter (load): stream order
            # makes this sub-batch wait for the slot to be free, and its DMA for its gather.
            stream = streams[slot]
            enter_stream(used, stream, waits, timing, mine)
            if store:
                kernel.launch(stream, regions_ptr, nreg, slot_ptr, bb, ids[lo:hi], to_staging=True)
                self._copy(dma, lane, stream, dlo, dhi)
            else:
                # A load's DMAs go one after another (each on its slot's stream), so that the
                # only scatter no DMA overlaps is the last, short sub-batch's.
                # A part's DMAs also follow the previous part's: the parts land in layer
                # order, each at the link's whole rate, rather than sharing it.
                if k or regions is not None:
                    drv.wait(stream, self._dma_done)
                self._copy(dma, lane, stream, dlo, dhi)
                if k + 1 < nsub or regions is not None:
                    drv.record(self._dma_done, stream)
                kernel.launch(stream, regions_ptr, nreg, slot_ptr, bb, ids[lo:hi], to_staging=False)

    def _await(self, fence: CudaFence) -> None:
        """On a waiter thread: sleep until ``fence``'s copies finish, then wake the reactor.

        The reactor then polls once per finished batch instead of on a timer while copies run:
        every timed poll takes the GIL from the engine's thread. The wait releases the GIL and,
        on blocking-sync events, sleeps. Fences of one direction finish in about launch order,
        so waiting for them in order costs at most a late notice, never a missed one (each
        notice polls every fence).
        """
        if fence.launched:
            err = drv.event_synchronize(fence.event)
            if err:
                log.error("cuda_event_wait_failed", error=err)
        wakeup = self._wakeup
        if wakeup is not None:
            wakeup()


__all__ = ["BatchIssue"]
