"""kvflow's ``kv_both`` as vLLM's NixlConnector runs it: every instance P or D per request as its
``kv_transfer_params`` say, plain requests on the CPU tier; PD's connector stats after real
hand-offs; one P serving two D instances and one D pulling from two P instances. Each instance is
vLLM's real v1 scheduler with ``KVFlowConnector`` and its worker twin over CPU tensors, the bytes
through one fake link per P–D pair."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)

from kvflow.backends.pd.fake import FakeLink
from tests.integrations.vllm_pd_rig import (
    BS,
    PROXY_PARAMS,
    TIMEOUTS,
    Fleet,
    Instance,
    PDRig,
    expected_kv,
    waiting_for_kv,
)
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPT = [(i * 37) % 30000 + 10 for i in range(4 * BS + 6)]  # 4 full blocks + 6 tokens
OTHER = [(i * 41) % 30000 + 17 for i in range(3 * BS + 9)]  # 3 full blocks + 9 tokens
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 2  # K and V, 2 layers, 16 tokens, 2 heads x 16, fp16


@pytest.fixture
def both() -> Iterator[PDRig]:
    r = PDRig(p_role="kv_both", d_role="kv_both")
    try:
        yield r
    finally:
        r.close()


def hand_off(rig: PDRig, p: Instance, d: Instance, prompt: list[int], rid: str) -> None:
    """The proxy's two legs from ``p`` to ``d``: ``d`` runs only the last prompt token, on
    exactly the KV ``p`` computed; both end idle."""
    req = p.add(prompt, PROXY_PARAMS, max_tokens=1, request_id=rid)
    rig.run(lambda: rid in p.outputs)
    params = p.outputs[rid].kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == p.connector._kv_transfer_config.engine_id
    assert rid in p.h.scheduler.requests, "p holds the finished request's blocks"
    del req
    dreq = d.add(prompt, dict(params), max_tokens=2, request_id=rid)
    d.step()
    assert waiting_for_kv(dreq)
    for _ in range(200):
        rig.step()
        if rid in d.computed:
            break
    assert d.computed[rid] == 1, "only the last prompt token is computed"
    assert d.kv_of(dreq, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
    rig.run(lambda: rid in d.outputs)
    rig.settle()


def test_kv_both_is_p_or_d_per_request_and_hands_off_both_ways(both: PDRig) -> None:
    """Two kv_both instances: a request with do_remote_decode makes the first P and the second D,
    then the other way round; each hand-off is byte-exact and leaves both sides idle."""
    assert both.p.connector._pd is None, "no PD half before a request carries PD params"
    hand_off(both, both.p, both.d, PROMPT, "ab")
    hand_off(both, both.d, both.p, OTHER, "ba")
    assert both.d.pd.pd.consumer.stats["handoffs_ok"] == 1
    assert both.p.pd.pd.consumer.stats["handoffs_ok"] == 1
    assert len(both.links) == 2, "one data-plane pair per direction"


def test_plain_requests_on_kv_both_instances_use_the_cpu_tier(both: PDRig) -> None:
    """On the same two kv_both instances, after a hand-off, a request without PD params stores
    to and loads from the instance's CPU tier as on a plain kv_both instance."""
    hand_off(both, both.p, both.d, PROMPT, "ab")
    d = both.d
    d.add(OTHER, None, max_tokens=1, request_id="warm")
    both.run(lambda: "warm" in d.outputs)
    both.settle()
    manager = d.connector._scheduler.manager  # type: ignore[union-attr]
    stored = manager.stats().blocks_stored
    assert stored >= 3
    assert d.h.scheduler.kv_cache_manager.reset_prefix_cache()
    req = d.add(OTHER, None, max_tokens=1, request_id="again")
    both.run(lambda: "again" in d.outputs)
    both.settle()
    assert manager.stats().blocks_loaded == 3, "the prompt's full blocks came from the CPU tier"
    assert d.computed["again"] == len(OTHER) - 3 * BS
    assert req.kv_transfer_params is None


def test_pd_stats_count_the_hand_off_on_both_sides(both: PDRig) -> None:
    """After one hand-off the connector stats vLLM published say, on D: one hand-off committed,
    the 5 blocks and their bytes moved, 69 prompt tokens from P, one copy latency; on P: one
    committed, the same blocks sent; no hold or reservation left; the log line and Prometheus
    carry them (each logger reads the same payloads, as vLLM's do)."""
    hand_off(both, both.p, both.d, PROMPT, "ab")
    p, d = both.p.stats(), both.d.stats()
    assert d.counters["pd_handoffs_committed"] == 1
    assert d.counters["pd_blocks_moved"] == 5
    assert d.counters["pd_bytes_moved"] == 5 * BLOCK_BYTES
    assert d.counters["pd_remote_prefill_tokens"] == len(PROMPT) - 1
    assert len(d.latencies["pd_transfer"]) == 1
    assert p.counters["pd_handoffs_committed"] == 1
    assert p.counters["pd_blocks_moved"] == 5
    assert "pd_handoffs_failed" not in p.counters | d.counters
    assert p.gauges["pd_holds_outstanding"] == 0
    assert d.gauges["pd_reservations_outstanding"] == 0
    summary = d.reduce()
    assert summary["pd_handoffs_committed"] == 1
    assert summary["pd_transfer_latency_ms_mean"] >= 0

    assert len(both.d.payloads) > 1, "several intervals aggregate"
    config = both.d.h.scheduler.vllm_config
    logging = KVConnectorLogging(config.kv_transfer_config)
    for payload in both.d.payloads:
        logging.observe(payload)
    lines: list[str] = []
    logging.log(lambda fmt, text: lines.append(fmt % text))
    assert "pd_remote_prefill_tokens=69" in lines[0]
    prom = KVConnectorProm(config, ["engine"], {0: ["0"]})
    metrics = prom.prom_metrics
    assert metrics is not None
    try:
        for payload in both.d.payloads:
            prom.observe(payload, engine_idx=0)
        value = REGISTRY.get_sample_value
        labels = {"engine": "0"}
        assert value("vllm:kvflow_pd_handoffs_committed_total", labels) == 1
        assert value("vllm:kvflow_pd_bytes_moved_total", labels) == 5 * BLOCK_BYTES
        assert value("vllm:kvflow_pd_transfer_latency_seconds_count", labels) == 1
        assert value("vllm:kvflow_pd_reservations_outstanding", labels) == 0
    finally:
        for family in (metrics._counters, metrics._gauges, metrics._histograms):
            for metric in family.values():
                REGISTRY.unregister(metric)


def test_pd_stats_count_a_failed_and_an_aborted_hand_off() -> None:
    """A receive the link loses counts as failed on both sides (nothing moved on D); a request D
    aborts before admitting it counts as aborted on P (released, nothing sent)."""
    link = FakeLink(recv_timeout_s=0.2)
    rig = PDRig(link)
    try:
        _, params = rig.prefill(PROMPT, "lost")
        link.drop(1)
        rig.d.add(PROMPT, params, max_tokens=1, request_id="lost")
        rig.run(lambda: "lost" in rig.d.outputs, max_steps=10_000)
        rig.settle(max_steps=10_000)
        _, params = rig.prefill(OTHER, "gone")
        rig.d.add(OTHER, params, request_id="gone")
        rig.d.h.scheduler.finish_requests("gone", _aborted())
        # D's abort reaches P over the control plane's threads: steps are no measure of it.
        rig.run(lambda: "gone" not in rig.p.h.scheduler.requests, max_steps=10_000)
        rig.settle(max_steps=10_000)
        p, d = rig.p.stats().counters, rig.d.stats().counters
        assert d["pd_handoffs_failed"] == 1
        assert "pd_remote_prefill_tokens" not in d
        assert p["pd_handoffs_failed"] == 1
        assert p["pd_handoffs_aborted"] == 1
        assert "pd_handoffs_committed" not in p
    finally:
        rig.close()


def _aborted() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


def test_one_p_serves_two_d_instances_each_on_a_pair_of_its_own() -> None:
    """P's requests name their D (remote_engine_id): two D schedulers each pull their own
    prompt's KV from the one P, through a data-plane pair per D; P ends with every block free."""
    fleet = Fleet({"P": "D1"}, {"D1": "", "D2": ""})
    try:
        p = fleet.instances["P"]
        free = p.free_blocks()
        a = fleet.prefill("P", PROMPT, "a", d="D1")
        b = fleet.prefill("P", OTHER, "b", d="D2")
        assert a["kvflow_data"] != b["kvflow_data"], "one pair per D"
        fleet.decode("D2", OTHER, b, "b")
        fleet.decode("D1", PROMPT, a, "a")
        fleet.settle()
        assert p.free_blocks() == free
        assert p.stats().counters["pd_handoffs_committed"] == 2
    finally:
        fleet.close()


def test_one_d_pulls_from_two_p_instances() -> None:
    """One D pulls two prompts from two P instances, each request's params naming its P."""
    fleet = Fleet({"P1": "D", "P2": "D"}, {"D": ""})
    try:
        a = fleet.prefill("P1", PROMPT, "a", d=None)
        b = fleet.prefill("P2", OTHER, "b", d=None)
        assert (a["remote_engine_id"], b["remote_engine_id"]) == ("P1", "P2")
        fleet.decode("D", PROMPT, a, "a")
        fleet.decode("D", OTHER, b, "b")
        fleet.settle()
        assert fleet.instances["D"].stats().counters["pd_handoffs_committed"] == 2
        assert len(fleet.links) == 2
    finally:
        fleet.close()


def test_a_kv_both_request_naming_no_d_begins_unbound_and_the_claiming_d_gets_it() -> None:
    """kv_both without pd_peer_engine_id and a proxy that names no D: the first PD request
    builds kv_both's PD half, P holds the KV unbound (pd_unbound) and returns params naming the
    spare data endpoint; the D that claims it binds it and gets the KV byte-exact."""
    fleet = Fleet({}, {"D": ""})
    try:
        p = fleet.instances["P"] = Instance("kv_both", "P", TIMEOUTS, links=fleet.links)
        free = p.free_blocks()
        with capture_logs() as logs:
            params = fleet.prefill("P", PROMPT, "r", d=None)
            events = [e["event"] for e in logs]
            assert "vllm_pd_ready" in events, "the first PD request built kv_both's PD half"
            assert {"event": "pd_unbound", "request_id": "r", "log_level": "info"} in logs
            assert params["kvflow_data_for"] == {}
            assert params["kvflow_data"]
            fleet.decode("D", PROMPT, params, "r")
            fleet.settle()
        bound = [(e["transfer_id"], e["peer"]) for e in logs if e["event"] == "pd_peer_bound"]
        assert bound == [(params["kvflow_transfer_id"], "D")]
        assert p.free_blocks() == free
    finally:
        fleet.close()
