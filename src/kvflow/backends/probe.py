"""Find out, without failing, what CUDA support this process has: driver, device, batched copies.

Used by ``kvflow doctor`` and by backend selection (``backend="auto"``). Every driver error,
including a missing ``libcuda.so.1`` on a machine without a GPU, means "no CUDA", never a crash.
"""

from __future__ import annotations

import functools
from typing import Any

from attrs import frozen

BATCH_MEMCPY_ABIS = (13000, 12080)
"""CUDA versions whose ``cuMemcpyBatchAsync`` ABI kvflow can call (13.0 dropped ``failIdx``)."""


@frozen
class CudaProbe:
    driver_loaded: bool
    driver_version: int | None  # e.g. 13000 for CUDA 13.0
    device_count: int
    device_name: str | None
    batch_memcpy_abi: int | None  # the newest ABI in BATCH_MEMCPY_ABIS the driver resolves
    error: str | None
    batch_3d_abi: int | None = None  # the same for ``cuMemcpy3DBatchAsync``

    @property
    def available(self) -> bool:
        return self.driver_loaded and self.device_count > 0

    @property
    def driver_version_str(self) -> str:
        if self.driver_version is None:
            return "—"
        return f"{self.driver_version // 1000}.{(self.driver_version % 1000) // 10}"


def _check(result: Any) -> Any:
    """cuda-python returns (err, *values); raise on an error, return the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def resolve_batch_memcpy(
    driver: Any, abis: tuple[int, ...] = BATCH_MEMCPY_ABIS, name: bytes = b"cuMemcpyBatchAsync"
) -> tuple[int | None, int | None]:
    """(ABI version, function address) of the driver function ``name`` (``cuMemcpyBatchAsync``
    or ``cuMemcpy3DBatchAsync``, whose ABIs changed alike in 13.0), first of ``abis`` that
    resolves."""
    for abi in abis:
        try:
            result = driver.cuGetProcAddress(
                name, abi, driver.CUflags(0) if hasattr(driver, "CUflags") else 0
            )
        except Exception:
            continue
        err, pfn = result[0], result[1]
        if int(err) == 0 and int(pfn) != 0:
            return abi, int(pfn)
    return None, None


@functools.cache
def probe_cuda() -> CudaProbe:
    """Probe the CUDA driver once per process."""
    try:
        from cuda.bindings import driver
    except Exception as exc:
        return CudaProbe(False, None, 0, None, None, f"cuda-python not importable: {exc}")
    try:
        _check(driver.cuInit(0))
    except Exception as exc:
        return CudaProbe(False, None, 0, None, None, f"no CUDA driver: {exc}")
    try:
        version = int(_check(driver.cuDriverGetVersion()))
        count = int(_check(driver.cuDeviceGetCount()))
        name = None
        if count:
            dev = _check(driver.cuDeviceGet(0))
            raw = _check(driver.cuDeviceGetName(256, dev))
            name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        abi, _ = resolve_batch_memcpy(driver)
        abi_3d, _ = resolve_batch_memcpy(driver, name=b"cuMemcpy3DBatchAsync")
        return CudaProbe(True, version, count, name, abi, None, abi_3d)
    except Exception as exc:
        return CudaProbe(True, None, 0, None, None, f"CUDA driver query failed: {exc}")


__all__ = ["BATCH_MEMCPY_ABIS", "CudaProbe", "probe_cuda", "resolve_batch_memcpy"]
