"""The soak benchmark runs for 30 seconds with every fault kind injected and every bad input
kind thrown at the connector, and finds no violation of kvflow's guarantees."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from attrs import evolve
from scripts import soak
from scripts.soak_faults import Tally

from kvflow.engine.engine import Engine, EngineConfig, RequestResult
from kvflow.engine.model import build_model, model_config


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


Tie = tuple[soak.Soak, list[int], RequestResult, int]


def _greedy(engine: Engine, prompt: list[int]) -> RequestResult:
    rid = engine.add_request(prompt, 3)
    while engine.has_unfinished():
        engine.step()
    return engine.take_result(rid)


@pytest.fixture
def tie() -> Iterator[Tie]:
    """A soak whose model's LM head has two identical rows, the reference's second output token
    one of them: the soak, its prompt, the reference's result and the tied twin of that token."""
    model = build_model(model_config("tiny"), seed=5)
    prompt = [3, 14, 15, 92, 65, 35]
    args = soak.parse_args([])
    config = EngineConfig(block_size=4, num_gpu_blocks=args.gpu_blocks, max_num_batched_tokens=48)
    top = _greedy(Engine(model.config, config, model=model), prompt).output_token_ids[1]
    twin = (top + 1) % model.config.vocab_size
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[top]
    tied = soak.Soak(args, model, Tally(), "eager", "inline", seed=1)
    try:
        result = _greedy(tied.reference, prompt)
        assert result.output_token_ids[1] in (top, twin)
        yield tied, prompt, result, twin if result.output_token_ids[1] == top else top
    finally:
        tied.close()


def test_an_output_differing_first_at_an_exact_tie_is_a_near_tie_not_a_violation(tie: Tie) -> None:
    """Two outputs that first differ where the model's float64 logits of both tokens are equal
    are counted as a near tie, naming the token and the gap, and are not a violation."""
    tied, prompt, want, other = tie
    got = evolve(want, output_token_ids=(want.output_token_ids[0], other, 7))
    tied._output_differs("req-9", prompt, want.output_token_ids, got)
    assert tied.tally.violations == []
    [note] = tied.tally.near_ties
    assert note.startswith("req-9: output ")
    assert "token 1: float64 logits 0.0e+00 apart" in note


def test_an_output_differing_where_the_model_had_a_clear_answer_is_a_violation(tie: Tie) -> None:
    """An output whose first differing token is far below the reference's in float64 (what a
    bad KV block gives) is a violation stating the gap; one that only ends early is too."""
    tied, prompt, want, _ = tie
    first = want.output_token_ids[0]
    worst = (first + 512) % 1024
    got = evolve(want, output_token_ids=(worst, *want.output_token_ids[1:]))
    tied._output_differs("req-9", prompt, want.output_token_ids, got)
    short = evolve(want, output_token_ids=want.output_token_ids[:2])
    tied._output_differs("req-10", prompt, want.output_token_ids, short)
    assert tied.tally.near_ties == []
    gap, ended = tied.tally.violations
    assert gap.startswith("req-9: output ")
    assert "token 0: float64 logits" in gap
    assert float(gap.rsplit("logits ", 1)[1].split(" apart")[0]) > soak.NEAR_TIE
    assert ended.startswith("req-10: output ")
    assert "float64" not in ended


def test_the_tie_judge_holds_the_longest_traffic_sequence_and_names_a_longer_one() -> None:
    """The judge's engine is sized from the traffic's bounds: a prompt and output of
    ``MAX_SEQUENCE`` tokens differing at their last token is judged, and one past it is a
    ValueError naming both lengths rather than an engine error mid-soak."""
    model = build_model(model_config("tiny"), seed=5)
    judge = soak.TieJudge(model)
    n = soak.MAX_SEQUENCE
    assert n == 40 + 10 + 12  # a finished conversation's last 40 tokens, a tail of 10, 12 out
    prompt = [(7 * i) % 100 + 1 for i in range(n - soak.OUTPUT_TOKENS[1])]
    want = [5] * soak.OUTPUT_TOKENS[1]
    got = [*want[:-1], 6]
    verdict = judge.margin(prompt, want, got)
    assert verdict is not None
    assert verdict[0] == len(want) - 1
    with pytest.raises(ValueError, match=f"exceed its {n}"):
        judge.margin([1, *prompt], want, got)
