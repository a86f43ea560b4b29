"""Scripted stand-ins for kvflow's manager and worker runtime, to test the vLLM adapter's wiring.

``ScriptedManager`` plays kvflow's scheduler role (``OffloadScheduler``) with hits and failures a
test sets; ``ScriptedRuntime`` plays its worker role (``OffloadWorker``), reporting each planned
transfer as done unless a test holds or fails it. ``worker_pass`` runs a worker-role connector through one step exactly in the order vLLM's
model runner does (``kv_connector_model_runner_mixin``). The connector classes here are loaded by
vLLM's own factory through ``kv_connector_module_path``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from attrs import define, field, frozen
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvflow.connector.api import KVCacheConfig
from kvflow.core.block_pool import PoolEvent
from kvflow.core.offload import GroupSpec, OffloadManager, OffloadManagerConfig
from kvflow.core.protocol import StepPlan, StepReport, TransferSpec
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.integrations.vllm import (
    KVFlowConnector,
    SchedulerRole,
    VLLMGpuCacheView,
    WorkerRole,
)
from kvflow.runtime.clock import FakeClock
from tests.integrations.vllm_harness import VLLMHarness

FAKES_MODULE = "tests.integrations.vllm_fakes"
PROMPT = [(i * 37) % 30000 + 10 for i in range(70)]  # 4 full blocks of 16 tokens + 6 tokens


@frozen
class Outcome:
    """The fields of the manager's ``StepOutcome`` the adapter reads."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()


_IDLE_MANAGER = OffloadManager(
    OffloadManagerConfig(groups=[GroupSpec(block_size=16, num_cpu_blocks=1)])
)


@define
class ScriptedManager:
    """An ``OffloadManager`` stand-in: offers the CPU hits in ``hits`` (tokens per request id),
    loads them into the blocks vLLM allocated, stores a finishing request's blocks when listed in
    ``store_on_finish``, and records every call."""

    block_size: int
    hits: dict[str, int] = field(factory=dict)
    store_on_finish: set[str] = field(factory=set)
    extra_invalid: set[int] = field(factory=set)  # ids only the manager knows are bad
    outputs: list[SchedulerOutput] = field(factory=list)
    finished: list[tuple[str, tuple[tuple[int, ...], ...] | None]] = field(factory=list)
    resets: int = 0
    _computed: dict[str, int] = field(factory=dict)
    _pending: list[TransferSpec] = field(factory=list)
    _live: dict[int, TransferSpec] = field(factory=dict)
    _ids: Any = field(factory=lambda: itertools.count(1))

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._computed[request.request_id] = num_computed_tokens
        extra = self.hits.get(request.request_id, 0) - num_computed_tokens
        return (extra, True) if extra > 0 else (0, False)

    def update_state_after_alloc(
        self, request: RequestLike, gpu_block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        self.hits.pop(request.request_id, None)
        first = self._computed[request.request_id] // self.block_size
        count = num_external_tokens // self.block_size
        # Every group loads the same token range (a sliding-window group's skipped blocks are
        # vLLM's null block 0 and are not loaded).
        gpu = tuple(
            tuple(b for b in group[first : first + count] if b != 0) for group in gpu_block_ids
        )
        cpu = tuple(tuple(range(len(g))) for g in gpu)
        self._pending.append(
            TransferSpec(next(self._ids), request.request_id, Direction.LOAD, gpu, cpu)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        self.outputs.append(scheduler_output)
        stores = tuple(t for t in self._pending if t.direction is Direction.STORE)
        loads = tuple(t for t in self._pending if t.direction is Direction.LOAD)
        self._live.update((t.transfer_id, t) for t in self._pending)
        self._pending = []
        return StepPlan(
            scheduler_output.step,
            stores=stores,
            loads=loads,
            flush=bool(scheduler_output.preempted_request_ids),
        )

    def update_from_reports(self, reports: Sequence[StepReport]) -> Outcome:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set(self.extra_invalid)
        self.extra_invalid = set()
        for report in reports:
            for tid in (*report.completed, *report.failed):
                spec = self._live.pop(tid)
                if spec.direction is Direction.LOAD:
                    recving.add(spec.request_id)
                    if tid in report.failed:
                        invalid.update(b for group in spec.gpu_block_ids for b in group)
                else:
                    sending.add(spec.request_id)
        return Outcome(frozenset(sending), frozenset(recving), frozenset(invalid))

    def request_finished(
        self, request: RequestLike, block_ids: Sequence[Sequence[int]] | None = None
    ) -> tuple[bool, dict[str, object] | None]:
        ids = None if block_ids is None else tuple(tuple(g) for g in block_ids)
        self.finished.append((request.request_id, ids))
        if request.request_id not in self.store_on_finish or not ids:
            return False, None
        self._pending.append(
            TransferSpec(
                next(self._ids),
                request.request_id,
                Direction.STORE,
                ids,
                tuple(tuple(range(len(g))) for g in ids),
            )
        )
        return True, None

    def reset_cache(self) -> bool:
        self.resets += 1
        return True

    def num_live_transfers(self, request_id: str | None = None) -> int:
        return len(self._pending) + len(self._live)

    def has_pending_push_work(self) -> bool:
        return self.num_live_transfers() > 0

    @property
    def manager(self) -> OffloadManager:
        """An idle manager: the scripted one counts nothing for the connector's stats."""
        return _IDLE_MANAGER

    def take_events(self) -> list[tuple[int, PoolEvent]]:
        return []

    def take_latencies(self) -> list[tuple[Direction, float]]:
        return []


@define
class ScriptedRuntime:
    """A worker role stand-in: every bound transfer completes at the next report, except held
    ones (still in flight) and failed ones (reported failed; a failed load's GPU blocks invalid)."""

    kv_cache_config: KVCacheConfig | None = None
    cpu_blocks: list[int] = field(factory=list)
    rank: int = 0
    hold: set[int] = field(factory=set)
    fail: set[int] = field(factory=set)
    hold_directions: set[Direction] = field(factory=set)
    fail_directions: set[Direction] = field(factory=set)
    plans: list[StepPlan] = field(factory=list)
    calls: list[str] = field(factory=list)
    registered: dict[str, Any] = field(factory=dict)
    _in_flight: dict[int, TransferSpec] = field(factory=dict)
    _errors: set[int] = field(factory=set)

    def register_kv_caches(self, kv_caches: Mapping[str, object]) -> None:
        kv = self.kv_cache_config
        assert kv is not None
        self.registered = {
            "caches": dict(kv_caches),
            "num_blocks": kv.num_blocks,
            "groups": dict(kv.tensor_groups),
        }

    def bind_connector_metadata(self, plan: object) -> None:
        assert isinstance(plan, StepPlan)
        self.plans.append(plan)
        self._in_flight.update((t.transfer_id, t) for t in (*plan.stores, *plan.loads))

    def start_load_kv(self) -> None:
        self.calls.append("start_load_kv")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        return {}

    def build_worker_report(self) -> StepReport:
        flight = self._in_flight
        done = [
            t
            for t in flight
            if t not in self.hold and flight[t].direction not in self.hold_directions
        ]
        failed = tuple(
            t for t in done if t in self.fail or flight[t].direction in self.fail_directions
        )
        completed = tuple(t for t in done if t not in failed)
        invalid = {
            b
            for t in failed
            if self._in_flight[t].direction is Direction.LOAD
            for group in self._in_flight[t].gpu_block_ids
            for b in group
        }
        for t in done:
            del self._in_flight[t]
        self._errors |= invalid
        return StepReport(self.rank, completed, failed, frozenset(invalid))

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def in_flight(self) -> list[TransferSpec]:
        """Transfers handed over and not reported yet."""
        return list(self._in_flight.values())

    def handle_preemptions(self, plan: object) -> None:
        self.calls.append("handle_preemptions")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class ScriptedConnector(KVFlowConnector):
    """``KVFlowConnector`` over the scripted manager and runtime."""

    def make_scheduler_role(self, gpu_view: VLLMGpuCacheView) -> SchedulerRole:
        return ScriptedManager(self.geometry.groups[0].block_size)

    def make_worker_role(self) -> WorkerRole:
        return ScriptedRuntime(self.kvflow_cache_config(), list(self.cpu_blocks))


class RealManagerConnector(KVFlowConnector):
    """``KVFlowConnector`` with kvflow's real scheduler role and the scripted worker role."""

    def make_worker_role(self) -> WorkerRole:
        return ScriptedRuntime(self.kvflow_cache_config(), list(self.cpu_blocks))


class ClockedConnector(RealManagerConnector):
    """``RealManagerConnector`` on the ``FakeClock`` a test sets in ``CLOCK`` first."""

    CLOCK: FakeClock | None = None

    @staticmethod
    def clock() -> FakeClock:
        assert ClockedConnector.CLOCK is not None, "set ClockedConnector.CLOCK first"
        return ClockedConnector.CLOCK


class ManagerRig:
    """vLLM's scheduler with kvflow's real scheduler role (or ``connector``'s) and a scripted
    worker twin."""

    def __init__(
        self,
        num_blocks: int = 64,
        policy: str = "eager",
        extra: dict[str, Any] | None = None,
        connector: str = "RealManagerConnector",
        **config: Any,
    ) -> None:
        self.h = VLLMHarness.build(
            num_blocks=num_blocks,
            connector=connector,
            module_path=FAKES_MODULE,
            extra_config={"cpu_bytes_to_use": 1 << 20, "store_policy": policy, **(extra or {})},
            **config,
        )
        assert isinstance(self.h.connector, KVFlowConnector)
        scheduler: Any = self.h.connector.scheduler_role  # kvflow's OffloadScheduler
        self.manager: Any = scheduler.manager
        self.worker = worker_connector(self.h.connector)
        runtime = self.worker.worker
        assert isinstance(runtime, ScriptedRuntime)
        self.runtime = runtime

    def serve_again(self, max_tokens: int = 2) -> tuple[Request, Any]:
        """Add PROMPT again and step until vLLM schedules it; the request and that step."""
        request = self.h.add(PROMPT, max_tokens=max_tokens)
        for _ in range(5):
            so, _ = self.step()
            if request.request_id in so.num_scheduled_tokens:
                break
        return request, so

    def step(self) -> tuple[Any, set[str]]:
        so = self.h.schedule()
        return so, self.h.finish(so, worker_pass(self.worker, so))

    def run(self, max_steps: int = 50) -> None:
        """Step until vLLM holds no request and every transfer settled."""
        for _ in range(max_steps):
            self.step()
            if not self.h.scheduler.requests and self.manager.num_live_transfers() == 0:
                return
        raise AssertionError("scheduler or transfers did not settle")

    def store_prompt_and_evict_gpu(self) -> None:
        """Serve PROMPT once, let its blocks reach the CPU tier, then empty vLLM's GPU cache."""
        self.h.add(PROMPT, max_tokens=1)
        self.run()
        # The lazy policy stores free blocks on the steps after they were freed (as the engine
        # keeps stepping for other requests); then let those stores settle.
        self.step()
        self.run()
        assert self.h.scheduler.kv_cache_manager.reset_prefix_cache()


def worker_connector(scheduler_connector: KVFlowConnector) -> KVFlowConnector:
    """The worker-role twin of a scheduler-role connector, as vLLM builds one in each worker."""
    cls = type(scheduler_connector)
    return cls(
        scheduler_connector._vllm_config,
        KVConnectorRole.WORKER,
        scheduler_connector._kv_cache_config,
    )


def worker_pass(worker: KVFlowConnector, scheduler_output: Any) -> KVConnectorOutput | None:
    """One step of a worker-role connector in the order vLLM's model runner calls it."""
    meta = scheduler_output.kv_connector_metadata
    if scheduler_output.preempted_req_ids:
        worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results(scheduler_output.finished_req_ids)
    output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    return None if output.is_empty() else output


__all__ = [
    "FAKES_MODULE",
    "PROMPT",
    "ManagerRig",
    "Outcome",
    "RealManagerConnector",
    "ScriptedConnector",
    "ScriptedManager",
    "ScriptedRuntime",
    "worker_connector",
    "worker_pass",
]
