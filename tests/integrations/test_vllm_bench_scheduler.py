"""``scripts/bench_vllm_scheduler.py`` runs end to end on a small workload: every configuration
steps vLLM's real scheduler, and ``--calls`` prints kvflow's calls one by one."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_scheduler_benchmark_prints_every_configuration_and_kvflow_s_calls() -> None:
    """A small run prints the side-by-side table with both connectors' rows, the manager vs
    adapter split, and with ``--calls`` a per-call table whose store rows are non-zero for the
    configuration that stores every step."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench_vllm_scheduler.py"),
            *("--requests", "16", "--prompt", "64", "--decode", "24", "--warmup", "2"),
            "--calls",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    for row in (
        "SimpleCPUOffload eager",
        "SimpleCPUOffload lazy",
        "kvflow eager, a store each step",
        "kvflow lazy",
        "adapter vs manager",
        "kvflow's calls per step",
    ):
        assert row in out, row
    store_row = next(line for line in out.splitlines() if "ledger: launch_store" in line)
    cells = [c.strip() for c in store_row.split("│") if c.strip()]
    assert float(cells[2]) > 0, "a store every step plans a store in the timed steps"
