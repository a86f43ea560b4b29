"""The GPU block view: kvflow's ``GpuCacheView`` over vLLM's GPU ``BlockPool``."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool


class VLLMGpuCacheView:
    """kvflow's ``GpuCacheView`` (what the lazy store policy reads) over vLLM's GPU ``BlockPool``.

    Walks vLLM's own intrusive free list in eviction order; allocates nothing per call.
    """

    __slots__ = ("_blocks", "_pool", "_queue")

    def __init__(self, block_pool: BlockPool) -> None:
        self._pool = block_pool
        self._blocks = block_pool.blocks
        self._queue = block_pool.free_block_queue

    def _id_or_none(self, block: Any) -> int | None:
        if block is None or block is self._queue.fake_free_list_tail:
            return None
        return int(block.block_id)

    def first_free(self) -> int | None:
        return self._id_or_none(self._queue.fake_free_list_head.next_free_block)

    def next_free(self, block_id: int) -> int | None:
        block = self._blocks[block_id]
        if block.ref_cnt or block.is_null:
            return None
        return self._id_or_none(block.next_free_block)

    def is_free(self, block_id: int) -> bool:
        block = self._blocks[block_id]
        return not block.ref_cnt and not block.is_null

    def block_hash(self, block_id: int) -> Hashable | None:
        block = self._blocks[block_id]
        return None if block.is_null else block.block_hash

    def touch(self, block_ids: Iterable[int]) -> None:
        self._pool.touch([self._blocks[b] for b in block_ids])

    def free(self, block_ids: Iterable[int]) -> None:
        self._pool.free_blocks([self._blocks[b] for b in block_ids])

    def iter_free(self) -> Iterator[int]:
        """Every free block id in eviction order (tests and diagnostics)."""
        block_id = self.first_free()
        while block_id is not None:
            yield block_id
            block_id = self.next_free(block_id)


__all__ = ["VLLMGpuCacheView"]
