"""Tests of the command line: version and doctor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

import kvflow
from kvflow.cli import doctor
from kvflow.cli.doctor import doctor_rows, run_doctor
from kvflow.cli.main import main


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow --version` prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert kvflow.__version__ in capsys.readouterr().out


def test_doctor_reports_every_check_as_a_table() -> None:
    """`kvflow doctor` prints Python, torch, CUDA, batched-copy support (1D and 2D) and the
    backend it picks."""
    console = Console(record=True, width=200)
    assert run_doctor(console) == 0
    text = console.export_text()
    for check in (
        "kvflow",
        "python",
        "torch",
        "CUDA driver",
        "cuMemcpyBatchAsync",
        "cuMemcpy3DBatchAsync",
        "default backend",
        "vllm",
        "matplotlib",
        "nixl",
        "PD transports",
    ):
        assert check in text
    names = [name for name, _, _ in doctor_rows()]
    assert len(names) == len(set(names))


def test_doctor_without_a_gpu_picks_the_host_backend() -> None:
    """On a machine without CUDA the doctor says so instead of failing."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rows = {name: value for name, value, _ in doctor_rows()}
    assert rows["default backend"].startswith("host")


@pytest.mark.parametrize("abi_3d", [13000, None])
def test_doctor_says_whether_the_driver_batches_2d_copies(
    monkeypatch: pytest.MonkeyPatch, abi_3d: int | None
) -> None:
    """With a GPU the doctor reports ``cuMemcpy3DBatchAsync`` (what ``CudaConfig.pitched_batch``
    needs) by its ABI, or says that 2D copies then go one call each."""
    from kvflow.backends.probe import CudaProbe
    from kvflow.cli import doctor

    gpu = CudaProbe(True, 13000, 1, "Test GPU", 13000, None, abi_3d)
    monkeypatch.setattr(doctor, "probe_cuda", lambda: gpu)
    rows = {name: (value, level) for name, value, level in doctor_rows()}
    want = ("yes (ABI 13000)", "ok") if abi_3d else ("no: 2D copies one call each", "info")
    assert rows["cuMemcpy3DBatchAsync"] == want
    assert rows["cuMemcpyBatchAsync"] == ("yes (ABI 13000)", "ok")


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Running kvflow without a command prints usage and exits 2."""
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_doctor_names_a_missing_optional_package_and_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An optional package that is not installed is reported with its install hint, not a warning."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import then raises ModuleNotFoundError
    rows = {name: (value, verdict) for name, value, verdict in doctor.optional_rows()}
    assert rows["vllm"] == ("not installed (pip install 'kvflow[vllm]')", "info")


def test_doctor_says_why_an_optional_package_does_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optional package whose import fails is a warning naming the error's first line."""
    (tmp_path / "nixl.py").write_text("raise RuntimeError('libnixl.so: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nixl", raising=False)
    for wheel_module in ("nixl_cu13", "nixl_cu12"):  # an installed NIXL wheel would answer first
        monkeypatch.setitem(sys.modules, wheel_module, None)
    rows = {name: (value, verdict) for name, value, verdict in doctor.optional_rows()}
    assert rows["nixl"] == ("import failed: libnixl.so: cannot open", "warn")


def test_doctor_shows_an_installed_packages_version() -> None:
    """matplotlib, installed with the dev extra, is shown with its distribution's version."""
    pytest.importorskip("matplotlib")
    value, verdict = {n: (v, d) for n, v, d in doctor.optional_rows()}["matplotlib"]
    assert verdict == "ok"
    assert value.endswith("(matplotlib)")


def test_doctor_lists_the_pd_transports_this_machine_can_use() -> None:
    """gloo is always usable on CPU; NIXL's row names its UCX backend when the extra is
    installed; cuda-ipc is named with why not on a machine without CUDA."""
    rows = {name: value for name, value, _ in doctor_rows()}
    assert rows["PD transports"].startswith("gloo")
    from kvflow.backends.pd.nixl import load_nixl

    if load_nixl()[0] is not None:
        assert "UCX backend" in rows["nixl backends"]
        assert "nixl" in rows["PD transports"].split(" (not")[0]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        assert "cuda-ipc: no CUDA device" in rows["PD transports"]
