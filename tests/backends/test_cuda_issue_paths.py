"""CPU-side tests of which path the CUDA backend's issue takes for one group of a batch: the
staged ring, direct descriptors, or (``CudaConfig.store_dma``) a store's 2D copies."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.backends.plan_helpers import flash_table

from kvflow.backends.cuda import issue
from kvflow.backends.cuda.config import CudaConfig
from kvflow.backends.cuda.plan import Descriptors, Pitched, direct_descriptors, pitched_direct

CPU_BASE = 1 << 30


class _Tier:
    """The pinned tier as the issue path reads it: a base address and a chunk size."""

    def ptr(self, group: int) -> int:
        return CPU_BASE

    def chunk_blocks(self, group: int) -> int:
        return 0


class _Lane:
    dma = "dma-stream"


def issued(
    monkeypatch: pytest.MonkeyPatch,
    *,
    store_dma: bool,
    staged: bool,
    store: bool,
    gpu: tuple[int, ...],
    cpu: tuple[int, ...],
    regions: tuple[int, int] | None = None,
    min_run: int = 4,
    config: CudaConfig | None = None,
) -> list[tuple[str, Any]]:
    """Run ``_copy_group`` for one group on a stand-in backend (``config`` instead of the
    options before it where given); what it queued, in order."""
    calls: list[tuple[str, Any]] = []
    backend: Any = issue.BatchIssue.__new__(issue.BatchIssue)
    if config is None:
        config = CudaConfig(store_dma=store_dma, store_dma_min_run=min_run)
    backend.config = config
    backend._staged = [staged]
    backend._staged_copy = lambda *a, **k: calls.append(("staged", k["regions"]))
    backend._copy = lambda desc, lane, stream: calls.append(("copy", desc))
    monkeypatch.setattr(issue, "enter_stream", lambda *a: calls.append(("enter", a[1])))
    table = flash_table(2, 64, 16)
    item = (0, table, gpu, cpu)
    backend._copy_group(_Lane(), item, _Tier(), [], [], None, store, regions, [])
    return calls


RUNS = (tuple(range(4, 20)), tuple(range(30, 46)))  # one run of 16 blocks on both sides
SCATTERED = ((9, 3, 40, 17), (1, 8, 2, 30))


def test_a_store_in_runs_with_store_dma_goes_as_the_2d_copies_on_the_dma_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``store_dma`` a store whose blocks come in runs is the 2D copies of
    ``pitched_direct``, queued on the direction's DMA stream, never the staged ring."""
    calls = issued(monkeypatch, store_dma=True, staged=True, store=True, gpu=RUNS[0], cpu=RUNS[1])
    assert [c[0] for c in calls] == ["enter", "copy"]
    assert calls[0][1] == _Lane.dma
    copies = calls[1][1]
    assert isinstance(copies, Pitched)
    gpu, cpu = (np.array(ids, dtype=np.int64) for ids in RUNS)
    want = pitched_direct(flash_table(2, 64, 16), gpu, cpu, CPU_BASE, store=True)
    assert want is not None
    assert copies.dst.tolist() == want.dst.tolist()
    assert copies.src.tolist() == want.src.tolist()
    assert copies.gpu_pitch == 16
    assert copies.cpu_pitch == want.cpu_pitch


@pytest.mark.parametrize(("min_run", "dma"), [(16, True), (17, False)])
def test_a_store_goes_as_2d_copies_only_where_its_runs_average_store_dma_min_run(
    monkeypatch: pytest.MonkeyPatch, min_run: int, dma: bool
) -> None:
    """A store of one 16-block run is 2D copies with ``store_dma_min_run`` 16 and takes the
    staged ring with 17: runs shorter on average than the minimum keep the group's path."""
    calls = issued(
        monkeypatch,
        store_dma=True,
        staged=True,
        store=True,
        gpu=RUNS[0],
        cpu=RUNS[1],
        min_run=min_run,
    )
    assert [c[0] for c in calls] == (["enter", "copy"] if dma else ["staged"])


@pytest.mark.parametrize(
    ("gpu", "cpu", "dma"),
    [
        (tuple(range(8, 56)), tuple(range(100, 148)), True),  # one run of 48 blocks
        ((*range(16), *range(30, 46)), tuple(range(200, 232)), False),  # runs of 16
    ],
)
def test_by_default_a_long_prefills_store_is_2d_copies_and_a_short_run_store_is_staged(
    monkeypatch: pytest.MonkeyPatch, gpu: tuple[int, ...], cpu: tuple[int, ...], dma: bool
) -> None:
    """With the default ``CudaConfig`` a store whose runs average 32 blocks or more (a long
    prefill's) goes as 2D copies, and one whose runs average fewer (a multi-turn workload's
    short runs) through the staged ring."""
    calls = issued(
        monkeypatch,
        store_dma=False,
        staged=True,
        store=True,
        gpu=gpu,
        cpu=cpu,
        config=CudaConfig(),
    )
    assert [c[0] for c in calls] == (["enter", "copy"] if dma else ["staged"])


def test_a_store_of_scattered_blocks_is_staged_without_planning_2d_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store whose GPU ids are scattered (a multi-turn step's) goes to the staged ring
    without ``pitched_direct`` building its arrays first: a cheap scan of the ids rules the 2D
    copies out before any copy is queued."""
    planned: list[int] = []
    monkeypatch.setattr(issue, "pitched_direct", lambda *a, **k: planned.append(1))
    gpu = tuple(int(i) for i in np.random.default_rng(7).permutation(np.arange(1, 64))[:48])
    calls = issued(
        monkeypatch,
        store_dma=True,
        staged=True,
        store=True,
        gpu=gpu,
        cpu=tuple(range(100, 148)),
        config=CudaConfig(),
    )
    assert [c[0] for c in calls] == ["staged"]
    assert planned == []


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize(
    ("store_dma", "store", "ids", "regions"),
    [
        (False, True, RUNS, None),  # the option off
        (True, True, SCATTERED, None),  # runs too short for 2D copies
        (True, False, RUNS, None),  # a load
        (True, False, RUNS, (1, 3)),  # a load's part
    ],
)
def test_anything_else_keeps_the_groups_own_path(
    monkeypatch: pytest.MonkeyPatch,
    staged: bool,
    store_dma: bool,
    store: bool,
    ids: tuple[tuple[int, ...], tuple[int, ...]],
    regions: tuple[int, int] | None,
) -> None:
    """Without the option, for scattered blocks, and for every load (whole or a part), the
    group's own path runs: the staged ring, or one batch of direct descriptors."""
    gpu, cpu = ids
    calls = issued(
        monkeypatch,
        store_dma=store_dma,
        staged=staged,
        store=store,
        gpu=gpu,
        cpu=cpu,
        regions=regions,
    )
    if staged:
        assert calls == [("staged", regions)]
        return
    assert [c[0] for c in calls] == ["enter", "copy"]
    desc = calls[1][1]
    assert isinstance(desc, Descriptors)
    table = flash_table(2, 64, 16)
    part = table if regions is None else table.subset(*regions)
    want = direct_descriptors(
        part,
        np.array(gpu, dtype=np.int64),
        np.array(cpu, dtype=np.int64),
        CPU_BASE,
        store=store,
    )
    assert desc.dst.tolist() == want.dst.tolist()
    assert desc.src.tolist() == want.src.tolist()


def test_a_checked_batch_skips_the_id_checks_but_not_the_counts() -> None:
    """``group_work`` checks every id of a batch it is not told was checked (an id out of
    range is a ``ConfigError`` naming it); a ``checked`` batch's tuples are taken as they are,
    but unequal GPU and CPU counts are still refused."""
    from kvflow.backends.cuda.plan import group_work
    from kvflow.errors import ConfigError

    table = flash_table(2, 64, 16)
    with pytest.raises(ConfigError, match=r"group 0 CPU block id 9 is outside 0\.\.7"):
        group_work([table], [8], ((1, 2),), ((3, 9),))
    ((_, _, gpu, cpu),) = group_work([table], [8], ((1, 2),), ((3, 4),), checked=True)
    assert (gpu, cpu) == ((1, 2), (3, 4))
    with pytest.raises(ConfigError, match="group 0: 2 GPU blocks but 1 CPU blocks"):
        group_work([table], [8], ((1, 2),), ((3,),), checked=True)
    # Ids not given as tuples are converted and checked even so.
    with pytest.raises(ConfigError, match="GPU block id 70 is outside"):
        group_work([table], [8], (np.array([1, 70]),), ((3, 4),), checked=True)
