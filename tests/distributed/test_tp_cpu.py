"""Tensor parallelism on CPU: two ranks as two processes (gloo), each with the host backend.

Rank 0 runs the engine and kvflow's one scheduler-side manager (world_size 2); both ranks run the
sharded forward and their own worker runtime and CPU tier. Each test spawns its two ranks through
``kvflow.engine.distributed.launch``, which kills them after a timeout, so CI never hangs.
Deselect with ``-m "not distributed"``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.connector.config import OffloadConfig
from kvflow.core.transfer import Direction
from kvflow.engine.distributed import launch
from kvflow.engine.engine import Engine
from kvflow.engine.model import model_config
from kvflow.engine.tp import RankZeroResult, TPSpec
from kvflow.engine.workload import run_multi_round
from tests.distributed import tp_scenarios as scen
from tests.engine.helpers import shared_model

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60.0
SPEC = TPSpec(
    model="tiny",
    engine=scen.ENGINE,
    offload=OffloadConfig(cpu_bytes="16MiB", backend="host", world_size=2),
)


@pytest.fixture(scope="module")
def tp1_outputs() -> dict[tuple[int, int], tuple[int, ...]]:
    """Greedy outputs of the workload on one rank (the full model), offload off."""
    engine = Engine(model_config("tiny"), scen.ENGINE, model=shared_model("tiny"))
    try:
        return run_multi_round(engine, scen.WORKLOAD).outputs()
    finally:
        engine.shutdown()


def _rank0(results: list[Any]) -> RankZeroResult[dict[str, Any]]:
    first = results[0]
    assert isinstance(first, RankZeroResult)
    assert results[1:] == [None]
    return first


def test_sharded_forward_matches_the_full_model() -> None:
    """Each rank holds half the q and kv heads, and with the all-reduce computes the full logits."""
    results = launch(scen.forward_rank, ("tiny",), world_size=2, timeout_s=TIMEOUT_S)
    cfg = model_config("tiny")
    for r in results:
        assert r["heads"] == cfg.num_heads // 2
        assert r["kv_heads"] == cfg.num_kv_heads // 2
        assert r["argmax_equal"]
        assert r["max_abs_diff"] < 1e-3


def test_tp2_with_offload_matches_tp1_and_both_ranks_store_and_load(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """tp=2 with offload gives the tp=1 greedy outputs; both ranks stored and loaded blocks."""
    res = _rank0(launch(scen.multi_round_rank, (SPEC, {}), world_size=2, timeout_s=TIMEOUT_S))
    got = res.value
    assert got["outputs"] == tp1_outputs
    assert got["blocks_stored"] > 0
    assert got["blocks_loaded"] > 0
    assert got["external_loaded_tokens"] > 0
    assert got["violations"] == []
    assert got["leaks"] == []
    assert [s.rank for s in res.statuses] == [0, 1]
    for status in res.statuses:
        assert status.in_flight == 0
        assert status.copies[Direction.STORE][0] > 0
        assert status.copies[Direction.LOAD][0] > 0
    # Both ranks ran the same plans over their halves of each block: the same bytes moved.
    (b0, b1) = ({d: s.copies[d][0] for d in Direction} for s in res.statuses)
    assert b0 == b1


def test_late_rank_reports_commit_nothing_early_and_leak_nothing(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """Rank 1's reports 5 steps late: no early commit, no hit before both ranks have it, no leak."""
    res = _rank0(
        launch(
            scen.multi_round_rank, (SPEC, {1: ("delay", 5)}), world_size=2, timeout_s=TIMEOUT_S
        )
    )
    got = res.value
    assert got["outputs"] == tp1_outputs
    # The audit saw stores reported by rank 0 only, and each was still live and uncached then.
    assert got["partial_checks"] > 0
    assert got["loads_checked"] > 0
    assert got["violations"] == []
    assert got["blocks_stored"] > 0
    assert got["blocks_loaded"] > 0
    assert got["leaks"] == []
    assert [s.in_flight for s in res.statuses] == [0, 0]


def test_duplicate_report_from_one_rank_is_rejected_not_double_counted() -> None:
    """A rank naming a live store twice raises ReportError; the store stays uncommitted."""
    res = _rank0(launch(scen.duplicate_rank, (SPEC,), world_size=2, timeout_s=TIMEOUT_S))
    got = res.value
    assert "twice" in got["error"]
    assert got["duplicates"]
    assert {rank for rank, _tid in got["duplicates"]} == {1}
    # Still in flight, reported by rank 1 once: not counted as the two ranks.
    assert all(state == (True, [1]) for state in got["states"].values()), got["states"]
    assert got["violations"] == []
