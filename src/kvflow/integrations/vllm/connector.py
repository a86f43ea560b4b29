"""``KVFlowConnector``: vLLM's KV connector API over kvflow's connector (``kvflow.connector``).

The scheduler-role instance holds kvflow's ``OffloadScheduler`` (built once vLLM binds its GPU
block pool), the worker-role instance an ``OffloadWorker``; both are built from one
``OffloadConfig`` (``config.offload_config``), so every option is parsed and validated there.
This class only translates: requests and scheduler outputs (``requests``), block ids of the groups
kvflow offloads, the plan and reports through vLLM's metadata (``relay``), events and stats
(``telemetry``). With ``kv_role`` ``kv_producer`` / ``kv_consumer`` the scheduler role is a P or D
instance's (``pd``: PD beside the CPU tier in one connector object) and the worker role also runs
the PD data plane (``pd_worker``). With ``kv_both`` (one rank) the instance is P or D per request
as the request's ``kv_transfer_params`` say, as vLLM's NixlConnector is; its PD half is built at
the first request that carries PD params, so an instance that sees none runs the CPU tier only.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvflow.connector.api import KVCacheConfig
from kvflow.connector.config import OffloadConfig
from kvflow.core.logs import follow_host_logging, get_logger
from kvflow.core.protocol import GroupBlockIds, StepReport
from kvflow.core.requests import RequestLike
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.config import (
    KVGeometry,
    check_pd_transport,
    kv_cache_geometry,
    offload_config,
    stats_interval,
)
from kvflow.integrations.vllm.gpu_view import VLLMGpuCacheView, VLLMKeyedGpuCacheView
from kvflow.integrations.vllm.pd import PD_ROLES, PDRequestViews, PDSchedulerRole, vllm_compat
from kvflow.integrations.vllm.pd_relay import (
    KVFlowHandshake,
    KVFlowPDConnectorMetadata,
    KVFlowPDWorkerMetadata,
)
from kvflow.integrations.vllm.relay import (
    KVFlowConnectorMetadata,
    KVFlowWorkerMetadata,
    OutcomeLike,
    OutcomeRelay,
    report_has_news,
)
from kvflow.integrations.vllm.requests import (
    GroupSelect,
    RequestViews,
    group_block_ids,
    steady_decode,
    translate_scheduler_output,
)
from kvflow.integrations.vllm.roles import SchedulerRole, WorkerRole
from kvflow.integrations.vllm.telemetry import (
    CopyDelta,
    KVFlowConnectorStats,
    KVFlowPromMetrics,
    StatsDelta,
    kv_cache_events,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VLLMSchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as VLLMKVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvflow.backends.pd.transport import KVTransport
    from kvflow.connector.offload import OffloadScheduler
    from kvflow.integrations.vllm.pd_worker import PDWorkerSide
    from kvflow.runtime.clock import Clock

log = get_logger("kvflow.integrations.vllm")

VLLM_VERSION_TESTED = "0.32.0"


def _world_rank() -> int:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_world_group().rank_in_group)


def _events_enabled(vllm_config: VllmConfig) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


class KVFlowConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector interface over kvflow's ``OffloadScheduler`` and ``OffloadWorker``.

    Both are built by ``make_scheduler_role`` / ``make_worker_role``, which a subclass may
    override (tests inject scripted stand-ins that way).
    """

    _cache_hit_source = CacheHitSource.HOST

    @staticmethod
    def clock() -> Clock:
        """The clock transfer latencies are read from (tests override it with a FakeClock)."""
        from kvflow.runtime.clock import SystemClock

        return SystemClock()

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: VLLMKVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # kvflow's events (stdlib logging unless structlog is configured) take vLLM's handler,
        # format and VLLM_LOGGING_LEVEL, unless the application set the kvflow logger up itself.
        follow_host_logging(logging.getLogger("vllm"))
        kv_role = self._kv_transfer_config.kv_role
        if kv_role != "kv_both" and kv_role not in PD_ROLES:
            raise ConfigError(
                f"KVFlowConnector: kv_role must be kv_both, kv_producer or kv_consumer, "
                f"got {kv_role!r}"
            )
        if kv_cache_config is None:
            raise ConfigError("KVFlowConnector needs vLLM's KVCacheConfig (vLLM >= 0.11)")
        parallel = vllm_config.parallel_config
        self.world_size = int(parallel.world_size)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config: OffloadConfig = offload_config(extra, self.world_size)
        self._interval = stats_interval(extra)  # the scheduler role's stats, while it has work
        self.pd_role: str | None = PD_ROLES.get(str(kv_role))
        device_type = str(vllm_config.device_config.device_type)
        if self.pd_role == "both":
            self.pd_role = self._both_pd(device_type)
        elif self.pd_role is not None:
            check_pd_transport(self.config.pd, device_type)
        if self.pd_role is not None and self.world_size != 1:
            raise ConfigError(
                f"KVFlowConnector {kv_role}: PD with {self.world_size} ranks is not "
                "supported yet (one rank per instance)"
            )
        # Every group kind is checked here, at start-up, in both roles.
        self.geometry: KVGeometry = kv_cache_geometry(
            kv_cache_config, int(parallel.decode_context_parallel_size)
        )
        groups = self.geometry.groups
        self.cpu_blocks = self.config.cpu_blocks_per_group([g.block_bytes for g in groups])
        self.num_cpu_blocks = self.cpu_blocks[0]
        self._num_groups = len(groups)
        self._select: GroupSelect | None = (
            None if self.geometry.offloads_every_group else self.geometry.select
        )
        self._boundary = math.gcd(*(g.block_size for g in groups))
        # vLLM sets hash_block_size on the config it hands connectors (None in older versions).
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
        views = RequestViews if self.pd_role is None else PDRequestViews
        self._views = views(None if hash_block_size is None else int(hash_block_size))
        lazy = self.config.store_policy == "lazy"
        # Lazy, with vLLM's hashes as the CPU keys of every group: the lazy walk reads a free
        # block's key from vLLM's block, so running requests' steps carry no news for the CPU
        # tier. Dedicated PD roles keep the recorded walk; kv_both keeps the keyed one and
        # passes running requests on once PD started (hand-offs follow their tables).
        self._keyed = (
            lazy
            and self.pd_role in (None, "both")
            and hash_block_size is not None
            and all(g.block_size == int(hash_block_size) for g in groups)
        )
        # vLLM maps failed block ids back to requests only with a single KV cache group.
        self._per_request_failures = self.geometry.num_vllm_groups > 1
        self._relay = OutcomeRelay(per_request=self._per_request_failures)
        self._events = _events_enabled(vllm_config)
        self._step = 0
        self._scheduler: SchedulerRole | None = None
        # kvflow's own scheduler role without PD: a steady decode step goes to it whole, as
        # columns (``OffloadScheduler.decode_step``), not through the translation.
        self._decode: OffloadScheduler | None = None
        # The same, lazy over a keyed view: a steady decode step has no news for it, and goes
        # to it by its number alone (``OffloadScheduler.quiet_step``).
        self._quiet: OffloadScheduler | None = None
        self._pd: PDSchedulerRole | None = None
        self._pd_pending = False  # kv_both: PD is built at the first request with PD params
        self._data_endpoint = ""  # this instance's worker data plane (the handshake's)
        self._worker: WorkerRole | None = None
        self._pd_worker: PDWorkerSide | None = None
        self._pd_reply = False  # worker: the scheduler wants this step's answer
        self._stats: StatsDelta | None = None
        self._stats_dirty = False
        self._report: StepReport | None = None
        self._copies = CopyDelta()
        self._copies_dirty = False
        self._echo: frozenset[int] = frozenset()
        self._echo_failed: frozenset[str] = frozenset()
        self._load_requests: dict[int, str] = {}  # worker: live load transfer → its request
        self._failed_requests: set[str] = set()  # worker: requests of loads that failed
        # The scheduler role is built in bind_gpu_block_pool, which vLLM's Scheduler calls
        # right after this: with a view of vLLM's GPU pool, loads, lazy stores and stores of
        # sliding-window models hold references on their GPU blocks.
        if role == KVConnectorRole.WORKER:
            self._worker = self.make_worker_role()
            if self.pd_role is not None:
                self._pd_worker = self.make_pd_worker()
        log.info(
            "vllm_connector_created",
            role=role.name,
            groups=self._num_groups,
            skipped_groups=[g for g, _ in self.geometry.skipped],
            cpu_blocks=self.num_cpu_blocks,
            store_policy=self.config.store_policy.value,
            worker_loop=self.config.worker_loop.value,
        )

    def _both_pd(self, device_type: str) -> str | None:
        """kv_both: "both" where PD per request can run here, else None (the CPU tier only, at
        any TP); a ``pd_transport`` the user named that cannot run is an error."""
        if self.world_size != 1:
            log.info("vllm_pd_off", reason=f"PD needs one rank per instance, not {self.world_size}")
            return None
        try:
            check_pd_transport(self.config.pd, device_type)
        except ConfigError as e:
            if "pd_transport" in (self._kv_transfer_config.kv_connector_extra_config or {}):
                raise
            log.info("vllm_pd_off", reason=str(e))
            return None
        return "both"

    @property
    def requires_kv_delivery(self) -> bool:
        # The CPU tier is a best-effort cache (a store dropped by preemption is a later miss);
        # a producer's hand-off is not: D waits for exactly that KV (kv_both may be P).
        return self.pd_role in ("producer", "both")

    # -- role construction (overridable) ----------------------------------------------------------

    def kvflow_cache_config(self, device: str = "cpu") -> KVCacheConfig:
        """kvflow's view of vLLM's KV cache: the offloaded groups, vLLM's block count."""
        return self.geometry.kvflow_cache_config(int(self._kv_cache_config.num_blocks), device)

    def make_scheduler_role(self, gpu_view: VLLMGpuCacheView) -> SchedulerRole:
        """kvflow's ``OffloadScheduler`` over vLLM's GPU block pool."""
        from kvflow.connector.offload import OffloadScheduler

        return OffloadScheduler(
            self.config,
            self.kvflow_cache_config(),
            [g.block_bytes for g in self.geometry.groups],
            gpu_view=gpu_view,
            now=self.clock().now,
            enable_events=self._events,
            record_latencies=True,
        )

    def make_pd_scheduler(self, offload: OffloadScheduler) -> PDSchedulerRole:
        """The P or D scheduler role: the CPU tier and PD in one ``PDOffloadConnector``."""
        assert self.pd_role is not None
        kv = self.kvflow_cache_config()
        model = self._vllm_config.model_config
        spec = self._kv_cache_config.kv_cache_groups[self.geometry.groups[0].vllm_group]
        return PDSchedulerRole(
            offload,
            self.pd_role,
            kv,
            self.config.pd,
            engine_id=str(self._kv_transfer_config.engine_id),
            compat=vllm_compat(
                str(model.model), str(model.dtype), kv, spec.kv_cache_spec, self.world_size
            ),
            clock=self.clock(),
            tp_size=self.world_size,
            block_bytes=[g.block_bytes for g in self.geometry.groups],
            data_endpoint=self._data_endpoint,
        )

    def make_pd_transport(self, pair_rank: int, host: str, port: int) -> KVTransport:
        """The worker's data plane to one peer (``pd_transport``, from kvflow's transport
        registry; tests override it)."""
        from kvflow.backends.pd.registry import make_transport

        transport: KVTransport = make_transport(
            self.config.pd.transport.value,
            pair_rank=pair_rank,
            host=host,
            port=port,
            now=self.clock().now,
            timeout_s=self.config.pd.timeout_s,
            device=self._cuda_device(),
        )
        return transport

    def _cuda_device(self) -> int:
        if str(self._vllm_config.device_config.device_type) != "cuda":
            return 0
        import torch

        return int(torch.cuda.current_device())

    def make_pd_worker(self) -> PDWorkerSide:
        from kvflow.integrations.vllm.pd_worker import PDWorkerSide

        assert self.pd_role is not None
        pd = self.config.pd
        return PDWorkerSide(
            self.pd_role,
            self.make_pd_transport,
            host=pd.side_channel_host,
            data_port=pd.data_port,
            transport_name=pd.transport.value,
        )

    def make_worker_role(self) -> WorkerRole:
        """kvflow's ``OffloadWorker`` for this worker's device, its runtime's loop as
        ``worker_loop`` says (``auto`` backend: CUDA for a CUDA worker with a driver, else host)."""
        # Imported here: the scheduler process never needs the runtime's event loop.
        from kvflow.connector.offload import OffloadWorker

        device = "cpu"
        if str(self._vllm_config.device_config.device_type) == "cuda":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        return OffloadWorker(
            self.config, self.kvflow_cache_config(device), self.cpu_blocks, rank=_world_rank()
        )

    @property
    def scheduler_role(self) -> SchedulerRole:
        if self._scheduler is None:
            raise ConfigError(
                "kvflow's scheduler side is not ready: vLLM binds its GPU block pool "
                "(bind_gpu_block_pool) first, and worker-role connectors have none"
            )
        return self._scheduler

    @property
    def worker(self) -> WorkerRole:
        if self._worker is None:
            raise ConfigError("worker-side call on a scheduler-role KVFlowConnector")
        return self._worker

    def _ids(self, block_ids: Sequence[Sequence[int]]) -> GroupBlockIds:
        return group_block_ids(block_ids if self._select is None else self._select(block_ids))

    # -- scheduler side ---------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._scheduler is None and self.role == KVConnectorRole.SCHEDULER:
            view = (
                VLLMKeyedGpuCacheView(
                    gpu_block_pool, {g.vllm_group: i for i, g in enumerate(self.geometry.groups)}
                )
                if self._keyed
                else VLLMGpuCacheView(gpu_block_pool)
            )
            self._scheduler = self.make_scheduler_role(view)
            from kvflow.connector.offload import OffloadScheduler

            if isinstance(self._scheduler, OffloadScheduler):
                if self._keyed:
                    self._quiet = self._scheduler
                elif self._select is None:
                    self._decode = self._scheduler
            if self.pd_role == "both":
                self._pd_pending = True
            elif self.pd_role is not None:
                self._start_pd()
            self._stats = StatsDelta(
                self._scheduler.manager, sum(self.cpu_blocks), self.clock().now, self._interval
            )

    def _start_pd(self) -> None:
        from kvflow.connector.offload import OffloadScheduler

        assert isinstance(self._scheduler, OffloadScheduler)
        self._pd_pending = False
        self._decode = self._quiet = None
        self._scheduler = self._pd = self.make_pd_scheduler(self._scheduler)

    def _view(self, request: Request) -> RequestLike:
        view = self._views.get(request)
        if self._pd_pending and getattr(view, "kv_transfer_params", None):
            self._start_pd()  # kv_both: the first request that is a hand-off
        return view

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._stats_dirty = True
        view = self._view(request)  # first: it may build kv_both's PD half
        return self.scheduler_role.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_role.update_state_after_alloc(
            self._views.get(request), self._ids(blocks.get_block_ids()), num_external_tokens
        )

    def build_connector_meta(
        self, scheduler_output: VLLMSchedulerOutput
    ) -> KVFlowConnectorMetadata:
        # Every step: each attribute read once, no property on the way.
        role = self._scheduler
        if role is None:
            role = self.scheduler_role  # raises the error that says why
        step = self._step
        self._step = step + 1
        quiet = self._quiet
        if quiet is not None and steady_decode(scheduler_output):
            # Lazy over a keyed view (no PD): most such steps leave the workers nothing to do,
            # and get the one idle metadata.
            quiet_plan = quiet.quiet_step(step)
            if quiet_plan is not None:
                self._stats_dirty = True
            return self._relay.metadata(quiet_plan)
        pd = self._pd
        decode = self._decode
        if decode is not None and steady_decode(scheduler_output):
            cached = scheduler_output.scheduled_cached_reqs
            plan = decode.decode_step(
                step, cached.req_ids, cached.num_computed_tokens, cached.new_block_ids
            )
        else:
            plan = role.build_connector_meta(
                translate_scheduler_output(
                    scheduler_output,
                    step,
                    self._num_groups,
                    self._boundary,
                    self._select,
                    running=not self._keyed or pd is not None,
                )
            )
        if plan.stores or plan.loads or plan.abandoned:
            self._stats_dirty = True
        meta = self._relay.metadata(plan)
        return meta if pd is None else pd.wrap_meta(meta)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        outcome: OutcomeLike | None = None
        pd = self._pd
        if pd is not None:
            # PD: the driver is polled every step the workers answer (its copies settle here).
            results = meta.pd_results if isinstance(meta, KVFlowPDWorkerMetadata) else ()
            reports = meta.reports if isinstance(meta, KVFlowWorkerMetadata) else ()
            outcome = pd.update_from_reports(reports, results)
            if reports or not outcome.is_empty:
                self._stats_dirty = True
        elif isinstance(meta, KVFlowWorkerMetadata) and meta.reports:
            role = self._scheduler
            if role is None:
                role = self.scheduler_role
            outcome = role.update_from_reports(meta.reports)
            self._stats_dirty = True
        self._relay.apply(connector_output, outcome)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._pd_pending:
            self._view(request)  # a D request finished before admission still releases P
        delay_free, params = self.scheduler_role.request_finished(
            self._views.pop(request), self._ids(block_ids)
        )
        return delay_free, None if params is None else dict(params)

    def reset_cache(self) -> bool | None:
        """Empty the CPU tier; True at once, even with transfers in flight (docs/vllm.md).

        From this call on no request is offered a CPU hit until the reset completes, and every
        transfer in flight is abandoned: its result is dropped when it settles, never cached. So
        the cache vLLM asked to reset serves nothing from before the reset, which is what
        vLLM's callers need (a weight update raises on False).
        """
        complete = self.scheduler_role.reset_cache()
        self._stats_dirty = True
        log.info("vllm_connector_reset_cache", complete=complete)
        return True

    def has_pending_push_work(self) -> bool:
        # Keeps vLLM's engine loop stepping until every transfer reported and held completions
        # went through their echo: an idle engine would otherwise leave finished stores
        # uncommitted, and the next request would miss them.
        return self._relay.pending or (
            self._scheduler is not None and self._scheduler.has_pending_push_work()
        )

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """P: its workers' data-plane endpoints (vLLM's engine core collects them at start-up);
        the producer's params name rank 0's, where D's worker meets it."""
        ours = metadata.get(0)
        if isinstance(ours, KVFlowHandshake):
            self._data_endpoint = f"{ours.host}:{ours.port}"
            if self._pd is not None:
                self._pd.data_endpoint = self._data_endpoint

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The CPU tier's KV cache events since the last call (with vLLM's KV events on)."""
        if not self._events or self._scheduler is None:
            return ()
        events = self._scheduler.take_events()
        return kv_cache_events(events, self.geometry) if events else ()

    # -- stats (both roles) -------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's stats: the scheduler role's counters, occupancy and latencies, or a
        worker's copy bytes and seconds; None when nothing changed (most steps)."""
        if self._scheduler is not None:
            pd = self._pd.take_stats() if self._pd is not None else None
            if not self._stats_dirty or self._stats is None or not self._stats.due():
                return pd
            self._stats_dirty = False
            stats = self._stats.take(self._scheduler.take_latencies())
            if stats is None or pd is None:
                return stats or pd
            return stats.aggregate(pd)
        if self._worker is None or not self._copies_dirty:
            return None
        self._copies_dirty = False
        return self._copies.take(self._worker.copy_throughput())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        if data is None:
            return KVFlowConnectorStats()
        # A copy: vLLM hands one payload to several loggers, and aggregating into this object
        # must not change what the next logger reads.
        return KVFlowConnectorStats(data=copy.deepcopy(data))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # Only the offloaded groups' layers: a group vLLM does not prefix-cache is never copied.
        layers = self.geometry.layer_groups
        self.worker.register_kv_caches({n: t for n, t in kv_caches.items() if n in layers})
        if self._pd_worker is not None:
            from kvflow.integrations.vllm.pd_worker import pd_groups

            self._pd_worker.register(pd_groups(kv_caches, self.kvflow_cache_config()))

    def get_handshake_metadata(self) -> KVFlowHandshake | None:
        """A PD worker's data-plane endpoint, for its scheduler (None without PD)."""
        pd = self._pd_worker
        if pd is None:
            return None
        return KVFlowHandshake(pd.transport_name, pd.host, pd.data_port)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, KVFlowConnectorMetadata):
            raise ConfigError(
                f"KVFlowConnector got {type(connector_metadata).__name__}, "
                "not KVFlowConnectorMetadata"
            )
        super().bind_connector_metadata(connector_metadata)
        self._echo |= connector_metadata.echo_invalid_block_ids
        self._echo_failed |= connector_metadata.echo_failed_request_ids
        plan = connector_metadata.plan
        if self._pd_worker is not None and isinstance(
            connector_metadata, KVFlowPDConnectorMetadata
        ):
            self._pd_worker.apply(connector_metadata.pd_ops)
            self._pd_reply = connector_metadata.want_reply
        if plan is None:
            return  # nothing for the workers this step (``IDLE_METADATA``)
        if plan.loads:
            self._load_requests.update((t.transfer_id, t.request_id) for t in plan.loads)
        self.worker.bind_connector_metadata(plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVFlowConnectorMetadata):
            plan = kv_connector_metadata.plan
            if plan is not None and plan.flush:
                self.worker.handle_preemptions(plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request, fenced before the step's forward: nothing to wait for here."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Stores are planned per step and launched in ``wait_for_save``, not per layer."""

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def _collect_report(self) -> None:
        if self._report is not None:
            return
        worker = self.worker
        worker.get_finished(set())
        report = self._report = worker.build_worker_report()
        if report.completed or report.failed:
            self._copies_dirty = True
            loads = self._load_requests
            if loads:
                for tid in report.completed:
                    loads.pop(tid, None)
                for tid in report.failed:
                    rid = loads.pop(tid, None)
                    if rid is not None:
                        self._failed_requests.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Request completion is decided by the scheduler role once all ranks reported.
        self._collect_report()
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """No completions (the scheduler role decides them); with several KV cache groups, the
        requests whose loads failed, as vLLM needs them there."""
        self._collect_report()
        failed: set[str] = set()
        if self._per_request_failures:
            failed = self._failed_requests | self._echo_failed
            self._echo_failed = frozenset()
        self._failed_requests = set()
        return KVConnectorTransferResults(failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._collect_report()
        errors = set(self.worker.get_block_ids_with_load_errors()) | self._echo
        self._echo = frozenset()
        # Several groups: vLLM rejects block ids it cannot map back; failed_recving carries them.
        return set() if self._per_request_failures else errors

    def build_connector_worker_meta(self) -> KVFlowWorkerMetadata | None:
        self._collect_report()
        report, self._report = self._report, None
        news = report is not None and report_has_news(report)
        if self._pd_worker is not None:
            results = self._pd_worker.take_results()
            if news or results or self._pd_reply:
                self._pd_reply = False
                return KVFlowPDWorkerMetadata((report,) if news and report else (), results)
            return None
        if not news or report is None:
            return None
        return KVFlowWorkerMetadata((report,))

    def shutdown(self) -> None:
        try:
            if self._worker is not None:
                self._worker.shutdown()
        finally:
            if self._pd_worker is not None:
                self._pd_worker.close()
            if self._pd is not None:
                self._pd.close()


__all__ = ["VLLM_VERSION_TESTED", "KVFlowConnector", "SchedulerRole", "WorkerRole"]
