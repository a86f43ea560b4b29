"""kvflow inside a vLLM process follows vLLM's logging: quiet at the default level, debug on ask.

vLLM configures stdlib logging for its own ``vllm`` logger (when its engine starts, before the
scheduler builds the connector) and never structlog; kvflow's connector lends that logger's
handler and level to the ``kvflow`` logger when vLLM builds it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import logging
from collections.abc import Iterator

from tests.integrations.vllm_fakes import PROMPT
from tests.integrations.vllm_fakes import ManagerRig as Rig
from tests.logging_setup import Records, fresh_logging, no_root_handlers


@pytest.fixture
def vllm_process() -> Iterator[logging.Logger]:
    """structlog unconfigured, the ``kvflow`` logger untouched and vLLM's logging set up with its
    defaults, as in a fresh vLLM server's engine process."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    with fresh_logging() as root:
        configure_logging(LoggingConfig())
        yield root


def _serve_twice(rig: Rig) -> None:
    """A prompt stored to the CPU tier, evicted from the GPU, then loaded back."""
    rig.store_prompt_and_evict_gpu()
    rig.h.add(PROMPT, max_tokens=2)
    rig.run()


def test_default_vllm_run_prints_no_debug_line(
    vllm_process: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    """At vLLM's default level (INFO) a store-and-load run prints no kvflow debug event."""
    with no_root_handlers():  # vLLM's server configures no root handler; pytest does
        rig = Rig()
    assert logging.getLogger("vllm").handlers, "vLLM configured its logger"
    assert logging.getLogger("vllm").getEffectiveLevel() == logging.INFO
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
    handler = Records()
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
