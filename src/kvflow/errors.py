"""The kvflow error hierarchy: one root, few leaves, each naming a class of problem a caller can act on."""

from __future__ import annotations


class KVFlowError(Exception):
    """Root of every error kvflow raises on purpose."""


class ConfigError(KVFlowError, ValueError):
    """A configuration value, argument or input is invalid; the message names it."""


class ProtocolError(KVFlowError):
    """A call came in the wrong order or names what the callee does not know (an unknown running
    request, a load with no pinned hit, a plan bound out of step order); state is unchanged."""


class LayoutError(ConfigError):
    """KV tensors handed to kvflow are inconsistent (shape, stride, device); names the tensor."""


class BlockPoolError(KVFlowError):
    """A block pool was misused (double free, unknown block, caching twice); the pool is unchanged."""


class TransitionError(KVFlowError):
    """An input is illegal in a state machine's current state; the state is unchanged."""

    def __init__(self, machine: str, entity: object, state: str, event: str) -> None:
        self.machine = machine
        self.entity = entity
        self.state = state
        self.event = event
        super().__init__(f"{machine} {entity!r}: input {event!r} is illegal in state {state!r}")


class ReportError(KVFlowError):
    """A worker report is inconsistent: unknown transfer, unknown rank, or a rank reporting twice."""


class BackendError(KVFlowError):
    """A device backend failed or is unavailable (no CUDA, driver too old, copy failed)."""


class PeerError(KVFlowError):
    """A PD peer engine is incompatible (HELLO), silent past a deadline, or gone; the message
    names the peer and what was waited for. The hand-off falls back to local recompute."""


class DeadlineError(BackendError, TimeoutError):
    """A wait ran past its deadline (a copy, a drain, a flush, pinning, another rank); the
    message names what was waited for and for how long."""


class ClosedError(KVFlowError):
    """The runtime, executor or reactor was used after it was closed."""


__all__ = [
    "BackendError",
    "BlockPoolError",
    "ClosedError",
    "ConfigError",
    "DeadlineError",
    "KVFlowError",
    "LayoutError",
    "PeerError",
    "ProtocolError",
    "ReportError",
    "TransitionError",
]
