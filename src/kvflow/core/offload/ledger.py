"""The transfer ledger: the one place transfers are created, launched, cancelled, abandoned,
settled and released, and the one place a CPU or GPU block reference changes.

Every load and store is a ``Transfer`` driven through ``kvflow.core.transfer.apply``. A block that
a transfer reads or writes holds a reference on its pool until the transfer is RELEASED (on the
GPU side only where the engine could free it under the copy: see ``store_refs``); a pinned hit
holds its CPU blocks until it becomes a load or is dropped. The ledger calls no policy: what the
store policies must know (a CPU eviction, a failed store) it reports back to its caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from kvflow.core.block_pool import StoredBlockInfo
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import BlockHash
from kvflow.core.logs import debug_enabled, get_logger
from kvflow.core.offload.config import STEP_STORE_ID, Geometry, OffloadManagerConfig, StorePolicy
from kvflow.core.offload.holds import GpuHolds
from kvflow.core.offload.state import LiveTransfer, PinnedHit, RequestState, StoreBatch, all_ids
from kvflow.core.offload.stats import Counters
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport, TransferSpec, aggregate
from kvflow.core.run_pool import RunBlockPool
from kvflow.core.transfer import (
    Direction,
    Transfer,
    TransferInput,
    TransferState,
    apply,
    apply_seq,
)
from kvflow.errors import ReportError

log = get_logger("kvflow.scheduler")


_UNDESCRIBED = StoredBlockInfo(None, ())
_COMMIT_AND_RELEASE = (
    (TransferInput.COMPLETE, "all_ranks_reported"),
    (TransferInput.RELEASE, "settled"),
)


def _transfer_id(x: LiveTransfer) -> int:
    return x.transfer.transfer_id


class TransferLedger:
    """Every live transfer of one manager, the CPU tier's pools, and the refs both hold.

    ``requests`` is the manager's registry of request states (shared, not copied): a finished
    request waiting for its transfers (``waiting``) leaves it when its last transfer is released.
    """

    def __init__(
        self,
        config: OffloadManagerConfig,
        geometry: Geometry,
        *,
        gpu_view: GpuCacheView | None,
        counters: Counters,
        requests: dict[str, RequestState],
    ) -> None:
        groups = config.groups
        self.groups = groups
        self.events = config.enable_events
        self._geo = geometry
        self.cpu = [
            # Ascending runs: a store's CPU blocks in few contiguous pieces (fewer copies), and
            # the pool's work per store or load per run, not per block.
            RunBlockPool(s.num_cpu_blocks, name=f"cpu[{g}]", enable_events=config.enable_events)
            for g, s in enumerate(groups)
        ]
        self.gpu = gpu_view
        eager = config.store_policy is StorePolicy.EAGER
        windowed = any(s.sliding_window is not None for s in groups)
        # Which transfers hold GPU refs. Loads always: an aborted request's blocks must not be
        # reused under its copy. Eager stores of full-attention blocks need none: the blocks stay
        # the request's until it finishes (then ``delay_free`` keeps them until the store is
        # done) or is preempted (then the plan flushes every copy before the engine reuses its
        # blocks), and a request the engine drops unannounced has its stores abandoned. Lazy
        # stores read free blocks and a sliding window frees blocks of running requests: those
        # hold refs. The refs cost two pool calls per block, on the engine's thread.
        self.store_refs = gpu_view is not None and (not eager or windowed)
        self.n = counters
        self.requests = requests
        self.xfers: dict[int, LiveTransfer] = {}
        self.shared: dict[int, LiveTransfer] = {}  # live step stores, by transfer id
        self.pending: list[LiveTransfer] = []  # PENDING transfers, launched by the next plan
        self.abandoned: list[int] = []  # for the next plan
        # Per group, every hash a live store writes → the GPU block it reads; each hash is in
        # one live store alone (the store policies skip hashes being stored).
        self.storing: list[dict[BlockHash, int]] = [{} for _ in groups]
        self.waiting: dict[RequestState, None] = {}  # finished requests kept for their transfers
        self.finished_sending: set[str] = set()  # for the next outcome
        self.finished_recving: set[str] = set()
        self.invalid: set[int] = set()
        self._next_id = 1
        # PD hand-offs' GPU holds: their refs go through the same view as the loads' refs.
        self.holds = GpuHolds(gpu_view, self._load_targets)

    # ---- queries ------------------------------------------------------------------------------

    def live(self, st: RequestState) -> list[LiveTransfer]:
        """The request's live transfers in launch order: its own and the step stores naming it."""
        own = list(st.transfers.values())
        shared = [x for x in self.shared.values() if st in x.reqs]
        if not shared:
            return own
        return sorted(own + shared, key=_transfer_id)

    def has_live(self, st: RequestState) -> bool:
        return bool(st.transfers) or any(st in x.reqs for x in self.shared.values())

    def _load_targets(self) -> Iterator[int]:
        """The GPU blocks that live loads, and allocated hits about to become loads, write."""
        for x in self.xfers.values():
            if x.spec.direction is Direction.LOAD:
                for ids in x.spec.gpu_block_ids:
                    yield from ids
        for st in self.requests.values():
            if st.match is not None and st.match.load is not None:
                for ids in st.match.load[0]:
                    yield from ids

    def cpu_refs(self) -> list[Counter[int]]:
        """Per group, the references held on each CPU block by transfers and pinned hits."""
        held: list[Counter[int]] = [Counter() for _ in self.cpu]
        for x in self.xfers.values():
            for g, ids in enumerate(x.spec.cpu_block_ids):
                held[g].update(ids)
        for st in self.requests.values():
            if st.match is not None:
                for g, ids in enumerate(st.match.cpu_block_ids):
                    held[g].update(ids)
        return held

    # ---- pinned hits --------------------------------------------------------------------------

    def pin(self, g: int, hashes: Sequence[BlockHash]) -> tuple[int, ...]:
        """Pin the cached CPU blocks of group ``g`` holding ``hashes`` (all must be cached)."""
        return self.cpu[g].touch_cached(hashes)

    def pin_ids(self, g: int, ids: list[int]) -> tuple[int, ...]:
        """``pin`` of blocks whose ids the matcher just looked up (``RunBlockPool.ids_of``)."""
        return self.cpu[g].pin_ids(ids)

    def unpin(self, m: PinnedHit) -> None:
        for g, ids in enumerate(m.cpu_block_ids):
            self.cpu[g].free(reversed(ids))

    def plan_load(self, st: RequestState) -> None:
        """Turn the request's allocated hit into a PENDING load; unpin what it does not load."""
        m, st.match = st.match, None
        assert m is not None
        assert m.load is not None
        gpu, cpu = m.load
        for g, pinned in enumerate(m.cpu_block_ids):
            if len(cpu[g]) == len(pinned):
                continue  # the load takes every pinned block (its ids are a subset of them)
            used = set(cpu[g])
            self.cpu[g].free(reversed([b for b in pinned if b not in used]))
        xfer = self._new(Direction.LOAD, st.request.request_id, [st], gpu, cpu)
        xfer.fenced = m.fenced
        if debug_enabled():
            log.debug(
                "offload_load_planned",
                request_id=st.request.request_id,
                transfer_id=xfer.transfer.transfer_id,
                num_blocks=xfer.spec.num_blocks,
                # Which GPU blocks it writes, from which token: what a trace needs to find a
                # load that wrote where another request read.
                num_computed_tokens=m.num_computed_tokens,
                gpu_block_ids=gpu,
            )

    # ---- creating and launching ---------------------------------------------------------------

    def plan_store(self, batch: StoreBatch, request_id: str) -> bool:
        """Allocate CPU blocks (evicting LRU cached ones) and queue one store; skip what won't
        fit. Returns whether a cached CPU block was evicted for it."""
        gpu: list[tuple[int, ...]] = []
        cpu: list[tuple[int, ...]] = []
        hashes: list[tuple[BlockHash, ...]] = []
        owners: list[tuple[RequestState | None, ...]] = []
        evicted = False
        for g, pool in enumerate(self.cpu):
            picked = batch.blocks[g]
            want = len(picked)
            if not want:
                gpu.append(())
                cpu.append(())
                hashes.append(())
                owners.append(())
                continue
            hs = tuple(picked)
            ids = tuple(picked.values())
            who = tuple(batch.owners[g])
            n = pool.num_free_blocks
            if n < want:
                self.n.skipped_stores += want - n
                log.info(
                    "offload_store_skipped", group=g, num_blocks=want - n, reason="cpu_pool_full"
                )
                hs, ids, who = hs[:n], ids[:n], who[:n]
            else:
                n = want
            cached_before = pool.num_cached_blocks
            cpu.append(tuple(pool.get_new_blocks(n)) if n else ())
            evicted = evicted or pool.num_cached_blocks < cached_before
            gpu.append(ids)
            hashes.append(hs)
            owners.append(who)
        if not any(cpu):
            return evicted
        shared = request_id == STEP_STORE_ID
        if len(batch.reqs) == 1:
            request_id = batch.reqs[0].request.request_id
        xfer = self._new(
            Direction.STORE, request_id, batch.reqs, tuple(gpu), tuple(cpu), shared=shared
        )
        xfer.hashes = tuple(hashes)
        xfer.owners = tuple(owners)
        for g, hs in enumerate(hashes):
            if hs:
                picked = batch.blocks[g]
                if len(hs) < len(picked):
                    self.storing[g].update(zip(hs, gpu[g], strict=True))  # what fitted
                elif self.storing[g]:
                    self.storing[g].update(picked)
                else:
                    # Nothing else being stored: the batch's picks (hash → GPU block, the
                    # batch is done with them) become the map, without a copy.
                    self.storing[g] = picked
        return evicted

    def launch_store(
        self,
        step: int,
        picked: dict[BlockHash, int],
        owners: list[RequestState | None],
        reqs: list[RequestState],
    ) -> StepPlan | None:
        """The step's plan when one group's step store (a ``StoreBatch``'s parts) is all it
        holds, as in a steady decode step: ``plan_store`` and ``launch`` in one pass. None,
        changing nothing, where anything else is pending or abandoned, or the CPU pool cannot
        take every block (then those two)."""
        pool = self.cpu[0]
        n = len(picked)
        if self.pending or self.abandoned or len(self.cpu) != 1 or pool.num_free_blocks < n:
            return None
        request_id = reqs[0].request.request_id if len(reqs) == 1 else STEP_STORE_ID
        xfer = self._new(
            Direction.STORE,
            request_id,
            reqs,
            (tuple(picked.values()),),
            (tuple(pool.get_new_blocks(n)),),
            shared=True,
            pending=False,
        )
        xfer.hashes = (tuple(picked),)
        xfer.owners = (tuple(owners),)
        storing = self.storing[0]
        if storing:
            storing.update(picked)
        else:
            self.storing[0] = picked  # as in ``plan_store``: the picks become the map
        apply(xfer.transfer, TransferInput.LAUNCH, cause="step_plan")
        return StepPlan(step, (xfer.spec,), (), False, ())

    def _new(
        self,
        direction: Direction,
        request_id: str,
        reqs: list[RequestState],
        gpu: GroupBlockIds,
        cpu: GroupBlockIds,
        *,
        shared: bool = False,
        pending: bool = True,
    ) -> LiveTransfer:
        tid = self._next_id
        self._next_id += 1
        store = direction is Direction.STORE
        # Both ends are checked already: GPU ids are the engine's validated table (``validate``
        # at alloc or in the step), CPU ids come from this ledger's pools, paired per group.
        spec = TransferSpec.trusted(tid, request_id, direction, gpu, cpu)
        xfer = LiveTransfer(Transfer(tid, direction, request_id), spec, reqs)
        if self.gpu is not None and (not store or self.store_refs):
            # Hold the GPU ends too: the engine may free them (an aborted load, a block leaving
            # a sliding window, a lazy store's free block) while the copy still runs.
            self.gpu.touch(all_ids(gpu))
            xfer.holds_gpu = True
        self.xfers[tid] = xfer
        if pending:
            self.pending.append(xfer)
        if shared:
            xfer.shared = True
            self.shared[tid] = xfer
        else:
            for st in reqs:
                st.transfers[tid] = xfer
        return xfer

    def launch(self, step: int, flush: bool) -> StepPlan:
        """The step's plan: every PENDING transfer, launched, and the ids abandoned since."""
        stores: list[TransferSpec] = []
        loads: list[TransferSpec] = []
        fenced: list[int] = []
        for x in self.pending:
            apply(x.transfer, TransferInput.LAUNCH, cause="step_plan")
            (stores if x.spec.direction is Direction.STORE else loads).append(x.spec)
            if x.fenced:
                fenced.append(x.spec.transfer_id)
        self.pending.clear()
        abandoned = tuple(self.abandoned)
        self.abandoned.clear()
        return StepPlan(
            step=step,
            stores=tuple(stores),
            loads=tuple(loads),
            flush=flush,
            abandoned=abandoned,
            fenced_loads=tuple(fenced),
        )

    # ---- cancelling and abandoning ------------------------------------------------------------

    def cancel(self, x: LiveTransfer) -> None:
        apply(x.transfer, TransferInput.CANCEL, cause="cancelled")
        self.pending.remove(x)
        self.release(x, commit=False)

    def abandon(self, x: LiveTransfer, *, cause: str) -> None:
        apply(x.transfer, TransferInput.ABANDON, cause=cause)
        self.abandoned.append(x.transfer.transfer_id)
        self.n.abandoned_transfers += 1

    def drop_request(self, st: RequestState, *, stores: bool) -> None:
        """Cancel the request's PENDING transfers, abandon its in-flight loads (and stores)."""
        for x in self.live(st):
            state = x.transfer.state
            is_load = x.spec.direction is Direction.LOAD
            if len(x.reqs) > 1 and (stores or is_load):
                # A step's store shared with other requests: only this request's blocks go.
                x.dropped = {*x.dropped, st}  # rare: a request gone under a shared store
                x.reqs.remove(st)
                if not x.shared:
                    del st.transfers[x.transfer.transfer_id]
            elif state is TransferState.PENDING:
                self.cancel(x)
            elif state is TransferState.IN_FLIGHT and (stores or is_load) and not x.fenced:
                # (A fenced load was read by the forward that launched it: it commits as usual.)
                self.abandon(x, cause="request_gone")

    def drop_all(self) -> None:
        """Cancel every PENDING transfer and abandon every in-flight one (a cache reset)."""
        for x in list(self.xfers.values()):
            state = x.transfer.state
            if state is TransferState.PENDING:
                self.cancel(x)
            elif state is TransferState.IN_FLIGHT:
                x.reset = True
                self.abandon(x, cause="reset")

    # ---- settling -----------------------------------------------------------------------------

    def apply_reports(
        self, reports: Iterable[StepReport], world_size: int
    ) -> tuple[list[int], list[int], list[LiveTransfer]]:
        """Apply worker reports; settle the transfers every rank reported. Returns the committed
        and the failed transfer ids and the stores that failed (not abandoned ones: the store
        policy decides what their blocks need). Invalid input raises ``ReportError`` and changes
        nothing."""
        if world_size == 1:
            reports = reports if isinstance(reports, (list, tuple)) else list(reports)
            if len(reports) == 1:
                one = reports[0]
                if (
                    type(one) is StepReport
                    and not one.rank
                    and not one.failed
                    and not one.invalid_block_ids
                    and len(set(one.completed)) == len(one.completed)
                ):
                    return (*self._apply_completed(one.completed), [])
        agg = aggregate(reports, world_size)
        for outcome_ranks in (agg.completed, agg.failed):
            for tid, ranks in outcome_ranks.items():
                x = self.xfers.get(tid)
                if x is None:
                    raise ReportError(f"report for unknown or settled transfer {tid}")
                if x.transfer.state is TransferState.PENDING:
                    raise ReportError(f"report for transfer {tid}, which was never launched")
                twice = ranks & x.reported.keys()
                if twice:
                    raise ReportError(f"rank(s) {sorted(twice)} reported transfer {tid} twice")
        touched: list[int] = []
        for ok, outcome_ranks in ((True, agg.completed), (False, agg.failed)):
            for tid, ranks in outcome_ranks.items():
                x = self.xfers[tid]
                for r in ranks:
                    x.reported[r] = ok
                touched.append(tid)
        committed: list[int] = []
        failed: list[int] = []
        store_failed: list[LiveTransfer] = []
        for tid in sorted(set(touched)):
            x = self.xfers[tid]
            if len(x.reported) < world_size:
                continue  # a rank is still copying: keep every ref
            abandoned = x.transfer.state is TransferState.ABANDONED
            if self._settle(x, agg.invalid_block_ids):
                committed.append(tid)
            else:
                failed.append(tid)
                if not abandoned and x.spec.direction is Direction.STORE:
                    store_failed.append(x)
        return committed, failed, store_failed

    def _apply_completed(self, completed: Sequence[int]) -> tuple[list[int], list[int]]:
        """``apply_reports`` for one rank's report of completed transfers only (the common
        step of a single-rank engine): the same checks and settling without aggregating ranks.
        The property test ``test_single_rank_fast_path_equals_the_general_one`` holds the two
        to the same result."""
        xfers = self.xfers
        for tid in completed:
            x = xfers.get(tid)
            if x is None:
                raise ReportError(f"report for unknown or settled transfer {tid}")
            if x.transfer.state is TransferState.PENDING:
                raise ReportError(f"report for transfer {tid}, which was never launched")
            if x.reported:
                raise ReportError(f"rank(s) {sorted(x.reported)} reported transfer {tid} twice")
        for tid in completed:
            xfers[tid].reported[0] = True
        committed: list[int] = []
        failed: list[int] = []  # abandoned ones: they settle without committing
        for tid in sorted(completed):
            (committed if self._settle(xfers[tid], frozenset()) else failed).append(tid)
        return committed, failed

    def _settle(self, x: LiveTransfer, reported_invalid: frozenset[int]) -> bool:
        """All ranks reported: commit or fail, then release. Returns whether it committed."""
        ok = all(x.reported.values())
        t = x.transfer
        is_load = t.direction is Direction.LOAD
        # Whether a load's request still wants it; a store's requests are not looked at (a store
        # settles every step, and their states would be read cold for nothing).
        alive = is_load and bool(x.reqs) and not x.reqs[0].finishing
        if t.state is TransferState.ABANDONED:
            apply(t, TransferInput.COMPLETE if ok else TransferInput.FAIL, cause="abandoned_done")
            if x.reset and alive:
                self._load_invalid(x, frozenset())
            self.release(x, commit=False)
            return False
        if ok:
            apply_seq(t, _COMMIT_AND_RELEASE)
            if alive and not x.fenced:  # a fenced load's request runs already
                self.finished_recving.add(t.request_id)
            self.release(x, commit=True)
            return True
        apply(t, TransferInput.FAIL, cause="all_ranks_reported")
        self.n.failed_transfers += 1
        log.warning(
            "offload_transfer_failed",
            transfer_id=t.transfer_id,
            request_id=t.request_id,
            direction=t.direction.value,
        )
        if alive:
            self._load_invalid(x, reported_invalid)
        apply(t, TransferInput.RELEASE, cause="settled")
        self.release(x, commit=False)
        return False

    def _load_invalid(self, x: LiveTransfer, reported: frozenset[int]) -> None:
        ids = {b for g in x.spec.gpu_block_ids for b in g}
        mine = ids & reported
        self.invalid |= mine or ids
        if not x.fenced:
            self.finished_recving.add(x.transfer.request_id)
            return
        # A fenced load's request computed on the blocks in the step that launched it (the
        # engine rolls it back): what that step stores of its blocks is garbage, under the hashes
        # of the right tokens, and must not enter the CPU prefix cache.
        for st in x.reqs:
            for other in self.live(st):
                if other.spec.direction is Direction.STORE:
                    other.dropped = {*other.dropped, st}

    def _describe(
        self, g: int, hashes: Sequence[BlockHash], owners: Sequence[RequestState | None]
    ) -> list[StoredBlockInfo]:
        """Per stored block of group ``g``: its parent hash, tokens and request, for the cache
        events (only with ``enable_events``). A lazy store's blocks have no owner."""
        bs, slot = self._geo.block_sizes[g], self._geo.slot[g]
        hint: dict[RequestState, int] = {}
        out: list[StoredBlockInfo] = []
        for h, st in zip(hashes, owners, strict=True):
            i = -1
            if st is not None:
                hs = st.hash_lists[slot]
                # A store picks each request's blocks in order: search on from the last one.
                try:
                    i = hs.index(h, hint.get(st, 0))
                except ValueError:
                    i = hs.index(h) if h in hs else -1
            if st is None or i < 0:
                out.append(_UNDESCRIBED)
                continue
            hint[st] = i + 1
            out.append(
                StoredBlockInfo(
                    hs[i - 1] if i else None,
                    tuple(st.request.all_token_ids[i * bs : (i + 1) * bs]),
                    st.request,
                )
            )
        return out

    def release(self, x: LiveTransfer, *, commit: bool) -> None:
        """Drop every ref the transfer holds; a committed store's blocks enter the prefix cache."""
        spec = x.spec
        tid = spec.transfer_id
        store = spec.direction is Direction.STORE
        nbytes = 0
        nblocks = 0
        groups = self.groups
        for g, cpu_ids in enumerate(spec.cpu_block_ids):
            if not cpu_ids:
                continue
            pool = self.cpu[g]
            if store:
                storing = self.storing[g]
                hs = x.hashes[g]
                if len(storing) == len(hs):
                    # Each live store's hashes map to it alone (the store policies skip hashes
                    # being stored): these are all of them.
                    storing.clear()
                else:
                    for h in hs:
                        storing.pop(h, None)
                if commit:
                    keep: Sequence[BlockHash | None] = hs
                    if x.dropped:
                        # The blocks of requests whose GPU blocks were freed are not cached.
                        dropped = x.dropped
                        keep = [
                            None if o in dropped else h
                            for h, o in zip(hs, x.owners[g], strict=True)
                        ]
                    # Cached, then freed in reverse: a request's tail blocks are evicted first.
                    n = pool.release_owned(
                        cpu_ids, keep, self._describe(g, hs, x.owners[g]) if self.events else None
                    )
                    nblocks += n
                    nbytes += n * groups[g].block_bytes
                    continue
            elif commit:
                nblocks += len(cpu_ids)
                nbytes += len(cpu_ids) * groups[g].block_bytes
            # Reverse: a request's tail blocks become the first to be evicted.
            pool.free_owned(cpu_ids[::-1])
        if x.holds_gpu:
            assert self.gpu is not None
            self.gpu.free(all_ids(spec.gpu_block_ids))
        if commit:
            counters = self.n
            if store:
                counters.blocks_stored += nblocks
                counters.bytes_stored += nbytes
            else:
                counters.blocks_loaded += nblocks
                counters.bytes_loaded += nbytes
        del self.xfers[tid]
        waiting = self.waiting
        if x.shared:
            del self.shared[tid]
            if not waiting:
                return  # no finished request waits: none of its requests' state is touched
        for st in x.reqs:
            if not x.shared:
                del st.transfers[tid]
            if st in waiting and not self.has_live(st):
                del waiting[st]
                rid = st.request.request_id
                del self.requests[rid]
                if st.delay_free:
                    self.finished_sending.add(rid)


__all__ = ["TransferLedger"]
