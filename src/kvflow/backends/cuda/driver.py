"""Thin helpers over cuda-python's driver bindings: error checks, context, streams, events, and
the raw ``cuMemcpyBatchAsync`` call (2D copies: ``pitched_copy``).

cuda-python's own ``cuMemcpyBatchAsync`` wrapper takes Python lists of pointer objects, far too
slow for tens of thousands of descriptors per step. So the function pointer is resolved through
``cuGetProcAddress`` for a chosen ABI and called with raw numpy arrays through a ctypes
``CFUNCTYPE``. ``cuEventSynchronize`` goes through ctypes too, because a ctypes call always
releases the GIL for its whole wait. Every other driver call goes through cuda-python, except
the few a PD hand-off makes on its critical path (``RawCalls``: event record and query, stream
wait, kernel launch), which take raw handles through ctypes as well: cuda-python builds Python
objects for each call's arguments and result. The CUDA backend's issue path keeps cuda-python:
per call, ctypes was no cheaper on the H200 (``scripts/bench_driver_calls.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any

import numpy as np

from kvflow.backends.cuda.plan import CopyList, Descriptors
from kvflow.backends.probe import BATCH_MEMCPY_ABIS, resolve_batch_memcpy
from kvflow.errors import BackendError

try:
    from cuda.bindings import driver as cu
except Exception:  # pragma: no cover - cuda-python is a dependency, but stay importable
    cu = None


def check(result: Any, what: str) -> Any:
    """cuda-python returns ``(err, *values)``; raise ``BackendError`` naming ``what`` on error."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise BackendError(f"{what} failed: {name} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def require_driver() -> Any:
    """The driver module after ``cuInit``; ``BackendError`` when there is no usable CUDA."""
    if cu is None:
        raise BackendError("cuda-python is not importable")
    try:
        check(cu.cuInit(0), "cuInit")
    except BackendError:
        raise
    except Exception as exc:  # a missing libcuda.so.1 raises RuntimeError from the bindings
        raise BackendError(f"no CUDA driver: {exc}") from exc
    return cu


class Context:
    """The device's primary context (the one torch uses), made current on each calling thread."""

    def __init__(self, device: int) -> None:
        drv = require_driver()
        count = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
        if not 0 <= device < count:
            raise BackendError(f"CUDA device {device} does not exist ({count} visible)")
        self.device = device
        self.cu_device = check(drv.cuDeviceGet(device), "cuDeviceGet")
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        self.driver_version = int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
        self._local = threading.local()
        self._released = False
        self.enter()

    def enter(self) -> None:
        """Make the context current on this thread (once per thread)."""
        if getattr(self._local, "ctx", None) is not self.ctx:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            self._local.ctx = self.ctx

    def attribute(self, attr: Any) -> int:
        return int(check(cu.cuDeviceGetAttribute(attr, self.cu_device), "cuDeviceGetAttribute"))

    def release(self) -> None:
        if not self._released:
            self._released = True
            check(cu.cuDevicePrimaryCtxRelease(self.cu_device), "cuDevicePrimaryCtxRelease")


def lowest_priority_stream() -> Any:
    """A non-blocking stream at the context's lowest priority (it never waits on stream 0)."""
    least, _greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return check(
        cu.cuStreamCreateWithPriority(cu.CUstream_flags.CU_STREAM_NON_BLOCKING, least),
        "cuStreamCreateWithPriority",
    )


def new_event(*, blocking: bool = False, timing: bool = False) -> Any:
    """An event, without timing unless ``timing``; ``blocking`` makes a host wait on it sleep
    instead of spin."""
    flags = 0 if timing else int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if blocking:
        flags |= int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
    return check(cu.cuEventCreate(flags), "cuEventCreate")


class EventPool:
    """Events of one kind (``new_event``'s flags), reused across batches.

    Every batch of the CUDA backend needs a fence event and two timing events; creating and
    destroying them is four to six driver calls a batch on the issuing thread. An event is given
    back only once nothing refers to it any more (its fence or timing object was collected), so
    re-recording it cannot change what anyone waits for: a stream that waited on it captured the
    record it waited for at ``cuStreamWaitEvent`` time. ``give`` may come from any thread (it
    runs in ``__del__``); after ``close`` a given-back event is destroyed instead.
    """

    __slots__ = ("_blocking", "_closed", "_free", "_lock", "_timing")

    def __init__(self, *, blocking: bool = False, timing: bool = False) -> None:
        self._blocking = blocking
        self._timing = timing
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> Any:
        """An event of this pool's kind: a given-back one, else a new one."""
        with self._lock:
            if self._free:
                return self._free.pop()
        return new_event(blocking=self._blocking, timing=self._timing)

    def give(self, event: Any) -> None:
        """Take ``event`` back for reuse (nothing may refer to it any more)."""
        with self._lock:
            if not self._closed:
                self._free.append(event)
                return
        cu.cuEventDestroy(event)

    def close(self) -> None:
        """Destroy the pooled events; those given back later are destroyed then."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for event in free:
            cu.cuEventDestroy(event)

    def __len__(self) -> int:
        return len(self._free)


def elapsed_s(start: Any, end: Any) -> float | None:
    """Seconds from ``start`` to ``end`` (timing events, both completed; negative when ``end``
    came first on the device), or None when the driver cannot say (not completed, no timing)."""
    err, ms = cu.cuEventElapsedTime(start, end)
    if int(err) != 0:
        return None
    return float(ms) * 1e-3


_event_sync: Any = None
_event_sync_lock = threading.Lock()


def event_synchronize(event: Any) -> int:
    """Block until ``event`` completes, with the GIL released; returns the CUresult as an int."""
    global _event_sync
    if _event_sync is None:
        with _event_sync_lock:
            if _event_sync is None:
                fn = ctypes.CDLL("libcuda.so.1").cuEventSynchronize
                fn.argtypes = [ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _event_sync = fn
    result: int = _event_sync(int(event))
    return result


NOT_READY = 600
"""``CUDA_ERROR_NOT_READY`` (a constant: this module imports without cuda-python)."""


def event_query(event: Any) -> int:
    """Whether ``event`` completed, without waiting: 0, ``NOT_READY``, or another CUresult."""
    (err,) = cu.cuEventQuery(event)
    return int(err)


def record(event: Any, stream: Any) -> None:
    (err,) = cu.cuEventRecord(event, stream)
    if err:
        check((err,), "cuEventRecord")


def wait(stream: Any, event: Any) -> None:
    (err,) = cu.cuStreamWaitEvent(stream, event, 0)
    if err:
        check((err,), "cuStreamWaitEvent")


_NOT_READY = 600  # CUDA_ERROR_NOT_READY


def failed(what: str, err: int) -> BackendError:
    name = str(err)
    if cu is not None:
        with contextlib.suppress(ValueError):
            name = cu.CUresult(err).name
    return BackendError(f"{what} failed: {name} ({err})")


class RawCalls:
    """``cuEventRecord``, ``cuStreamWaitEvent``, ``cuEventQuery`` and ``cuLaunchKernel`` on raw
    handles (ints: ``int(CUevent)``, ``torch.cuda.Stream.cuda_stream``), through ctypes; a
    failure is a ``BackendError`` naming the call. Get the one instance from ``raw_calls``."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, ui, res = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int

        def fn(name: str, *args: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(args)
            f.restype = res
            return f

        self._record = fn("cuEventRecord", vp, vp)
        self._wait = fn("cuStreamWaitEvent", vp, vp, ui)
        self._query = fn("cuEventQuery", vp)
        self._launch = fn("cuLaunchKernel", vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp)

    def record(self, event: int, stream: int) -> None:
        err = self._record(event, stream)
        if err:
            raise failed("cuEventRecord", err)

    def wait(self, stream: int, event: int) -> None:
        """``stream`` waits for the most recent record of ``event`` (once this returns, the
        event may be recorded again without changing what the stream waits for)."""
        err = self._wait(stream, event, 0)
        if err:
            raise failed("cuStreamWaitEvent", err)

    def query(self, event: int) -> bool:
        """Has ``event``'s most recent record completed (True for one never recorded)?"""
        err = self._query(event)
        if err == 0:
            return True
        if err == _NOT_READY:
            return False
        raise failed("cuEventQuery", err)

    def launch(self, function: int, grid: int, block: int, stream: int, params: int) -> None:
        """Launch ``function`` on a 1-D grid; ``params`` is the address of its array of
        parameter pointers (the driver copies the parameters before this returns)."""
        err = self._launch(function, grid, 1, 1, block, 1, 1, 0, stream, params, None)
        if err:
            raise failed("cuLaunchKernel", err)


_raw_calls: RawCalls | None = None


def raw_calls() -> RawCalls:
    """The process's ``RawCalls`` (libcuda opened on first use)."""
    global _raw_calls
    if _raw_calls is None:
        with _event_sync_lock:
            if _raw_calls is None:
                _raw_calls = RawCalls()
    return _raw_calls


def stream_of(handle: int) -> Any:
    """A cuda-python stream object for a raw handle (e.g. ``torch.cuda.Stream.cuda_stream``)."""
    return cu.CUstream(handle)


_PTR = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_ARGTYPES = {
    # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
    13000: (_PTR, _PTR, _PTR, _SIZE, _PTR, _PTR, _SIZE, _PTR),
    # CUDA 12.8: the same with a failIdx out-parameter before the stream
    12080: (_PTR, _PTR, _PTR, _SIZE, _PTR, _PTR, _SIZE, _PTR, _PTR),
}


def choose_abi(driver_version: int) -> tuple[int, ...]:
    """ABIs to try for this driver, preferred first: a 13.x driver gets the 13.0 ABI."""
    return tuple(abi for abi in BATCH_MEMCPY_ABIS if abi <= driver_version)


class CopyAttributes:
    """One ``CUmemcpyAttributes`` for a whole batch, built with cuda-python's struct.

    Stores (GPU → CPU) use source access order STREAM: the copy may read the GPU page only once
    the stream reaches it, after the compute that wrote it (ANY raced with compute, vllm#45704).
    Loads read the CPU tier, which nothing else writes while they are in flight: ANY.
    """

    def __init__(self, *, store: bool, device: int, device_to_device: bool = False) -> None:
        order = cu.CUmemcpySrcAccessOrder
        loc = cu.CUmemLocationType
        self.attrs = cu.CUmemcpyAttributes()
        # Device-to-device copies (PD's CUDA IPC) read pages another process's compute wrote:
        # STREAM, after the interprocess event the copy stream waits on.
        self.attrs.srcAccessOrder = (
            order.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            if store or device_to_device
            else order.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        )
        gpu_hint, cpu_hint = (
            (self.attrs.srcLocHint, self.attrs.dstLocHint)
            if store
            else (self.attrs.dstLocHint, self.attrs.srcLocHint)
        )
        gpu_hint.type = loc.CU_MEM_LOCATION_TYPE_DEVICE
        gpu_hint.id = device
        cpu_hint.type = (
            loc.CU_MEM_LOCATION_TYPE_DEVICE if device_to_device else loc.CU_MEM_LOCATION_TYPE_HOST
        )
        cpu_hint.id = device if device_to_device else 0
        self.attrs.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self.ptr = int(self.attrs.getPtr())
        self._idx = np.zeros(1, dtype=np.uint64)
        self.idx_ptr = int(self._idx.ctypes.data)


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` resolved for one ABI, called on raw pointer arrays."""

    def __init__(self, abi: int, address: int) -> None:
        if abi not in _ARGTYPES:
            raise BackendError(f"unknown cuMemcpyBatchAsync ABI {abi}")
        self.abi = abi
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, *_ARGTYPES[abi])(address)
        self._fail_idx = ctypes.c_size_t(0)
        self._fail_ptr = ctypes.addressof(self._fail_idx)

    @classmethod
    def resolve(cls, driver_version: int) -> BatchMemcpy:
        """Resolve the function for this driver; ``BackendError`` on drivers older than 12.8."""
        abis = choose_abi(driver_version)
        if not abis:
            raise BackendError(
                f"cuMemcpyBatchAsync needs a CUDA 12.8+ driver; this one is "
                f"{driver_version // 1000}.{driver_version % 1000 // 10}"
            )
        found, address = resolve_batch_memcpy(cu, abis)
        if found is not None and address is not None:
            return cls(found, address)
        raise BackendError(
            f"cuGetProcAddress found no cuMemcpyBatchAsync for ABIs {abis} "
            f"(driver {driver_version})"
        )

    def __call__(self, desc: Descriptors, attrs: CopyAttributes, stream: Any) -> None:
        self.raw(
            desc.dst.ctypes.data,
            desc.src.ctypes.data,
            desc.size.ctypes.data,
            len(desc),
            attrs,
            stream,
        )

    def raw(
        self, dst: int, src: int, size: int, count: int, attrs: CopyAttributes, stream: Any
    ) -> None:
        """Copy ``count`` descriptors from raw uint64 arrays at ``dst``/``src``/``size``."""
        if count == 0:
            return
        if self.abi == 12080:
            err = self._fn(
                dst, src, size, count, attrs.ptr, attrs.idx_ptr, 1, self._fail_ptr, int(stream)
            )
        else:
            err = self._fn(dst, src, size, count, attrs.ptr, attrs.idx_ptr, 1, int(stream))
        if err != 0:
            where = f" at descriptor {self._fail_idx.value}" if self.abi == 12080 else ""
            raise BackendError(
                f"cuMemcpyBatchAsync failed with CUresult {err}{where} ({count} copies)"
            )


def memcpy_each(desc: Descriptors | CopyList, stream: Any) -> None:
    """The fallback without ``cuMemcpyBatchAsync``: one ``cuMemcpyAsync`` per descriptor."""
    for d, s, n in zip(*desc.lists(), strict=True):
        check(cu.cuMemcpyAsync(d, s, n, stream), "cuMemcpyAsync")


__all__ = [
    "NOT_READY",
    "BatchMemcpy",
    "Context",
    "CopyAttributes",
    "EventPool",
    "RawCalls",
    "check",
    "choose_abi",
    "cu",
    "elapsed_s",
    "event_query",
    "event_synchronize",
    "failed",
    "lowest_priority_stream",
    "memcpy_each",
    "new_event",
    "raw_calls",
    "record",
    "require_driver",
    "stream_of",
    "wait",
]
