"""The scheduler's read-mostly view of the engine's GPU block pool, for the lazy store policy.

The lazy policy walks the engine's GPU free queue from its eviction end and stores the blocks that
are about to be evicted. The queue belongs to the engine, so the manager sees it only through
``GpuCacheView``: kvflow's own ``BlockPool`` through ``BlockPoolGpuView``, vLLM's block pool
through an adapter in the connector. Block ids are unique across KV cache groups (one shared pool,
as in vLLM).
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable
from typing import Protocol, runtime_checkable

from kvflow.core.block_pool import BlockPool
from kvflow.core.hashing import BlockHash

BlockKey = tuple[int, BlockHash]
"""A block's content as the CPU tier keys it: (kvflow group, block hash)."""


@runtime_checkable
class GpuCacheView(Protocol):
    """What the lazy store policy needs from the engine's GPU block pool."""

    def first_free(self) -> int | None:
        """Id of the free block that would be evicted next, or None if none is free."""
        ...

    def next_free(self, block_id: int) -> int | None:
        """Id of the free block evicted after ``block_id``; None at the end or if it is not free."""
        ...

    def is_free(self, block_id: int) -> bool:
        """Whether the block is in the free queue (no request or copy holds it)."""
        ...

    def block_hash(self, block_id: int) -> Hashable | None:
        """The engine's own prefix-cache key of the block, or None if it caches nothing."""
        ...

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one reference on each block, so the engine cannot reuse it under a copy."""
        ...

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop a reference taken with ``touch``."""
        ...


@runtime_checkable
class KeyedGpuCacheView(GpuCacheView, Protocol):
    """A ``GpuCacheView`` whose engine hashes are kvflow's CPU keys (vLLM hashing every request
    at every offloaded group's block size): the lazy policy reads what a free block holds from
    the engine's block itself, so it records nothing per request and step."""

    def block_key(self, block_id: int) -> BlockKey | None:
        """The kvflow group and hash of the block's content, from the engine's own hash; None
        if the engine caches nothing in it or kvflow does not offload its group."""
        ...

    def scan_free(
        self, after: int | None, limit: int
    ) -> tuple[list[int], list[tuple[int, BlockKey]]]:
        """Up to ``limit`` free blocks in eviction order, from the queue head (``after`` None) or
        past the free block ``after`` (none if it is not free); and, of those, the ones with a
        key, as ``(block id, key)`` in the same order."""
        ...

    def first_free_in(self, block_ids: Container[int]) -> int | None:
        """The first free block, from the queue head, that is in ``block_ids``; None if none."""
        ...

    def keyed_blocks(self) -> Iterable[tuple[int, BlockKey]]:
        """Every block with a key, as ``(block id, key)`` (read at a cache reset only)."""
        ...


class BlockPoolGpuView:
    """``GpuCacheView`` over a kvflow ``BlockPool`` (the reference engine's GPU pool, and tests)."""

    __slots__ = ("_blocks", "_pool", "_queue")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._blocks = pool.blocks
        self._queue = pool.free_queue

    def first_free(self) -> int | None:
        block = self._queue.first()
        return None if block is None else block.block_id

    def next_free(self, block_id: int) -> int | None:
        block = self._blocks[block_id]
        if block.ref_cnt:
            return None
        nxt = self._queue.next_of(block)
        return None if nxt is None else nxt.block_id

    def is_free(self, block_id: int) -> bool:
        return self._blocks[block_id].ref_cnt == 0

    def block_hash(self, block_id: int) -> Hashable | None:
        return self._blocks[block_id].block_hash

    def touch(self, block_ids: Iterable[int]) -> None:
        self._pool.touch(block_ids)

    def free(self, block_ids: Iterable[int]) -> None:
        self._pool.free(block_ids)


__all__ = ["BlockKey", "BlockPoolGpuView", "GpuCacheView", "KeyedGpuCacheView"]
