"""Fixtures for the CLI and script tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import structlog
import torch


@pytest.fixture(autouse=True)
def _keep_logging_config() -> Iterator[None]:
    """The scripts set structlog, the GIL switch interval and torch's threads for their own
    process; the suite's settings come back (structlog unconfigured again if it was)."""
    was, before = structlog.is_configured(), structlog.get_config()
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    yield
    if was:
        structlog.configure(**before)
    else:
        structlog.reset_defaults()
    sys.setswitchinterval(interval)
    torch.set_num_threads(threads)
