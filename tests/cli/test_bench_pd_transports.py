"""``scripts/bench_pd_transports.py`` end to end on CPU at a tiny size: gloo and (with the nixl
extra) NIXL between two processes, every figure the table shows, bytes checked on D."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import bench_pd_transports

from kvflow.backends.pd.nixl import load_nixl


@pytest.mark.distributed
def test_transport_bench_reports_speed_ceiling_and_descriptors_per_transport(
    tmp_path: Path,
) -> None:
    """Each transport's row has its GB/s (one hand-off, and several in flight), the contiguous
    and memcpy references, the copies it issued and its launch cost; D's blocks match P's; NIXL
    names its UCX backend; P closes its transport only after D is through with its checks."""
    names = ["gloo"] + (["nixl"] if load_nixl()[0] is not None else [])
    out = tmp_path / "transports.json"
    code = bench_pd_transports.main(
        ["--transports", *names, "--mib", "1", "--repeat", "1", "--sizes-kib", "32",
         "--in-flight", "3", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())["transports"]
    assert set(data) == set(names)
    for name in names:
        assert data[name]["p_closed_after_d_done"]
        f = data[name]["sizes"]["32"]
        assert f["bytes_match"]
        assert f["blocks"] == 32
        for key in ("gbs", "contiguous_gbs", "ceiling_gbs", "launch_us", "in_flight_gbs"):
            assert f[key] > 0, (name, key)
        assert f["in_flight"] == 3
        assert f["of_in_flight_ceiling"] == pytest.approx(
            f["in_flight_gbs"] / (3 * f["bytes"] / f["in_flight_ceiling_s"] / 1e9)
        )
        assert f["issued"] >= 1
    if "nixl" in data:
        assert data["nixl"]["stats"]["backend"] == "UCX"
        assert data["nixl"]["sizes"]["32"]["issued"] == 32  # scattered: one per block


def test_pinning_picks_two_cpus_of_different_cores_or_none() -> None:
    """``two_cores`` names two distinct CPUs of this process's affinity, or None when there are
    not two physical cores to pick from."""
    import os

    cpus = bench_pd_transports.two_cores()
    if cpus is None:
        assert len(os.sched_getaffinity(0)) < 4
    else:
        assert cpus[0] != cpus[1]
        assert set(cpus) <= os.sched_getaffinity(0)
