"""Tests of the producer (P) manager: the hold's life, every timer, aborts, TP, stale messages."""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from kvflow.core.pd.common import (
    CancelCopies,
    FinishedSending,
    LaunchCopies,
    PDTimeouts,
)
from kvflow.core.pd.machines import PState
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
from kvflow.core.pd.producer import ProducerManager
from kvflow.errors import ConfigError, ProtocolError
from tests.core.pd_world import of, prompt_hashes, sends

T = PDTimeouts(lease_s=5, grant_window_s=2, copy_s=4, done_s=3, prefill_s=9, drain_retry_s=1)
IDS = ((10, 11, 12),)
HASHES = prompt_hashes(1, 3)
CLAIM = Claim("t", 1, ((0, 1),), (1,), 12, hashes_digest(HASHES))


def ready(world_size: int = 1, **kw: Any) -> ProducerManager:
    p = ProducerManager("P", world_size=world_size, timeouts=T, **kw)
    assert p.kv_ready("t", 1, "D", IDS, HASHES, 0.0) == []
    return p


def in_flight(world_size: int = 1) -> ProducerManager:
    p = ready(world_size)
    p.on_message("D", CLAIM, 0.0)
    assert p.transfers["t"].state is PState.IN_FLIGHT
    return p


def occupy_the_send_slot(p: ProducerManager) -> None:
    """Another hand-off takes P's only send slot (``max_inflight=1``) and keeps it."""
    p.kv_ready("busy", 1, "D", ((20,),), HASHES[:1], 0.0)
    p.on_message("D", Claim("busy", 1, ((5,),), (0,), 4, hashes_digest(HASHES[:1])), 0.0)


def producer_in(state: str) -> ProducerManager:
    """A producer (one send slot) whose hand-off "t" is in ``state`` ("unknown": none)."""
    p = ProducerManager("P", timeouts=T, max_inflight=1)
    if state == "prefilling":
        p.begin("t", 1, "D", 0.0)
    elif state != "unknown":
        p.kv_ready("t", 1, "D", IDS, HASHES, 0.0)
    if state == "granted":
        occupy_the_send_slot(p)
    if state in ("granted", "in_flight", "sent"):
        p.on_message("D", CLAIM, 0.0)
    if state == "sent":
        p.copy_done("t", 1, 0, True, 0.0)
    if state != "unknown":
        assert p.transfers["t"].state.value == state
    return p


def test_happy_path_grants_sends_and_releases_once() -> None:
    """CLAIM → GRANT with P's ids for the claimed range and hashes, sends launched at once;
    every rank's send → DONE(ok); D's DONE → the blocks back to the engine exactly once."""
    p = ready()
    out = p.on_message("D", CLAIM, 0.1)
    assert sends(out) == [Grant("t", 1, ((11, 12),), HASHES, 2.0, 1)]
    assert of(out, LaunchCopies) == [LaunchCopies("t", 1, "D", True, (((11, 0), (12, 1)),), 1)]
    out = p.copy_done("t", 1, 0, True, 0.2)
    assert sends(out) == [Done("t", 1, DoneStatus.OK)]
    assert p.transfers["t"].state is PState.SENT
    out = p.on_message("D", Done("t", 1, DoneStatus.OK), 0.3)
    assert of(out, FinishedSending) == [FinishedSending("t", IDS)]
    assert p.num_live == 0
    assert p.ledger.num_blocks == 0
    assert p.on_message("D", Done("t", 1, DoneStatus.OK), 0.4) == []  # duplicate: dropped


def test_channels_are_unique_among_live_hand_offs_and_reused_after_release() -> None:
    """Each grant gets a data-plane channel no live hand-off holds; a released one is free."""
    p = ProducerManager("P", timeouts=T)
    for i in range(3):
        p.kv_ready(f"t{i}", 1, "D", ((10 + i,),), HASHES[:1], 0.0)
    claim = Claim("t0", 1, ((0,),), (0,), 4, hashes_digest(HASHES[:1]))
    grants: list[Grant] = []
    for i in range(3):
        out = p.on_message("D", Claim(f"t{i}", 1, claim.block_ids, (0,), 4, claim.digest), 0.0)
        grants.extend(m for m in sends(out) if isinstance(m, Grant))
    assert len({g.channel for g in grants}) == 3
    assert all(g.channel > 0 for g in grants)
    p.abort("t1", 0.1)
    p.copy_done("t1", 1, 0, False, 0.1)
    p.kv_ready("t3", 1, "D", ((20,),), HASHES[:1], 0.2)
    out = p.on_message("D", Claim("t3", 1, claim.block_ids, (0,), 4, claim.digest), 0.2)
    (g3,) = [m for m in sends(out) if isinstance(m, Grant)]
    assert g3.channel not in {grants[0].channel, grants[2].channel}


def test_unclaimed_lease_expires_and_a_late_claim_is_nacked() -> None:
    """Only a hold that was never granted expires; the claim that comes later gets NACK."""
    p = ready()
    assert p.tick(4.9) == []
    assert of(p.tick(5.0), FinishedSending) == [FinishedSending("t", IDS)]
    assert sends(p.on_message("D", CLAIM, 6.0)) == [Nack("t", 1, NackReason.EXPIRED)]
    assert sends(p.on_message("D", Claim("u", 1, ((0,),), (0,), 4, b"x"), 6.0)) == [
        Nack("u", 1, NackReason.UNKNOWN_TRANSFER)
    ]


def test_a_granted_hold_outlives_the_lease_until_every_send_settled() -> None:
    """Past the lease, past the copy timeout: the blocks stay held while a send may read them;
    the timeout cancels the sends and the blocks come back only when they settled."""
    p = ProducerManager("P", timeouts=PDTimeouts(lease_s=1, copy_s=4, drain_retry_s=1))
    p.kv_ready("t", 1, "D", IDS, HASHES, 0.0)
    p.on_message("D", CLAIM, 0.0)
    assert of(p.tick(3.9), FinishedSending) == []
    out = p.tick(4.0)
    assert of(out, CancelCopies) == [CancelCopies("t", 1)]
    assert p.transfers["t"].state is PState.DRAINING
    assert p.ledger.num_blocks == 3
    with capture_logs() as logs:
        assert of(p.tick(100.0), FinishedSending) == []
    assert "pd_drain_overdue" in [e["event"] for e in logs]
    out = p.copy_done("t", 1, 0, False, 101.0)
    assert of(out, FinishedSending) == [FinishedSending("t", IDS)]
    assert sends(out) == [Done("t", 1, DoneStatus.FAILED)]


def test_first_failing_rank_does_not_free_while_other_ranks_send() -> None:
    """TP: rank 0's failure drains the hand-off, but the blocks come back after rank 1 settled."""
    p = in_flight(world_size=2)
    out = p.copy_done("t", 1, 0, False, 0.5)
    assert of(out, CancelCopies) == [CancelCopies("t", 1)]
    assert not of(out, FinishedSending)
    out = p.copy_done("t", 1, 1, True, 0.6)
    assert of(out, FinishedSending) == [FinishedSending("t", IDS)]


def test_commit_needs_every_rank() -> None:
    """DONE(ok) goes to D only when every rank's send finished."""
    p = in_flight(world_size=2)
    assert sends(p.copy_done("t", 1, 1, True, 0.1)) == []
    assert sends(p.copy_done("t", 1, 0, True, 0.2)) == [Done("t", 1, DoneStatus.OK)]


def test_done_before_the_local_fence_releases_after_it() -> None:
    """D's DONE may arrive before P saw its own send finish: P releases right after the fence."""
    p = in_flight()
    assert p.on_message("D", Done("t", 1, DoneStatus.OK), 0.1) == []
    out = p.copy_done("t", 1, 0, True, 0.2)
    assert of(out, FinishedSending) == [FinishedSending("t", IDS)]


@pytest.mark.parametrize(
    ("claim", "reason"),
    [
        (Claim("t", 1, ((0, 1),), (1,), 12, b"wrong digest...."), NackReason.HASH_MISMATCH),
        (Claim("t", 1, ((0, 1),), (2,), 12, hashes_digest(HASHES)), NackReason.SHAPE),
        (Claim("t", 1, ((0,), (1,)), (0, 0), 12, hashes_digest(HASHES)), NackReason.SHAPE),
    ],
)
def test_a_bad_claim_is_refused_and_the_hold_stays(claim: Claim, reason: NackReason) -> None:
    """A claim for another prompt or blocks that do not fit gets NACK; P keeps its hold."""
    p = ready()
    assert sends(p.on_message("D", claim, 0.1)) == [Nack("t", 1, reason)]
    assert p.transfers["t"].state is PState.READY
    assert p.ledger.num_blocks == 3


@pytest.mark.parametrize("state", ["ready", "granted", "in_flight", "sent", "unknown"])
def test_abort_from_d_is_acked_once_nothing_of_p_writes(state: str) -> None:
    """ABORT: in READY, GRANTED (no send slot yet), SENT or for an unknown id P acks at once;
    with sends in flight, P cancels and acks only after they settled."""
    p = producer_in(state)
    out = p.on_message("D", Abort("t", 1, "test"), 0.2)
    if state == "in_flight":
        assert of(out, CancelCopies) == [CancelCopies("t", 1)]
        assert not sends(out)
        out = p.copy_done("t", 1, 0, False, 0.3)
    assert sends(out) == [AbortAck("t", 1)]
    assert of(out, FinishedSending) == ([] if state == "unknown" else [FinishedSending("t", IDS)])
    assert "t" not in p.transfers
    assert sends(p.on_message("D", CLAIM, 0.4)) == [Nack("t", 1, NackReason.EXPIRED)]


def test_release_before_a_claim_frees_the_hold() -> None:
    """D's RELEASE (it gave up before claiming) frees P's hold; after a grant it is ignored."""
    p = ready()
    assert of(p.on_message("D", Release("t", 1), 0.1), FinishedSending) == [
        FinishedSending("t", IDS)
    ]
    p = in_flight()
    assert p.on_message("D", Release("t", 1), 0.1) == []
    assert p.transfers["t"].state is PState.IN_FLIGHT


def test_concurrent_flow_claim_while_prefilling_is_granted_at_kv_ready() -> None:
    """A claim that arrives while P prefills waits; kv_ready grants and launches it."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, "D", 0.0)
    assert p.on_message("D", CLAIM, 0.1) == []
    out = p.kv_ready("t", 1, "D", IDS, HASHES, 0.5)
    assert [type(m) for m in sends(out)] == [Grant]
    assert len(of(out, LaunchCopies)) == 1


def test_abort_while_prefilling_frees_the_blocks_at_kv_ready() -> None:
    """D's ABORT during P's prefill is acked at once; the KV that P completes later is not held."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, "D", 0.0)
    assert sends(p.on_message("D", Abort("t", 1, "x"), 0.1)) == [AbortAck("t", 1)]
    with capture_logs() as logs:
        assert p.kv_ready("t", 1, "D", IDS, HASHES, 0.5) == [FinishedSending("t", IDS)]
    assert [e["event"] for e in logs] == ["pd_kv_ready_after_abort"]
    assert p.ledger.num_blocks == 0


def test_engine_abort_in_every_state() -> None:
    """The engine's abort: nothing held while prefilling; READY frees; in flight it drains and
    tells D with DONE(failed) once the sends settled."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, "D", 0.0)
    assert p.abort("t", 0.1) == []
    assert p.num_live == 0
    p = ready()
    assert p.abort("t", 0.1) == [FinishedSending("t", IDS)]
    p = in_flight()
    out = p.abort("t", 0.1)
    assert of(out, CancelCopies)
    assert not of(out, FinishedSending)
    out = p.copy_done("t", 1, 0, False, 0.2)
    assert sends(out) == [Done("t", 1, DoneStatus.FAILED)]
    assert of(out, FinishedSending)
    with pytest.raises(ProtocolError):
        p.abort("t", 0.3)


@pytest.mark.parametrize(
    ("state", "at", "after"),
    [
        ("prefilling", T.prefill_s, None),
        ("ready", T.lease_s, None),
        ("granted", T.grant_window_s, None),
        ("in_flight", T.copy_s, PState.DRAINING),
        ("sent", T.done_s, None),
    ],
)
def test_every_state_has_a_timer(state: str, at: float, after: PState | None) -> None:
    """Each non-terminal state's deadline fires at its time and not before."""
    p = producer_in(state)
    p.tick(at - 0.01)
    assert p.transfers["t"].state.value == state
    p.tick(at)
    if after is None:
        assert "t" not in p.transfers
    else:
        assert p.transfers["t"].state is after


def test_granted_timeout_without_a_slot_tells_d() -> None:
    """No send slot within the grant window: P never launches, frees, and says DONE(failed)."""
    p = producer_in("granted")
    out = p.tick(T.grant_window_s)
    assert Done("t", 1, DoneStatus.FAILED) in sends(out)
    assert FinishedSending("t", IDS) in out
    assert not of(out, LaunchCopies)


def test_stale_unknown_and_wrong_peer_messages_are_logged_and_dropped() -> None:
    """Messages of another epoch, another peer or no hand-off change nothing and log why."""
    p = in_flight()
    with capture_logs() as logs:
        assert p.on_message("D", Done("t", 0, DoneStatus.OK), 0.1) == []
        assert p.on_message("X", Done("t", 1, DoneStatus.OK), 0.1) == []
        assert p.on_message("D", Done("nope", 1, DoneStatus.OK), 0.1) == []
        assert p.on_message("D", CLAIM, 0.1) == []  # duplicate
    whys = [e["why"] for e in logs if e["event"] == "pd_message_dropped"]
    assert whys == ["stale_epoch", "wrong_peer", "unknown", "duplicate_claim_in_in_flight"]
    assert p.transfers["t"].state is PState.IN_FLIGHT
    # An ABORT of another attempt is answered: nothing of that attempt runs on P.
    assert sends(p.on_message("D", Abort("t", 0, "old"), 0.2)) == [AbortAck("t", 0)]


def test_peer_silence_drains_claimed_hand_offs() -> None:
    """P heartbeats D while a claim is live; D silent past the timeout → drain, then release."""
    p = in_flight()
    out = p.tick(T.heartbeat_s)
    assert sends(out) == [Heartbeat("", 0, "P")]
    p.on_message("D", Heartbeat("", 0, "D"), 2.0)
    assert p.transfers["t"].state is PState.IN_FLIGHT
    p.copy_done("t", 1, 0, True, 2.5)
    p.tick(2.0 + T.peer_timeout_s + 0.1)
    assert "t" not in p.transfers
    assert len(p.peers) == 0


def test_prefix_shared_blocks_are_held_by_each_hand_off_until_its_own_release() -> None:
    """Two requests sharing prefix-cached blocks hold them in two hand-offs at once (sends only
    read them); releasing one keeps the blocks held for the other."""
    p = ready()
    p.kv_ready("u", 1, "D", ((12, 13),), HASHES, 0.0)  # block 12 is also held by "t"
    assert set(p.transfers) == {"t", "u"}
    assert p.ledger.owner(0, 12) == "t"
    p.abort("t", 0.0)
    assert p.ledger.owner(0, 12) == "u"
    assert p.ledger.num_blocks == 2
    p.abort("u", 0.0)
    assert p.ledger.num_blocks == 0


def test_bad_engine_input_raises_and_changes_nothing() -> None:
    """A second kv_ready, a block named twice, a bad copy_done: typed errors, state unchanged."""
    p = ready()
    with pytest.raises(ProtocolError):
        p.kv_ready("t", 1, "D", ((30,),), HASHES, 0.0)
    with pytest.raises(ProtocolError):
        p.kv_ready("v", 1, "D", ((40, 40),), HASHES, 0.0)
    assert set(p.transfers) == {"t"}
    assert p.ledger.num_blocks == 3
    with pytest.raises(ProtocolError):
        p.copy_done("t", 1, 0, True, 0.0)  # nothing launched
    p.on_message("D", CLAIM, 0.0)
    p.copy_done("t", 1, 0, True, 0.0)
    with pytest.raises(ProtocolError):
        p.copy_done("t", 1, 0, True, 0.0)
    with pytest.raises(ConfigError):
        ProducerManager("P", world_size=0)
    with pytest.raises(ConfigError):
        PDTimeouts(lease_s=0)
