"""Tensor parallelism on two GPUs: one rank per GPU, NCCL sums, the CUDA backend on each rank.

The same scenarios as the CPU two-process tests, on the real path: each rank's KV cache lives on
its own GPU and its stores and loads are DMA copies to and from its own pinned CPU tier, so a
rank's report really can arrive after the other's. Skipped unless two CUDA devices are visible.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from kvflow.connector.config import OffloadConfig
from kvflow.engine.distributed import launch
from kvflow.engine.engine import Engine
from kvflow.engine.model import build_model, model_config
from kvflow.engine.tp import RankZeroResult, TPSpec
from kvflow.engine.workload import run_multi_round
from tests.connector.test_offload_end_to_end import WORKLOAD
from tests.distributed import tp_scenarios as scen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

TIMEOUT_S = 180.0
# float32: tp=2 sums two partial products where tp=1 computes one, and greedy tokens must not
# depend on that rounding.
ENGINE = attrs.evolve(scen.ENGINE, device="cuda", dtype="float32")
SPEC = TPSpec(
    model="tiny",
    engine=ENGINE,
    offload=OffloadConfig(cpu_bytes="16MiB", backend="cuda", world_size=2),
)


@pytest.fixture(scope="module")
def tp1_outputs() -> dict[tuple[int, int], tuple[int, ...]]:
    """Greedy outputs of the workload on one GPU (the full model), offload off."""
    cfg = model_config("tiny")
    one = attrs.evolve(ENGINE, device="cuda:0")
    model = build_model(cfg, device="cuda:0", dtype=torch.float32, seed=one.seed)
    engine = Engine(cfg, one, model=model)
    try:
        return run_multi_round(engine, WORKLOAD).outputs()
    finally:
        engine.shutdown()


def _run(faults: dict[int, tuple[str, int]]) -> RankZeroResult[dict[str, Any]]:
    return scen.rank_zero(
        launch(
            scen.multi_round_rank, (SPEC, faults), world_size=2, timeout_s=TIMEOUT_S, device="cuda"
        )
    )


def test_tp2_on_two_gpus_matches_one_gpu_and_both_ranks_copy(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """tp=2 over two GPUs with offload gives the one-GPU greedy outputs; each rank's CUDA backend
    stored and loaded the same bytes of its own shard, and nothing is left held."""
    scen.check_tp2_matches_tp1(_run({}), tp1_outputs)


def test_late_rank_on_gpus_commits_nothing_early_and_leaks_nothing(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """Rank 1's reports 5 steps late on real GPU copies: no store commits on rank 0's report
    alone, no CPU hit is served before both ranks have the block, no leak, same outputs."""
    scen.check_late_rank(_run({1: ("delay", 5)}), tp1_outputs)
