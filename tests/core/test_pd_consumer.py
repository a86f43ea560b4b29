"""Tests of the consumer (D) manager: reservations, claims, drains, timers, TP, hash checks."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from kvflow.core.pd.common import (
    Action,
    CancelCopies,
    FinishedRecving,
    FreeBlocks,
    LaunchCopies,
    PDTimeouts,
    Send,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.machines import DState
from kvflow.core.pd.messages import (
    Abort,
    AbortAck,
    Claim,
    Done,
    DoneStatus,
    Grant,
    Heartbeat,
    Nack,
    NackReason,
    Release,
    hashes_digest,
)
from kvflow.errors import ConfigError, ProtocolError
from tests.core.pd_world import of, prompt_hashes, sends

T = PDTimeouts(claim_s=3, grant_window_s=2, copy_s=4, drain_retry_s=1, peer_timeout_s=5)
IDS = ((0, 1),)
HASHES = prompt_hashes(1, 3)
GRANT = Grant("t", 1, ((11, 12),), HASHES, 2.0, 7)
OK = Done("t", 1, DoneStatus.OK)


def claiming(world_size: int = 1, **kw: Any) -> tuple[ConsumerManager, list[Action]]:
    d = ConsumerManager("D", world_size=world_size, timeouts=T, **kw)
    out = d.reserve("t", 1, "P", IDS, (1,), 12, HASHES, 0.0)
    return d, out


def in_flight(world_size: int = 1) -> ConsumerManager:
    d, _ = claiming(world_size)
    d.on_message("P", GRANT, 0.1)
    assert d.transfers["t"].state is DState.IN_FLIGHT
    return d


def test_happy_path_claims_receives_verifies_and_commits() -> None:
    """reserve → CLAIM with D's blocks, P's start and the prompt's digest; GRANT → receives;
    every rank landed and P's DONE → verified → finished_recving(ok) and DONE(ok) to P."""
    d, out = claiming()
    assert sends(out) == [Claim("t", 1, IDS, (1,), 12, hashes_digest(HASHES))]
    out = d.on_message("P", GRANT, 0.1)
    assert of(out, LaunchCopies) == [LaunchCopies("t", 1, "P", False, (((0, 11), (1, 12)),), 7)]
    assert d.copy_done("t", 1, 0, True, 0.2) == []  # P's DONE not yet seen
    out = d.on_message("P", OK, 0.3)
    assert of(out, FinishedRecving) == [FinishedRecving("t", True, ())]
    assert sends(out) == [Done("t", 1, DoneStatus.OK)]
    assert d.num_live == 0
    assert d.ledger.num_blocks == 0


def test_commit_only_when_every_rank_landed() -> None:
    """TP: with P's DONE in, one rank's receive is not enough."""
    d = in_flight(world_size=2)
    d.on_message("P", OK, 0.2)
    assert d.copy_done("t", 1, 1, True, 0.3) == []
    assert of(d.copy_done("t", 1, 0, True, 0.4), FinishedRecving) == [
        FinishedRecving("t", True, ())
    ]


def test_first_failing_rank_does_not_free_while_another_still_receives() -> None:
    """Rank 0 fails: ABORT to P, cancel; the blocks stay reserved until rank 1 settled and P
    acked; then they are reported invalid (recompute)."""
    d = in_flight(world_size=2)
    out = d.copy_done("t", 1, 0, False, 0.2)
    assert of(out, CancelCopies) == [CancelCopies("t", 1)]
    assert sends(out) == [Abort("t", 1, "consumer_drain")]
    assert d.on_message("P", AbortAck("t", 1), 0.3) == []  # rank 1 still running
    out = d.copy_done("t", 1, 1, False, 0.4)
    assert of(out, FinishedRecving) == [FinishedRecving("t", False, IDS)]


def test_nack_fails_at_once_and_is_not_retried() -> None:
    """P's NACK: nothing will write the blocks, so they are reported invalid at once; no new
    claim follows (a one-shot miss)."""
    d, _ = claiming()
    out = d.on_message("P", Nack("t", 1, NackReason.EXPIRED), 0.1)
    assert out == [FinishedRecving("t", False, IDS)]
    assert d.tick(100.0) == []


def test_kv_of_another_request_is_rejected_by_hash() -> None:
    """P's hashes differ from D's own chain: verify_bad → the blocks are invalid (recompute),
    DONE(failed) to P, and no retry."""
    d, _ = claiming()
    d.on_message("P", Grant("t", 1, ((11, 12),), prompt_hashes(2, 3), 2.0, 7), 0.1)
    d.copy_done("t", 1, 0, True, 0.2)
    with capture_logs() as logs:
        out = d.on_message("P", OK, 0.3)
    assert of(out, FinishedRecving) == [FinishedRecving("t", False, IDS)]
    assert sends(out) == [Done("t", 1, DoneStatus.FAILED)]
    assert "pd_hash_mismatch" in [e["event"] for e in logs]
    assert d.num_live == 0
    assert not sends(d.tick(50.0))


def test_abort_during_a_push_holds_the_blocks_until_abort_ack() -> None:
    """The engine aborts while P may still write: the blocks stay out of the pool, ABORT is
    re-sent on every retry, and they are freed only after ABORT_ACK and the receive settled."""
    d = in_flight()
    out = d.abort("t", 0.2)
    assert sends(out) == [Abort("t", 1, "consumer_drain")]
    assert of(out, CancelCopies)
    assert d.copy_done("t", 1, 0, False, 0.3) == []
    assert Abort("t", 1, "consumer_drain") in sends(d.tick(1.2))
    assert d.ledger.num_blocks == 2
    assert d.on_message("P", AbortAck("t", 1), 1.5) == [FreeBlocks("t", IDS)]


def test_claim_timeout_drains_and_a_late_grant_is_dropped() -> None:
    """No answer within claim_s: D drains (ABORT), never launches on a grant that comes after,
    and frees once P acked."""
    d, _ = claiming()
    out = d.tick(T.claim_s)
    assert [m for m in sends(out) if not isinstance(m, Heartbeat)] == [
        Abort("t", 1, "consumer_drain")
    ]
    with capture_logs() as logs:
        assert d.on_message("P", GRANT, 3.1) == []
    assert [e["why"] for e in logs] == ["unexpected_in_draining"]
    assert of(d.on_message("P", AbortAck("t", 1), 3.2), FinishedRecving) == [
        FinishedRecving("t", False, IDS)
    ]


def test_never_launches_after_the_grant_window() -> None:
    """One receive slot: a grant that waits for it past its window drains instead of starting."""
    d = ConsumerManager("D", timeouts=T, max_inflight=1)
    d.reserve("a", 1, "P", ((5,),), (0,), 4, HASHES[:1], 0.0)
    d.on_message("P", Grant("a", 1, ((7,),), HASHES[:1], 2.0, 8), 0.0)
    d.reserve("t", 1, "P", IDS, (1,), 12, HASHES, 0.0)
    assert not of(d.on_message("P", GRANT, 0.1), LaunchCopies)
    d.on_message("P", Done("a", 1, DoneStatus.OK), 2.0)
    out = d.copy_done("a", 1, 0, True, 2.5)  # the slot frees after t's window (0.1 + 2)
    assert not of(out, LaunchCopies)
    assert Abort("t", 1, "consumer_drain") in sends(out)
    assert d.transfers["t"].state is DState.DRAINING


def test_peer_death_frees_claimed_blocks_only_after_the_quarantine() -> None:
    """P goes silent: after peer_timeout D declares it dead, cancels, and keeps the blocks for
    grant window + longest copy before they return."""
    d = in_flight()
    d.tick(0.5)
    out = d.tick(0.1 + T.peer_timeout_s + 0.01)
    assert of(out, CancelCopies)
    assert d.transfers["t"].state is DState.DRAINING
    lost_at = d.transfers["t"].lost_at
    assert lost_at is not None
    d.copy_done("t", 1, 0, False, lost_at + 0.1)
    assert d.tick(lost_at + T.quarantine_s - 0.01) == []
    assert of(d.tick(lost_at + T.quarantine_s), FinishedRecving) == [
        FinishedRecving("t", False, IDS)
    ]


def test_nothing_to_receive_still_reports_and_frees_p() -> None:
    """A full local hit (no blocks to receive) reports at once and sends RELEASE to P."""
    d = ConsumerManager("D", timeouts=T)
    out = d.reserve("t", 1, "P", ((),), (3,), 12, HASHES, 0.0)
    assert out == [Send("P", Release("t", 1)), FinishedRecving("t", True, ())]
    assert d.num_live == 0


def test_p_failing_in_flight_drains_with_its_confirmation() -> None:
    """P's DONE(failed): P writes nothing more; D frees once its own receive settled."""
    d = in_flight()
    out = d.on_message("P", Done("t", 1, DoneStatus.FAILED), 0.2)
    assert of(out, CancelCopies)
    assert not sends(out)
    assert of(d.copy_done("t", 1, 0, False, 0.3), FinishedRecving) == [
        FinishedRecving("t", False, IDS)
    ]


@pytest.mark.parametrize(
    ("state", "at"),
    [
        ("reserved", T.claim_s),
        ("claiming", T.claim_s),
        ("granted", 0.1 + 2.0),
        ("in_flight", 0.1 + T.copy_s),
    ],
)
def test_every_state_has_a_timer(state: str, at: float) -> None:
    """Each waiting state's deadline fires at its time, not before; claimed states drain."""
    d = ConsumerManager("D", timeouts=T, max_inflight=1)
    if state == "granted":
        d.reserve("a", 1, "P", ((5,),), (0,), 4, HASHES[:1], 0.0)
        d.on_message("P", Grant("a", 1, ((7,),), HASHES[:1], 2.0, 8), 0.0)
    d.reserve("t", 1, "P", IDS, (1,), 12, HASHES, 0.0, claim=state != "reserved")
    if state in ("granted", "in_flight"):
        d.on_message("P", GRANT, 0.1)
    assert d.transfers["t"].state.value == state
    d.tick(at - 0.01)
    assert d.transfers["t"].state.value == state
    out = d.tick(at)
    if state == "reserved":
        assert of(out, FinishedRecving) == [FinishedRecving("t", False, IDS)]
    else:
        assert d.transfers["t"].state is DState.DRAINING


def test_engine_abort_before_the_claim_frees_at_once() -> None:
    """Aborted before any claim: RELEASE to P and the blocks back at once."""
    d = ConsumerManager("D", timeouts=T)
    d.reserve("t", 1, "P", IDS, (1,), 12, HASHES, 0.0, claim=False)
    assert d.abort("t", 0.1) == [Send("P", Release("t", 1)), FreeBlocks("t", IDS)]
    with pytest.raises(ProtocolError):
        d.abort("t", 0.2)


def test_stale_unknown_and_wrong_peer_messages_are_logged_and_dropped() -> None:
    """Other epochs, other peers, unknown ids and out-of-state messages change nothing."""
    d = in_flight()
    with capture_logs() as logs:
        assert d.on_message("P", Done("t", 0, DoneStatus.OK), 0.2) == []
        assert d.on_message("Q", OK, 0.2) == []
        assert d.on_message("P", Nack("zz", 1, NackReason.EXPIRED), 0.2) == []
        assert d.on_message("P", GRANT, 0.2) == []
        assert d.on_message("P", Heartbeat("", 0, "P"), 0.2) == []
    whys = [e["why"] for e in logs]
    assert whys == ["stale_epoch", "wrong_peer", "unknown", "unexpected_in_in_flight"]
    assert d.transfers["t"].state is DState.IN_FLIGHT


def test_bad_input_raises_and_changes_nothing() -> None:
    """Overlapping reservations, a bad start list, an unknown abort: typed errors, no change."""
    d, _ = claiming()
    with pytest.raises(ProtocolError):
        d.reserve("u", 1, "P", ((1, 2),), (0,), 8, HASHES, 0.0)
    with pytest.raises(ConfigError):
        d.reserve("v", 1, "P", ((8,),), (0, 0), 4, HASHES, 0.0)
    with pytest.raises(ProtocolError):
        d.abort("nope", 0.0)
    with pytest.raises(ProtocolError):
        d.copy_done("t", 1, 0, True, 0.0)
    assert set(d.transfers) == {"t"}
    assert d.ledger.num_blocks == 2


def test_a_malformed_grant_drains() -> None:
    """A grant whose blocks do not match the claim is never launched."""
    d, _ = claiming()
    out = d.on_message("P", Grant("t", 1, ((11,),), HASHES, 2.0, 7), 0.1)
    assert not of(out, LaunchCopies)
    assert d.transfers["t"].state is DState.DRAINING
