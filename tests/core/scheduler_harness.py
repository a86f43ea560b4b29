"""Test harness for the offload manager: a tiny engine on a real GPU ``BlockPool`` and fake workers.

The engine side allocates GPU blocks, builds ``SchedulerOutput``\\ s and "computes" tokens by writing
each completed block's expected content (its hash) into ``gpu_data``. The fake workers copy
contents between ``gpu_data`` and ``cpu_data`` only when a test makes a rank report, so every
round trip checks that the right bytes arrived in the right block.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Sequence

from kvflow.core.block_pool import BlockPool
from kvflow.core.gpu_view import BlockKey, BlockPoolGpuView, GpuCacheView
from kvflow.core.hashing import BlockHash, hash_block, hash_blocks
from kvflow.core.offload import (
    GroupSpec,
    OffloadManager,
    OffloadManagerConfig,
    ResetStatus,
    StepOutcome,
)
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.requests import (
    NO_DECODE_REQUESTS,
    CachedRequest,
    DecodeRequests,
    KVRequest,
    NewRequest,
    SchedulerOutput,
)
from kvflow.core.transfer import Direction


class FakeWorkers:
    """``world_size`` ranks that hold every launched transfer until a test says it finished."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.launched: dict[int, TransferSpec] = {}
        self.unreported: dict[int, set[int]] = {}  # transfer id → ranks yet to report
        self.plans: list[StepPlan] = []

    def run(self, plan: StepPlan) -> None:
        self.plans.append(plan)
        for spec in (*plan.stores, *plan.loads):
            self.launched[spec.transfer_id] = spec
            self.unreported[spec.transfer_id] = set(range(self.world_size))

    def in_flight(self) -> list[int]:
        return sorted(t for t, ranks in self.unreported.items() if ranks)

    def report(
        self,
        rank: int,
        completed: Iterable[int] = (),
        failed: Iterable[int] = (),
        invalid: Iterable[int] = (),
    ) -> StepReport:
        return StepReport(rank, tuple(completed), tuple(failed), frozenset(invalid))

    def accepted(self, reports: Iterable[StepReport]) -> None:
        """The manager took these reports: their ranks are done with those transfers."""
        for report in reports:
            for tid in (*report.completed, *report.failed):
                self.unreported.get(tid, set()).discard(report.rank)


class KeyedView(BlockPoolGpuView):
    """``KeyedGpuCacheView`` over the Sim's GPU pool: ``keys`` maps the engine's block hash to
    kvflow's key of the content (the Sim fills it as it computes blocks), as vLLM's hashes are."""

    __slots__ = ("_keys",)

    def __init__(self, pool: BlockPool, keys: dict[Hashable, BlockKey]) -> None:
        super().__init__(pool)
        self._keys = keys

    def block_key(self, block_id: int) -> BlockKey | None:
        h = self._blocks[block_id].block_hash
        return None if h is None else self._keys.get(h)

    def scan_free(
        self, after: int | None, limit: int
    ) -> tuple[list[int], list[tuple[int, BlockKey]]]:
        ids: list[int] = []
        keyed: list[tuple[int, BlockKey]] = []
        bid = self.first_free() if after is None else self.next_free(after)
        while bid is not None and len(ids) < limit:
            ids.append(bid)
            key = self.block_key(bid)
            if key is not None:
                keyed.append((bid, key))
            bid = self.next_free(bid)
        return ids, keyed

    def first_free_in(self, block_ids: Container[int]) -> int | None:
        bid = self.first_free()
        while bid is not None and bid not in block_ids:
            bid = self.next_free(bid)
        return bid

    def keyed_blocks(self) -> Iterator[tuple[int, BlockKey]]:
        for block in self._blocks:
            key = self.block_key(block.block_id)
            if key is not None:
                yield block.block_id, key


class Sim:
    """A minimal engine around one ``OffloadManager``; block ids are shared by all groups.
    ``keyed``: the lazy policy reads block contents from a ``KeyedView`` (as over vLLM)."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        *,
        world_size: int = 1,
        store_policy: str = "eager",
        lazy_watermark: int = 64,
        gpu_blocks: int = 256,
        null_block: bool = False,
        wrap_view: Callable[[GpuCacheView], GpuCacheView] | None = None,
        decode_columns: bool = False,
        eager_store_interval: int = 1,
        enable_events: bool = False,
        keyed: bool = False,
        decode_steps: bool = False,
        quiet_steps: bool = False,
        fence_loads: str = "never",
    ) -> None:
        self.gpu = BlockPool(gpu_blocks, name="gpu")
        self.keys: dict[Hashable, BlockKey] = {}
        # Pass one-token, non-speculative running requests as DecodeRequests columns.
        self.decode_columns = decode_columns
        # A step of running requests only, one token each, goes to ``decode_step`` whole.
        self.decode_steps = decode_steps or quiet_steps
        # Such a step goes to ``quiet_step`` by its number alone, and no step passes a running
        # request (lazy over a keyed view, as vLLM's adapter does): their new blocks are never
        # told.
        self.quiet_steps = quiet_steps
        self.null: int | None = None
        if null_block:
            self.null = self.gpu.get_new_blocks(1)[0]  # held forever, like vLLM's null block
        self.config = OffloadManagerConfig(
            groups=tuple(groups),
            world_size=world_size,
            store_policy=store_policy,
            lazy_watermark=lazy_watermark,
            null_block_id=self.null,
            eager_store_interval=eager_store_interval,
            enable_events=enable_events,
            fence_loads=fence_loads,
            num_gpu_blocks=gpu_blocks,  # the engine's pool: ids beyond it are refused
        )
        view: GpuCacheView = KeyedView(self.gpu, self.keys) if keyed else BlockPoolGpuView(self.gpu)
        self.mgr = OffloadManager(
            self.config, gpu_view=view if wrap_view is None else wrap_view(view)
        )
        self.workers = FakeWorkers(world_size)
        self.step_no = 0
        self.requests: dict[str, KVRequest] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.null_prefix: dict[tuple[str, int], int] = {}  # (request, group) → padded blocks
        self.delayed: set[str] = set()  # finished, GPU blocks kept for a copy in flight
        self.flushed: set[int] = set()  # in flight, but their data moved at a preemption flush
        self.gpu_data: dict[int, BlockHash] = {}
        self.resets = 0  # ``reset_cache`` calls so far
        self.resets_at_plan: list[int] = []  # ``resets`` when each plan was built
        self.epoch: dict[
            int, int
        ] = {}  # GPU block → ``resets`` when its cached content was computed
        self.cpu_data: list[dict[int, BlockHash]] = [{} for _ in groups]
        self.outcomes: list[StepOutcome] = []

    # ---- engine side ----------------------------------------------------------------------

    def hashes(self, req: KVRequest, g: int) -> list[BlockHash]:
        bs = self.config.groups[g].block_size
        return hash_blocks(req.all_token_ids, bs, extra_keys=req.extra_keys)

    def _grow(self, rid: str, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Allocate GPU blocks so the table holds ``num_tokens``; return the new ids per group."""
        table = self.tables.setdefault(rid, [[] for _ in self.config.groups])
        new: list[tuple[int, ...]] = []
        for g, spec in enumerate(self.config.groups):
            added: list[int] = []
            if not table[g] and self.null is not None:
                # Like vLLM's sliding-window groups: leading blocks outside the window are padding.
                added += [self.null] * self.null_prefix.get((rid, g), 0)
            need = -(-num_tokens // spec.block_size) - len(table[g]) - len(added)
            added += self.gpu.get_new_blocks(max(0, need))
            table[g].extend(added)
            new.append(tuple(added))
        return tuple(new)

    def _compute(self, req: KVRequest, upto: int) -> None:
        """The step's forward pass: every block completed by ``upto`` tokens gets its content."""
        rid = req.request_id
        for g, spec in enumerate(self.config.groups):
            hashes = self.hashes(req, g)
            for i in range(upto // spec.block_size):
                b = self.tables[rid][g][i]
                if b == self.null:
                    continue
                self.gpu_data[b] = hashes[i]
                if self.gpu.block(b).block_hash is None:
                    engine_hash = hash_block(hashes[i], [g])
                    self.gpu.cache([b], [engine_hash])
                    self.keys[engine_hash] = (g, hashes[i])
                    self.epoch[b] = self.resets
        self.computed[rid] = upto

    def add(self, rid: str, tokens: Sequence[int], extra_keys: tuple[str, ...] = ()) -> KVRequest:
        req = KVRequest.from_prompt(rid, list(tokens), extra_keys)
        self.requests[rid] = req
        return req

    def stored(
        self, rid: str, tokens: Sequence[int], extra_keys: tuple[str, ...] = ()
    ) -> KVRequest:
        """A request prefilled in one step whose stores every rank completed."""
        req = self.add(rid, tokens, extra_keys)
        self.match(req)
        self.step(new=[(req, len(req.all_token_ids))])
        self.complete()
        return req

    def loading(self, rid: str, tokens: Sequence[int]) -> tuple[KVRequest, TransferSpec]:
        """A request whose whole CPU hit is allocated and launched as a load (still in flight)."""
        req = self.add(rid, tokens)
        hit, is_async = self.match(req)
        assert hit, f"{rid}: no CPU hit"
        assert is_async
        self.alloc(req, hit, hit)
        (load,) = self.step().loads
        return req, load

    def match(self, req: KVRequest, gpu_computed: int = 0) -> tuple[int | None, bool]:
        return self.mgr.get_num_new_matched_tokens(req, gpu_computed)

    def alloc(self, req: KVRequest, num_tokens: int, external: int) -> list[list[int]]:
        """Allocate blocks for ``num_tokens`` (GPU hits + external) and tell the manager."""
        self._grow(req.request_id, num_tokens)
        table = self.tables[req.request_id]
        self.mgr.update_state_after_alloc(req, table, external)
        self.computed[req.request_id] = num_tokens
        return table

    def step(
        self,
        new: Sequence[tuple[KVRequest, int]] = (),
        cached: Sequence[tuple[KVRequest, int] | tuple[KVRequest, int, int]] = (),
        preempted: Iterable[str] = (),
        finished: Iterable[str] = (),
        resumed: Sequence[tuple[KVRequest, int]] = (),
    ) -> StepPlan:
        """One engine step. ``new``/``resumed``: (request, tokens scheduled); ``cached``: (request,
        tokens scheduled[, of which speculative])."""
        self.step_no += 1
        news: list[NewRequest] = []
        caches: list[CachedRequest] = []
        for rid in preempted:
            self._free(rid)
            self.computed[rid] = 0
        for req, n in new:
            rid = req.request_id
            done = self.computed.get(rid, 0)
            self._grow(rid, done + n)
            news.append(NewRequest(rid, self.tables[rid], done, n))
        for req, n in resumed:
            rid = req.request_id
            self._grow(rid, n)
            caches.append(CachedRequest(rid, self.tables[rid], 0, n, 0, True))
        steady = (
            self.decode_steps
            and cached
            and not new
            and not resumed
            and not preempted
            and not finished
            and all(item[1] == 1 and (len(item) == 2 or not item[2]) for item in cached)
        )
        decode: list[tuple[str, int, tuple[tuple[int, ...], ...]]] = []
        rows: list[tuple[str, int, tuple[list[int], ...] | None]] = []  # a steady step's
        for item in cached:
            req, n = item[0], item[1]
            spec = item[2] if len(item) == 3 else 0
            rid = req.request_id
            done = self.computed[rid]
            ids = self._grow(rid, done + n)
            if self.quiet_steps:
                continue  # as vLLM's adapter over a keyed view: no running request is passed
            if steady:
                # As vLLM passes them: per group lists, or None for no new block.
                rows.append((rid, done, tuple(list(g) for g in ids) if any(ids) else None))
            elif self.decode_columns and n == 1 and not spec:
                decode.append((rid, done, ids))
            else:
                caches.append(CachedRequest(rid, ids, done, n, spec))
        so = SchedulerOutput(
            self.step_no,
            tuple(news),
            tuple(caches),
            frozenset(finished),
            frozenset(preempted),
            DecodeRequests(*zip(*decode, strict=True)) if decode else NO_DECODE_REQUESTS,
        )
        if steady and self.quiet_steps:
            quiet = self.mgr.quiet_step(self.step_no)
            plan = StepPlan(self.step_no) if quiet is None else quiet
        elif steady:
            plan = self.mgr.decode_step(
                self.step_no, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
            )
        else:
            plan = self.mgr.build_step_plan(so)
        self.resets_at_plan.append(self.resets)
        if plan.flush:
            # The worker's handle_preemptions waits for every copy launched so far before this
            # step's forward: their data moves now, whenever their ranks report.
            for tid in self.workers.in_flight():
                if tid not in self.flushed:
                    self._copy(self.workers.launched[tid])
                    self.flushed.add(tid)
        self.workers.run(plan)
        for req, n in new:
            self._compute(req, self.computed.get(req.request_id, 0) + n)
        for req, n in resumed:
            self._compute(req, n)
        for item in cached:
            req, n = item[0], item[1]
            spec = item[2] if len(item) == 3 else 0
            self._compute(req, self.computed[req.request_id] + n - spec)
        return plan

    def reset_cache(self) -> ResetStatus:
        """The engine resets the connector's cache (its own GPU prefix cache stays, as when
        vLLM's GPU reset fails with requests running)."""
        self.resets += 1
        return self.mgr.reset_cache()

    def decode(self, req: KVRequest, token: int) -> StepPlan:
        """Append one sampled token and run a decode step for it."""
        req.all_token_ids.append(token)
        return self.step(cached=[(req, 1)])

    def finish(self, req: KVRequest) -> bool:
        rid = req.request_id
        table = self.tables.get(rid) or [[] for _ in self.config.groups]
        delay, params = self.mgr.request_finished(req, table)
        assert params is None
        if delay:
            self.delayed.add(rid)
        else:
            self._free(rid)
        return delay

    def _free(self, rid: str) -> None:
        for ids in self.tables.pop(rid, []):
            self.gpu.free(reversed([b for b in ids if b != self.null]))

    # ---- worker side ----------------------------------------------------------------------

    def _copy(self, spec: TransferSpec) -> None:
        for g, (gpu, cpu) in enumerate(zip(spec.gpu_block_ids, spec.cpu_block_ids, strict=True)):
            for gb, cb in zip(gpu, cpu, strict=True):
                if spec.direction is Direction.STORE:
                    self.cpu_data[g][cb] = self.gpu_data[gb]
                else:
                    self.gpu_data[gb] = self.cpu_data[g][cb]

    def report(self, reports: Iterable[StepReport]) -> StepOutcome:
        """Hand reports to the manager; copy the data of what completed; act on the outcome."""
        reports = list(reports)
        out = self.mgr.update_from_reports(reports)
        self.workers.accepted(reports)
        for tid in out.committed:
            if tid not in self.flushed:
                self._copy(self.workers.launched[tid])
        self.flushed.difference_update((*out.committed, *out.failed))
        for rid in out.finished_sending:
            assert rid in self.delayed, f"{rid} reported finished_sending without delay"
            self.delayed.discard(rid)
            self._free(rid)
        self.outcomes.append(out)
        return out

    def complete(
        self, tids: Iterable[int] | None = None, ranks: Iterable[int] | None = None
    ) -> StepOutcome:
        """Every listed rank (default all) reports every listed transfer (default all) done."""
        tids = self.workers.in_flight() if tids is None else list(tids)
        ranks = range(self.config.world_size) if ranks is None else list(ranks)
        reports = []
        for r in ranks:
            mine = [t for t in tids if r in self.workers.unreported.get(t, set())]
            reports.append(self.workers.report(r, completed=mine))
        return self.report(reports)

    # ---- checks ---------------------------------------------------------------------------

    def on_cpu(self, req: KVRequest, g: int = 0) -> list[bool]:
        """Per block of ``req`` in group ``g``: is it in the CPU prefix cache with the right data?"""
        pool = self.mgr.cpu_pools[g]
        out = []
        for h in self.hashes(req, g):
            bid = pool.get_cached_block(h)
            out.append(bid is not None and self.cpu_data[g].get(bid) == h)
        return out

    def drain(self) -> None:
        """Finish every request, settle every copy, then check that no ref leaked on either pool."""
        for rid, req in self.requests.items():
            if rid in self.delayed:
                continue
            if self.mgr.has_request(rid):
                self.finish(req)
            else:
                self._free(rid)
        for _ in range(4):
            self.step()
            self.complete()
        assert not self.delayed, f"requests never reported finished_sending: {self.delayed}"
        assert self.mgr.num_live_transfers() == 0
        for pool in self.mgr.cpu_pools:
            assert pool.num_free_blocks == pool.num_blocks, f"{pool.name}: leaked CPU refs"
        held = 0 if self.null is None else 1
        assert self.gpu.num_free_blocks == self.gpu.num_blocks - held, "leaked GPU refs"
