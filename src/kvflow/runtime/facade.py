"""What the two synchronous facades over ``WorkerRuntime`` share: the calls that differ between
them only in how they reach the loop, the load-error mailbox, and the context-manager protocol.

``SyncWorkerRuntime`` (``portal``) runs the loop on a thread of its own; ``InlineWorkerRuntime``
(``inline``) steps it on the engine's thread. An engine holds either as a ``WorkerFacade``.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

from kvflow.core.layout import KVLayout
from kvflow.core.protocol import StepPlan, StepReport
from kvflow.core.transfer import Direction
from kvflow.runtime.gate import PlanGate
from kvflow.runtime.worker import WorkerRuntime

T = TypeVar("T")


class WorkerFacade(abc.ABC):
    """The worker side of vLLM's connector API over one ``WorkerRuntime``, for a synchronous
    engine. Subclasses say how an awaitable call reaches the loop (``_on_loop``)."""

    _rt: WorkerRuntime
    _load_errors: set[int]
    _gate: PlanGate  # the boundary checks on the engine's thread (kvflow.runtime.gate)

    @abc.abstractmethod
    def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the runtime's loop and wait for its result."""

    @abc.abstractmethod
    def shutdown(self, *, drain: bool = True) -> None:
        """Drain (or cancel) the runtime and close the backend. Idempotent."""

    @abc.abstractmethod
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Register the engine's named KV tensors with the backend; returns their layout."""

    @abc.abstractmethod
    def allocate_cpu_tier(self, num_blocks: int | Sequence[int]) -> None:
        """Allocate the CPU tier: ``num_blocks`` per group."""

    @abc.abstractmethod
    def bind_connector_metadata(self, plan: StepPlan) -> None:
        """Take this step's plan."""

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Launch the bound plan's loads (before the forward pass)."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Launch the bound plan's stores, fenced after the compute issued so far."""

    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the previous call."""

    @abc.abstractmethod
    def finish_step(self) -> tuple[set[str], set[str], StepReport]:
        """``get_finished()`` and ``build_report()`` together, at the end of a step."""

    @abc.abstractmethod
    def build_report(self) -> StepReport:
        """This rank's ``StepReport`` since the previous one."""

    @abc.abstractmethod
    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        """Per direction: (bytes copied, seconds copies of that direction were in flight)."""

    @abc.abstractmethod
    def wait_for_progress(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until some copy settles; returns whether one did."""

    @property
    def runtime(self) -> WorkerRuntime:
        """The async runtime underneath (touch it only as the subclass says)."""
        return self._rt

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU block ids of failed loads seen in reports since the last call."""
        out, self._load_errors = self._load_errors, set()
        return out

    def handle_preemptions(self, plan: StepPlan) -> None:
        """Abandon what ``plan`` abandons and, if it asks to flush, wait for every copy."""
        self._gate.require("handle_preemptions")  # boundary check
        self._on_loop(self._rt.handle_preemptions, plan)

    def flush(self) -> None:
        """Wait for every copy handed over so far."""
        self._on_loop(self._rt.flush)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(drain=exc is None)


__all__ = ["WorkerFacade"]
