"""Tensor parallelism on CPU: two ranks as two processes (gloo), each with the host backend.

Rank 0 runs the engine and kvflow's one scheduler-side manager (world_size 2); both ranks run the
sharded forward and their own worker runtime and CPU tier. Each test spawns its two ranks through
``kvflow.engine.distributed.launch``, which kills them after a timeout, so CI never hangs.
Deselect with ``-m "not distributed"``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import ProcessRaisedException

from kvflow.connector.config import OffloadConfig
from kvflow.engine.distributed import ProcessGroupChannel, launch
from kvflow.engine.engine import Engine
from kvflow.engine.model import build_model, model_config
from kvflow.engine.tp import TPSpec, shard_config, shard_model
from kvflow.engine.workload import run_multi_round
from kvflow.errors import ConfigError, DeadlineError, KVFlowError
from kvflow.runtime.clock import SystemClock
from tests.connector.test_offload_end_to_end import WORKLOAD
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
        return run_multi_round(engine, WORKLOAD).outputs()
    finally:
        engine.shutdown()


class ThreadSum:
    """An all-reduce between threads: each rank's thread hands in its part and gets the sum."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * world_size

    def reducer(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = torch.stack([p for p in self.parts if p is not None]).sum(0)
            self.barrier.wait()  # every rank has read the parts before any overwrites its own
            return total

        return reduce


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_sharded_forward_matches_the_full_model(name: str) -> None:
    """Two shards (half the q and kv heads and MLP each) with a summing reduce give the full
    model's logits, sliding-window layers included."""
    full = shared_model(name) if name == "tiny" else build_model(model_config(name), seed=0)
    ids = [(37 * i + 11) % full.config.vocab_size for i in range(40)]
    want = full.forward_dense(ids)
    sums = ThreadSum(2)
    shards = [shard_model(full, r, 2, sums.reducer(r)) for r in range(2)]
    for shard in shards:
        assert shard.config.num_heads == full.config.num_heads // 2
        assert shard.config.num_kv_heads == full.config.num_kv_heads // 2
        assert shard.config.head_dim == full.config.head_dim
    got: list[torch.Tensor] = [torch.empty(0)] * 2

    def run(rank: int) -> None:
        got[rank] = shards[rank].forward_dense(ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for logits in got:
        assert torch.allclose(logits, want, atol=1e-3, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


def test_shard_config_rejects_heads_not_divisible_by_tp() -> None:
    """A tp size that does not divide the kv heads is a ConfigError naming the field."""
    with pytest.raises(ConfigError, match="num_kv_heads 2 is not divisible by tp 4"):
        shard_config(model_config("tiny"), 4)


def test_tp2_with_offload_matches_tp1_and_both_ranks_store_and_load(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """tp=2 with offload gives the tp=1 greedy outputs; both ranks stored and loaded blocks."""
    res = scen.rank_zero(
        launch(scen.multi_round_rank, (SPEC, {}), world_size=2, timeout_s=TIMEOUT_S)
    )
    scen.check_tp2_matches_tp1(res, tp1_outputs)
    assert res.value["external_loaded_tokens"] > 0


def test_late_rank_reports_commit_nothing_early_and_leak_nothing(
    tp1_outputs: dict[tuple[int, int], tuple[int, ...]],
) -> None:
    """Rank 1's reports 5 steps late: no early commit, no hit before both ranks have it, no leak."""
    res = scen.rank_zero(
        launch(scen.multi_round_rank, (SPEC, {1: ("delay", 5)}), world_size=2, timeout_s=TIMEOUT_S)
    )
    scen.check_late_rank(res, tp1_outputs)


def test_duplicate_report_from_one_rank_is_rejected_not_double_counted() -> None:
    """A rank naming a live store twice raises ReportError; the store stays uncommitted."""
    res = scen.rank_zero(launch(scen.duplicate_rank, (SPEC,), world_size=2, timeout_s=TIMEOUT_S))
    got = res.value
    assert "twice" in got["error"]
    assert got["duplicates"]
    assert {rank for rank, _tid in got["duplicates"]} == {1}
    # Still in flight, reported by rank 1 once: not counted as the two ranks.
    assert all(state == (True, [1]) for state in got["states"].values()), got["states"]
    assert got["violations"] == []


def test_a_failing_rank_fails_the_launch_and_stops_the_other() -> None:
    """A rank that raises makes launch raise its error, without waiting for the timeout."""
    clock = SystemClock()
    start = clock.now()
    with pytest.raises(ProcessRaisedException, match="rank 1 failed on purpose"):
        launch(scen.raising_rank, world_size=2, timeout_s=TIMEOUT_S)
    assert clock.now() - start < TIMEOUT_S / 2


def test_a_hanging_rank_is_killed_at_the_timeout() -> None:
    """A rank that never returns is killed at the deadline and launch raises KVFlowError."""
    with pytest.raises(KVFlowError, match=r"still running after 3\.0 s"):
        launch(scen.hanging_rank, world_size=2, timeout_s=3.0)


def _barrier_without_rank_1(rank: int, world_size: int, released: Any) -> str | None:
    """Rank 0 waits at a barrier rank 1 never reaches (rank 1 waits for an event rank 0 sets
    once its barrier gave up)."""
    channel = ProcessGroupChannel()
    if rank == 0:
        try:
            channel.barrier(timeout_s=1.0)
        except DeadlineError as exc:
            message = str(exc)
        else:
            message = "no error"
        released.set()
        return message
    assert released.wait(TIMEOUT_S)
    return None


def test_a_barrier_a_rank_never_reaches_raises_a_deadline_error_naming_it() -> None:
    """A TP barrier is bounded: past its timeout rank 0 gets a DeadlineError naming the barrier
    and the rank that did not come (gloo's monitored barrier), instead of waiting forever."""
    released = torch.multiprocessing.get_context("spawn").Event()
    message, _ = launch(_barrier_without_rank_1, (released,), world_size=2, timeout_s=TIMEOUT_S)
    assert isinstance(message, str)
    assert "barrier of 2 ranks still waiting after 1 s" in message
    assert "Ranks 1 failed" in message
