"""The PD connector on two reference engines in one process (P and D over real zmq control
planes, bytes through the fake transport), in the sequential flow: outputs identical to a
colocated engine, D's prompt work at most one token, aborts on both sides, a failed transfer
recomputes once, KV of another request refused; a leak check after each test."""

from __future__ import annotations

import pytest

from kvflow.backends.pd.fake import FakeLink
from kvflow.engine.request import RequestStatus
from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPTS = prompts([9, 16, 23])  # mid-block, block-aligned, mid-block at block size 4
MAX_TOKENS = 5


def colocated() -> list[tuple[int, ...]]:
    e = engine()
    out = [r.output_token_ids for r in e.run_to_completion(requests(PROMPTS, MAX_TOKENS))]
    e.shutdown()
    return out


def test_sequential_flow_matches_a_colocated_engine_and_d_computes_one_token(pair: Pair) -> None:
    """P prefills with one output token, D gets P's KV and decodes: every output equals the
    colocated engine's token for token; D computes exactly one prompt token per request."""
    results = pair.run(PROMPTS, MAX_TOKENS)
    assert [r.output_token_ids for r in results] == colocated()
    for r, p in zip(results, PROMPTS, strict=True):
        assert r.prefill_tokens_computed == 1
        assert r.external_loaded_tokens == len(p) - 1
    assert pair.dc.stats["handoffs_ok"] == len(PROMPTS)
    assert pair.pc.driver.bytes_moved > 0
    pair.check_no_leaks()


def test_d_s_own_prefix_hit_covers_the_start_and_only_the_rest_comes_from_p(pair: Pair) -> None:
    """A second request with a prompt D has cached claims only the blocks past D's GPU hit."""
    first = pair.run(PROMPTS[:1], MAX_TOKENS)
    again = pair.run(PROMPTS[:1], MAX_TOKENS)
    assert first[0].output_token_ids == again[0].output_token_ids
    assert again[0].gpu_cached_tokens == 8  # two full blocks of 9 tokens
    assert again[0].external_loaded_tokens == 0  # the partial block (token 8 is the last)
    pair.check_no_leaks()


def test_a_lost_transfer_recomputes_once_with_identical_output() -> None:
    """The link drops P's data: D's hand-off fails, its blocks are reported invalid, the
    request recomputes its prompt (never asks P again) and its output is still identical."""
    link = FakeLink(recv_timeout_s=0.2)
    pd = Pair(link)
    try:
        link.drop(1)
        (r,) = pd.run(PROMPTS[:1], MAX_TOKENS)
        assert r.output_token_ids == colocated()[0]
        assert pd.dc.stats["handoffs_failed"] == 1
        assert r.prefill_tokens_computed == len(PROMPTS[0])
        pd.check_no_leaks()
    finally:
        pd.close()


def test_kv_of_another_request_is_refused_by_hash(pair: Pair) -> None:
    """D gets P's params for a different prompt: P refuses the claim (digest mismatch), D
    recomputes and its output is the colocated engine's for D's own prompt."""
    pr = pair.prefill("x", PROMPTS[1])
    assert pr.kv_transfer_params is not None
    r = pair.decode("r0", PROMPTS[0], MAX_TOKENS, pr.kv_transfer_params)
    assert r.output_token_ids == colocated()[0]
    assert r.external_loaded_tokens == 0
    assert pair.dc.stats["handoffs_failed"] == 1
    pair.check_no_leaks()


def test_abort_on_d_while_waiting_for_p_holds_blocks_until_the_hand_off_ends(pair: Pair) -> None:
    """D aborts a request parked on its hand-off: its blocks stay out of the pool until the
    hand-off drained, then both sides free everything."""
    pr = pair.prefill("r0", PROMPTS[2])
    assert pr.kv_transfer_params is not None
    pair.d.add_request(
        PROMPTS[2], MAX_TOKENS, request_id="r0", kv_transfer_params=pr.kv_transfer_params
    )
    pair.d.step()  # admitted: reserved and claimed
    req = pair.d.scheduler.requests["r0"]
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert pair.d.abort_request("r0")
    assert "r0" in pair.d.scheduler.requests  # held while the hand-off drains
    assert not pair.d.abort_request("r0")
    pair.drain()
    pair.check_no_leaks()


def test_abort_on_p_during_the_hand_off_frees_p_and_d_recomputes(pair: Pair) -> None:
    """P's router gives up after P finished: P's held blocks come back once nothing reads them;
    a D request arriving after that recomputes (P's NACK) with the right output."""
    pr = pair.prefill("r0", PROMPTS[0])
    assert pr.kv_transfer_params is not None
    assert not pair.p.abort_request("r0")  # finished already: the hand-off owns the blocks
    pair.pc.driver.apply(pair.pc.driver.manager.abort("t-r0", pair.pc.driver.now()))
    pair.drain()
    pair.d.add_request(
        PROMPTS[0], MAX_TOKENS, request_id="r0", kv_transfer_params=pr.kv_transfer_params
    )
    pair.drain()
    assert pair.d.take_result("r0").output_token_ids == colocated()[0]
    pair.check_no_leaks()


def test_abort_on_p_before_its_prompt_is_computed_holds_nothing(pair: Pair) -> None:
    """A P request aborted while waiting never reaches a hand-off: its blocks go back at once."""
    pair.p.add_request(
        PROMPTS[0],
        1,
        request_id="r0",
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "t-r0"},
    )
    assert pair.p.abort_request("r0")
    pair.drain()
    assert pair.pc.driver.manager.num_live == 0
    pair.check_no_leaks()


def test_a_request_id_used_again_gets_its_own_hand_off(pair: Pair) -> None:
    """A finished request's id, reused by a new request, is served from P again (the one-shot
    miss rule belongs to a request, not to its id)."""
    pair.run(PROMPTS[:1], MAX_TOKENS)
    (again,) = pair.run(PROMPTS[1:2], MAX_TOKENS)  # the same id "r0"
    assert again.external_loaded_tokens == len(PROMPTS[1]) - 1
    assert pair.dc.stats["handoffs_ok"] == 2
    pair.check_no_leaks()


def test_d_s_cpu_tier_covers_the_prefix_and_only_the_rest_comes_from_p() -> None:
    """D with its own CPU tier: D computed a prompt itself (stored to its CPU tier), its GPU
    cache is reset; a longer prompt sharing that start loads the start from D's CPU tier and
    only the rest from P; the output is the colocated engine's, D computes one prompt token,
    nothing leaks on either tier."""
    pd = Pair(d_cpu_tier=True)
    try:
        first = PROMPTS[2]
        pd.d.run_to_completion(requests([first], MAX_TOKENS))  # D's own: stored to its CPU tier
        pd.drain()
        assert pd.d.scheduler.reset_prefix_cache()  # the GPU cache only: D keeps its CPU tier
        longer = first[:20] + PROMPTS[1][:9]
        sent_before = pd.pc.driver.bytes_moved
        (r,) = pd.run([longer], MAX_TOKENS)
        e = engine()
        (want,) = e.run_to_completion(requests([longer], MAX_TOKENS))
        e.shutdown()
        assert r.output_token_ids == want.output_token_ids
        assert r.prefill_tokens_computed == 1
        assert r.external_loaded_tokens == len(longer) - 1
        assert pd.offload is not None
        loaded = pd.offload.scheduler.stats().manager.blocks_loaded
        assert loaded == 5  # tokens 0..19 from D's CPU tier
        per_block = pd.pc.driver.block_bytes[0]
        # Tokens 20..27 (blocks 5 and 6) from P; D recomputes token 28.
        assert pd.pc.driver.bytes_moved - sent_before == 2 * per_block
        pd.check_no_leaks()
    finally:
        pd.close()


def test_params_used_twice_on_d_make_the_second_request_a_miss_not_a_hang(pair: Pair) -> None:
    """Two D requests given the same P params (a router bug): the first is served from P, the
    second's reservation is refused and reported at once as a miss; both outputs are right."""
    pr = pair.prefill("r0", PROMPTS[0])
    params = pr.kv_transfer_params
    assert params is not None
    pair.d.add_request(PROMPTS[0], MAX_TOKENS, request_id="r0", kv_transfer_params=params)
    pair.d.add_request(PROMPTS[0], MAX_TOKENS, request_id="r1", kv_transfer_params=params)
    pair.drain()
    want = colocated()[0]
    a, b = pair.d.take_result("r0"), pair.d.take_result("r1")
    assert a.output_token_ids == b.output_token_ids == want
    assert a.external_loaded_tokens == len(PROMPTS[0]) - 1
    assert b.external_loaded_tokens == 0
    pair.check_no_leaks()
