"""The concurrent flow in process with the reference engine's chunked prefill: P pushes each
prefill chunk as soon as the step that computed it returned (not one push at the end), D
commits only once every chunk landed; outputs are the colocated engine's token for token and D
computes one prompt token. Aborts mid-way on either side hold the blocks until the hand-off
drained. A leak check after each test."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from kvflow.core.pd.common import Action, LaunchCopies
from kvflow.core.pd.machines import DState, PState
from kvflow.core.pd.producer import PTransfer
from kvflow.runtime.clock import SystemClock
from tests.connector.pd_pair import Pair, engine
from tests.engine.helpers import prompts, requests
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPTS = prompts([23, 40, 33])
MAX_TOKENS = 5
CHUNKED: dict[str, Any] = {"max_num_batched_tokens": 8}  # a 40-token prompt takes 5 steps


def colocated() -> list[tuple[int, ...]]:
    e = engine(**CHUNKED)
    out = [r.output_token_ids for r in e.run_to_completion(requests(PROMPTS, MAX_TOKENS))]
    e.shutdown()
    return out


def step_until(
    pd: Pair, transfers: Mapping[str, Any], tid: str, done: Callable[[Any], bool]
) -> None:
    """Step both engines until hand-off ``tid`` (in ``transfers``) satisfies ``done``."""
    for _ in range(2_000):
        pd.step()
        t = transfers.get(tid)
        if t is not None and done(t):
            return
    raise AssertionError(f"hand-off {tid} never reached the state wanted")


def claims_before_prefill(pd: Pair, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Start the concurrent flow for each prompt and step D alone, P only polling its driver,
    until P holds every hand-off's claim: the claims then arrive before P's prefill starts
    (zmq delivers them on its own thread, so stepping both engines at once races it)."""
    tids = [pd.start_concurrent(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    transfers = pd.pc.driver.manager.transfers

    def claimed() -> bool:
        for tid in tids:
            t = transfers.get(tid)
            if not isinstance(t, PTransfer) or (t.claim is None and t.pending_claim is None):
                return False
        return True

    guard = SystemClock()
    deadline = guard.now() + 20.0
    while not claimed():
        assert guard.now() < deadline, "P never held every claim"
        pd.d.step()
        pd.pc.driver.poll()
        if not claimed():
            pd.pc.driver.wait(0.002)
    return tids


class Launches:
    """Records P's sends: (transfer id, blocks) per launch."""

    def __init__(self, pd: Pair) -> None:
        self.sends: list[tuple[str, int]] = []
        apply = pd.pc.driver.apply

        def recording(actions: list[Action]) -> None:
            for a in actions:
                if isinstance(a, LaunchCopies) and a.send:
                    self.sends.append((a.transfer_id, sum(len(g) for g in a.pairs)))
            apply(actions)

        pd.pc.driver.apply = recording  # type: ignore[method-assign]


def test_chunks_stream_while_p_prefills_and_outputs_match_a_colocated_engine() -> None:
    """Chunked prefill on P (8 tokens a step): every hand-off is pushed in several chunks, the
    first before P's prefill ended; D's outputs are the colocated engine's, one prompt token
    computed each, nothing leaked."""
    pd = Pair(**CHUNKED)
    try:
        launches = Launches(pd)
        claims_before_prefill(pd, PROMPTS, MAX_TOKENS)
        pd.drain()
        for i in range(len(PROMPTS)):
            pd.p.take_result(f"r{i}")
        results = [pd.d.take_result(f"r{i}") for i in range(len(PROMPTS))]
        assert [r.output_token_ids for r in results] == colocated()
        for r, p in zip(results, PROMPTS, strict=True):
            assert r.prefill_tokens_computed == 1
            assert r.external_loaded_tokens == len(p) - 1
        per_handoff: dict[str, list[int]] = {}
        for tid, n in launches.sends:
            per_handoff.setdefault(tid, []).append(n)
        assert len(per_handoff) == len(PROMPTS)
        for tid, sizes in per_handoff.items():
            # The claim is in before P's prefill: one push per step (two blocks) as chunks
            # are fenced, and the rest at kv_ready.
            assert len(sizes) >= 2, (tid, sizes)
        # D claims the blocks of tokens 0 .. prompt - 2: 6, 10 and 8 blocks.
        claimed = {sum(v): v for v in per_handoff.values()}
        assert sorted(claimed) == [6, 8, 10]
        assert len(claimed[10]) >= 3, per_handoff  # the 40-token prompt: 5 prefill steps
        pd.check_no_leaks()
    finally:
        pd.close()


def test_d_abort_mid_stream_holds_d_s_blocks_until_the_hand_off_drained() -> None:
    """D's engine aborts the request after the first chunk was pushed: the request's blocks
    stay out of D's pool until P acknowledged and every chunk settled; P serves on."""
    pd = Pair(**CHUNKED)
    try:
        # The claim first: a claim that lands after P's prefill finished streams nothing.
        (tid,) = claims_before_prefill(pd, [PROMPTS[1]], MAX_TOKENS)
        step_until(pd, pd.dc.driver.manager.transfers, tid, lambda t: t.state is DState.IN_FLIGHT)
        free_before = pd.d.blocks.num_free_blocks()
        assert pd.d.abort_request("r0")
        assert pd.d.blocks.num_free_blocks() == free_before  # held for the drain
        pd.drain()
        pd.p.take_result("r0")
        pd.check_no_leaks()
    finally:
        pd.close()


def test_p_abort_mid_stream_drains_and_d_recomputes_with_identical_output() -> None:
    """P's engine aborts the request while its hand-off streams: P keeps the blocks until the
    pushes settled, D's hand-off fails and D computes the prompt itself, same output."""
    pd = Pair(**CHUNKED)
    try:
        # The claim first: a claim that lands after P's prefill finished streams nothing.
        (tid,) = claims_before_prefill(pd, [PROMPTS[1]], MAX_TOKENS)
        transfers = pd.pc.driver.manager.transfers
        step_until(pd, transfers, tid, lambda t: t.state is PState.STREAMING and bool(t.chunks))
        assert pd.p.abort_request("r0")
        pd.drain()
        r = pd.d.take_result("r0")
        assert r.output_token_ids == colocated()[1]
        assert r.external_loaded_tokens == 0
        assert r.prefill_tokens_computed == len(PROMPTS[1])  # a one-shot miss: D computed it
        assert pd.dc.stats["handoffs_failed"] == 1
        pd.check_no_leaks()
    finally:
        pd.close()
