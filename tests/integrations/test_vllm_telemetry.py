"""kvflow's KV cache events, connector stats and Prometheus metrics through vLLM's real scheduler.

What vLLM's own tests check for ``SimpleCPUOffloadConnector``'s events (one ``BlockStored`` per
block with medium ``"CPU"``, group, kind, block size, locality, hash, parent hash, tokens;
nothing with events off) and stats (a payload that aggregates and reduces for vLLM's log line,
recorded into Prometheus through the connector's metrics hook) is checked here for kvflow's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvflow.core.transfer import Direction
from kvflow.integrations.vllm import KV_EVENT_MEDIUM, KVFlowConnector, KVFlowConnectorStats
from kvflow.runtime.clock import FakeClock
from tests.integrations.vllm_fakes import PROMPT, ClockedConnector, ManagerRig

BS = 16


class Observed(ManagerRig):
    """A rig that keeps what vLLM's scheduler publishes: KV cache events and stats payloads."""

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        self.events: list[KVCacheEvent] = []
        self.payloads: list[dict[str, Any]] = []
        scheduler = self.h.scheduler
        scheduler.kv_event_publisher.publish = lambda batch: self.events.extend(batch.events)
        make_stats = scheduler.make_stats

        def keep_stats(*args: Any, **kwargs: Any) -> Any:
            stats = make_stats(*args, **kwargs)
            if stats is not None and stats.kv_connector_stats:
                self.payloads.append(stats.kv_connector_stats)
            return stats

        scheduler.make_stats = keep_stats

    def cpu_events(self) -> list[KVCacheEvent]:
        return [e for e in self.events if getattr(e, "medium", MEDIUM_CPU) == MEDIUM_CPU]


def test_stored_blocks_are_published_one_event_per_block_with_vllms_metadata() -> None:
    """A served prompt's 4 blocks reach the CPU tier: 4 BlockStored with medium CPU, group 0,
    full attention, block size 16, LOCAL, vLLM's own block hashes, chained parents and tokens."""
    rig = Observed(kv_events=True)
    request = rig.h.add(PROMPT, max_tokens=1)
    rig.run()
    stored = [e for e in rig.cpu_events() if isinstance(e, BlockStored)]
    assert KV_EVENT_MEDIUM == MEDIUM_CPU
    assert len(stored) == 4
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    for i, event in enumerate(stored):
        assert event.block_hashes == [hashes[i]]
        assert event.parent_block_hash == (None if i == 0 else hashes[i - 1])
        assert event.token_ids == PROMPT[i * BS : (i + 1) * BS]
        assert (event.group_idx, event.kv_cache_spec_kind, event.block_size) == (
            0,
            "full_attention",
            BS,
        )
        assert event.kv_cache_spec_sliding_window is None
        assert (event.medium, event.locality) == (MEDIUM_CPU, "LOCAL")
        assert (event.lora_id, event.lora_name) == (None, None)


def test_evictions_and_resets_are_published_for_the_cpu_tier() -> None:
    """A CPU tier of 4 blocks: a second prompt evicts the first one's blocks (BlockRemoved,
    medium CPU, the evicted hashes); a connector reset publishes AllBlocksCleared."""
    rig = Observed(kv_events=True, extra={"cpu_bytes_to_use": 4 * 2 * 2 * BS * 2 * 16 * 2})
    first = rig.h.add(PROMPT, max_tokens=1)
    rig.run()
    rig.h.add([t + 1 for t in PROMPT], max_tokens=1)
    rig.run()
    removed = [e for e in rig.cpu_events() if isinstance(e, BlockRemoved)]
    assert removed
    gone = {h for e in removed for h in e.block_hashes}
    assert gone <= {maybe_convert_block_hash(h) for h in first.block_hashes}
    assert all((e.medium, e.group_idx, e.locality) == (MEDIUM_CPU, 0, "LOCAL") for e in removed)
    assert rig.h.scheduler.reset_prefix_cache(reset_connector=True)
    rig.step()
    assert isinstance(rig.events[-1], AllBlocksCleared)


def test_no_cpu_events_without_vllms_kv_events() -> None:
    """With vLLM's KV cache events off, kvflow's take_events yields nothing and records nothing."""
    rig = Observed()
    rig.h.add(PROMPT, max_tokens=1)
    rig.run()
    assert rig.cpu_events() == []
    assert list(rig.h.connector.take_events()) == []
    assert all(not pool.take_events() for pool in rig.manager.cpu_pools)


def test_stats_reach_vllms_log_line_aggregated_over_the_interval() -> None:
    """The stats vLLM collected each step aggregate (counters summed, occupancy the latest) and
    reduce for vLLM's KV transfer log line: lookups, hits, hit tokens, stored and loaded blocks
    and bytes, latencies, CPU tier occupancy."""
    rig = Observed()
    rig.store_prompt_and_evict_gpu()
    request = rig.h.add(PROMPT, max_tokens=2)
    rig.run()
    assert request.is_finished()
    assert rig.payloads, "the scheduler role reported stats"
    logging = KVConnectorLogging(rig.h.scheduler.vllm_config.kv_transfer_config)
    for payload in rig.payloads:
        logging.observe(payload)
    lines: list[str] = []
    logging.log(lambda fmt, text: lines.append(fmt % text))
    (line,) = lines
    summary = dict(
        part.split("=") for part in line.removeprefix("KV Transfer metrics: ").split(", ")
    )
    assert summary["hits"] == "1"
    assert summary["hit_tokens"] == "64"
    assert summary["blocks_loaded"] == "4"
    assert summary["bytes_loaded"] == str(4 * 2 * BS * 2 * 16 * 2 * 2)
    assert int(summary["blocks_stored"]) == 4
    assert summary["cpu_blocks_cached"] == "4"
    assert summary["cpu_blocks_total"] == str(rig.h.connector.num_cpu_blocks)
    assert summary["transfers_in_flight"] == "0"
    assert float(summary["load_latency_ms_mean"]) >= 0
    assert float(summary["hit_rate"]) == pytest.approx(0.5)


def _clocked(extra: dict[str, Any], *, hold_stores: bool) -> Observed:
    """An observed rig on a FakeClock (``ClockedConnector.CLOCK``); with ``hold_stores`` its
    stores stay in flight until the test releases them."""
    ClockedConnector.CLOCK = FakeClock()
    rig = Observed(connector="ClockedConnector", extra=extra)
    if hold_stores:
        rig.runtime.hold_directions.add(Direction.STORE)
    return rig


def _counted(rig: Observed, name: str) -> float:
    return sum(KVFlowConnectorStats(data=p).counters.get(name, 0) for p in rig.payloads)


def test_stats_while_stores_are_in_flight_wait_for_the_interval_and_lose_nothing() -> None:
    """With transfers in flight the scheduler role reports at most once a ``stats_interval_s``
    (1 s by default) of its clock, and at once when the last transfer settles: a lookup made
    meanwhile is reported late but counted once, and the payloads sum to the manager's totals."""
    rig = _clocked({"eager_store_interval": 1}, hold_stores=True)
    clock = ClockedConnector.CLOCK
    assert clock is not None
    rig.h.add(PROMPT, max_tokens=4)
    rig.step()
    assert len(rig.payloads) == 1  # the first change is reported at once
    assert KVFlowConnectorStats(data=rig.payloads[0]).gauges["transfers_in_flight"] >= 1
    rig.h.add([t + 1 for t in PROMPT], max_tokens=4)
    rig.step()
    rig.step()
    assert rig.manager.counters.lookups == 2
    assert len(rig.payloads) == 1, "a change while stores are in flight waits for the interval"
    clock.jump(0.999)
    rig.step()
    assert len(rig.payloads) == 1
    clock.jump(0.001)
    rig.step()
    assert len(rig.payloads) == 2
    assert KVFlowConnectorStats(data=rig.payloads[1]).counters["lookups"] == 1
    rig.runtime.hold_directions.clear()
    rig.run()
    last = KVFlowConnectorStats(data=rig.payloads[-1])
    assert last.gauges["transfers_in_flight"] == 0, "the last transfer's settling is reported"
    assert _counted(rig, "lookups") == 2
    assert _counted(rig, "blocks_stored") == rig.manager.counters.blocks_stored == 8
    assert len(_latencies(rig, "store")) == sum(len(plan.stores) for plan in rig.runtime.plans) >= 2


def test_stats_while_requests_run_wait_for_the_interval_and_flush_when_idle() -> None:
    """Stores that complete in their own step: a lookup while a request still runs waits for
    the interval too, and the step after which the engine may idle (no request, no transfer)
    reports it; every lookup and stored block is counted once."""
    rig = _clocked({"eager_store_interval": 1}, hold_stores=False)
    rig.h.add(PROMPT, max_tokens=8)
    rig.step()
    assert len(rig.payloads) == 1
    rig.h.add([t + 1 for t in PROMPT], max_tokens=8)
    rig.step()
    assert len(rig.payloads) == 1, "held: requests still run"
    rig.run()
    assert len(rig.payloads) == 2
    assert rig.manager.has_work() is False
    assert _counted(rig, "lookups") == 2
    assert _counted(rig, "blocks_stored") == rig.manager.counters.blocks_stored == 8


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "jump", "hold", "release"]), st.floats(0, 0.7)
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_stats_payloads_are_an_interval_apart_while_busy_and_sum_to_the_totals(
    actions: list[tuple[str, float]],
) -> None:
    """Over any run of new requests, steps, clock jumps and stores held or let through: while the
    manager has work, two payloads are at least the interval apart on its clock; once it has
    none, the payloads sum to its counters and hold one latency per committed store."""
    rig = _clocked({"eager_store_interval": 1}, hold_stores=False)
    clock = ClockedConnector.CLOCK
    assert clock is not None
    last: float | None = None
    added = 0

    def step() -> None:
        nonlocal last
        before = len(rig.payloads)
        rig.step()
        assert len(rig.payloads) <= before + 1
        if len(rig.payloads) > before:
            if last is not None and rig.manager.has_work():
                assert clock.now() - last >= 1.0, "a payload inside the interval while busy"
            last = clock.now()

    for action, dt in actions:
        if action == "add" and added < 6:
            rig.h.add([t + 7 * added for t in PROMPT], max_tokens=4)
            added += 1
        elif action == "step":
            step()
        elif action == "jump":
            clock.jump(dt)
        elif action == "hold":
            rig.runtime.hold_directions.add(Direction.STORE)
        elif action == "release":
            rig.runtime.hold_directions.clear()
    rig.runtime.hold_directions.clear()
    for _ in range(60):
        if not rig.h.scheduler.requests and not rig.manager.has_work():
            break
        step()
    assert not rig.manager.has_work()
    counters = rig.manager.counters
    for name in ("lookups", "hits", "hit_tokens", "blocks_stored", "bytes_stored"):
        assert _counted(rig, name) == getattr(counters, name), name
    stores = sum(len(plan.stores) for plan in rig.runtime.plans)
    assert len(_latencies(rig, "store")) == stores


def _latencies(rig: Observed, direction: str) -> list[float]:
    return [
        s for p in rig.payloads for s in KVFlowConnectorStats(data=p).latencies.get(direction, [])
    ]


def test_stats_interval_zero_reports_every_step_that_changed() -> None:
    """``stats_interval_s: 0``: a change is reported in its own step, transfers in flight or
    not (the payload of every step, as before the interval)."""
    rig = _clocked({"eager_store_interval": 1, "stats_interval_s": 0}, hold_stores=True)
    rig.h.add(PROMPT, max_tokens=4)
    rig.step()
    rig.h.add([t + 1 for t in PROMPT], max_tokens=4)
    rig.step()
    assert len(rig.payloads) == 2
    assert KVFlowConnectorStats(data=rig.payloads[1]).counters["lookups"] == 1


def test_stats_of_workers_aggregate_into_copy_throughput() -> None:
    """Two ranks' copy bytes and seconds sum; the reduced line shows GB/s per direction."""
    a = KVFlowConnectorStats()
    a.add("copy_bytes_store", 4e9)
    a.add("copy_seconds_store", 1.0)
    b = KVFlowConnector.build_kv_connector_stats(dict(KVFlowConnectorStats().data))
    assert isinstance(b, KVFlowConnectorStats)
    assert b.is_empty()
    b.add("copy_bytes_store", 2e9)
    b.add("copy_seconds_store", 1.0)
    b.latencies["store"] = [0.002]
    merged = a.aggregate(b)
    assert merged.reduce()["copy_gbps_store"] == 3.0
    assert merged.reduce()["store_latency_ms_max"] == 2.0
    merged.reset()
    assert merged.is_empty()


def test_prometheus_metrics_through_vllms_connector_hook() -> None:
    """vLLM's KVConnectorProm builds kvflow's metrics from the connector class and records the
    payloads into counters, gauges and latency histograms labelled per engine."""
    rig = Observed()
    rig.store_prompt_and_evict_gpu()
    rig.h.add(PROMPT, max_tokens=2)
    rig.run()
    config = rig.h.scheduler.vllm_config
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    metrics = prom.prom_metrics
    assert metrics is not None
    labels = {"model_name": "tiny", "engine": "0"}
    try:
        for payload in rig.payloads:
            prom.observe(payload, engine_idx=0)
        value = REGISTRY.get_sample_value
        assert value("vllm:kvflow_blocks_loaded_total", labels) == 4
        assert value("vllm:kvflow_hit_tokens_total", labels) == 64
        assert value("vllm:kvflow_cpu_blocks_cached", labels) == 4
        assert value("vllm:kvflow_load_latency_seconds_count", labels) == 1
        assert value("vllm:kvflow_store_latency_seconds_count", labels) >= 1
    finally:
        for family in (metrics._counters, metrics._gauges, metrics._histograms):
            for metric in family.values():
                REGISTRY.unregister(metric)
