"""A cheap test of whether structlog would emit a debug event, for kvflow's per-step hot paths.

Calling a method on ``structlog.get_logger()``'s lazy proxy assembles a new bound logger each time
unless the application configured ``cache_logger_on_first_use``: about 10 µs, spent even when the
configured level filters the event out. ``debug_enabled()`` answers from the configured wrapper
class alone, without binding anything. It says False only for structlog's own filtering loggers
(``make_filtering_bound_logger``) above DEBUG; any other wrapper class (structlog's defaults, the
stdlib integration, kvflow's tracing) counts as enabled, so the event is built and the configured
chain decides, exactly as without the guard. ``structlog.testing.capture_logs()`` keeps the
wrapper class, so tests see every debug event.
"""

from __future__ import annotations

import logging

import structlog

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


def debug_enabled() -> bool:
    """Whether a ``log.debug(...)`` call through structlog's configured loggers can emit."""
    level = _FILTERING_LEVELS.get(structlog.get_config()["wrapper_class"])
    return level is None or level <= logging.DEBUG


__all__ = ["debug_enabled"]
