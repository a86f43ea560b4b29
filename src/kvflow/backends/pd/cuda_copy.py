"""Device-to-device block copies for PD's CUDA IPC transport: between a peer's KV tensors mapped
into this process and this process's own, on one GPU.

Two ways, chosen per KV cache group by page size (``choose_method``):

- ``dma``: one ``cuMemcpyBatchAsync`` (kvflow's CUDA backend's raw-array wrapper) over every
  (run, region) page: a run of blocks consecutive on both sides of a region whose rows are back
  to back is one copy (``d2d_descriptors``);
- ``kernel``: a copy kernel that reads the source page and writes the destination page
  directly: both are device memory, so no staging slot and no second copy. A page is split into
  ``CHUNK_BYTES`` pieces, one warp each; the region tables are uploaded once. The block ids
  travel in the launch's parameters (up to ``VALUE_CAPACITIES[-1]`` pairs a launch, a hand-off
  with more cut into at most ``VALUE_LAUNCHES`` launches: ``plan_launches``), so nothing is
  uploaded and no buffer outlives the call that launches; a larger hand-off uploads its ids to
  one device array on the copy stream and is one launch.

The descriptor, parameter and launch planning here is pure numpy and runs on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from attrs import frozen

from kvflow.backends.cuda.kernels import THREADS, WARPS, compile_cubin
from kvflow.backends.cuda.plan import Descriptors, runs
from kvflow.backends.pd.rendezvous import Region
from kvflow.errors import BackendError, ConfigError, LayoutError

I64 = npt.NDArray[np.int64]
Method = Literal["auto", "dma", "kernel"]
METHODS = ("auto", "dma", "kernel")

CHUNK_BYTES = 4096
"""A warp copies at most this much of a page per work item (one round of ``COPY_PAGE``'s
loads), so a large page is spread over many warps instead of one warp looping over it."""

VALUE_CAPACITIES = (256, 1024, 2048, 4092)
"""Pairs a launch carries in its parameters, one kernel each (``kvf_pair_copy_v<N>``): the
smallest that fits is launched, since the driver copies the whole parameter block at every
launch and a larger block costs the launching host more. 4,092 pairs (32,736 bytes of ids,
32,760 with the scalars) is the most that fits the 32,764 bytes of parameters CUDA 12.1+ allows
on sm_70+; older drivers take the first alone (within 4,096 bytes)."""

VALUE_LAUNCHES = 1
"""A hand-off with more pairs than one parameter block holds is cut into at most this many
launches; past that its ids are uploaded and it is one launch. One by default: a second launch
of a full block costs the host more than the upload does."""

_VALUE_KERNEL = r"""
struct KvfPairIds@N@ { int v[2 * @N@]; };

// Up to @N@ pairs in the launch's parameters (src ids, then dst ids, packed): no upload.
extern "C" __global__ void __launch_bounds__(@THREADS@, 4) kvf_pair_copy_v@N@(
    const KvfPairRegion* __restrict__ regions, int nregions, int chunks, long long npairs,
    const __grid_constant__ KvfPairIds@N@ ids)
{
    kvf_pair_body(regions, nregions, chunks, npairs, ids.v, ids.v + npairs);
}
"""

SOURCE = r"""
#define KVF_CHUNK @CHUNK@
struct KvfPairRegion { long long src; long long dst; long long src_stride; long long dst_stride;
                       long long page; };

// Work item w is chunk (w % chunks) of region ((w / chunks) % nregions) of pair
// (w / (chunks * nregions)): consecutive warps copy consecutive bytes of a page. Its source,
// destination and length; false for a chunk past the end of a smaller region's page.
__device__ __forceinline__ bool kvf_item(
    unsigned w, unsigned per_pair, int chunks, const KvfPairRegion* __restrict__ regions,
    const int* __restrict__ src_ids, const int* __restrict__ dst_ids,
    const char** s, char** d, int* n)
{
    const unsigned i = w / per_pair;
    const unsigned rest = w - i * per_pair;
    const unsigned r = rest / chunks;
    const long long off = static_cast<long long>(rest - r * chunks) * KVF_CHUNK;
    const KvfPairRegion rg = regions[r];
    if (off >= rg.page) return false;
    *n = static_cast<int>(rg.page - off < KVF_CHUNK ? rg.page - off : KVF_CHUNK);
    *s = reinterpret_cast<const char*>(
        rg.src + static_cast<long long>(src_ids[i]) * rg.src_stride + off);
    *d = reinterpret_cast<char*>(rg.dst + static_cast<long long>(dst_ids[i]) * rg.dst_stride + off);
    return true;
}

// One chunk (<= 4 KiB) a warp, each lane with up to 8 16-byte loads in flight. The next item's
// ids and region are read while this item's loads are in flight: reading them after would add
// a second round trip to every chunk. Plain loads and stores: the streaming hints (__ldcs /
// __stcs) held the kernel a few points further below a contiguous memcpy, and 16 loads a lane
// (8 KiB items) ran slower, not faster (docs/benchmarks.md, eighteenth session).
__device__ __forceinline__ void kvf_pair_body(
    const KvfPairRegion* __restrict__ regions, int nregions, int chunks, long long npairs,
    const int* __restrict__ src_ids, const int* __restrict__ dst_ids)
{
    const unsigned per_pair = static_cast<unsigned>(nregions) * chunks;
    const unsigned items = per_pair * static_cast<unsigned>(npairs);
    const int lane = threadIdx.x & 31;
    const unsigned nwarps = (gridDim.x * blockDim.x) >> 5;
    unsigned w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const char* s = nullptr;
    char* d = nullptr;
    int n = 0;
    bool have = w < items && kvf_item(w, per_pair, chunks, regions, src_ids, dst_ids, &s, &d, &n);
    while (w < items) {
        const bool vec = have && ((reinterpret_cast<unsigned long long>(s)
            | reinterpret_cast<unsigned long long>(d) | static_cast<unsigned long long>(n))
            & 15ull) == 0ull;
        const int nv = n >> 4;
        uint4 v[8];
        if (vec) {
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int k = lane + u * 32;
                if (k < nv) v[u] = reinterpret_cast<const uint4*>(s)[k];
            }
        }
        const unsigned next = w + nwarps;
        const char* s2 = nullptr;
        char* d2 = nullptr;
        int n2 = 0;
        const bool have2 = next < items && next > w
            && kvf_item(next, per_pair, chunks, regions, src_ids, dst_ids, &s2, &d2, &n2);
        if (vec) {
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int k = lane + u * 32;
                if (k < nv) reinterpret_cast<uint4*>(d)[k] = v[u];
            }
        } else if (have) {
            for (int k = lane; k < n; k += 32) d[k] = s[k];
        }
        if (next <= w) break;  // the unsigned index wrapped: every item is done
        s = s2;
        d = d2;
        n = n2;
        have = have2;
        w = next;
    }
}

// The pairs as a device array (src ids, then dst ids) uploaded on the copy stream before the
// launch: one launch carries any number of them.
extern "C" __global__ void __launch_bounds__(@THREADS@, 4) kvf_pair_copy(
    const KvfPairRegion* __restrict__ regions, int nregions, int chunks, long long npairs,
    const int* __restrict__ src_ids, const int* __restrict__ dst_ids)
{
    kvf_pair_body(regions, nregions, chunks, npairs, src_ids, dst_ids);
}
@VALUE_KERNELS@"""
SOURCE = (
    SOURCE.replace(
        "@VALUE_KERNELS@", "".join(_VALUE_KERNEL.replace("@N@", str(n)) for n in VALUE_CAPACITIES)
    )
    .replace("@CHUNK@", str(CHUNK_BYTES))
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


# Parameter block: regions pointer, nregions, chunks, npairs, src ids pointer, dst ids pointer.
_OFFSETS = (0, 8, 12, 16, 24, 32)
PARAM_BYTES = 40
# By value: regions pointer, nregions, chunks, npairs, then the ids (src, then dst).
_VALUE_OFFSETS = (0, 8, 12, 16, 24)
_VALUE_HEADER = 24
MAX_PARAM_BYTES = 32764
"""The most parameter bytes a launch takes (CUDA 12.1+ on sm_70+)."""


def chunks_of(table: PairTable) -> int:
    """Work items per (pair, region): the largest page in ``CHUNK_BYTES`` pieces."""
    return max(1, -(-int(table.page.max()) // CHUNK_BYTES)) if table.num_regions else 1


def _work_items(npairs: int, num_regions: int, chunks: int) -> int:
    if npairs < 0 or num_regions < 0 or chunks < 1:
        raise BackendError(f"copy launch: {npairs} pairs, {num_regions} regions, {chunks} chunks")
    if npairs * num_regions * chunks >= 1 << 32:
        raise BackendError(
            f"copy launch: {npairs} pairs x {num_regions} regions x {chunks} chunks is "
            "more work items than one launch indexes (2**32)"
        )
    return npairs * num_regions * chunks


def value_capacities(driver_version: int, cc_major: int) -> tuple[int, ...]:
    """The ``VALUE_CAPACITIES`` this driver and device launch: parameter blocks past 4,096 bytes
    need a CUDA 12.1+ driver and sm_70+."""
    if driver_version >= 12010 and cc_major >= 7:
        return VALUE_CAPACITIES
    return tuple(c for c in VALUE_CAPACITIES if _VALUE_HEADER + 8 * c <= 4096)


def plan_launches(
    npairs: int, capacities: Sequence[int], max_launches: int
) -> tuple[tuple[int, int, int], ...]:
    """One hand-off group's launches as ``(start, stop, capacity)`` over its pairs: the fewest
    launches of ids by value (``capacity`` the smallest block that holds the part, parts as even
    as can be), or, when that would take more than ``max_launches``, one launch of uploaded
    ids (``capacity`` 0). Empty for no pairs."""
    if npairs < 0 or max_launches < 0 or any(c <= 0 for c in capacities):
        raise BackendError(
            f"copy plan: {npairs} pairs, capacities {tuple(capacities)}, {max_launches} launches"
        )
    if npairs == 0:
        return ()
    caps = sorted(capacities)
    k = -(-npairs // caps[-1]) if caps else max_launches + 1
    if k > max_launches:
        return ((0, npairs, 0),)
    base, extra = divmod(npairs, k)
    out = []
    start = 0
    for i in range(k):
        stop = start + base + (i < extra)
        out.append((start, stop, next(c for c in caps if c >= stop - start)))
        start = stop
    return tuple(out)


class ParamBlock:
    """The kernel's parameters, reused by every launch (the driver copies them at launch)."""

    def __init__(self) -> None:
        self.raw = np.zeros(PARAM_BYTES, dtype=np.uint8)
        base = int(self.raw.ctypes.data)
        self.pointers = np.array([base + o for o in _OFFSETS], dtype=np.uint64)
        self.address = int(self.pointers.ctypes.data)
        self._i64 = self.raw.view(np.int64)
        self._i32 = self.raw.view(np.int32)

    def fill(
        self, regions_ptr: int, num_regions: int, chunks: int, npairs: int, ids_ptr: int
    ) -> int:
        """Write one launch's parameters (``ids_ptr``: ``npairs`` int32 source ids, then as many
        destination ids); returns the work items, one warp each."""
        items = _work_items(npairs, num_regions, chunks)
        self._i64[0] = regions_ptr
        self._i32[2] = num_regions
        self._i32[3] = chunks
        self._i64[2] = npairs
        self._i64[3] = ids_ptr
        self._i64[4] = ids_ptr + 4 * npairs
        return items


class ValueParams:
    """The parameters of ``kvf_pair_copy_v<capacity>``: the scalars, then up to ``capacity``
    pairs as int32 (source ids, then destination ids, packed). The driver copies the block at
    launch, so the next launch may rewrite it at once."""

    def __init__(self, capacity: int) -> None:
        size = _VALUE_HEADER + 8 * capacity
        if capacity <= 0 or size > MAX_PARAM_BYTES:
            raise ConfigError(
                f"a launch carries 1..{(MAX_PARAM_BYTES - 24) // 8} pairs, not {capacity}"
            )
        self.capacity = capacity
        self.raw = np.zeros(size, dtype=np.uint8)
        base = int(self.raw.ctypes.data)
        self.pointers = np.array([base + o for o in _VALUE_OFFSETS], dtype=np.uint64)
        self.address = int(self.pointers.ctypes.data)
        self._i64 = self.raw[:_VALUE_HEADER].view(np.int64)
        self._i32 = self.raw[:_VALUE_HEADER].view(np.int32)
        self.ids = self.raw[_VALUE_HEADER:].view(np.int32)

    def fill(
        self, regions_ptr: int, num_regions: int, chunks: int, src_ids: Any, dst_ids: Any
    ) -> int:
        """Write one launch's parameters; returns the work items, one warp each."""
        n = len(src_ids)
        if n > self.capacity or len(dst_ids) != n:
            raise BackendError(
                f"copy launch: {n} source and {len(dst_ids)} destination ids for a block of "
                f"{self.capacity} pairs"
            )
        items = _work_items(n, num_regions, chunks)
        self._i64[0] = regions_ptr
        self._i32[2] = num_regions
        self._i32[3] = chunks
        self._i64[2] = n
        ids = self.ids
        ids[:n] = src_ids
        ids[n : 2 * n] = dst_ids
        return items


class PairCopyKernel:
    """``kvf_pair_copy`` (uploaded ids) and its by-value variants ``kvf_pair_copy_v<N>`` loaded
    into the current context, launched through ``RawCalls`` on raw stream handles."""

    def __init__(
        self,
        arch: str,
        max_ctas: int,
        *,
        capacities: Sequence[int] = VALUE_CAPACITIES,
        max_launches: int = VALUE_LAUNCHES,
    ) -> None:
        from kvflow.backends.cuda.driver import check, cu, raw_calls

        if max_ctas <= 0:
            raise ConfigError(f"max_ctas must be positive, got {max_ctas}")
        if any(c not in VALUE_CAPACITIES for c in capacities) or max_launches < 0:
            raise ConfigError(
                f"by-value capacities must be among {VALUE_CAPACITIES} and max_launches >= 0, "
                f"got {tuple(capacities)}, {max_launches}"
            )
        self._cu, self._check, self._raw = cu, check, raw_calls()
        self.max_ctas = max_ctas
        self.capacities = tuple(sorted(capacities))
        self.max_launches = max_launches
        image = np.frombuffer(compile_cubin(arch, SOURCE), dtype=np.uint8)
        self.module = check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")

        def function(name: str) -> int:
            f = check(cu.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
            return int(f)

        self.function = function("kvf_pair_copy")
        self.params = ParamBlock()
        self._value = {
            c: (function(f"kvf_pair_copy_v{c}"), ValueParams(c)) for c in self.capacities
        }
        self.launches = 0

    def plan(self, npairs: int) -> tuple[tuple[int, int, int], ...]:
        """``plan_launches`` with this kernel's capacities and launch limit."""
        return plan_launches(npairs, self.capacities, self.max_launches)

    def copy(
        self, stream: int, regions_ptr: int, num_regions: int, chunks: int, npairs: int,
        ids_ptr: int,
    ) -> int:  # fmt: skip
        """Copy every region of ``npairs`` pairs (device ids at ``ids_ptr``) on ``stream`` in
        one launch; returns the launches made (1, or 0 for no pairs)."""
        items = self.params.fill(regions_ptr, num_regions, chunks, npairs, ids_ptr)
        if items == 0:
            return 0
        self._launch(self.function, self.params.address, stream, items)
        return 1

    def copy_by_value(
        self, stream: int, regions_ptr: int, num_regions: int, chunks: int, src_ids: Any,
        dst_ids: Any, capacity: int,
    ) -> int:  # fmt: skip
        """Copy every region of the pairs (host ids, at most ``capacity``) on ``stream`` in one
        launch of ``kvf_pair_copy_v<capacity>``; returns the launches made (1, or 0)."""
        function, params = self._value[capacity]
        items = params.fill(regions_ptr, num_regions, chunks, src_ids, dst_ids)
        if items == 0:
            return 0
        self._launch(function, params.address, stream, items)
        return 1

    def warm_up(self, stream: int) -> None:
        """An empty launch of each function, so that lazy loading happens now and not inside a
        hand-off."""
        self.params.fill(0, 0, 1, 0, 0)
        self._raw.launch(self.function, 1, THREADS, stream, self.params.address)
        for function, params in self._value.values():
            params.fill(0, 0, 1, (), ())
            self._raw.launch(function, 1, THREADS, stream, params.address)

    def _launch(self, function: int, params: int, stream: int, items: int) -> None:
        self._raw.launch(function, min(self.max_ctas, -(-items // WARPS)), THREADS, stream, params)
        self.launches += 1

    def unload(self) -> None:
        self._check(self._cu.cuModuleUnload(self.module), "cuModuleUnload")


__all__ = [
    "CHUNK_BYTES",
    "MAX_PARAM_BYTES",
    "METHODS",
    "SOURCE",
    "VALUE_CAPACITIES",
    "VALUE_LAUNCHES",
    "Method",
    "PairCopyKernel",
    "PairTable",
    "ParamBlock",
    "ValueParams",
    "choose_method",
    "chunks_of",
    "d2d_descriptors",
    "plan_launches",
    "value_capacities",
]
