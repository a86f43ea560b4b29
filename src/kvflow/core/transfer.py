"""The transfer state machine: one table of legal (state, input) → state pairs and one function
that applies it, logs the transition and raises ``TransitionError`` for anything else.

Every load (CPU → GPU) and store (GPU → CPU) kvflow runs is a ``Transfer`` driven through this
table, on the scheduler side and on each worker.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import define

from kvflow.core.fsm import Machine


class Direction(enum.StrEnum):
    """Which way a transfer moves KV."""

    STORE = "store"  # GPU → CPU
    LOAD = "load"  # CPU → GPU


class TransferState(enum.StrEnum):
    PENDING = "pending"  # decided, not yet handed to the workers
    IN_FLIGHT = "in_flight"  # handed to the workers; copies queued or running
    COMMITTED = "committed"  # every rank reported the copy done
    FAILED = "failed"  # a device error or a rank reported failure
    ABANDONED = "abandoned"  # nobody wants the result any more; waiting for the device to finish
    RELEASED = "released"  # references dropped; terminal


class TransferInput(enum.StrEnum):
    LAUNCH = "launch"  # put into a step plan
    CANCEL = "cancel"  # dropped before launch
    COMPLETE = "complete"  # every rank reported success
    FAIL = "fail"  # a device error or a rank reported failure
    ABANDON = "abandon"  # reset, preemption or the request went away while in flight
    RELEASE = "release"  # references dropped after commit or failure


S, In = TransferState, TransferInput

TRANSITIONS: Mapping[tuple[TransferState, TransferInput], TransferState] = {
    (S.PENDING, In.LAUNCH): S.IN_FLIGHT,
    (S.PENDING, In.CANCEL): S.RELEASED,
    (S.IN_FLIGHT, In.COMPLETE): S.COMMITTED,
    (S.IN_FLIGHT, In.FAIL): S.FAILED,
    (S.IN_FLIGHT, In.ABANDON): S.ABANDONED,
    (S.COMMITTED, In.RELEASE): S.RELEASED,
    (S.FAILED, In.RELEASE): S.RELEASED,
    # An abandoned transfer's result is discarded whichever way the device finishes.
    (S.ABANDONED, In.COMPLETE): S.RELEASED,
    (S.ABANDONED, In.FAIL): S.RELEASED,
}
"""The whole protocol. Anything not listed is illegal."""

TERMINAL_STATES = frozenset({S.RELEASED})


@define(eq=False)
class Transfer:
    """One load or store of one request's blocks, identified by ``transfer_id``."""

    transfer_id: int
    direction: Direction
    request_id: str
    state: TransferState = TransferState.PENDING

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


_DIRECTION_NAMES = {d: d.value for d in Direction}
"""``Direction.value`` is a Python-level property: a dict lookup is cheaper."""


def _fields(transfer: Transfer) -> tuple[object, dict[str, object]]:
    return transfer.transfer_id, {
        "request_id": transfer.request_id,
        "direction": _DIRECTION_NAMES[transfer.direction],
    }


TRANSFER_MACHINE: Machine[TransferState, TransferInput] = Machine(
    "transfer",
    TRANSITIONS,
    id_field="transfer_id",
    initial=TransferState.PENDING,
    terminal=TERMINAL_STATES,
    logger="kvflow.transfer",
    fields=_fields,
)

apply = TRANSFER_MACHINE.fire
"""``apply(transfer, input, cause=...)``: apply one input to ``transfer`` by the table; log it;
store and return the new state. An illegal pair raises ``TransitionError`` and leaves the
transfer unchanged."""

apply_seq = TRANSFER_MACHINE.fire_seq
"""``apply_seq(transfer, ((input, cause), ...))``: ``apply`` of each in turn (a transfer that
settles: complete, then release), each transition logged; if any is illegal, raises before any
is applied."""


def render_mermaid() -> str:
    """A Mermaid state diagram of the table, for docs/state-machines.md."""
    return TRANSFER_MACHINE.render_mermaid()


def render_table() -> str:
    """A Markdown table of every (state, input) pair: the new state, or a dash where illegal."""
    return TRANSFER_MACHINE.render_table(TransferState, TransferInput)


__all__ = [
    "TERMINAL_STATES",
    "TRANSFER_MACHINE",
    "TRANSITIONS",
    "Direction",
    "Transfer",
    "TransferInput",
    "TransferState",
    "apply",
    "apply_seq",
    "render_mermaid",
    "render_table",
]
