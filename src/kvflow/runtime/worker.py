"""The worker-side runtime: registers the engine's KV caches, runs each ``StepPlan``, reports.

Per step the engine (through the connector) calls ``bind(plan)``, ``start_load_kv()`` before its
forward pass, ``wait_for_save()`` after it (stores are fenced on the compute issued so far), and
later ``get_finished()`` / ``build_report()``. Each transfer is a ``core.transfer.Transfer``
driven through the one transition table: PENDING at bind, IN_FLIGHT at launch, COMMITTED or
FAILED when its copy's fence finishes, RELEASED once reported; a transfer the plan abandons while
in flight is ABANDONED and released (still reported, so the scheduler can drop its block
references) when the device is done with it.

Methods other than the ``async`` ones are synchronous and must run on the event loop's thread;
engines with a synchronous step loop drive it through a ``kvflow.runtime.sync_worker.SyncWorker``
(``make_sync_worker``). ``WorkerOptions`` is how all of them are configured.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial

import anyio
from attrs import define, field, frozen

from kvflow.backends.base import Backend, CopiesInParts, Fence, FenceStatus
from kvflow.core import validate
from kvflow.core.layout import KVLayout, LayerParts, layer_parts
from kvflow.core.logs import get_logger
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.transfer import Direction, Transfer, TransferInput, TransferState, apply
from kvflow.errors import ClosedError, ConfigError, DeadlineError, ProtocolError
from kvflow.runtime.clock import Clock, SystemClock
from kvflow.runtime.deadline import within
from kvflow.runtime.executor import CopyOrder, CopyStats, DmaExecutor, FencedBatch
from kvflow.runtime.reactor import Reactor
from kvflow.runtime.timeouts import Timeouts

log = get_logger("kvflow.worker")


@frozen
class WorkerOptions:
    """How a worker runtime is built, whoever drives its loop.

    ``rank``: this worker's tensor-parallel rank (in its reports). ``clock``: what the reactor
    reads and sleeps on (``SystemClock`` when None; tests pass a ``FakeClock``). ``coalesce``:
    one backend batch for all the transfers of a direction the engine launched at once.
    ``min_backoff`` / ``max_backoff``: the reactor's poll back-off, in seconds. ``timeouts``:
    the bounds of the drain at shutdown and of a flush, on ``clock``.
    """

    rank: int = 0
    clock: Clock | None = None
    coalesce: bool = True
    min_backoff: float = 20e-6
    max_backoff: float = 1e-3
    timeouts: Timeouts = field(factory=Timeouts)
    load_parts: int = 1
    """Fenced loads land in up to this many parts by layer, where the backend can
    (``CopiesInParts``) and the engine waits layer by layer; 1: whole."""

    def __attrs_post_init__(self) -> None:
        validate.positive_int("load_parts", self.load_parts)


@define(eq=False, slots=True)
class _Entry:
    spec: TransferSpec
    transfer: Transfer


@define(eq=False)
class WorkerRuntime:
    """One worker's (rank's) transfer runtime. Open it with ``async with WorkerRuntime.open(...)``."""

    backend: Backend
    rank: int = 0
    clock: Clock = field(factory=SystemClock)
    coalesce: bool = True
    min_backoff: float = 20e-6
    max_backoff: float = 1e-3
    layout: KVLayout | None = None
    timeouts: Timeouts = field(factory=Timeouts)
    """Bounds of the drain at shutdown and of a flush, on ``clock``."""
    load_parts: int = 1
    """``WorkerOptions.load_parts``."""
    progress_hooks: list[Callable[[], None]] = field(factory=list)
    """Called on the loop each time copies settle (the sync facade wakes an idle engine)."""
    submit_at_launch: bool = False
    """Submit a launched order on the caller's thread when nothing is queued ahead of it
    (``DmaExecutor.submit_now``), not on the executor's next loop turn: ``InlineSyncWorker``
    sets it, since each loop turn it runs costs the engine's thread more than the submit."""
    reactor: Reactor = field(init=False)
    executor: DmaExecutor = field(init=False)
    _entries: dict[int, _Entry] = field(factory=dict)
    _plan: StepPlan | None = None
    _plan_checked: bool = False  # ``bind``'s ``checked``
    _loads_launched: bool = False
    _stores_launched: bool = False
    _live: dict[tuple[str, Direction], int] = field(factory=dict)
    _finished: dict[Direction, set[str]] = field(
        factory=lambda: {Direction.STORE: set(), Direction.LOAD: set()}
    )
    _completed: list[int] = field(factory=list)
    _failed: list[int] = field(factory=list)
    _invalid: set[int] = field(factory=set)
    _landed: dict[str, float] = field(factory=dict)  # request id → its loads' copies ended
    _no_news: StepReport = field(init=False)
    """This rank's report of a step where nothing finished (most steps): frozen, so one serves."""
    _stopping: bool = False
    _closed: bool = False
    _stopped: anyio.Event = field(factory=anyio.Event)

    def __attrs_post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"negative rank {self.rank}")
        validate.positive_int("load_parts", self.load_parts)
        self._no_news = StepReport(rank=self.rank)
        self.reactor = Reactor(self.backend, self.clock, self.min_backoff, self.max_backoff)
        self.executor = DmaExecutor(
            self.backend, self.reactor, self._on_done, self.coalesce, now=self.clock.now
        )

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(
        cls, backend: Backend, options: WorkerOptions | None = None
    ) -> AsyncIterator[WorkerRuntime]:
        """Start the reactor and executor tasks; on exit drain (or, on error, cancel) and close.
        A drain past its deadline raises its ``DeadlineError`` here, unwrapped."""
        opts = options if options is not None else WorkerOptions()
        rank = opts.rank
        rt = cls(
            backend,
            rank=rank,
            clock=opts.clock if opts.clock is not None else SystemClock(),
            coalesce=opts.coalesce,
            min_backoff=opts.min_backoff,
            max_backoff=opts.max_backoff,
            timeouts=opts.timeouts,
            load_parts=opts.load_parts,
        )
        late: DeadlineError | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(rt.reactor.run)
            tg.start_soon(rt.executor.run)
            log.info("worker_runtime_started", rank=rank, backend=backend.name)
            try:
                yield rt
            except BaseException:
                rt._abort()
                tg.cancel_scope.cancel()
                raise
            else:
                try:
                    await rt.shutdown()
                except DeadlineError as exc:
                    late = exc  # raised below: a task group would wrap it
            finally:
                tg.cancel_scope.cancel()
        if late is not None:
            raise late

    async def shutdown(self, *, drain: bool = True) -> None:
        """Stop: ``drain`` submits and waits for everything queued; else queued copies fail
        (cause ``shutdown``) and only those already on the device are waited for. Then the
        reactor stops and the backend closes. Idempotent."""
        if self._closed:
            return
        if self._stopping:
            # Another task is shutting down: wait for it, as long as its drain may take.
            await within(
                self.clock,
                self.timeouts.drain_s,
                f"rank {self.rank}: another task's shutdown",
                self._stopped.wait,
            )
            return
        self._stopping = True
        log.info(
            "worker_runtime_stopping",
            rank=self.rank,
            drain=drain,
            queued=self.executor.queued,
            outstanding=self.executor.outstanding,
        )
        self.executor.close(drain=drain)
        what = (
            f"rank {self.rank}: {'drain' if drain else 'cancel'} at shutdown "
            f"({self.executor.queued} copy orders queued, {self.executor.outstanding} batches "
            "on the device)"
        )
        try:
            await within(self.clock, self.timeouts.drain_s, what, self.executor.wait_closed)
        except DeadlineError:
            # The device did not finish in time: abandon what is left, close, and say so.
            log.error("worker_runtime_drain_timed_out", rank=self.rank, drain=drain)
            self._abort()
            raise
        self._close_rest()

    def _abort(self) -> None:
        """Error path: no waiting on the loop; ``backend.close`` still waits for device copies."""
        if self._closed:
            return
        self.executor.close(drain=False)
        for e in self._entries.values():
            if e.transfer.state is TransferState.IN_FLIGHT:
                apply(e.transfer, TransferInput.ABANDON, cause="runtime_aborted")
        self._close_rest()

    def _close_rest(self) -> None:
        self._closed = True
        self._stopped.set()
        self.reactor.close()
        self.backend.close()
        log.info("worker_runtime_stopped", rank=self.rank)

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise ClosedError(f"worker runtime of rank {self.rank} is shut down")

    # -- registration -------------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Register the engine's named KV tensors with the backend; returns their layout."""
        self._check_open()
        self.layout = self.backend.register_kv_caches(kv_caches, num_blocks, groups)
        if self.load_parts > 1 and isinstance(self.backend, CopiesInParts):
            parts = layer_parts(self.layout, self.load_parts)
            if parts.count > 1:
                self.backend.prepare_parts(parts)
                self.executor.parts = parts
        return self.layout

    @property
    def load_parts_of(self) -> LayerParts | None:
        """How fenced loads are cut by layer, if they are (``WorkerOptions.load_parts``)."""
        return self.executor.parts

    def allocate_cpu_tier(self, num_blocks: int | Sequence[int]) -> None:
        """Allocate the CPU tier: ``num_blocks`` per group (an int: the same for every group)."""
        self._check_open()
        if self.layout is None:
            raise ProtocolError("allocate_cpu_tier before register_kv_caches")
        counts = (
            [num_blocks] * len(self.layout.groups)
            if isinstance(num_blocks, int)
            else list(num_blocks)
        )
        self.backend.allocate_cpu_tier(counts)

    # -- one step -----------------------------------------------------------------------------
    def bind(self, plan: StepPlan, *, checked: bool = False) -> None:
        """Take this step's plan: abandon what it abandons, create its transfers (PENDING).
        ``checked``: a ``PlanGate`` has checked the plan against this runtime's layout and CPU
        tier (the sync facades' bind), so the backend need not check its ids again
        (``CopyBatch.checked``)."""
        self._check_open()
        if self._plan is not None and not (self._loads_launched and self._stores_launched):
            raise ProtocolError(
                f"step {plan.step} bound while step {self._plan.step} has unlaunched transfers"
            )
        new = [*plan.stores, *plan.loads]
        if new:
            ids = [t.transfer_id for t in new]
            if len(set(ids)) != len(ids):
                raise ConfigError(f"step {plan.step} lists a transfer id twice")
            known = [i for i in ids if i in self._entries]
            if known:
                raise ProtocolError(f"step {plan.step}: transfers {known} are already known")
        validate.fenced_loads(plan)
        if plan.abandoned:
            self._abandon(plan.abandoned)
        for spec in new:
            self._entries[spec.transfer_id] = _Entry(
                spec, Transfer(spec.transfer_id, spec.direction, spec.request_id)
            )
        self._plan = plan
        self._plan_checked = checked
        self._loads_launched = not plan.loads
        self._stores_launched = not plan.stores
        if log.debug_enabled():  # with structlog configured, a filtered-out call still binds
            log.debug(
                "step_bound",
                rank=self.rank,
                step=plan.step,
                stores=len(plan.stores),
                loads=len(plan.loads),
                flush=plan.flush,
                abandoned=len(plan.abandoned),
            )

    def _abandon(self, transfer_ids: Sequence[int]) -> None:
        for tid in transfer_ids:
            e = self._entries.get(tid)
            if e is None:
                continue  # already reported and released: nothing left to abandon
            if e.transfer.state is TransferState.IN_FLIGHT:
                apply(e.transfer, TransferInput.ABANDON, cause="plan_abandoned")
            elif e.transfer.state is TransferState.PENDING:
                apply(e.transfer, TransferInput.CANCEL, cause="plan_abandoned")
                del self._entries[tid]

    def start_load_kv(self) -> None:
        """Launch the bound plan's loads (before the forward pass that needs their blocks)."""
        self._check_open()
        plan = self._plan
        if plan is None or self._loads_launched:
            return
        self._loads_launched = True
        self._launch(plan.step, plan.loads, (), frozenset(plan.fenced_loads))

    async def fenced_load_fences(self, step: int) -> list[FencedBatch]:
        """The fences of step ``step``'s fenced loads (launched by ``start_load_kv``), once the
        executor has submitted them: the engine's compute waits for these before its forward
        (per batch, its parts' fences in layer order where loads land in parts, else its own).
        A load whose submit failed has none (it fails, and the engine rolls its request back).
        ``DeadlineError`` past ``timeouts.load_s``."""
        executor = self.executor
        if executor.fenced_queued:
            what = f"rank {self.rank}: step {step}'s fenced loads submitted"
            await within(self.clock, self.timeouts.load_s, what, executor.fenced_submitted)
        return executor.take_fenced()

    async def settle_failed(self, fences: Sequence[Fence]) -> None:
        """Wait until the backend reports each of these batches finished and settle it: a
        compute wait found them failed, and a failed fenced load must be in the report of the
        step whose forward read it (not settled before the backend says so: copies of it may
        still run). ``DeadlineError`` past ``timeouts.load_s``."""
        for fence in fences:
            what = f"rank {self.rank}: a failed fenced load's batch reported finished"
            await within(self.clock, self.timeouts.load_s, what, partial(self.reactor.wait, fence))

    def wait_for_save(self, compute_fence: Fence | None = None) -> None:
        """Launch the bound plan's stores, fenced after the compute the engine issued so far:
        ``compute_fence`` if given (recorded on the engine's thread), else one recorded now."""
        self._check_open()
        plan = self._plan
        if plan is None or self._stores_launched:
            return
        fence = compute_fence if compute_fence is not None else self.backend.compute_fence()
        self._stores_launched = True
        self._launch(plan.step, plan.stores, (fence,))

    def launch(self) -> None:
        """``start_load_kv`` and ``wait_for_save`` together (after this step's compute is issued)."""
        self.start_load_kv()
        self.wait_for_save()

    def _launch(
        self,
        step: int,
        specs: Sequence[TransferSpec],
        wait_for: tuple[Fence, ...],
        fenced: frozenset[int] = frozenset(),
    ) -> None:
        entries = self._entries
        live = [s for s in specs if s.transfer_id in entries]
        if not live:
            return
        order = CopyOrder(
            step, live[0].direction, tuple(live), wait_for, fenced, self._plan_checked
        )
        now = self.submit_at_launch and self.executor.can_submit_now
        if not now:
            # Enqueue first: if the executor refuses (closing), no transfer has changed state.
            # The actor cannot run before the transitions below, which are all on this thread.
            self.executor.enqueue(order)
        counts = self._live
        for s in live:
            apply(entries[s.transfer_id].transfer, TransferInput.LAUNCH, cause="launched")
            key = (s.request_id, s.direction)
            counts[key] = counts.get(key, 0) + 1
        if now:
            # After the transitions: a refused submit settles its transfers at once.
            self.executor.submit_now(order)

    def _on_done(
        self,
        specs: Sequence[TransferSpec],
        status: FenceStatus,
        cause: str,
        landed: float | None,
    ) -> None:
        self._settled(specs, status, cause)
        if landed is not None:
            for s in specs:
                if s.direction is Direction.LOAD:
                    self._landed[s.request_id] = max(landed, self._landed.get(s.request_id, landed))
        for hook in self.progress_hooks:
            hook()

    def _settled(self, specs: Sequence[TransferSpec], status: FenceStatus, cause: str) -> None:
        ok = status is FenceStatus.DONE
        for s in specs:
            e = self._entries.get(s.transfer_id)
            if e is None:
                continue
            was_abandoned = e.transfer.state is TransferState.ABANDONED
            apply(e.transfer, TransferInput.COMPLETE if ok else TransferInput.FAIL, cause=cause)
            (self._completed if ok else self._failed).append(s.transfer_id)
            if not ok and s.direction is Direction.LOAD and not was_abandoned:
                self._invalid.update(b for group in s.gpu_block_ids for b in group)
            if was_abandoned:
                del self._entries[s.transfer_id]
            key = (s.request_id, s.direction)
            left = self._live[key] - 1
            if left:
                self._live[key] = left
            else:
                del self._live[key]
                self._finished[s.direction].add(s.request_id)

    def copy_stats(self) -> dict[Direction, CopyStats]:
        """Per direction: bytes copied, the copy time the backend measured, the time in flight."""
        sizes = [g.block_bytes for g in self.layout.groups] if self.layout is not None else []
        out: dict[Direction, CopyStats] = {}
        for direction, t in self.executor.throughput.items():
            moved = sum(n * size for n, size in zip(t.blocks, sizes, strict=False))
            out[direction] = CopyStats(moved, t.copy_s, t.busy_s, t.batches, t.measured_batches)
        return out

    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        """Per direction: (bytes copied, seconds the copies took): the backend's own measure of
        its copies where it times every batch (``CopyStats.seconds``), else seconds in flight."""
        return {d: (c.bytes, c.seconds) for d, c in self.copy_stats().items()}

    # -- results ------------------------------------------------------------------------------
    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``: requests whose last in-flight store / load
        finished (done or failed) since the previous call."""
        sending, recving = self._finished[Direction.STORE], self._finished[Direction.LOAD]
        self._finished = {Direction.STORE: set(), Direction.LOAD: set()}
        return sending, recving

    def build_report(self) -> StepReport:
        """Transfers finished since the last report (then RELEASED), GPU block ids of failed
        loads (the engine recomputes them), and when the loads' copies landed."""
        if not (self._completed or self._failed or self._invalid):
            return self._no_news
        report = StepReport(
            rank=self.rank,
            completed=tuple(self._completed),
            failed=tuple(self._failed),
            invalid_block_ids=frozenset(self._invalid),
            landed=tuple(self._landed.items()) if self._landed else (),
        )
        for tid in (*self._completed, *self._failed):
            e = self._entries.pop(tid, None)
            if e is not None:
                apply(e.transfer, TransferInput.RELEASE, cause="reported")
        self._completed, self._failed, self._invalid = [], [], set()
        if self._landed:
            self._landed = {}
        return report

    def transfer_state(self, transfer_id: int) -> TransferState | None:
        """The worker-side state of a transfer still tracked (None once released)."""
        e = self._entries.get(transfer_id)
        return None if e is None else e.transfer.state

    @property
    def tracked_transfers(self) -> frozenset[int]:
        """Transfer ids bound and not yet released by a report. Only the engine's calls change
        it (bind, report), never a copy finishing, so it is stable between two calls."""
        return frozenset(self._entries)

    @property
    def in_flight(self) -> int:
        """Transfers launched and not yet finished on the device."""
        return sum(self._live.values())

    async def flush(self) -> None:
        """Wait for every copy handed over so far, including those not yet submitted."""
        self._check_open()
        what = (
            f"rank {self.rank}: flush of every copy handed over "
            f"({self.executor.queued} copy orders queued, {self.executor.outstanding} batches "
            "on the device)"
        )
        await within(self.clock, self.timeouts.flush_s, what, self.executor.flush)

    async def handle_preemptions(self, plan: StepPlan) -> None:
        """Before the engine reuses preempted requests' GPU blocks: abandon what ``plan``
        abandons and, if it asks to flush, wait for every copy handed over."""
        self._check_open()
        self._abandon(plan.abandoned)
        if plan.flush:
            log.info("preemption_flush", rank=self.rank, step=plan.step, in_flight=self.in_flight)
            await self.flush()


__all__ = ["WorkerOptions", "WorkerRuntime"]
