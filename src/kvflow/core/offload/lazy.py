"""The lazy store policy's cursor over the GPU free queue: blocks are stored only when they near
its eviction end.

``LazyCursor.record`` remembers what each completed GPU block holds; ``walk`` returns the
blocks of the queue's covered prefix the CPU tier lacks, as one ``StoreBatch`` for the ledger.
Over a ``KeyedGpuCacheView`` (the engine's hashes are kvflow's keys) nothing is recorded: the
walk reads each free block's key from the engine, so the policy's work per step is the walk's.
"""

from __future__ import annotations

from collections.abc import Container, Hashable, Iterable, Sequence

from kvflow.core.gpu_view import BlockKey, GpuCacheView, KeyedGpuCacheView
from kvflow.core.hashing import BlockHash
from kvflow.core.logs import debug_enabled, get_logger
from kvflow.core.offload.config import Geometry
from kvflow.core.offload.state import RequestState, StoreBatch, next_boundary
from kvflow.core.protocol import GroupBlockIds
from kvflow.core.run_pool import RunBlockPool

log = get_logger("kvflow.scheduler")


class LazyCursor:
    """The covered prefix of the GPU free queue and the content records it is built from.

    The cursor is the last covered block; every block from the queue head to it is covered
    (stored, being stored, or holding nothing worth storing). It survives steps: blocks the
    engine takes leave ``_ahead`` (``taken``), freed hashed blocks join behind the cursor. It
    resets, and the next walk starts from the head, when its block is reused, or when a CPU
    eviction or a failed store may have uncovered a block ahead of it. Blocks the engine took
    without the cursor being told (a keyed view's engine passes no steady-decode allocations)
    leave ``_ahead`` when the walk finds them no longer free at the covered prefix's head.
    """

    def __init__(
        self,
        geometry: Geometry,
        cpu: Sequence[RunBlockPool],
        storing: Sequence[dict[BlockHash, int]],
        view: GpuCacheView,
        *,
        null_block_id: int | None,
        watermark: int,
        num_gpu_blocks: int | None = None,
    ) -> None:
        self._geo = geometry
        self._num_gpu_blocks = num_gpu_blocks
        self._cpu = cpu
        self._storing = storing
        self._view = view
        self._null = null_block_id
        self._watermark = watermark
        # GPU block → (group, kvflow hash, engine hash when recorded, None if not yet set).
        self._record: dict[int, tuple[int, BlockHash, Hashable | None]] = {}
        self._cursor: int | None = None  # the last covered block of the GPU free queue
        self._cursor_hash: Hashable | None = None  # its engine hash when the walk passed it
        self._ahead: set[int] = set()  # free blocks from the queue head to the cursor
        self._order: list[int] = []  # ``_ahead``'s blocks in walk order (and stale ones)
        self._keyed: KeyedGpuCacheView | None = (
            view if isinstance(view, KeyedGpuCacheView) else None
        )
        # Keyed: blocks whose content predates the last reset (block → its key then).
        self._stale: dict[int, BlockKey] = {}
        # Recorded: the same blocks, never recorded until the engine takes them fresh.
        self._stale_ids: set[int] = set()
        # Keyed: the covered prefix was last extended by ``follow`` (a reset pending), so the
        # next walk starts from the queue head again.
        self._following = False

    @property
    def keyed(self) -> bool:
        """Whether the walk reads what a free block holds from the engine (nothing recorded)."""
        return self._keyed is not None

    def record(self, sts: Sequence[RequestState]) -> None:
        """Advance the requests' cursors to their confirmed blocks, recording what each block
        passed holds."""
        if self._keyed is not None:
            # What a block holds is read from the engine at the walk; the requests' cursors
            # are not used (the engine passes no steady-decode steps).
            return
        if self._geo.num_groups == 1:
            self._record_one(sts)
        else:
            self._record_groups(sts)

    def _record_groups(self, sts: Sequence[RequestState]) -> None:
        geo = self._geo
        view = self._view
        record = self._record
        null = self._null
        stale = self._stale_ids  # a GPU prefix hit on a block computed before the last reset
        for st in sts:
            if st.hashing:
                st.hash_confirmed()
            confirmed = st.confirmed
            st.next_boundary = next_boundary(confirmed, geo.block_sizes)
            cursor = st.cursor
            for g, bs in geo.group_sizes:
                done = confirmed // bs
                cur = cursor[g]
                if done <= cur:
                    continue
                cursor[g] = done
                ids = st.table[g]
                hs = st.hash_lists[geo.slot[g]]
                for i in range(cur, done):
                    b = ids[i]
                    if b != null and not (stale and b in stale):
                        record[b] = (g, hs[i], view.block_hash(b))

    def _record_one(self, sts: Sequence[RequestState]) -> None:
        """``record`` for one KV cache group (most models), its group loop unrolled: it runs
        once per request with a completed block. The property test
        ``test_one_group_record_equals_the_general_one`` holds the two to the same result."""
        bs = self._geo.block_sizes[0]
        slot = self._geo.slot[0]
        block_hash = self._view.block_hash
        record = self._record
        null = self._null
        stale = self._stale_ids  # a GPU prefix hit on a block computed before the last reset
        for st in sts:
            if st.hashing:
                st.hash_confirmed()
            done = st.confirmed // bs
            st.next_boundary = (done + 1) * bs
            cursor = st.cursor
            cur = cursor[0]
            if done <= cur:
                continue
            cursor[0] = done
            ids = st.table[0]
            hs = st.hash_lists[slot]
            for i in range(cur, done):
                b = ids[i]
                if b != null and not (stale and b in stale):
                    record[b] = (0, hs[i], block_hash(b))

    def forget(self) -> None:
        """Drop every content record (a cache reset): no block computed before it is stored."""
        self._record.clear()
        if self._keyed is not None:
            # Rare (a reset): one pass over the engine's hashed blocks.
            self._stale = dict(self._keyed.keyed_blocks())
        elif self._num_gpu_blocks is not None:
            # The engine's prefix cache may keep them (vLLM's GPU reset fails while requests
            # run): a request that hits one there must not have it recorded under its hashes.
            block_hash, null = self._view.block_hash, self._null
            self._stale_ids = {
                b for b in range(self._num_gpu_blocks) if b != null and block_hash(b) is not None
            }

    def reset(self, cause: str) -> None:
        """Nothing is covered any more: the next walk starts from the queue head."""
        if (self._cursor is not None or self._ahead) and debug_enabled():
            log.debug("offload_lazy_cursor_reset", cause=cause, covered=len(self._ahead))
        self._cursor = None
        self._cursor_hash = None
        self._ahead.clear()
        self._order.clear()

    @property
    def has_stale(self) -> bool:
        """Whether blocks whose content predates the last reset are marked."""
        return bool(self._stale) or bool(self._stale_ids)

    def taken(self, ids: Sequence[int], keep: Container[int] = ()) -> None:
        """The engine took these GPU blocks (allocation or prefix hit): they left the free queue,
        and what was recorded of their content no longer holds. ``keep``: the GPU prefix hits
        among them, whose content stays what it was (a pre-reset mark stays on them)."""
        record = self._record
        if record:
            # A block handed to a request may be refilled (a fresh allocation, a load) before
            # kvflow sees its new owner's tokens: a walk trusting the old record would store the
            # new content under the old hash. The new owner's ``record`` records it again.
            for b in ids:
                record.pop(b, None)
        stale = self._stale
        if stale:
            for b in ids:
                if b not in keep:
                    stale.pop(b, None)  # its next content is computed after the reset
        stale_ids = self._stale_ids
        if stale_ids:
            stale_ids.difference_update(b for b in ids if b not in keep)
        ahead = self._ahead
        if not ahead:
            return
        for b in ids:
            if b in ahead:
                ahead.discard(b)
                if b == self._cursor:
                    self.reset("cursor_block_taken")
                    return

    def taken_tables(self, tables: Iterable[GroupBlockIds], keep: Container[int] = ()) -> None:
        """``taken`` for every group of every table in ``tables``, in one call (a plan hands
        over a step's new blocks of all requests at once)."""
        pop = self._record.pop
        ahead = self._ahead
        if self._stale or self._stale_ids:
            tables = list(tables)
            stale_ids = self._stale_ids
            for ids in tables:
                for group_ids in ids:
                    for b in group_ids:
                        if b not in keep:
                            # Its next content is computed after the reset.
                            self._stale.pop(b, None)
                            stale_ids.discard(b)
        for ids in tables:
            for group_ids in ids:
                for b in group_ids:
                    pop(b, None)
                    # After a reset ``ahead`` is empty: the rest only drop records, as ``taken``.
                    if b in ahead:
                        ahead.discard(b)
                        if b == self._cursor:
                            self.reset("cursor_block_taken")

    def walk(self) -> StoreBatch | None:
        """Extend the covered prefix of the GPU free queue to ``watermark`` blocks; returns the
        hashed blocks in it that the CPU tier lacks (None if there are none)."""
        if self._keyed is not None:
            return self._walk_keyed(self._keyed)
        view = self._view
        cursor = self._valid_cursor()
        budget = self._watermark - len(self._ahead)
        if budget <= 0:
            return None
        picked: list[dict[BlockHash, int]] = [{} for _ in range(self._geo.num_groups)]
        bid = view.first_free() if cursor is None else view.next_free(cursor)
        last = self._walk_recorded(bid, budget, picked)
        return self._picked(picked, last, cursor)

    def _valid_cursor(self) -> int | None:
        """The cursor, or None after a reset if its block left the free queue or was refilled."""
        cursor = self._cursor
        if cursor is not None:
            view = self._view
            if not view.is_free(cursor) or view.block_hash(cursor) != self._cursor_hash:
                self.reset("cursor_block_reused")
                return None
        return cursor

    def _picked(
        self, picked: list[dict[BlockHash, int]], last: int | None, cursor: int | None
    ) -> StoreBatch | None:
        """The walk's end: ``last`` becomes the cursor; the picked blocks as one batch."""
        if last is not None and last != cursor:
            self._cursor, self._cursor_hash = last, self._view.block_hash(last)
        if not any(picked):
            return None
        ahead = self._ahead
        for p in picked:
            # A picked block leaves the free queue while its store holds it; it comes back
            # behind the cursor, already covered.
            ahead.difference_update(p.values())
        return StoreBatch(picked, [[None] * len(p) for p in picked])

    def _prune(self) -> int:
        """Drop the blocks the engine took unseen from the covered prefix; the walk's budget
        after it. The engine allocates from the queue's head (unhashed blocks it frees go
        before the covered ones and are taken first), so the covered blocks still free are
        ``order``'s tail from the first of them the view finds from the head: every block
        before it in ``order`` is gone. No check per block gone, only the bulk drop."""
        assert self._keyed is not None
        ahead = self._ahead
        order = self._order
        if len(order) != len(ahead):
            # Every block of ``ahead`` has an entry; more entries are stale: blocks that left
            # the prefix (picked for a store, ``taken``), some of them walked again since.
            order = self._order = self._compacted()
        first = self._keyed.first_free_in(ahead)
        k = len(order) if first is None else order.index(first)
        if k:
            gone = order[:k]
            del order[:k]
            ahead.difference_update(gone)
            stale = self._stale
            if stale:
                for b in gone:
                    stale.pop(b, None)  # taken: its next content is computed after the reset
        return self._watermark - len(ahead)

    def _compacted(self) -> list[int]:
        """``order`` with one entry per block of ``ahead``: its last, where the walk that covered
        it last put it (an earlier entry is from before it left the free queue and came back
        behind the cursor), so that the list is the covered prefix in queue order again."""
        ahead = self._ahead
        seen: set[int] = set()
        kept = []
        for b in reversed(self._order):
            if b in ahead and b not in seen:
                seen.add(b)
                kept.append(b)
        kept.reverse()
        return kept

    def follow(self) -> None:
        """A step while a cache reset is pending (no walk picks a block then), over a keyed
        view: the covered prefix still follows the free queue's head, so that a block the
        engine takes there untold (a keyed view's engine passes no steady-decode allocations)
        is known taken, as ``taken`` knows a told one, and its pre-reset key stops marking what
        it holds next. Nothing is picked; the next ``walk`` starts from the head again. Without
        this, a block taken during the pending reset and refilled with the same tokens stayed
        stale, and its post-reset content was never stored."""
        keyed = self._keyed
        if keyed is None:
            return  # every take is told: ``taken`` keeps the records and the prefix exact
        cursor = self._valid_cursor()
        budget = self._prune() if self._ahead else self._watermark
        self._following = True
        if budget <= 0:
            return
        ids, _ = keyed.scan_free(cursor, budget)
        if ids:
            self._ahead.update(ids)
            self._order.extend(ids)
            self._cursor, self._cursor_hash = ids[-1], keyed.block_hash(ids[-1])

    def _walk_keyed(self, keyed: KeyedGpuCacheView) -> StoreBatch | None:
        """``walk`` over a keyed view: up to the budget of free blocks past the cursor, read
        from the engine in one ``scan_free`` (the blocks, and the keys of those holding one).
        In steady decode every step lands here, and most scans find no key: that case builds
        nothing."""
        if self._following:
            # The blocks ``follow`` covered were passed over without being picked.
            self._following = False
            if self._ahead:
                self._prune()  # the last takes of the pending reset's steps, before forgetting
            self.reset("reset_settled")
        cursor = self._valid_cursor()
        ahead = self._ahead
        # Only a keyed view's engine takes blocks without telling (``taken`` is exact else):
        # counting such blocks as covered would cover fewer than the watermark.
        budget = self._prune() if ahead else self._watermark
        if budget <= 0:
            return None
        ids, found = keyed.scan_free(cursor, budget)
        if not ids:
            return None  # the steady state: every free block is covered
        ahead.update(ids)
        self._order.extend(ids)
        if not found:
            # The steady state's walk: nothing to store, the last block scanned is the cursor.
            end = ids[-1]
            self._cursor, self._cursor_hash = end, keyed.block_hash(end)
            return None
        picked: list[dict[BlockHash, int]] = [{} for _ in range(self._geo.num_groups)]
        stale = self._stale
        storing = self._storing
        cpu = self._cpu
        for bid, (g, h) in found:
            if stale and bid in stale:
                if stale[bid] == (g, h):
                    continue  # computed before the last reset: never stored
                del stale[bid]
            if h not in storing[g] and h not in picked[g] and not cpu[g].is_cached(h):
                picked[g][h] = bid
        # The cursor is the last block passed over and not picked (a picked one leaves the
        # free queue while it is stored).
        taken = {b for p in picked for b in p.values()}
        last = next((b for b in reversed(ids) if b not in taken), cursor)
        return self._picked(picked, last, cursor)

    def _walk_recorded(
        self, bid: int | None, budget: int, picked: list[dict[BlockHash, int]]
    ) -> int | None:
        """The walk over the content records; returns the last block passed over and not
        picked (the new cursor), None if none."""
        view = self._view
        ahead = self._ahead
        record = self._record
        null = self._null
        last = self._cursor
        while bid is not None:
            budget -= 1
            ahead.add(bid)
            rec = record.get(bid) if bid != null else None
            engine_hash = None if rec is None else view.block_hash(bid)
            # A block the engine refilled behind our back has a new engine hash: not ours to store.
            if rec is not None and engine_hash is not None and rec[2] in (None, engine_hash):
                g, h, _ = rec
                if (
                    h not in self._storing[g]
                    and h not in picked[g]
                    and not self._cpu[g].is_cached(h)
                ):
                    picked[g][h] = bid
                else:
                    last = bid
            else:
                last = bid
            if budget <= 0:
                break
            bid = view.next_free(bid)
        return last


__all__ = ["LazyCursor"]
