"""The host backend: real copies between CPU torch tensors on one copy thread; the embedded default.

The "GPU tier" is the engine's KV tensors (CPU tensors here), registered through ``core.layout``;
the CPU tier is one block-major uint8 tensor per KV cache group, ``block_bytes`` per block, each
region's page at its ``cpu_offsets`` slot, so a whole block is one contiguous piece. Submitted
batches run in order on the copy thread (torch releases the GIL while copying); each finished
fence calls the reactor's wakeup, so completion is seen at once instead of at the next poll.
Compute on the host is synchronous in the engine's thread, so ``compute_fence`` is already done.
The copy thread times each batch's copies (``copy_seconds``, the ``TimesCopies`` protocol) and
notes when they ended (``copy_landed_ago``, ``DatesCopies``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from attrs import define, field

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.torch_layout import layout_of, region_view
from kvflow.core.layout import KVLayout, LayerParts
from kvflow.core.logs import get_logger
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError, DeadlineError, LayoutError

log = get_logger("kvflow.backend.host")


@define(eq=False, slots=True)
class HostFence:
    """Set by the copy thread when its batch has run (or, for compute, born done)."""

    fence_id: int
    status: FenceStatus = FenceStatus.PENDING
    finished: threading.Event = field(factory=threading.Event)
    error: str | None = None
    copy_s: float | None = None  # the copy thread's own timing of the batch's copies
    ended: float | None = None  # time.perf_counter when they ended


@define(eq=False, slots=True)
class _RegionCopy:
    view: torch.Tensor  # (num_blocks, page_bytes) uint8 view of the engine's tensor
    cpu_offset: int
    page_bytes: int


_Job = tuple[CopyBatch, tuple[HostFence, ...], HostFence, LayerParts | None, tuple[HostFence, ...]]


@define(eq=False)
class HostBackend:
    """``Backend`` over CPU torch tensors; copies run on a daemon thread in submission order."""

    name: str = "host"
    layout: KVLayout | None = None
    _tensors: dict[str, torch.Tensor] = field(factory=dict)
    _regions: list[list[_RegionCopy]] = field(factory=list)
    _cpu: list[torch.Tensor] = field(factory=list)
    _jobs: queue.SimpleQueue[_Job | None] = field(factory=queue.SimpleQueue)
    _thread: threading.Thread | None = None
    _ids: itertools.count[int] = field(factory=lambda: itertools.count(1))
    _wakeup: Callable[[], None] | None = None
    _closed: bool = False

    # -- Backend protocol -------------------------------------------------------------------
    def register_kv_caches(
        self,
        tensors: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        self._check_open()
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                raise LayoutError(f"tensor {name!r} is on {t.device}; the host backend needs CPU")
        layout = layout_of(tensors, num_blocks, groups)
        by_name = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
        self._regions = [
            [
                _RegionCopy(region_view(by_name[r.tensor], r), off, r.page_bytes)
                for r, off in zip(g.regions, g.cpu_offsets, strict=True)
            ]
            for g in layout.groups
        ]
        self._tensors = by_name
        self.layout = layout
        log.info(
            "kv_caches_registered",
            backend=self.name,
            tensors=len(tensors),
            aliases=len(layout.aliases),
            regions=layout.num_regions,
            groups=len(layout.groups),
        )
        return layout

    def allocate_cpu_tier(self, num_blocks: Sequence[int]) -> None:
        self._check_open()
        if self.layout is None:
            raise BackendError("allocate_cpu_tier before register_kv_caches")
        if len(num_blocks) != len(self.layout.groups):
            raise ConfigError(
                f"CPU tier sizes for {len(num_blocks)} groups, layout has {len(self.layout.groups)}"
            )
        if any(n <= 0 for n in num_blocks):
            raise ConfigError(f"CPU tier needs a positive block count per group, got {num_blocks}")
        self._cpu = [
            torch.zeros((n, g.block_bytes), dtype=torch.uint8)
            for n, g in zip(num_blocks, self.layout.groups, strict=True)
        ]
        log.info(
            "cpu_tier_allocated",
            backend=self.name,
            blocks=list(num_blocks),
            bytes=sum(t.numel() for t in self._cpu),
        )

    def compute_fence(self) -> HostFence:
        fence = HostFence(next(self._ids), FenceStatus.DONE)
        fence.finished.set()
        return fence

    def compute_wait(self, fence: Fence, timeout_s: float) -> bool:
        """The engine computes on the host: block until ``fence``'s copies have run."""
        self._check_open()
        own = self._own(fence)
        if not own.finished.wait(timeout_s):
            raise DeadlineError(
                f"host backend: a fenced load's copies not done after {timeout_s} s"
            )
        return own.status is FenceStatus.DONE

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        return self._queue(batch, wait_for, None)[0]

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[HostFence, tuple[HostFence, ...]]:
        """``submit``, the copy thread landing ``parts`` one after another (``CopiesInParts``):
        a part's fence is set as soon as its regions are copied."""
        self.prepare_parts(parts)
        return self._queue(batch, wait_for, parts)

    def prepare_parts(self, parts: LayerParts) -> None:
        """Nothing to make ahead on the host (``CopiesInParts``); ``parts`` is checked."""
        parts.check_groups(len(self._regions))

    def _queue(
        self, batch: CopyBatch, wait_for: Sequence[Fence], parts: LayerParts | None
    ) -> tuple[HostFence, tuple[HostFence, ...]]:
        self._check_open()
        if not self._cpu:
            raise BackendError("submit before allocate_cpu_tier")
        deps = tuple(self._own(f) for f in wait_for)
        fence = HostFence(next(self._ids))
        part_fences = (
            () if parts is None else tuple(HostFence(next(self._ids)) for _ in parts.spans)
        )
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._copy_loop, name="kvflow-host-copy", daemon=True
            )
            self._thread.start()
        self._jobs.put((batch, deps, fence, parts, part_fences))
        return fence, part_fences

    def query(self, fence: Fence) -> FenceStatus:
        return self._own(fence).status

    def copy_seconds(self, fence: Fence) -> float | None:
        """How long the copy thread took for this batch's copies (after its dependencies);
        batches on the one thread never overlap. None until it has run."""
        return self._own(fence).copy_s

    def copy_landed_ago(self, fence: Fence) -> float | None:
        """Seconds since the copy thread finished this batch's copies (``DatesCopies``)."""
        ended = self._own(fence).ended
        return None if ended is None else max(0.0, time.perf_counter() - ended)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        self._wakeup = wakeup

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._cpu, self._regions, self._tensors = [], [], {}
        log.info("backend_closed", backend=self.name)

    # -- helpers for tests and tools ----------------------------------------------------------
    def cpu_tier(self, group: int = 0) -> torch.Tensor:
        """The block-major CPU tier of ``group``: ``(num_blocks, block_bytes)`` uint8."""
        if not 0 <= group < len(self._cpu):
            raise ConfigError(f"no CPU tier for group {group}")
        return self._cpu[group]

    # -- the copy thread ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("host backend is closed")

    @staticmethod
    def _own(fence: Fence) -> HostFence:
        if not isinstance(fence, HostFence):
            raise BackendError(f"not a fence of the host backend: {fence!r}")
        return fence

    def _copy_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            batch, deps, fence, parts, part_fences = job
            for dep in deps:
                dep.finished.wait()
            began = time.perf_counter()
            landed = 0  # parts whose fences are set
            try:
                if parts is None:
                    self._copy(batch)
                else:
                    for spans, part in zip(parts.spans, part_fences, strict=True):
                        self._copy(batch, spans)
                        _settle(part, FenceStatus.DONE)
                        landed += 1
                fence.ended = time.perf_counter()
                fence.copy_s = fence.ended - began
            except Exception as exc:  # any copy error fails the batch, never the thread
                fence.error = f"{type(exc).__name__}: {exc}"
                fence.status = FenceStatus.FAILED
                for part in part_fences[landed:]:
                    _settle(part, FenceStatus.FAILED)
                log.warning("host_copy_failed", fence_id=fence.fence_id, error=fence.error)
            else:
                fence.status = FenceStatus.DONE
            fence.finished.set()
            wakeup = self._wakeup
            if wakeup is not None:
                wakeup()

    def _copy(self, batch: CopyBatch, spans: Sequence[tuple[int, int]] | None = None) -> None:
        """Copy ``batch``: every region of each group, or with ``spans`` regions
        ``spans[g][0] .. spans[g][1] - 1`` of group ``g``."""
        if len(batch.gpu_block_ids) > len(self._regions):
            raise BackendError(f"batch names {len(batch.gpu_block_ids)} groups")
        for g, (gpu_ids, cpu_ids) in enumerate(
            zip(batch.gpu_block_ids, batch.cpu_block_ids, strict=True)
        ):
            if not gpu_ids:
                continue
            cpu = self._cpu[g]
            regions = self._regions[g]
            n_gpu = regions[0].view.shape[0]
            if spans is not None:
                regions = regions[spans[g][0] : spans[g][1]]
                if not regions:
                    continue
            if min(gpu_ids) < 0 or max(gpu_ids) >= n_gpu:
                raise BackendError(f"group {g}: GPU block id out of range 0..{n_gpu - 1}")
            if min(cpu_ids) < 0 or max(cpu_ids) >= cpu.shape[0]:
                raise BackendError(f"group {g}: CPU block id out of range 0..{cpu.shape[0] - 1}")
            gi = torch.tensor(gpu_ids, dtype=torch.long)
            ci = torch.tensor(cpu_ids, dtype=torch.long)
            # In 8-byte words where every page allows it: torch's indexed copies go element by
            # element, so bytes as uint8 cost eight times the work.
            wide = all(_fits_words(rc.view) for rc in regions) and _fits_words(cpu)
            tier = _words(cpu) if wide else cpu
            unit = 8 if wide else 1
            # index_select / index_copy_, not ``t[ids]``: torch's indexing operators hold the
            # GIL for the whole copy, which would stall the engine's thread.
            if batch.direction is Direction.STORE:
                # Region by region into the block-major rows: page r of block b at its offset.
                for rc in regions:
                    lo, hi = rc.cpu_offset // unit, (rc.cpu_offset + rc.page_bytes) // unit
                    pages = (_words(rc.view) if wide else rc.view).index_select(0, gi)
                    tier[:, lo:hi].index_copy_(0, ci, pages)
            else:
                rows = tier.index_select(0, ci)
                for rc in regions:
                    lo, hi = rc.cpu_offset // unit, (rc.cpu_offset + rc.page_bytes) // unit
                    (_words(rc.view) if wide else rc.view).index_copy_(0, gi, rows[:, lo:hi])


def _settle(fence: HostFence, status: FenceStatus) -> None:
    fence.status = status
    fence.finished.set()


def _fits_words(t: torch.Tensor) -> bool:
    """Whether a ``(blocks, bytes)`` uint8 view can be read as 8-byte words in place."""
    return (
        t.shape[-1] % 8 == 0
        and t.stride(-1) == 1
        and t.stride(0) % 8 == 0
        and (t.storage_offset() % 8 == 0)
        and t.untyped_storage().data_ptr() % 8 == 0
    )


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


__all__ = ["HostBackend", "HostFence"]
