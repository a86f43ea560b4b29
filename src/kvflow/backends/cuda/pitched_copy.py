"""A batch's 2D copies (``plan.Pitched``: a staged load's parts, a ``store_dma`` store) issued
through the driver: all of one call's copies in one ``cuMemcpy3DBatchAsync`` where the driver has
it (CUDA 12.8+), else one ``cuMemcpy2DAsync`` each. Both go through ctypes on parameters built
without a Python object per copy: the batch's operations are one numpy structured array laid out
as ``cuda.h``'s ``CUDA_MEMCPY3D_BATCH_OP``; the single copy reuses one ``CUDA_MEMCPY2D``."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvflow.backends.cuda.driver import choose_abi, cu, failed
from kvflow.backends.cuda.plan import Pitched
from kvflow.backends.probe import resolve_batch_memcpy
from kvflow.errors import BackendError


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (``cuda.h``); ctypes pads after the two memory-type enums as C does."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_MEMORYTYPE_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: a UVA address, host or device


class Memcpy2D:
    """``cuMemcpy2DAsync`` through ctypes on one reused parameter struct (the driver reads it
    before the call returns): a part's run of CPU blocks (or a region's run of blocks, for a
    store without staging) is one call, where cuda-python would build a struct object per call.
    Addresses go as unified (UVA) addresses: the pinned tier's, the staging ring's and the KV
    cache's alike."""

    def __init__(self) -> None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._params = _Memcpy2D()
        self._params.srcMemoryType = self._params.dstMemoryType = _MEMORYTYPE_UNIFIED
        self._ptr = ctypes.addressof(self._params)

    def __call__(self, copies: Pitched, stream: Any, lo: int = 0, hi: int = -1) -> None:
        """Copies ``lo:hi`` of ``copies`` on ``stream``, one driver call each."""
        hi = len(copies) if hi < 0 else hi
        p = self._params
        width = copies.width
        p.WidthInBytes = width
        p.srcPitch, p.dstPitch = copies.pitches
        handle = int(stream)
        rows = copies.rows[lo:hi].tolist()
        for d, s, h in zip(
            copies.dst[lo:hi].tolist(), copies.src[lo:hi].tolist(), rows, strict=True
        ):
            p.dstDevice, p.srcDevice, p.Height = d, s, h
            err = self._fn(self._ptr, handle)
            if err:
                raise failed(f"cuMemcpy2DAsync ({h} rows of {width} bytes)", err)


# ``cuda.h``'s enum values (constants: this module imports without cuda-python).
_OPERAND_POINTER = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CU_MEM_LOCATION_TYPE_DEVICE / _HOST
_ORDER_STREAM, _ORDER_ANY = 1, 3  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM / _ANY
_PREFER_OVERLAP_WITH_COMPUTE = 1  # CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE


def _operand(side: str, at: int) -> list[tuple[str, str, int]]:
    """A ``CUmemcpy3DOperand`` of pointer type: (field, numpy format, offset) from ``at``."""
    return [
        (f"{side}_type", "<u4", at),
        (f"{side}_ptr", "<u8", at + 8),
        (f"{side}_row", "<u8", at + 16),  # rowLength: the pitch, in 1-byte elements
        (f"{side}_layer", "<u8", at + 24),  # layerHeight: rows of a layer
        (f"{side}_loc_type", "<i4", at + 32),  # locHint
        (f"{side}_loc_id", "<i4", at + 36),
    ]


_FIELDS = [
    *_operand("src", 0),
    *_operand("dst", 40),
    ("width", "<u8", 80),  # extent, in 1-byte elements for pointer-to-pointer copies
    ("height", "<u8", 88),
    ("depth", "<u8", 96),
    ("order", "<u4", 104),  # srcAccessOrder
    ("flags", "<u4", 108),
]
BATCH_OP = np.dtype(
    {
        "names": [f[0] for f in _FIELDS],
        "formats": [f[1] for f in _FIELDS],
        "offsets": [f[2] for f in _FIELDS],
        "itemsize": 112,
    }
)
"""``CUDA_MEMCPY3D_BATCH_OP`` of ``cuda.h`` (112 bytes) with both operands pointers."""


def batch_ops(copies: Pitched, device: int, lo: int = 0, hi: int = -1) -> np.ndarray:
    """``lo:hi`` of ``copies`` as ``cuMemcpy3DBatchAsync`` operations, one layer each: the GPU
    side hinted at ``device``, the CPU side at the host. A store reads the GPU in stream order
    (after the compute that wrote it: ANY raced with compute, vllm#45704); a load reads the CPU
    tier, which nothing writes while it is in flight: ANY, as ``driver.CopyAttributes``."""
    hi = len(copies) if hi < 0 else hi
    rows = copies.rows[lo:hi]
    ops = np.zeros(len(rows), dtype=BATCH_OP)
    src_pitch, dst_pitch = copies.pitches
    src_loc, dst_loc = (
        (_LOCATION_DEVICE, _LOCATION_HOST) if copies.store else (_LOCATION_HOST, _LOCATION_DEVICE)
    )
    for side, ptrs, pitch, loc in (
        ("src", copies.src, src_pitch, src_loc),
        ("dst", copies.dst, dst_pitch, dst_loc),
    ):
        ops[f"{side}_type"] = _OPERAND_POINTER
        ops[f"{side}_ptr"] = ptrs[lo:hi]
        ops[f"{side}_row"] = pitch
        ops[f"{side}_layer"] = rows
        ops[f"{side}_loc_type"] = loc
        ops[f"{side}_loc_id"] = device if loc == _LOCATION_DEVICE else 0
    ops["width"] = copies.width
    ops["height"] = rows
    ops["depth"] = 1
    ops["order"] = _ORDER_STREAM if copies.store else _ORDER_ANY
    ops["flags"] = _PREFER_OVERLAP_WITH_COMPUTE
    return ops


_SIZE, _PTR, _ULL = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ulonglong
_ARGTYPES_3D = {
    # CUDA 13: (numOps, opList, flags, stream)
    13000: (_SIZE, _PTR, _ULL, _PTR),
    # CUDA 12.8: the same with a failIdx out-parameter after the list
    12080: (_SIZE, _PTR, _PTR, _ULL, _PTR),
}


class Memcpy3DBatch:
    """``cuMemcpy3DBatchAsync`` resolved for one ABI: a call's 2D copies in one driver call."""

    def __init__(self, abi: int, address: int, device: int) -> None:
        if abi not in _ARGTYPES_3D:
            raise BackendError(f"unknown cuMemcpy3DBatchAsync ABI {abi}")
        self.abi = abi
        self.device = device
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, *_ARGTYPES_3D[abi])(address)
        self._fail_idx = ctypes.c_size_t(0)
        self._fail_ptr = ctypes.addressof(self._fail_idx)

    @classmethod
    def resolve(cls, driver_version: int, device: int) -> Memcpy3DBatch:
        """Resolve the function for this driver; ``BackendError`` where it has none."""
        abis = choose_abi(driver_version)
        found, address = (
            (None, None) if not abis else resolve_batch_memcpy(cu, abis, b"cuMemcpy3DBatchAsync")
        )
        if found is None or address is None:
            raise BackendError(
                f"no cuMemcpy3DBatchAsync in this driver ({driver_version // 1000}."
                f"{driver_version % 1000 // 10}; it needs 12.8+)"
            )
        return cls(found, address, device)

    def __call__(self, copies: Pitched, stream: Any, lo: int = 0, hi: int = -1) -> None:
        """Copies ``lo:hi`` of ``copies`` on ``stream`` in one driver call."""
        ops = batch_ops(copies, self.device, lo, hi)
        n = len(ops)
        if not n:
            return
        if self.abi == 12080:
            err = self._fn(n, ops.ctypes.data, self._fail_ptr, 0, int(stream))
        else:
            err = self._fn(n, ops.ctypes.data, 0, int(stream))
        if err:
            where = f" at copy {self._fail_idx.value}" if self.abi == 12080 else ""
            raise failed(
                f"cuMemcpy3DBatchAsync ({n} 2D copies of {copies.width}-byte rows{where})", err
            )


class PitchedCopier:
    """The backend's 2D copy call: ``Memcpy3DBatch`` for ``min_batch`` copies or more where the
    driver has it, else ``Memcpy2D`` (one driver call per copy, cheaper for a single copy)."""

    def __init__(self, batch: Memcpy3DBatch | None, min_batch: int) -> None:
        self.batch = batch
        self.each = Memcpy2D()
        self.min_batch = min_batch

    def __call__(self, copies: Pitched, stream: Any, lo: int = 0, hi: int = -1) -> None:
        hi = len(copies) if hi < 0 else hi
        if self.batch is not None and hi - lo >= self.min_batch:
            self.batch(copies, stream, lo, hi)
        else:
            self.each(copies, stream, lo, hi)


__all__ = ["BATCH_OP", "Memcpy2D", "Memcpy3DBatch", "PitchedCopier", "batch_ops"]
