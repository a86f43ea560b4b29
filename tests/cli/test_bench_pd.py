"""``kvflow bench --pd`` end to end at a tiny size, and its one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvflow.cli.main import main

TINY = ["--users", "2", "--rounds", "2", "--system", "32", "--first-question", "16",
        "--question", "16", "--answer", "4"]  # fmt: skip


def test_bench_pd_prints_the_table_and_writes_the_json(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """P and D processes against a colocated engine: the table on stdout, identical outputs, no
    leaked blocks, and the JSON's required top-level keys."""
    figures = tmp_path / "pd.json"
    assert main(["bench", "--pd", *TINY, "--json", str(figures)]) == 0
    out, _ = capfd.readouterr()
    assert "TTFT p50 (ms)" in out
    assert "ITL p99 (ms)" in out
    assert "identical" in out
    data = json.loads(figures.read_text())
    for key in ("outputs_identical", "requests", "decode_prompt_tokens_computed",
                "leaked_blocks", "bytes_moved", "transport"):  # fmt: skip
        assert key in data
    assert data["outputs_identical"] is True
    assert data["leaked_blocks"] == 0
    assert data["requests"] == 4
    assert data["transport"] == "gloo"
    assert data["bytes_moved"] > 0
    # Every request's prompt came from P: D computed only each one's last token.
    assert data["handoffs_ok"] == data["requests"]
    assert data["decode_prompt_tokens_computed"] == data["requests"]


def test_bench_pd_with_p_s_first_token_matches_and_reports_the_second_token(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--pd-first-token prefill: the title says P samples the first token, outputs are
    identical, D computes one token per request, and the JSON carries the option and a
    submit → second token figure on both sides."""
    figures = tmp_path / "pd.json"
    argv = ["bench", "--pd", "--pd-first-token", "prefill", *TINY, "--json", str(figures)]
    assert main(argv) == 0
    out, _ = capfd.readouterr()
    assert "P samples the first token" in out
    assert "second token p50 (ms)" in out
    data = json.loads(figures.read_text())
    assert data["first_token"] == "prefill"
    assert data["outputs_identical"] is True
    assert data["leaked_blocks"] == 0
    assert data["handoffs_ok"] == data["requests"]
    assert data["decode_prompt_tokens_computed"] == data["requests"]
    for side in ("pd", "colocated"):
        assert data[side]["second_token_p50_s"] > data[side]["ttft_p50_s"] > 0
    assert "TTFT by part" in out
    assert "P's engine sampled it" in out
    for side in ("pd", "colocated"):
        # The parts (``match`` lies within ``queue``) sum to the mean TTFT, every part >= 0.
        parts = data[side]["ttft_parts_mean_s"]
        ttfts = data[side]["ttfts_s"]
        assert len(ttfts) == data["requests"]
        assert min(parts.values()) >= 0
        total = sum(v for k, v in parts.items() if k != "match")
        assert total == pytest.approx(sum(ttfts) / len(ttfts), rel=1e-9, abs=1e-9)
    # P sampled the first token: its prefill is in P's timeline, none in D's hand-off parts.
    assert data["pd"]["ttft_parts_mean_s"]["load_copy"] == 0
    assert data["pd"]["ttft_parts_mean_s"]["load_seen"] == 0
    assert data["pd"]["ttft_parts_mean_s"]["first_step"] > 0


@pytest.mark.parametrize("first", ["decode", "prefill"])
def test_bench_pd_in_half_precision_checks_against_the_colocated_engine(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], first: str
) -> None:
    """--dtype bfloat16: the PD run replays the colocated run's answers and the JSON's check
    compares tokens, else first-token logits (D's, or P's when P samples the first token),
    with the colocated engine's; it passes, and says which it compared."""
    figures = tmp_path / "pd.json"
    argv = ["bench", "--pd", "--dtype", "bfloat16", "--pd-first-token", first, *TINY]
    assert main([*argv, "--json", str(figures)]) == 0
    out, _ = capfd.readouterr()
    assert "outputs vs the colocated engine" in out
    check = json.loads(figures.read_text())["check"]
    assert check["passed"] is True
    assert check["requests"] == 4
    assert check["kind"] in ("tokens", "first_token_logits")
    assert check["max_rel_logits_err"] <= check["tolerance"]


def test_bench_pd_from_p_tp2_to_d_tp1_matches_the_colocated_engine(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """--pd-tp 2,1: P as two rank processes, D as one; the table names the TP sizes, outputs
    are identical, every hand-off commits and nothing leaks."""
    figures = tmp_path / "pd.json"
    assert main(["bench", "--pd", "--pd-tp", "2,1", *TINY, "--json", str(figures)]) == 0
    out, _ = capfd.readouterr()
    assert "P tp2 → D tp1" in out
    data = json.loads(figures.read_text())
    assert data["tp"] == [2, 1]
    assert data["outputs_identical"] is True
    assert data["leaked_blocks"] == 0
    assert data["handoffs_ok"] == data["requests"]


def test_bench_pd_over_nixl_reports_the_transport_it_chose(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With --pd-transport nixl (D reads P's blocks through NIXL) outputs are identical, nothing
    leaks, and the table and the JSON name NIXL's backend and UCX's transport on each side."""
    from kvflow.backends.pd.nixl import load_nixl

    if load_nixl()[0] is None:
        pytest.skip("NIXL is not importable (pip install 'kvflow[nixl]')")
    figures = tmp_path / "pd.json"
    assert main(["bench", "--pd", "--pd-transport", "nixl", *TINY, "--json", str(figures)]) == 0
    out, _ = capfd.readouterr()
    assert "transport chosen (D)" in out
    data = json.loads(figures.read_text())
    assert data["outputs_identical"] is True
    assert data["leaked_blocks"] == 0
    assert data["transport"] == "nixl"
    assert data["handoffs_ok"] == data["requests"]
    d = data["transport_stats"]["D"]
    assert d["backend"] == "UCX"
    assert d["mode"] == "read"
    assert d["transfers"] >= data["requests"]
    assert d["ucx"]  # UCX's own report, e.g. cma/memory between two processes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pd-flow", "concurrent"], "--pd-flow needs --pd"),
        (["--pd", "--device", "cuda"], "--pd-transport gloo moves CPU tensors"),
        (["--pd-transport", "nixl"], "--pd-transport needs --pd"),
        (["--pd", "--pd-transport", "cuda-ipc"], "cuda-ipc joins two processes on one GPU"),
        (["--pd", "--pd-transport", "ncclx"], "invalid choice"),
        (["--pd", "--plot", "x.png"], "--plot is not available with --pd"),
        (["--pd", "--pd-flow", "sideways"], "invalid choice"),
        (["--pd-tp", "1,2"], "--pd-tp needs --pd"),
        (["--pd-first-token", "prefill"], "--pd-first-token needs --pd"),
        (["--pd", "--step-parts"], "--step-parts is for offload off vs on, not --pd"),
        (["--pd", "--pd-first-token", "p"], "invalid choice"),
        (
            ["--pd", "--pd-flow", "concurrent", "--pd-first-token", "prefill"],
            "--pd-first-token prefill needs the sequential flow",
        ),
        (["--pd", "--pd-tp", "2"], "--pd-tp '2': two positive sizes"),
        (["--pd", "--pd-tp", "1,0"], "two positive sizes"),
        (
            ["--pd", "--pd-tp", "1,2", "--pd-transport", "nixl"],
            "--pd-tp runs on --pd-transport gloo",
        ),
    ],
)
def test_bench_pd_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --pd combination is one line on stderr and exit status 2, before any work."""
    code: int | str | None
    try:
        code = main(["bench", *argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert message in err


@pytest.mark.gpu
def test_bench_pd_over_cuda_ipc_on_one_gpu_matches_the_colocated_engine(tmp_path: Path) -> None:
    """P and D as two processes on one GPU joined by CUDA IPC (D pulls): outputs identical to a
    colocated engine, every hand-off committed, nothing leaked, D the side that copies."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    figures = tmp_path / "pd.json"
    argv = ["bench", "--pd", "--device", "cuda", "--pd-transport", "cuda-ipc", *TINY,
            "--json", str(figures)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(figures.read_text())
    assert data["outputs_identical"] is True
    assert data["leaked_blocks"] == 0
    assert data["transport"] == "cuda-ipc"
    assert data["handoffs_ok"] == data["requests"]
    d = data["transport_stats"]["D"]
    assert d["initiates"] is True
    assert d["copies"] > 0
    assert d["failed"] == 0


def test_bench_pd_warms_each_engine_at_the_timed_prompts_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The untimed warm-up of the colocated engine and of the P/D pair runs the timed workload's
    prompt lengths (a full prefill and a prefix-hit round) with other tokens, so that no
    engine's first-call costs land in the first timed round."""
    import kvflow.bench.pd as pd_bench

    seen: list[Any] = []
    real = pd_bench._rounds

    def recording(workload: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(workload)
        return real(workload, *args, **kwargs)

    monkeypatch.setattr(pd_bench, "_rounds", recording)
    argv = ["bench", "--pd", *TINY, "--rounds", "3", "--json", str(tmp_path / "pd.json")]
    assert main(argv) == 0
    timed = seen[1]
    assert timed.num_rounds == 3
    warms = [seen[0], seen[2]]  # before the colocated run, before the P/D run
    for warm in warms:
        assert warm.num_rounds == 2
        for name in ("num_users", "system_prompt_len", "first_question_len", "question_len",
                     "answer_len", "vocab_size"):  # fmt: skip
            assert getattr(warm, name) == getattr(timed, name)
        assert warm.system_prompt() != timed.system_prompt()


def test_bench_pd_trace_merges_every_process_s_events_in_time_order(tmp_path: Path) -> None:
    """--pd --trace FILE: one JSON-lines file with the events of the main process (the
    colocated engine, the router), P and D, each named by ``process``, in time order, the
    hand-off's transitions on both engines among them; no per-process part is left behind."""
    trace = tmp_path / "pd.jsonl"
    assert main(["bench", "--pd", *TINY, "--trace", str(trace)]) == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    stamps = [e["ts"] for e in events]
    assert stamps == sorted(stamps)
    by_process: dict[str, set[str]] = {}
    for e in events:
        by_process.setdefault(e["process"], set()).add(e["event"])
    assert set(by_process) == {"main", "P", "D"}
    for side in ("P", "D"):
        assert any(name.startswith("pd_") for name in by_process[side]), by_process[side]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pd.jsonl"]
