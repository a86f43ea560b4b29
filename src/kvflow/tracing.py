"""Write every structured log event to a JSON-lines file, and read such a file back.

The library never configures logging on import; a program (``kvflow bench --trace``) opts in with
``trace_to(path, now)``, which installs a JSON-lines sink for the duration of a ``with`` block and
restores the previous structlog configuration afterwards. ``now`` is the caller's clock, so traces
of a fake-clock run carry fake times.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import structlog

from kvflow.errors import ConfigError


class _JsonLinesSink:
    """A structlog processor chain end that appends one JSON object per event to a file."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, _logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        self._stream.write(json.dumps(event_dict, default=str) + "\n")
        raise structlog.DropEvent


@contextmanager
def trace_to(path: Path, now: Callable[[], float]) -> Iterator[None]:
    """Send every structlog event, stamped ``ts=now()``, to ``path`` as JSON lines."""
    previous = structlog.get_config()

    def stamp(_logger: object, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        event_dict["ts"] = now()
        event_dict["level"] = method
        return event_dict

    with path.open("w") as stream:
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, stamp, _JsonLinesSink(stream)],
            wrapper_class=structlog.BoundLogger,
            logger_factory=structlog.ReturnLoggerFactory(),
            cache_logger_on_first_use=False,
        )
        try:
            yield
        finally:
            structlog.configure(**previous)


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a JSON-lines trace; a malformed line raises ``ConfigError`` naming it."""
    with path.open() as stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not a JSON line ({exc.msg})") from exc
            if not isinstance(event, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object")
            yield event


__all__ = ["read_trace", "trace_to"]
