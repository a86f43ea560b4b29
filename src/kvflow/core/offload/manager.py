"""The offload manager: answers the engine scheduler's calls and orchestrates the other parts.

``OffloadManager`` owns kvflow's CPU tier (one ``RunBlockPool`` per KV cache group, held by its
``TransferLedger``) and its prefix cache. The engine's scheduler calls it like vLLM's KV
connector scheduler API:

- ``get_num_new_matched_tokens``: the longest CPU hit beyond the GPU prefix; pins the hit blocks;
- ``update_state_after_alloc``: turns the pinned hit into a load into the GPU blocks just allocated;
- ``build_step_plan``: every load and store of the step, as one ``StepPlan`` for the workers;
- ``update_from_reports``: the workers' ``StepReport``\\ s; a transfer settles only when every rank
  reported it; stores then enter the CPU prefix cache;
- ``request_finished``: whether the engine must keep the request's GPU blocks for a copy in flight;
- ``reset_cache``: forget the CPU prefix cache, with transfers in flight or not.

Per-step work is one comparison per scheduled request plus work proportional to the blocks that
completed. Sans-IO: no device, no event loop, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from operator import itemgetter

from kvflow.core import validate
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.hashing import BlockHash, BlockHasher, EngineBlockHashes, HashChain
from kvflow.core.logs import debug_enabled, get_logger
from kvflow.core.offload.config import (
    LAZY_REQUEST_ID,
    STEP_STORE_ID,
    FenceLoads,
    Geometry,
    OffloadManagerConfig,
    ResetStatus,
    StorePolicy,
)
from kvflow.core.offload.decode import DecodeSteps, News
from kvflow.core.offload.eager import EagerStore
from kvflow.core.offload.lazy import LazyCursor
from kvflow.core.offload.ledger import TransferLedger
from kvflow.core.offload.matching import HitMatcher
from kvflow.core.offload.queries import ManagerQueries
from kvflow.core.offload.state import (
    PinnedHit,
    RequestState,
    StoreBatch,
    confirmed_tokens,
    own_hashers,
    take,
)
from kvflow.core.offload.stats import NO_OUTCOME, Counters, StepOutcome
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError

log = get_logger("kvflow.scheduler")


def _request_id(st: RequestState) -> str:
    return st.request.request_id


_state_of = itemgetter(0)  # a ``News`` entry's request


class OffloadManager(DecodeSteps, ManagerQueries):
    """The scheduler side of the CPU tier; see the module docstring for the call sequence."""

    def __init__(
        self, config: OffloadManagerConfig, *, gpu_view: GpuCacheView | None = None
    ) -> None:
        if config.store_policy is StorePolicy.LAZY and gpu_view is None:
            raise ConfigError("store_policy 'lazy' needs a gpu_view of the engine's GPU block pool")
        self.config = config
        geo = self._geo = Geometry.of(config)
        self._num_groups = geo.num_groups
        self._null = config.null_block_id
        self._eager = config.store_policy is StorePolicy.EAGER
        self._requests: dict[str, RequestState] = {}
        self._n = Counters()
        ledger = self._ledger = TransferLedger(
            config, geo, gpu_view=gpu_view, counters=self._n, requests=self._requests
        )
        self._cpu = ledger.cpu
        self._matcher = HitMatcher(geo, ledger.cpu)
        interval = config.eager_store_interval if self._eager and not geo.window_groups else 1
        self._store = EagerStore(
            geo, ledger.cpu, ledger.storing, null_block_id=self._null, interval=interval
        )
        self._lazy: LazyCursor | None = None
        if not self._eager:
            assert gpu_view is not None
            self._lazy = LazyCursor(
                geo,
                ledger.cpu,
                ledger.storing,
                gpu_view,
                null_block_id=self._null,
                watermark=config.lazy_watermark,
                num_gpu_blocks=config.num_gpu_blocks,
            )
        # ``quiet_step``'s walk: the lazy policy over a keyed view only.
        self._quiet_lazy = self._lazy if self._lazy is not None and self._lazy.keyed else None
        self._no_new: GroupBlockIds = ((),) * self._num_groups
        self.init_decode(fused=self._eager and geo.num_groups == 1)
        self._allocated: dict[str, RequestState] = {}  # matches the engine allocated blocks for
        # Requests the last step scheduled, and how many of any finished since: whether one
        # still runs, so that a fenced load (``FenceLoads.IDLE``) stalls nobody's step.
        self._scheduled = 0
        self._finished_since = 0
        self._one_rank = config.world_size == 1
        self.fence_loads = config.fence_loads
        """``config.fence_loads``, or what a connector combining this tier with another source
        of KV sets (PD's loads are asynchronous: the whole load must be)."""
        self._reset_pending = False
        self._reset_done = False

    # ---- matching -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the CPU tier can load, and whether asynchronously.

        Whole blocks, consistent over all groups, leaving at least one token to compute. ``None``
        means "ask again next step" (this request's previous load is still on the device). The hit
        blocks are pinned until ``update_state_after_alloc`` or ``request_finished``.
        """
        if type(num_computed_tokens) is not int or num_computed_tokens < 0:
            raise ConfigError(
                f"num_computed_tokens must be an int >= 0, got {num_computed_tokens!r}"
            )
        rid = request.request_id
        st = self._requests.get(rid)
        if st is None:
            st = self._new_request(request)
        else:
            if any(x.spec.direction is Direction.LOAD for x in st.transfers.values()):
                return None, False
            if st.request is not request:
                # Another object for the same id (a preempted request comes back through the
                # waiting queue): hash from it, and an engine's hashes live on the new object.
                st.set_request(request, self._hashers(request))
            self._drop_match(st)
        st.gpu_hit = num_computed_tokens
        # A request that must not read cached KV (vLLM: prompt logprobs) gets no hit and takes
        # no pin; it is still known here, so its blocks are stored.
        if self._reset_pending or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        for hasher in st.hashers:
            hasher.extend_to(tokens, num_tokens)
        hit = self._matcher.longest_hit(st, num_computed_tokens, num_tokens)
        self._n.lookups += 1
        # A full-prompt hit still recomputes the last token: the engine needs its logits.
        num_external = min(hit, num_tokens - 1) - num_computed_tokens
        if num_external <= 0:
            self._n.misses += 1
            return 0, False
        first: list[int] = []
        pinned: list[tuple[int, ...]] = []
        found = self._matcher.found
        for g in range(self._num_groups):
            lo, hi = self._matcher.needed_blocks(g, num_computed_tokens, hit)
            looked = found.get(g)
            if looked is not None and looked[0] <= lo and hi - looked[0] <= len(looked[1]):
                # The matcher looked these blocks up just now: pin its ids.
                start = looked[0]
                pinned.append(self._ledger.pin_ids(g, looked[1][lo - start : hi - start]))
            else:
                hashes = st.hashers[self._geo.slot[g]].hashes
                pinned.append(self._ledger.pin(g, hashes[lo:hi]))
            first.append(lo)
        fence = self.fence_loads
        # One rank only: a fenced load's failure must be known before the step's tokens are
        # taken, and another rank's is known only from its report, steps later.
        fenced = self._one_rank and (
            fence is FenceLoads.ALWAYS
            or (fence is FenceLoads.IDLE and self._scheduled <= self._finished_since)
        )
        st.match = PinnedHit(
            num_computed_tokens, num_external, tuple(first), tuple(pinned), fenced=fenced
        )
        self._n.hits += 1
        self._n.hit_tokens += num_external
        if debug_enabled():
            log.debug(
                "offload_hit",
                request_id=rid,
                num_computed_tokens=num_computed_tokens,
                num_external_tokens=num_external,
                fenced=fenced,
            )
        return num_external, not fenced

    def update_state_after_alloc(
        self,
        request: RequestLike,
        gpu_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Turn the pinned hit into a load into ``gpu_block_ids`` (the request's whole block table).

        ``num_external_tokens`` is what the engine allocated for: 0 drops the pin; less than the hit
        loads fewer blocks. Until the next ``build_step_plan`` a new call replaces the previous one.
        """
        rid = request.request_id
        # -- boundary check (kvflow.core.validate): the whole table, before anything changes --
        table = (
            validate.group_ids(
                rid, gpu_block_ids, self._num_groups, self.config.num_gpu_blocks, self._null
            )
            if num_external_tokens or len(gpu_block_ids)
            else ()
        )
        st = self._requests.get(rid)
        if type(num_external_tokens) is not int or num_external_tokens < 0:
            raise ConfigError(f"{rid}: num_external_tokens must be an int >= 0")
        if num_external_tokens == 0:
            if st is not None:
                self._drop_match(st)
                st.checked_table = tuple(map(tuple, table)) if table else None
            return
        m = None if st is None else st.match
        if st is None or m is None:
            raise ProtocolError(
                f"{rid}: {num_external_tokens} external tokens but no pinned CPU hit"
            )
        if num_external_tokens > m.num_external_tokens:
            raise ConfigError(
                f"{rid}: {num_external_tokens} external tokens allocated, "
                f"only {m.num_external_tokens} matched"
            )
        last_token = m.num_computed_tokens + num_external_tokens
        gpu: list[tuple[int, ...]] = []
        cpu: list[tuple[int, ...]] = []
        for g, bs in self._geo.group_sizes:
            lo = m.first[g]
            n = max(0, -(-last_token // bs) - lo)
            if len(table[g]) < lo + n:
                raise ConfigError(
                    f"{rid} group {g}: block table has {len(table[g])} blocks, load needs {lo + n}"
                )
            targets = table[g][lo : lo + n]
            if self._null is None or self._null not in targets:
                # No null block to skip (full attention): the two slices pair as they are.
                gpu.append(targets)
                cpu.append(m.cpu_block_ids[g][:n])
                continue
            pairs = [
                (gb, cb)
                for gb, cb in zip(targets, m.cpu_block_ids[g][:n], strict=True)
                if gb != self._null
            ]
            gpu.append(tuple(p[0] for p in pairs))
            cpu.append(tuple(p[1] for p in pairs))
        if self._ledger.holds:
            self._ledger.holds.check_load(b for ids in gpu for b in ids)  # PD writes them
        st.request = request
        st.checked_table = tuple(map(tuple, table))
        m.load = (tuple(gpu), tuple(cpu))
        if self._lazy is not None:
            keep = self._gpu_hits(st, table) if self._lazy.has_stale else ()
            for ids in table:
                self._lazy.taken(ids, keep)
        self._allocated[rid] = st

    # ---- planning -----------------------------------------------------------------------------

    def build_step_plan(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """Every load and store of this step (all PENDING transfers are launched). Pure w.r.t. input."""
        so = scheduler_output
        lazy = self._lazy
        if (
            lazy is not None
            and not so.new_requests
            and not so.cached_requests
            and not so.decode_requests.request_ids
            and not so.finished_request_ids
            and not so.preempted_request_ids
            and not self._allocated
        ):
            # A lazy step with no news (a keyed view's engine passes no running request): the
            # general path below does only this for it.
            return self._quiet_lazy_step(so, lazy)
        # -- boundary check (kvflow.core.validate): the step, new requests' counts and tables --
        validate.scheduler_output(so)
        requests = self._requests
        check = self._check_table
        num_groups = self._num_groups
        dirty: list[News] = []
        prechecked: set[int] = set()  # new requests whose ids the allocation checked
        for new in so.new_requests:
            st = requests.get(new.request_id)
            if st is None:
                raise ProtocolError(
                    f"unknown new request {new.request_id!r}: match or alloc it first"
                )
            end = new.num_computed_tokens + new.num_scheduled_tokens - new.num_spec_tokens
            confirmed = confirmed_tokens(st, end)
            check(st, end, confirmed, new.block_ids, True)
            if st.checked_table is not None and st.checked_table == new.block_ids:
                prechecked.add(len(dirty))
            dirty.append((st, confirmed, new.block_ids, True))
        no_new = self._no_new
        news = self._running_news
        resumed = False  # a cached request replaces its table
        for c in so.cached_requests:
            st = requests.get(c.request_id)
            if st is None:
                raise ProtocolError(f"unknown running request {c.request_id!r}")
            end = c.num_computed_tokens + c.num_scheduled_tokens - c.num_spec_tokens
            ids = c.new_block_ids
            if end < st.next_boundary:
                if ids == no_new:
                    continue  # the steady state: no block completed, none allocated
                if not c.resumed_from_preemption:
                    # Only new blocks (vLLM-like engines pass every allocation at once): inline,
                    # as the common case of a step where many requests cross into a new block
                    # (``confirmed_tokens`` inlined too: a call per request here is measurable,
                    # docs/benchmarks.md, issue 19).
                    num_tokens = len(st.request.all_token_ids)
                    confirmed = end if end < num_tokens else num_tokens
                    if confirmed >= st.confirmed and len(ids) == num_groups:
                        dirty.append((st, confirmed, ids, False))
                        continue
            if c.resumed_from_preemption:
                resumed = True
            dirty.append(news(st, end, ids, c.resumed_from_preemption))
        decode = so.decode_requests
        # Entries from here on are checked as they are built, not by ``step_entries``.
        num_general = len(dirty)
        if decode.request_ids:
            self._decode_news(decode, dirty)
        # -- boundary check (kvflow.core.validate): every entry that changes something --
        if num_general:
            entries = dirty[:num_general] if len(dirty) > num_general else dirty
            if prechecked:
                # Ids validated at allocation, given again unchanged: checked as no ids (the
                # rest of the entry still is).
                entries = [
                    (e[0], e[1], self._no_new, e[3]) if i in prechecked else e
                    for i, e in enumerate(entries)
                ]
            validate.step_entries(
                entries, _request_id, num_groups, self.config.num_gpu_blocks, self._null
            )
        if len(dirty) > num_general and len(set(map(_state_of, dirty))) != len(dirty):
            validate.step_entries(
                dirty, _request_id, num_groups, self.config.num_gpu_blocks, self._null
            )  # names the request scheduled twice
        # Every table is checked: from here on nothing raises on bad input.
        self._scheduled = (
            len(so.new_requests) + len(so.cached_requests) + len(so.decode_requests.request_ids)
        )
        self._finished_since = 0

        flush = False
        if so.preempted_request_ids:
            flush = True
            for rid in sorted(so.preempted_request_ids):
                st = requests.get(rid)
                if st is not None:
                    self._preempt(st)
        if so.finished_request_ids:
            for rid in sorted(so.finished_request_ids):
                st = requests.get(rid)
                if st is not None and not st.finishing:
                    # The engine dropped the request without request_finished: its blocks are gone.
                    self._finish(st, None, engine_freed=True)
        ledger = self._ledger
        if self._allocated:
            for st in self._allocated.values():
                ledger.plan_load(st)
            self._allocated.clear()
        store = self._store
        if (
            not so.new_requests
            and not resumed
            and not flush
            and not so.finished_request_ids
            and num_groups == 1
            and store.interval == 1
            and lazy is None
            and not self._reset_pending
        ):
            # Running requests only (no table replaced) over one group, a store each step: the
            # eager policy applies and collects the entries in one pass (the general path of
            # the ``else``, fused).
            if dirty:
                picked = store.apply_running_one(dirty)
                if picked.reqs:
                    ledger.plan_store(picked, STEP_STORE_ID)
        else:
            advancing: list[RequestState] = []
            replaced = False
            # Eager stores coalesced over ``eager_store_interval`` plans: a request with a
            # completed block joins the deferred ones here, while its state is at hand.
            deferring = store.interval > 1
            fresh = not store.deferred
            if lazy is not None and dirty:
                # Nothing below reads the cursor before ``_advance``: every take first is the
                # same.
                keep: set[int] = set()
                if lazy.has_stale:
                    for st, _, ids, replace in dirty:
                        if replace:
                            keep.update(self._gpu_hits(st, ids))
                lazy.taken_tables([entry[2] for entry in dirty], keep)
            for st, confirmed, ids, replace in dirty:
                if replace:
                    replaced = True
                    st.checked_table = None  # used up (the step passed its checks)
                    st.table = tuple([list(g) for g in ids])
                    st.cursor = [0] * num_groups
                elif num_groups == 1:
                    if ids[0]:
                        st.table[0].extend(ids[0])
                else:
                    for table, new_ids in zip(st.table, ids, strict=True):
                        if new_ids:
                            table.extend(new_ids)
                if replace or confirmed >= st.next_boundary or confirmed < st.confirmed:
                    if deferring:
                        store.defer(st, confirmed)
                    else:
                        advancing.append(st)
                # Else no group completes a block and confirmed tokens did not go back:
                # advancing would change nothing, its boundary included.
                st.confirmed = confirmed
            if deferring:
                due = store.due(fresh=fresh, replaced=replaced)
                if due is not None:
                    advancing = due
            if advancing:
                # One pass over the step's completed blocks (requests are independent of each
                # other here, so advancing after every table grew is the same as advancing each
                # in turn).
                self._advance(advancing, STEP_STORE_ID)
            if lazy is not None:
                self._lazy_walk(lazy)
        if not ledger.pending and not ledger.abandoned:
            return StepPlan(so.step, (), (), flush, ())  # most eager steps: nothing to launch
        return ledger.launch(so.step, flush)

    def quiet_step(self, step: int) -> StepPlan | None:
        """``build_step_plan`` of a step that holds no news for the CPU tier, given by its number
        alone: no request new, resumed, finished or preempted, and running requests whose steps
        the policy does not need. That is a steady decode step under the lazy policy over a
        keyed GPU view (``LazyCursor.keyed``): the walk, and whatever it or an earlier call left
        to launch. None where that leaves the workers nothing to do (most such steps: no plan
        object is made for them). ``ConfigError`` under any other policy, whose running
        requests have news."""
        lazy = self._quiet_lazy
        if lazy is None:
            raise ConfigError(
                "quiet_step needs the lazy store policy over a keyed GPU view: "
                "other policies need every running request's step (decode_step)"
            )
        if type(step) is not int or step < 0:
            validate.strict_int("step", step)
        if self._allocated:
            # Hits allocated since the last step: the general path turns them into loads.
            return self.build_step_plan(SchedulerOutput(step))
        return self._walk_step(step, lazy)

    def _quiet_lazy_step(self, so: SchedulerOutput, lazy: LazyCursor) -> StepPlan:
        """``build_step_plan`` of a lazy step without requests, finishes or preemptions."""
        validate.scheduler_output(so)
        self._scheduled = self._finished_since = 0
        plan = self._walk_step(so.step, lazy)
        return StepPlan(so.step, (), (), False, ()) if plan is None else plan

    def _walk_step(self, step: int, lazy: LazyCursor) -> StepPlan | None:
        """The walk, and whatever it or an earlier call left to launch; None if nothing."""
        ledger = self._ledger
        self._lazy_walk(lazy)
        if not ledger.pending and not ledger.abandoned:
            return None
        return ledger.launch(step, False)

    def _lazy_walk(self, lazy: LazyCursor) -> None:
        """The lazy walk's store, planned; while a reset is pending, no store: the walk only
        follows the blocks the engine takes."""
        if self._reset_pending:
            lazy.follow()
            return
        batch = lazy.walk()
        if batch is not None:
            self._plan_store(batch, LAZY_REQUEST_ID)

    def _gpu_hits(self, st: RequestState, table: Sequence[Sequence[int]]) -> list[int]:
        """The blocks of a table handed over whole (a new or resumed request) that its GPU
        prefix hit covers: their content is the engine's, kept from before."""
        return [
            b
            for (_, bs), ids in zip(self._geo.group_sizes, table, strict=True)
            for b in ids[: st.gpu_hit // bs]
        ]

    def _advance(self, sts: Sequence[RequestState], request_id: str) -> None:
        """Hand the blocks the requests completed since their last call to the store policy;
        the eager policy's candidates become one store named ``request_id``."""
        if self._lazy is not None:
            self._lazy.record(sts)
            return
        batch = self._store.collect(sts, pick=not self._reset_pending)
        if batch.reqs:
            self._plan_store(batch, request_id)

    def _plan_store(self, batch: StoreBatch, request_id: str) -> None:
        evicted = self._ledger.plan_store(batch, request_id)
        if evicted and self._lazy is not None:
            # Evicted copies may back blocks ahead of the cursor: they are no longer covered.
            self._lazy.reset("cpu_eviction")

    def _running_news(self, st: RequestState, end: int, ids: GroupBlockIds, replace: bool) -> News:
        """A running request with news (``end`` tokens computed after the step), its table
        checked; the ``dirty`` entry ``build_step_plan`` applies once every request passed."""
        confirmed = confirmed_tokens(st, end)
        if (
            replace
            or confirmed >= st.next_boundary
            or confirmed < st.confirmed
            or len(ids) != self._num_groups
        ):
            self._check_table(st, end, confirmed, ids, replace)
        # Else only new blocks: every group's table already holds its confirmed blocks (the
        # check passed when they completed; tables only grow until a preemption resets the
        # boundary), so it holds them with more blocks too.
        return st, confirmed, ids, replace

    # ---- lifecycle ----------------------------------------------------------------------------

    def _new_request(self, request: RequestLike) -> RequestState:
        hashers = self._hashers(request)
        n = self._num_groups
        st = RequestState(
            request=request,
            hashers=hashers,
            hashing=own_hashers(hashers),
            hash_lists=tuple(h.hashes for h in hashers),
            table=tuple([] for _ in range(n)),
            cursor=[0] * n,
        )
        self._requests[request.request_id] = st
        return st

    def _hashers(self, request: RequestLike) -> list[HashChain]:
        """Per block size, the engine's own hashes of the request where it has them, else
        kvflow's hasher over its tokens."""
        # ``EngineHashedRequest`` by its one method: a runtime protocol check is far slower.
        engine: Callable[[int], Sequence[BlockHash] | None] | None = getattr(
            request, "engine_block_hashes", None
        )
        out: list[HashChain] = []
        for bs in self._geo.hasher_sizes:
            hashes = None if engine is None else engine(bs)
            out.append(
                BlockHasher(bs, request.extra_keys)
                if hashes is None
                else EngineBlockHashes(bs, hashes)
            )
        return out

    def _drop_match(self, st: RequestState) -> None:
        m, st.match = st.match, None
        if m is not None:
            self._allocated.pop(st.request.request_id, None)
            self._ledger.unpin(m)

    def _preempt(self, st: RequestState) -> None:
        # In-flight stores keep going: the plan's flush makes the engine wait for them before it
        # reuses the blocks, so their data is good. A load's target blocks are gone.
        self._drop_match(st)
        self._ledger.drop_request(st, stores=False)
        # Its GPU blocks are gone: completed blocks not stored yet are lost with them.
        self._store.deferred.pop(st, None)
        st.forget_blocks(self._num_groups)
        if debug_enabled():
            log.debug("offload_request_preempted", request_id=st.request.request_id)

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]] | None = None
    ) -> tuple[bool, dict[str, object] | None]:
        """The request is done. Returns ``(delay_free, params)``: if ``delay_free``, the engine keeps
        its GPU blocks until the request id appears in ``StepOutcome.finished_sending``.

        Eager: any full computed block not yet stored is stored now (from ``block_ids``).
        """
        # -- boundary check (kvflow.core.validate): the table, before anything changes --
        if block_ids is not None:
            block_ids = validate.group_ids(
                request.request_id,
                block_ids,
                self._num_groups,
                self.config.num_gpu_blocks,
                self._null,
            )
        st = self._requests.get(request.request_id)
        if st is None:
            return False, None
        self._finished_since += 1
        return self._finish(st, block_ids, engine_freed=False), None

    def _finish(
        self, st: RequestState, block_ids: Sequence[Sequence[int]] | None, *, engine_freed: bool
    ) -> bool:
        rid = st.request.request_id
        table: list[list[int]] | None = None
        if block_ids is not None and not engine_freed:
            table = [[int(b) for b in g] for g in block_ids]
            if len(table) != self._num_groups:
                raise ConfigError(f"{rid}: {len(table)} block groups, expected {self._num_groups}")
        self._drop_match(st)
        ledger = self._ledger
        # If the engine already freed the blocks, copies reading them produce garbage: abandon.
        ledger.drop_request(st, stores=engine_freed)
        # Blocks deferred by the store interval are stored with the rest: no cursor passed them,
        # and the manager's own table still names them when the engine passes none.
        deferred = st in self._store.deferred
        self._store.deferred.pop(st, None)
        if not engine_freed and not self._reset_pending and (table is not None or deferred):
            if table is not None:
                confirmed = st.confirmed
                st.table = tuple(
                    table[g] if len(table[g]) >= confirmed // bs else st.table[g]
                    for g, bs in self._geo.group_sizes
                )
            self._advance((st,), rid)
        st.finishing = True
        live = ledger.has_live(st)
        st.delay_free = live and not engine_freed
        if live:
            ledger.waiting[st] = None
        else:
            ledger.waiting.pop(st, None)
            del self._requests[rid]
        if debug_enabled():
            log.debug("offload_request_finished", request_id=rid, delay_free=st.delay_free)
        return st.delay_free

    def reset_cache(self) -> ResetStatus:
        """Forget the CPU prefix cache. In-flight transfers are abandoned (their results dropped
        when they settle); the reset is PENDING until then and COMPLETE after."""
        for st in self._requests.values():
            self._drop_match(st)
        self._ledger.drop_all()
        self._reset_pending = True
        if self._lazy is not None:
            self._lazy.forget()
            self._lazy.reset("reset")
        status = self._try_complete_reset()
        log.info("offload_reset", status=status.value, in_flight=len(self._ledger.xfers))
        return status

    def _try_complete_reset(self) -> ResetStatus:
        if not self._reset_pending:
            return ResetStatus.COMPLETE
        if self._ledger.xfers:
            return ResetStatus.PENDING
        for pool in self._cpu:
            done = pool.reset_prefix_cache()
            assert done, f"{pool.name}: blocks still in use after every transfer settled"
        self._reset_pending = False
        self._reset_done = True
        return ResetStatus.COMPLETE

    # ---- reports ------------------------------------------------------------------------------

    def update_from_reports(self, reports: Iterable[StepReport]) -> StepOutcome:
        """Apply worker reports. A transfer settles once all ``world_size`` ranks reported it: it
        commits if all succeeded, else fails. Invalid input raises ``ReportError`` and changes nothing.
        """
        ledger = self._ledger
        committed, failed, store_failed = ledger.apply_reports(reports, self.config.world_size)
        if store_failed:
            if self._lazy is not None:
                # Blocks ahead of the lazy cursor may have counted on the failed store.
                self._lazy.reset("store_failed")
            else:
                for x in store_failed:
                    self._store.rearm(self._requests.values(), x.transfer.transfer_id, x.hashes)
        if self._reset_pending:
            self._try_complete_reset()
        if not (
            ledger.finished_sending or ledger.finished_recving or ledger.invalid or self._reset_done
        ):
            if not (committed or failed):
                return NO_OUTCOME  # most steps: nothing settled
            return StepOutcome(committed=tuple(committed), failed=tuple(failed))
        out = StepOutcome(
            take(ledger.finished_sending),
            take(ledger.finished_recving),
            tuple(committed),
            tuple(failed),
            take(ledger.invalid),
            self._reset_done,
        )
        self._reset_done = False
        return out


__all__ = ["OffloadManager"]
