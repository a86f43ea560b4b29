"""``ThreadedSyncWorker``: the worker runtime's loop on a thread of its own, driven from a
synchronous engine.

The runtime lives on an event loop in a thread of its own (anyio's blocking portal). Method names
follow the worker side of vLLM's ``KVConnectorBase_V1`` (``register_kv_caches``,
``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, ``handle_preemptions``, ``shutdown``), so a connector maps
onto it one to one.

The three calls an engine makes on its hot path every step (``bind_connector_metadata``,
``start_load_kv``, ``wait_for_save``) are *posted*: queued for the loop in order without waiting
for it, because a blocking round trip to another thread costs more than the calls themselves
(docs/benchmarks.md, the synchronous facade's figures). The
loop is woken only when a posted call has copies to start (the bound plan's loads, its stores);
otherwise the calls ride along with the next wake-up or blocking call, still in order (and at
the latest every ``_MAX_PENDING`` calls). Each wake-up hands the GIL to the loop's thread while
the engine's thread waits to get it back, so a step wakes the loop at most twice. What settles
is collected on the loop as it happens (a progress hook), so ``finish_step``, the engine's
end-of-step question, needs no round trip at all. An error one of the posted calls raises on the
loop is raised again, unchanged, by the next facade call. Every other call blocks until the loop
has run it. ``wait_for_save`` records the compute fence on the caller's thread, so a GPU backend
fences after the engine's own stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvflow.backends.base import Backend
from kvflow.core.layout import KVLayout
from kvflow.core.logs import get_logger
from kvflow.core.protocol import StepPlan, StepReport, merge_reports
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError
from kvflow.runtime.executor import CopyStats
from kvflow.runtime.sync_worker import SyncWorker
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

log = get_logger("kvflow.portal")

T = TypeVar("T")

_MAX_PENDING = 16
"""Posted calls that wait for a wake-up at most (steps without copies post only a bind)."""


def _call_name(fn: Callable[..., object]) -> str:
    """A posted call's name for a log line: its ``repr`` where it has none (a log line must
    not fail on the loop)."""
    return getattr(fn, "__name__", None) or repr(fn)


class ThreadedSyncWorker(SyncWorker):
    """``WorkerRuntime`` on a loop thread, driven from a synchronous thread. Use as a context
    manager or call ``shutdown()``."""

    def __init__(self, backend: Backend, options: WorkerOptions | None = None) -> None:
        super().__init__()
        self._backend = backend
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._rt_cm = self._portal.wrap_async_context_manager(
                WorkerRuntime.open(backend, options)
            )
            self._rt: WorkerRuntime = self._rt_cm.__enter__()
            self._loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False
        self._progress = threading.Event()
        # Finished work is collected on the loop as it settles, so the engine's thread reads it
        # at the end of a step without a round trip (and without waiting for the loop to submit
        # that step's stores).
        self._mail_lock = threading.Lock()
        self._mail_finished: dict[Direction, set[str]] = {d: set() for d in Direction}
        self._mail_reports: list[StepReport] = []
        self._rt.progress_hooks.append(self._collect)
        self._posted_error: BaseException | None = None
        self._pending: list[tuple[Callable[..., object], tuple[Any, ...]]] = []

    # -- plumbing ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("threaded sync worker is shut down")

    def _collect(self) -> None:
        """On the loop, whenever copies settle: move what finished into the mailbox."""
        sending, recving = self._rt.get_finished()
        report = self._rt.build_report()
        with self._mail_lock:
            self._mail_finished[Direction.STORE] |= sending
            self._mail_finished[Direction.LOAD] |= recving
            if report.completed or report.failed or report.invalid_block_ids:
                self._mail_reports.append(report)
        self._progress.set()

    def _take_finished(self) -> tuple[set[str], set[str]]:
        with self._mail_lock:
            mail, self._mail_finished = self._mail_finished, {d: set() for d in Direction}
        return mail[Direction.STORE], mail[Direction.LOAD]

    def _take_report(self) -> StepReport:
        with self._mail_lock:
            reports, self._mail_reports = self._mail_reports, []
        report = merge_reports(self._rt.rank, reports)
        self._load_errors |= report.invalid_block_ids
        return report

    def _sync(self) -> None:
        """A round trip: every posted call, and every copy the loop has seen settle, is done."""
        self._call(lambda: None)

    def _raise_posted(self) -> None:
        """Raise (once) the error of an earlier posted call: on the loop before a blocking call,
        or on the engine's thread in ``finish_step``."""
        err, self._posted_error = self._posted_error, None
        if err is not None:
            raise err

    def _guard(self, fn: Callable[..., T], *args: Any) -> T:
        self._raise_posted()
        return fn(*args)

    async def _aguard(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        self._raise_posted()
        return await fn(*args)

    def _take_pending(self) -> list[tuple[Callable[..., object], tuple[Any, ...]]]:
        batch, self._pending = self._pending, []
        return batch

    def _run_posted(self, batch: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
        """On the loop: run posted calls in order. After one failed, later ones are skipped
        until its error has been raised."""
        for fn, args in batch:
            if self._posted_error is not None:
                log.warning("posted_call_skipped", call=_call_name(fn))
                continue
            try:
                fn(*args)
            except Exception as exc:
                log.warning("posted_call_failed", call=_call_name(fn), error=str(exc))
                self._posted_error = exc

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run synchronous ``fn`` on the loop, after every posted call, and wait for its result.
        A bare callback and a thread-safe future: far cheaper than ``portal.call``, which spawns
        a task."""
        self._check_open()
        batch = self._take_pending()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            self._run_posted(batch)
            try:
                future.set_result(self._guard(fn, *args))
            except BaseException as exc:
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result()

    def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run async ``fn`` as a plain asyncio task on the loop, after every posted call, and
        wait for its result."""
        self._check_open()
        batch = self._take_pending()

        async def run() -> T:
            self._run_posted(batch)
            return await self._aguard(fn, *args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def _post(self, fn: Callable[..., object], *args: Any, wake: bool = True) -> None:
        """Queue ``fn(*args)`` for the loop, in order with every other call; don't wait. With
        ``wake`` the loop runs everything queued soon; without, it runs at the next wake-up."""
        self._check_open()
        self._pending.append((fn, args))
        if wake:
            self._wake()

    def _wake(self) -> None:
        batch = self._take_pending()
        if batch:
            self._loop.call_soon_threadsafe(self._run_posted, batch)

    @property
    def portal(self) -> BlockingPortal:
        return self._portal

    # -- the engine's calls ----------------------------------------------------------------------
    def _register(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None,
    ) -> KVLayout:
        return self._call(self._rt.register_kv_caches, kv_caches, num_blocks, groups)

    def _allocate(self, num_blocks: int | Sequence[int]) -> None:
        self._call(self._rt.allocate_cpu_tier, num_blocks)

    def _bind(self, plan: StepPlan) -> None:
        """Posted: ``WorkerRuntime.bind(plan)`` (``PlanGate`` has checked it); runs with the
        step's first wake-up."""
        self._post(self._bind_gated, plan, wake=False)

    def _bind_gated(self, plan: StepPlan) -> None:
        """On the loop: ``WorkerRuntime.bind`` of a plan ``PlanGate`` let through."""
        self._rt.bind(plan, checked=True)

    def _start_loads(self) -> None:
        """Posted, waking the loop so the loads start before the engine's forward rather than
        after it."""
        self._post(self._rt.start_load_kv)

    def _start_stores(self) -> None:
        """Posted: launch the stores, fenced on a compute fence recorded here (so a GPU backend
        fences after the engine's own stream), waking the loop."""
        self._post(self._rt.wait_for_save, self._backend.compute_fence())

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the previous call, after a round trip
        (so every call posted before has run)."""
        self._sync()
        return self._take_finished()

    def finish_step(self) -> tuple[set[str], set[str], StepReport]:
        """``get_finished()`` and ``build_report()`` together, the pair an engine asks for at the
        end of every step, without a round trip: what the loop has seen settle so far. A copy
        that settles later is in the next step's answer. Raises the error of a posted call the
        loop has run."""
        self._check_open()
        self._raise_posted()
        if len(self._pending) >= _MAX_PENDING:
            self._wake()  # steps without copies: run their queued calls now and then
        sending, recving = self._take_finished()
        return sending, recving, self._take_report()

    def build_report(self) -> StepReport:
        """This rank's ``StepReport`` since the previous one, after a round trip; its invalid
        block ids also feed ``get_block_ids_with_load_errors``."""
        self._sync()
        return self._take_report()

    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        """Per direction: (bytes copied, seconds the copies took), from the executor's accounting."""
        return self._call(self._rt.copy_throughput)

    def copy_stats(self) -> dict[Direction, CopyStats]:
        """Per direction: bytes, measured copy time, time in flight (the executor's accounting)."""
        return self._call(self._rt.copy_stats)

    def _wait_progress(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until some copy settles; at once if none is in flight.

        For an engine with nothing to compute but requests waiting on transfers: blocking here
        releases the GIL to the copy threads instead of spinning empty steps against them.
        Returns whether a copy settled. (A real-time wait on the device, not a clock sleep.)
        """
        if self._pending:
            self._sync()  # the queued calls may launch the very copies the engine waits for
        if self._rt.in_flight == 0 and not self._progress.is_set():
            return False
        settled = self._progress.wait(timeout)
        self._progress.clear()
        return settled

    def shutdown(self, *, drain: bool = True) -> None:
        """Drain (or cancel) the runtime, close the backend, stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._wake()
            try:
                # Bounded: a drain past ``Timeouts.drain_s`` raises DeadlineError, the runtime
                # closed (what it still had in flight abandoned).
                self._portal.call(lambda: self._rt.shutdown(drain=drain))
            finally:
                self._rt_cm.__exit__(None, None, None)
        finally:
            self._closed = True
            self._portal_cm.__exit__(None, None, None)


__all__ = ["ThreadedSyncWorker"]
