"""The PD router over two spawned engine processes (CPU, gloo data plane, zmq control plane):
the sequential flow's outputs equal a colocated engine's token for token, D computes one prompt
token per request, and both engines end with every block back and no hand-off live."""

from __future__ import annotations

from typing import Any

import pytest
from tests.engine.helpers import make_engine, prompts, requests

from kvflow.core.pd.common import PDTimeouts
from kvflow.pd.router import PDRouter

ENGINE: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 96}
PROMPTS = prompts([10, 17, 24])
MAX_TOKENS = 4


def test_sequential_flow_over_two_processes_matches_a_colocated_engine() -> None:
    """P then D in their own processes: identical outputs, ≤ 1 prompt token computed on D per
    request, bytes moved over gloo, nothing leaked on either side."""
    colocated = make_engine(**ENGINE)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))
    ]
    with PDRouter(engine=ENGINE, timeout_s=60) as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
    assert [g.result.output_token_ids for g in got] == expected
    assert all(g.result.prefill_tokens_computed <= 1 for g in got)
    assert all(
        g.prefill is not None and g.prefill.output_token_ids == e[:1]
        for g, e in zip(got, expected, strict=True)
    )
    p, d = router.summaries["P"], router.summaries["D"]
    assert p["leaked_blocks"] == d["leaked_blocks"] == 0
    assert p["live_handoffs"] == d["live_handoffs"] == 0
    assert p["bytes_moved"] > 0
    assert d["handoffs_ok"] == len(PROMPTS)


@pytest.mark.parametrize(
    "engine",
    [ENGINE, {**ENGINE, "max_num_batched_tokens": 8}],
    ids=["one_step_prefill", "chunked_prefill_streams"],
)
def test_concurrent_flow_over_two_processes_matches_a_colocated_engine(
    engine: dict[str, Any],
) -> None:
    """P and D get the request at once (D reserves and claims while P prefills; with chunked
    prefill P pushes each step's chunk as it is fenced): identical outputs, nothing leaked; a
    claim that reached P before P admitted the request is a one-shot miss that D recomputes, so
    D's prompt work is bounded by the prompt, never wrong."""
    colocated = make_engine(**engine)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))
    ]
    with PDRouter(engine=engine, flow="concurrent", timeout_s=60) as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
    assert [g.result.output_token_ids for g in got] == expected
    p, d = router.summaries["P"], router.summaries["D"]
    assert p["leaked_blocks"] == d["leaked_blocks"] == 0
    assert p["live_handoffs"] == d["live_handoffs"] == 0
    assert d["handoffs_ok"] + d["handoffs_failed"] == len(PROMPTS)
    for g in got:
        if g.result.external_loaded_tokens:
            assert g.result.prefill_tokens_computed == 1


def test_p_killed_while_holding_the_kv_leaves_d_serving_by_recompute() -> None:
    """SIGKILL of P after its prefill, before D claims: D's claim goes unanswered, D declares
    P dead, keeps the claimed blocks out of its pool for the quarantine, then recomputes; the
    output is the colocated engine's and D ends with every block back."""
    colocated = make_engine(**ENGINE)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS[:2], MAX_TOKENS))
    ]
    fast = PDTimeouts(claim_s=1, grant_window_s=0.5, copy_s=0.5, heartbeat_s=0.2,
                      peer_timeout_s=1, drain_retry_s=0.2)  # fmt: skip
    first, second = requests(PROMPTS[:2], MAX_TOKENS)
    with PDRouter(engine=ENGINE, timeout_s=60, pd_timeouts=fast) as router:
        (ok,) = router.run([first])  # HELLO cached, one hand-off committed
        held = router.prefill(second)
        router.kill("P")
        got = router.decode(second, held.kv_transfer_params)
    assert ok.result.output_token_ids == expected[0]
    assert got.result.output_token_ids == expected[1]
    assert got.result.prefill_tokens_computed == len(PROMPTS[1])
    d = router.summaries["D"]
    assert d["leaked_blocks"] == 0
    assert d["live_handoffs"] == 0
    assert d["handoffs_failed"] == 1


def test_d_killed_before_it_claims_leaves_p_serving_and_frees_p_s_hold() -> None:
    """SIGKILL of D after P's prefill: nobody claims P's held KV, its lease expires and the
    blocks come back; P goes on serving new requests and ends with nothing leaked."""
    fast = PDTimeouts(lease_s=0.5, heartbeat_s=0.2, peer_timeout_s=1)
    first, second = requests(PROMPTS[:2], MAX_TOKENS)
    with PDRouter(engine=ENGINE, timeout_s=60, pd_timeouts=fast) as router:
        held = router.prefill(first)
        router.kill("D")
        again = router.prefill(second)
    assert held.kv_transfer_params is not None
    assert (
        again.output_token_ids
        == make_engine(**ENGINE).run_to_completion(requests(PROMPTS[1:2], 1))[0].output_token_ids
    )
    p = router.summaries["P"]
    assert p["leaked_blocks"] == 0
    assert p["live_handoffs"] == 0
    assert router.summaries["D"] == {}  # killed: no summary
