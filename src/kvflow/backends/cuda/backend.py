"""``CudaBackend``: the backend protocol on a CUDA GPU, through cuda-python.

Two ways to move a batch of blocks, chosen per KV cache group by page size:

- direct: one ``cuMemcpyBatchAsync`` over every (block, region) page — good when pages are large;
- staged: a gather kernel packs the pages of up to a slot's worth of blocks into a block-major
  staging slot on the GPU, then the copy engine moves whole blocks (runs of them) to the CPU tier;
  loads run the same pipeline backwards. Slots form a ring per direction, each slot with a stream
  of its own that runs both its kernel and its DMA: stream order alone keeps a slot's gather before
  its DMA and its next gather after that DMA, while gather ``k + 1`` on the next slot's stream
  overlaps DMA ``k``. A store's sub-batch is then two driver calls (kernel, DMA) rather than six
  (with the four event records and waits that ordered one kernel stream against one DMA
  stream); a load's chains its DMA after the previous one's (four), so that only its last,
  short scatter is left without a DMA to overlap.

Every stream kvflow creates is non-blocking at the lowest priority. Fences are CUDA events: a
store waits (device-side) on the compute fence, a load on any in-flight store of its blocks.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from attrs import evolve

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.config import CudaConfig, Method
from kvflow.backends.cuda.deferred import DeferredIssue
from kvflow.backends.cuda.issue import BatchIssue
from kvflow.backends.cuda.jobs import JobThread
from kvflow.backends.cuda.kernels import PIECE_BYTES, StageKernel
from kvflow.backends.cuda.pinned import PinnedTier
from kvflow.backends.cuda.pitched_copy import Memcpy3DBatch, PitchedCopier
from kvflow.backends.cuda.plan import (
    RegionTable,
    group_work,
)
from kvflow.backends.cuda.streams import CudaFence, Lane, Ring
from kvflow.backends.cuda.timing import ClockMark, IssueStats, LandingClock, Timing
from kvflow.backends.torch_layout import describe
from kvflow.core.layout import KVLayout, LayerParts, TensorDesc, derive_layout
from kvflow.core.logs import get_logger
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError, DeadlineError

log = get_logger("kvflow.backends.cuda")


class CudaBackend(BatchIssue):
    """The backend protocol on one CUDA device. Methods are called from one thread."""

    name = "cuda"

    def __init__(self, device: int = 0, config: CudaConfig | None = None) -> None:
        self.config = config or CudaConfig()
        try:
            import torch
        except Exception as exc:  # pragma: no cover - torch is a dependency
            raise BackendError(f"torch is not importable: {exc}") from exc
        if not torch.cuda.is_available():
            raise BackendError("CUDA backend: torch sees no CUDA device")
        self._torch = torch
        # The engine's current stream as a raw handle in one C call (what Triton reads):
        # ``torch.cuda.current_stream`` builds a Stream object through several Python calls,
        # a cost on every store's launch. Older or other builds fall back to it.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current_stream: Callable[[int], int] = (
            raw if raw is not None else lambda d: int(torch.cuda.current_stream(d).cuda_stream)
        )
        torch.cuda.init()  # type: ignore[no-untyped-call]
        self._ctx = drv.Context(device)
        self.device = device
        self._batch: drv.BatchMemcpy | None = None
        self.batch_error: str | None = None
        if self.config.use_batch_memcpy:
            try:
                self._batch = drv.BatchMemcpy.resolve(self._ctx.driver_version)
            except BackendError as exc:
                self.batch_error = str(exc)
                log.warning(
                    "cuda_batch_memcpy_unavailable", reason=str(exc), fallback="cuMemcpyAsync"
                )
        else:
            self.batch_error = "disabled by CudaConfig.use_batch_memcpy"
        batch_3d: Memcpy3DBatch | None = None
        self.batch_3d_error: str | None = "disabled by CudaConfig.pitched_batch"
        if self.config.pitched_batch:
            try:
                batch_3d = Memcpy3DBatch.resolve(self._ctx.driver_version, device)
                self.batch_3d_error = None
            except BackendError as exc:
                self.batch_3d_error = str(exc)
                log.warning(
                    "cuda_batch_3d_unavailable", reason=str(exc), fallback="cuMemcpy2DAsync"
                )
        self._memcpy2d = PitchedCopier(batch_3d, self.config.batch_min_copies)
        self._lanes = {
            d: Lane(
                dma=drv.lowest_priority_stream(),
                attrs=drv.CopyAttributes(store=d is Direction.STORE, device=device),
            )
            for d in Direction
        }
        self._join = drv.new_event()
        self._dma_done = drv.new_event()  # a load's sub-batch DMA, for the next one to wait on
        # Fence events (blocking, so that a waiter thread sleeps), timing events, and the
        # compute fences' plain ones: one pool each, reused batch after batch.
        self._fence_events = drv.EventPool(blocking=True)
        self._timing_events = drv.EventPool(timing=True)
        self._plain_events = drv.EventPool()
        self._launcher = (
            JobThread(self._ctx, "kvflow-cuda-launch") if self.config.launch_thread else None
        )
        self._deferred = DeferredIssue()  # without a launcher: a load's parts not issued yet
        self._wakeup: Callable[[], None] | None = None
        self.pushes_completions = self.config.completion_threads
        """Waiter threads call the wakeup as batches finish: the reactor need not poll on a
        timer."""
        self._waiters = (
            {d: JobThread(self._ctx, f"kvflow-cuda-wait-{d.value}") for d in Direction}
            if self.config.completion_threads
            else {}
        )
        self._kernel: StageKernel | None = None
        self.layout: KVLayout | None = None
        self._tables: list[RegionTable] = []
        self._table_dev: list[Any] = []  # torch tensors keeping the region tables alive
        self._kernel_rows: list[int] = []  # rows of each table: regions, large pages cut up
        # Tables of load parts (group, first region, end) → (device tensor, rows).
        self._part_tables: dict[tuple[int, int, int], tuple[Any, int]] = {}
        self._prepared: LayerParts | None = None  # the parts whose tables are all uploaded
        self._staging: list[Any] = []
        self._tier: PinnedTier | None = None
        self._staged: list[bool] = []
        self._last_timing: dict[Direction, Timing | None] = dict.fromkeys(Direction)
        # Clock marks need a stream with nothing queued: one of their own.
        self._mark_stream = drv.lowest_priority_stream()
        self._landing = LandingClock(self.clock_mark)
        self.issue_stats: dict[Direction, IssueStats] = {d: IssueStats() for d in Direction}
        """Host time spent issuing each direction's batches (planning and driver calls)."""
        self._closed = False
        log.info(
            "cuda_backend_opened",
            device=device,
            driver=self._ctx.driver_version,
            batch_memcpy_abi=self._batch.abi if self._batch else None,
        )

    # -- registration -------------------------------------------------------------------------

    def register_kv_caches(
        self,
        tensors: Mapping[str, Any],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        self._check_open()
        if self.layout is not None:
            raise BackendError("KV caches are already registered with this backend")
        descs = {
            name: t if isinstance(t, TensorDesc) else describe(name, t)
            for name, t in tensors.items()
        }
        want = f"cuda:{self.device}"
        for d in descs.values():
            if d.device != want:
                raise ConfigError(f"tensor {d.name!r} is on {d.device}, this backend drives {want}")
        layout = derive_layout(descs, num_blocks, groups, device=want)
        self._ctx.enter()
        self._tables = [RegionTable.from_group(g) for g in layout.groups]
        torch = self._torch
        rows = [t.as_device_rows(PIECE_BYTES) for t in self._tables]
        self._table_dev = [torch.from_numpy(r).to(f"cuda:{self.device}") for r in rows]
        self._kernel_rows = [len(r) for r in rows]
        self._staged = [self._wants_staging(t) for t in self._tables]
        self.layout = layout
        log.info(
            "cuda_kv_caches_registered",
            groups=len(layout.groups),
            regions=layout.num_regions,
            paths=["staged" if s else "direct" for s in self._staged],
        )
        return layout

    def _wants_staging(self, table: RegionTable) -> bool:
        method = self.config.method
        fits = table.block_bytes <= self.config.slot_bytes
        if method == "staged" and not fits:
            raise ConfigError(
                f"group {table.group}: a block of {table.block_bytes} bytes does not fit a "
                f"staging slot of {self.config.slot_bytes}"
            )
        if method == "staged":
            return True
        if method == "direct":
            return False
        return fits and table.min_page_bytes <= self.config.staged_max_page_bytes

    def allocate_cpu_tier(self, num_blocks: Sequence[int]) -> None:
        self._check_open()
        if self.layout is None:
            raise BackendError("register_kv_caches must come before allocate_cpu_tier")
        if self._tier is not None:
            raise BackendError("the CPU tier is already allocated")
        if len(num_blocks) != len(self._tables):
            raise ConfigError(
                f"allocate_cpu_tier: {len(num_blocks)} block counts for {len(self._tables)} groups"
            )
        self._ctx.enter()
        if any(self._staged):
            self._setup_staging()
        self._tier = PinnedTier(
            self._ctx,
            list(num_blocks),
            [t.block_bytes for t in self._tables],
            chunk_bytes=self.config.register_chunk_bytes,
        )

    def set_method(self, method: Method) -> None:
        """Re-choose every group's path, e.g. to compare paths on one pinned tier (benchmarks)."""
        self._check_open()
        if self.layout is None:
            raise BackendError("register_kv_caches must come before set_method")
        self.flush()
        self.config = evolve(self.config, method=method)
        self._staged = [self._wants_staging(t) for t in self._tables]
        if any(self._staged) and self._kernel is None and self._tier is not None:
            self._setup_staging()

    def _setup_staging(self) -> None:
        torch = self._torch
        cfg = self.config
        major = self._ctx.attribute(
            drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        )
        minor = self._ctx.attribute(
            drv.cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
        )
        self._kernel = StageKernel(f"sm_{major}{minor}", cfg.gather_ctas)
        for lane in self._lanes.values():
            buf = torch.empty(
                cfg.num_slots * cfg.slot_bytes, dtype=torch.uint8, device=f"cuda:{self.device}"
            )
            self._staging.append(buf)
            lane.ring = Ring(
                base=int(buf.data_ptr()),
                slot_bytes=cfg.slot_bytes,
                streams=[drv.lowest_priority_stream() for _ in range(cfg.num_slots)],
            )
        store_ring = self._lanes[Direction.STORE].ring
        assert store_ring is not None
        self._kernel.warm_up(store_ring.streams[0])
        # torch allocated the staging buffers on its current stream; our streams must not race it.
        torch.cuda.synchronize(self.device)
        self.flush()

    # -- fences --------------------------------------------------------------------------------

    def compute_fence(self) -> CudaFence:
        self._check_open()
        self._ctx.enter()
        event = self._plain_events.take()
        stream = self._current_stream(self.device)
        drv.record(event, drv.stream_of(stream))
        return CudaFence(event, self, pool=self._plain_events)

    def compute_wait(self, fence: Fence, timeout_s: float) -> bool:
        """The engine's current stream waits on the device for ``fence``'s copies. The host
        waits only for the launch thread to have issued them (``DeadlineError`` past
        ``timeout_s``): an event waited on before it is recorded would not hold the stream."""
        self._check_open()
        self._event_of(fence)
        assert isinstance(fence, CudaFence)
        k = self._deferred.pending_index(fence)
        self._issue_deferred(None if k is None else k + 1)  # this part, and the next behind it
        if fence.issued is not None:  # a load's part: waits for its own issue only
            if not fence.issued.wait(timeout_s):
                raise DeadlineError(
                    f"CUDA backend: a fenced load part's copies not issued after {timeout_s} s"
                )
        elif not fence.launched and fence.error is None and self._launcher is not None:
            issued = threading.Event()
            self._launcher.put(issued.set)
            if not issued.wait(timeout_s):
                raise DeadlineError(
                    f"CUDA backend: a fenced load's copies not issued after {timeout_s} s"
                )
        if not fence.launched or fence.error is not None:
            return False  # its issue failed: its transfers fail, nothing to read
        self._ctx.enter()
        stream = self._current_stream(self.device)
        drv.wait(drv.stream_of(stream), fence.event)
        return True

    def query(self, fence: Fence) -> FenceStatus:
        event = self._event_of(fence)
        assert isinstance(fence, CudaFence)
        if not fence.launched:
            if fence.error is not None:
                fence.prev_timing = None
                return FenceStatus.FAILED
            return FenceStatus.PENDING
        (err,) = drv.cu.cuEventQuery(event)
        if err == drv.cu.CUresult.CUDA_SUCCESS:
            if fence.error is not None:  # its issue failed part-way; what it issued is done
                fence.prev_timing = None
                return FenceStatus.FAILED
            if fence.timing is not None:
                fence.timing.seen_done = True
            return FenceStatus.DONE
        if err == drv.cu.CUresult.CUDA_ERROR_NOT_READY:
            return FenceStatus.PENDING
        fence.prev_timing = None
        log.error("cuda_fence_failed", error=getattr(err, "name", str(err)))
        return FenceStatus.FAILED

    def copy_seconds(self, fence: Fence) -> float | None:
        """Device seconds of a finished batch's copies (``TimesCopies``): from its start event
        (after its waits) to its end event, less the time the previous batch of its direction
        was copying too (so overlapping batches count once; batches of one direction on
        different slot streams may also run, and finish, out of order). None without
        ``time_copies``, or when the driver cannot say."""
        self._event_of(fence)
        assert isinstance(fence, CudaFence)
        timing, prev = fence.timing, fence.prev_timing
        fence.prev_timing = None
        if timing is None or not fence.launched:
            return None
        self._ctx.enter()
        return timing.seconds_beyond(prev)

    def copy_landed_ago(self, fence: Fence) -> float | None:
        """Seconds since a finished batch's copies ended on the device (``DatesCopies``): its
        end event placed on ``time.perf_counter`` (``LandingClock``). None without
        ``time_copies``, or when the driver or no clock mark can say."""
        self._event_of(fence)
        assert isinstance(fence, CudaFence)
        timing = fence.timing
        if timing is None or not fence.launched:
            return None
        self._ctx.enter()
        return self._landing.ago(timing.end)

    def clock_mark(self) -> ClockMark:
        """A mark tying the device's clock to ``time.perf_counter``, for ``last_copy_span`` (a
        benchmark's timeline) and ``copy_landed_ago``: recorded on a stream of its own."""
        self._ctx.enter()
        return ClockMark(self._timing_events, self._mark_stream)

    def last_copy_span(self, direction: Direction, mark: ClockMark) -> tuple[float, float] | None:
        """When the last issued batch of ``direction`` began and ended copying on the device
        (after its waits), on the host's clock by way of ``mark``; None without
        ``time_copies`` or before that batch finished."""
        timing = self._last_timing[direction]
        if timing is None:
            return None
        self._ctx.enter()
        start, end = mark.place(timing.start), mark.place(timing.end)
        return None if start is None or end is None else (start, end)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self._wakeup = wakeup

    def _event_of(self, fence: Fence) -> Any:
        if not isinstance(fence, CudaFence) or fence.owner is not self:
            raise BackendError(f"fence {fence!r} was not made by this CUDA backend")
        return fence.event

    # -- copies --------------------------------------------------------------------------------

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> CudaFence:
        self._issue_deferred()
        work, waits = self._work(batch, wait_for)
        self._ctx.enter()
        fence = CudaFence(self._fence_events.take(), self, launched=False, pool=self._fence_events)
        self._launch(functools.partial(self._issue, batch.direction, work, waits, fence))
        return fence

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[CudaFence, tuple[CudaFence, ...]]:
        """``submit``, the copies issued part by part (``CopiesInParts``): part ``k``'s regions
        of every block, then an event the engine's compute for those layers waits on
        (``compute_wait``), which the host may do as soon as that part is issued. Without a
        launch thread, part 0 is issued here and each later part as the engine waits for the
        one before it (``DeferredIssue``)."""
        self._issue_deferred()
        work, waits = self._work(batch, wait_for)
        if parts is not self._prepared:  # made already, unless the runtime did not ask
            self.prepare_parts(parts)
        self._ctx.enter()
        fence = CudaFence(self._fence_events.take(), self, launched=False, pool=self._fence_events)
        part_fences = tuple(
            CudaFence(self._plain_events.take(), self, launched=False, pool=self._plain_events)
            for _ in parts.spans
        )
        for part in part_fences:
            part.issued = threading.Event()
        if self._launcher is not None or not self.config.defer_parts:
            self._launch(
                functools.partial(
                    self._issue, batch.direction, work, waits, fence, parts.spans, part_fences
                )
            )
        else:
            job = self._issue_steps(
                batch.direction, work, waits, fence, parts.spans, part_fences, defer=True
            )
            self._deferred.start(job, part_fences)
        return fence, part_fences

    def _issue_deferred(self, upto: int | None = None) -> None:
        """Issue the pending load's parts through part ``upto`` (None: all that is left), on
        this thread with the device's context current."""
        if self._deferred.pending:
            self._ctx.enter()
            if upto is None:
                self._deferred.finish()
            else:
                self._deferred.through(upto)

    def prepare_parts(self, parts: LayerParts) -> None:
        """Upload the kernel's region table of each part of a staged group now (``CopiesInParts``):
        an upload in a load's submit would make the caller wait for its stream."""
        self._check_open()
        parts.check_groups(len(self._tables))
        self._ctx.enter()
        for spans in parts.spans:
            for g, (lo, hi) in enumerate(spans):
                if lo < hi and self._staged[g]:
                    self._part_rows(g, lo, hi)
        self._prepared = parts

    def _launch(self, job: Callable[[], None]) -> None:
        if self._launcher is not None:
            self._launcher.put(job)
        else:
            job()

    def _work(self, batch: CopyBatch, wait_for: Sequence[Fence]) -> tuple[list[Any], list[Any]]:
        """A batch's checked work per group, and the fences it waits for."""
        self._check_open()
        tier = self._tier
        if tier is None:
            raise BackendError("submit before allocate_cpu_tier")
        work = group_work(
            self._tables,
            [tier.num_blocks(g) for g in range(len(self._tables))],
            batch.gpu_block_ids,
            batch.cpu_block_ids,
            checked=batch.checked,
        )
        # The fences themselves travel with the job: a caller may drop a fence (and so destroy
        # its event) before the launch thread has waited on it.
        for f in wait_for:
            self._event_of(f)  # a fence from elsewhere raises here, in the caller's thread
        return work, list(wait_for)

    # -- inspection, flush, shutdown ------------------------------------------------------------

    def path(self, group: int) -> str:
        """``"staged"`` or ``"direct"``: how copies of ``group`` run."""
        return "staged" if self._staged[group] else "direct"

    @property
    def batch_memcpy_abi(self) -> int | None:
        return self._batch.abi if self._batch else None

    @property
    def cpu_tier(self) -> PinnedTier:
        if self._tier is None:
            raise BackendError("the CPU tier is not allocated")
        return self._tier

    def cpu_block(self, group: int, block: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The bytes of CPU block ``block`` of ``group`` (a view into the pinned tier)."""
        row: np.ndarray[Any, np.dtype[np.uint8]] = self.cpu_tier.array(group)[block]
        return row

    def wait_launched(self) -> None:
        """Block until every submitted batch has been handed to the driver (its fence recorded)."""
        self._issue_deferred()
        if self._launcher is not None:
            self._launcher.drain()

    def flush(self) -> None:
        """Block until everything submitted so far has finished (preemption, shutdown)."""
        self.wait_launched()
        self._ctx.enter()
        for stream in self._streams():
            drv.check(drv.cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def _streams(self) -> list[Any]:
        """Every stream this backend made."""
        out = []
        for lane in self._lanes.values():
            out.append(lane.dma)
            if lane.ring is not None:
                out.extend(lane.ring.streams)
        return out

    def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):  # closing whatever the driver says
            self._issue_deferred()
        self._deferred.close()
        self.flush()
        self._closed = True
        if self._launcher is not None:
            self._launcher.close()
        for waiter in self._waiters.values():
            waiter.close()
        if self._tier is not None:
            self._tier.close()
        if self._kernel is not None:
            self._kernel.unload()
        for stream in self._streams():
            drv.cu.cuStreamDestroy(stream)
        drv.cu.cuEventDestroy(self._join)
        drv.cu.cuEventDestroy(self._dma_done)
        self._staging.clear()
        self._table_dev.clear()
        self._part_tables.clear()
        self._prepared = None
        self._last_timing = dict.fromkeys(Direction)  # its events go now, not at exit
        self._landing.mark = None
        drv.cu.cuStreamDestroy(self._mark_stream)
        for pool in (self._fence_events, self._timing_events, self._plain_events):
            pool.close()
        log.info("cuda_backend_closed", device=self.device)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the CUDA backend is closed")


__all__ = ["CudaBackend", "CudaConfig", "CudaFence", "IssueStats"]
