"""One P, two D instances, and vLLM's stock proxy: P is told nothing about D, so each hand-off
begins unbound and the first D to claim it gets it, over the data-plane pair of that D. Each
instance is vLLM's real v1 scheduler with ``KVFlowConnector`` and its worker twin over CPU
tensors, the bytes through one fake link per P–D pair."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from collections.abc import MutableMapping
from typing import Any

from structlog.testing import capture_logs

from tests.integrations.vllm_pd_rig import BS, Fleet
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

pytestmark = pytest.mark.usefixtures("no_leaks")

PROMPT = [(i * 37) % 30000 + 10 for i in range(4 * BS + 6)]  # 4 full blocks + 6 tokens
OTHER = [(i * 41) % 30000 + 17 for i in range(3 * BS + 9)]  # 3 full blocks + 9 tokens
THIRD = [(i * 43) % 30000 + 23 for i in range(2 * BS + 3)]  # 2 full blocks + 3 tokens


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    """The captured log entries of one event."""
    return [e for e in logs if e["event"] == name]


def test_one_p_binds_each_hand_off_to_the_d_that_claims_it() -> None:
    """No D named anywhere: D1's and then D2's request are each claimed by that D, bound to it
    (pd_peer_bound) and moved byte-exact over a pair of its own; P's blocks all come back."""
    fleet = Fleet({"P": ""}, {"D1": "", "D2": ""})
    try:
        p = fleet.instances["P"]
        free = p.free_blocks()
        with capture_logs() as logs:
            a = fleet.prefill("P", PROMPT, "a", d=None)
            fleet.decode("D1", PROMPT, a, "a")
            b = fleet.prefill("P", OTHER, "b", d=None)
            fleet.decode("D2", OTHER, b, "b")
            c = fleet.prefill("P", THIRD, "c", d=None)
            fleet.decode("D1", THIRD, c, "c")
            fleet.settle()
        assert "pd_unbound" in [e["event"] for e in logs]
        bound = {e["transfer_id"]: e["peer"] for e in events(logs, "pd_peer_bound")}
        assert bound == {
            a["kvflow_transfer_id"]: "D1",
            b["kvflow_transfer_id"]: "D2",
            c["kvflow_transfer_id"]: "D1",
        }
        # a's params offered the worker's own endpoint to a new D; b's name D1's pair and a new
        # endpoint, which D2 took; c's name both pairs.
        assert a["kvflow_data_for"] == {}
        assert b["kvflow_data_for"] == {"D1": a["kvflow_data"]}
        assert b["kvflow_data"] != a["kvflow_data"]
        assert c["kvflow_data_for"] == {"D1": a["kvflow_data"], "D2": b["kvflow_data"]}
        assert len(fleet.links) == 2, "one pair per D"
        assert p.free_blocks() == free
        counters = p.stats().counters
        assert counters["pd_handoffs_committed"] == 3
        assert not events(logs, "pd_bind_refused")
        assert not events(logs, "pd_send_failed"), "nothing was sent to an unbound peer"
    finally:
        fleet.close()


def test_two_new_ds_racing_for_the_first_pair_one_recomputes() -> None:
    """Both Ds get params before either claims, so both pick the one spare endpoint: the first
    claim binds and moves its KV, the second is refused (pd_bind_refused) and its D computes
    the prompt itself; nothing leaks, and D2's next request binds over a pair of its own."""
    fleet = Fleet({"P": ""}, {"D1": "", "D2": ""})
    try:
        p = fleet.instances["P"]
        free = p.free_blocks()
        with capture_logs() as logs:
            a = fleet.prefill("P", PROMPT, "a", d=None)
            b = fleet.prefill("P", OTHER, "b", d=None)
            assert a["kvflow_data"] == b["kvflow_data"]
            fleet.decode("D1", PROMPT, a, "a")
            d2 = fleet.instances["D2"]
            d2.add(OTHER, b, max_tokens=2, request_id="b")
            fleet.run(lambda: "b" in d2.outputs)
            assert d2.computed["b"] == len(OTHER), "refused: D2 computed the whole prompt"
            c = fleet.prefill("P", THIRD, "c", d=None)
            assert c["kvflow_data"] != a["kvflow_data"]
            fleet.decode("D2", THIRD, c, "c")
            fleet.settle()
        refused = events(logs, "pd_bind_refused")
        assert [(e["transfer_id"], e["peer"]) for e in refused] == [(b["kvflow_transfer_id"], "D2")]
        released = [e["transfer_id"] for e in events(logs, "pd_unbound_released")]
        assert released == [b["kvflow_transfer_id"]], "P let b go at once, not at the lease"
        bound = {e["transfer_id"]: e["peer"] for e in events(logs, "pd_peer_bound")}
        assert bound == {a["kvflow_transfer_id"]: "D1", c["kvflow_transfer_id"]: "D2"}
        assert len(fleet.links) == 2
        assert p.free_blocks() == free
        assert not events(logs, "pd_send_failed"), "nothing was sent to an unbound peer"
    finally:
        fleet.close()


def test_a_d_request_with_a_named_peer_and_an_unbound_one_share_the_pair() -> None:
    """P configured with no D; one request names D1 (remote_engine_id), the next names none:
    D1 claims both, over the one pair P named for it in the first request's params."""
    fleet = Fleet({"P": ""}, {"D1": ""})
    try:
        a = fleet.prefill("P", PROMPT, "a", d="D1")
        fleet.decode("D1", PROMPT, a, "a")
        b = fleet.prefill("P", OTHER, "b", d=None)
        assert b["kvflow_data_for"] == {"D1": a["kvflow_data"]}
        fleet.decode("D1", OTHER, b, "b")
        fleet.settle()
        assert len(fleet.links) == 1
        assert fleet.instances["P"].stats().counters["pd_handoffs_committed"] == 2
    finally:
        fleet.close()


def test_one_new_d_with_two_requests_in_flight_binds_both_to_one_pair() -> None:
    """A new D gets two unbound requests' params before claiming either (both name the same
    spare endpoint): its first claim takes the spare, the second finds D paired there already;
    both move byte-exact over the one pair."""
    fleet = Fleet({"P": ""}, {"D1": "", "D2": ""})
    try:
        with capture_logs() as logs:
            a = fleet.prefill("P", PROMPT, "a", d=None)
            b = fleet.prefill("P", OTHER, "b", d=None)
            assert a["kvflow_data"] == b["kvflow_data"]
            fleet.decode("D1", PROMPT, a, "a")
            fleet.decode("D1", OTHER, b, "b")
            fleet.settle()
        assert not events(logs, "pd_bind_refused")
        assert len(fleet.links) == 1
        assert fleet.instances["P"].stats().counters["pd_handoffs_committed"] == 2
    finally:
        fleet.close()
