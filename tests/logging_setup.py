"""Helpers for tests of kvflow's logging: a record-keeping handler and a fresh-process setup."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import structlog


class Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def fresh_logging() -> Iterator[logging.Logger]:
    """structlog unconfigured and a pristine ``kvflow`` logger, as in a new process; restored."""
    was, before = structlog.is_configured(), structlog.get_config()
    root = logging.getLogger("kvflow")
    saved = (root.level, list(root.handlers), root.propagate)
    structlog.reset_defaults()
    root.setLevel(logging.NOTSET)
    root.handlers.clear()
    root.propagate = True
    try:
        yield root
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        root.propagate = saved[2]
        if was:
            structlog.configure(**before)
        else:
            structlog.reset_defaults()


@contextmanager
def no_root_handlers() -> Iterator[None]:
    """The root logger without handlers (pytest's own are put back), as in a process where only
    a host library such as vLLM configured its logger."""
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved
