"""Tests of the generic table-driven state machine used by transfers and engine requests."""

from __future__ import annotations

import enum
from typing import Any

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


class Lamp:
    """An entity that holds its own state, for ``fire``."""

    def __init__(self, lamp_id: int, state: Light) -> None:
        self.lamp_id = lamp_id
        self.state = state


def _lamp_fields(lamp: Lamp) -> tuple[object, dict[str, Any]]:
    return lamp.lamp_id, {"street": "main"}


LAMPS: Machine[Light, Push] = Machine(
    "light",
    MACHINE.transitions,
    id_field="light_id",
    initial=Light.RED,
    terminal=(Light.OFF,),
    logger="test.fsm",
    fields=_lamp_fields,
)


def test_fire_stores_the_new_state_and_logs_what_apply_logs() -> None:
    """fire() writes the table's state into the entity and logs exactly apply()'s event, its id
    and fields taken from the machine's ``fields``."""
    lamp = Lamp(3, Light.RED)
    with capture_logs() as fired:
        assert LAMPS.fire(lamp, Push.GO, cause="test") is Light.GREEN
    with capture_logs() as applied:
        MACHINE.apply(3, Light.RED, Push.GO, cause="test", street="main")
    assert lamp.state is Light.GREEN
    assert fired == applied


@pytest.mark.parametrize(("state", "event"), [(Light.GREEN, Push.GO), (Light.OFF, Push.STOP)])
def test_fire_of_an_illegal_pair_raises_and_leaves_the_entity(state: Light, event: Push) -> None:
    """An illegal pair raises TransitionError naming the entity's id and logs the rejection;
    the entity keeps its state."""
    lamp = Lamp(4, state)
    with capture_logs() as logs, pytest.raises(TransitionError) as info:
        LAMPS.fire(lamp, event, cause="test")
    assert (info.value.entity, info.value.state) == (4, state.value)
    assert lamp.state is state
    assert [(e["event"], e["street"]) for e in logs] == [("light_transition_rejected", "main")]


def test_fire_seq_applies_all_or_nothing_and_logs_each_step() -> None:
    """fire_seq() stores the last state and logs each transition in order; with an illegal pair
    anywhere in the sequence it raises before storing anything."""
    lamp = Lamp(5, Light.RED)
    with capture_logs() as logs:
        assert LAMPS.fire_seq(lamp, ((Push.GO, "a"), (Push.STOP, "b"))) is Light.RED
    assert [(e["from"], e["to"], e["cause"]) for e in logs] == [
        ("red", "green", "a"),
        ("green", "red", "b"),
    ]
    with pytest.raises(TransitionError):
        LAMPS.fire_seq(lamp, ((Push.GO, "a"), (Push.GO, "b")))
    assert lamp.state is Light.RED


def test_fire_needs_a_machine_built_with_fields() -> None:
    """A machine without ``fields`` cannot name the entity it would log: fire() says so."""
    with capture_logs(), pytest.raises(TypeError, match="fields"):
        MACHINE.fire(Lamp(6, Light.GREEN), Push.GO, cause="test")


def test_diagram_and_table_are_rendered_from_the_table() -> None:
    """The Mermaid diagram lists every transition; the Markdown table marks illegal pairs."""
    diagram = MACHINE.render_mermaid()
    assert "[*] --> RED" in diagram
    assert "RED --> GREEN: go" in diagram
    assert "OFF --> [*]" in diagram
    table = MACHINE.render_table(Light, Push)
    assert "| **red** | green | — | off |" in table
