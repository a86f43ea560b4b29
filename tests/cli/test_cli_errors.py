"""Every error a person can fix in a ``kvflow`` command line: one line, exit 2, before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.backends import probe
from kvflow.bench.config import MODEL_PRESETS
from kvflow.cli.main import build_parser, main


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``kvflow argv``; check exit 2 and a single ``kvflow: error:`` line; return it."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvflow: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--cpu-bytes", "banana"], "e.g. 512MiB or 2GiB"),
        (["--cpu-bytes", "0"], "--cpu-bytes '0': a positive size"),
        (["--users", "0"], "--users: 0 is not positive"),
        (["--rounds", "x"], "--rounds: 'x' is not an integer"),
        (["--threads", "0"], "--threads: 0 is not positive"),
        (["--system", "-1"], "--system: -1 is negative"),
        (["--cache-fraction", "9"], "--cache-fraction: 9.0 is not in (0, 4]"),
        (["--model", "nope"], "--model 'nope': one of tiny, small, llama-1b"),
        (["--model", "tiny-swaX"], "PRESET-swaW"),
        (["--device", "tpu"], "--device 'tpu': one of cpu, cuda, cuda:N"),
        (["--device", "cpu:1"], "one of cpu, cuda, cuda:N"),
        (["--backend", "cuda"], "needs device cuda"),
        (["--store-policy", "never"], "invalid choice: 'never'"),
    ],
)
def test_bad_bench_value_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is named with its accepted form, in one line with exit 2."""
    assert says in _one_line_error(["bench", *argv], capsys)


@pytest.mark.parametrize("flag", ["--json", "--trace", "--plot"])
def test_output_into_a_missing_directory_fails_before_the_run(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output file in a directory that does not exist is an error before any work."""
    target = tmp_path / "missing" / "out.png"
    line = _one_line_error(["bench", flag, str(target)], capsys)
    assert f"{flag} {target}: directory {target.parent} does not exist" in line


def test_output_onto_a_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory given as an output file is named as such."""
    assert "is a directory" in _one_line_error(["bench", "--json", str(tmp_path)], capsys)


def test_output_into_an_unwritable_directory_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output file in a directory this user may not write is an error before any work."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere: let os.access answer as for another user
        monkeypatch.setattr(os, "access", lambda _path, _mode: False)
    assert "not writable" in _one_line_error(["bench", "--trace", str(locked / "t")], capsys)


def test_plot_with_an_unknown_format_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--plot`` names the file endings it can write."""
    line = _one_line_error(["bench", "--plot", str(tmp_path / "x.gif")], capsys)
    assert ".png, .svg, .pdf" in line


def test_plot_without_matplotlib_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--plot`` without matplotlib says how to install it, before the run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec then finds nothing
    line = _one_line_error(["bench", "--plot", str(tmp_path / "x.png")], capsys)
    assert "pip install 'kvflow[plot]'" in line


def _no_gpu() -> probe.CudaProbe:
    return probe.CudaProbe(False, None, 0, None, None, "no CUDA driver")


def _one_gpu() -> probe.CudaProbe:
    return probe.CudaProbe(True, 13000, 1, "Test GPU", 13000, None)


def test_device_cuda_without_a_gpu_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda`` on a machine whose driver sees no GPU says so and suggests cpu."""
    monkeypatch.setattr(probe, "probe_cuda", _no_gpu)
    line = _one_line_error(["bench", "--device", "cuda"], capsys)
    assert "no CUDA GPU on this machine (no CUDA driver); use --device cpu" in line


def test_device_index_past_the_gpus_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda:3`` on a one-GPU machine names the indices there are."""
    monkeypatch.setattr(probe, "probe_cuda", _one_gpu)
    line = _one_line_error(["bench", "--device", "cuda:3"], capsys)
    assert "this machine has 1 GPU(s), cuda:0 to cuda:0" in line


def test_device_cuda_with_a_cpu_torch_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU the driver sees but a CPU build of torch: one line naming torch, not an assert."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch uses CUDA")
    monkeypatch.setattr(probe, "probe_cuda", _one_gpu)
    line = _one_line_error(["bench", "--device", "cuda"], capsys)
    assert "cannot use the GPU; install a CUDA build of torch" in line


def test_errors_are_found_without_importing_torch() -> None:
    """Value, path and device errors are reported by a process that never imported torch."""
    code = (
        "import sys\n"
        "from kvflow.cli.main import main\n"
        "for argv in (['--cpu-bytes', 'banana'], ['--model', 'nope'], ['--device', 'tpu'],\n"
        "             ['--json', '/no/such/dir/x.json'], ['--users', '0']):\n"
        "    try:\n"
        "        code = main(['bench', *argv])\n"
        "    except SystemExit as exc:\n"
        "        code = exc.code\n"
        "    assert code == 2, (argv, code)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("kvflow: error: ") == 5


def test_model_presets_match_the_engines() -> None:
    """The CLI's torch-free preset list is the engine's."""
    from kvflow.engine.model import MODEL_CONFIGS

    assert sorted(MODEL_PRESETS) == sorted(MODEL_CONFIGS)


def test_bench_help_shows_the_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvflow bench --help`` shows each option's default."""
    monkeypatch.setenv("COLUMNS", "200")  # no line break inside "(default: ...)"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    for shown in ("(default: 8)", "(default: tiny)", "(default: eager)", "(default: 0.4)"):
        assert shown in text
    assert "(default: None)" not in text


def test_trace_top_must_not_be_negative(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvflow trace --top -1`` is an error, not a silently shorter list."""
    path = tmp_path / "t.jsonl"
    path.write_text("{}\n")
    assert "--top: -1 is negative" in _one_line_error(["trace", str(path), "--top", "-1"], capsys)


def test_trace_of_a_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvflow trace DIR`` says it is a directory."""
    assert "is a directory" in _one_line_error(["trace", str(tmp_path)], capsys)


def test_trace_of_a_binary_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvflow trace`` on a binary file (here a PNG header) is one line."""
    path = tmp_path / "x.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    assert "a binary file" in _one_line_error(["trace", str(path)], capsys)


def test_trace_of_a_non_utf8_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file that is not UTF-8 text is one line too."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"event": "caf\xe9"}\n')
    assert "not a UTF-8 text file" in _one_line_error(["trace", str(path)], capsys)


def test_trace_of_a_missing_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace path that does not exist is one line."""
    assert "cannot read it" in _one_line_error(["trace", str(tmp_path / "nope.jsonl")], capsys)


def _transition(tid: int, frm: str, to: str, ts: object) -> str:
    return json.dumps(
        {"event": "transfer_transition", "transfer_id": tid, "direction": "store",
         "request_id": "r", "from": frm, "to": to, "ts": ts}
    )  # fmt: skip


def test_trace_reports_bad_lines_and_summarizes_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cut-off last line and a field of the wrong type are named by line; the rest is summed."""
    path = tmp_path / "t.jsonl"
    lines = [
        _transition(1, "pending", "in_flight", 0.0),
        _transition(1, "in_flight", "committed", 0.002),
        _transition(2, "pending", "in_flight", "soon"),
        '{"event": "transfer_transition", "transfer_id": 3, "fr',
    ]
    path.write_text("\n".join(lines))
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 line(s) skipped" in out
    assert "line 3: ts 'soon' is not a number; skipped" in out
    assert "line 4: not a JSON line" in out
    assert "pending → committed latency" in out
    assert "2.000" in out, "transfer 1's latency is in the summary"
