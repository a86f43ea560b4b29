"""kvflow's loggers: structlog's when the application configured structlog, else stdlib ``logging``.

Every kvflow module takes its logger from ``get_logger("kvflow.<part>")``. An event goes, at the
moment it is logged:

- through structlog's configured chain when ``structlog.is_configured()`` (an application that set
  structlog up, ``kvflow bench --trace``, ``structlog.testing.capture_logs()``);
- otherwise through stdlib ``logging``, to the logger of the same name under ``kvflow``: the host
  application's levels, handlers and format apply (Python's default shows WARNING and above; a
  host such as vLLM lends its own with ``follow_host_logging``). structlog's unconfigured default
  would print every debug event to stdout, thousands of lines a second inside a busy server.

The library never configures logging on import. ``debug_enabled()`` is the hot paths' guard: it
answers without building the event, from the ``kvflow`` logger's effective level when structlog is
unconfigured, or from structlog's configured wrapper class. Calling a method on
``structlog.get_logger()``'s lazy proxy assembles a bound logger each time unless the application
configured ``cache_logger_on_first_use`` (about 10 µs, spent even when the level filters the event
out). Under structlog the guard says False only for structlog's own filtering loggers
(``make_filtering_bound_logger``) above DEBUG; any other wrapper class counts as enabled, so the
event is built and the configured chain decides, exactly as without the guard.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

try:
    # structlog's own ``is_configured()`` reads this flag; read here, the hot paths' guard is
    # one call instead of three (``test_debug_enabled_follows_every_configuration`` holds it
    # to the public functions).
    from structlog._config import _CONFIG

    _STRUCTLOG_CONFIG: Any = _CONFIG
except ImportError:  # pragma: no cover - a structlog without it: the public call
    _STRUCTLOG_CONFIG = None

_FILTERING_LEVELS: dict[object, int] = {
    structlog.make_filtering_bound_logger(level): level
    for level in (
        logging.NOTSET,
        logging.DEBUG,
        logging.INFO,
        logging.WARNING,
        logging.ERROR,
        logging.CRITICAL,
    )
}

ROOT = "kvflow"
"""The stdlib logger every kvflow logger sits under."""


_ROOT_LOGGER = logging.getLogger(ROOT)


def _structlog_debug_enabled() -> bool:
    level = _FILTERING_LEVELS.get(structlog.get_config()["wrapper_class"])
    return level is None or level <= logging.DEBUG


def debug_enabled() -> bool:
    """Whether a ``log.debug(...)`` call on the ``kvflow`` logger can emit."""
    if not structlog.is_configured():
        return _ROOT_LOGGER.isEnabledFor(logging.DEBUG)
    return _structlog_debug_enabled()


class _Rendered:
    """``event key=value ...``, built only if a stdlib handler formats the record."""

    __slots__ = ("event", "fields")

    def __init__(self, event: str, fields: dict[str, Any]) -> None:
        self.event = event
        self.fields = fields

    def __str__(self) -> str:
        parts = [self.event]
        for key, value in self.fields.items():
            shown = repr(value) if isinstance(value, str) and (not value or " " in value) else value
            parts.append(f"{key}={shown}")
        return " ".join(parts)


class Logger:
    """One kvflow module's logger: ``debug``/``info``/``warning``/``error``/``exception``."""

    __slots__ = ("_proxy", "_stdlib", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        # structlog's lazy proxy reads structlog's configuration at each call, so an application
        # that configures structlog after kvflow was imported is followed.
        self._proxy = structlog.get_logger(name)
        self._stdlib = logging.getLogger(name)

    def debug_enabled(self) -> bool:
        """Whether ``self.debug(...)`` can emit: the guard before building a costly event."""
        config = _STRUCTLOG_CONFIG
        if not (config.is_configured if config is not None else structlog.is_configured()):
            # ``isEnabledFor``'s own answer cache, read without its call; a miss (a level just
            # changed) asks it. A logger ``disabled`` by ``logging.config`` may say True here:
            # its ``debug`` then builds the event and ``logging`` drops it.
            enabled = self._stdlib._cache.get(logging.DEBUG)  # type: ignore[attr-defined]
            return enabled if enabled is not None else self._stdlib.isEnabledFor(logging.DEBUG)
        return _structlog_debug_enabled()

    def _emit(self, level: int, event: str, fields: dict[str, Any], exc: bool = False) -> None:
        if self._stdlib.isEnabledFor(level):
            exc_info = fields.pop("exc_info", exc)
            self._stdlib.log(
                level,
                "%s",
                _Rendered(event, fields),
                exc_info=exc_info,
                extra={"kvflow_event": event, "kvflow_fields": fields},
                stacklevel=3,  # the record names kvflow's call site, not this module
            )

    def debug(self, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            self._proxy.debug(event, **fields)
        else:
            self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            self._proxy.info(event, **fields)
        else:
            self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            self._proxy.warning(event, **fields)
        else:
            self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            self._proxy.error(event, **fields)
        else:
            self._emit(logging.ERROR, event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """``error`` with the exception being handled attached."""
        if structlog.is_configured():
            self._proxy.exception(event, **fields)
        else:
            self._emit(logging.ERROR, event, fields, exc=True)


def get_logger(name: str) -> Logger:
    """The logger of kvflow module ``name``, a dotted name under ``kvflow`` ("kvflow.worker")."""
    return Logger(name)


def follow_host_logging(host: logging.Logger) -> bool:
    """Give the ``kvflow`` logger ``host``'s level and handlers, unless something configured it.

    For a host that configures only its own logger (vLLM sets up ``vllm`` with its handler, format
    and ``VLLM_LOGGING_LEVEL``): kvflow's stdlib events then read like the host's. Called when the
    host builds kvflow's connector, never on import. A no-op when structlog is configured, the
    ``kvflow`` logger already has a level or handlers, or the root logger has handlers (then the
    application configured logging, and kvflow's events propagate there). Returns whether it
    changed anything.
    """
    mine = logging.getLogger(ROOT)
    if structlog.is_configured() or mine.level != logging.NOTSET or mine.handlers:
        return False
    if logging.getLogger().handlers:
        return False
    if not host.handlers:
        return False
    mine.setLevel(host.getEffectiveLevel())
    for handler in host.handlers:
        mine.addHandler(handler)
    mine.propagate = host.propagate
    return True


__all__ = ["ROOT", "Logger", "debug_enabled", "follow_host_logging", "get_logger"]
