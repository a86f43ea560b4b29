"""The CPU tier's block pool, keeping its free queue as runs of consecutive ids.

``RunBlockPool`` has ``BlockPool``'s semantics with ``ascending_runs`` (the same blocks leave in
the same LRU order, the same hashes are cached and evicted, the same events; the property tests
in ``tests/core/test_run_pool.py`` hold the two to each other), but keeps per-block state in
flat lists and its free queue as a doubly linked list of runs: stretches of the queue whose ids
are consecutive, ascending or descending. A store's blocks leave as runs (``get_new_blocks``) and
go back as one (``release_owned`` in reverse), a load pins and frees a run: each of those is a few
list-slice assignments and dict operations in C per run instead of Python work per block. Any
other shape of input takes a per-block path with the same result.

Blocks are plain ids: ``blocks`` and ``block`` return read-only snapshots (``Block``) for tests.
Every call validates its whole input before changing anything: a ``BlockPoolError`` leaves the
pool exactly as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import cast

from kvflow.core.block_pool import (
    AllBlocksCleared,
    Block,
    BlockRemoved,
    BlockStored,
    PoolEvent,
    PrefixCacheQueries,
    StoredBlockInfo,
    check_cache_input,
    double_free_error,
    stored_event,
)
from kvflow.core.hashing import BlockHash
from kvflow.core.idruns import EVERY_CAP, ascending_runs, every
from kvflow.errors import BlockPoolError, ConfigError


class _Run:
    """Free blocks ``lo .. hi - 1``, next to each other in the free queue: in ascending id order,
    or descending with ``desc`` (a one-block run's ``desc`` means nothing)."""

    __slots__ = ("desc", "hi", "lo", "next", "prev")

    def __init__(self, lo: int, hi: int, desc: bool) -> None:
        self.lo = lo
        self.hi = hi
        self.desc = desc
        self.prev: _Run | None = None
        self.next: _Run | None = None


def _runs(ids: Sequence[int], every: list[int]) -> list[tuple[int, int, int]] | None:
    """``ascending_runs`` within the pool (``every`` is its ``_ids``)."""
    return ascending_runs(ids, every, len(every))


class RunBlockPool(PrefixCacheQueries):
    """Ref-counted blocks, an LRU free queue of id runs and a hash → id prefix cache."""

    __slots__ = (
        "_cached",
        "_events",
        "_hash",
        "_head",
        "_ids",
        "_nones",
        "_refs",
        "_run",
        "_tail",
        "enable_events",
        "name",
        "num_free_blocks",
    )

    def __init__(self, num_blocks: int, *, name: str = "pool", enable_events: bool = False) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"{name}: num_blocks must be positive, got {num_blocks}")
        self.name = name
        self.enable_events = enable_events
        self._events: list[PoolEvent] = []
        self._refs = [0] * num_blocks
        # The ids as int objects made once: ``get_new_blocks`` hands out slices of it, and run
        # checks compare against it, without making an int per block.
        self._ids = (
            every(num_blocks)[:num_blocks] if num_blocks <= EVERY_CAP else list(range(num_blocks))
        )
        self._nones: list[None] = [None] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._head = _Run(-1, -1, False)
        self._tail = _Run(-1, -1, False)
        first = _Run(0, num_blocks, False)
        self._head.next = first
        first.prev = self._head
        first.next = self._tail
        self._tail.prev = first
        self._run: list[_Run | None] = [first] * num_blocks
        self.num_free_blocks = num_blocks

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.num_free_blocks / len(self._refs)

    @property
    def ascending_runs(self) -> bool:
        return True

    def block(self, block_id: int) -> Block:
        """A snapshot of the block with this id; raises ``BlockPoolError`` for an unknown id."""
        self._check_ids((block_id,))
        return Block(block_id, self._refs[block_id], self._hash[block_id])

    @property
    def blocks(self) -> list[Block]:
        """Snapshots of every block (read-only use: tests)."""
        return [Block(i, r, h) for i, (r, h) in enumerate(zip(self._refs, self._hash, strict=True))]

    def free_ids(self) -> Iterator[int]:
        """The free blocks' ids in eviction order (head first)."""
        run = self._head.next
        while run is not None and run is not self._tail:
            yield from range(run.hi - 1, run.lo - 1, -1) if run.desc else range(run.lo, run.hi)
            run = run.next

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Id of the block caching ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def find_longest_prefix(self, block_hashes: Iterable[BlockHash]) -> list[int]:
        """Ids of the cached blocks for the longest prefix of ``block_hashes`` (does not touch)."""
        out: list[int] = []
        cached = self._cached
        for h in block_hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def ids_of(self, block_hashes: Sequence[BlockHash]) -> list[int] | None:
        """The ids of the blocks caching these hashes if every one is cached, else None (one
        pass in C)."""
        try:
            return list(map(self._cached.__getitem__, block_hashes))
        except KeyError:
            return None

    def pin_ids(self, ids: list[int]) -> tuple[int, ...]:
        """``touch_cached`` of hashes whose ids ``ids_of`` just gave (nothing changed since)."""
        self._touch(ids)
        return tuple(ids)

    def none_cached(self, block_hashes: Iterable[BlockHash]) -> bool:
        """Whether none of these hashes is cached (one pass in C)."""
        return self._cached.keys().isdisjoint(block_hashes)

    # ---- the free queue ------------------------------------------------------------------

    def _link(self, run: _Run, prev: _Run) -> None:
        nxt = prev.next
        assert nxt is not None
        run.prev, run.next = prev, nxt
        prev.next = nxt.prev = run

    def _unlink_run(self, run: _Run) -> None:
        prev, nxt = run.prev, run.next
        assert prev is not None
        assert nxt is not None
        prev.next, nxt.prev = nxt, prev

    def _unlink(self, a: int, b: int) -> None:
        """Take the free blocks ``a .. b - 1``, all of one run, out of the queue."""
        run = self._run[a]
        assert run is not None
        assert run is self._run[b - 1]
        lo, hi = run.lo, run.hi
        if a == lo and b == hi:
            self._unlink_run(run)
        elif a == lo:
            run.lo = b
        elif b == hi:
            run.hi = a
        elif a - lo <= hi - b:
            # The smaller side becomes a new run: its ids are relabelled (one slice).
            left = _Run(lo, a, run.desc)
            self._run[lo:a] = [left] * (a - lo)
            run.lo = b
            prev = run if run.desc else run.prev
            assert prev is not None
            self._link(left, prev)
        else:
            right = _Run(b, hi, run.desc)
            self._run[b:hi] = [right] * (hi - b)
            run.hi = a
            prev = run.prev if run.desc else run
            assert prev is not None
            self._link(right, prev)
        self._run[a:b] = [None] * (b - a)
        self.num_free_blocks -= b - a

    def _push(self, lo: int, hi: int, desc: bool, *, head: bool) -> None:
        """Put the blocks ``lo .. hi - 1`` (free now) at the head or the tail of the queue, in
        ascending or descending order, joining the run next to them where ids continue."""
        n = hi - lo
        run = self._head.next if head else self._tail.prev
        assert run is not None
        if run.hi - run.lo and self._join(run, lo, hi, desc, before=head):
            target = run
        else:
            target = _Run(lo, hi, desc)
            prev = self._head if head else run
            self._link(target, prev)
        self._run[lo:hi] = [target] * n
        self.num_free_blocks += n

    @staticmethod
    def _join(run: _Run, lo: int, hi: int, desc: bool, *, before: bool) -> bool:
        """Extend ``run`` by the blocks ``lo .. hi - 1`` placed just before (or after) it in
        the queue, if the ids continue in one direction; returns whether it did."""
        one, single = hi - lo == 1, run.hi - run.lo == 1
        if before:
            end = lo if desc else hi - 1  # the new blocks' last, in queue order
            edge = run.hi - 1 if run.desc else run.lo  # the run's first
            if end + 1 == edge and (single or not run.desc) and (one or not desc):
                run.lo, run.desc = lo, False
                return True
            if end - 1 == edge and (single or run.desc) and (one or desc):
                run.hi, run.desc = hi, True
                return True
            return False
        end = hi - 1 if desc else lo  # the new blocks' first
        edge = run.lo if run.desc else run.hi - 1  # the run's last
        if end == edge + 1 and (single or not run.desc) and (one or not desc):
            run.hi, run.desc = hi, False
            return True
        if end == edge - 1 and (single or run.desc) and (one or desc):
            run.lo, run.desc = lo, True
            return True
        return False

    def _drop_one(self, b: int) -> None:
        """Drop one reference of block ``b`` (checked: it has one); at zero it joins the queue,
        cached at the tail, uncached at the head."""
        refs = self._refs[b] - 1
        self._refs[b] = refs
        if refs == 0:
            self._push(b, b + 1, False, head=self._hash[b] is None)

    # ---- checks --------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> None:
        n = len(self._refs)
        for b in ids:
            if type(b) is not int or not 0 <= b < n:
                raise BlockPoolError(f"{self.name}: unknown block id {b!r}")

    def _check_refs(self, ids: Sequence[int]) -> None:
        """Each listed id (valid) has as many references as it is listed."""
        refs = self._refs
        if len(set(ids)) == len(ids):
            for b in ids:
                if refs[b] < 1:
                    self._double_free(b, 1)
            return
        want: dict[int, int] = {}
        for b in ids:
            want[b] = want.get(b, 0) + 1
        for b, count in want.items():
            if refs[b] < count:
                self._double_free(b, count)

    def _double_free(self, block_id: int, count: int) -> None:
        raise double_free_error(self.name, block_id, self._refs[block_id], count)

    # ---- mutations -----------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Take the first ``n`` free blocks in eviction order (ref count 1), evicting their
        cached hashes; returned ascending by id (``BlockPool``'s ``ascending_runs``)."""
        if n < 0:
            raise BlockPoolError(f"{self.name}: cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise BlockPoolError(
                f"{self.name}: asked for {n} blocks, only {self.num_free_blocks} free"
            )
        record = self.enable_events
        nones = self._nones
        evicted: list[BlockHash] = []
        pieces: list[tuple[int, int]] = []
        cached = self._cached
        hashes = self._hash
        run = self._head.next
        need = n
        while need:
            assert run is not None
            assert run is not self._tail
            nxt = run.next
            lo, hi = run.lo, run.hi
            if hi - lo <= need:
                self._unlink_run(run)
                a, b = lo, hi
            elif run.desc:
                a, b = hi - need, hi
                run.hi = a
            else:
                a, b = lo, lo + need
                run.lo = b
            m = b - a
            need -= m
            hs = hashes[a:b]
            if hs != nones[:m]:
                if run.desc:
                    hs.reverse()  # eviction order
                live = cast("list[BlockHash]", hs) if all(hs) else [x for x in hs if x is not None]
                deque(map(cached.__delitem__, live), 0)  # each del in C
                if record:
                    evicted += live
                hashes[a:b] = nones[:m]
            self._refs[a:b] = [1] * m
            self._run[a:b] = [None] * m
            pieces.append((a, b))
            run = nxt
        self.num_free_blocks -= n
        out: list[int] = []
        for a, b in sorted(pieces) if len(pieces) > 1 else pieces:
            out += self._ids[a:b]
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block, taking free ones out of the free queue (a cache hit)."""
        ids = block_ids if isinstance(block_ids, tuple | list) else list(block_ids)
        self._check_ids(ids)
        self._touch(ids)

    def _touch(self, ids: Sequence[int]) -> None:
        refs = self._refs
        runs = None
        if len(ids) > 1:
            # A hit's ids are ascending where it was stored by one store: sort only otherwise.
            runs = _runs(ids, self._ids) or _runs(sorted(ids), self._ids)
        if runs is None:
            for b in ids:
                if refs[b] == 0:
                    self._unlink(b, b + 1)
                refs[b] += 1
            return
        # Distinct ids (a hit's): the order of touching does not matter, so run by run.
        for lo, hi, _ in runs:
            m = hi - lo
            free = refs[lo:hi].count(0)
            if free == m:
                self._take(lo, hi)
                refs[lo:hi] = [1] * m
            elif not free:
                refs[lo:hi] = [r + 1 for r in refs[lo:hi]]
            else:
                for b in range(lo, hi):
                    if refs[b] == 0:
                        self._unlink(b, b + 1)
                    refs[b] += 1

    def _take(self, a: int, b: int) -> None:
        """Take the free blocks ``a .. b - 1`` out of the queue, one queue run at a time."""
        runs = self._run
        while a < b:
            run = runs[a]
            assert run is not None
            end = min(b, run.hi)
            self._unlink(a, end)
            a = end

    def touch_cached(self, block_hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """``touch`` of the blocks caching ``block_hashes`` (a hit being pinned); returns their
        ids. Every hash must be cached: else ``BlockPoolError``, nothing touched."""
        cached = self._cached
        try:
            ids = list(map(cached.__getitem__, block_hashes))
        except KeyError:
            raise BlockPoolError(f"{self.name}: a hash to touch is not cached") from None
        self._touch(ids)
        return tuple(ids)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed block; blocks reaching zero join the free queue in order
        (cached ones at the tail, uncached ones at the head)."""
        ids = block_ids if isinstance(block_ids, tuple | list) else list(block_ids)
        self._check_ids(ids)
        self._check_refs(ids)
        # Checked: what ``free_owned`` assumes holds (repeated ids take its per-block path).
        self.free_owned(ids)

    def free_owned(self, block_ids: Sequence[int]) -> None:
        """``free`` for a caller that holds one reference on each of these distinct, valid ids
        (kvflow's manager releasing a transfer's CPU blocks): run by run where the ids are
        ascending or descending runs."""
        n = len(block_ids)
        if not n:
            return
        refs = self._refs
        desc = n > 1 and block_ids[0] > block_ids[-1]
        runs = _runs(block_ids[::-1] if desc else block_ids, self._ids)
        if runs is None:
            self._check_refs(block_ids)
            for b in block_ids:
                self._drop_one(b)
            return
        for lo, hi, _ in runs:
            if refs[lo:hi].count(1) != hi - lo and 0 in refs[lo:hi]:
                self._check_refs(block_ids)  # raises: nothing changed yet
        if desc:
            runs.reverse()  # the order the ids are walked in
        hashes = self._hash
        for lo, hi, _ in runs:
            m = hi - lo
            if refs[lo:hi].count(1) == m:
                hs = hashes[lo:hi]
                # ``all``: no None (nor an empty hash, which takes the per-block path).
                if all(hs):
                    refs[lo:hi] = [0] * m
                    self._push(lo, hi, desc, head=False)
                    continue
                if hs == self._nones[:m]:
                    refs[lo:hi] = [0] * m
                    # Uncached blocks go to the head one by one: in reverse walk order.
                    self._push(lo, hi, not desc, head=True)
                    continue
            for b in range(hi - 1, lo - 1, -1) if desc else range(lo, hi):
                self._drop_one(b)

    def cache(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Enter in-use blocks into the prefix cache under the given hashes; per block, whether it
        was cached (a hash another block holds stays with that block)."""
        if len(block_ids) == len(block_hashes):
            self._check_ids(block_ids)
        refs, hashes = self._refs, self._hash
        check_cache_input(
            self.name, block_ids, block_hashes, refs.__getitem__, lambda b: hashes[b] is not None
        )
        done: list[bool] = []
        cached = self._cached
        for b, h in zip(block_ids, block_hashes, strict=True):
            if h in cached:
                done.append(False)
                continue
            hashes[b] = h
            cached[h] = b
            done.append(True)
        if self.enable_events and True in done:
            self._events.append(stored_event(block_ids, block_hashes, done))
        return done

    def release_owned(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash | None],
        infos: Sequence[StoredBlockInfo] | None = None,
    ) -> int:
        """``cache`` of the blocks whose hash is not None, then ``free_owned`` of all of them in
        reverse order (a committed store's CPU blocks, fresh from ``get_new_blocks``: in use and
        uncached). Returns how many were cached. The hashes must be distinct (a store's are): of
        two blocks with one hash the last is cached. ``infos`` (per block) go into the event."""
        n = len(block_ids)
        if n != len(block_hashes):
            raise BlockPoolError(f"{self.name}: {n} blocks but {len(block_hashes)} hashes")
        if not n:
            return 0
        refs, hashes, cached = self._refs, self._hash, self._cached
        runs: list[tuple[int, int, int]] | None = None
        if all(block_hashes):  # no None (an empty hash takes the per-block path)
            first = block_ids[0]
            end = first + n if type(first) is int and first >= 0 else 0
            # One run (a store's blocks from a free queue with room at its head: most stores):
            # its check is one comparison in C.
            one = 0 < end <= len(refs) and list(block_ids) == self._ids[first:end]
            runs = [(first, end, 0)] if one else _runs(block_ids, self._ids)
        if runs is not None:
            for lo, hi, _ in runs:
                if refs[lo:hi].count(1) != hi - lo or hashes[lo:hi].count(None) != hi - lo:
                    runs = None  # not fresh from ``get_new_blocks``
                    break
        if runs is not None:
            full: Sequence[BlockHash] = block_hashes  # type: ignore[assignment]  # no None
            before = len(cached)
            cached.update(zip(full, block_ids, strict=True))
            if len(cached) == before + n:
                # A store's runs, every block cached: each run joins the tail in descending
                # order, the last run first (the ids are walked in reverse).
                for lo, hi, at in reversed(runs):
                    hashes[lo:hi] = block_hashes[at : at + hi - lo]
                    refs[lo:hi] = [0] * (hi - lo)
                    self._push(lo, hi, True, head=False)
                if self.enable_events:
                    self._events.append(
                        BlockStored(
                            tuple(full),
                            tuple(block_ids),
                            () if infos is None else tuple(infos),
                        )
                    )
                return n
            # A hash was cached already, or two blocks share one: put back what the update
            # overwrote (the blocks' own hashes say which blocks held them) and take the
            # per-block path.
            held = {h: b for b, h in enumerate(hashes) if h is not None}
            for key in full:
                b = held.get(key)
                if b is None:
                    cached.pop(key, None)
                else:
                    cached[key] = b
        self._check_ids(block_ids)
        self._check_refs(block_ids)
        # Cache in reverse (the last of two blocks with one hash wins), then free in reverse.
        won: set[int] = set()
        for b, h in zip(reversed(block_ids), reversed(block_hashes), strict=True):
            if h is not None and h not in cached:
                hashes[b] = h
                cached[h] = b
                won.add(b)
        # Cached blocks join the tail in the walk's order; uncached ones the head afterwards
        # (which commutes with appending at the tail), in the same order.
        head: list[int] = []
        for b in reversed(block_ids):
            refs[b] -= 1
            if refs[b] == 0:
                if hashes[b] is None:
                    head.append(b)
                else:
                    self._push(b, b + 1, False, head=False)
        for b in head:
            self._push(b, b + 1, False, head=True)
        if won and self.enable_events:
            picked = [i for i, b in enumerate(block_ids) if b in won]
            stored: list[BlockHash] = []
            for i in picked:
                x = block_hashes[i]
                assert x is not None
                stored.append(x)
            self._events.append(
                BlockStored(
                    tuple(stored),
                    tuple(block_ids[i] for i in picked),
                    () if infos is None else tuple(infos[i] for i in picked),
                )
            )
        return len(won)

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each listed block (e.g. its data turned out invalid)."""
        ids = block_ids if isinstance(block_ids, tuple | list) else list(block_ids)
        self._check_ids(ids)
        removed: list[BlockHash] = []
        for b in ids:
            h = self._hash[b]
            if h is None:
                continue
            del self._cached[h]
            self._hash[b] = None
            removed.append(h)
            if self._refs[b] == 0:
                # An unhashed free block belongs at the head: it has nothing left to lose.
                self._unlink(b, b + 1)
                self._push(b, b + 1, False, head=True)
        if removed and self.enable_events:
            self._events.append(BlockRemoved(tuple(removed)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refuses (returns False, changes nothing) while blocks are
        in use."""
        if self.num_free_blocks != len(self._refs):
            return False
        self._hash[:] = [None] * len(self._hash)
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True


__all__ = ["RunBlockPool"]
