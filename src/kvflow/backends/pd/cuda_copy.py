"""Device-to-device block copies for PD's CUDA IPC transport: between a peer's KV tensors mapped
into this process and this process's own, on one GPU.

Two ways, chosen per KV cache group by page size (``choose_method``):

- ``dma``: one ``cuMemcpyBatchAsync`` (kvflow's CUDA backend's raw-array wrapper) over every
  (run, region) page: a run of blocks consecutive on both sides of a region whose rows are back
  to back is one copy (``d2d_descriptors``);
- ``kernel``: the staged path's page copier (``kernels.COPY_PAGE``, one warp per page) in a
  kernel that reads the source page and writes the destination page directly: both are device
  memory, so no staging slot and no second copy; block ids travel by value
  (``MAX_PAIRS`` pairs per launch), the region tables are uploaded once.

The descriptor and parameter planning here is pure numpy and runs on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from attrs import frozen

from kvflow.backends.cuda.kernels import COPY_PAGE, THREADS, WARPS, compile_cubin
from kvflow.backends.cuda.plan import Descriptors, runs
from kvflow.backends.pd.rendezvous import Region
from kvflow.errors import BackendError, ConfigError, LayoutError

I64 = npt.NDArray[np.int64]
Method = Literal["auto", "dma", "kernel"]
METHODS = ("auto", "dma", "kernel")

MAX_PAIRS = 480
"""Block pairs one kernel launch carries by value (3,840 of the 4,096 parameter bytes)."""

SOURCE = (
    (
        r"""
#define KVF_MAX_PAIRS @MAX_PAIRS@
struct KvfPairRegion { long long src; long long dst; long long src_stride; long long dst_stride;
                       long long page; };
struct KvfPairIds { int src[KVF_MAX_PAIRS]; int dst[KVF_MAX_PAIRS]; };
"""
        + COPY_PAGE
        + r"""
// Page p is region (p % nregions) of pair (p / nregions).
extern "C" __global__ void __launch_bounds__(@THREADS@) kvf_pair_copy(
    const KvfPairRegion* __restrict__ regions, int nregions, int npairs,
    const __grid_constant__ KvfPairIds ids)
{
    const long long npages = static_cast<long long>(nregions) * npairs;
    const int lane = threadIdx.x & 31;
    const long long nwarps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    for (long long p = first; p < npages; p += nwarps) {
        const int i = static_cast<int>(p / nregions);
        const int r = static_cast<int>(p - static_cast<long long>(i) * nregions);
        const KvfPairRegion rg = regions[r];
        const char* s = reinterpret_cast<const char*>(
            rg.src + static_cast<long long>(ids.src[i]) * rg.src_stride);
        char* d = reinterpret_cast<char*>(rg.dst + static_cast<long long>(ids.dst[i]) * rg.dst_stride);
        kvf_copy_page(d, s, rg.page, lane);
    }
}
"""
    )
    .replace("@MAX_PAIRS@", str(MAX_PAIRS))
    .replace("@THREADS@", str(THREADS))
)


@frozen
class PairTable:
    """One group's regions for one direction of copy (source side, destination side)."""

    src_base: I64
    dst_base: I64
    src_stride: I64
    dst_stride: I64
    page: I64

    @classmethod
    def of(cls, src: Sequence[Region], dst: Sequence[Region], *, group: int) -> PairTable:
        if len(src) != len(dst):
            raise LayoutError(f"group {group}: {len(src)} source regions, {len(dst)} destination")
        pages = [s.row_bytes for s in src]
        if pages != [d.row_bytes for d in dst]:
            raise LayoutError(f"group {group}: page sizes differ between the two sides")
        return cls(
            np.array([r.base for r in src], dtype=np.int64),
            np.array([r.base for r in dst], dtype=np.int64),
            np.array([r.stride for r in src], dtype=np.int64),
            np.array([r.stride for r in dst], dtype=np.int64),
            np.array(pages, dtype=np.int64),
        )

    @property
    def num_regions(self) -> int:
        return len(self.page)

    def rows(self) -> I64:
        """``(R, 5)`` rows ``(src, dst, src_stride, dst_stride, page)``: the kernel's table."""
        return np.ascontiguousarray(
            np.stack(
                [self.src_base, self.dst_base, self.src_stride, self.dst_stride, self.page], axis=1
            ),
            dtype=np.int64,
        )


def d2d_descriptors(table: PairTable, src_ids: I64, dst_ids: I64) -> Descriptors:
    """One copy per (block, region) page; in a region whose rows are back to back on both sides,
    a run of blocks consecutive on both sides is one copy. Ordered region-major."""
    starts, lengths = runs(src_ids, dst_ids)
    dst_parts, src_parts, size_parts = [], [], []
    for r in range(table.num_regions):
        page = int(table.page[r])
        ss, ds = int(table.src_stride[r]), int(table.dst_stride[r])
        if ss == page and ds == page:
            s_ids, d_ids, n = src_ids[starts], dst_ids[starts], lengths * page
        else:
            s_ids, d_ids, n = src_ids, dst_ids, np.full(len(src_ids), page, dtype=np.int64)
        src_parts.append(table.src_base[r] + s_ids * ss)
        dst_parts.append(table.dst_base[r] + d_ids * ds)
        size_parts.append(n)
    if not size_parts:
        z = np.zeros(0, dtype=np.uint64)
        return Descriptors(z, z, z)

    def u64(parts: list[I64]) -> npt.NDArray[np.uint64]:
        return np.ascontiguousarray(np.concatenate(parts)).astype(np.int64).view(np.uint64)

    return Descriptors(u64(dst_parts), u64(src_parts), u64(size_parts))


def choose_method(method: Method, table: PairTable, kernel_max_page_bytes: int) -> str:
    """``dma`` or ``kernel`` for a group: ``auto`` copies pages up to ``kernel_max_page_bytes``
    with the kernel (many small copies cost the copy engine more per byte than the SMs)."""
    if method not in METHODS:
        raise ConfigError(f"cuda-ipc copy method must be one of {METHODS}, not {method!r}")
    if method != "auto":
        return method
    return "kernel" if int(table.page.min()) <= kernel_max_page_bytes else "dma"


# Parameter block: regions pointer, nregions, npairs, then the two id arrays.
_OFFSETS = (0, 8, 12, 16)
PARAM_BYTES = 16 + 8 * MAX_PAIRS


class ParamBlock:
    """The kernel's parameters, reused by every launch (the driver copies them at launch)."""

    def __init__(self) -> None:
        self.raw = np.zeros(PARAM_BYTES, dtype=np.uint8)
        base = int(self.raw.ctypes.data)
        self.pointers = np.array([base + o for o in _OFFSETS], dtype=np.uint64)
        self._regions = self.raw[0:8].view(np.int64)
        self._counts = self.raw[8:16].view(np.int32)
        self._src = self.raw[16 : 16 + 4 * MAX_PAIRS].view(np.int32)
        self._dst = self.raw[16 + 4 * MAX_PAIRS :].view(np.int32)

    def fill(self, regions_ptr: int, num_regions: int, src_ids: I64, dst_ids: I64) -> int:
        """Write one launch's parameters; returns the grid size (CTAs) to launch with."""
        n = len(src_ids)
        if n > MAX_PAIRS or len(dst_ids) != n:
            raise BackendError(f"one copy launch takes at most {MAX_PAIRS} pairs, got {n}")
        self._regions[0] = regions_ptr
        self._counts[0] = num_regions
        self._counts[1] = n
        self._src[:n] = src_ids
        self._dst[:n] = dst_ids
        return -(-n * num_regions // WARPS)

    def ids(self) -> tuple[list[int], list[int]]:
        n = int(self._counts[1])
        return self._src[:n].tolist(), self._dst[:n].tolist()


class PairCopyKernel:
    """``kvf_pair_copy`` loaded into the current context."""

    def __init__(self, arch: str, max_ctas: int) -> None:
        from kvflow.backends.cuda.driver import check, cu

        if max_ctas <= 0:
            raise ConfigError(f"max_ctas must be positive, got {max_ctas}")
        self._cu, self._check = cu, check
        self.max_ctas = max_ctas
        image = np.frombuffer(compile_cubin(arch, SOURCE), dtype=np.uint8)
        self.module = check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        self.function = check(
            cu.cuModuleGetFunction(self.module, b"kvf_pair_copy"), "cuModuleGetFunction"
        )
        self.params = ParamBlock()
        self.launches = 0

    def copy(self, stream: Any, regions_ptr: int, num_regions: int, src: I64, dst: I64) -> int:
        """Copy every region of pairs ``src[i] → dst[i]`` on ``stream``; returns launches."""
        launches = 0
        for lo in range(0, len(src), MAX_PAIRS):
            grid = self.params.fill(
                regions_ptr, num_regions, src[lo : lo + MAX_PAIRS], dst[lo : lo + MAX_PAIRS]
            )
            self._launch(stream, min(self.max_ctas, max(grid, 1)))
            launches += 1
        self.launches += launches
        return launches

    def warm_up(self, stream: Any) -> None:
        """An empty launch, so that lazy loading happens now and not inside a hand-off."""
        self.params.fill(0, 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._launch(stream, 1)

    def _launch(self, stream: Any, grid: int) -> None:
        (err,) = self._cu.cuLaunchKernel(
            self.function, grid, 1, 1, THREADS, 1, 1, 0, stream, self.params.pointers, 0
        )
        if err:
            self._check((err,), "cuLaunchKernel(kvf_pair_copy)")

    def unload(self) -> None:
        self._check(self._cu.cuModuleUnload(self.module), "cuModuleUnload")


__all__ = [
    "MAX_PAIRS",
    "METHODS",
    "SOURCE",
    "Method",
    "PairCopyKernel",
    "PairTable",
    "ParamBlock",
    "choose_method",
    "d2d_descriptors",
]
