"""The PD router over two spawned engine processes (CPU, gloo data plane, zmq control plane):
both flows' outputs equal a colocated engine's token for token with poison-on-free in every
engine, D computes one prompt token per request, SIGKILL of either process (holding KV, or in the
middle of a running copy) leaves the other serving, and both engines end with every block back,
no hand-off live and no thread left; a live hand-off always has its timer armed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from tests.engine.helpers import make_engine, prompts, requests

from kvflow.core.pd.common import PDTimeouts
from kvflow.engine.engine import GenerationRequest, RequestResult
from kvflow.engine.model import model_config
from kvflow.errors import ConfigError
from kvflow.pd.router import PDRouter
from kvflow.runtime.clock import SystemClock

# Poison-on-free in both engine processes (and the colocated one): a use after free on either
# side of the gloo copy would change a token.
ENGINE: dict[str, Any] = {"block_size": 4, "num_gpu_blocks": 96, "poison_freed_blocks": True}
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
    _assert_clean(router)


def test_p_s_first_token_rides_along_to_d_over_two_processes() -> None:
    """``first_token="prefill"``: the first token is P's, D's prompt is P's plus it, D loads
    all of P's prompt and computes one token; outputs equal a colocated engine's, the TTFT runs
    from the request's arrival at P to P's token, a one-token answer needs no hand-off, nothing
    leaks."""
    colocated = make_engine(**ENGINE)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))
    ]
    one = [GenerationRequest(PROMPTS[0], 1, request_id="single")]
    with PDRouter(engine=ENGINE, timeout_s=60, first_token="prefill") as router:
        got = router.run(requests(PROMPTS, MAX_TOKENS))
        (single,) = router.run(one)
    assert [g.result.output_token_ids for g in got] == expected
    for g, p in zip(got, PROMPTS, strict=True):
        assert g.prefill is not None
        assert g.prefill.output_token_ids == g.result.output_token_ids[:1]
        assert g.result.prefill_tokens_computed == 1
        assert g.result.external_loaded_tokens == len(p)
        assert g.result.prompt_len == len(p)
        assert len(g.token_times) == MAX_TOKENS  # P's token's time first, then D's
        assert g.ttft_s > 0
        assert g.delivered_s >= 0  # the router's send → P's arrival, outside the TTFT
        assert g.token_times[1] > g.token_times[0]
    assert single.result.output_token_ids == expected[0][:1]
    assert len(single.token_times) == 1
    p_side, d_side = router.summaries["P"], router.summaries["D"]
    assert d_side["handoffs_ok"] == len(PROMPTS)  # none for the one-token answer
    assert p_side["leaked_blocks"] == d_side["leaked_blocks"] == 0
    assert p_side["live_handoffs"] == d_side["live_handoffs"] == 0
    _assert_clean(router)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"first_token": "d"}, "PD first token 'd'"),
        ({"first_token": "prefill", "flow": "concurrent"}, "needs the sequential flow"),
    ],
)
def test_a_first_token_option_that_cannot_work_is_refused_before_any_process(
    kwargs: dict[str, Any], says: str
) -> None:
    """An unknown first-token option, or P's token in the concurrent flow (D has the request
    before P sampled anything), is a ConfigError at construction."""
    with pytest.raises(ConfigError, match=says):
        PDRouter(engine=ENGINE, **kwargs)


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
    _assert_clean(router)


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
    _assert_clean(router)


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
    _assert_p_served_on_alone(router, again)


def _assert_clean(router: PDRouter) -> None:
    """The leak check after a PD process test, of every engine that stopped (a killed one has
    no summary): both pools whole, no hand-off live, no timer unarmed, no thread left."""
    stopped = {name: s for name, s in router.summaries.items() if s}
    assert stopped
    for name, s in stopped.items():
        assert s["leaked_blocks"] == 0, name
        assert s["live_handoffs"] == 0, name
        assert s["unarmed_timers"] == [], name
        assert s["threads_left"] == [], name


def _assert_p_served_on_alone(router: PDRouter, again: RequestResult) -> None:
    """P's prefill after D's death is a colocated engine's, and P ended with nothing leaked."""
    alone = make_engine(**ENGINE).run_to_completion(requests(PROMPTS[1:2], 1))[0]
    assert again.output_token_ids == alone.output_token_ids
    p = router.summaries["P"]
    assert p["leaked_blocks"] == 0
    assert p["live_handoffs"] == 0
    assert router.summaries["D"] == {}  # killed: no summary
    _assert_clean(router)


def _one_block_per_chunk() -> dict[str, Any]:
    """Transport options that make a copy last: one block per staging chunk, the sender pausing
    0.3 s before each chunk but the first."""
    cfg = model_config("tiny")
    block = 2 * cfg.num_layers * ENGINE["block_size"] * cfg.num_kv_heads * cfg.head_dim * 4
    return {"slot_bytes": block, "direct_min_bytes": None, "send_pause_s": 0.3}


def _await_launch(router: PDRouter, before: int) -> None:
    """Until P has launched the sends of the hand-off D just claimed (bounded)."""
    clock = SystemClock()
    deadline = clock.now() + 30
    while router.stats("P")["bytes_moved"] == before:  # each ask is a round trip to P
        assert clock.now() < deadline, "P never launched its sends"
    # Mid-copy, each side's live hand-off (IN_FLIGHT) has its deadline armed.
    for name in ("P", "D"):
        assert router.stats(name)["unarmed_timers"] == [], name


def test_p_killed_during_a_running_copy_leaves_d_serving_by_recompute() -> None:
    """SIGKILL of P while its gloo sends run (one block landed, the rest paused): D's receives
    fail at once (the pair broke, nothing waits without a deadline), D holds the claimed
    blocks until P is declared dead and the quarantine passed, then recomputes; the output is
    the colocated engine's, D serves a later request alone and ends with every block back."""
    check_p_killed_mid_copy(lambda router: router.kill("P"))


def check_p_killed_mid_copy(kill: Callable[[PDRouter], None], **router_kw: Any) -> None:
    """One slow hand-off committed, then ``kill`` in the middle of the next one's copy: D
    recomputes that request with the colocated output, serves a third alone, leaks nothing."""
    colocated = make_engine(**ENGINE)
    expected = [
        r.output_token_ids for r in colocated.run_to_completion(requests(PROMPTS, MAX_TOKENS))
    ]
    fast = PDTimeouts(claim_s=2, grant_window_s=1, copy_s=3, heartbeat_s=0.2,
                      peer_timeout_s=1, drain_retry_s=0.2)  # fmt: skip
    first, second, third = requests(PROMPTS, MAX_TOKENS)
    with PDRouter(
        engine=ENGINE,
        timeout_s=60,
        pd_timeouts=fast,
        transport_options=_one_block_per_chunk(),
        **router_kw,
    ) as router:
        (ok,) = router.run([first])  # HELLO cached, one (slow) hand-off committed
        held = router.prefill(second)
        before = router.stats("P")["bytes_moved"]
        rid = router.start_decode(second, held.kv_transfer_params)
        _await_launch(router, before)
        kill(router)
        got = router.finish_decode(rid)
        alone = router.decode(third, None)
    assert ok.result.output_token_ids == expected[0]
    assert got.result.output_token_ids == expected[1]
    assert got.result.prefill_tokens_computed == len(PROMPTS[1])
    assert alone.result.output_token_ids == expected[2]
    d = router.summaries["D"]
    assert d["leaked_blocks"] == 0
    assert d["live_handoffs"] == 0
    assert (d["handoffs_ok"], d["handoffs_failed"]) == (1, 1)
    _assert_clean(router)


def test_d_killed_during_a_running_copy_leaves_p_serving_and_frees_its_hold() -> None:
    """SIGKILL of D while P's gloo sends run: P's sends fail (the pair broke), P's hand-off
    drains on its own fence and its blocks come back; P goes on serving new requests and ends
    with nothing leaked."""
    fast = PDTimeouts(lease_s=1, claim_s=2, grant_window_s=1, copy_s=3, heartbeat_s=0.2,
                      peer_timeout_s=1, drain_retry_s=0.2)  # fmt: skip
    first, second, _ = requests(PROMPTS, MAX_TOKENS)
    with PDRouter(
        engine=ENGINE, timeout_s=60, pd_timeouts=fast, transport_options=_one_block_per_chunk()
    ) as router:
        held = router.prefill(first)
        before = router.stats("P")["bytes_moved"]
        router.start_decode(first, held.kv_transfer_params)
        _await_launch(router, before)
        router.kill("D")
        again = router.prefill(second)
    _assert_p_served_on_alone(router, again)
