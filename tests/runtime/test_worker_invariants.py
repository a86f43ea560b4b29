"""Property test: whatever the plans and however the device finishes (any order, some copies
failing), every launched transfer is reported exactly once and no copy breaks a fence."""

from __future__ import annotations

import anyio
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.backends.fake import FakeBackend, FakeFence
from kvflow.core.layout import TensorDesc
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.runtime.clock import FakeClock, wait_all_tasks_blocked
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

BLOCKS = 8

transfer = st.tuples(
    st.sampled_from([Direction.STORE, Direction.LOAD]),
    st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=3, unique=True),
)
steps = st.lists(st.lists(transfer, max_size=4), min_size=1, max_size=5)


async def scenario(plan: list[list[tuple[Direction, list[int]]]], data: st.DataObject) -> None:
    clock = FakeClock()
    fake = FakeBackend(now=clock.now)
    desc = TensorDesc("kv", (BLOCKS, 64), (64, 1), 2, 0x1000, "cuda:0")
    fake.register_kv_caches({"kv": desc}, BLOCKS)
    fake.allocate_cpu_tier([BLOCKS])
    coalesce = data.draw(st.booleans(), label="coalesce")
    launched: dict[int, TransferSpec] = {}
    completed: list[int] = []
    failed: list[int] = []
    invalid: set[int] = set()
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, coalesce=coalesce)) as rt:
        tid = 0
        for step, items in enumerate(plan):
            stores: list[TransferSpec] = []
            loads: list[TransferSpec] = []
            for direction, blocks in items:
                tid += 1
                spec = TransferSpec(tid, f"r{tid}", direction, [blocks], [blocks])
                (stores if direction is Direction.STORE else loads).append(spec)
                launched[tid] = spec
            fake.write({b for _, blocks in items for b in blocks})
            rt.bind(StepPlan(step, stores=tuple(stores), loads=tuple(loads)))
            rt.start_load_kv()
            rt.wait_for_save()
            await wait_all_tasks_blocked()
            while fake.pending:
                if not data.draw(st.booleans(), label="finish one now"):
                    break
                fence: FakeFence = data.draw(st.sampled_from(fake.pending), label="fence")
                if fence.kind == "copy" and data.draw(st.booleans(), label="fail it"):
                    fake.fail(fence)
                else:
                    fake.release(fence)
                await wait_all_tasks_blocked()
            report = rt.build_report()
            completed += report.completed
            failed += report.failed
            invalid |= report.invalid_block_ids
        fake.release_all()
        await rt.flush()
        report = rt.build_report()
        completed += report.completed
        failed += report.failed
        invalid |= report.invalid_block_ids
        assert rt.in_flight == 0
    assert sorted(completed + failed) == sorted(launched)
    assert fake.violations == []
    failed_loads = {
        b
        for t in failed
        if launched[t].direction is Direction.LOAD
        for b in launched[t].gpu_block_ids[0]
    }
    assert invalid == failed_loads


@settings(max_examples=60, deadline=None)
@given(steps, st.data())
def test_every_transfer_reported_once_and_fences_hold(
    plan: list[list[tuple[Direction, list[int]]]], data: st.DataObject
) -> None:
    """Random plans, release orders and failures: each transfer reported once, no violation."""
    anyio.run(scenario, plan, data)
