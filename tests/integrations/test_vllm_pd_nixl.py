"""kvflow's PD in vLLM over NIXL's host path: a ``kv_producer`` and a ``kv_consumer`` instance,
each vLLM's real scheduler with ``KVFlowConnector`` and ``pd_transport=nixl`` over CPU KV tensors,
in a spawned process (NIXL's agents and UCX keep process-wide threads, pipes and a log file).
Skipped where NIXL (``kvflow[nixl]``) is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import multiprocessing as mp
from multiprocessing.connection import Connection

from kvflow.backends.pd.nixl import load_nixl
from tests.integrations.vllm_harness import KVFLOW_MODULE, tiny_model_dir
from tests.integrations.vllm_pd_rig import (
    BS,
    PROXY_PARAMS,
    TIMEOUTS,
    Instance,
    expected_kv,
    waiting_for_kv,
)

TIMEOUT_S = 180.0


def _nixl_handoff(conn: Connection, model_dir: str) -> None:
    """P and D in this (spawned) process over NIXL; sends what the test checks. NIXL's agents
    and UCX keep process-wide state (threads, pipes, a log file), hence a process of its own."""
    from pathlib import Path

    from tests.integrations import vllm_harness

    vllm_harness._model_dir = Path(model_dir)
    extra = {**TIMEOUTS, "pd_transport": "nixl", "pd_timeout_s": 30.0}
    p = Instance(
        "kv_producer",
        "P",
        {**extra, "pd_peer_engine_id": "D"},
        connector="KVFlowConnector",
        module=KVFLOW_MODULE,
    )
    d: Instance | None = None
    try:
        d = Instance("kv_consumer", "D", extra, connector="KVFlowConnector", module=KVFLOW_MODULE)
        prompt = [(i * 29) % 30000 + 10 for i in range(3 * BS + 5)]
        p.add(prompt, PROXY_PARAMS, max_tokens=1, request_id="r")
        for _ in range(50):
            p.step()
        params = p.outputs["r"].kv_transfer_params
        assert params is not None
        req = d.add(prompt, dict(params), max_tokens=2, request_id="r")
        d.step()
        parked = waiting_for_kv(req)
        for _ in range(100_000):
            p.step()
            d.step()
            if "r" in d.computed:
                break
        exact = d.kv_of(req, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
        for _ in range(100_000):
            if p.idle() and d.idle() and "r" in d.outputs:
                break
            p.step()
            d.step()
        committed = d.stats().counters.get("pd_handoffs_committed")
        conn.send((parked, d.computed.get("r"), exact, p.idle(), d.idle(), committed))
    finally:
        try:
            if d is not None:
                d.shutdown()
        finally:
            p.shutdown()


@pytest.mark.skipif(load_nixl()[0] is None, reason="NIXL is not installed (kvflow[nixl])")
def test_kv_moves_from_p_to_d_over_nixl_host_memory() -> None:
    """P and D with pd_transport=nixl over their CPU KV tensors (NIXL's DRAM path, D reads P's
    blocks): D parks the request, gets exactly P's KV, computes one token; both end idle."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_handoff, args=(child, str(tiny_model_dir())), daemon=True)
    proc.start()
    try:
        assert parent.poll(TIMEOUT_S), "the NIXL hand-off did not finish"
        parked, computed, exact, p_idle, d_idle, committed = parent.recv()
    finally:
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()
        child.close()
    assert parked, "D parked the request on P's KV"
    assert computed == 1
    assert exact, "D holds exactly the KV P computed"
    assert (p_idle, d_idle) == (True, True)
    assert committed == 1
