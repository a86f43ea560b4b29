"""Device-to-device block copies for PD's CUDA IPC transport: between a peer's KV tensors mapped
into this process and this process's own, on one GPU.

Two ways, chosen per KV cache group by page size (``choose_method``):

- ``dma``: one ``cuMemcpyBatchAsync`` (kvflow's CUDA backend's raw-array wrapper) over every
  (run, region) page: a run of blocks consecutive on both sides of a region whose rows are back
  to back is one copy (``d2d_descriptors``);
- ``kernel``: a copy kernel that reads the source page and writes the destination page
  directly: both are device memory, so no staging slot and no second copy. A page is split into ``CHUNK_BYTES`` pieces, one warp each; the block
  ids are one device array uploaded on the copy stream, so a hand-off is one launch; the region
  tables are uploaded once.

The descriptor and parameter planning here is pure numpy and runs on any machine.
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
// a second round trip to every chunk. The pairs are a device array (src ids, then dst ids)
// uploaded on the copy stream before the launch, so one launch carries any number of them.
extern "C" __global__ void __launch_bounds__(@THREADS@, 4) kvf_pair_copy(
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
                if (k < nv) v[u] = __ldcs(reinterpret_cast<const uint4*>(s) + k);
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
                if (k < nv) __stcs(reinterpret_cast<uint4*>(d) + k, v[u]);
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
""".replace("@CHUNK@", str(CHUNK_BYTES)).replace("@THREADS@", str(THREADS))


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


def chunks_of(table: PairTable) -> int:
    """Work items per (pair, region): the largest page in ``CHUNK_BYTES`` pieces."""
    return max(1, -(-int(table.page.max()) // CHUNK_BYTES)) if table.num_regions else 1


class ParamBlock:
    """The kernel's parameters, reused by every launch (the driver copies them at launch)."""

    def __init__(self) -> None:
        self.raw = np.zeros(PARAM_BYTES, dtype=np.uint8)
        base = int(self.raw.ctypes.data)
        self.pointers = np.array([base + o for o in _OFFSETS], dtype=np.uint64)
        self._i64 = self.raw.view(np.int64)
        self._i32 = self.raw.view(np.int32)

    def fill(
        self, regions_ptr: int, num_regions: int, chunks: int, npairs: int, ids_ptr: int
    ) -> int:
        """Write one launch's parameters (``ids_ptr``: ``npairs`` int32 source ids, then as many
        destination ids); returns the work items, one warp each."""
        if npairs < 0 or num_regions < 0 or chunks < 1:
            raise BackendError(
                f"copy launch: {npairs} pairs, {num_regions} regions, {chunks} chunks"
            )
        if npairs * num_regions * chunks >= 1 << 32:
            raise BackendError(
                f"copy launch: {npairs} pairs x {num_regions} regions x {chunks} chunks is "
                "more work items than one launch indexes (2**32)"
            )
        self._i64[0] = regions_ptr
        self._i32[2] = num_regions
        self._i32[3] = chunks
        self._i64[2] = npairs
        self._i64[3] = ids_ptr
        self._i64[4] = ids_ptr + 4 * npairs
        return npairs * num_regions * chunks


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

    def copy(
        self, stream: Any, regions_ptr: int, num_regions: int, chunks: int, npairs: int,
        ids_ptr: int,
    ) -> int:  # fmt: skip
        """Copy every region of ``npairs`` pairs (device ids at ``ids_ptr``) on ``stream`` in
        one launch; returns the launches made (1, or 0 for no pairs)."""
        items = self.params.fill(regions_ptr, num_regions, chunks, npairs, ids_ptr)
        if items == 0:
            return 0
        self._launch(stream, min(self.max_ctas, -(-items // WARPS)))
        self.launches += 1
        return 1

    def warm_up(self, stream: Any) -> None:
        """An empty launch, so that lazy loading happens now and not inside a hand-off."""
        self.params.fill(0, 0, 1, 0, 0)
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
    "CHUNK_BYTES",
    "METHODS",
    "SOURCE",
    "Method",
    "PairCopyKernel",
    "PairTable",
    "ParamBlock",
    "choose_method",
    "chunks_of",
    "d2d_descriptors",
]
