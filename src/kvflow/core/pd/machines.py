"""The two PD state machines, one per side of a hand-off, as transition tables (data).

Both are applied only by ``kvflow.core.fsm.Machine``, which logs ``pd_producer_transition`` /
``pd_consumer_transition`` and raises ``TransitionError`` (state unchanged) for a pair that is not
listed. Every non-terminal state has a deadline (``TIMEOUT``, or ``LEASE_EXPIRED`` for the
producer's unclaimed hold); the managers in ``producer`` and ``consumer`` set and fire them.
docs/state-machines.md renders both tables (scripts/gen_state_diagram.py).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from kvflow.core.fsm import Machine


class PState(enum.StrEnum):
    """The producer's (P's) side of one hand-off."""

    PREFILLING = "prefilling"  # the request is still computing its KV (concurrent flow)
    STREAMING = "streaming"  # claimed while prefilling: granted, each fenced chunk pushed at once
    READY = "ready"  # KV complete, blocks held for D; nothing granted: the lease may expire
    GRANTED = "granted"  # D's claim accepted: the hold cannot expire; waiting for a send slot
    IN_FLIGHT = "in_flight"  # P's sends run on every rank
    SENT = "sent"  # every rank's send finished; waiting for D's DONE
    DRAINING = "draining"  # failed or aborted while granted: waiting for every send to settle
    RELEASED = "released"  # P's blocks returned to the engine (finished_sending); terminal


class PInput(enum.StrEnum):
    KV_READY = "kv_ready"
    CLAIM = "claim"
    LAUNCH = "launch"
    LOCAL_DONE = "local_done"
    PEER_DONE = "peer_done"
    LEASE_EXPIRED = "lease_expired"
    FAIL = "fail"
    ABORT = "abort"
    PEER_LOST = "peer_lost"
    DRAIN_DONE = "drain_done"
    TIMEOUT = "timeout"


class DState(enum.StrEnum):
    """The consumer's (D's) side of one hand-off."""

    RESERVED = "reserved"  # D's blocks reserved; no claim sent, so P may not write them
    CLAIMING = "claiming"  # CLAIM sent, unanswered: P may write the blocks from now on
    GRANTED = "granted"  # P's grant arrived: the receive must start within the grant window
    IN_FLIGHT = "in_flight"  # receives run on every rank
    LANDED = "landed"  # every rank's part landed and P said DONE: verifying P's hashes
    COMMITTED = "committed"  # KV verified; finished_recving; terminal
    DRAINING = "draining"  # failed or aborted after the claim: waiting for P's answer and receives
    FAILED = "failed"  # no usable KV and nothing can touch the blocks: recompute; terminal
    RELEASED = "released"  # ended by an abort or after a drain; blocks returned; terminal


class DInput(enum.StrEnum):
    CLAIM_SENT = "claim_sent"
    GRANT = "grant"
    NACK = "nack"
    LAUNCH = "launch"
    LANDED = "landed"
    VERIFY_OK = "verify_ok"
    VERIFY_BAD = "verify_bad"
    FAIL = "fail"
    ABORT = "abort"
    TIMEOUT = "timeout"
    PEER_LOST = "peer_lost"
    DRAIN_DONE = "drain_done"


P, PI, D, DI = PState, PInput, DState, DInput

PRODUCER_TRANSITIONS: Mapping[tuple[PState, PInput], PState] = {
    (P.PREFILLING, PI.KV_READY): P.READY,
    (P.PREFILLING, PI.ABORT): P.RELEASED,  # nothing held yet
    (P.PREFILLING, PI.TIMEOUT): P.RELEASED,
    # The concurrent flow: a claim while prefilling is granted at once; chunks are pushed as
    # their KV is fenced (a LAUNCH each), the rest at kv_ready.
    (P.PREFILLING, PI.CLAIM): P.STREAMING,
    (P.STREAMING, PI.LAUNCH): P.STREAMING,
    (P.STREAMING, PI.KV_READY): P.IN_FLIGHT,
    (P.STREAMING, PI.FAIL): P.DRAINING,
    (P.STREAMING, PI.ABORT): P.DRAINING,
    (P.STREAMING, PI.PEER_LOST): P.DRAINING,
    (P.STREAMING, PI.TIMEOUT): P.DRAINING,
    (P.READY, PI.CLAIM): P.GRANTED,
    # Only a hold that was never granted expires; a CLAIM after it gets NACK(expired).
    (P.READY, PI.LEASE_EXPIRED): P.RELEASED,
    (P.READY, PI.ABORT): P.RELEASED,
    (P.READY, PI.PEER_LOST): P.RELEASED,
    (P.GRANTED, PI.LAUNCH): P.IN_FLIGHT,
    (P.GRANTED, PI.FAIL): P.DRAINING,
    (P.GRANTED, PI.ABORT): P.DRAINING,
    (P.GRANTED, PI.PEER_LOST): P.DRAINING,
    (P.GRANTED, PI.TIMEOUT): P.DRAINING,  # no send slot within the grant window
    (P.IN_FLIGHT, PI.LOCAL_DONE): P.SENT,
    (P.IN_FLIGHT, PI.FAIL): P.DRAINING,
    (P.IN_FLIGHT, PI.ABORT): P.DRAINING,
    (P.IN_FLIGHT, PI.PEER_LOST): P.DRAINING,
    (P.IN_FLIGHT, PI.TIMEOUT): P.DRAINING,
    (P.SENT, PI.PEER_DONE): P.RELEASED,
    # Every send has finished: nothing of P's reads the blocks any more.
    (P.SENT, PI.ABORT): P.RELEASED,
    (P.SENT, PI.PEER_LOST): P.RELEASED,
    (P.SENT, PI.TIMEOUT): P.RELEASED,
    (P.DRAINING, PI.DRAIN_DONE): P.RELEASED,
    # Overdue drain: the manager logs, re-sends what it owes and waits again (never frees early).
    (P.DRAINING, PI.TIMEOUT): P.DRAINING,
}
"""The producer's whole protocol. Anything not listed is illegal."""

CONSUMER_TRANSITIONS: Mapping[tuple[DState, DInput], DState] = {
    (D.RESERVED, DI.CLAIM_SENT): D.CLAIMING,
    # Nothing was named to P: the blocks may go back at once.
    (D.RESERVED, DI.ABORT): D.RELEASED,
    (D.RESERVED, DI.TIMEOUT): D.FAILED,
    (D.RESERVED, DI.PEER_LOST): D.FAILED,
    (D.CLAIMING, DI.GRANT): D.GRANTED,
    (D.CLAIMING, DI.NACK): D.FAILED,  # P refused: it never writes these blocks
    (D.CLAIMING, DI.ABORT): D.DRAINING,
    (D.CLAIMING, DI.TIMEOUT): D.DRAINING,
    (D.CLAIMING, DI.PEER_LOST): D.DRAINING,
    (D.CLAIMING, DI.FAIL): D.DRAINING,
    (D.GRANTED, DI.LAUNCH): D.IN_FLIGHT,
    (D.GRANTED, DI.ABORT): D.DRAINING,
    (D.GRANTED, DI.TIMEOUT): D.DRAINING,  # the grant window passed: never launch after it
    (D.GRANTED, DI.PEER_LOST): D.DRAINING,
    (D.GRANTED, DI.FAIL): D.DRAINING,
    (D.IN_FLIGHT, DI.LANDED): D.LANDED,
    (D.IN_FLIGHT, DI.LAUNCH): D.IN_FLIGHT,  # a streamed hand-off's next chunk (READY)
    (D.IN_FLIGHT, DI.ABORT): D.DRAINING,
    (D.IN_FLIGHT, DI.TIMEOUT): D.DRAINING,
    (D.IN_FLIGHT, DI.PEER_LOST): D.DRAINING,
    (D.IN_FLIGHT, DI.FAIL): D.DRAINING,
    (D.LANDED, DI.VERIFY_OK): D.COMMITTED,
    (D.LANDED, DI.VERIFY_BAD): D.FAILED,  # KV of another request: a one-shot miss, recompute
    (D.LANDED, DI.TIMEOUT): D.FAILED,
    (D.DRAINING, DI.DRAIN_DONE): D.RELEASED,
    (D.DRAINING, DI.TIMEOUT): D.DRAINING,  # re-send ABORT, wait again
}
"""The consumer's whole protocol. Anything not listed is illegal."""

PRODUCER_TERMINAL = frozenset({P.RELEASED})
CONSUMER_TERMINAL = frozenset({D.COMMITTED, D.FAILED, D.RELEASED})

PRODUCER_MACHINE: Machine[PState, PInput] = Machine(
    "pd_producer",
    PRODUCER_TRANSITIONS,
    id_field="transfer_id",
    initial=P.PREFILLING,
    terminal=PRODUCER_TERMINAL,
    logger="kvflow.pd.producer",
)
CONSUMER_MACHINE: Machine[DState, DInput] = Machine(
    "pd_consumer",
    CONSUMER_TRANSITIONS,
    id_field="transfer_id",
    initial=D.RESERVED,
    terminal=CONSUMER_TERMINAL,
    logger="kvflow.pd.consumer",
)

__all__ = [
    "CONSUMER_MACHINE",
    "CONSUMER_TERMINAL",
    "CONSUMER_TRANSITIONS",
    "PRODUCER_MACHINE",
    "PRODUCER_TERMINAL",
    "PRODUCER_TRANSITIONS",
    "DInput",
    "DState",
    "PInput",
    "PState",
]
