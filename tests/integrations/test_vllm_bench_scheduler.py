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


def bench(*args: str, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The benchmark script run with ``args`` on this checkout's ``src`` (and ``path``)."""
    paths = [str(ROOT / "src"), *([str(path)] if path is not None else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_vllm_scheduler.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_the_scheduler_benchmark_prints_every_configuration_and_kvflow_s_calls() -> None:
    """A small run prints the side-by-side table with both connectors' rows, the manager vs
    adapter split, and with ``--calls`` a per-call table whose store rows are non-zero for the
    configuration that stores every step."""
    ran = bench("--requests", "16", "--prompt", "64", "--decode", "24", "--warmup", "2", "--calls")
    assert ran.returncode == 0, ran.stderr
    out = ran.stdout
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


def test_the_cold_split_runs_a_twin_right_after_the_store_each_step_rig() -> None:
    """``--cold-split`` prints the twin's row and the cold / warm table, and without the
    store-each-step configuration it stops with a one-line error and exit 2."""
    small = ("--requests", "16", "--prompt", "64", "--decode", "16", "--warmup", "2")
    ran = bench(*small, "--only", "each", "--cold-split")
    assert ran.returncode == 0, ran.stderr
    out = ran.stdout
    assert "(twin)" in out
    assert "its twin, right after it" in out
    diff = next(line for line in out.splitlines() if "difference" in line)
    float([c.strip() for c in diff.split("│") if c.strip()][-1])
    bad = bench(*small, "--only", "lazy", "--cold-split")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert "--cold-split" in bad.stderr


def test_kvflow_s_clock_in_the_benchmark_runs_only_while_its_own_rig_steps() -> None:
    """The clock the benchmark gives kvflow's connector advances by its own rig's steps only:
    work between them (another rig's step, the collection before a round) is not its time."""
    import argparse
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location(
        "bench_vllm_scheduler", ROOT / "scripts" / "bench_vllm_scheduler.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = argparse.Namespace(
        requests=4, prompt=64, decode=8, warmup=2, block_size=16, batch_tokens=8192
    )
    rig, other = mod.Rig(None, None, {}, None, args), mod.Rig(None, None, {}, None, args)
    seen: list[float] = []
    schedule = rig.scheduler.schedule

    def schedule_and_read() -> object:
        seen.append(mod.ENGINE_CLOCK.now())
        return schedule()

    rig.scheduler.schedule = schedule_and_read
    before = rig.engine_s
    rig.step()
    other.step()
    spent = time.perf_counter() + 0.05
    while time.perf_counter() < spent:  # work of nobody's engine
        pass
    rig.step()
    first, second = seen
    assert 0 < second - first <= rig.engine_s - before, "only the rig's own steps count"
    assert mod.ENGINE_CLOCK.now() == 0.0, "no rig steps now: nobody's time"


def test_base_runs_another_tree_beside_this_one_in_the_same_rounds(tmp_path: Path) -> None:
    """``--base`` with a renamed copy of a tree (``scripts/renamed_tree.sh``) adds that tree's
    store-each-step row, its connector loaded from the copy, in either order; a package that is
    not there is a one-line error and exit 2."""
    made = subprocess.run(
        ["bash", str(ROOT / "scripts" / "renamed_tree.sh"), "HEAD", str(tmp_path), "kvf_other"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr
    assert (
        "kvflow"
        not in (tmp_path / "kvf_other" / "core" / "offload" / "ledger.py")
        .read_text()
        .replace("kvflow's", "")
        .split("kvf_other")[0]
        .split("import")[-1]
    )
    small = ("--requests", "16", "--prompt", "64", "--decode", "16", "--warmup", "2")
    for order in ((), ("--base-first",)):
        ran = bench(*small, "--only", "each", "--base", "kvf_other", *order, path=tmp_path)
        assert ran.returncode == 0, ran.stderr
        # The rows in the order the rigs step in each round (a long name may wrap: its start).
        mine, other = (
            ran.stdout.index("│ kvflow eager, a store"),
            ran.stdout.index("│ kvf_other eager"),
        )
        assert (other < mine) if order else (mine < other)
    bad = bench(*small, "--only", "each", "--base", "kvf_missing")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert "kvf_missing" in bad.stderr
