"""The staged path's gather/scatter kernel, compiled at run time with cuda-python's NVRTC.

One kernel moves whole pages between the engine's paged per-region layout and a block-major
staging slot (the CPU tier's layout), so that the copy engine then moves whole blocks. A small
persistent grid (``max_ctas``) walks the pages, one warp per page: the copy takes SMs for tens
of microseconds per slot instead of occupying the whole GPU. Block ids travel as a by-value kernel parameter, so a
launch needs no host→device upload and no buffer that must outlive it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvflow.backends.cuda.driver import check, cu
from kvflow.errors import BackendError

MAX_IDS = 512
"""Block ids one launch carries in its parameter block (2 KiB of the 4 KiB parameter space)."""

PIECE_BYTES = 64 * 1024
"""Pages larger than this are cut into pieces for the kernel (``RegionTable.as_device_rows``):
one warp copies one piece of one block, so large pages keep enough warps busy."""

THREADS = 256
WARPS = THREADS // 32

COPY_PAGE = r"""
__device__ __forceinline__ void kvf_copy_page(char* dst, const char* src, long long n, int lane) {
    // One warp per page; each lane keeps 8 16-byte loads in flight, so a 4 KiB page is a single
    // round trip and small pages cost the SMs no more time per byte than large ones.
    if (((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)
          | static_cast<unsigned long long>(n)) & 15ull) == 0ull) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const long long nv = n >> 4;
        for (long long k = lane; k < nv; k += 8 * 32) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const long long kk = k + u * 32;
                if (kk < nv) v[u] = __ldcs(s + kk);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const long long kk = k + u * 32;
                if (kk < nv) __stcs(d + kk, v[u]);
            }
        }
    } else {
        for (long long k = lane; k < n; k += 32) dst[k] = src[k];
    }
}
"""
"""One warp copies one page (16-byte loads when aligned); shared with the PD copy kernel."""

_TEMPLATE = r"""
#define KVF_MAX_IDS @MAX_IDS@
struct KvfRegion { long long base; long long stride; long long page; long long off; };
struct KvfIds { int v[KVF_MAX_IDS]; };

@COPY_PAGE@
// Page p of the launch is region (p % nregions) of block (p / nregions): consecutive warps
// touch consecutive staging bytes. to_staging = 1 gathers (store), 0 scatters (load).
extern "C" __global__ void __launch_bounds__(@THREADS@) kvf_stage(
    const KvfRegion* __restrict__ regions, long long staging, long long block_bytes,
    int nregions, int nblocks, int to_staging, const __grid_constant__ KvfIds ids)
{
    const long long npages = static_cast<long long>(nregions) * nblocks;
    const int lane = threadIdx.x & 31;
    const long long nwarps = (static_cast<long long>(gridDim.x) * blockDim.x) >> 5;
    const long long first = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    for (long long p = first; p < npages; p += nwarps) {
        const int i = static_cast<int>(p / nregions);
        const int r = static_cast<int>(p - static_cast<long long>(i) * nregions);
        const KvfRegion rg = regions[r];
        char* gpu = reinterpret_cast<char*>(rg.base + static_cast<long long>(ids.v[i]) * rg.stride);
        char* stg = reinterpret_cast<char*>(staging + i * block_bytes + rg.off);
        if (to_staging) kvf_copy_page(stg, gpu, rg.page, lane);
        else kvf_copy_page(gpu, stg, rg.page, lane);
    }
}
"""
SOURCE = (
    _TEMPLATE.replace("@COPY_PAGE@", COPY_PAGE)
    .replace("@MAX_IDS@", str(MAX_IDS))
    .replace("@THREADS@", str(THREADS))
)


@functools.cache
def compile_cubin(arch: str, source: str = SOURCE) -> bytes:
    """Compile ``source`` (the staging kernel by default) for ``arch`` (e.g. ``"sm_90"``);
    ``BackendError`` with the log on failure."""
    try:
        from cuda.bindings import nvrtc
    except Exception as exc:  # pragma: no cover - part of cuda-python
        raise BackendError(f"NVRTC is not importable: {exc}") from exc

    def ok(result: Any, what: str) -> Any:
        err, *rest = result
        if int(err) != 0:
            raise BackendError(f"{what} failed: {err!r}")
        return rest[0] if len(rest) == 1 else tuple(rest)

    try:
        prog = ok(
            nvrtc.nvrtcCreateProgram(source.encode(), b"kvflow_kernel.cu", 0, [], []),
            "nvrtcCreateProgram",
        )
    except BackendError:
        raise
    except Exception as exc:  # libnvrtc missing: the bindings raise their own not-found error
        raise BackendError(f"NVRTC is not available: {exc}") from exc
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-default-device"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = b" " * size
        ok(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        nvrtc.nvrtcDestroyProgram(prog)
        raise BackendError(f"compiling the staging kernel failed:\n{log.decode(errors='replace')}")
    size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin)


# Parameter block: six scalars then the id array, each at its natural alignment.
_PARAM_OFFSETS = (0, 8, 16, 24, 28, 32, 40)
_PARAM_BYTES = 40 + 4 * MAX_IDS


class StageKernel:
    """The loaded ``kvf_stage`` function and a reusable parameter block for launching it."""

    def __init__(self, arch: str, max_ctas: int) -> None:
        if max_ctas <= 0:
            raise BackendError(f"max_ctas must be positive, got {max_ctas}")
        self.max_ctas = max_ctas
        image = np.frombuffer(compile_cubin(arch), dtype=np.uint8)
        self.module = check(cu.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        self.function = check(
            cu.cuModuleGetFunction(self.module, b"kvf_stage"), "cuModuleGetFunction"
        )
        # The driver copies parameters at launch, so one block serves every launch.
        self._params = np.zeros(_PARAM_BYTES, dtype=np.uint8)
        base = int(self._params.ctypes.data)
        self._pointers = np.array([base + off for off in _PARAM_OFFSETS], dtype=np.uint64)
        self._scalars = self._params[:24].view(np.int64)  # regions, staging, block_bytes
        self._ints = self._params[24:36].view(np.int32)  # nregions, nblocks, to_staging
        self._ids = self._params[40:].view(np.int32)

    def warm_up(self, stream: Any) -> None:
        """Launch once with no work, so that the kernel is loaded now.

        Under lazy module loading the first launch loads the function, which can wait for the
        whole device to go idle; that must happen at start-up, not inside a store that races
        with compute.
        """
        self._ints[0] = 0
        self._ints[1] = 0
        check(
            cu.cuLaunchKernel(self.function, 1, 1, 1, THREADS, 1, 1, 0, stream, self._pointers, 0),
            "cuLaunchKernel(kvf_stage)",
        )

    def launch(
        self,
        stream: Any,
        regions_ptr: int,
        num_regions: int,
        staging_ptr: int,
        block_bytes: int,
        gpu_ids: Sequence[int] | np.ndarray[Any, np.dtype[np.int64]],
        *,
        to_staging: bool,
    ) -> None:
        n = len(gpu_ids)
        if n > MAX_IDS:
            raise BackendError(f"one staging launch takes at most {MAX_IDS} blocks, got {n}")
        if n == 0:
            return
        self._scalars[0] = regions_ptr
        self._scalars[1] = staging_ptr
        self._scalars[2] = block_bytes
        self._ints[0] = num_regions
        self._ints[1] = n
        self._ints[2] = 1 if to_staging else 0
        self._ids[:n] = gpu_ids
        grid = min(self.max_ctas, -(-n * num_regions // WARPS))
        (err,) = cu.cuLaunchKernel(
            self.function, grid, 1, 1, THREADS, 1, 1, 0, stream, self._pointers, 0
        )
        if err:
            check((err,), "cuLaunchKernel(kvf_stage)")

    def unload(self) -> None:
        check(cu.cuModuleUnload(self.module), "cuModuleUnload")


__all__ = [
    "COPY_PAGE",
    "MAX_IDS",
    "PIECE_BYTES",
    "SOURCE",
    "THREADS",
    "WARPS",
    "StageKernel",
    "compile_cubin",
]
