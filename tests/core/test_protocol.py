"""Tests of the scheduler/worker messages: validation and report aggregation across ranks."""

from __future__ import annotations

import pickle

import pytest

from kvflow.core.protocol import StepPlan, StepReport, TransferSpec, aggregate, merge_reports
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ReportError


def test_transfer_spec_pairs_blocks_per_group_and_knows_its_direction() -> None:
    """src/dst follow the direction; lists are normalised to tuples of ints."""
    spec = TransferSpec(1, "r", Direction.STORE, [[3, 4], [9]], [[0, 1], [2]])
    assert spec.gpu_block_ids == ((3, 4), (9,))
    assert spec.src_block_ids == spec.gpu_block_ids
    assert spec.dst_block_ids == ((0, 1), (2,))
    assert spec.num_blocks == 3
    load = TransferSpec(2, "r", Direction.LOAD, [[3]], [[0]])
    assert load.src_block_ids == ((0,),)


@pytest.mark.parametrize(
    ("gpu", "cpu", "match"),
    [
        ([[1, 2]], [[1]], "2 GPU blocks but 1 CPU blocks"),
        ([[1], [2]], [[1]], "2 GPU groups but 1 CPU groups"),
        ([[-1]], [[1]], "negative block id"),
    ],
)
def test_transfer_spec_rejects_mismatched_blocks(
    gpu: list[list[int]], cpu: list[list[int]], match: str
) -> None:
    """A spec whose two ends do not pair up is a ConfigError naming the transfer and group."""
    with pytest.raises(ConfigError, match=match):
        TransferSpec(5, "r", Direction.LOAD, gpu, cpu)


def test_messages_pickle_unchanged() -> None:
    """Plans and reports cross process boundaries intact."""
    plan = StepPlan(3, stores=(TransferSpec(1, "r", Direction.STORE, [[1]], [[2]]),), flush=True)
    report = StepReport(1, completed=(1,), failed=(2,), invalid_block_ids=frozenset({5}))
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert pickle.loads(pickle.dumps(report)) == report


def test_aggregate_collects_ranks_per_transfer() -> None:
    """Each transfer maps to the set of ranks that finished it; invalid blocks are unioned."""
    agg = aggregate(
        [
            StepReport(0, completed=(1, 2)),
            StepReport(1, completed=(1,), failed=(2,), invalid_block_ids=frozenset({7})),
        ],
        world_size=2,
    )
    assert agg.completed == {1: frozenset({0, 1}), 2: frozenset({0})}
    assert agg.failed == {2: frozenset({1})}
    assert agg.invalid_block_ids == frozenset({7})
    empty = aggregate([], world_size=2)
    assert (empty.completed, empty.failed, empty.invalid_block_ids) == ({}, {}, frozenset())


def test_aggregate_rejects_a_rank_reporting_a_transfer_twice() -> None:
    """Two reports of one rank naming the same transfer are an error, not a double count."""
    with pytest.raises(ReportError, match="rank 0 reported transfer 1 twice"):
        aggregate([StepReport(0, completed=(1,)), StepReport(0, completed=(1,))], world_size=2)
    with pytest.raises(ReportError, match="rank 0 reported transfer 1 twice"):
        aggregate([StepReport(0, completed=(1,)), StepReport(0, failed=(1,))], world_size=2)


def test_aggregate_rejects_unknown_ranks_and_bad_reports() -> None:
    """Ranks outside the world and self-contradicting reports raise ReportError."""
    with pytest.raises(ReportError, match="world size is 2"):
        aggregate([StepReport(2, completed=(1,))], world_size=2)
    with pytest.raises(ReportError, match="completed and failed"):
        StepReport(0, completed=(1,), failed=(1,))
    with pytest.raises(ReportError, match="twice in one report"):
        StepReport(0, completed=(1, 1))
    with pytest.raises(ReportError, match="negative rank"):
        StepReport(-1)
    with pytest.raises(ReportError, match="dates a request's landed load twice"):
        StepReport(0, completed=(1, 2), landed=(("r", 1.0), ("r", 2.0)))


def test_merging_one_ranks_reports_keeps_everything_and_each_requests_latest_landing() -> None:
    """``merge_reports`` joins a rank's reports of several polls: every transfer and invalid
    block, and for a request dated in two of them, the later landing."""
    merged = merge_reports(
        1,
        [
            StepReport(1, completed=(1,), landed=(("a", 2.0), ("b", 1.0))),
            StepReport(1, completed=(3,), failed=(4,), invalid_block_ids=frozenset({9})),
            StepReport(1, completed=(5,), landed=(("a", 3.0),)),
        ],
    )
    assert merged == StepReport(
        1,
        completed=(1, 3, 5),
        failed=(4,),
        invalid_block_ids=frozenset({9}),
        landed=(("a", 3.0), ("b", 1.0)),
    )
    assert merge_reports(0, []) == StepReport(0)
