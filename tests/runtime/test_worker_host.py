"""The worker runtime's scenarios on the host backend with real data: every round trip is
byte-compared after store → evict → load. Copies run on the backend's thread; the tests wait
only on the runtime (flush / shutdown), never by sleeping."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from kvflow.backends.base import CopyBatch
from kvflow.backends.host import HostBackend
from kvflow.backends.torch_layout import region_view
from kvflow.core.layout import KVLayout
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.errors import ClosedError
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

pytestmark = pytest.mark.asyncio

N = 8  # GPU blocks
CPU = 16
Caches = dict[str, torch.Tensor]

LAYOUTS: dict[str, Callable[[], Caches]] = {
    "flash_attention": lambda: {f"l{i}": torch.randn(2, N, 4, 2, 8) for i in range(3)},
    "flashinfer_mla": lambda: {f"l{i}": torch.randn(N, 16, 64) for i in range(3)},
    "cross_layer": lambda: {"all": torch.randn(N, 3, 2, 4, 2, 8)},
}


def blocks(layout: KVLayout, caches: Caches, ids: list[int]) -> list[torch.Tensor]:
    """Every region's pages of GPU blocks ``ids``, as bytes (copied)."""
    return [region_view(caches[r.tensor], r)[ids].clone() for g in layout.groups for r in g.regions]


def store(tid: int, req: str, gpu: list[int], cpu: list[int]) -> TransferSpec:
    return TransferSpec(tid, req, Direction.STORE, [gpu], [cpu])


def load(tid: int, req: str, gpu: list[int], cpu: list[int]) -> TransferSpec:
    return TransferSpec(tid, req, Direction.LOAD, [gpu], [cpu])


def evict(caches: Caches) -> None:
    for t in caches.values():
        t.fill_(-1.0)


@pytest.mark.parametrize("style", sorted(LAYOUTS))
async def test_host_round_trip_is_byte_exact(style: str) -> None:
    """Blocks stored, evicted from the GPU tier and loaded elsewhere come back byte for byte."""
    caches = LAYOUTS[style]()
    with capture_logs() as logs:
        async with WorkerRuntime.open(HostBackend()) as rt:
            layout = rt.register_kv_caches(caches, N)
            rt.allocate_cpu_tier(CPU)
            before = blocks(layout, caches, [1, 2, 5])
            rt.bind(StepPlan(1, stores=(store(1, "r", [1, 2, 5], [9, 3, 15]),)))
            rt.launch()
            with anyio.fail_after(30):
                await rt.flush()
            assert rt.get_finished() == ({"r"}, set())
            assert rt.build_report().completed == (1,)
            evict(caches)
            rt.bind(StepPlan(2, loads=(load(2, "r", [7, 0, 4], [9, 3, 15]),)))
            rt.launch()
            with anyio.fail_after(30):
                await rt.flush()
            assert rt.get_finished() == (set(), {"r"})
            assert rt.build_report().completed == (2,)
            after = blocks(layout, caches, [7, 0, 4])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    moves = [
        (e["transfer_id"], e["from"], e["to"]) for e in logs if e["event"] == "transfer_transition"
    ]
    assert moves == [
        (t, a, b)
        for t in (1, 2)
        for a, b in (
            ("pending", "in_flight"),
            ("in_flight", "committed"),
            ("committed", "released"),
        )
    ]


async def test_host_many_in_flight_steps() -> None:
    """Many steps of stores in flight at once all land, each in its own CPU block."""
    caches = LAYOUTS["flash_attention"]()
    async with WorkerRuntime.open(HostBackend(), WorkerOptions(coalesce=False)) as rt:
        layout = rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        before = blocks(layout, caches, list(range(N)))
        for step in range(N):
            rt.bind(StepPlan(step, stores=(store(step, f"r{step}", [step], [CPU - 1 - step]),)))
            rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        assert sorted(rt.build_report().completed) == list(range(N))
        evict(caches)
        rt.bind(StepPlan(N, loads=tuple(load(N + b, "x", [b], [CPU - 1 - b]) for b in range(N))))
        rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        assert len(rt.build_report().completed) == N
        after = blocks(layout, caches, list(range(N)))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


async def test_host_store_copies_what_compute_wrote_before_wait_for_save() -> None:
    """A store launched by wait_for_save copies the block as the step's compute left it."""
    caches = LAYOUTS["flashinfer_mla"]()
    backend = HostBackend()
    async with WorkerRuntime.open(backend) as rt:
        layout = rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        rt.bind(StepPlan(1, stores=(store(1, "r", [3], [0]),)))
        rt.start_load_kv()
        for t in caches.values():
            t[3] = 7.0  # this step's compute writes the block
        rt.wait_for_save()
        with anyio.fail_after(30):
            await rt.flush()
        row = backend.cpu_tier(0)[0].view(torch.float32)
        assert layout.groups[0].block_bytes == 3 * 16 * 64 * 4
        assert bool((row == 7.0).all())


async def test_host_load_after_store_on_same_block() -> None:
    """A load into a GPU block launched right after a store of it leaves the store's copy intact."""
    caches = LAYOUTS["flash_attention"]()
    async with WorkerRuntime.open(HostBackend()) as rt:
        layout = rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        rt.bind(StepPlan(1, stores=(store(1, "a", [6], [10]),)))
        rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        rt.build_report()
        old_2, old_6 = blocks(layout, caches, [2]), blocks(layout, caches, [6])
        rt.bind(StepPlan(2, stores=(store(2, "b", [2], [11]),)))
        rt.launch()
        rt.bind(StepPlan(3, loads=(load(3, "a", [2], [10]),)))
        rt.launch()  # no flush in between: the load must wait for the store of block 2
        with anyio.fail_after(30):
            await rt.flush()
        assert sorted(rt.build_report().completed) == [2, 3]
        evict(caches)
        rt.bind(StepPlan(4, loads=(load(4, "b", [5], [11]),)))
        rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        rt.build_report()
        loaded_old_2 = blocks(layout, caches, [5])
    assert all(torch.equal(a, b) for a, b in zip(old_2, loaded_old_2, strict=True))
    assert not torch.equal(old_2[0], old_6[0])


async def test_host_flush_waits_for_queued_copies() -> None:
    """A flush right after launch, before the executor ran, returns with every copy done."""
    caches = LAYOUTS["cross_layer"]()
    async with WorkerRuntime.open(HostBackend()) as rt:
        rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        rt.bind(StepPlan(1, stores=tuple(store(i, "r", [i], [i]) for i in range(N))))
        rt.launch()
        assert rt.executor.queued == 1
        with anyio.fail_after(30):
            await rt.handle_preemptions(StepPlan(2, flush=True))
        assert rt.in_flight == 0
        assert len(rt.build_report().completed) == N


async def test_host_failed_copy_reports_invalid_blocks() -> None:
    """A load naming a CPU block outside the tier fails alone; its neighbours load correctly."""
    caches = LAYOUTS["flashinfer_mla"]()
    async with WorkerRuntime.open(HostBackend(), WorkerOptions(coalesce=False)) as rt:
        layout = rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        rt.bind(StepPlan(1, stores=(store(1, "a", [0], [0]),)))
        rt.launch()
        before = blocks(layout, caches, [0])
        rt.bind(StepPlan(2, loads=(load(2, "a", [4], [0]), load(3, "b", [5, 6], [1, CPU]))))
        rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        report = rt.build_report()
        assert (sorted(report.completed), report.failed) == ([1, 2], (3,))
        assert report.invalid_block_ids == {5, 6}
        assert all(
            torch.equal(a, b) for a, b in zip(before, blocks(layout, caches, [4]), strict=True)
        )


async def test_host_shutdown_with_work_in_flight() -> None:
    """Leaving the runtime with copies in flight drains them all, then closes the backend."""
    caches = {f"l{i}": torch.randn(N, 64, 8, 64) for i in range(4)}
    backend = HostBackend()
    async with WorkerRuntime.open(backend) as rt:
        layout = rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        tier = backend.cpu_tier(0)  # held past close, to check what the copies wrote
        for step in range(4):
            rt.bind(
                StepPlan(
                    step,
                    stores=(
                        store(step, "r", [2 * step, 2 * step + 1], [5 + 2 * step, 6 + 2 * step]),
                    ),
                )
            )
            rt.launch()
        assert rt.in_flight == 4
    assert sorted(rt.build_report().completed) == [0, 1, 2, 3]
    with pytest.raises(ClosedError):
        backend.submit(CopyBatch(Direction.STORE, ((0,),), ((0,),)))
    group = layout.groups[0]
    for b in range(8):
        for r, off in zip(group.regions, group.cpu_offsets, strict=True):
            page = region_view(caches[r.tensor], r)[b]
            assert torch.equal(tier[5 + b, off : off + r.page_bytes], page)


async def test_host_copy_time_is_the_copy_threads_own() -> None:
    """The host backend times each batch on its copy thread: every batch is measured, and the
    measured time is within the submit → seen-done time."""
    caches = LAYOUTS["flash_attention"]()
    async with WorkerRuntime.open(HostBackend()) as rt:
        rt.register_kv_caches(caches, N)
        rt.allocate_cpu_tier(CPU)
        rt.bind(StepPlan(1, stores=(store(1, "r", [1, 2, 5], [9, 3, 15]),)))
        rt.launch()
        with anyio.fail_after(30):
            await rt.flush()
        rt.build_report()
        stats = rt.copy_stats()[Direction.STORE]
    assert stats.measured
    assert rt.layout is not None
    assert stats.bytes == 3 * rt.layout.groups[0].block_bytes
    assert 0 < stats.copy_s <= stats.in_flight_s
    assert rt.copy_throughput()[Direction.STORE] == (stats.bytes, stats.copy_s)
