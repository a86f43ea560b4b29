"""The GPU block view: kvflow's ``GpuCacheView`` over vLLM's GPU ``BlockPool``, keyed (the lazy
policy reads a free block's content from vLLM's own block hash) where vLLM's hashes are kvflow's
keys."""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvflow.core.gpu_view import BlockKey

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


class VLLMKeyedGpuCacheView(VLLMGpuCacheView):
    """A ``KeyedGpuCacheView`` over vLLM's pool: for when vLLM hashes every request at every
    offloaded group's block size, so a request's ``block_hashes`` are kvflow's CPU keys and a
    cached block's ``block_hash`` is one of them with vLLM's group id appended (4 bytes, big
    endian). ``groups`` maps vLLM's group ids to kvflow's group indices (offloaded groups only).
    """

    __slots__ = ("_groups",)

    def __init__(self, block_pool: BlockPool, groups: Mapping[int, int]) -> None:
        super().__init__(block_pool)
        self._groups = {gid.to_bytes(4, "big"): g for gid, g in groups.items()}

    def block_key(self, block_id: int) -> BlockKey | None:
        h = self._blocks[block_id].block_hash
        if h is None:
            return None
        g = self._groups.get(h[-4:])
        return None if g is None else (g, h[:-4])

    def scan_free(
        self, after: int | None, limit: int
    ) -> tuple[list[int], list[tuple[int, BlockKey]]]:
        queue = self._queue
        if after is None:
            block = queue.fake_free_list_head.next_free_block
        else:
            block = self._blocks[after]
            if block.ref_cnt or block.is_null:
                return [], []
            block = block.next_free_block
        tail = queue.fake_free_list_tail
        groups = self._groups
        ids: list[int] = []
        keyed: list[tuple[int, BlockKey]] = []
        # One loop over vLLM's linked list: the lazy walk's per-block cost, so no calls in it.
        while block is not None and block is not tail and limit > 0:
            limit -= 1
            bid = block.block_id
            ids.append(bid)
            h = block.block_hash
            if h is not None:
                g = groups.get(h[-4:])
                if g is not None:
                    keyed.append((bid, (g, h[:-4])))
            block = block.next_free_block
        return ids, keyed

    def first_free_in(self, block_ids: Container[int]) -> int | None:
        queue = self._queue
        block = queue.fake_free_list_head.next_free_block
        tail = queue.fake_free_list_tail
        while block is not None and block is not tail:
            if block.block_id in block_ids:
                return int(block.block_id)
            block = block.next_free_block
        return None

    def keyed_blocks(self) -> Iterator[tuple[int, BlockKey]]:
        for block in self._blocks:
            key = None if block.is_null else self.block_key(block.block_id)
            if key is not None:
                yield int(block.block_id), key


__all__ = ["VLLMGpuCacheView", "VLLMKeyedGpuCacheView"]
