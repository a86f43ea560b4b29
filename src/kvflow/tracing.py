"""Write every structured log event to a JSON-lines file, and read such a file back.

The library never configures logging on import; a program (``kvflow bench --trace``) opts in with
``trace_to(path, now)``, which installs a JSON-lines sink for the duration of a ``with`` block and
restores the previous structlog configuration afterwards (or structlog's unconfigured state, so
kvflow's events go back to stdlib ``logging``). ``now`` is the caller's clock, so traces of a
fake-clock run carry fake times. The sink writes the file only: nothing reaches stdout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import structlog

from kvflow.errors import ConfigError


def _json_line(event: Mapping[str, Any]) -> str:
    return json.dumps(event, default=str) + "\n"


class _JsonLinesSink:
    """A structlog processor chain end that appends one JSON object per event to a file."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def __call__(self, _logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        self._stream.write(_json_line(event_dict))
        raise structlog.DropEvent


@contextmanager
def trace_to(path: Path, now: Callable[[], float]) -> Iterator[None]:
    """Send every structlog event, stamped ``ts=now()``, to ``path`` as JSON lines."""
    was_configured = structlog.is_configured()
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
            if was_configured:
                structlog.configure(**previous)
            else:
                structlog.reset_defaults()


def read_trace_lines(
    path: Path, problems: list[str] | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, event) of a JSON-lines trace.

    A path that is not a readable text file raises ``ConfigError`` at once. A line that is not a
    JSON object (a cut-off last line, what a killed process leaves) raises ``ConfigError`` naming
    it, or, with ``problems`` given, is recorded there as ``"line N: ..."`` and skipped.
    """
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a trace file (kvflow bench --trace FILE)")
    try:
        with path.open("rb") as probe:
            head = probe.read(8192)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from exc
    if b"\0" in head:
        raise ConfigError(f"{path}: a binary file, not a JSON-lines trace")
    with path.open(encoding="utf-8") as stream:
        try:
            for lineno, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError as exc:
                    problem = f"line {lineno}: not a JSON line ({exc.msg})"
                else:
                    if isinstance(event, dict):
                        yield lineno, event
                        continue
                    problem = f"line {lineno}: expected a JSON object"
                if problems is None:
                    raise ConfigError(f"{path}:{problem.removeprefix('line ')}")
                problems.append(problem)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a UTF-8 text file ({exc.reason})") from exc


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    """The events of a JSON-lines trace; a malformed line raises ``ConfigError`` naming it."""
    for _, event in read_trace_lines(path):
        yield event


def merge_traces(path: Path, parts: Mapping[str, Path]) -> int:
    """Write the events of several processes' traces (``parts``: a name per file) to ``path``,
    each with ``process`` set to its name, in ``ts`` order (their clocks must be one: the
    system's monotonic clock is, across processes). A missing part (a process that never
    started) adds nothing, and a cut-off line (a killed process) is skipped; the parts are
    removed. Returns the number of events written."""
    events: list[dict[str, Any]] = []
    for name, part in parts.items():
        if not part.exists():
            continue
        for _, event in read_trace_lines(part, problems=[]):
            event["process"] = name
            events.append(event)
    events.sort(key=lambda e: e.get("ts", 0.0))
    with path.open("w") as stream:
        for event in events:
            stream.write(_json_line(event))
    for part in parts.values():
        if part != path:
            part.unlink(missing_ok=True)
    return len(events)


__all__ = ["merge_traces", "read_trace", "read_trace_lines", "trace_to"]
