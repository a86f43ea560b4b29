"""``kvflow bench`` end to end at a tiny size: the table on stdout, each requested file written."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from kvflow.bench.config import BenchConfig
from kvflow.bench.multi_round import run_bench
from kvflow.cli.bench import figure
from kvflow.cli.main import main

TINY = ["--users", "2", "--rounds", "2", "--warmup", "round", "--system", "32",
        "--first-question", "16", "--question", "16", "--answer", "4"]  # fmt: skip


@pytest.fixture
def fresh_process() -> Iterator[None]:
    """structlog unconfigured, as in a new ``kvflow`` process; the suite's settings come back."""
    was, before = structlog.is_configured(), structlog.get_config()
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    structlog.reset_defaults()
    yield
    if was:
        structlog.configure(**before)
    sys.setswitchinterval(interval)
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("fresh_process")
def test_bench_writes_its_files_and_only_the_tables_to_stdout(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With --trace the events go to the file alone: stdout holds the tables, no debug lines."""
    trace, plot, figures = tmp_path / "t.jsonl", tmp_path / "p.png", tmp_path / "f.json"
    argv = ["bench", *TINY, "--trace", str(trace), "--plot", str(plot), "--json", str(figures)]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "TTFT p50 per round" in out
    assert "transfer_transition" not in out + err
    assert "debug" not in out + err
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "transfer_transition" for e in events)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert json.loads(figures.read_text())["config"]["users"] == 2


@pytest.mark.usefixtures("fresh_process")
def test_plot_axes_start_at_zero_and_say_lower_is_better() -> None:
    """The TTFT plot's axes start at 0, are labelled, and the y label says lower is better."""
    cfg = BenchConfig(users=2, rounds=2, warmup="round", system_prompt=32, first_question=16,
                      question=16, answer=4)  # fmt: skip
    ax = figure(run_bench(cfg)).axes[0]
    assert ax.get_ylim()[0] == 0
    assert ax.get_xlim()[0] == 0
    assert "lower is better" in ax.get_ylabel()
    assert ax.get_xlabel().startswith("round")
