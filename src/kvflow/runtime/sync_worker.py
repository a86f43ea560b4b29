"""``SyncWorker``: the worker runtime driven from a synchronous engine, the base of the two ways to
drive its loop.

``ThreadedSyncWorker`` (``threaded``) runs the loop on a thread of its own; ``InlineSyncWorker``
(``inline``) steps it on the engine's thread (``WorkerLoop`` names the choice). They share the
calls that differ only in how they reach the loop, the boundary checks of every engine call
(``PlanGate``: the order of the calls and each plan, on the engine's thread, before anything is
applied or posted), the load-error mailbox, and the context-manager protocol; an engine holds either as a ``SyncWorker``, made by
``kvflow.runtime.factory.make_sync_worker``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from kvflow.core import validate
from kvflow.core.layout import KVLayout, LayerParts
from kvflow.core.protocol import StepPlan, StepReport
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError
from kvflow.runtime.gate import PlanGate

if TYPE_CHECKING:
    # Only for annotations: the connector's configuration imports ``WorkerLoop`` from here, and
    # a vLLM scheduler process reading it must not load the event loop's modules.
    from kvflow.runtime.executor import CopyStats, FencedBatch
    from kvflow.runtime.worker import WorkerRuntime

T = TypeVar("T")


class WorkerLoop(enum.StrEnum):
    """Where the worker runtime's event loop runs."""

    THREAD = "thread"  # a thread of its own; the engine's calls are posted to it
    INLINE = "inline"  # the engine's thread, stepped by the connector's calls


class SyncWorker(abc.ABC):
    """The worker side of vLLM's connector API over one ``WorkerRuntime``, for a synchronous
    engine. Subclasses say how an awaitable call reaches the loop (``_on_loop``)."""

    _rt: WorkerRuntime

    def __init__(self) -> None:
        self._load_errors: set[int] = set()
        self._gate = PlanGate()  # the boundary checks on the engine's thread
        self._bound: StepPlan | None = None
        # This step's fenced loads landing in parts, which the engine's layers wait for one by
        # one (``wait_for_layer_load``): how loads are cut, per batch its parts' fences, and
        # how many leading parts the compute waits for already.
        self._layer_parts: LayerParts | None = None
        self._part_fences: list[FencedBatch] = []
        self._parts_waited = 0

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise ``ClosedError`` if the worker is shut down (or its runtime stopped)."""

    @abc.abstractmethod
    def _on_loop(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the runtime's loop and wait for its result."""

    @abc.abstractmethod
    def shutdown(self, *, drain: bool = True) -> None:
        """Drain (or cancel) the runtime and close the backend. Idempotent."""

    @abc.abstractmethod
    def _register(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None,
    ) -> KVLayout:
        """``WorkerRuntime.register_kv_caches``, on the loop's terms."""

    @abc.abstractmethod
    def _allocate(self, num_blocks: int | Sequence[int]) -> None:
        """``WorkerRuntime.allocate_cpu_tier``, on the loop's terms."""

    @abc.abstractmethod
    def _bind(self, plan: StepPlan) -> None:
        """``WorkerRuntime.bind(plan)``, at once or posted."""

    @abc.abstractmethod
    def _start_loads(self) -> None:
        """Launch the bound plan's loads."""

    @abc.abstractmethod
    def _start_stores(self) -> None:
        """Launch the bound plan's stores, fenced after the compute issued so far."""

    @abc.abstractmethod
    def _wait_progress(self, timeout: float) -> bool:
        """``wait_for_progress`` with a checked timeout."""

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
        """Per direction: (bytes copied, seconds the copies took: ``CopyStats.seconds``)."""

    @abc.abstractmethod
    def copy_stats(self) -> dict[Direction, CopyStats]:
        """Per direction: bytes, measured copy time and time in flight (``CopyStats``)."""

    # -- the engine's calls, checked here (kvflow.runtime.gate) then handed to the driver ---------
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Register the engine's named KV tensors with the backend; returns their layout."""
        self._check_open()
        layout = self._register(kv_caches, num_blocks, groups)
        self._gate.registered(layout)
        return layout

    def allocate_cpu_tier(self, num_blocks: int | Sequence[int]) -> None:
        """Allocate the CPU tier: ``num_blocks`` per group."""
        self._check_open()
        self._allocate(num_blocks)
        self._gate.allocated(num_blocks)

    def bind_connector_metadata(self, plan: StepPlan) -> None:
        """Take this step's plan, once ``PlanGate`` let it through: a bad or replayed one
        raises at once, binding nothing."""
        self._check_open()
        self._gate.check(plan)  # boundary check
        self._bind(plan)
        self._bound = plan
        self._gate.record(plan)

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        """Launch the bound plan's loads (before the forward pass); nothing if it has none.

        ``layerwise``: the engine calls ``wait_for_layer_load`` before each layer writes or
        reads its KV cache, so where fenced loads land in parts (``WorkerOptions.load_parts``)
        each layer's compute waits only for its own part; otherwise the whole forward waits
        for every fenced load here."""
        self._check_open()
        self._gate.require("start_load_kv")  # boundary check
        self._end_layer_waits()
        plan = self._bound
        if plan is None or plan.loads:
            self._start_loads()
            if plan is not None and plan.fenced_loads:
                self._fence_compute(plan, layerwise)

    def _fence_compute(self, plan: StepPlan, layerwise: bool) -> None:
        """The engine's compute (issued after this, on this thread) waits for the plan's
        fenced loads: on a GPU a wait on the device, the host going on at once; layer by
        layer (``wait_for_layer_load``) where they land in parts and the engine asks."""
        rt = self._rt
        fences = self._on_loop(rt.fenced_load_fences, plan.step)
        parts = rt.load_parts_of
        if layerwise and parts is not None and fences:
            self._layer_parts, self._part_fences, self._parts_waited = parts, fences, 0
            return
        self._compute_waits(fences, 0, None)

    def _compute_waits(self, batches: Sequence[FencedBatch], lo: int, hi: int | None) -> None:
        """The compute waits for parts ``lo:hi`` of each batch (every fence of a whole one)."""
        rt = self._rt
        wait, load_s = rt.backend.compute_wait, rt.timeouts.load_s
        # Every wait is made, a failed one included: the compute must be held behind each.
        failed = [b.fence for b in batches if not all([wait(f, load_s) for f in b.parts[lo:hi]])]  # noqa: C419
        if failed:
            # Settled now, so that this step's report names the failed loads and the engine
            # drops what its forward computes from their blocks.
            self._on_loop(rt.settle_failed, failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer ``layer_name`` writes or reads its KV cache: the compute issued after
        this waits for the part of this step's fenced loads holding that layer (and the parts
        before it). Nothing to wait for without parts in flight (``start_load_kv(layerwise=
        True)``); an unknown layer name is a ``ConfigError``."""
        parts = self._layer_parts
        if parts is None:
            return
        part = parts.part_of.get(layer_name)
        if part is None:
            raise ConfigError(
                f"wait_for_layer_load: {layer_name!r} is not a registered KV cache tensor"
            )
        if part < self._parts_waited:
            return
        self._compute_waits(self._part_fences, self._parts_waited, part + 1)
        self._parts_waited = part + 1

    def _end_layer_waits(self) -> None:
        """Close the step's layer waits: parts the engine never waited for are waited for now
        (so that what comes after is ordered) and reported as a ``ProtocolError``: the layers
        in them ran without their KV."""
        parts = self._layer_parts
        if parts is None:
            return
        self._layer_parts = None
        left = parts.count - self._parts_waited
        if left <= 0:
            return
        self._compute_waits(self._part_fences, self._parts_waited, None)
        missed = sorted(t for t, k in parts.part_of.items() if k >= self._parts_waited)
        raise ProtocolError(
            f"start_load_kv(layerwise=True), but wait_for_layer_load never came for the layers "
            f"of {left} of {parts.count} load parts: {', '.join(missed)}"
        )

    def wait_for_save(self) -> None:
        """Launch the bound plan's stores, fenced after the compute issued so far; nothing if it
        has none."""
        self._check_open()
        self._gate.require("wait_for_save")  # boundary check
        self._end_layer_waits()
        plan = self._bound
        if plan is None or plan.stores:
            self._start_stores()

    def wait_for_progress(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until some copy settles; returns whether one did."""
        self._check_open()
        timeout = validate.timeout_s("wait_for_progress timeout", timeout)  # boundary check
        return self._wait_progress(timeout)

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


__all__ = ["SyncWorker", "WorkerLoop"]
