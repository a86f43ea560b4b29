"""The eager store policy: a block is stored as soon as its KV is computed.

``EagerStore.collect`` hands the blocks the requests completed since their last call to the
store, as one ``StoreBatch``; in steady decode, ``eager_store_interval`` plans' worth of requests
are deferred and collected together (``defer`` / ``due``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvflow.core.hashing import BlockHash
from kvflow.core.logs import get_logger
from kvflow.core.offload.config import Geometry
from kvflow.core.offload.state import RequestState, StoreBatch, next_boundary
from kvflow.core.run_pool import RunBlockPool

log = get_logger("kvflow.scheduler")


# A step's entry (request, confirmed tokens, new block ids per group, whether they replace the
# table), as the manager builds them.
_Entry = tuple[RequestState, int, Sequence[Sequence[int]], bool]

# From this many completed blocks a request's blocks are first tried as a whole (a prefill's).
_WHOLE = 8


def _pick_all(
    ids: Sequence[int],
    hs: Sequence[BlockHash],
    null: int | None,
    in_flight: dict[BlockHash, int],
    picked: dict[BlockHash, int],
    pool: RunBlockPool,
) -> bool:
    """Pick every block if none is skipped (none is the null block, stored, being stored or
    picked already, and no hash repeats), with C-level passes instead of four lookups a block
    in Python; returns whether it did (else nothing is picked)."""
    if null is not None and null in ids:
        return False
    if in_flight and not in_flight.keys().isdisjoint(hs):
        return False
    if picked and not picked.keys().isdisjoint(hs):
        return False
    if not pool.none_cached(hs):
        return False
    before = len(picked)
    picked.update(zip(hs, ids, strict=True))
    if len(picked) == before + len(hs):
        return True
    for h in hs:  # a hash repeats: none of these was picked before, so drop them all
        picked.pop(h, None)
    return False


def _pick_run(
    st: RequestState,
    ids: Sequence[int],
    hs: Sequence[BlockHash],
    cur: int,
    done: int,
    null: int | None,
    in_flight: dict[BlockHash, int],
    picked: dict[BlockHash, int],
    pool: RunBlockPool,
    owners: list[RequestState | None],
) -> bool:
    """Pick the request's blocks ``cur .. done - 1`` of one group worth storing (not the null
    block, not cached, not being stored, not picked already); returns whether any was."""
    if done - cur >= _WHOLE and _pick_all(
        ids[cur:done], hs[cur:done], null, in_flight, picked, pool
    ):
        owners += [st] * (done - cur)
        return True
    in_cpu = pool.cached_hashes
    added = False
    for i in range(cur, done):
        b, h = ids[i], hs[i]
        if b == null or h in in_flight or h in picked or h in in_cpu:
            continue
        picked[h] = b
        owners.append(st)
        added = True
    return added


class EagerStore:
    """Picks each completed block worth storing: not the null block, not cached on CPU, not
    being stored, not picked already by the same batch."""

    def __init__(
        self,
        geometry: Geometry,
        cpu: Sequence[RunBlockPool],
        storing: Sequence[dict[BlockHash, int]],
        *,
        null_block_id: int | None,
        interval: int,
    ) -> None:
        self._geo = geometry
        self._cpu = cpu
        self._storing = storing
        self._null = null_block_id
        self.interval = interval
        # Interval > 1: requests with completed blocks not handed to the store yet (an ordered
        # set), and how many plans ago the oldest of them was deferred.
        self.deferred: dict[RequestState, None] = {}
        self._deferred_plans = 0

    def collect(self, sts: Sequence[RequestState], *, pick: bool = True) -> StoreBatch:
        """Advance the requests' store cursors to their confirmed blocks; with ``pick``, return
        the eager candidates among the blocks passed, in request order, as one batch.

        Everything that is the same for every request is looked up once per call, not once per
        request or block.
        """
        batch = StoreBatch.empty(self._geo.num_groups)
        if self._geo.num_groups == 1:
            self._collect_one(sts, batch, pick)
        else:
            self._collect_groups(sts, batch, pick)
        return batch

    def _collect_groups(self, sts: Sequence[RequestState], batch: StoreBatch, pick: bool) -> None:
        geo = self._geo
        null = self._null
        reqs = batch.reqs
        sizes = geo.block_sizes
        # Per group, everything the loop reads, in one tuple: the pools, the hashes being
        # stored, and this batch's picks.
        groups = tuple(
            enumerate(
                zip(
                    sizes,
                    geo.slot,
                    self._cpu,
                    self._storing,
                    batch.blocks,
                    batch.owners,
                    strict=True,
                )
            )
        )
        for st in sts:
            if st.hashing:
                st.hash_confirmed()
            confirmed = st.confirmed
            st.next_boundary = next_boundary(confirmed, sizes)
            cursor = st.cursor
            added = False
            for g, (bs, slot, pool, in_flight, picked, owners) in groups:
                done = confirmed // bs
                cur = cursor[g]
                if done <= cur:
                    continue
                cursor[g] = done
                if pick and _pick_run(
                    st,
                    st.table[g],
                    st.hash_lists[slot],
                    cur,
                    done,
                    null,
                    in_flight,
                    picked,
                    pool,
                    owners,
                ):
                    added = True
            if added:
                reqs.append(st)

    def _collect_one(self, sts: Sequence[RequestState], batch: StoreBatch, pick: bool) -> None:
        """``_collect_groups`` for one KV cache group (most models), its group loop unrolled:
        it runs once per request with a completed block, on every store. The property test
        ``test_one_group_collect_equals_the_general_one`` holds the two to the same result."""
        self.advance_one(
            [(st, st.confirmed) for st in sts],
            batch.blocks[0],
            batch.owners[0],
            batch.reqs,
            pick=pick,
            apply=False,
        )

    def apply_running_one(self, entries: Sequence[_Entry]) -> StoreBatch:
        """A step of running requests only (no table replaced) over one KV cache group: each
        entry's new ids join its table, its confirmed tokens are set, and its completed blocks
        are collected as ``collect`` does (a request at a time is the same as all at once:
        requests are independent here). The property test
        ``test_running_one_group_step_equals_the_general_one`` holds it to the manager's general
        path."""
        for st, _, ids, _ in entries:
            new = ids[0]
            if new:
                st.table[0].extend(new)
        batch = StoreBatch.empty(1)
        self.advance_one(
            [(st, confirmed) for st, confirmed, _, _ in entries],
            batch.blocks[0],
            batch.owners[0],
            batch.reqs,
            pick=True,
            apply=True,
        )
        return batch

    def advance_one(
        self,
        entries: Iterable[tuple[RequestState, int]],
        picked: dict[BlockHash, int],
        owners: list[RequestState | None],
        reqs: list[RequestState],
        *,
        pick: bool,
        apply: bool,
    ) -> None:
        """One group, tables current: advance each request to its confirmed tokens and, with
        ``pick``, add its completed blocks worth storing to ``picked`` (hash → GPU block, in
        order), their requests to ``owners`` and the request to ``reqs`` (a ``StoreBatch``'s
        parts). With ``apply``, first set its confirmed tokens (a request whose boundary is not
        reached and whose tokens did not go back is then done)."""
        bs = self._geo.block_sizes[0]
        slot = self._geo.slot[0]
        pool = self._cpu[0]
        in_cpu = pool.cached_hashes
        in_flight = self._storing[0]
        null = self._null
        for st, confirmed in entries:
            if apply:
                if st.next_boundary > confirmed >= st.confirmed:
                    st.confirmed = confirmed  # no block completes, none went back
                    continue
                st.confirmed = confirmed
            if st.hashing:
                st.hash_confirmed()
            done = confirmed // bs
            st.next_boundary = (done + 1) * bs
            cur = st.cursor[0]
            if done <= cur:
                continue
            st.cursor[0] = done
            if not pick:
                continue
            hs = st.hash_lists[slot]
            table = st.table[0]
            if done == cur + 1:  # steady decode: one block completed
                b, h = table[cur], hs[cur]
                if b != null and h not in in_flight and h not in picked and h not in in_cpu:
                    picked[h] = b
                    owners.append(st)
                    reqs.append(st)
            elif _pick_run(st, table, hs, cur, done, null, in_flight, picked, pool, owners):
                reqs.append(st)

    def defer(self, st: RequestState, confirmed: int) -> None:
        """Skip the request until its next block completes, as if collected (its cursors stay
        where the last store left them)."""
        self.deferred[st] = None
        st.next_boundary = next_boundary(confirmed, self._geo.block_sizes)

    def due(self, *, fresh: bool, replaced: bool) -> list[RequestState] | None:
        """The deferred requests if their store is due now (``fresh``: none were deferred before
        this plan; ``replaced``: a request was new or resumed), else None.

        Counted from the plan that deferred the oldest of them. Steps with new or resumed
        requests (prefill: large stores) store at once, taking every deferred block along; only
        steady decode steps are coalesced.
        """
        deferred = self.deferred
        if not deferred:
            return None
        self._deferred_plans = (0 if fresh else self._deferred_plans) + 1
        if replaced or self._deferred_plans >= self.interval:
            due = list(deferred)
            deferred.clear()
            return due
        return None

    def rearm(
        self,
        sts: Iterable[RequestState],
        transfer_id: int,
        hashes: Sequence[Sequence[BlockHash]],
    ) -> None:
        """A store failed: its blocks (``hashes``, per group) become eligible again for every
        running request that still holds one (its own, or one skipped as a duplicate of it), so
        a later step or ``request_finished`` stores them. The request's cursor moves back to its
        first such block; full-attention groups only (a sliding window may have freed its old
        blocks)."""
        failed = [frozenset(hs) for hs in hashes]
        slot = self._geo.slot
        rearmed = 0
        for st in sts:
            if st.finishing:
                continue
            moved = False
            for g in self._geo.full_groups:
                lost = failed[g] if g < len(failed) else frozenset()
                if not lost:
                    continue
                hs = st.hash_lists[slot[g]]
                for i in range(st.cursor[g]):
                    if hs[i] in lost:
                        st.cursor[g] = i
                        moved = True
                        break
            if moved:
                st.next_boundary = 0  # the next step advances it, even without a new block
                rearmed += 1
        if rearmed:
            log.info("offload_store_rearmed", transfer_id=transfer_id, requests=rearmed)


__all__ = ["EagerStore"]
