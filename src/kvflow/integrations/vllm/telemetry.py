"""Events and metrics: kvflow's CPU tier as vLLM's KV cache events, connector stats and Prometheus.

``kv_cache_events`` turns the manager's CPU-pool events into vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` with medium ``"CPU"`` (vLLM's ``MEDIUM_CPU``, as its
``SimpleCPUOffloadConnector`` names its tier), so a KV-aware router sees what kvflow holds.
``KVFlowConnectorStats`` is the stats payload vLLM carries from the connector's roles to its
logger (counters summed over workers and intervals, gauges the latest, latencies as
observations); ``KVFlowPromMetrics`` records it into Prometheus through vLLM's connector hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvflow.connector.offload import LATENCY_BUCKETS_S
from kvflow.core import block_pool
from kvflow.core.offload import OffloadManager
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvflow.integrations.vllm.config import KVGeometry

KV_EVENT_MEDIUM = MEDIUM_CPU
"""The medium kvflow's events name: its tier is CPU memory, as vLLM's own CPU offload's is."""

PD_COUNTERS = (
    "pd_handoffs_committed",
    "pd_handoffs_failed",
    "pd_handoffs_aborted",
    "pd_bytes_moved",
    "pd_blocks_moved",
    "pd_remote_prefill_tokens",
)
"""PD's counters (``pd_stats``): a P, D or ``kv_both`` instance's hand-offs and their copies."""
COUNTERS = (
    "lookups",
    "hits",
    "hit_tokens",
    "blocks_stored",
    "blocks_loaded",
    "bytes_stored",
    "bytes_loaded",
    "skipped_stores",
    "failed_transfers",
    "abandoned_transfers",
    # worker side: bytes copied and seconds copies were in flight, per direction
    "copy_bytes_store",
    "copy_seconds_store",
    "copy_bytes_load",
    "copy_seconds_load",
    *PD_COUNTERS,
)
PD_LATENCY = "pd_transfer"
GAUGES = (
    "cpu_blocks_used",
    "cpu_blocks_cached",
    "cpu_blocks_total",
    "transfers_in_flight",
    "pd_holds_outstanding",
    "pd_reservations_outstanding",
)
LATENCIES = ("store", "load", PD_LATENCY)
MANAGER_COUNTERS = COUNTERS[:10]
"""The counters the scheduler role's manager keeps (then the workers' copies, and PD's)."""

_read_counters = attrgetter(*MANAGER_COUNTERS)
"""The manager's counters as one tuple, read in C (vLLM asks for stats every step)."""

_COUNTERS_KEY, _GAUGES_KEY, _LATENCY_KEY = "counters", "gauges", "latency_s"
_DIRECTION_KEY = {d: d.value for d in Direction}
"""A direction's name in the payload (plain ``str``: it crosses processes), by dict lookup:
an enum's ``value`` is a Python-level descriptor."""
_UNDESCRIBED = block_pool.StoredBlockInfo(None, ())


def _lora(info: block_pool.StoredBlockInfo) -> tuple[int | None, str | None]:
    request = getattr(info.request, "request", None)  # a VLLMRequestView's vLLM Request
    lora = None if request is None else getattr(request, "lora_request", None)
    return (None, None) if lora is None else (int(lora.lora_int_id), str(lora.lora_name))


def kv_cache_events(
    events: Sequence[tuple[int, block_pool.PoolEvent]], geometry: KVGeometry
) -> list[KVCacheEvent]:
    """The manager's (group, pool event) pairs as vLLM's KV cache events for the CPU tier: one
    ``BlockStored`` per block (parent hash, tokens, LoRA where the manager knew them), as vLLM's
    own CPU offload connector publishes them."""
    out: list[KVCacheEvent] = []
    for g, event in events:
        group = geometry.groups[g]
        if isinstance(event, block_pool.BlockStored):
            kind = "sliding_window" if group.sliding_window is not None else "full_attention"
            infos = event.infos or (_UNDESCRIBED,) * len(event.block_hashes)
            for h, info in zip(event.block_hashes, infos, strict=True):
                lora_id, lora_name = _lora(info)
                parent = info.parent_hash
                out.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(h)],
                        parent_block_hash=None
                        if parent is None
                        else maybe_convert_block_hash(parent),
                        token_ids=list(info.token_ids),
                        block_size=group.block_size,
                        lora_id=lora_id,
                        medium=KV_EVENT_MEDIUM,
                        lora_name=lora_name,
                        group_idx=group.vllm_group,
                        kv_cache_spec_kind=kind,
                        kv_cache_spec_sliding_window=group.sliding_window,
                        locality="LOCAL",
                    )
                )
        elif isinstance(event, block_pool.BlockRemoved):
            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in event.block_hashes],
                    medium=KV_EVENT_MEDIUM,
                    group_idx=group.vllm_group,
                    locality="LOCAL",
                )
            )
        else:
            out.append(AllBlocksCleared())
    return out


@dataclass
class KVFlowConnectorStats(KVConnectorStats):
    """kvflow's stats of one interval, as vLLM carries them from workers and the scheduler.

    ``data`` is plain data (it crosses processes): ``counters`` (name → number, summed when
    aggregated), ``gauges`` (name → number, the latest wins), ``latency_s`` (direction → the
    launch → commit seconds observed).
    """

    def __post_init__(self) -> None:
        if _COUNTERS_KEY not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {_COUNTERS_KEY: {}, _GAUGES_KEY: {}, _LATENCY_KEY: {}}

    @property
    def counters(self) -> dict[str, float]:
        counters: dict[str, float] = self.data[_COUNTERS_KEY]
        return counters

    @property
    def gauges(self) -> dict[str, float]:
        gauges: dict[str, float] = self.data[_GAUGES_KEY]
        return gauges

    @property
    def latencies(self) -> dict[str, list[float]]:
        latencies: dict[str, list[float]] = self.data[_LATENCY_KEY]
        return latencies

    def add(self, name: str, value: float) -> None:
        if value:
            self.counters[name] = self.counters.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVFlowConnectorStats:
        if not isinstance(other, KVFlowConnectorStats):
            raise TypeError(f"cannot aggregate kvflow stats with {type(other).__name__}")
        for name, value in other.counters.items():
            self.add(name, value)
        self.gauges.update(other.gauges)
        for direction, seconds in other.latencies.items():
            self.latencies.setdefault(direction, []).extend(seconds)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One summary of the interval for vLLM's log line: counters, gauges, hit rate, copy
        GB/s per direction, launch → commit latency (mean and max, ms) per direction."""
        c = self.counters
        out: dict[str, int | float] = {
            name: c[name] for name in COUNTERS if name in c and not name.startswith("copy_")
        }
        out.update(self.gauges)
        if c.get("lookups"):
            out["hit_rate"] = round(c.get("hits", 0) / c["lookups"], 4)
        for direction in LATENCIES:
            seconds = c.get(f"copy_seconds_{direction}", 0)
            if seconds > 0:
                out[f"copy_gbps_{direction}"] = round(
                    c.get(f"copy_bytes_{direction}", 0) / seconds / 1e9, 3
                )
            observed = self.latencies.get(direction)
            if observed:
                out[f"{direction}_latency_ms_mean"] = round(1e3 * sum(observed) / len(observed), 3)
                out[f"{direction}_latency_ms_max"] = round(1e3 * max(observed), 3)
        return out

    def is_empty(self) -> bool:
        data = self.data  # vLLM asks every step: the dicts directly, not through the properties
        return not (data[_COUNTERS_KEY] or data[_GAUGES_KEY] or any(data[_LATENCY_KEY].values()))


class CopyDelta:
    """A worker's copy bytes and seconds since its previous payload, from the worker role's
    running totals (``copy_throughput``)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[Direction, tuple[int, float]] = {}

    def take(self, now: dict[Direction, tuple[int, float]]) -> KVFlowConnectorStats | None:
        """The payload of what moved since the last call; None when nothing did."""
        stats = KVFlowConnectorStats()
        for direction, (moved, busy) in now.items():
            last_moved, last_busy = self._last.get(direction, (0, 0.0))
            stats.add(f"copy_bytes_{direction.value}", moved - last_moved)
            stats.add(f"copy_seconds_{direction.value}", busy - last_busy)
        self._last = dict(now)
        return None if stats.is_empty() else stats


class StatsDelta:
    """The scheduler role's counters since the previous interval, read cheaply each step from the
    manager's live counters: a payload only when something moved (vLLM asks every step), and
    while requests run or transfers are in flight at most one each ``interval`` seconds of
    ``now`` (``due``): counters sum and latencies accumulate meanwhile, so nothing is lost, only
    reported up to an interval later.

    With a store every step something moves every step, so this runs once a step; after vLLM's
    own scheduling every object and function it touches is out of the CPU caches, so it touches
    few: the manager's counter object, pools and live-transfer count are looked up once, the
    pools' sizes are constants, and the payload is built without its class's ``__init__``.
    """

    __slots__ = (
        "_busy",
        "_counters",
        "_emitted",
        "_interval",
        "_last",
        "_last_gauges",
        "_live",
        "_now",
        "_pools",
        "_total_blocks",
        "_used",
    )

    def __init__(
        self,
        manager: OffloadManager,
        total_cpu_blocks: int,
        now: Callable[[], float] | None = None,
        interval: float = 0.0,
    ) -> None:
        if interval and now is None:
            raise ConfigError("StatsDelta: an interval needs a clock (now)")
        self._now = now
        self._interval = interval
        self._emitted = -math.inf
        self._counters = manager.counters
        self._live = manager.num_live_transfers
        self._busy = manager.has_work
        self._pools = manager.cpu_pools
        self._used = sum(pool.num_blocks for pool in self._pools)  # minus the free ones
        self._last: tuple[int, ...] = (0,) * len(MANAGER_COUNTERS)
        self._last_gauges: tuple[int, int, int] | None = None
        self._total_blocks = total_cpu_blocks

    def due(self) -> bool:
        """Whether a payload is due now: always with no interval, else once the interval has
        passed since the last one, or when the manager holds no request and no transfer (the
        engine may go idle after this step: vLLM steps while it has requests, and while
        transfers settle through ``has_pending_push_work``, so its last change is never held
        back). A True answer starts the next interval."""
        interval = self._interval
        if not interval:
            return True
        assert self._now is not None
        now = self._now()
        if now - self._emitted < interval and self._busy():
            return False
        self._emitted = now
        return True

    def take(self, latencies: Sequence[tuple[Direction, float]]) -> KVFlowConnectorStats | None:
        now: tuple[int, ...] = _read_counters(self._counters)
        used = self._used
        cached = 0
        for pool in self._pools:
            used -= pool.num_free_blocks
            cached += pool.num_cached_blocks
        gauges = (used, cached, self._live())
        last = self._last
        if now == last and gauges == self._last_gauges and not latencies:
            return None
        counters: dict[str, float] = {}
        if now != last:
            for name, v, before in zip(MANAGER_COUNTERS, now, last, strict=True):
                if v != before:
                    counters[name] = v - before
            self._last = now
        self._last_gauges = gauges
        observed: dict[str, list[float]] = {}
        for direction, seconds in latencies:
            key = _DIRECTION_KEY[direction]
            seen = observed.get(key)
            if seen is None:
                observed[key] = [seconds]
            else:
                seen.append(seconds)
        stats: KVFlowConnectorStats = object.__new__(KVFlowConnectorStats)
        stats.data = {
            _COUNTERS_KEY: counters,
            _GAUGES_KEY: {
                "cpu_blocks_used": used,
                "cpu_blocks_cached": cached,
                "cpu_blocks_total": self._total_blocks,
                "transfers_in_flight": gauges[2],
            },
            _LATENCY_KEY: observed,
        }
        return stats


_DOC = {
    "lookups": "CPU tier lookups answered (requests asked for a CPU hit)",
    "hits": "lookups that found a CPU hit",
    "hit_tokens": "tokens offered from the CPU tier (each saves its prefill)",
    "blocks_stored": "KV blocks committed into the CPU tier (every rank copied them)",
    "blocks_loaded": "KV blocks loaded back from the CPU tier",
    "bytes_stored": "bytes committed into the CPU tier, one rank's share",
    "bytes_loaded": "bytes loaded from the CPU tier, one rank's share",
    "skipped_stores": "blocks not stored because the CPU tier had no evictable block",
    "failed_transfers": "transfers that failed on a rank (loads are recomputed)",
    "abandoned_transfers": "transfers abandoned by a reset or a request gone under them",
    "copy_bytes_store": "bytes copied GPU to CPU, summed over ranks",
    "copy_seconds_store": "seconds GPU to CPU copies took (the backend's timing where it times them all, else submit to seen done), summed over ranks",
    "copy_bytes_load": "bytes copied CPU to GPU, summed over ranks",
    "copy_seconds_load": "seconds CPU to GPU copies took (the backend's timing where it times them all, else submit to seen done), summed over ranks",
    "cpu_blocks_used": "CPU tier blocks in use (pinned hits and transfers)",
    "cpu_blocks_cached": "CPU tier blocks holding cached KV",
    "cpu_blocks_total": "CPU tier capacity in blocks, all groups",
    "transfers_in_flight": "transfers planned and not yet settled",
    "pd_handoffs_committed": "PD hand-offs that ended with the KV in D's blocks (P: every copy ok)",
    "pd_handoffs_failed": "PD hand-offs whose copies failed (D recomputes the prompt)",
    "pd_handoffs_aborted": "PD hand-offs ended with nothing moved (request gone, released, lease out)",
    "pd_bytes_moved": "bytes PD copies moved between P and D, this instance's side",
    "pd_blocks_moved": "KV blocks PD copies moved between P and D, this instance's side",
    "pd_remote_prefill_tokens": "prompt tokens D got from P instead of computing them",
    "pd_holds_outstanding": "P: hand-offs live (their blocks held for D, or being prefilled)",
    "pd_reservations_outstanding": "D: hand-offs live (blocks reserved for P's KV)",
}


_LATENCY_DOC = {PD_LATENCY: "kvflow PD copies, launch to settled as the scheduler saw it"}


def _metric_name(name: str, kind: str) -> str:
    return f"vllm:kvflow_{name}_total" if kind == "counter" else f"vllm:kvflow_{name}"


class KVFlowPromMetrics(KVConnectorPromMetrics):
    """kvflow's counters, gauges and latency histograms, per engine, in vLLM's Prometheus."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            n: self._counter_cls(
                name=_metric_name(n, "counter"), documentation=_DOC[n], labelnames=labelnames
            )
            for n in COUNTERS
        }
        self._gauges = {
            n: self._gauge_cls(
                name=_metric_name(n, "gauge"),
                documentation=_DOC[n],
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            for n in GAUGES
        }
        self._histograms = {
            d: self._histogram_cls(
                name=f"vllm:kvflow_{d}_latency_seconds",
                documentation=_LATENCY_DOC.get(
                    d, f"kvflow {d} transfers, plan to commit (every rank reported)"
                ),
                labelnames=labelnames,
                buckets=list(LATENCY_BUCKETS_S),
            )
            for d in LATENCIES
        }
        self._children: dict[tuple[int, str], Any] = {}

    def _child(self, metric: Any, key: str, engine_idx: int) -> Any:
        child = self._children.get((engine_idx, key))
        if child is None:
            child = metric.labels(*self.per_engine_labelvalues[engine_idx])
            self._children[(engine_idx, key)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        stats = KVFlowConnectorStats(data=transfer_stats_data)
        for name, value in stats.counters.items():
            metric = self._counters.get(name)
            if metric is not None and value > 0:
                self._child(metric, name, engine_idx).inc(value)
        for name, value in stats.gauges.items():
            metric = self._gauges.get(name)
            if metric is not None:
                self._child(metric, name, engine_idx).set(value)
        for direction, seconds in stats.latencies.items():
            histogram = self._histograms.get(direction)
            if histogram is not None:
                child = self._child(histogram, f"latency_{direction}", engine_idx)
                for s in seconds:
                    child.observe(s)


__all__ = [
    "COUNTERS",
    "GAUGES",
    "KV_EVENT_MEDIUM",
    "PD_COUNTERS",
    "PD_LATENCY",
    "CopyDelta",
    "KVFlowConnectorStats",
    "KVFlowPromMetrics",
    "StatsDelta",
    "kv_cache_events",
]
