"""Streamed hand-offs (the concurrent flow's per-chunk pushes), on both managers driven by hand:
a claim that arrives while P prefills is granted at once, each chunk is pushed as soon as its KV
is fenced (READY + sends), D launches each chunk's receives on its READY and commits only once
every chunk landed on every rank and P said DONE; aborts mid-way hold the blocks until the
drain ends on either side."""

from __future__ import annotations

from typing import Any

from kvflow.core.pd.common import (
    CancelCopies,
    FinishedRecving,
    FinishedSending,
    FreeBlocks,
    LaunchCopies,
    PDTimeouts,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.machines import DState, PState
from kvflow.core.pd.messages import Abort, AbortAck, Claim, Done, DoneStatus, Grant, Ready
from kvflow.core.pd.producer import ProducerManager
from tests.core.pd_world import of, prompt_hashes, sends

T = PDTimeouts(claim_s=3, grant_window_s=2, copy_s=5, drain_retry_s=0.5, prefill_s=20)
HASHES = prompt_hashes(7, 4)
P_IDS = ((10, 11, 12, 13),)
D_IDS = ((3, 4, 5),)  # D's own cache covers P's block 0


def streamed(ranks: int = 1) -> tuple[ProducerManager, ConsumerManager, list[Any]]:
    """P prefilling with the prompt's hashes, D's claim granted at once; the grant's actions."""
    p = ProducerManager("P", world_size=ranks, timeouts=T)
    d = ConsumerManager("D", world_size=ranks, timeouts=T)
    assert p.begin("t", 1, "D", 0.0, block_hashes=HASHES) == []
    (claim,) = sends(d.reserve("t", 1, "P", D_IDS, (1,), 16, HASHES, 0.0, claim_timeout_s=20))
    out = p.on_message("D", claim, 0.1)
    (grant,) = sends(out)
    assert isinstance(grant, Grant)
    assert grant.streaming
    assert p.transfers["t"].state is PState.STREAMING
    assert not of(out, LaunchCopies)  # nothing fenced yet
    assert d.on_message("P", grant, 0.2) == []
    return p, d, out


def chunk(p: ProducerManager, fenced: int, now: float) -> tuple[Ready, LaunchCopies]:
    out = p.kv_chunk("t", 1, (P_IDS[0][:fenced],), fenced, now)
    (ready,) = sends(out)
    (launch,) = of(out, LaunchCopies)
    return ready, launch


def test_each_fenced_chunk_is_pushed_at_once_and_d_commits_when_all_landed() -> None:
    """Chunks of one and two blocks are pushed as their KV is fenced, the last one at
    kv_ready; D launches each on its READY and commits only after the last landed."""
    p, d, _ = streamed()
    assert p.kv_chunk("t", 1, ((10,),), 1, 0.3) == []  # block 0 is D's own: nothing to push
    r1, s1 = chunk(p, 2, 0.4)
    assert (r1.start, r1.stop) == (0, 1)
    assert s1.pairs == (((11, 3),),)
    assert s1.send
    (l1,) = of(d.on_message("P", r1, 0.5), LaunchCopies)
    assert l1.channel == s1.channel == r1.channel
    assert l1.pairs == (((3, 1),),)
    r2, s2 = chunk(p, 4, 0.6)
    assert (r2.start, r2.stop) == (1, 3)
    assert s2.channel != s1.channel
    out = p.kv_ready("t", 1, "D", P_IDS, HASHES, 0.7)
    assert not of(out, LaunchCopies)  # everything was pushed already
    assert p.transfers["t"].state is PState.IN_FLIGHT
    (l2,) = of(d.on_message("P", r2, 0.8), LaunchCopies)
    assert p.copy_done("t", 1, 0, True, 0.9, s1.channel) == []
    (done,) = sends(p.copy_done("t", 1, 0, True, 1.0, s2.channel))
    assert done == Done("t", 1, DoneStatus.OK)
    assert d.copy_done("t", 1, 0, True, 1.1, l1.channel) == []
    assert d.on_message("P", done, 1.2) == []  # P's DONE before D's last chunk landed
    assert d.transfers["t"].state is DState.IN_FLIGHT
    out = d.copy_done("t", 1, 0, True, 1.3, l2.channel)
    assert of(out, FinishedRecving) == [FinishedRecving("t", True, ())]
    (ack,) = sends(out)
    assert of(p.on_message("D", ack, 1.4), FinishedSending) == [FinishedSending("t", P_IDS)]
    assert p.num_live == d.num_live == 0
    assert p.ledger.num_blocks == d.ledger.num_blocks == 0


def test_commit_needs_every_rank_of_every_chunk() -> None:
    """Two ranks: D's hand-off lands only once both ranks received both chunks."""
    p, d, _ = streamed(ranks=2)
    r1, s1 = chunk(p, 2, 0.3)
    out = p.kv_ready("t", 1, "D", P_IDS, HASHES, 0.4)
    (r2,) = sends(out)
    (s2,) = of(out, LaunchCopies)
    (l1,) = of(d.on_message("P", r1, 0.5), LaunchCopies)
    (l2,) = of(d.on_message("P", r2, 0.5), LaunchCopies)
    for rank in (0, 1):
        p.copy_done("t", 1, rank, True, 0.6, s1.channel)
    (done,) = [m for r in (0, 1) for m in sends(p.copy_done("t", 1, r, True, 0.6, s2.channel))]
    d.on_message("P", done, 0.7)
    for rank, channel in ((0, l1.channel), (0, l2.channel), (1, l1.channel)):
        assert d.copy_done("t", 1, rank, True, 0.8, channel) == []
    assert d.transfers["t"].state is DState.IN_FLIGHT
    out = d.copy_done("t", 1, 1, True, 0.9, l2.channel)
    assert of(out, FinishedRecving) == [FinishedRecving("t", True, ())]


def test_a_duplicate_or_overlapping_ready_is_dropped() -> None:
    """A READY seen twice (or overlapping a chunk already launched) launches nothing."""
    p, d, _ = streamed()
    r1, _ = chunk(p, 3, 0.3)
    assert of(d.on_message("P", r1, 0.4), LaunchCopies)
    assert d.on_message("P", r1, 0.5) == []
    assert d.on_message("P", Ready("t", 1, 1, 3, r1.channel), 0.6) == []
    assert d.on_message("P", Ready("t", 1, 2, 9, 77), 0.6) == []  # past the claim


def test_d_s_abort_mid_stream_holds_its_blocks_until_abort_ack_and_every_chunk_settled() -> None:
    """D aborts after one chunk launched: ABORT to P, the chunk is cancelled, and D's blocks
    come back only after P's ABORT_ACK and the chunk's settling; P pushes nothing more."""
    p, d, _ = streamed()
    r1, s1 = chunk(p, 2, 0.3)
    (l1,) = of(d.on_message("P", r1, 0.4), LaunchCopies)
    out = d.abort("t", 0.5)
    assert sends(out) == [Abort("t", 1, "consumer_drain")]
    assert of(out, CancelCopies)
    p_out = p.on_message("D", Abort("t", 1, "consumer_drain"), 0.6)
    assert of(p_out, CancelCopies)
    assert not sends(p_out)  # P's push still runs: no ack yet
    assert p.kv_chunk("t", 1, (P_IDS[0][:4],), 4, 0.7) == []  # draining: nothing more pushed
    (ack,) = sends(p.copy_done("t", 1, 0, False, 0.8, s1.channel))
    assert ack == AbortAck("t", 1)
    assert d.on_message("P", ack, 0.9) == []  # D's own receive still runs
    assert d.ledger.num_blocks == 3
    assert d.copy_done("t", 1, 0, False, 1.0, l1.channel) == [FreeBlocks("t", D_IDS)]
    # P's request is still prefilling: its blocks stay the engine's until kv_ready.
    assert p.kv_ready("t", 1, "D", P_IDS, HASHES, 1.1) == [FinishedSending("t", P_IDS)]


def test_p_s_abort_mid_stream_frees_p_s_blocks_only_after_every_push_settled() -> None:
    """P's engine aborts the request while a chunk is being sent: FinishedSending (the engine
    frees the blocks) comes only once the send settled, and D hears that P stopped."""
    p, _d, _ = streamed()
    _, s1 = chunk(p, 2, 0.3)
    out = p.abort("t", 0.4)
    assert of(out, CancelCopies)
    assert not of(out, FinishedSending)
    assert p.transfers["t"].state is PState.DRAINING
    out = p.copy_done("t", 1, 0, False, 0.5, s1.channel)
    assert sends(out) == [Done("t", 1, DoneStatus.FAILED)]
    assert of(out, FinishedSending) == [FinishedSending("t", ((10, 11),))]


def test_a_claim_before_the_prompt_is_known_waits_then_streams() -> None:
    """A hand-off begun without hashes keeps D's claim; ``set_prompt`` grants it streaming and
    pushes what is already fenced."""
    p = ProducerManager("P", timeouts=T)
    p.begin("t", 1, "D", 0.0)
    claim = Claim(
        "t",
        1,
        D_IDS,
        (1,),
        16,
        sends(ConsumerManager("D", timeouts=T).reserve("t", 1, "P", D_IDS, (1,), 16, HASHES, 0.0))[
            0
        ].digest,
    )
    assert p.on_message("D", claim, 0.1) == []
    assert p.kv_chunk("t", 1, (P_IDS[0][:3],), 3, 0.2) == []
    out = p.set_prompt("t", HASHES, 0.3)
    grant, ready = sends(out)
    assert isinstance(grant, Grant)
    assert grant.streaming
    assert (ready.start, ready.stop) == (0, 2)
    assert of(out, LaunchCopies)[0].pairs == (((11, 3), (12, 4)),)


def test_a_preempted_request_s_stream_stops_and_its_blocks_come_back_at_kv_ready() -> None:
    """P's engine preempts the request mid-stream (its blocks are the engine's again): the
    hand-off drains without a FinishedSending for the running request, D hears P stopped, and
    the request's later kv_ready hands its blocks back at once."""
    p, _d, _ = streamed()
    _, s1 = chunk(p, 2, 0.3)
    assert of(p.abort("t", 0.4, engine_waits=False), CancelCopies)
    out = p.copy_done("t", 1, 0, False, 0.5, s1.channel)
    assert sends(out) == [Done("t", 1, DoneStatus.FAILED)]
    assert not of(out, FinishedSending)
    assert p.num_live == 0
    assert p.ledger.num_blocks == 0
    assert p.kv_ready("t", 1, "D", P_IDS, HASHES, 0.6) == [FinishedSending("t", P_IDS)]


def test_a_failed_push_before_kv_ready_frees_every_block_of_the_request() -> None:
    """A chunk's send fails while P still prefills (the hand-off drains); kv_ready then brings
    the request's whole table: the drain's FinishedSending names all of it, not only the
    chunk's blocks, and the ledger ends empty."""
    p, _d, _ = streamed()
    two = p.kv_chunk("t", 1, ((10, 11),), 2, 0.3)
    (launch,) = of(two, LaunchCopies)
    second, _ = chunk(p, 3, 0.35)
    assert p.copy_done("t", 1, 0, False, 0.4, launch.channel) != []
    assert p.transfers["t"].state is PState.DRAINING
    assert p.kv_ready("t", 1, "D", P_IDS, HASHES, 0.5) == []
    out = p.copy_done("t", 1, 0, True, 0.6, second.channel)
    assert of(out, FinishedSending) == [FinishedSending("t", P_IDS)]
    assert p.ledger.num_blocks == 0
    assert "t" not in p.transfers
