"""GPU block accounting for the engine's scheduler: block tables, prefix caching, sliding windows.

One ``kvflow.core.block_pool.BlockPool`` shared by every KV cache group (as in vLLM), block 0 held
forever as the null block, so a block id names one block whatever its group: transfers, invalid
block reports and the offload manager's GPU references need no group to go with an id. A group's
prefix-cache key is the block hash tagged with the group id (group 0: the hash alone). A request's
table in a full-attention group covers every position; in a sliding-window group, blocks wholly
before the window of the next query are freed and replaced by the null block. Prefix hits use the
request's chained block hashes: a full-attention group needs every block of the prefix cached, a
sliding-window group only the blocks inside the window at the hit point; the hit is the longest
length every group agrees on. Blocks enter the prefix cache once computed (after the step that
wrote them), so a block is never matched before its data exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice

from kvflow.connector.api import NULL_BLOCK_ID, KVCacheConfig, KVCacheGroupSpec
from kvflow.core.block_pool import BlockPool
from kvflow.core.gpu_view import BlockPoolGpuView
from kvflow.core.hashing import BlockHash
from kvflow.core.logs import get_logger
from kvflow.core.protocol import GroupBlockIds
from kvflow.errors import BlockPoolError

log = get_logger("kvflow.engine.blocks")


def _first_needed_block(group: KVCacheGroupSpec, num_computed: int, block_size: int) -> int:
    """Index of the first block the query at position ``num_computed`` can still see."""
    if group.sliding_window is None:
        return 0
    return max(0, num_computed - group.sliding_window + 1) // block_size


class BlockManager:
    """Per-request block tables over one pool per KV cache group."""

    def __init__(self, config: KVCacheConfig, *, enable_prefix_caching: bool = True) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, name="gpu")
        # Bumped whenever blocks come free or enter or leave the prefix cache: until it moves,
        # a request that could not get blocks cannot get them (the scheduler skips asking).
        self.changes = 0
        # One entry per group, all the same pool: per-group code reads naturally.
        self.pools = [self.pool] * len(config.groups)
        (null,) = self.pool.get_new_blocks(1)
        if null != NULL_BLOCK_ID:  # pragma: no cover - a fresh pool hands out block 0 first
            raise BlockPoolError(f"gpu: expected block {NULL_BLOCK_ID} first, got {null}")
        self.tables: dict[str, list[list[int]]] = {}
        # ``block_ids`` of each request as last handed out, dropped whenever its tables change:
        # a decode step asks for every running request's tables, which change once a block.
        self._ids: dict[str, GroupBlockIds] = {}
        self._full_attention = all(g.sliding_window is None for g in config.groups)
        self._nothing_added: GroupBlockIds = tuple(() for _ in config.groups)
        self._num_cached: dict[str, list[int]] = {}
        # Poison-on-free (``EngineConfig.poison_freed_blocks``): called with the blocks a free
        # left with no reference, after they left the prefix cache (their data is gone).
        self.on_freed: Callable[[list[int]], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.config.num_blocks - 1

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def gpu_view(self) -> BlockPoolGpuView:
        """The offload manager's view of the shared GPU pool (free queue, refs)."""
        return BlockPoolGpuView(self.pool)

    @staticmethod
    def cache_key(group: int, block_hash: BlockHash) -> BlockHash:
        """The prefix-cache key of a block of ``group``: one pool serves every group. Group 0's
        is the hash itself, so the common one-group model keys nothing; another group's is the
        hash tagged with its id, longer than any hash, so it never meets a group 0 key."""
        return block_hash + group.to_bytes(2, "little") if group else block_hash

    def block_ids(self, request_id: str) -> GroupBlockIds:
        ids = self._ids.get(request_id)
        if ids is None:
            tables = self.tables.get(request_id)
            if tables is None:
                return self._nothing_added
            ids = self._ids[request_id] = tuple(tuple(t) for t in tables)
        return ids

    # ---- prefix hits ------------------------------------------------------------------------

    def find_prefix_hit(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> list[list[int]]:
        """Per group, the table of the longest cached prefix that leaves at least one token of
        ``num_tokens`` to compute (the last token's logits are needed). Touches nothing."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.pools]
        max_blocks = min(len(block_hashes), (num_tokens - 1) // self.block_size)
        if self._full_attention:
            return self._full_hit(block_hashes, max_blocks)
        hashes = block_hashes[:max_blocks]
        n = max_blocks
        keyed = [[self.cache_key(g.group_id, h) for h in hashes] for g in self.config.groups]
        for group, pool in zip(self.config.groups, self.pools, strict=True):
            if group.sliding_window is None:
                n = min(n, len(pool.find_longest_prefix(keyed[group.group_id][:n])))
        for group, pool in zip(self.config.groups, self.pools, strict=True):
            if group.sliding_window is not None:
                n = self._sliding_hit(group, pool, keyed[group.group_id], n)
        tables: list[list[int]] = []
        for group, pool in zip(self.config.groups, self.pools, strict=True):
            first = _first_needed_block(group, n * self.block_size, self.block_size)
            table = [NULL_BLOCK_ID] * first
            for h in keyed[group.group_id][first:n]:
                bid = pool.get_cached_block(h)
                assert bid is not None
                table.append(bid)
            tables.append(table)
        return tables

    def _full_hit(self, block_hashes: Sequence[BlockHash], limit: int) -> list[list[int]]:
        """``find_prefix_hit`` where every group is full attention: each group's cached prefix,
        walked only as far as the groups before it hit (a prompt's blocks past its hit, most of
        a long one, are never keyed), then cut to the shortest."""
        table = self.pool.find_longest_prefix(islice(block_hashes, limit))
        tables = [table]
        n = len(table)
        key = self.cache_key
        for g in range(1, len(self.pools)):
            table = self.pool.find_longest_prefix(key(g, h) for h in islice(block_hashes, n))
            tables.append(table)
            n = len(table)
        return [t[:n] if len(t) > n else t for t in tables]

    def _sliding_hit(
        self, group: KVCacheGroupSpec, pool: BlockPool, hashes: Sequence[BlockHash], limit: int
    ) -> int:
        """Largest ``n <= limit`` whose window blocks at position ``n * block_size`` are cached."""
        run = 0  # cached blocks ending at index i - 1
        runs = [0]
        for h in hashes[:limit]:
            run = run + 1 if pool.is_cached(h) else 0
            runs.append(run)
        for n in range(limit, 0, -1):
            if runs[n] >= n - _first_needed_block(group, n * self.block_size, self.block_size):
                return n
        return 0

    # ---- allocation -------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        num_computed: int,
        num_new_tokens: int,
        prefix_hit: list[list[int]] | None = None,
        *,
        applied: int | None = None,
    ) -> GroupBlockIds | None:
        """Grow the request's tables to cover ``num_computed + num_new_tokens`` positions.

        ``prefix_hit`` (at admission only) becomes the start of the tables. ``applied``: the
        tokens whose step output was applied, when fewer than ``num_computed`` (a step scheduled
        ahead): sliding-window blocks are freed only behind them, once they were cached.
        Returns the blocks newly added per group (the whole tables at admission), or None,
        changing nothing, when a group has too few free blocks.
        """
        admitting = prefix_hit is not None
        if not admitting and self._full_attention:
            # The common decode step: the tables already cover the new token (15 steps of 16).
            total = -(-(num_computed + num_new_tokens) // self.block_size)
            if all(len(t) >= total for t in self.tables[request_id]):
                return self._nothing_added
        if admitting:
            assert prefix_hit is not None
            if request_id in self.tables:
                raise BlockPoolError(f"request {request_id} already holds blocks")
            tables = [list(t) for t in prefix_hit]
        else:
            tables = self.tables[request_id]
            self.free_skipped(request_id, num_computed if applied is None else applied)
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        plans: list[tuple[int, int]] = []  # (nulls to append, new blocks to append) per group
        needed = 0  # free blocks this allocation takes from the shared pool, all groups
        for g, (group, pool) in enumerate(zip(self.config.groups, self.pools, strict=True)):
            have = len(tables[g])
            first = _first_needed_block(group, num_computed, self.block_size)
            nulls = max(0, min(first, total_blocks) - have)
            new = max(0, total_blocks - have - nulls)
            reused = 0
            if admitting:
                reused = sum(
                    1 for b in tables[g] if b != NULL_BLOCK_ID and pool.block(b).ref_cnt == 0
                )
            needed += new + reused
            plans.append((nulls, new))
        if needed > self.pool.num_free_blocks:
            return None
        if admitting:
            self._num_cached[request_id] = [len(t) for t in tables]
        added: list[tuple[int, ...]] = []
        for g, pool in enumerate(self.pools):
            if admitting:
                pool.touch([b for b in tables[g] if b != NULL_BLOCK_ID])
            nulls, new = plans[g]
            fresh = [NULL_BLOCK_ID] * nulls + pool.get_new_blocks(new)
            tables[g].extend(fresh)
            added.append(tuple(tables[g]) if admitting else tuple(fresh))
        if admitting:
            self.tables[request_id] = tables
        self._ids.pop(request_id, None)
        return tuple(added)

    def free_skipped(self, request_id: str, num_computed: int) -> None:
        """Free sliding-window blocks no future query of the request can see."""
        tables = self.tables[request_id]
        for g, (group, pool) in enumerate(zip(self.config.groups, self.pools, strict=True)):
            first = _first_needed_block(group, num_computed, self.block_size)
            table = tables[g]
            gone = [b for b in table[: min(first, len(table))] if b != NULL_BLOCK_ID]
            if gone:
                self.changes += 1
                self._ids.pop(request_id, None)
                pool.free(reversed(gone))
                self._freed(gone)
                for j in range(min(first, len(table))):
                    table[j] = NULL_BLOCK_ID

    def free(self, request_id: str) -> None:
        """Give back every block of the request, tail first so its tail is evicted first."""
        tables = self.tables.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        self._ids.pop(request_id, None)
        if tables is None:
            return
        self.changes += 1
        for pool, table in zip(self.pools, tables, strict=True):
            pool.free(b for b in reversed(table) if b != NULL_BLOCK_ID)
        if self.on_freed is not None:
            self._freed([b for table in tables for b in table if b != NULL_BLOCK_ID])

    def _freed(self, block_ids: list[int]) -> None:
        """Poison-on-free: the blocks of ``block_ids`` nothing references any more lose their
        cached hash (a prefix hit must not read poison) and go to ``on_freed``."""
        if self.on_freed is None:
            return
        blocks = self.pool.blocks
        dead = list(dict.fromkeys(b for b in block_ids if blocks[b].ref_cnt == 0))
        if dead:
            self.pool.uncache(dead)
            self.on_freed(dead)

    # ---- prefix cache -----------------------------------------------------------------------

    def caches_more(self, request_id: str, num_computed: int) -> bool:
        """Whether ``cache_computed`` at ``num_computed`` could enter a block not entered yet
        (15 decode steps of 16 it cannot, and need not hash the request's tokens to know)."""
        if not self.enable_prefix_caching:
            return False
        return num_computed // self.block_size > min(self._num_cached[request_id])

    def cache_computed(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed: int
    ) -> None:
        """Enter the request's blocks that are now fully computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        tables, done = self.tables[request_id], self._num_cached[request_id]
        full = min(num_computed // self.block_size, len(block_hashes))
        for g, pool in enumerate(self.pools):
            start = done[g]
            if full <= start:
                continue
            pairs = [
                (bid, self.cache_key(g, block_hashes[j]))
                for j, bid in enumerate(tables[g][start:full], start)
                if bid != NULL_BLOCK_ID and pool.block(bid).block_hash is None
            ]
            if pairs:
                self.changes += 1
                pool.cache([p[0] for p in pairs], [p[1] for p in pairs])
            done[g] = full

    def rollback(self, request_id: str, num_computed: int) -> None:
        """The request's KV past ``num_computed`` is invalid: stop counting it as cached."""
        done = self._num_cached.get(request_id)
        if done is not None:
            for g in range(len(done)):
                done[g] = min(done[g], num_computed // self.block_size)

    def can_resume_at(self, request_id: str, num_computed: int) -> bool:
        """Can the request recompute in place from ``num_computed``: every sliding-window block
        it will read or write from there on is a real block, not the null block?"""
        tables = self.tables[request_id]
        for group, table in zip(self.config.groups, tables, strict=True):
            if group.sliding_window is None:
                continue
            first = _first_needed_block(group, num_computed, self.block_size)
            if NULL_BLOCK_ID in table[first:]:
                return False
        return True

    def first_invalid_position(self, request_id: str, invalid: set[int]) -> int | None:
        """Start of the first block of the request listed in ``invalid`` (any group), or None."""
        tables = self.tables.get(request_id)
        if tables is None:
            return None
        first: int | None = None
        for table in tables:
            for j, bid in enumerate(table):
                if bid != NULL_BLOCK_ID and bid in invalid:
                    pos = j * self.block_size
                    first = pos if first is None else min(first, pos)
                    break
        return first

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop invalid blocks from every group's prefix cache (their data is garbage)."""
        self.changes += 1
        self.pool.uncache(
            b for b in block_ids if b != NULL_BLOCK_ID and 0 <= b < self.pool.num_blocks
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refuses while any request holds blocks."""
        if self.tables:
            return False
        self.changes += 1
        self.pool.free([NULL_BLOCK_ID])
        ok = self.pool.reset_prefix_cache()
        self.pool.touch([NULL_BLOCK_ID])
        log.debug("gpu_prefix_cache_reset", ok=ok)
        return ok


__all__ = ["BlockManager"]
