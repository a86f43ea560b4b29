"""Helpers of the CUDA plan tests: a simulated flat address space, a FlashAttention-style
region table in it, and copies applied to it as the DMA engine would."""

from __future__ import annotations

import numpy as np

from kvflow.backends.cuda.plan import Copies, Pitched, RegionTable
from kvflow.core.layout import TensorDesc, derive_layout

GPU_BASE = 1 << 20  # simulated address space: [GPU regions | CPU tier | staging]


def tdesc(
    name: str, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, ptr: int
) -> TensorDesc:
    return TensorDesc(
        name=name, shape=shape, strides=strides, itemsize=itemsize, data_ptr=ptr, device="cuda:0"
    )


def flash_table(num_layers: int, num_blocks: int, page: int) -> RegionTable:
    """A FlashAttention-style layout: per layer (2, N, page) placed back to back at GPU_BASE."""
    tensors = {}
    ptr = GPU_BASE
    for i in range(num_layers):
        name = f"layer{i}"
        tensors[name] = tdesc(name, (2, num_blocks, page), (num_blocks * page, page, 1), 1, ptr)
        ptr += 2 * num_blocks * page
    return RegionTable.from_group(derive_layout(tensors, num_blocks).groups[0])


def apply(memory: np.ndarray, desc: Copies, offset_dst: int = 0, offset_src: int = 0) -> None:
    """Run a batch of copies (2D copies row by row) on a simulated flat address space."""
    if isinstance(desc, Pitched):
        desc = desc.row_copies()
    for d, s, n in zip(*desc.lists(), strict=True):
        memory[d + offset_dst : d + offset_dst + n] = memory[s + offset_src : s + offset_src + n]


def reference_block(memory: np.ndarray, table: RegionTable, gpu_id: int) -> np.ndarray:
    """The bytes a block-major CPU block must hold for GPU block ``gpu_id``."""
    pages = [
        memory[int(b) + gpu_id * int(st_) : int(b) + gpu_id * int(st_) + int(p)]
        for b, st_, p in zip(table.base, table.stride, table.page, strict=True)
    ]
    return np.concatenate(pages)


def simulated_memory(table: RegionTable, blocks_per_slot: int) -> tuple[np.ndarray, int, int, int]:
    """A flat address space for ``table``'s GPU regions, a CPU tier of 8 blocks more than the
    GPU's and two staging slots: (memory, CPU tier base, CPU blocks, staging base)."""
    gpu_bytes = int((table.stride * table.num_blocks).sum())
    cpu_base = GPU_BASE + gpu_bytes
    cpu_blocks = table.num_blocks + 8
    staging = cpu_base + cpu_blocks * table.block_bytes
    memory = np.zeros(staging + 2 * blocks_per_slot * table.block_bytes, dtype=np.uint8)
    return memory, cpu_base, cpu_blocks, staging


def assert_within_chunks(
    host: np.ndarray, size: np.ndarray, cpu_base: int, block_bytes: int, chunk_blocks: int
) -> None:
    """Every copy's CPU-side bytes lie inside one pinned chunk of ``chunk_blocks`` blocks (the
    driver refuses a copy over two separately pinned ranges); 0 means one chunk."""
    if chunk_blocks <= 0:
        return
    for at, n in zip(host.tolist(), size.tolist(), strict=True):
        first = (at - cpu_base) // block_bytes
        last = (at + n - 1 - cpu_base) // block_bytes
        assert first // chunk_blocks == last // chunk_blocks, (at, n, chunk_blocks)


def run_ids(lengths: list[int], gaps: list[int]) -> np.ndarray:
    """CPU ids in ascending runs of ``lengths`` blocks, ``gaps[i]`` ids skipped before run i."""
    ids: list[int] = []
    at = 0
    for n, gap in zip(lengths, gaps, strict=True):
        at += gap
        ids += range(at, at + n)
        at += n
    return np.array(ids, dtype=np.int64)
