"""The engine benchmark scripts run end to end at a tiny size and write the figures they claim."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import structlog
import torch
from scripts import (
    bench_connector_fixed,
    bench_connector_transfer,
    bench_copy_contention,
    bench_decode_step,
    bench_driver_calls,
    bench_engine_offload,
    bench_issue_plan,
    bench_logging,
    bench_pd_control,
    bench_pd_transfer,
    bench_store_beside_compute,
    bench_transfer,
    connector_rig,
    time_offload_parts,
)


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


def test_decode_step_bench_with_offload_times_each_mode_with_the_connector(
    tmp_path: Path,
) -> None:
    """``--offload`` runs each mode a second time with kvflow's offload connector and writes
    both figures per shape."""
    out = tmp_path / "step_offload.json"
    bench_decode_step.main(
        [
            "--model", "tiny", "--device", "cpu", "--modes", "eager-torch", "--offload",
            "--shapes", "2x40", "--steps", "10", "--warm", "1", "--rounds", "2", "--json", str(out),
        ]
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert data["offload"] is True
    figures = data["shapes"]["2x40"]
    assert figures["eager-torch_median_ms"] > 0
    assert figures["eager-torch+offload_median_ms"] > 0


def test_noreuse_bench_reports_paired_overheads(tmp_path: Path) -> None:
    """The 0 % reuse scenario pairs each on run with an off run and reports their quartiles,
    and the off runs' own spread (what the host can resolve)."""
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
    walls = [r["wall_s"] for r in n["runs_off"]]
    assert n["off_wall_spread"] == pytest.approx((max(walls) - min(walls)) / n["off_wall_s"])
    assert n["blocks_stored_last_run"] > 0
    assert n["off_connector_calls_s"] > 0
    assert n["on_connector_calls_s"] > n["off_connector_calls_s"], "storing costs the engine"
    assert all(r["connector_calls_s"] > 0 for r in n["runs_on"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_connector_call_timing_counts_a_nested_public_call_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connector method that calls another public one adds only its own (outer) time to the
    engine thread's connector time, not the inner call's a second time."""
    import itertools
    from types import SimpleNamespace

    class Conn:
        def outer(self) -> str:
            return self.inner()

        def inner(self) -> str:
            return "done"

    conn = Conn()
    ticks = itertools.count()
    monkeypatch.setattr("time.perf_counter", lambda: float(next(ticks)))
    engine = SimpleNamespace(scheduler_connector=conn, worker_connector=conn)
    per_call: dict[str, list[float]] = {}
    spent = bench_engine_offload.time_connector_calls(engine, per_call)  # type: ignore[arg-type]
    assert conn.outer() == "done"
    # Clock reads: outer starts at 0, inner starts at 1 (its end is not read), outer ends at 2.
    assert spent == [2.0]
    assert per_call == {"outer": [1, 2.0]}
    assert conn.inner() == "done"  # a call of its own counts: from 3 to 4
    assert spent == [3.0]
    assert per_call == {"outer": [1, 2.0], "inner": [1, 1.0]}


def test_noreuse_bench_on_null_copies_times_each_connector_method(tmp_path: Path) -> None:
    """With ``--null-copies --calls`` the 0 % reuse scenario runs offload on copies that finish
    at once and writes each public connector method's calls and time per run, which add up to
    the connector's time on the engine thread; a scenario with loads refuses null copies."""
    out = tmp_path / "noreuse.json"
    rc = bench_engine_offload.main(
        [
            "--scenario", "noreuse", "--requests", "4", "--prompt", "40", "--answer", "3",
            "--repeat", "2", "--cpu-bytes", "64MiB", "--null-copies", "--calls",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    n = json.loads(out.read_text())["noreuse"]
    assert n["null_copies"] is True
    calls = n["on_calls"]
    assert calls["build_connector_meta"]["calls_per_run"] > 0
    assert calls["wait_for_save"]["ms_per_run"] > 0
    total_ms = sum(c["ms_per_run"] for c in calls.values())
    mean_on_ms = sum(r["connector_calls_s"] for r in n["runs_on"]) * 1e3 / 2
    assert total_ms == pytest.approx(mean_on_ms, rel=0.05)
    assert bench_engine_offload.main(["--scenario", "reload", "--null-copies"]) == 2


@pytest.mark.parametrize(
    "flags",
    [["--store", "dma"], ["--store", "staged"], ["--pitched-batch"], ["--gather-ctas", "264"]],
)
def test_engine_offload_bench_refuses_cuda_copy_options_off_cuda(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The store path, batched 2D copies and the gather width are the CUDA backend's: asked
    for on the host, the bench exits with status 2 and a one-line error naming the option,
    before building anything."""
    flag = flags[0]
    assert bench_engine_offload.main(["--scenario", "noreuse", *flags]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        f"bench_engine_offload: {flag} is the CUDA backend's, without --null-copies"
    ]


def test_copy_contention_bench_says_it_needs_cuda() -> None:
    """Without a GPU the copy-contention benchmark exits with status 2 instead of failing."""
    assert bench_copy_contention.main([]) == 2


def test_logging_bench_times_every_setup_and_leaves_structlog_unconfigured(tmp_path: Path) -> None:
    """Each logging setup gets a per-call figure for each call; structlog is reset afterwards."""
    out = tmp_path / "logging.json"
    assert bench_logging.main(["--calls", "50", "--repeat", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["per_call_ns"]
    assert set(figures) == set(bench_logging.SETUPS)
    for row in figures.values():
        assert set(row) == set(bench_logging.CALLS)
        assert all(ns > 0 for ns in row.values())
    assert not structlog.is_configured()


def test_pd_control_bench_times_hand_offs_against_the_zmq_floor(tmp_path: Path) -> None:
    """A few hand-offs between two processes are timed both ways (D on the plane's loop and
    through the PDDriver) and every one is released on P."""
    out = tmp_path / "pd_control.json"
    bench_pd_control.main(["--handoffs", "20", "--warmup", "5", "--json", str(out)])
    f = json.loads(out.read_text())
    assert f["released_on_p"] == 2 * 25
    for key in ("handoff_us", "handoff_us_driver", "raw_zmq_rtt_us"):
        assert 0 < f[f"{key}_p50"] <= f[f"{key}_p99"]
        assert f[f"{key}_mean"] > 0


@pytest.mark.distributed
def test_pd_transfer_bench_compares_the_transport_with_raw_gloo(tmp_path: Path) -> None:
    """Two gloo processes move scattered and contiguous blocks both ways of the comparison;
    bytes match, and both processes' CPU is counted."""
    out = tmp_path / "pd_transfer.json"
    bench_pd_transfer.main(
        ["--mib", "1", "--repeat", "1", "--sizes-kib", "4", "32", "--json", str(out)]
    )
    sizes = json.loads(out.read_text())["sizes"]
    assert set(sizes) == {f"{k}/{lay}" for k in (4, 32) for lay in ("scattered", "contiguous")}
    for f in sizes.values():
        assert f["bytes_match"]
        assert f["kvflow_gbs"] > 0
        assert f["raw_gbs"] > 0
        assert f["kvflow_cpu_ms"] > 0


def test_connector_transfer_bench_drives_every_layout_through_the_connector(
    tmp_path: Path,
) -> None:
    """On the host backend every layout's store and load go through the connector's engine
    calls, come back byte for byte, and are reported against a same-run ceiling."""
    out = tmp_path / "connector_transfer.json"
    rc = bench_connector_transfer.main(
        [
            "--device", "cpu", "--blocks", "6", "--layers", "2", "--steps", "2",
            "--warmup", "1", "--ceiling-reps", "1", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    f = json.loads(out.read_text())
    results = f["results"]
    assert [r["layout"] for r in results] == list(connector_rig.LAYOUTS)
    for r in results:
        assert r["bytes_match"] is True
        assert r["copy_time_measured"] is True  # the host backend's copy thread timed them
        assert r["step_bytes"] == 6 * r["block_bytes"]
        for d in ("store", "load"):
            fig = r[d]
            assert fig["ceiling_gbps"] > 0
            assert 0 < fig["copy_ms"] <= fig["wall_ms"]
            assert fig["launch_us"] > 0
            assert len(fig["walls_ms"]) == 2
            assert len(fig["launches_us"]) == len(fig["issues_us"]) == 2
            assert fig["fractions"] == pytest.approx(
                [r["step_bytes"] / (w * 1e-3) / 1e9 / fig["ceiling_gbps"] for w in fig["walls_ms"]]
            )
            bytes_at_ceiling_ms = r["step_bytes"] / (fig["ceiling_gbps"] * 1e9) * 1e3
            assert fig["fixed_ms"] == pytest.approx(fig["wall_ms"] - bytes_at_ceiling_ms)
            # From the launch call: within each step's wall, without its plan and bind.
            spans = fig["from_launch_ms_all"]
            assert all(0 < s < w for s, w in zip(spans, fig["walls_ms"], strict=True))
            assert fig["from_launch_ms"] == pytest.approx(statistics.median(spans))
            assert fig["from_launch_fixed_ms"] == pytest.approx(
                fig["from_launch_ms"] - bytes_at_ceiling_ms
            )
            assert fig["from_launch_fraction"] == pytest.approx(
                r["step_bytes"] / (fig["from_launch_ms"] * 1e-3) / 1e9 / fig["ceiling_gbps"]
            )
            assert fig["from_launch_fractions"] == pytest.approx(
                [r["step_bytes"] / (s * 1e-3) / 1e9 / fig["ceiling_gbps"] for s in spans]
            )


def test_connector_floor_only_reports_quartiles_and_a_profile(tmp_path: Path) -> None:
    """``--floor-only`` runs only the copies-finish-at-once steps (kvflow's hashing or the
    engine's), reports each direction's quartiles and every step, and writes a profile."""
    out, prof = tmp_path / "floor.json", tmp_path / "floor.prof"
    rc = bench_connector_transfer.main(
        [
            "--device", "cpu", "--floor-only", "--layouts", "4k,cross", "--blocks", "6",
            "--layers", "2", "--steps", "3", "--warmup", "1", "--hashes", "kvflow",
            "--profile", str(prof), "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    f = json.loads(out.read_text())
    assert (f["floor_only"], f["hashes"]) == (True, "kvflow")
    assert [r["layout"] for r in f["results"]] == ["4k", "cross"]
    for r in f["results"]:
        for d in ("store", "load"):
            fig = r[d]
            assert len(fig["floors_ms"]) == len(fig["floor_launches_us"]) == 3
            assert fig["floor_ms_q1"] <= fig["floor_ms"] <= fig["floor_ms_q3"]
            assert 0 < fig["floor_launch_us"] < fig["floor_ms"] * 1e3
    assert prof.stat().st_size > 0


def test_connector_ab_bench_pools_both_trees_steps(tmp_path: Path) -> None:
    """The interleaved comparison runs one process per tree and round and pools every measured
    step of each (here the floor on CPU, this tree against itself as the base)."""
    out = tmp_path / "ab.json"
    rc = bench_connector_fixed.main(
        [
            "--base-src", "src", "--rounds", "1", "--layouts", "4k", "--blocks", "4",
            "--layers", "2", "--steps", "2", "--warmup", "1", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    f = json.loads(out.read_text())
    assert [(r["layout"], r["dir"]) for r in f["rows"]] == [("4k", "store"), ("4k", "load")]
    for key, steps in f["steps"].items():
        assert key.split("|")[2] in ("base", "branch")
        assert len(steps["floors_ms"]) == len(steps["floor_launches_us"]) == 2


def test_connector_ab_bench_refuses_a_base_tree_without_kvflow(tmp_path: Path) -> None:
    """A --base-src that holds no kvflow package is a one-line usage error (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        bench_connector_fixed.main(["--base-src", str(tmp_path)])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_driver_calls_bench_says_it_needs_cuda() -> None:
    """Without a GPU the driver-call benchmark exits with status 2 instead of failing."""
    assert bench_driver_calls.main(["--rounds", "1"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_driver_calls_bench_times_every_call_both_ways(tmp_path: Path) -> None:
    """On a GPU every driver call kind is timed through the bindings and through ctypes."""
    out = tmp_path / "calls.json"
    assert bench_driver_calls.main(["--rounds", "2", "--calls", "20", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5
    for row in rows:
        assert row["bindings_us"][1] > 0
        assert row["raw_us"][1] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_store_beside_compute_bench_says_it_needs_cuda() -> None:
    """Without a GPU the store-beside-compute benchmark exits with status 2 instead of failing."""
    assert bench_store_beside_compute.main(["--rounds", "1"]) == 2


def test_store_beside_compute_bench_takes_the_suites_gather_widths() -> None:
    """The device suite's gather widths parse into one staged variant each, beside the DMA-only
    ones; a width of zero is a usage error (exit 2)."""
    args = bench_store_beside_compute.parse_args(["--gather-ctas", "64,132,264"])
    assert bench_store_beside_compute.variants(args.gather_ctas) == [
        "none", "staged/64", "staged/132", "staged/264", "2d", "2d-batch", "2d-split", "contiguous",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        bench_store_beside_compute.parse_args(["--gather-ctas", "64,0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        bench_store_beside_compute.parse_args(["--kv-heads", "0"])
    assert exc.value.code == 2


@pytest.mark.parametrize(("blocks", "runs"), [("4", "8"), ("8", "4")])
def test_store_beside_compute_bench_refuses_runs_too_short_for_2d_copies(
    blocks: str, runs: str
) -> None:
    """A store cut into more runs than it has blocks, or into runs too short for 2D copies, is
    a usage error (exit 2), found before any GPU work."""
    with pytest.raises(SystemExit) as exc:
        bench_store_beside_compute.main(["--blocks", blocks, "--runs", runs])
    assert exc.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_store_beside_compute_bench_times_every_variant(tmp_path: Path) -> None:
    """On a GPU each way of issuing the store is timed beside the GEMMs, its copy timed by
    events (the 2D copies' bytes are checked before any timing)."""
    out = tmp_path / "store_compute.json"
    rc = bench_store_beside_compute.main(
        [
            "--blocks", "32", "--runs", "2", "--rounds", "1", "--reps", "4",
            "--gather-ctas", "64,8", "--kv-heads", "2", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == set(bench_store_beside_compute.variants([64, 8]))
    for name, f in variants.items():
        assert f["gemm_ms"] > 0
        assert (f["store_ms"] > 0) == (name != "none")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_connector_transfer_bench_says_it_needs_cuda() -> None:
    """Without a GPU the default --device cuda exits with status 2 instead of failing."""
    assert bench_connector_transfer.main(["--steps", "1"]) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["auto", "staged"])
def test_connector_transfer_bench_on_cuda_is_byte_exact_and_timed_by_events(
    tmp_path: Path, method: str
) -> None:
    """On the CUDA backend every layout's round trip through the connector is byte-exact, every
    copy is timed by CUDA events, the copy time is within the step's wall time, the
    timeline's phases add up to it, and its span from the launch call is that wall less the
    plan and the bind."""
    out = tmp_path / "connector_transfer_cuda.json"
    rc = bench_connector_transfer.main(
        [
            "--blocks", "64", "--layers", "4", "--steps", "3", "--warmup", "1",
            "--method", method, "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    for r in json.loads(out.read_text())["results"]:
        assert r["bytes_match"] is True
        assert r["copy_time_measured"] is True
        if method == "staged":
            assert r["path"] == "staged"
        for d in ("store", "load"):
            assert 0 < r[d]["copy_ms"] <= r[d]["wall_ms"]
            assert r[d]["issue_us"] > 0
            assert r[d]["ceiling_gbps"] > 1
            steps = r[d]["timelines"]
            spans = r[d]["from_launch_ms_all"]
            assert len(r[d]["from_launch_fractions"]) == len(spans) == len(r[d]["walls_ms"])
            for i, wall_ms in enumerate(r[d]["walls_ms"]):
                # From the launch call: the wall without the step's plan and bind.
                assert spans[i] == pytest.approx(
                    wall_ms - (steps["plan"][i] + steps["bind"][i]) / 1e3, rel=1e-6
                )
                pre, copy, post = (steps[k][i] for k in ("pre", "copy", "post"))
                assert min(pre, copy, post) > 0
                assert pre + copy + post == pytest.approx(wall_ms * 1e3, rel=1e-6)
                assert steps["detect"][i] + steps["settle"][i] == pytest.approx(post)
                assert steps["polls"][i] >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_connector_transfer_bench_takes_the_staged_ramp_it_is_given(tmp_path: Path) -> None:
    """--ramp-mib sets the CUDA backend's ramp for the run (recorded in the JSON), and the
    round trips stay byte-exact with a ramp of a few blocks."""
    out = tmp_path / "connector_ramp.json"
    rc = bench_connector_transfer.main(
        [
            "--blocks", "64", "--layers", "4", "--steps", "2", "--warmup", "1", "--no-floor",
            "--layouts", "4k", "--ramp-mib", "0.25", "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["ramp_mib"] == 0.25
    assert all(r["bytes_match"] is True for r in data["results"])


def test_connector_transfer_bench_refuses_a_negative_ramp() -> None:
    """A negative --ramp-mib is a one-line usage error, exit 2, before any work."""
    with pytest.raises(SystemExit) as e:
        bench_connector_transfer.main(["--device", "cpu", "--ramp-mib", "-1"])
    assert e.value.code == 2


def test_transfer_bench_plans_without_a_gpu(tmp_path: Path) -> None:
    """--plan-only times the host side of a staged step: CPU ids in runs need far fewer DMA
    descriptors than scattered ones."""
    out = tmp_path / "plan.json"
    rc = bench_transfer.main(
        ["--plan-only", "--chunks", "4,32", "--layers", "2", "--blocks", "64", "--json", str(out)]
    )
    assert rc == 0
    rows = json.loads(out.read_text())["plan_only"]
    assert [r["chunk_kib"] for r in rows] == [4, 32]
    for r in rows:
        assert r["one_run_descriptors"] <= r["churned_pool_descriptors"] < 64
        assert r["scattered_descriptors"] > 32
        assert r["one_run_plan_us"] > 0


def test_issue_plan_bench_times_both_ways_cold_and_warm(tmp_path: Path) -> None:
    """The planning bench times the plain-Python plan (with the ids checked by the backend, and
    as a gated plan's batch, not again) and the numpy plan of one store, and of a load in parts,
    each cold and warm, and refuses a nonsensical shape with exit 2."""
    shape = ["--blocks", "32", "--runs", "3", "--rounds", "2", "--warm", "3", "--sweep-mib", "1"]
    for parts in ("0", "4"):
        out = tmp_path / f"plan{parts}.json"
        assert bench_issue_plan.main([*shape, "--parts", parts, "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["parts"] == int(parts)
        ways = {
            "tuples (plain Python)",
            "tuples of a gated plan (CopyBatch.checked)",
            "arrays (numpy)",
        }
        assert set(got["cold_us"]) == set(got["warm_us"]) == ways
        assert all(v > 0 for v in (*got["cold_us"].values(), *got["warm_us"].values()))
    for bad in (["--runs", "9", "--blocks", "4"], ["--parts", "33", "--layers", "16"]):
        with pytest.raises(SystemExit) as exc:
            bench_issue_plan.main(bad)
        assert exc.value.code == 2


def test_offload_parts_times_the_connectors_functions_on_the_engine_thread(tmp_path: Path) -> None:
    """The function timer runs the 0 % reuse bench with timers around the connector's and the
    runtime's functions: the connector's calls are counted once per engine step (warm-up run
    included), a store launch and its commit are timed, and a missing --parts-json file is a
    one-line exit 2."""
    out = tmp_path / "parts.json"
    bench = ["--model", "tiny", "--scenario", "noreuse", "--repeat", "1", "--null-copies"]
    small = ["--requests", "4", "--prompt", "64", "--answer", "4"]
    assert time_offload_parts.main([*bench, *small, "--parts-json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["runs_counted"] == 2
    functions = got["functions"]
    steps = functions["OffloadScheduler.build_connector_meta"]["calls"]
    assert steps > 0
    assert functions["OffloadWorker.wait_for_save"]["calls"] == steps
    assert functions["OffloadScheduler.request_finished"]["calls"] == 2 * 4
    for name in ("InlineSyncWorker._start_stores", "TransferLedger.release"):
        assert functions[name]["calls"] >= 2
        assert functions[name]["seconds"] > 0
    assert time_offload_parts.main([*bench, "--parts-json"]) == 2


@pytest.mark.parametrize("flag", ["--store-min-run", "--gather-ctas"])
def test_engine_offload_bench_refuses_a_count_below_one(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A minimum run of blocks or a gather of fewer than one CTA is a one-line error naming the
    option and exit status 2."""
    assert bench_engine_offload.main(["--scenario", "noreuse", flag, "0"]) == 2
    assert capsys.readouterr().out.strip().splitlines() == [
        f"bench_engine_offload: {flag} must be positive"
    ]
