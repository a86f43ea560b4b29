"""kvflow as vLLM's PD connector: a ``kv_producer`` and a ``kv_consumer`` instance, each vLLM's
real v1 scheduler with ``KVFlowConnector`` and its worker twin over CPU tensors, in the
sequential flow vLLM's example proxy drives (bytes through the fake link; the two-process gloo
test is in ``test_vllm_pd_gloo.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from collections.abc import Iterator

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvflow.backends.pd.fake import FakeLink
from kvflow.errors import ConfigError
from tests.integrations.vllm_pd_rig import (
    BS,
    RELEASE_GUARD_S,
    Instance,
    PDRig,
    expected_kv,
    waiting_for_kv,
)
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPT = [(i * 37) % 30000 + 10 for i in range(4 * BS + 6)]  # 4 full blocks + 6 tokens
NIXL_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "tp_size",
}


@pytest.fixture
def rig() -> Iterator[PDRig]:
    r = PDRig()
    try:
        yield r
    finally:
        r.close()


def test_p_finishes_with_delay_free_and_d_runs_only_the_tail_on_p_s_exact_kv(rig: PDRig) -> None:
    """P's scheduler finishes the proxy's request holding its blocks (delay-free) and returns
    NIXL-named params plus kvflow's; D parks the request in WAITING_FOR_REMOTE_KVS, runs it after
    finished_recving with one token to compute, on exactly P's KV; then P frees its blocks."""
    p_free = rig.p.free_blocks()
    _, params = rig.prefill(PROMPT, "r1")
    assert set(params) >= NIXL_KEYS
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_request_id"]) == ("P", "r1")
    assert params["remote_port"] == rig.p.pd.port
    assert params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == 5
    assert {"kvflow_transfer_id", "kvflow_digest", "kvflow_data"} <= set(params)
    assert "r1" in rig.p.h.scheduler.requests, "P holds the finished request's blocks"
    assert rig.p.free_blocks() < p_free

    req = rig.d.add(PROMPT, params, max_tokens=3, request_id="r1")
    rig.d.step()
    assert waiting_for_kv(req)
    so = rig.until_scheduled("r1")
    assert so.num_scheduled_tokens == {"r1": 1}, "only the last prompt token is computed"
    assert rig.d.kv_of(req, len(PROMPT) - 1) == expected_kv(PROMPT, len(PROMPT) - 1)
    rig.run(lambda: "r1" in rig.d.outputs)
    assert rig.d.computed["r1"] == 1
    assert rig.d.pd.pd.stats["handoffs_ok"] == 1
    rig.settle()
    assert rig.p.free_blocks() == p_free
    assert "r1" not in rig.p.h.scheduler.requests


@pytest.mark.parametrize("extra", [6, BS - 1], ids=["mid_block", "token_fills_the_block"])
def test_a_proxy_that_sends_d_p_s_token_gets_all_of_p_s_kv_and_one_token_computed(
    rig: PDRig, extra: int
) -> None:
    """P's params name its prompt length (``kvflow_num_tokens``); D's prompt is P's plus P's
    sampled token: D loads every token of P's prompt (the last block partial, or filled by that
    token) and computes only P's token."""
    prompt = PROMPT[: 4 * BS + extra]
    p_free = rig.p.free_blocks()
    p_req, params = rig.prefill(prompt, "r1")
    assert params["kvflow_num_tokens"] == len(prompt)
    tok = p_req.output_token_ids[0]
    req = rig.d.add([*prompt, tok], params, max_tokens=2, request_id="r1")
    so = rig.until_scheduled("r1")
    assert so.num_scheduled_tokens == {"r1": 1}, "only P's token is computed"
    assert rig.d.kv_of(req, len(prompt)) == expected_kv(prompt, len(prompt))
    rig.run(lambda: "r1" in rig.d.outputs)
    assert rig.d.computed["r1"] == 1
    assert rig.d.pd.pd.stats["handoffs_ok"] == 1
    rig.settle()
    assert rig.p.free_blocks() == p_free


def test_abort_on_d_while_waiting_holds_its_blocks_until_the_hand_off_drained(
    rig: PDRig,
) -> None:
    """D aborts a request parked on its hand-off: vLLM keeps its blocks until kvflow says the
    hand-off drained (finished_sending), then both sides free everything."""
    d_free = rig.d.free_blocks()
    _, params = rig.prefill(PROMPT, "r1")
    req = rig.d.add(PROMPT, params, request_id="r1")
    rig.d.step()  # admitted: reserved and claimed
    assert waiting_for_kv(req)
    rig.d.h.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert "r1" in rig.d.h.scheduler.requests, "held while the hand-off drains"
    assert rig.d.free_blocks() < d_free
    rig.settle()
    assert rig.d.free_blocks() == d_free
    assert not rig.p.h.scheduler.requests


def test_d_rejecting_before_admission_releases_p_at_once(rig: PDRig) -> None:
    """A request D finishes before admitting it (aborted while waiting) releases P's hold at
    once, long before P's unclaimed lease would."""
    _, params = rig.prefill(PROMPT, "r1")
    rig.d.add(PROMPT, params, request_id="r1")
    rig.d.h.scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert rig.d.pd.pd.stats["released_unadmitted"] == 1
    rig.run(lambda: "r1" not in rig.p.h.scheduler.requests, max_steps=20, guard_s=RELEASE_GUARD_S)
    rig.settle()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_receive_becomes_invalid_blocks_and_vllm_applies_its_policy(policy: str) -> None:
    """The link loses P's data: D's hand-off fails and its blocks are reported invalid; with
    kv_load_failure_policy=recompute vLLM recomputes the whole prompt (never asks P again), with
    fail it ends the request with an error; nothing leaks on either side."""
    link = FakeLink(recv_timeout_s=0.2)
    rig = PDRig(link, policy=policy)
    try:
        _, params = rig.prefill(PROMPT, "r1")
        link.drop(1)
        rig.d.add(PROMPT, params, max_tokens=2, request_id="r1")
        rig.run(lambda: "r1" in rig.d.outputs, max_steps=10_000)
        assert rig.d.pd.pd.stats["handoffs_failed"] == 1
        if policy == "recompute":
            assert rig.d.outputs["r1"].finish_reason == FinishReason.LENGTH
            assert rig.d.computed["r1"] == len(PROMPT)
        else:
            assert rig.d.outputs["r1"].finish_reason == FinishReason.ERROR
        rig.settle(max_steps=10_000)
    finally:
        rig.close()


def test_a_full_local_prefix_hit_still_releases_p(rig: PDRig) -> None:
    """D already holds all but the last token of the prompt on its GPU: it pulls nothing, still
    tells P at once, and computes one token."""
    prompt = PROMPT[: 4 * BS + 1]
    local = rig.d.add(prompt, None, max_tokens=1, request_id="warm")
    rig.run(lambda: "warm" in rig.d.outputs)
    assert local.num_computed_tokens >= len(prompt)
    assert rig.serve_without_pulling(prompt) == 1
    rig.settle()


def test_d_s_cpu_tier_covers_the_prefix_and_p_sends_only_the_rest(rig: PDRig) -> None:
    """D's CPU tier holds the first 4 blocks (its GPU cache was reset): D loads those from its
    CPU tier and claims only the rest from P, in one connector; the KV is byte-exact."""
    rig.d.add(PROMPT[: 4 * BS], None, max_tokens=1, request_id="warm")
    rig.run(lambda: "warm" in rig.d.outputs)
    rig.settle()
    assert rig.d.connector._scheduler.manager.stats().blocks_stored == 4  # type: ignore[union-attr]
    assert rig.d.h.scheduler.kv_cache_manager.reset_prefix_cache()
    for t in rig.d.caches.values():
        t.fill_(-1.0)
    prompt = PROMPT + [11, 12, 13, 14] * 6  # 94 tokens: 2 more blocks past the cached 4
    _, params = rig.prefill(prompt, "r1")
    req = rig.d.add(prompt, params, max_tokens=2, request_id="r1")
    rig.d.step()
    assert waiting_for_kv(req)
    start = rig.d.pd.pd.driver.manager.transfers[params["kvflow_transfer_id"]].start
    assert start == (4,), "the claim starts past D's CPU-tier hit"
    so = rig.until_scheduled("r1")
    assert so.num_scheduled_tokens == {"r1": 1}
    assert rig.d.kv_of(req, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
    rig.run(lambda: "r1" in rig.d.outputs)
    rig.settle()


def test_below_the_recompute_threshold_d_prefills_itself_and_releases_p() -> None:
    """pd_recompute_below_tokens larger than the pull: D computes the prompt and P is released
    at once."""
    rig = PDRig(d_extra={"pd_recompute_below_tokens": 1000})
    try:
        assert rig.serve_without_pulling(PROMPT) == len(PROMPT)
        assert rig.d.pd.pd.stats["recomputed_locally"] == 1
        rig.settle()
    finally:
        rig.close()


def test_params_of_another_prompt_are_a_local_prefill_not_a_load_failure(rig: PDRig) -> None:
    """The proxy pairs P's params with a different prompt: D sees the digest differ, prefills
    itself (a miss, not a load failure) and releases P."""
    other = [t + 1 for t in PROMPT]
    assert rig.serve_without_pulling(PROMPT, other) == len(other)
    rig.settle()


@pytest.mark.parametrize(
    ("role", "extra", "message"),
    [
        ("kv_consumer", {"pd_lease_s": 0}, "pd_lease_s"),
        ("kv_consumer", {"pd_transport": "carrier-pigeon"}, "pd_transport"),
        ("kv_consumer", {"pd_side_channel_port": 70000}, "pd_side_channel_port"),
        ("kv_consumer", {"pd_recompute_below_tokens": -1}, "pd_recompute_below_tokens"),
        ("kv_consumer", {"pd_claim": 1}, "pd_claim"),
    ],
)
def test_pd_options_are_checked_at_start_up(
    role: str, extra: dict[str, object], message: str
) -> None:
    """An unknown or bad PD option stops start-up with a ConfigError naming it."""
    with pytest.raises(ConfigError, match=message):
        Instance(role, "X", extra)


def test_producer_requires_kv_delivery_and_consumer_does_not(rig: PDRig) -> None:
    """vLLM recomputes a preempted P request whose hand-off is pending (requires_kv_delivery),
    never a D or a CPU-tier-only instance's."""
    assert rig.p.h.scheduler.requires_kv_delivery is True
    assert rig.d.h.scheduler.requires_kv_delivery is False


def test_several_hand_offs_at_once_each_get_their_own_request_s_kv(rig: PDRig) -> None:
    """Three prompts prefilled on P, then sent to D together: three hand-offs live at once, each
    request runs on exactly its own prompt's KV, and both sides end with nothing held."""
    prompts = [[(i * k) % 30000 + 10 for i in range(3 * BS + k)] for k in (3, 5, 7)]
    params = [rig.prefill(p, f"r{k}")[1] for k, p in enumerate(prompts)]
    reqs = [
        rig.d.add(p, ps, max_tokens=2, request_id=f"r{k}")
        for k, (p, ps) in enumerate(zip(prompts, params, strict=True))
    ]
    rig.d.step()
    assert all(waiting_for_kv(r) for r in reqs)
    # The hand-offs' completions come over real sockets, so they may land in different D steps;
    # each request is checked in the step D first schedules it, before its blocks can be freed.
    first: dict[str, int] = {}
    for _ in range(200):
        rig.p.step()
        so = rig.d.step()
        for k, (req, prompt) in enumerate(zip(reqs, prompts, strict=True)):
            rid = f"r{k}"
            if rid in so.num_scheduled_tokens and rid not in first:
                first[rid] = so.num_scheduled_tokens[rid]
                assert rig.d.kv_of(req, len(prompt) - 1) == expected_kv(prompt, len(prompt) - 1)
        if len(first) == 3:
            break
    assert first == {"r0": 1, "r1": 1, "r2": 1}, "each computes only its last prompt token"
    rig.run(lambda: all(f"r{k}" in rig.d.outputs for k in range(3)))
    assert rig.d.pd.pd.stats["handoffs_ok"] == 3
    rig.settle()
