"""kvflow's PD in vLLM across two processes: a ``kv_producer`` instance in a spawned process and
a ``kv_consumer`` instance here (or ``kv_both`` on both), each vLLM's real scheduler with
``KVFlowConnector``, the KV moved between their CPU tensors by the gloo data plane."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import multiprocessing as mp

from tests.integrations.vllm_harness import tiny_model_dir
from tests.integrations.vllm_pd_rig import BS, Instance, expected_kv, serve_p

TIMEOUT_S = 120.0
PD = {"pd_transport": "gloo", "pd_timeout_s": 30.0, "pd_lease_s": 30.0, "pd_claim_s": 30.0}


@pytest.mark.parametrize(
    ("p_role", "d_role"), [("kv_producer", "kv_consumer"), ("kv_both", "kv_both")]
)
def test_kv_moves_between_two_processes_byte_exact_over_gloo(p_role: str, d_role: str) -> None:
    """P (another process) prefills the proxy's request; D claims P's KV over the control plane,
    receives it over gloo into its reserved blocks, holds exactly the KV P computed, computes one
    prompt token; afterwards both sides are idle with every block free. The same with kv_both on
    both instances (each P or D by the request's params)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=serve_p,
        args=(child, {**PD, "pd_peer_engine_id": "D"}, str(tiny_model_dir()), p_role),
        daemon=True,
    )
    proc.start()
    d: Instance | None = None
    try:
        assert parent.poll(TIMEOUT_S), "P did not start"
        assert parent.recv() == "ready"
        d = Instance(
            d_role, "D", PD, connector="KVFlowConnector", module="kvflow.integrations.vllm"
        )
        d_free = d.free_blocks()
        prompt = [(i * 53) % 30000 + 10 for i in range(6 * BS + 3)]
        parent.send(("prefill", prompt, "r1"))
        assert parent.poll(TIMEOUT_S), "P did not prefill"
        params = parent.recv()
        assert params["kvflow_data"]
        req = d.add(prompt, params, max_tokens=2, request_id="r1")
        for _ in range(100_000):
            so = d.step()
            if "r1" in so.num_scheduled_tokens:
                break
        assert so.num_scheduled_tokens == {"r1": 1}
        assert d.kv_of(req, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
        assert d.stats().counters["pd_handoffs_committed"] == 1
        for _ in range(100_000):
            if "r1" in d.outputs and d.idle():
                break
            d.step()
        assert d.idle()
        assert d.free_blocks() == d_free
        parent.send("stop")
        assert parent.poll(TIMEOUT_S), "P did not stop"
        assert parent.recv() == (True, True), "P ended with a hand-off or a block held"
    finally:
        if d is not None:
            d.shutdown()
        proc.join(TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
