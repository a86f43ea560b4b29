"""Tests of P's unbound hand-offs: begun with no D named (ANY_PEER), bound by the first valid
CLAIM; nothing goes to an unbound peer, other messages and rival claims are dropped."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvflow.core.pd.common import (
    ANY_PEER,
    Action,
    FinishedSending,
    LaunchCopies,
    Send,
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
    Message,
    Nack,
    NackReason,
    Release,
    hashes_digest,
)
from kvflow.core.pd.producer import ProducerManager
from kvflow.errors import ProtocolError
from tests.core.pd_world import World, of, sends
from tests.core.test_pd_producer import CLAIM, HASHES, IDS, T


def unbound_ready(**kw: object) -> ProducerManager:
    p = ProducerManager("P", timeouts=T, **kw)  # type: ignore[arg-type]
    assert p.kv_ready("t", 1, ANY_PEER, IDS, HASHES, 0.0) == []
    assert p.transfers["t"].peer == ANY_PEER
    return p


def no_unbound_peer(actions: list[Action]) -> None:
    """Nothing is addressed to ANY_PEER."""
    for a in actions:
        if isinstance(a, Send | LaunchCopies):
            assert a.peer != ANY_PEER, a


def test_first_valid_claim_binds_and_the_hand_off_runs_to_release() -> None:
    """An unbound hold is granted to the first claimer, logged pd_peer_bound; sends go to it,
    its DONE releases P's blocks once."""
    p = unbound_ready()
    with capture_logs() as logs:
        out = p.on_message("D1", CLAIM, 0.0)
    assert {"event": "pd_peer_bound", "transfer_id": "t", "epoch": 1, "peer": "D1"} in [
        {k: e[k] for k in ("event", "transfer_id", "epoch", "peer") if k in e} for e in logs
    ]
    assert [type(m) for m in sends(out)] == [Grant]
    assert [a.peer for a in out if isinstance(a, Send | LaunchCopies)] == ["D1", "D1"]
    t = p.transfers["t"]
    assert (t.peer, t.state) == ("D1", PState.IN_FLIGHT)
    done = p.copy_done("t", 1, 0, True, 0.1)
    assert sends(done) == [Done("t", 1, DoneStatus.OK)]
    assert [a.peer for a in done if isinstance(a, Send)] == ["D1"]
    out = p.on_message("D1", Done("t", 1, DoneStatus.OK), 0.2)
    assert of(out, FinishedSending) == [FinishedSending("t", IDS)]
    assert not p.transfers
    assert len(p.peers) == 0


def test_a_rival_claim_after_binding_is_dropped_as_stale() -> None:
    """Once bound to D1, D2's claim is dropped (wrong_peer) and changes nothing."""
    p = unbound_ready()
    p.on_message("D1", CLAIM, 0.0)
    with capture_logs() as logs:
        assert p.on_message("D2", CLAIM, 0.0) == []
    assert [e["why"] for e in logs if e["event"] == "pd_message_dropped"] == ["wrong_peer"]
    assert p.transfers["t"].peer == "D1"
    assert len(p.peers) == 1
    # The rival's abort is acked: its drain ends; D1's hand-off goes on.
    assert p.on_message("D2", Abort("t", 1, "x"), 0.1) == [Send("D2", AbortAck("t", 1))]
    assert p.transfers["t"].state is PState.IN_FLIGHT


@pytest.mark.parametrize(
    ("claim", "reason"),
    [
        (Claim("t", 1, ((0,),), (1,), 4, b"x" * 16), NackReason.HASH_MISMATCH),
        (Claim("t", 1, ((0, 1, 2),), (1,), 12, hashes_digest(HASHES)), NackReason.SHAPE),
    ],
)
def test_an_invalid_claim_is_refused_and_does_not_bind(claim: Claim, reason: NackReason) -> None:
    """A bad claim gets NACK to its sender; the hold stays unbound, a valid claim binds later."""
    p = unbound_ready()
    out = p.on_message("D1", claim, 0.0)
    assert out == [Send("D1", Nack("t", 1, reason))]
    assert p.transfers["t"].peer == ANY_PEER
    assert len(p.peers) == 0
    assert [type(m) for m in sends(p.on_message("D2", CLAIM, 0.0))] == [Grant]
    assert p.transfers["t"].peer == "D2"


def test_may_bind_can_refuse_a_binding() -> None:
    """``may_bind`` False: NACK(unknown_transfer) to the claimer, logged pd_bind_refused; the
    next claimer it accepts binds."""
    asked: list[tuple[str, str]] = []

    def may_bind(tid: str, peer: str) -> bool:
        asked.append((tid, peer))
        return peer == "D2"

    p = unbound_ready(may_bind=may_bind)
    with capture_logs() as logs:
        out = p.on_message("D1", CLAIM, 0.0)
    assert out == [Send("D1", Nack("t", 1, NackReason.UNKNOWN_TRANSFER))]
    assert "pd_bind_refused" in [e["event"] for e in logs]
    assert p.transfers["t"].peer == ANY_PEER
    assert [type(m) for m in sends(p.on_message("D2", CLAIM, 0.0))] == [Grant]
    assert asked == [("t", "D1"), ("t", "D2")]


@pytest.mark.parametrize(
    "msg",
    [
        Abort("t", 1, "x"),
        Release("t", 2),
        Done("t", 1, DoneStatus.OK),
        Claim("t", 2, ((0, 1),), (1,), 12, hashes_digest(HASHES)),
        Abort("t", 2, "x"),
    ],
)
def test_any_other_message_for_an_unbound_hand_off_is_dropped(msg: Message) -> None:
    """Aborts, DONEs, and releases and claims of another epoch about an unbound hold are dropped
    as stale (why=unbound), an abort acked (nothing of P writes that peer's blocks); the hold
    stays, unbound and unwatched."""
    p = unbound_ready()
    with capture_logs() as logs:
        out = p.on_message("D1", msg, 0.0)
    acks = [AbortAck("t", msg.epoch)] if isinstance(msg, Abort) else []
    assert sends(out) == acks
    assert [e["why"] for e in logs if e["event"] == "pd_message_dropped"] == ["unbound"]
    t = p.transfers["t"]
    assert (t.peer, t.state, len(p.peers)) == (ANY_PEER, PState.READY, 0)


def test_a_release_of_an_unbound_hold_lets_go_at_once_and_tells_nobody() -> None:
    """A D that needs nothing of an unbound hold (a full local prefix hit behind a stock
    proxy) RELEASEs it: P's blocks come back now, not at the lease's end, and no message goes
    out; a later claim of it is NACKed as expired."""
    p = unbound_ready()
    with capture_logs() as logs:
        out = p.on_message("D1", Release("t", 1), 0.1)
    assert out == [FinishedSending("t", IDS)]
    assert not p.transfers
    assert any(e["event"] == "pd_peer_bound" and e.get("cause") == "release" for e in logs)
    assert p.on_message("D2", CLAIM, 0.2) == [Send("D2", Nack("t", 1, NackReason.EXPIRED))]


def test_a_message_from_an_unnamed_peer_is_dropped() -> None:
    """A sender whose engine id is empty (ANY_PEER) never binds anything."""
    p = unbound_ready()
    assert p.on_message(ANY_PEER, CLAIM, 0.0) == []
    assert p.transfers["t"].peer == ANY_PEER


def test_unbound_lease_expiry_releases_with_no_peer_to_tell() -> None:
    """An unclaimed unbound hold expires as any hold does: blocks back, nothing sent."""
    p = unbound_ready()
    assert p.tick(4.9) == []
    out = p.tick(5.0)
    assert out == [FinishedSending("t", IDS)]
    assert p.on_message("D1", CLAIM, 5.1) == [Send("D1", Nack("t", 1, NackReason.EXPIRED))]


def test_unbound_prefilling_timeout_and_engine_abort_send_nothing() -> None:
    """Prefilling past its deadline, or aborted by the engine while ready, an unbound hand-off
    ends with no message to anyone."""
    p = ProducerManager("P", timeouts=T)
    p.begin("a", 1, ANY_PEER, 0.0)
    assert p.tick(9.0) == []
    assert "a" not in p.transfers
    p.kv_ready("b", 1, ANY_PEER, IDS, HASHES, 10.0)
    assert p.abort("b", 10.0) == [FinishedSending("b", IDS)]


def test_peer_lost_never_matches_unbound_hand_offs() -> None:
    """peer_lost of any peer, ANY_PEER included, leaves an unbound hold alone."""
    p = unbound_ready()
    assert p.peer_lost(ANY_PEER, 0.0) == []
    assert p.peer_lost("D1", 0.0) == []
    assert p.transfers["t"].state is PState.READY


def test_heartbeats_go_only_to_bound_peers() -> None:
    """An unbound hold is not watched: no heartbeat, no loss; bound, its peer is watched."""
    p = unbound_ready()
    assert p.tick(1.0) == []
    assert len(p.peers) == 0
    p.on_message("D1", Heartbeat("", 0, "D1"), 1.0)
    assert len(p.peers) == 0
    p.on_message("D1", CLAIM, 1.0)
    assert len(p.peers) == 1


def test_a_claim_while_prefilling_binds_and_is_granted_at_kv_ready() -> None:
    """The concurrent flow unbound: the claim binds at once and is granted at kv_ready, which
    still names ANY_PEER; a rival claim meanwhile is dropped."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, ANY_PEER, 0.0)
    assert p.on_message("D1", CLAIM, 0.0) == []
    assert p.transfers["t"].peer == "D1"
    assert p.on_message("D2", CLAIM, 0.0) == []
    out = p.kv_ready("t", 1, ANY_PEER, IDS, HASHES, 0.5)
    assert [type(m) for m in sends(out)] == [Grant]
    assert {a.peer for a in out if isinstance(a, Send | LaunchCopies)} == {"D1"}


def test_a_streamed_unbound_hand_off_binds_and_pushes_to_its_claimer() -> None:
    """With the prompt known while prefilling, the first claim binds and is granted streaming;
    each chunk goes to the claimer; kv_ready naming ANY_PEER pushes the rest."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, ANY_PEER, 0.0, block_hashes=HASHES)
    out = p.on_message("D1", CLAIM, 0.0)
    assert [type(m) for m in sends(out)] == [Grant]
    out += p.kv_chunk("t", 1, IDS, 2, 0.1)
    out += p.kv_ready("t", 1, ANY_PEER, IDS, HASHES, 0.2)
    no_unbound_peer(out)
    assert {a.peer for a in out if isinstance(a, Send | LaunchCopies)} == {"D1"}
    assert p.transfers["t"].state is PState.IN_FLIGHT


def test_kv_ready_naming_another_peer_than_the_bound_one_is_refused() -> None:
    """Begun unbound, the engine may say ANY_PEER or nothing else: a named peer is a
    ProtocolError and changes nothing."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, ANY_PEER, 0.0)
    with pytest.raises(ProtocolError):
        p.kv_ready("t", 1, "D9", IDS, HASHES, 0.1)
    assert p.transfers["t"].state is PState.PREFILLING
    assert not p.ledger.holds("t")


def test_two_ds_each_claim_their_own_unbound_hand_off_in_the_world() -> None:
    """The fake world with unbound hand-offs and a rival D: every hand-off still commits or
    recomputes, nothing leaks, nothing goes to ANY_PEER."""
    w = World(unbound=True)
    tids = [w.new_handoff(blocks=2) for _ in range(3)]
    w.rival_claim(tids[0])  # D2 binds t1 first: D's claim for it is dropped, D recomputes
    w.quiesce()
    w.check_no_leaks()
    assert w.results[tids[0]] == "recompute"
    assert all(w.results[t] == "committed" for t in tids[1:])
