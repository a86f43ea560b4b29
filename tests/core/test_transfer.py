"""Tests of the transfer state machine: every (state, input) pair, logging, and the generated doc."""

from __future__ import annotations

import itertools
import runpy
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvflow.core.transfer import (
    TRANSITIONS,
    Direction,
    Transfer,
    TransferInput,
    TransferState,
    apply,
    apply_seq,
)
from kvflow.errors import TransitionError

ROOT = Path(__file__).resolve().parents[2]
ALL_PAIRS = list(itertools.product(TransferState, TransferInput))


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS, ids=lambda x: str(x))
def test_every_pair_follows_the_table(state: TransferState, event: TransferInput) -> None:
    """Legal pairs move to the table's state and log once; illegal ones raise and change nothing."""
    t = Transfer(7, Direction.STORE, "req-1", state)
    expected = TRANSITIONS.get((state, event))
    with capture_logs() as logs:
        if expected is None:
            with pytest.raises(TransitionError) as info:
                apply(t, event, cause="test")
            assert t.state is state
            assert info.value.state == state.value
            assert info.value.event == event.value
            assert [e["event"] for e in logs] == ["transfer_transition_rejected"]
        else:
            assert apply(t, event, cause="test") is expected
            assert t.state is expected
            assert logs == [
                {
                    "event": "transfer_transition",
                    "log_level": "debug",
                    "transfer_id": 7,
                    "request_id": "req-1",
                    "direction": "store",
                    "input": event.value,
                    "cause": "test",
                    "from": state.value,
                    "to": expected.value,
                }
            ]


@pytest.mark.parametrize(("first", "second"), list(itertools.product(TransferInput, repeat=2)))
def test_a_sequence_applies_like_single_inputs_or_changes_nothing(
    first: TransferInput, second: TransferInput
) -> None:
    """Two inputs applied as one sequence from IN_FLIGHT log the same transitions and end in
    the same state as applied one by one; if either is illegal, the sequence raises for it and
    leaves the transfer unchanged (one by one may have applied the first)."""
    one = Transfer(3, Direction.LOAD, "req-2", TransferState.IN_FLIGHT)
    with capture_logs() as single:
        try:
            apply(one, first, cause="a")
            apply(one, second, cause="b")
            legal = True
        except TransitionError:
            legal = False
    seq = Transfer(3, Direction.LOAD, "req-2", TransferState.IN_FLIGHT)
    with capture_logs() as both:
        if legal:
            assert apply_seq(seq, ((first, "a"), (second, "b"))) is one.state
        else:
            with pytest.raises(TransitionError):
                apply_seq(seq, ((first, "a"), (second, "b")))
    if legal:
        assert seq.state is one.state
        assert both == single
    else:
        assert seq.state is TransferState.IN_FLIGHT
        assert [e["event"] for e in both] == ["transfer_transition_rejected"]
        assert both[0] == single[-1]


def test_released_is_terminal_and_reachable_from_everywhere() -> None:
    """No input leaves RELEASED, and every state has a path to RELEASED."""
    assert not [e for (s, e) in TRANSITIONS if s is TransferState.RELEASED]
    reach = {TransferState.RELEASED}
    changed = True
    while changed:
        changed = False
        for (src, _), dst in TRANSITIONS.items():
            if dst in reach and src not in reach:
                reach.add(src)
                changed = True
    assert reach == set(TransferState)


def test_brief_lifecycles() -> None:
    """The brief's paths: commit, failure, cancel before launch, abandon while in flight."""
    paths = [
        ([TransferInput.LAUNCH, TransferInput.COMPLETE, TransferInput.RELEASE], True),
        ([TransferInput.LAUNCH, TransferInput.FAIL, TransferInput.RELEASE], True),
        ([TransferInput.CANCEL], True),
        ([TransferInput.LAUNCH, TransferInput.ABANDON, TransferInput.COMPLETE], True),
        ([TransferInput.LAUNCH, TransferInput.ABANDON, TransferInput.FAIL], True),
    ]
    for inputs, ends_released in paths:
        t = Transfer(1, Direction.LOAD, "r")
        for event in inputs:
            apply(t, event, cause="path")
        assert t.done is ends_released


def test_state_machine_doc_is_up_to_date() -> None:
    """docs/state-machines.md is exactly what scripts/gen_state_diagram.py renders from the table."""
    script = runpy.run_path(str(ROOT / "scripts" / "gen_state_diagram.py"))
    rendered = script["render"]()
    committed = (ROOT / "docs" / "state-machines.md").read_text()
    assert committed == rendered, "run: python scripts/gen_state_diagram.py"
