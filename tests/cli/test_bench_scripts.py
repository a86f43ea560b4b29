"""The engine benchmark scripts run end to end at a tiny size and write the figures they claim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripts import bench_copy_contention, bench_decode_step, bench_engine_offload


def test_decode_step_bench_times_every_shape_in_every_mode(tmp_path: Path) -> None:
    """Eager and uncaptured-pieces decode steps are timed for each shape and written as JSON."""
    out = tmp_path / "step.json"
    bench_decode_step.main(
        [
            "--model", "tiny", "--device", "cpu", "--modes", "eager-torch", "pieces-torch",
            "--shapes", "1x40,3x20", "--steps", "2", "--warm", "1", "--json", str(out),
        ]
    )  # fmt: skip
    shapes = json.loads(out.read_text())["shapes"]
    assert set(shapes) == {"1x40", "3x20"}
    for figures in shapes.values():
        assert figures["eager-torch_median_ms"] > 0
        assert figures["pieces-torch_median_ms"] > 0


def test_noreuse_bench_reports_paired_overheads(tmp_path: Path) -> None:
    """The 0 % reuse scenario pairs each on run with an off run and reports their quartiles."""
    out = tmp_path / "noreuse.json"
    bench_engine_offload.main(
        [
            "--scenario", "noreuse", "--requests", "4", "--prompt", "40", "--answer", "3",
            "--repeat", "3", "--cpu-bytes", "64MiB", "--json", str(out),
        ]
    )  # fmt: skip
    n = json.loads(out.read_text())["noreuse"]
    assert len(n["runs_off"]) == len(n["runs_on"]) == 3
    q1, q3 = n["wall_overhead_paired_iqr"]
    assert q1 <= n["wall_overhead_paired_median"] <= q3
    assert n["blocks_stored_last_run"] > 0
    assert n["off_connector_calls_s"] > 0
    assert n["on_connector_calls_s"] > n["off_connector_calls_s"], "storing costs the engine"
    assert all(r["connector_calls_s"] > 0 for r in n["runs_on"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_copy_contention_bench_says_it_needs_cuda() -> None:
    """Without a GPU the copy-contention benchmark exits with status 2 instead of failing."""
    assert bench_copy_contention.main([]) == 2
