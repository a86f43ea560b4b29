"""Tests of trace writing (JSON lines via structlog) and the `kvflow trace` summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
from rich.console import Console

from kvflow.cli.main import main
from kvflow.cli.trace import run_trace, summarize
from kvflow.core.transfer import Direction, Transfer, TransferInput, apply
from kvflow.errors import ConfigError
from kvflow.tracing import read_trace, read_trace_lines, trace_to


def _write_trace(path: Path) -> None:
    now = [0.0]
    with trace_to(path, lambda: now[0]):
        plans = [
            (
                1,
                Direction.STORE,
                [TransferInput.LAUNCH, TransferInput.COMPLETE, TransferInput.RELEASE],
                0.004,
            ),
            (
                2,
                Direction.STORE,
                [TransferInput.LAUNCH, TransferInput.COMPLETE, TransferInput.RELEASE],
                0.001,
            ),
            (
                3,
                Direction.LOAD,
                [TransferInput.LAUNCH, TransferInput.COMPLETE, TransferInput.RELEASE],
                0.002,
            ),
            (
                4,
                Direction.LOAD,
                [TransferInput.LAUNCH, TransferInput.FAIL, TransferInput.RELEASE],
                0.003,
            ),
            (5, Direction.STORE, [TransferInput.LAUNCH, TransferInput.ABANDON], 0.0),
        ]
        for tid, direction, inputs, duration in plans:
            t = Transfer(tid, direction, f"req-{tid}")
            for event in inputs:
                if event is TransferInput.COMPLETE or event is TransferInput.FAIL:
                    now[0] += duration
                apply(t, event, cause="test")
        structlog.get_logger("x").info("unrelated_event", n=1)


def test_trace_file_holds_every_event_as_json(tmp_path: Path) -> None:
    """trace_to writes one JSON object per structlog event with the caller's clock time."""
    path = tmp_path / "t.jsonl"
    _write_trace(path)
    events = list(read_trace(path))
    assert len(events) == 15  # 14 transitions and one unrelated event
    assert events[0]["event"] == "transfer_transition"
    assert events[0]["ts"] == 0.0
    assert events[-1] == {
        "event": "unrelated_event",
        "n": 1,
        "ts": pytest.approx(0.01),
        "level": "info",
    }


def test_trace_restores_logging_configuration(tmp_path: Path) -> None:
    """After the with-block, structlog is configured exactly as before."""
    before = structlog.get_config()
    _write_trace(tmp_path / "t.jsonl")
    assert structlog.get_config() == before


def test_trace_leaves_unconfigured_structlog_unconfigured(tmp_path: Path) -> None:
    """Tracing in a process that never configured structlog leaves it unconfigured, so kvflow's
    events go back to stdlib logging instead of structlog's stdout printer."""
    was, before = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    try:
        _write_trace(tmp_path / "t.jsonl")
        assert not structlog.is_configured()
    finally:
        if was:
            structlog.configure(**before)


def test_wrong_field_type_is_a_named_error_without_a_problem_list() -> None:
    """summarize() without a problem list raises ConfigError naming the line of a bad field."""
    bad = {"event": "transfer_transition", "transfer_id": "x", "from": "pending", "to": "in_flight"}
    with pytest.raises(ConfigError, match=r"line 4: transfer_id 'x' is not an integer"):
        summarize([(4, bad)])


def test_summary_counts_outcomes_and_latencies(tmp_path: Path) -> None:
    """Outcomes per direction, pending→committed latency percentiles and the slowest are right."""
    path = tmp_path / "t.jsonl"
    _write_trace(path)
    s = summarize(read_trace_lines(path))
    assert s.ended_in == {
        ("store", "committed"): 2,
        ("load", "committed"): 1,
        ("load", "failed"): 1,
        ("store", "abandoned"): 1,
    }
    assert s.latency_s["store"] == pytest.approx((0.001, 0.004))
    assert s.latency_s["load"] == pytest.approx((0.002,))
    assert [x[0] for x in s.slowest] == [1, 3, 2]


def test_trace_command_prints_tables(tmp_path: Path) -> None:
    """`kvflow trace FILE` prints the outcome, latency and slowest-transfer tables."""
    path = tmp_path / "t.jsonl"
    _write_trace(path)
    console = Console(record=True, width=120)
    assert run_trace(path, console=console) == 0
    text = console.export_text()
    assert "pending → committed latency" in text
    assert "slowest transfers" in text
    assert "req-1" in text
    assert main(["trace", str(tmp_path / "missing.jsonl")]) == 2


def test_malformed_trace_line_is_a_named_error(tmp_path: Path) -> None:
    """A line that is not JSON raises ConfigError naming the file and line."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"event": "a"}) + "\nnot json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        list(read_trace(path))
