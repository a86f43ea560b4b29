"""Tests of the command line: version and doctor."""

from __future__ import annotations

import pytest
from rich.console import Console

import kvflow
from kvflow.cli.doctor import doctor_rows, run_doctor
from kvflow.cli.main import main


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvflow --version` prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert kvflow.__version__ in capsys.readouterr().out


def test_doctor_reports_every_check_as_a_table() -> None:
    """`kvflow doctor` prints Python, torch, CUDA, batched-copy support and the backend it picks."""
    console = Console(record=True, width=200)
    assert run_doctor(console) == 0
    text = console.export_text()
    for check in (
        "kvflow",
        "python",
        "torch",
        "CUDA driver",
        "cuMemcpyBatchAsync",
        "default backend",
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


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    """Running kvflow without a command prints usage and exits 2."""
    assert main([]) == 2
    assert "doctor" in capsys.readouterr().out
