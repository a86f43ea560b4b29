"""The GPU side of PD's CUDA IPC transport (``CudaIpcDevice``): torch's CUDA IPC for the KV
tensors and the two interprocess events, a copy stream, and ``cuda_copy``'s batched DMA /
page-copy kernel through kvflow's CUDA driver helpers.

What a hand-off does on its critical path goes through the driver on raw handles
(``driver.RawCalls``): event records, stream waits, event queries and the kernel launch. The
interprocess events stay torch's (their IPC handles are torch's format), called through their
raw handle; the events of one side alone come from a pool, created once and handed back by the
transport when it no longer needs them. The kernel carries a hand-off's block ids in its
parameters (``cuda_copy.plan_launches``), so the usual launch writes no pinned buffer and
uploads nothing; only a hand-off too large for its parameter blocks uploads its ids.

Importing this module needs no GPU; ``CudaIpcDevice`` raises ``BackendError`` without one.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from kvflow.backends.pd.cuda_copy import VALUE_LAUNCHES
from kvflow.backends.pd.rendezvous import SideLayout
from kvflow.core.logs import get_logger
from kvflow.errors import BackendError, ConfigError, LayoutError

log = get_logger("kvflow.backend.pd.cuda_ipc")

_MAX_ID = (1 << 31) - 1  # the kernel reads block ids as int32


class DeviceEvent:
    """A CUDA event as the transport holds it: its raw handle, the torch event that owns it
    (interprocess events; None for a pooled one) and its IPC handle (b"" if none)."""

    __slots__ = ("handle", "keep", "raw")

    def __init__(self, raw: int, keep: Any = None, handle: bytes = b"") -> None:
        if not raw:
            raise BackendError("cuda-ipc transport: an event without a CUDA handle")
        self.raw = raw
        self.keep = keep
        self.handle = handle


class CudaIpcDevice:
    """The GPU side of the transport: torch's CUDA IPC for tensors and events, a copy stream,
    and ``cuda_copy``'s batched DMA / page-copy kernel through kvflow's CUDA driver helpers.
    ``value_launches``: at most this many by-value launches a group before its ids are
    uploaded instead (0: always upload)."""

    def __init__(
        self,
        device: int = 0,
        *,
        method: str = "auto",
        kernel_max_page_bytes: int = 512 << 10,
        kernel_ctas: int | None = None,
        value_launches: int = VALUE_LAUNCHES,
    ) -> None:
        from kvflow.backends.cuda import driver as drv
        from kvflow.backends.pd.cuda_copy import METHODS

        if method not in METHODS:
            raise ConfigError(f"cuda-ipc copy method must be one of {METHODS}, not {method!r}")
        if value_launches < 0:
            raise ConfigError(f"value_launches must be >= 0, got {value_launches}")
        if not torch.cuda.is_available():
            raise BackendError("cuda-ipc transport: torch sees no CUDA device")
        self._drv = drv
        self.device = device
        self.method = method
        self.kernel_max_page_bytes = kernel_max_page_bytes
        self.kernel_ctas = kernel_ctas
        self.value_launches = value_launches
        torch.cuda.init()  # type: ignore[no-untyped-call]
        self._ctx = drv.Context(device)
        self._raw = drv.raw_calls()
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._copy_stream = int(self._stream.cuda_stream)
        self._cu_stream = drv.stream_of(self._copy_stream)
        self._current_raw: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._free: list[DeviceEvent] = []
        self._made: list[Any] = []  # every pooled event, destroyed at a synchronized close
        self._batch: Any = None
        self._attrs: Any = None
        self._kernel: Any = None
        self._tables: list[Any] = []
        self._paths: list[str] = []
        self._table_dev: list[torch.Tensor] = []
        self._table_ptr: list[int] = []
        self._chunks: list[int] = []
        self._ids_dev: torch.Tensor | None = None
        self._ids_pinned: torch.Tensor | None = None
        self._ids_host: Any = None
        self._ids_uploaded: Any = None

    def check(self, layout: SideLayout) -> None:
        for g, regions in enumerate(layout.groups):
            for i, r in enumerate(regions):
                if r.device != self.device:
                    raise LayoutError(
                        f"cuda-ipc transport: group {g} tensor {i} is not on cuda:{self.device}"
                    )

    def export(self, t: torch.Tensor) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(t))  # type: ignore[no-untyped-call]

    def open(self, data: bytes) -> torch.Tensor:
        rebuild, args = pickle.loads(data)
        t: torch.Tensor = rebuild(*args)
        return t

    # -- events -------------------------------------------------------------------------------

    def new_event(self, *, interprocess: bool) -> DeviceEvent:
        if interprocess:
            event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            # torch creates an event at its first use: asking for the IPC handle creates it.
            handle: bytes = event.ipc_handle()  # type: ignore[no-untyped-call]
            return DeviceEvent(int(event.cuda_event), event, handle)
        if self._free:
            return self._free.pop()
        self._ctx.enter()
        made = self._drv.new_event()
        self._made.append(made)
        return DeviceEvent(int(made))

    def free_event(self, event: DeviceEvent) -> None:
        """Hand a pooled event back: the transport waits on it no more and queries it no more
        (its last record completed, or a stream wait already captured it)."""
        if event.keep is None:
            self._free.append(event)

    def event_handle(self, event: DeviceEvent) -> bytes:
        return event.handle

    def open_event(self, data: bytes) -> DeviceEvent:
        event = torch.cuda.Event.from_ipc_handle(self.device, data)  # type: ignore[no-untyped-call]
        return DeviceEvent(int(event.cuda_event), event, data)

    def _current(self) -> int:
        if self._current_raw is not None:
            return int(self._current_raw(self.device))
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def record(self, event: DeviceEvent, *, on_copy_stream: bool) -> None:
        self._raw.record(event.raw, self._copy_stream if on_copy_stream else self._current())

    def wait(self, event: DeviceEvent) -> None:
        self._raw.wait(self._copy_stream, event.raw)

    def query(self, event: DeviceEvent) -> bool:
        return self._raw.query(event.raw)

    # -- copies -------------------------------------------------------------------------------

    def prepare(self, src: SideLayout, dst: SideLayout) -> list[str]:
        from kvflow.backends.pd.cuda_copy import (
            PairCopyKernel,
            PairTable,
            choose_method,
            chunks_of,
            value_capacities,
        )

        drv = self._drv
        self._ctx.enter()
        for side in (src, dst):
            for g in range(len(side.groups)):
                if side.num_blocks(g) > _MAX_ID + 1:
                    raise LayoutError(
                        f"cuda-ipc transport: group {g} has {side.num_blocks(g)} blocks, more "
                        "than the copy's int32 block ids name"
                    )
        self._tables = [
            PairTable.of(s, d, group=g)
            for g, (s, d) in enumerate(zip(src.groups, dst.groups, strict=True))
        ]
        self._paths = [
            choose_method(self.method, t, self.kernel_max_page_bytes)  # type: ignore[arg-type]
            for t in self._tables
        ]
        if "dma" in self._paths:
            try:
                self._batch = drv.BatchMemcpy.resolve(self._ctx.driver_version)
            except BackendError as e:
                log.warning("pd_cuda_ipc_batch_memcpy_unavailable", reason=str(e))
            self._attrs = drv.CopyAttributes(store=False, device=self.device, device_to_device=True)
        if "kernel" in self._paths:
            attr = drv.cu.CUdevice_attribute
            major = self._ctx.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            minor = self._ctx.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            sms = self._ctx.attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            # Enough resident warps on every SM to keep the loads of many pages in flight.
            ctas = self.kernel_ctas if self.kernel_ctas is not None else 8 * int(sms)
            self._kernel = PairCopyKernel(
                f"sm_{major}{minor}",
                ctas,
                capacities=value_capacities(self._ctx.driver_version, major),
                max_launches=self.value_launches,
            )
            self._table_dev = [
                torch.from_numpy(t.rows()).to(f"cuda:{self.device}") for t in self._tables
            ]
            self._table_ptr = [int(t.data_ptr()) for t in self._table_dev]
            self._chunks = [chunks_of(t) for t in self._tables]
            self._kernel.warm_up(self._copy_stream)
            torch.cuda.synchronize(self.device)
        return list(self._paths)

    def copy(self, group: int, src_ids: Any, dst_ids: Any) -> int:
        """Queue the copy of one group's pairs on the copy stream; returns the launches (kernel)
        or the copies (DMA) issued."""
        from kvflow.backends.pd.cuda_copy import d2d_descriptors

        self._ctx.enter()
        table = self._tables[group]
        if self._paths[group] == "kernel":
            kernel = self._kernel
            n = len(src_ids)
            regions, nreg, chunks = self._table_ptr[group], table.num_regions, self._chunks[group]
            launches = 0
            for start, stop, capacity in kernel.plan(n):
                if capacity == 0:
                    ids = self._upload_ids(src_ids, dst_ids)
                    launches += kernel.copy(self._copy_stream, regions, nreg, chunks, n, ids)
                else:
                    launches += kernel.copy_by_value(
                        self._copy_stream,
                        regions,
                        nreg,
                        chunks,
                        src_ids[start:stop],
                        dst_ids[start:stop],
                        capacity,
                    )
            return launches
        desc = d2d_descriptors(table, src_ids, dst_ids)
        if self._batch is not None:
            self._batch(desc, self._attrs, self._cu_stream)
        else:
            self._drv.memcpy_each(desc, self._cu_stream)
        return len(desc)

    def _upload_ids(self, src_ids: Any, dst_ids: Any) -> int:
        """The pairs as one device int32 array (sources, then destinations), copied on the copy
        stream ahead of the launch that reads it; returns its address."""
        drv = self._drv
        n = len(src_ids)
        if self._ids_host is None or len(self._ids_host) < 2 * n:
            size = 1 << max(12, (2 * n - 1).bit_length())
            # Allocated on the copy stream, so that freeing the old one cannot hand its memory
            # to another stream under a queued kernel.
            with torch.cuda.stream(self._stream):
                self._ids_dev = torch.empty(size, dtype=torch.int32, device=self.device)
            self._ids_pinned = torch.empty(size, dtype=torch.int32, pin_memory=True)
            self._ids_host = self._ids_pinned.numpy()
            if self._ids_uploaded is None:
                self._ids_uploaded = drv.new_event()
        else:
            # The pinned buffer is rewritten only after its last upload ran (long since, as a
            # rule: the upload is the first thing of the previous copy).
            drv.event_synchronize(self._ids_uploaded)
        assert self._ids_dev is not None
        host = self._ids_host
        host[:n] = src_ids
        host[n : 2 * n] = dst_ids
        dev_ptr = int(self._ids_dev.data_ptr())
        drv.check(
            drv.cu.cuMemcpyHtoDAsync(dev_ptr, host.ctypes.data, 8 * n, self._cu_stream),
            "cuMemcpyHtoDAsync(pair ids)",
        )
        drv.record(self._ids_uploaded, self._cu_stream)
        return dev_ptr

    def close(self, *, synchronize: bool) -> None:
        if synchronize:
            self._stream.synchronize()
        if self._kernel is not None and synchronize:
            self._kernel.unload()
            self._kernel = None
        if synchronize:
            self._table_dev, self._table_ptr = [], []
            if self._ids_uploaded is not None:
                self._drv.cu.cuEventDestroy(self._ids_uploaded)
                self._ids_uploaded = None
            self._ids_dev = self._ids_pinned = self._ids_host = None
            for made in self._made:
                self._drv.cu.cuEventDestroy(made)
            self._made, self._free = [], []
        # Unsynchronized (a copy may never finish), the region tables, id buffers and pooled
        # events stay: freed, their memory could be handed out again under a kernel or an
        # upload still queued, and an event may still be recorded by the stuck stream.
        # Mapped peer memory is unmapped when the rebuilt tensors go; let torch drop its cache.
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


__all__ = ["CudaIpcDevice", "DeviceEvent"]
