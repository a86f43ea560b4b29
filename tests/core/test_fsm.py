"""Tests of the generic table-driven state machine used by transfers and engine requests."""

from __future__ import annotations

import enum

import pytest
from structlog.testing import capture_logs

from kvflow.core.fsm import Machine
from kvflow.errors import TransitionError


class Light(enum.StrEnum):
    RED = "red"
    GREEN = "green"
    OFF = "off"


class Push(enum.StrEnum):
    GO = "go"
    STOP = "stop"
    UNPLUG = "unplug"


MACHINE: Machine[Light, Push] = Machine(
    "light",
    {
        (Light.RED, Push.GO): Light.GREEN,
        (Light.GREEN, Push.STOP): Light.RED,
        (Light.RED, Push.UNPLUG): Light.OFF,
    },
    id_field="light_id",
    initial=Light.RED,
    terminal=(Light.OFF,),
    logger="test.fsm",
)


def test_legal_pair_returns_the_new_state_and_logs_it() -> None:
    """apply() returns the table's state and logs one debug event with id, fields, from and to."""
    with capture_logs() as logs:
        assert MACHINE.apply(3, Light.RED, Push.GO, cause="test", street="main") is Light.GREEN
    assert logs == [
        {
            "event": "light_transition",
            "log_level": "debug",
            "light_id": 3,
            "street": "main",
            "input": "go",
            "cause": "test",
            "from": "red",
            "to": "green",
        }
    ]


@pytest.mark.parametrize(("state", "event"), [(Light.GREEN, Push.GO), (Light.OFF, Push.STOP)])
def test_illegal_pair_raises_and_logs_a_rejection(state: Light, event: Push) -> None:
    """A pair outside the table raises TransitionError naming machine, entity, state and input."""
    with capture_logs() as logs, pytest.raises(TransitionError) as info:
        MACHINE.apply(4, state, event, cause="test")
    assert (info.value.machine, info.value.entity) == ("light", 4)
    assert (info.value.state, info.value.event) == (state.value, event.value)
    assert [e["event"] for e in logs] == ["light_transition_rejected"]
    assert MACHINE.next_state(state, event) is None


def test_diagram_and_table_are_rendered_from_the_table() -> None:
    """The Mermaid diagram lists every transition; the Markdown table marks illegal pairs."""
    diagram = MACHINE.render_mermaid()
    assert "[*] --> RED" in diagram
    assert "RED --> GREEN: go" in diagram
    assert "OFF --> [*]" in diagram
    table = MACHINE.render_table(Light, Push)
    assert "| **red** | green | — | off |" in table
