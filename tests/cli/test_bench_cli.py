"""``kvflow bench`` end to end at a tiny size: the table on stdout, each requested file written."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from kvflow.bench.config import BenchConfig
from kvflow.bench.multi_round import LOGITS_TOLERANCE, compare_to_reference, run_bench
from kvflow.cli.bench_report import figure
from kvflow.cli.main import main
from kvflow.engine.engine import RequestResult
from kvflow.engine.workload import RoundRecord, WorkloadResult

TINY = ["--users", "2", "--rounds", "2", "--warmup", "round", "--system", "32",
        "--first-question", "16", "--question", "16", "--answer", "4"]  # fmt: skip


@pytest.fixture
def fresh_process() -> Iterator[None]:
    """structlog unconfigured, as in a new ``kvflow`` process; the suite's settings come back."""
    was, before = structlog.is_configured(), structlog.get_config()
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    structlog.reset_defaults()
    yield
    if was:
        structlog.configure(**before)
    sys.setswitchinterval(interval)
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("fresh_process")
def test_bench_writes_its_files_and_only_the_tables_to_stdout(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With --trace the events go to the file alone: stdout holds the tables, no debug lines."""
    trace, plot, figures = tmp_path / "t.jsonl", tmp_path / "p.png", tmp_path / "f.json"
    argv = ["bench", *TINY, "--trace", str(trace), "--plot", str(plot), "--json", str(figures)]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    assert "TTFT p50 per round" in out
    assert "transfer_transition" not in out + err
    assert "debug" not in out + err
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "transfer_transition" for e in events)
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert json.loads(figures.read_text())["config"]["users"] == 2


@pytest.mark.usefixtures("fresh_process")
def test_plot_axes_start_at_zero_and_say_lower_is_better() -> None:
    """The TTFT plot's axes start at 0, are labelled, and the y label says lower is better."""
    cfg = BenchConfig(users=2, rounds=2, warmup="round", system_prompt=32, first_question=16,
                      question=16, answer=4)  # fmt: skip
    ax = figure(run_bench(cfg)).axes[0]
    assert ax.get_ylim()[0] == 0
    assert ax.get_xlim()[0] == 0
    assert "lower is better" in ax.get_ylabel()
    assert ax.get_xlabel().startswith("round")


def _records(outputs: list[tuple[int, ...]], logits: list[torch.Tensor]) -> WorkloadResult:
    recs = [
        RoundRecord(
            user=i,
            round=0,
            result=RequestResult(
                request_id=f"u{i}-r0",
                prompt_len=8,
                output_token_ids=out,
                ttft_s=0.01,
                e2e_s=0.02,
                prefill_tokens_computed=8,
                gpu_cached_tokens=0,
                external_loaded_tokens=0,
                recomputed_tokens=0,
                num_preemptions=0,
                first_logits=lg,
            ),
        )
        for i, (out, lg) in enumerate(zip(outputs, logits, strict=True))
    ]
    return WorkloadResult(recs, 1.0)


def test_half_precision_check_tells_a_moved_token_from_wrong_kv() -> None:
    """Same tokens pass as identical; a token moved by rounding passes on its logits; logits a
    wrong block would give (far off) fail, naming the largest distance."""
    gen = torch.Generator().manual_seed(0)
    ref_logits = [torch.randn(64, generator=gen) for _ in range(3)]
    ref = _records([(1, 2), (3, 4), (5, 6)], ref_logits)
    same = compare_to_reference(ref, ref)
    assert same.passed
    assert same.kind == "tokens"
    assert same.requests_identical == 3
    nudged = [lg + 1e-3 * torch.randn(64, generator=gen) for lg in ref_logits]
    moved = compare_to_reference(_records([(1, 2), (3, 9), (5, 6)], nudged), ref)
    assert moved.passed
    assert moved.kind == "first_token_logits"
    assert moved.requests_identical == 2
    assert moved.max_rel_logits_err is not None
    assert moved.max_rel_logits_err < LOGITS_TOLERANCE
    wrong = [ref_logits[0], torch.randn(64, generator=gen), ref_logits[2]]
    bad = compare_to_reference(_records([(1, 2), (7, 4), (5, 6)], wrong), ref)
    assert not bad.passed
    assert bad.max_rel_logits_err is not None
    assert bad.max_rel_logits_err > 0.5


@pytest.mark.usefixtures("fresh_process")
def test_bfloat16_bench_checks_against_a_no_eviction_replay(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """In bf16 the bench adds the reference run: its verdict line, the phase table and the JSON
    check; the exit code follows the check."""
    assert main(["bench", *TINY, "--dtype", "bfloat16"]) == 0
    out, _ = capfd.readouterr()
    assert "outputs vs a no-eviction replay (bfloat16)" in out
    assert "by phase" in out
    assert "queue for GPU blocks" in out
    result = run_bench(
        BenchConfig(
            users=2,
            rounds=2,
            warmup="round",
            system_prompt=32,
            first_question=16,
            question=16,
            answer=4,
            dtype="bfloat16",
        )
    )
    assert result.check.reference == "no-eviction replay of the offload run's prompts"
    assert result.check.passed
    assert result.check.requests == 4
    on = result.runs[1]
    assert set(on.history_ttft_phases_mean_ms) >= {"queue", "load_copy", "load_seen", "first_step"}


@pytest.mark.usefixtures("fresh_process")
def test_bench_step_parts_table_and_json(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--step-parts`` prints where the engine's steps went per kind of step; the JSON has the
    same figures either way: steps per round, and the parts adding up to each kind's total."""
    figures = tmp_path / "f.json"
    assert main(["bench", *TINY, "--step-parts", "--json", str(figures)]) == 0
    out, _ = capfd.readouterr()
    assert "Engine steps per round with a history" in out
    runs = json.loads(figures.read_text())["runs"]
    for run in runs:
        parts = run["history_step_parts"]
        assert {"decode", "prefill"} <= set(parts) <= {"decode", "prefill", "mixed", "idle"}
        for kind in parts.values():
            assert kind["steps"] >= 1
            summed = sum(v for k, v in kind.items() if k.endswith("_ms") and k != "total_ms")
            assert summed == pytest.approx(kind["total_ms"])
    assert runs[0]["history_step_parts"]["decode"]["meta_ms"] >= 0.0
