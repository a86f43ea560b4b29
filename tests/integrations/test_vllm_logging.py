"""kvflow inside a vLLM process follows vLLM's logging: quiet at the default level, debug on ask.

vLLM configures stdlib logging for its own ``vllm`` logger and never structlog; kvflow's connector
lends that logger's handler and level to the ``kvflow`` logger when vLLM builds it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import logging
from collections.abc import Iterator

import structlog

from tests.integrations.test_vllm_scenarios import PROMPT, Rig


class _Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def vllm_process() -> Iterator[logging.Logger]:
    """structlog unconfigured and the ``kvflow`` logger untouched, as in a fresh vLLM server."""
    was, before = structlog.is_configured(), structlog.get_config()
    root = logging.getLogger("kvflow")
    saved = (root.level, list(root.handlers), root.propagate)
    structlog.reset_defaults()
    root.setLevel(logging.NOTSET)
    root.handlers.clear()
    root.propagate = True
    yield root
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    root.propagate = saved[2]
    if was:
        structlog.configure(**before)


def _serve_twice(rig: Rig) -> None:
    """A prompt stored to the CPU tier, evicted from the GPU, then loaded back."""
    rig.store_prompt_and_evict_gpu()
    rig.h.add(PROMPT, max_tokens=2)
    rig.run()


def test_default_vllm_run_prints_no_debug_line(
    vllm_process: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    """At vLLM's default level (INFO) a store-and-load run prints no kvflow debug event."""
    rig = Rig()
    assert logging.getLogger("vllm").handlers, "vLLM configured its logger on import"
    assert vllm_process.handlers == logging.getLogger("vllm").handlers, "vLLM's handler lent"
    assert vllm_process.getEffectiveLevel() == logging.getLogger("vllm").getEffectiveLevel()
    _serve_twice(rig)
    assert any(p.loads for p in rig.runtime.plans), "transfers ran"
    out, err = capfd.readouterr()
    assert "transfer_transition" not in out + err
    assert "[debug" not in out + err
    assert "DEBUG" not in out + err


def test_kvflow_logger_at_debug_sends_debug_events_to_the_handler(
    vllm_process: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    """With the ``kvflow`` logger at DEBUG, transitions reach its handler and not stdout."""
    handler = _Records()
    vllm_process.addHandler(handler)
    vllm_process.setLevel(logging.DEBUG)
    vllm_process.propagate = False
    rig = Rig()
    assert vllm_process.handlers == [handler], "an application's own setup is kept"
    _serve_twice(rig)
    events = [getattr(r, "kvflow_event", None) for r in handler.records]
    assert "transfer_transition" in events
    assert any(r.levelno == logging.DEBUG for r in handler.records)
    out, err = capfd.readouterr()
    assert "transfer_transition" not in out + err
