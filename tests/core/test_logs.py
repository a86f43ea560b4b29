"""kvflow's loggers follow the host: stdlib ``logging`` unless structlog is configured."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from kvflow.core import logs
from kvflow.core.transfer import Direction, Transfer, TransferInput, apply
from tests.logging_setup import Records, fresh_logging, no_root_handlers


@pytest.fixture
def unconfigured() -> Iterator[logging.Logger]:
    """structlog as in a process that never configured it, and a pristine ``kvflow`` logger."""
    with fresh_logging() as root:
        yield root


def _transition() -> None:
    apply(Transfer(7, Direction.STORE, "req-7"), TransferInput.LAUNCH, cause="test")


def test_unconfigured_debug_event_is_dropped_at_the_default_level(
    unconfigured: logging.Logger, capfd: pytest.CaptureFixture[str]
) -> None:
    """Without any configuration a transition's debug event prints nothing (stdlib: WARNING)."""
    assert not logs.debug_enabled()
    _transition()
    logs.get_logger("kvflow.test").debug("some_debug_event", n=1)
    out, err = capfd.readouterr()
    assert out == err == ""


def test_unconfigured_events_reach_stdlib_handlers_at_their_level(
    unconfigured: logging.Logger,
) -> None:
    """With the kvflow logger at DEBUG, events arrive as stdlib records with their fields."""
    handler = Records()
    unconfigured.addHandler(handler)
    unconfigured.setLevel(logging.DEBUG)
    assert logs.debug_enabled()
    _transition()
    logs.get_logger("kvflow.test").info("spaced", why="two words")
    first, second = handler.records
    assert first.name == "kvflow.transfer"
    assert first.levelno == logging.DEBUG
    assert first.getMessage().startswith("transfer_transition transfer_id=7 request_id=req-7")
    assert first.kvflow_event == "transfer_transition"  # type: ignore[attr-defined]
    assert first.kvflow_fields["to"] == "in_flight"  # type: ignore[attr-defined]
    assert first.pathname.endswith("fsm.py"), "the record names kvflow's call site"
    assert second.getMessage() == "spaced why='two words'"


def test_child_logger_level_is_its_own(unconfigured: logging.Logger) -> None:
    """A kvflow module's logger set to DEBUG emits debug events while the others stay quiet."""
    handler = Records()
    unconfigured.addHandler(handler)
    child = logging.getLogger("kvflow.transfer")
    child.setLevel(logging.DEBUG)
    try:
        assert logs.get_logger("kvflow.transfer").debug_enabled()
        assert not logs.get_logger("kvflow.worker").debug_enabled()
        _transition()
        logs.get_logger("kvflow.worker").debug("quiet")
    finally:
        child.setLevel(logging.NOTSET)
    assert [r.kvflow_event for r in handler.records] == ["transfer_transition"]  # type: ignore[attr-defined]


def test_exception_attaches_the_exception_being_handled(unconfigured: logging.Logger) -> None:
    """``log.exception`` gives the stdlib record the exception's info."""
    handler = Records()
    unconfigured.addHandler(handler)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logs.get_logger("kvflow.test").exception("it_failed", n=2)
    (record,) = handler.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


def test_configured_structlog_takes_the_events(unconfigured: logging.Logger) -> None:
    """An application that configures structlog gets kvflow's events; stdlib sees none."""
    handler = Records()
    unconfigured.addHandler(handler)
    unconfigured.setLevel(logging.DEBUG)
    seen: list[str] = []

    def keep(_logger: object, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        seen.append(str(event_dict["event"]))
        raise structlog.DropEvent

    structlog.configure(
        processors=[keep], wrapper_class=structlog.make_filtering_bound_logger(logging.INFO)
    )
    assert not logs.debug_enabled(), "structlog's own filter at INFO decides"
    _transition()
    logs.get_logger("kvflow.test").info("visible")
    assert seen == ["visible"]
    assert handler.records == []


def test_capture_logs_sees_debug_events_with_stdlib_quiet(unconfigured: logging.Logger) -> None:
    """``structlog.testing.capture_logs`` captures debug events whatever stdlib's level is."""
    with capture_logs() as captured:
        _transition()
    assert [e["event"] for e in captured] == ["transfer_transition"]


def test_debug_enabled_follows_every_configuration(unconfigured: logging.Logger) -> None:
    """The hot paths' guard answers as the public calls do (``structlog.is_configured`` and the
    stdlib logger's ``isEnabledFor``), through level changes, ``logging.disable`` and structlog
    being configured and reset."""
    log = logs.get_logger("kvflow.transfer")
    stdlib = logging.getLogger("kvflow.transfer")

    def public() -> bool:
        if not structlog.is_configured():
            return stdlib.isEnabledFor(logging.DEBUG)
        return logs._structlog_debug_enabled()

    changes: list[Callable[[], object]] = [
        lambda: None,
        lambda: unconfigured.setLevel(logging.DEBUG),
        lambda: stdlib.setLevel(logging.INFO),
        lambda: stdlib.setLevel(logging.NOTSET),
        lambda: logging.disable(logging.DEBUG),
        lambda: logging.disable(logging.NOTSET),
        lambda: structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)
        ),
        lambda: structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
        ),
        structlog.reset_defaults,
        lambda: unconfigured.setLevel(logging.WARNING),
    ]
    seen: list[bool] = []
    for change in changes:
        change()
        assert log.debug_enabled() == public()
        log.debug_enabled()  # a second answer, from the cache
        assert log.debug_enabled() == public()
        seen.append(public())
    assert True in seen, "an enabled answer was exercised"
    assert False in seen, "a disabled answer was exercised"


def test_follow_host_logging_lends_the_hosts_handlers_once(unconfigured: logging.Logger) -> None:
    """The kvflow logger takes an unconfigured host's level and handlers; a set level wins."""
    host = logging.getLogger("test_host_app")
    handler = Records()
    host.addHandler(handler)
    host.setLevel(logging.INFO)
    host.propagate = False
    try:
        with no_root_handlers():
            assert logs.follow_host_logging(host)
            assert unconfigured.level == logging.INFO
            assert unconfigured.handlers == [handler]
            assert not logs.follow_host_logging(host), "already set up: a no-op"
            _transition()
            logs.get_logger("kvflow.test").info("shown")
            assert [r.getMessage() for r in handler.records] == ["shown"]
            unconfigured.handlers.clear()
            unconfigured.setLevel(logging.DEBUG)
            assert not logs.follow_host_logging(host), "the application's own level wins"
    finally:
        host.removeHandler(handler)
        host.propagate = True


def test_follow_host_logging_leaves_a_configured_root_alone(unconfigured: logging.Logger) -> None:
    """With handlers on the root logger (the application configured logging) kvflow's events
    keep propagating there: nothing is lent."""
    host = logging.getLogger("test_host_app")
    handler = Records()
    host.addHandler(handler)
    root = logging.getLogger()
    root_handler = Records()
    try:
        with no_root_handlers():
            root.addHandler(root_handler)
            assert not logs.follow_host_logging(host)
            assert unconfigured.handlers == []
    finally:
        host.removeHandler(handler)


def test_importing_kvflow_configures_no_logging() -> None:
    """Importing kvflow's modules leaves structlog unconfigured and stdlib logging untouched."""
    code = (
        "import logging, structlog\n"
        "import kvflow.connector.offload, kvflow.core.offload, kvflow.runtime.worker\n"
        "root = logging.getLogger('kvflow')\n"
        "assert not structlog.is_configured()\n"
        "assert root.handlers == [] and root.level == logging.NOTSET\n"
        "assert logging.getLogger().handlers == []\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_module_takes_its_logger_from_kvflow_core_logs() -> None:
    """No kvflow module calls ``structlog.get_logger`` itself: its events would bypass the stdlib
    route and print every debug event to stdout when structlog is unconfigured."""
    package = Path(logs.__file__).resolve().parent.parent
    offenders = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "logs.py" and "structlog.get_logger(" in path.read_text()
    ]
    assert offenders == [], "use kvflow.core.logs.get_logger"
