"""A synchronous facade over ``WorkerRuntime`` for engines with a synchronous step loop.

The runtime lives on an event loop in a thread of its own (anyio's blocking portal); each call
here runs the matching runtime method on that loop and returns its result. Method names follow
the worker side of vLLM's ``KVConnectorBase_V1`` (``register_kv_caches``,
``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``, ``get_finished``,
``get_block_ids_with_load_errors``, ``handle_preemptions``, ``shutdown``), so a connector maps
onto it one to one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, TypeVar

import structlog
from anyio.from_thread import BlockingPortal, start_blocking_portal

from kvflow.backends.base import Backend
from kvflow.core.layout import KVLayout
from kvflow.core.protocol import StepPlan, StepReport
from kvflow.errors import ClosedError
from kvflow.runtime.clock import Clock
from kvflow.runtime.worker import WorkerRuntime

log = structlog.get_logger("kvflow.portal")

T = TypeVar("T")


class SyncWorkerRuntime:
    """``WorkerRuntime`` driven from a synchronous thread. Use as a context manager or call
    ``shutdown()``; every method blocks until the runtime's loop has run it."""

    def __init__(
        self,
        backend: Backend,
        *,
        rank: int = 0,
        clock: Clock | None = None,
        coalesce: bool = True,
        min_backoff: float = 20e-6,
        max_backoff: float = 1e-3,
    ) -> None:
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._rt_cm = self._portal.wrap_async_context_manager(
                WorkerRuntime.open(
                    backend,
                    rank=rank,
                    clock=clock,
                    coalesce=coalesce,
                    min_backoff=min_backoff,
                    max_backoff=max_backoff,
                )
            )
            self._rt: WorkerRuntime = self._rt_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        self._closed = False
        self._load_errors: set[int] = set()

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise ClosedError("sync worker runtime is shut down")
        return self._portal.call(fn, *args)

    def _acall(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._closed:
            raise ClosedError("sync worker runtime is shut down")
        return self._portal.call(fn, *args)

    @property
    def runtime(self) -> WorkerRuntime:
        """The async runtime underneath (touch it only through ``portal`` calls)."""
        return self._rt

    @property
    def portal(self) -> BlockingPortal:
        return self._portal

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        return self._call(self._rt.register_kv_caches, kv_caches, num_blocks, groups)

    def allocate_cpu_tier(self, num_blocks: int | Sequence[int]) -> None:
        self._call(self._rt.allocate_cpu_tier, num_blocks)

    def bind_connector_metadata(self, plan: StepPlan) -> None:
        self._call(self._rt.bind, plan)

    def start_load_kv(self) -> None:
        self._call(self._rt.start_load_kv)

    def wait_for_save(self) -> None:
        self._call(self._rt.wait_for_save)

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self._call(self._rt.get_finished)

    def build_report(self) -> StepReport:
        """This rank's ``StepReport``; its invalid block ids also feed
        ``get_block_ids_with_load_errors``."""
        report = self._call(self._rt.build_report)
        self._load_errors |= report.invalid_block_ids
        return report

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids of failed loads seen in reports since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def handle_preemptions(self, plan: StepPlan) -> None:
        self._acall(self._rt.handle_preemptions, plan)

    def flush(self) -> None:
        self._acall(self._rt.flush)

    def shutdown(self, *, drain: bool = True) -> None:
        """Drain (or cancel) the runtime, close the backend, stop the loop thread. Idempotent."""
        if self._closed:
            return
        try:
            self._portal.call(lambda: self._rt.shutdown(drain=drain))
            self._rt_cm.__exit__(None, None, None)
        finally:
            self._closed = True
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncWorkerRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(drain=exc is None)


__all__ = ["SyncWorkerRuntime"]
