"""Table-driven state machines: one table of legal (state, input) → state pairs, one function that
applies it, logs the transition and raises ``TransitionError`` for any other pair.

kvflow's transfer state machine and the reference engine's request state machine are both
``Machine``\\ s; their diagrams in docs/state-machines.md are rendered from the tables.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from kvflow.core.logs import get_logger
from kvflow.errors import TransitionError

S = TypeVar("S", bound=enum.Enum)
I = TypeVar("I", bound=enum.Enum)  # noqa: E741 - the conventional name for an input type


class Stateful(Protocol[S]):
    """An entity whose state a ``Machine`` keeps: ``fire`` reads and writes ``state``."""

    state: S


class Machine(Generic[S, I]):
    """A named transition table and the one function that applies it.

    ``apply`` logs ``<name>_transition`` at debug level with the entity's id field, the fields
    given, ``input``, ``cause``, ``from`` and ``to``; an illegal pair logs
    ``<name>_transition_rejected`` at warning level and raises ``TransitionError``.

    ``fire`` and ``fire_seq`` do the same on an entity that holds its state, for machines built
    with ``fields`` (the entity's id and logged fields, read only when an event is built): a
    transfer passes here several times a step, so the hot path is one call that builds nothing
    for a filtered event.
    """

    def __init__(
        self,
        name: str,
        transitions: Mapping[tuple[S, I], S],
        *,
        id_field: str,
        initial: S,
        terminal: Iterable[S],
        logger: str,
        fields: Callable[[Any], tuple[object, dict[str, Any]]] | None = None,
    ) -> None:
        self.name = name
        self._fields = fields
        self.transitions = transitions
        self.id_field = id_field
        self.initial = initial
        self.terminal = frozenset(terminal)
        self._log = get_logger(logger)

    def next_state(self, state: S, event: I) -> S | None:
        """The state ``event`` leads to from ``state``, or None if the pair is illegal."""
        return self.transitions.get((state, event))

    def apply(self, entity_id: object, state: S, event: I, *, cause: str, **fields: Any) -> S:
        """The new state for ``event`` in ``state``; the caller stores it. Illegal: raises."""
        new = self.transitions.get((state, event))
        if new is None:
            self._reject(entity_id, fields, state, event, cause)
        # Transfers pass here several times a step: skip building an event that is filtered.
        if self._log.debug_enabled():
            self._logged(entity_id, fields, state, event, new, cause)
        return new

    def fire(self, entity: Stateful[S], event: I, *, cause: str) -> S:
        """``apply`` to ``entity``'s own state, stored back; its id and fields come from the
        machine's ``fields``. Illegal: raises, the entity unchanged."""
        state = entity.state
        new = self.transitions.get((state, event))
        if new is None:
            self._reject(*self._described(entity), state, event, cause)
        if self._log.debug_enabled():
            self._logged(*self._described(entity), state, event, new, cause)
        entity.state = new
        return new

    def fire_seq(self, entity: Stateful[S], steps: Sequence[tuple[I, str]]) -> S:
        """``fire`` of each ``(input, cause)`` in turn, logged one by one; the final state,
        stored back. If any pair is illegal, raises for it before any is applied (the entity
        keeps its state). One look at the log level for them all: a transfer settling takes two
        at once."""
        transitions = self.transitions
        state = new = entity.state
        for event, cause in steps:
            after = transitions.get((new, event))
            if after is None:
                self._reject(*self._described(entity), new, event, cause)
            new = after
        if self._log.debug_enabled():
            entity_id, fields = self._described(entity)
            for event, cause in steps:
                after = transitions[(state, event)]
                self._logged(entity_id, fields, state, event, after, cause)
                state = after
        entity.state = new
        return new

    def _described(self, entity: object) -> tuple[object, dict[str, Any]]:
        if self._fields is None:
            raise TypeError(f"{self.name}: fire needs a machine built with fields")
        return self._fields(entity)

    def _reject(
        self, entity_id: object, fields: dict[str, Any], state: S, event: I, cause: str
    ) -> NoReturn:
        self._log.warning(
            f"{self.name}_transition_rejected",
            **{self.id_field: entity_id},
            **fields,
            state=state.value,
            input=event.value,
            cause=cause,
        )
        raise TransitionError(self.name, entity_id, str(state.value), str(event.value))

    def _logged(
        self,
        entity_id: object,
        fields: dict[str, Any],
        state: S,
        event: I,
        new: S,
        cause: str,
    ) -> None:
        self._log.debug(
            f"{self.name}_transition",
            **{self.id_field: entity_id},
            **fields,
            input=event.value,
            cause=cause,
            **{"from": state.value, "to": new.value},
        )

    def render_mermaid(self) -> str:
        """A Mermaid state diagram of the table."""
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial.name}"]
        for (src, event), dst in self.transitions.items():
            lines.append(f"    {src.name} --> {dst.name}: {event.value}")
        for state in sorted(self.terminal, key=lambda s: s.name):
            lines.append(f"    {state.name} --> [*]")
        return "\n".join(lines) + "\n"

    def render_table(self, states: Iterable[S], inputs: Iterable[I]) -> str:
        """A Markdown table of every (state, input) pair: the new state, or a dash if illegal."""
        inputs = list(inputs)
        rows = [
            "| state \\ input | " + " | ".join(str(i.value) for i in inputs) + " |",
            "|" + "---|" * (len(inputs) + 1),
        ]
        for state in states:
            cells = [
                str(dst.value) if (dst := self.transitions.get((state, i))) is not None else "—"
                for i in inputs
            ]
            rows.append(f"| **{state.value}** | " + " | ".join(cells) + " |")
        return "\n".join(rows) + "\n"


__all__ = ["Machine", "Stateful"]
