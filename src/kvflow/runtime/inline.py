"""``InlineSyncWorker``: the worker runtime's event loop stepped on the engine's own thread.

``ThreadedSyncWorker`` gives the runtime a loop thread of its own. In an engine whose step loop
is bound by its Python thread, every wake-up of that thread (and of the backend's launch and
completion threads) takes the GIL from the engine: each costs the engine the other thread's
work plus two hand-offs, several times a step. Here the loop has no thread: the engine's calls
step it (``run_until_complete``) just long enough for what they started to be submitted, and
the reactor polls the backend's fences at each step instead of being woken by a completion
thread. The same tasks run (the reactor, the DMA executor actor), in the same order; only who
drives the loop changes. Most calls need no loop turn at all: a launch with nothing queued
ahead submits on the caller's thread, and a poll dispatches the fences it finds done. Nothing
of kvflow runs between the engine's calls, so a copy that finishes is seen at the engine's
next call, at the latest one step later (vLLM's own offload connectors poll their transfers
once a step the same way).

Use a backend that does not push completions from threads of its own
(``make_backend(..., inline=True)``): one that does still works (its callbacks queue on the
loop and run at the next call) but keeps the threads this driver exists to avoid.

Calls may come from different threads over time (an async frontend stepping the engine in a
worker thread), never from two at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio

from kvflow.backends.base import Backend, FenceStatus
from kvflow.core.layout import KVLayout
from kvflow.core.logs import get_logger
from kvflow.core.protocol import StepPlan, StepReport
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError
from kvflow.runtime.deadline import wait_or_timeout
from kvflow.runtime.executor import CopyStats
from kvflow.runtime.sync_worker import SyncWorker
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

log = get_logger("kvflow.inline")

T = TypeVar("T")

_MAX_SUBMIT_TURNS = 8
"""Loop iterations a call gives the executor to submit what it queued (it needs one)."""


class InlineSyncWorker(SyncWorker):
    """``WorkerRuntime`` stepped from the engine's thread. Use as a context manager or call
    ``shutdown()``. Same methods as ``ThreadedSyncWorker``."""

    def __init__(self, backend: Backend, options: WorkerOptions | None = None) -> None:
        super().__init__()
        self._backend = backend
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._drain = True
        self._stop: anyio.Event | None = None
        ready: asyncio.Future[WorkerRuntime] = self._loop.create_future()

        async def serve() -> None:
            try:
                async with WorkerRuntime.open(backend, options) as rt:
                    self._stop = anyio.Event()
                    ready.set_result(rt)
                    await self._stop.wait()
                    if not self._drain:
                        await rt.shutdown(drain=False)
            except Exception as exc:
                # A runtime that cannot start (bad options) raises here, not a wait forever.
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        self._main = self._loop.create_task(serve())
        try:
            self._rt: WorkerRuntime = self._drive(ready)
        except BaseException:
            self._main.cancel()
            self._drive(asyncio.gather(self._main, return_exceptions=True))
            self._close_loop()
            raise
        self._rt.progress_hooks.append(self._on_progress)
        self._rt.submit_at_launch = True
        self._settled = False
        self._progress: anyio.Event | None = None
        log.info("inline_worker_runtime_started", rank=self._rt.rank, backend=backend.name)

    # -- driving the loop -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("inline worker runtime is shut down")
        if self._main.done():
            # The runtime's task group ended on its own: a task of it failed.
            exc = None if self._main.cancelled() else self._main.exception()
            raise ClosedError(f"the worker runtime stopped: {exc!r}") from exc

    def _drive(self, awaitable: Awaitable[T]) -> T:
        """Run the loop until ``awaitable`` is done: on this thread, or, where this thread runs
        an event loop of its own (an engine built or shut down from async code), on a helper
        thread while this one waits."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(awaitable)
        if self._helper is None:
            self._helper = concurrent.futures.ThreadPoolExecutor(1, "kvflow-inline-helper")
        return self._helper.submit(self._loop.run_until_complete, awaitable).result()

    def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop until it returns."""
        self._check_open()

        async def call() -> T:
            return await fn(*args)

        return self._drive(call())

    async def _settle(self, done: list[tuple[Any, FenceStatus]] | None = None) -> None:
        """Dispatch the finished fences (``done``, or a poll now), then give the executor the
        turns it needs to submit its queue."""
        rt = self._rt
        if done is None:
            rt.reactor.poll_now()
        else:
            rt.reactor.process(done)
        for _ in range(_MAX_SUBMIT_TURNS):
            if not rt.executor.queued:
                break
            await anyio.lowlevel.checkpoint()

    def _step_loop(self) -> None:
        """Let the loop run what the last call queued and dispatch finished copies. A loop turn
        costs the engine's thread more than a poll or a submit: launches submit at once when
        nothing is queued (``WorkerRuntime.submit_at_launch``), and with copies in flight the
        fences are polled and the finished ones dispatched without a turn. Callers check that
        the runtime is open."""
        rt = self._rt
        if rt.executor.queued:
            self._on_loop(self._settle)
        elif rt.in_flight or rt.executor.outstanding:
            done = rt.reactor.poll()
            if done:
                # Dispatching is plain calls (the settling, the executor's accounting): with
                # nothing queued the loop need not turn for it. Tasks they wake (a flush's
                # waiter) run at the loop's next turn, which only calls that wait take.
                rt.reactor.process(done)

    def _on_progress(self) -> None:
        self._settled = True
        if self._progress is not None:
            self._progress.set()

    # -- the engine's calls ----------------------------------------------------------------------
    def _register(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None,
    ) -> KVLayout:
        return self._rt.register_kv_caches(kv_caches, num_blocks, groups)

    def _allocate(self, num_blocks: int | Sequence[int]) -> None:
        self._rt.allocate_cpu_tier(num_blocks)

    def _bind(self, plan: StepPlan) -> None:
        """``WorkerRuntime.bind(plan)``, at once (``PlanGate`` has checked it)."""
        self._rt.bind(plan, checked=True)

    def _start_loads(self) -> None:
        """Launch the loads (their copies are submitted before this returns)."""
        self._rt.start_load_kv()
        self._step_loop()

    def _start_stores(self) -> None:
        """Launch the stores, fenced on a compute fence recorded now."""
        self._rt.wait_for_save(self._backend.compute_fence())
        self._step_loop()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the previous call, after a poll."""
        self._check_open()
        self._step_loop()
        return self._rt.get_finished()

    def finish_step(self) -> tuple[set[str], set[str], StepReport]:
        """``get_finished()`` and ``build_report()`` together, after one poll of the fences."""
        sending, recving = self.get_finished()
        return sending, recving, self._take_report()

    def build_report(self) -> StepReport:
        """This rank's ``StepReport`` since the previous one, after a poll."""
        self._check_open()
        self._step_loop()
        return self._take_report()

    def _take_report(self) -> StepReport:
        report = self._rt.build_report()
        self._load_errors |= report.invalid_block_ids
        return report

    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        """Per direction: (bytes copied, seconds the copies took), from the executor's accounting."""
        self._check_open()
        return self._rt.copy_throughput()

    def copy_stats(self) -> dict[Direction, CopyStats]:
        """Per direction: bytes, measured copy time, time in flight (the executor's accounting)."""
        self._check_open()
        return self._rt.copy_stats()

    def _wait_progress(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds (real time: the reactor polls with back-off) until
        some copy settles; at once if none is in flight. Returns whether a copy settled."""
        self._step_loop()
        if not self._settled and self._rt.in_flight:
            self._on_loop(self._await_progress, timeout)
        settled, self._settled = self._settled, False
        return settled

    async def _await_progress(self, timeout: float) -> None:
        self._progress = anyio.Event()
        try:
            await wait_or_timeout(self._rt.clock, timeout, self._progress.wait)
        finally:
            self._progress = None

    def shutdown(self, *, drain: bool = True) -> None:
        """Drain (or cancel) the runtime, close the backend and the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain = drain
        try:
            if self._stop is not None and not self._main.done():
                self._stop.set()
            self._drive(self._main)
        finally:
            self._close_loop()
            log.info("inline_worker_runtime_stopped", rank=self._rt.rank)

    def _close_loop(self) -> None:
        self._drive(self._loop.shutdown_asyncgens())
        self._loop.close()
        if self._helper is not None:
            self._helper.shutdown()


__all__ = ["InlineSyncWorker"]
