"""The soak benchmark runs for 30 seconds with every fault kind injected and every bad input
kind thrown at the connector, and finds no violation of kvflow's guarantees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import soak


@pytest.mark.slow
def test_soak_30_seconds_injects_every_fault_and_finds_no_violation(tmp_path: Path) -> None:
    """30 s of random traffic over the store policies (eager, eager with a store each step,
    lazy), both worker loops and one or two ranks (one: loads fenced while the engine is idle,
    in parts by layer with the inline loop):
    exit status 0, no violation, every fault and bad-input kind exercised, reloads and outputs
    checked."""
    out = tmp_path / "soak.json"
    assert soak.main(["--duration", "30", "--seed", "7", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["violations"] == []
    assert set(figures["segments"]) == {
        f"{policy}/{loop}/{ranks}"
        for policy in ("eager", "eager1", "lazy")
        for loop in ("inline", "thread")
        for ranks in (1, 2)
    }
    assert all(n > 0 for n in figures["segments"].values())
    for fault in (
        "store_failed_on_device",
        "load_failed_on_device",
        "copy_slowed",
        "completion_reported_late",
        "rank1_reported_late",
        "rank1_reported_failure",
        "resets_with_copies_in_flight",
        "preemptions",
    ):
        assert figures["faults"].get(fault, 0) > 0, fault
    assert len(figures["rejected"]) >= 9
    assert figures["outputs_checked"] == figures["requests"] > 0
    assert figures["transfers"]["blocks_loaded_committed"] > 0
    assert figures["transfers"]["loads_fenced"] > 0
    assert figures["checks"]["loads_in_parts"] > 0
    assert figures["checks"]["blocks_reloaded_byte_identical"] > 0
    assert figures["checks"]["transfers_held_for_late_rank"] > 0


def test_soak_catches_a_corrupted_cpu_block_and_exits_1(tmp_path: Path) -> None:
    """With stored CPU blocks corrupted on purpose the soak reports reload violations (and the
    outputs that differ) and exits 1: its checks can fail."""
    out = tmp_path / "soak.json"
    code = soak.main(
        ["--duration", "4", "--sabotage", "corrupt-cpu", "--policy", "eager", "--json", str(out)]
    )
    assert code == 1
    violations = json.loads(out.read_text())["violations"]
    assert any("not as its store wrote it" in v for v in violations)
