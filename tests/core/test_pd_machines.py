"""Tests of the PD producer and consumer tables: every (state, input) pair, reachability, timers."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvflow.core.fsm import Machine
from kvflow.core.pd.machines import (
    CONSUMER_MACHINE,
    CONSUMER_TERMINAL,
    CONSUMER_TRANSITIONS,
    PRODUCER_MACHINE,
    PRODUCER_TERMINAL,
    PRODUCER_TRANSITIONS,
    DInput,
    DState,
    PInput,
    PState,
)
from kvflow.errors import TransitionError

CASES: list[tuple[Machine[Any, Any], Mapping[Any, Any], type[enum.Enum], Any, Any]] = [
    (PRODUCER_MACHINE, PRODUCER_TRANSITIONS, PState, state, event)
    for state, event in itertools.product(PState, PInput)
] + [
    (CONSUMER_MACHINE, CONSUMER_TRANSITIONS, DState, state, event)
    for state, event in itertools.product(DState, DInput)
]


@pytest.mark.parametrize(
    ("machine", "table", "states", "state", "event"),
    CASES,
    ids=[f"{c[0].name}-{c[3].value}-{c[4].value}" for c in CASES],
)
def test_every_pair_follows_the_table(
    machine: Machine[Any, Any],
    table: Mapping[Any, Any],
    states: type[enum.Enum],
    state: Any,
    event: Any,
) -> None:
    """A legal pair returns the table's state and logs one transition; an illegal pair raises
    TransitionError naming the pair and logs a rejection."""
    expected = table.get((state, event))
    with capture_logs() as logs:
        if expected is None:
            with pytest.raises(TransitionError) as info:
                machine.apply("t1", state, event, cause="test", epoch=3)
            assert (info.value.state, info.value.event) == (state.value, event.value)
            assert [e["event"] for e in logs] == [f"{machine.name}_transition_rejected"]
        else:
            assert machine.apply("t1", state, event, cause="test", epoch=3) is expected
            assert logs == [
                {
                    "event": f"{machine.name}_transition",
                    "log_level": "debug",
                    "transfer_id": "t1",
                    "epoch": 3,
                    "input": event.value,
                    "cause": "test",
                    "from": state.value,
                    "to": expected.value,
                }
            ]


@pytest.mark.parametrize(
    ("table", "states", "terminal", "initial"),
    [
        (PRODUCER_TRANSITIONS, PState, PRODUCER_TERMINAL, PState.PREFILLING),
        (CONSUMER_TRANSITIONS, DState, CONSUMER_TERMINAL, DState.RESERVED),
    ],
)
def test_terminal_states_are_final_and_reachable_from_every_state(
    table: Mapping[Any, Any], states: type[enum.Enum], terminal: frozenset[Any], initial: Any
) -> None:
    """No input leaves a terminal state; every state is reachable from the initial state and
    reaches a terminal one."""
    assert not [s for (s, _) in table if s in terminal]
    reach = {initial}
    while True:
        more = {dst for (src, _), dst in table.items() if src in reach} - reach
        if not more:
            break
        reach |= more
    assert reach == set(states)
    back = set(terminal)
    while True:
        more = {src for (src, _), dst in table.items() if dst in back} - back
        if not more:
            break
        back |= more
    assert back == set(states)


def test_every_non_terminal_state_has_a_timer() -> None:
    """Every non-terminal state of both machines has a deadline input (timeout, or the
    producer's lease), so nothing waits forever."""
    for state in set(PState) - PRODUCER_TERMINAL:
        assert {(state, PInput.TIMEOUT), (state, PInput.LEASE_EXPIRED)} & set(PRODUCER_TRANSITIONS)
    for d_state in set(DState) - CONSUMER_TERMINAL:
        assert (d_state, DInput.TIMEOUT) in CONSUMER_TRANSITIONS


def test_granted_holds_never_expire_and_claimed_blocks_never_free_directly() -> None:
    """The rules of PD.md §1 as properties of the tables: only READY has a lease; a granted or
    in-flight producer reaches RELEASED only through DRAINING (or after every send, SENT); a
    consumer that claimed frees only via DRAINING or P's NACK (P never writes after refusing)."""
    assert [s for (s, e) in PRODUCER_TRANSITIONS if e is PInput.LEASE_EXPIRED] == [PState.READY]
    for state in (PState.GRANTED, PState.IN_FLIGHT):
        assert PState.RELEASED not in {
            d for (s, _), d in PRODUCER_TRANSITIONS.items() if s is state
        }
    ends = {DState.FAILED, DState.RELEASED, DState.COMMITTED}
    for (src, event), dst in CONSUMER_TRANSITIONS.items():
        claimed = src in (DState.CLAIMING, DState.GRANTED, DState.IN_FLIGHT)
        if claimed and dst in ends and event is not DInput.NACK:
            pytest.fail(f"{src} --{event}--> {dst} frees claimed blocks without draining")
    assert [(s, d) for (s, e), d in CONSUMER_TRANSITIONS.items() if e is DInput.NACK] == [
        (DState.CLAIMING, DState.FAILED)
    ]
