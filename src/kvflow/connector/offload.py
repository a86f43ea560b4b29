"""kvflow's offload connector: the CPU tier behind the engine-facing connector interface.

``OffloadScheduler`` is the scheduler role: a thin shell around ``kvflow.core.offload``'s
``OffloadManager`` that turns its step plans into connector metadata and the workers' reports into
the finished/invalid sets an engine acts on. ``OffloadWorker`` is the worker role: the
synchronous driver of ``kvflow.runtime``'s worker runtime over a backend. ``OffloadConnector`` builds the pair for
one engine. Both keep stats; the scheduler also times every transfer from launch to commit.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from attrs import define, field, frozen

from kvflow.backends.base import Backend
from kvflow.backends.select import make_backend
from kvflow.connector.api import NULL_BLOCK_ID, KVCacheConfig, KVConnectorOutput
from kvflow.connector.config import OffloadConfig, WorkerLoop
from kvflow.core import validate
from kvflow.core.block_pool import PoolEvent
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.logs import get_logger
from kvflow.core.offload import (
    NO_OUTCOME,
    GroupSpec,
    NewBlockIds,
    OffloadManager,
    OffloadStats,
    ResetStatus,
    StepOutcome,
)
from kvflow.core.protocol import GroupBlockIds, StepPlan, StepReport, latest_landed
from kvflow.core.requests import RequestLike, SchedulerOutput
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError
from kvflow.runtime.executor import CopyStats
from kvflow.runtime.factory import make_sync_worker
from kvflow.runtime.sync_worker import SyncWorker

log = get_logger("kvflow.connector")

_NOTHING = KVConnectorOutput()
"""What ``update_connector_output`` returns when nothing settled (frozen: one serves all)."""

LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
"""Upper bounds of the transfer latency histogram buckets (the last bucket is open)."""


@define(eq=False)
class LatencyHistogram:
    """Counts of launch → commit latencies per bucket, plus their sum (Prometheus-style)."""

    counts: list[int] = field(factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def quantile(self, q: float) -> float:
        """The bucket bound below which a fraction ``q`` of observations fall (nan if empty)."""
        n = self.count
        if n == 0:
            return float("nan")
        rank, acc = q * n, 0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= rank and c:
                return LATENCY_BUCKETS_S[i] if i < len(LATENCY_BUCKETS_S) else float("inf")
        return float("inf")


@frozen
class ConnectorStats:
    """The connector's counters: the manager's, plus per-direction launch → commit latency.
    Copy throughput is the worker's: ``OffloadWorker.copy_stats`` (``CopyStats.gbps``: bytes over
    the copy time the backend measured), ``copy_throughput`` and ``copy_gbps``."""

    manager: OffloadStats
    store_latency: tuple[tuple[int, ...], float]  # (bucket counts, sum of seconds)
    load_latency: tuple[tuple[int, ...], float]


def copy_gbps(copies: Mapping[Direction, tuple[int, float]], direction: Direction) -> float:
    """GB/s of one direction from ``copy_throughput()``'s (bytes, seconds); 0 if idle."""
    moved, busy = copies.get(direction, (0, 0.0))
    return moved / busy / 1e9 if busy > 0 else 0.0


def group_specs(
    kv: KVCacheConfig, block_bytes: Sequence[int], cpu_blocks: Sequence[int]
) -> tuple[GroupSpec, ...]:
    if len(block_bytes) != len(kv.groups):
        raise ConfigError(
            f"{len(block_bytes)} block sizes in bytes given for {len(kv.groups)} KV cache groups"
        )
    return tuple(
        GroupSpec(
            block_size=kv.group_block_size(g.group_id),
            num_cpu_blocks=n,
            sliding_window=g.sliding_window,
            block_bytes=b,
        )
        for g, b, n in zip(kv.groups, block_bytes, cpu_blocks, strict=True)
    )


class OffloadScheduler:
    """The scheduler role. ``gpu_view`` (the engine's GPU pool) lets transfers hold GPU references
    where the engine could otherwise reuse a block under a copy; the lazy policy needs it."""

    def __init__(
        self,
        config: OffloadConfig,
        kv_cache_config: KVCacheConfig,
        block_bytes: Sequence[int],
        *,
        gpu_view: GpuCacheView | None = None,
        now: Callable[[], float] | None = None,
        null_block_id: int | None = NULL_BLOCK_ID,
        enable_events: bool = False,
        record_latencies: bool = False,
    ) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.cpu_blocks = config.cpu_blocks_per_group(block_bytes)
        self.manager = OffloadManager(
            config.manager_config(
                group_specs(kv_cache_config, block_bytes, self.cpu_blocks),
                null_block_id=null_block_id,
                enable_events=enable_events,
                num_gpu_blocks=kv_cache_config.num_blocks,
            ),
            gpu_view=gpu_view,
        )
        self._now = now
        self._launched: dict[int, tuple[Direction, float]] = {}
        self._latency = {Direction.STORE: LatencyHistogram(), Direction.LOAD: LatencyHistogram()}
        # Each latency as observed, for an engine's own histograms (``take_latencies``).
        self._recent: list[tuple[Direction, float]] | None = [] if record_latencies else None

    # ---- the engine's calls ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.manager.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: RequestLike, block_ids: GroupBlockIds, num_external_tokens: int
    ) -> None:
        self.manager.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        return self._stamped(self.manager.build_step_plan(scheduler_output))

    def decode_step(
        self,
        step: int,
        request_ids: Sequence[str],
        num_computed_tokens: Sequence[int],
        new_block_ids: Sequence[NewBlockIds],
    ) -> StepPlan:
        """``build_connector_meta`` of a step of running requests only, one token each, in
        columns (``OffloadManager.decode_step``)."""
        return self._stamped(
            self.manager.decode_step(step, request_ids, num_computed_tokens, new_block_ids)
        )

    def quiet_step(self, step: int) -> StepPlan | None:
        """``build_connector_meta`` of a step with no news for the CPU tier, by its number
        (``OffloadManager.quiet_step``: steady decode under the lazy policy over a keyed GPU
        view); None where the workers have nothing to do."""
        plan = self.manager.quiet_step(step)
        return plan if plan is None else self._stamped(plan)

    def _stamped(self, plan: StepPlan) -> StepPlan:
        """The plan, its transfers' launch times noted (for their latency at commit)."""
        if self._now is not None and (plan.stores or plan.loads):
            t = self._now()
            for spec in (*plan.stores, *plan.loads):
                self._launched[spec.transfer_id] = (spec.direction, t)
        return plan

    def update_from_reports(self, reports: Sequence[StepReport]) -> StepOutcome:
        """Apply the workers' reports (timing every transfer that settled); the manager's
        outcome, for an adapter that builds its engine's output itself."""
        outcome = self.manager.update_from_reports(reports)
        if self._now is not None and (outcome.committed or outcome.failed):
            t = self._now()
            for tid in outcome.committed:
                launched = self._launched.pop(tid, None)
                if launched is not None:
                    self._latency[launched[0]].observe(t - launched[1])
                    if self._recent is not None:
                        self._recent.append((launched[0], t - launched[1]))
            for tid in outcome.failed:
                self._launched.pop(tid, None)
        return outcome

    def update_connector_output(self, output: KVConnectorOutput) -> KVConnectorOutput:
        """Apply the workers' reports; return what the engine must act on (all ranks agreed)."""
        outcome = self.update_from_reports(output.reports)
        if outcome is NO_OUTCOME:
            return _NOTHING  # most steps: nothing settled, nothing for the engine
        recving = outcome.finished_recving
        return KVConnectorOutput(
            finished_sending=outcome.finished_sending,
            finished_recving=recving,
            invalid_block_ids=outcome.invalid_block_ids,
            loads_landed=latest_landed(output.reports, recving) if recving else {},
        )

    def request_finished(
        self, request: RequestLike, block_ids: GroupBlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.manager.request_finished(request, block_ids)

    def reset_cache(self) -> bool:
        return self.manager.reset_cache() is ResetStatus.COMPLETE

    def has_pending_push_work(self) -> bool:
        return self.manager.num_live_transfers() > 0

    def take_events(self) -> list[tuple[int, PoolEvent]]:
        """The CPU tier's cache events since the last call, as (group, event); none unless
        built with ``enable_events``."""
        return self.manager.take_events()

    def take_latencies(self) -> list[tuple[Direction, float]]:
        """Launch → commit latencies observed since the last call (``record_latencies``)."""
        recent = self._recent
        if not recent:
            return []
        self._recent = []
        return recent

    def stats(self) -> ConnectorStats:
        st, ld = self._latency[Direction.STORE], self._latency[Direction.LOAD]
        return ConnectorStats(
            manager=self.manager.stats(),
            store_latency=(tuple(st.counts), st.total_s),
            load_latency=(tuple(ld.counts), ld.total_s),
        )


class OffloadWorker:
    """The worker role of one rank: registers the KV tensors and runs each step's plan.

    ``block_bytes`` (per group, what the CPU tier was sized with) lets registration refuse KV
    tensors whose blocks are larger: the tier would exceed ``cpu_bytes``."""

    def __init__(
        self,
        config: OffloadConfig,
        kv_cache_config: KVCacheConfig,
        cpu_blocks: Sequence[int],
        *,
        backend: Backend | None = None,
        rank: int = 0,
        block_bytes: Sequence[int] | None = None,
    ) -> None:
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.cpu_blocks = tuple(cpu_blocks)
        self.block_bytes = None if block_bytes is None else tuple(block_bytes)
        self.rank = rank
        inline = config.worker_loop is WorkerLoop.INLINE
        self.backend = backend or make_backend(
            config.backend.value, kv_cache_config.device, inline=inline
        )
        self.runtime: SyncWorker = make_sync_worker(
            self.backend, config.worker_options(rank), loop=config.worker_loop
        )
        self._report: StepReport | None = None  # fetched with get_finished, for this step

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        kv = self.kv_cache_config
        layout = self.runtime.register_kv_caches(dict(kv_caches), kv.num_blocks, kv.tensor_groups)
        # Boundary check before the tier is allocated: its bytes follow the tensors' blocks.
        registered = [g.block_bytes for g in layout.groups]
        validate.tier_budget(
            self.block_bytes if self.block_bytes is not None else registered,
            registered,
            self.cpu_blocks,
            self.config.cpu_bytes,
        )
        self.runtime.allocate_cpu_tier(self.cpu_blocks)

    def _as_plan(self, meta: object) -> StepPlan:
        if not isinstance(meta, StepPlan):
            raise ConfigError(f"kvflow worker expects a StepPlan, got {type(meta).__name__}")
        return meta

    def bind_connector_metadata(self, meta: object) -> None:
        self.runtime.bind_connector_metadata(self._as_plan(meta))

    def handle_preemptions(self, meta: object) -> None:
        plan = self._as_plan(meta)
        if plan.flush:
            self.runtime.handle_preemptions(plan)

    def start_load_kv(self, *, layerwise: bool = False) -> None:
        self.runtime.start_load_kv(layerwise=layerwise)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.runtime.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        self.runtime.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Which requests may go on is decided by the scheduler once every rank reported; the
        # per-rank sets are only informative.
        sending, recving, self._report = self.runtime.finish_step()
        return sending or None, recving or None

    def copy_throughput(self) -> dict[Direction, tuple[int, float]]:
        """Per direction: (bytes copied, seconds the copies took) on this rank: the backend's
        own timing of its copies (CUDA events, the host backend's copy thread) where it times
        every batch, else seconds from submit until the fence was seen done."""
        return self.runtime.copy_throughput()

    def copy_stats(self) -> dict[Direction, CopyStats]:
        """Per direction on this rank: bytes, ``copy_s`` (measured by the backend),
        ``in_flight_s`` (submit → seen done), batches, ``measured_batches``; ``gbps``."""
        return self.runtime.copy_stats()

    def wait_cpu_tier(self, timeout_s: float = 600.0) -> None:
        """Block until the whole CPU tier can take copies, at most ``timeout_s`` seconds (then
        ``DeadlineError``). The CUDA backend pins the tier in the background and, until it is
        done, pins a chunk inside the first copy that needs it, on the thread that launches
        every copy: a benchmark waits here to time the steady state."""
        timeout_s = validate.timeout_s("wait_cpu_tier timeout_s", timeout_s)
        # Imported here: the CUDA bindings load only where a CUDA backend was asked for.
        from kvflow.backends.cuda import CudaBackend

        if isinstance(self.backend, CudaBackend):
            self.backend.cpu_tier.wait_registered(timeout_s)

    def wait_for_progress(self, timeout: float) -> None:
        self.runtime.wait_for_progress(timeout)

    def build_worker_report(self) -> StepReport:
        report, self._report = self._report, None
        return report if report is not None else self.runtime.build_report()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.runtime.get_block_ids_with_load_errors()

    def clear_connector_metadata(self) -> None:
        # The runtime keeps the bound plan until the next bind; nothing to drop here.
        return None

    def shutdown(self) -> None:
        self.runtime.shutdown()


@define(eq=False)
class OffloadConnector:
    """Both roles of kvflow's connector for one engine process (scheduler and rank-0 worker)."""

    scheduler: OffloadScheduler
    worker: OffloadWorker

    @classmethod
    def build(
        cls,
        config: OffloadConfig,
        kv_cache_config: KVCacheConfig,
        block_bytes: Sequence[int],
        *,
        gpu_view: GpuCacheView | None = None,
        backend: Backend | None = None,
        now: Callable[[], float] | None = None,
    ) -> OffloadConnector:
        scheduler = OffloadScheduler(
            config, kv_cache_config, block_bytes, gpu_view=gpu_view, now=now
        )
        worker = OffloadWorker(
            config, kv_cache_config, scheduler.cpu_blocks, backend=backend, block_bytes=block_bytes
        )
        log.info(
            "offload_connector_built",
            cpu_blocks=scheduler.cpu_blocks,
            store_policy=config.store_policy.value,
            backend=worker.backend.name,
        )
        return cls(scheduler, worker)


__all__ = [
    "LATENCY_BUCKETS_S",
    "ConnectorStats",
    "LatencyHistogram",
    "OffloadConnector",
    "OffloadScheduler",
    "OffloadWorker",
    "copy_gbps",
]
