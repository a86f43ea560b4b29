"""``Timeouts``: the worker runtime's configurable bounds on its waits, and their defaults.

Apart from ``kvflow.runtime.deadline`` (which awaits them) so that the connector's configuration
can name the defaults without loading the event loop's modules.
"""

from __future__ import annotations

from attrs import field, frozen

from kvflow.core.validate import timeout_s

DRAIN_TIMEOUT_S = 60.0
"""Default bound on a drain at shutdown: every queued copy submitted and finished."""
FLUSH_TIMEOUT_S = 60.0
"""Default bound on a flush (a preemption waits for every copy handed over)."""
LOAD_TIMEOUT_S = 60.0
"""Default bound on the engine's wait before a forward that reads fenced loads: their copies
submitted (and, where the compute is the host's, landed)."""


def _drain(value: object) -> float:
    return timeout_s("drain_s", value)


def _flush(value: object) -> float:
    return timeout_s("flush_s", value)


def _load(value: object) -> float:
    return timeout_s("load_s", value)


@frozen
class Timeouts:
    """Bounds, in seconds on the runtime's clock, of the waits a worker runtime makes."""

    drain_s: float = field(default=DRAIN_TIMEOUT_S, converter=_drain)
    flush_s: float = field(default=FLUSH_TIMEOUT_S, converter=_flush)
    load_s: float = field(default=LOAD_TIMEOUT_S, converter=_load)


__all__ = ["DRAIN_TIMEOUT_S", "FLUSH_TIMEOUT_S", "LOAD_TIMEOUT_S", "Timeouts"]
