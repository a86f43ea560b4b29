"""The worker runtime on the fake backend: every scenario of a transfer's life, stepped
deterministically (FakeClock, fences released by the test, no real sleeps)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import anyio
import attrs
import pytest
from structlog.testing import capture_logs

from kvflow.backends.base import CopyBatch, Fence, FenceStatus, TimesCopies
from kvflow.backends.fake import GARBAGE, FakeBackend, FakeFence
from kvflow.core.layout import TensorDesc
from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import TRANSITIONS, Direction, TransferState
from kvflow.errors import ClosedError, ConfigError, ProtocolError
from kvflow.runtime.clock import FakeClock, wait_all_tasks_blocked
from kvflow.runtime.worker import WorkerOptions, WorkerRuntime

pytestmark = pytest.mark.asyncio


def store(tid: int, req: str, gpu: list[int], cpu: list[int]) -> TransferSpec:
    return TransferSpec(tid, req, Direction.STORE, [gpu], [cpu])


def load(tid: int, req: str, gpu: list[int], cpu: list[int]) -> TransferSpec:
    return TransferSpec(tid, req, Direction.LOAD, [gpu], [cpu])


def copies(fake: FakeBackend) -> list[FakeFence]:
    return [f for f in fake.submitted if f.kind == "copy"]


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


async def test_one_transfer_full_life(fake: FakeBackend, clock: FakeClock) -> None:
    """A store goes PENDING → IN_FLIGHT → COMMITTED → RELEASED, logging each step."""
    with capture_logs() as logs:
        async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, rank=3)) as rt:
            rt.bind(StepPlan(1, stores=(store(7, "req", [2, 3], [10, 11]),)))
            assert rt.transfer_state(7) is TransferState.PENDING
            version = fake.write([2, 3])
            rt.wait_for_save()
            assert rt.transfer_state(7) is TransferState.IN_FLIGHT
            await wait_all_tasks_blocked()
            [copy] = copies(fake)
            [compute] = copy.wait_for
            assert compute.kind == "compute"
            assert copy.batch == CopyBatch(Direction.STORE, ((2, 3),), ((10, 11),))
            assert rt.get_finished() == (set(), set())
            assert rt.build_report().completed == ()

            fake.release(compute)
            fake.release(copy)
            await wait_all_tasks_blocked()
            assert rt.transfer_state(7) is TransferState.COMMITTED
            assert rt.get_finished() == ({"req"}, set())
            report = rt.build_report()
            assert (report.rank, report.completed, report.failed) == (3, (7,), ())
            assert report.landed == ()  # only loads are dated
            assert rt.transfer_state(7) is None
            assert fake.cpu_version[(0, 10)] == fake.cpu_version[(0, 11)] == version
    transitions = [(e["from"], e["to"], e["cause"]) for e in events(logs, "transfer_transition")]
    assert transitions == [
        ("pending", "in_flight", "launched"),
        ("in_flight", "committed", "fence_done"),
        ("committed", "released", "reported"),
    ]
    assert all(e["transfer_id"] == 7 for e in events(logs, "transfer_transition"))
    for name in (
        "worker_runtime_started",
        "step_bound",
        "copy_order_queued",
        "copy_batch_submitted",
        "copy_batch_finished",
        "worker_runtime_stopping",
        "worker_runtime_stopped",
    ):
        assert len(events(logs, name)) == 1, name
    assert fake.closed
    assert fake.violations == []


async def test_a_step_where_nothing_finished_reports_the_ranks_one_empty_report(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """Steps with nothing finished get one shared empty report of the rank; a step with a
    finished transfer gets its own report, and the next quiet step the shared one again."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, rank=2)) as rt:
        quiet = rt.build_report()
        assert (quiet.rank, quiet.completed, quiet.failed, quiet.invalid_block_ids) == (
            2,
            (),
            (),
            frozenset(),
        )
        rt.bind(StepPlan(1, stores=(store(7, "req", [2], [10]),)))
        rt.wait_for_save()
        await wait_all_tasks_blocked()
        assert rt.build_report() is quiet  # in flight: nothing finished yet
        [copy] = copies(fake)
        [compute] = copy.wait_for
        fake.release(compute)
        fake.release(copy)
        await wait_all_tasks_blocked()
        report = rt.build_report()
        assert report is not quiet
        assert report.completed == (7,)
        assert rt.build_report() is quiet


async def test_many_in_flight_complete_out_of_order(fake: FakeBackend, clock: FakeClock) -> None:
    """Transfers finishing in reverse order are each reported once, when their own copy ends."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, coalesce=False)) as rt:
        rt.bind(StepPlan(1, stores=tuple(store(i, f"r{i % 2}", [i], [i]) for i in range(6))))
        rt.wait_for_save()
        rt.bind(StepPlan(2, loads=tuple(load(10 + i, "l", [8 + i], [20 + i]) for i in range(3))))
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        fenced = copies(fake)
        assert len(fenced) == 9
        for f in fake.pending:
            if f.kind == "compute":
                fake.release(f)
        assert rt.in_flight == 9
        reported: list[int] = []
        for f in reversed(fenced):
            fake.release(f)
            await wait_all_tasks_blocked()
            report = rt.build_report()
            assert len(report.completed) == 1
            reported.extend(report.completed)
            sending, recving = rt.get_finished()
            if reported[-1] == 0:
                assert sending == {"r0"}  # r0's last store (0, 2, 4) was id 0
            if reported[-1] == 10:
                assert recving == {"l"}
        assert reported == [12, 11, 10, 5, 4, 3, 2, 1, 0]
        assert rt.in_flight == 0
    assert fake.violations == []


async def test_store_without_compute_fence_reads_stale_data(fake: FakeBackend) -> None:
    """The hazard is real: a store not fenced after compute copies the old block contents."""
    version = fake.write([4])
    compute = fake.compute_fence()
    copy = fake.submit(CopyBatch(Direction.STORE, ((4,),), ((9,),)))  # no wait_for
    fake.release(copy)
    assert copy.status is FenceStatus.DONE
    assert fake.cpu_version.get((0, 9)) == 0 != version
    assert len(fake.violations) == 1
    assert "before the compute writing it finished" in fake.violations[0]
    fake.release(compute)
    assert fake.gpu_version[(0, 4)] == version


async def test_store_is_fenced_after_compute(fake: FakeBackend, clock: FakeClock) -> None:
    """The runtime's store waits for its step's compute fence and copies the new contents."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        version = fake.write([4])
        rt.bind(StepPlan(1, stores=(store(1, "r", [4], [9]),)))
        rt.wait_for_save()
        await wait_all_tasks_blocked()
        [copy] = copies(fake)
        fake.release(copy)  # the copy engine is free, but compute has not finished
        await wait_all_tasks_blocked()
        assert copy.status is FenceStatus.PENDING
        assert rt.build_report().completed == ()
        fake.release(copy.wait_for[0])
        await wait_all_tasks_blocked()
        assert rt.build_report().completed == (1,)
    assert fake.cpu_version[(0, 9)] == version
    assert fake.violations == []


async def test_load_waits_for_in_flight_store_on_same_block(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """A load into a GPU block an in-flight store still reads is fenced after that store."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        old = fake.write([3])
        rt.bind(StepPlan(1, stores=(store(1, "a", [3], [7]),)))
        rt.wait_for_save()
        fake.release(fake.pending[0])  # compute done; the store is queued on the copy engine
        fake.cpu_version[(0, 9)] = 99  # another request's block, already in the CPU tier
        rt.bind(StepPlan(2, loads=(load(2, "b", [3], [9]), load(3, "c", [5], [9]))))
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        store_copy, load_copy = copies(fake)
        assert store_copy in load_copy.wait_for
        fake.release(load_copy)
        await wait_all_tasks_blocked()
        assert load_copy.status is FenceStatus.PENDING
        fake.release(store_copy)
        await wait_all_tasks_blocked()
        report = rt.build_report()
        assert sorted(report.completed) == [1, 2, 3]
    assert fake.cpu_version[(0, 7)] == old
    assert fake.gpu_version[(0, 3)] == fake.gpu_version[(0, 5)] == 99
    assert fake.violations == []


async def test_store_waits_for_in_flight_load_on_same_block(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """A store of a GPU block an in-flight load still writes is fenced after that load."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        fake.cpu_version[(0, 9)] = 42
        rt.bind(StepPlan(1, loads=(load(1, "a", [3], [9]),)))
        rt.start_load_kv()
        rt.bind(StepPlan(2, stores=(store(2, "a", [3], [10]),)))
        rt.wait_for_save()
        await wait_all_tasks_blocked()
        load_copy, store_copy = copies(fake)
        assert load_copy in store_copy.wait_for
        fake.release(store_copy)
        fake.release(store_copy.wait_for[0])  # compute done
        await wait_all_tasks_blocked()
        assert store_copy.status is FenceStatus.PENDING
        fake.release(load_copy)
        await wait_all_tasks_blocked()
        assert sorted(rt.build_report().completed) == [1, 2]
    assert fake.cpu_version[(0, 10)] == 42
    assert fake.violations == []


async def test_load_into_other_blocks_does_not_wait(fake: FakeBackend, clock: FakeClock) -> None:
    """A load that shares no GPU block with in-flight stores waits for nothing."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, stores=(store(1, "a", [3], [7]),)))
        rt.wait_for_save()
        rt.bind(StepPlan(2, loads=(load(2, "b", [4], [9]),)))
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        _, load_copy = copies(fake)
        assert load_copy.wait_for == ()
        fake.release_all()
        await wait_all_tasks_blocked()
        assert sorted(rt.build_report().completed) == [1, 2]


async def test_flush_on_preemption_waits_for_queued_unsubmitted_copies(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """handle_preemptions with flush returns only after copies still in the inbox have run."""
    flushed = anyio.Event()
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:

        async def preempt() -> None:
            await rt.handle_preemptions(StepPlan(2, flush=True))
            flushed.set()

        rt.bind(StepPlan(1, stores=(store(1, "a", [1], [1]),), loads=(load(2, "b", [2], [2]),)))
        rt.launch()
        assert copies(fake) == []  # queued in the executor's inbox, not yet submitted
        assert rt.executor.queued == 2
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(preempt)
                await wait_all_tasks_blocked()
                assert len(copies(fake)) == 2
                assert not flushed.is_set()
                fake.release_all()
                await wait_all_tasks_blocked()
                assert flushed.is_set()
        assert [e["event"] for e in logs if e["event"].startswith(("preemption", "flush"))] == [
            "preemption_flush",
            "flush_requested",
            "flush_done",
        ]
        assert sorted(rt.build_report().completed) == [1, 2]


async def test_failed_load_becomes_failed_transfer_with_invalid_blocks(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """A load whose copy fails is FAILED, its GPU blocks are reported invalid, its request done."""
    with capture_logs() as logs:
        async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
            rt.bind(StepPlan(1, loads=(load(5, "r", [6, 7], [1, 2]),)))
            rt.start_load_kv()
            await wait_all_tasks_blocked()
            fake.fail(copies(fake)[0])
            await wait_all_tasks_blocked()
            assert rt.transfer_state(5) is TransferState.FAILED
            assert rt.get_finished() == (set(), {"r"})
            report = rt.build_report()
            assert (report.completed, report.failed) == ((), (5,))
            assert report.invalid_block_ids == {6, 7}
    assert fake.gpu_version[(0, 6)] == GARBAGE
    [fail] = [e for e in events(logs, "transfer_transition") if e["to"] == "failed"]
    assert fail["cause"] == "fence_failed"


async def test_failed_store_reports_no_invalid_blocks(fake: FakeBackend, clock: FakeClock) -> None:
    """A failed store is FAILED but leaves the GPU blocks valid."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, stores=(store(5, "r", [6], [1]),)))
        rt.wait_for_save()
        await wait_all_tasks_blocked()
        fake.release(fake.pending[0])
        fake.fail(copies(fake)[0])
        await wait_all_tasks_blocked()
        report = rt.build_report()
        assert (report.failed, report.invalid_block_ids) == ((5,), frozenset())


@pytest.mark.parametrize(("coalesce", "failed"), [(True, [1, 2, 3]), (False, [2])])
async def test_batch_failure_attribution(
    fake: FakeBackend, clock: FakeClock, coalesce: bool, failed: list[int]
) -> None:
    """Coalesced, one failed batch fails all its transfers; uncoalesced, only the one that failed."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, coalesce=coalesce)) as rt:
        rt.bind(StepPlan(1, loads=tuple(load(i, f"r{i}", [i], [i]) for i in (1, 2, 3))))
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        batches = copies(fake)
        assert len(batches) == (1 if coalesce else 3)
        fake.fail(batches[0] if coalesce else batches[1])
        fake.release_all()
        await wait_all_tasks_blocked()
        report = rt.build_report()
        assert sorted(report.failed) == failed
        assert sorted(report.completed) == sorted({1, 2, 3} - set(failed))
        assert report.invalid_block_ids == set(failed)


async def test_shutdown_drains_work_in_flight(fake: FakeBackend, clock: FakeClock) -> None:
    """shutdown() waits for submitted and queued copies, then closes the backend."""
    stopped = anyio.Event()
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, stores=(store(1, "a", [1], [1]),)))
        rt.wait_for_save()
        await wait_all_tasks_blocked()
        rt.bind(StepPlan(2, loads=(load(2, "b", [2], [2]),)))
        rt.start_load_kv()  # still in the inbox when shutdown begins

        async def stop() -> None:
            await rt.shutdown()
            stopped.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            await wait_all_tasks_blocked()
            assert not stopped.is_set()
            assert len(copies(fake)) == 2
            assert not fake.closed
            with pytest.raises(ClosedError):
                rt.bind(StepPlan(3, loads=(load(3, "c", [3], [3]),)))
            assert rt.transfer_state(3) is None
            fake.release_all()
        assert stopped.is_set()
        assert fake.closed
        assert sorted(rt.build_report().completed) == [1, 2]
        with pytest.raises(ClosedError):
            rt.bind(StepPlan(3))


async def test_shutdown_without_drain_fails_queued_copies(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """shutdown(drain=False) fails copies never submitted but still waits for submitted ones."""
    submitted_when_blocked: list[int] = []

    async def release_when_blocked() -> None:
        await wait_all_tasks_blocked()
        submitted_when_blocked.append(len(copies(fake)))
        fake.release_all()

    with capture_logs() as logs:
        async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
            rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
            rt.start_load_kv()
            await wait_all_tasks_blocked()
            rt.bind(StepPlan(2, loads=(load(2, "b", [2], [2]),)))
            async with anyio.create_task_group() as tg:
                tg.start_soon(release_when_blocked)
                rt.start_load_kv()
                await rt.shutdown(drain=False)
            assert submitted_when_blocked == [1]
            report = rt.build_report()
            assert (report.completed, report.failed) == ((1,), (2,))
    [shut] = [e for e in events(logs, "transfer_transition") if e["cause"] == "shutdown"]
    assert shut["transfer_id"] == 2


async def test_abandoned_transfer_is_released_when_the_device_finishes(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """An in-flight transfer a plan abandons goes ABANDONED, then RELEASED when its copy ends."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
        rt.start_load_kv()
        rt.bind(StepPlan(2, loads=(load(2, "b", [2], [2]),), abandoned=(1, 42)))
        assert rt.transfer_state(1) is TransferState.ABANDONED
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        fake.fail(copies(fake)[0])
        fake.release_all()
        await wait_all_tasks_blocked()
        assert rt.transfer_state(1) is None
        report = rt.build_report()
        assert (report.completed, report.failed) == ((2,), (1,))
        assert report.invalid_block_ids == frozenset()


async def test_delayed_fence_is_found_by_polling(fake: FakeBackend, clock: FakeClock) -> None:
    """A fence that finishes late, with no wakeup, is found by the back-off polls."""
    fake.auto_complete = False
    async with clock.autojump(), WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
        rt.start_load_kv()
        await clock.sleep(0.001)
        [copy] = copies(fake)
        fake.release_at(copy, 0.5)
        await rt.flush()
        assert 0.5 <= clock.now() <= 0.5 + rt.max_backoff
        assert rt.build_report().completed == (1,)


async def test_a_load_reports_when_its_copies_landed_not_when_a_poll_saw_them(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """A load whose copies ran at 0.5 s, found by a back-off poll later, reports its request as
    landed at 0.5 s; a failed load beside it reports no landing."""
    fake.auto_complete = False
    async with clock.autojump(), WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
        rt.start_load_kv()
        rt.bind(StepPlan(2, loads=(load(2, "b", [2], [2]),)))
        rt.start_load_kv()
        await clock.sleep(0.001)
        first, second = copies(fake)
        fake.release_at(first, 0.5)
        fake.fail(second)
        await rt.flush()
        assert clock.now() > 0.5
        report = rt.build_report()
        assert (report.completed, report.failed) == ((1,), (2,))
        assert report.landed == (("a", 0.5),)
        assert rt.build_report().landed == ()


async def test_only_loads_are_dated_a_store_never_asks_the_backend(
    fake: FakeBackend, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished store is not dated (no one reads its landing, and on CUDA dating costs a clock
    mark); the load finished beside it is."""
    fake.auto_complete = False
    asked: list[FakeFence] = []
    dated = FakeBackend.copy_landed_ago

    def spy(self: FakeBackend, fence: Fence) -> float | None:
        assert isinstance(fence, FakeFence)
        asked.append(fence)
        return dated(self, fence)

    monkeypatch.setattr(FakeBackend, "copy_landed_ago", spy)
    async with clock.autojump(), WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, stores=(store(1, "a", [1], [1]),), loads=(load(2, "b", [2], [2]),)))
        rt.start_load_kv()
        rt.wait_for_save()
        await clock.sleep(0.001)
        for copy in copies(fake):
            for compute in copy.wait_for:
                fake.release(compute)
            fake.release_at(copy, 0.25)
        await rt.flush()
        report = rt.build_report()
        assert sorted(report.completed) == [1, 2]
        assert report.landed == (("b", 0.25),)
        assert [f.batch.direction for f in asked if f.batch is not None] == [Direction.LOAD]
        assert len(asked) == 1


async def test_bind_rejects_bad_plans_without_changing_state(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """Duplicate ids raise ConfigError; binding over unlaunched transfers or replaying known ids
    raises ProtocolError; state unchanged."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        with pytest.raises(ConfigError, match="twice"):
            rt.bind(StepPlan(1, stores=(store(1, "a", [1], [1]), store(1, "a", [2], [2]))))
        assert rt.transfer_state(1) is None
        rt.bind(StepPlan(1, stores=(store(1, "a", [1], [1]),)))
        with pytest.raises(ProtocolError, match="unlaunched"):
            rt.bind(StepPlan(2, loads=(load(2, "b", [2], [2]),)))
        assert rt.transfer_state(2) is None
        rt.wait_for_save()
        with pytest.raises(ProtocolError, match="already known"):
            rt.bind(StepPlan(2, loads=(load(1, "b", [2], [2]),)))
        await wait_all_tasks_blocked()
        fake.release_all()
        await wait_all_tasks_blocked()
        assert rt.build_report().completed == (1,)


async def test_every_transition_of_the_table_is_logged(fake: FakeBackend, clock: FakeClock) -> None:
    """A run touching every (state, input) pair of the transfer table logs each one."""
    with capture_logs() as logs:
        async with WorkerRuntime.open(fake, WorkerOptions(clock=clock, coalesce=False)) as rt:
            rt.bind(StepPlan(1, loads=tuple(load(i, f"r{i}", [i], [i]) for i in range(1, 5))))
            rt.start_load_kv()
            rt.bind(
                StepPlan(
                    2, loads=(load(5, "r5", [5], [5]), load(6, "r6", [6], [6])), abandoned=(3, 4)
                )
            )
            await rt.handle_preemptions(StepPlan(3, abandoned=(5,)))
            assert rt.transfer_state(5) is None
            rt.start_load_kv()
            await wait_all_tasks_blocked()
            one, two, three, four, six = copies(fake)
            fake.release(one)
            fake.fail(two)
            fake.release(three)
            fake.fail(four)
            fake.release(six)
            await wait_all_tasks_blocked()
            rt.build_report()
    logged = {(e["from"], e["input"], e["to"]) for e in events(logs, "transfer_transition")}
    table = {(s.value, i.value, t.value) for (s, i), t in TRANSITIONS.items()}
    assert logged == table


async def test_error_in_the_body_abandons_in_flight_work_and_closes(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """An exception inside the runtime's block abandons transfers in flight and closes the backend."""
    with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="engine crashed")):
        async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
            rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
            rt.start_load_kv()
            await wait_all_tasks_blocked()
            raise RuntimeError("engine crashed")
    assert rt.transfer_state(1) is TransferState.ABANDONED
    assert fake.closed


async def test_concurrent_shutdowns_both_wait(fake: FakeBackend, clock: FakeClock) -> None:
    """A second shutdown call waits for the first to finish instead of returning early."""
    done: list[str] = []
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, loads=(load(1, "a", [1], [1]),)))
        rt.start_load_kv()
        await wait_all_tasks_blocked()

        async def stop(name: str) -> None:
            await rt.shutdown()
            done.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop, "first")
            tg.start_soon(stop, "second")
            await wait_all_tasks_blocked()
            assert done == []
            fake.release_all()
        assert sorted(done) == ["first", "second"]


@attrs.define(eq=False)
class TimedFake(FakeBackend):
    """The fake backend, also measuring its copies (``TimesCopies``): each batch says it took
    ``copy_s`` seconds on the device, whatever the clock did."""

    copy_s: float = 0.25
    asked: list[FenceStatus] = attrs.field(factory=list)

    def copy_seconds(self, fence: Fence) -> float | None:
        self.asked.append(self.query(fence))
        return self.copy_s


async def test_copy_stats_take_the_backends_own_copy_time(
    fake: FakeBackend, clock: FakeClock
) -> None:
    """With a backend that times its copies, copy_throughput's seconds are the measured copy
    time (asked once per finished batch), not the longer submit → seen-done time."""
    base = fake
    fake = TimedFake(now=clock.now)
    descs = {
        f"layer{i}": TensorDesc(
            f"layer{i}", (2, 16, 4, 8), (512, 32, 8, 1), 2, 0x10000 * (i + 1), "cuda:0"
        )
        for i in range(2)
    }
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.register_kv_caches(descs, 16)
        rt.allocate_cpu_tier(32)
        for step, tid in ((1, 1), (2, 2)):
            rt.bind(StepPlan(step, stores=(store(tid, "r", [tid, tid + 4], [tid, tid + 4]),)))
            rt.wait_for_save()
            await wait_all_tasks_blocked()
            for f in list(fake.pending):
                if f.kind == "compute":
                    fake.release(f)
            clock.jump(3.0)  # the engine looks only 3 s later
            for f in copies(fake)[-1:]:
                fake.release(f)
            await wait_all_tasks_blocked()
            rt.build_report()
        stats = rt.copy_stats()[Direction.STORE]
        block = fake.layout.groups[0].block_bytes if fake.layout else 0
        assert (stats.bytes, stats.batches, stats.measured_batches) == (4 * block, 2, 2)
        assert stats.measured
        assert stats.copy_s == pytest.approx(0.5)
        assert stats.in_flight_s >= 6.0
        moved, seconds = rt.copy_throughput()[Direction.STORE]
        assert moved == 4 * block
        assert seconds == pytest.approx(0.5)
        assert stats.gbps == pytest.approx(4 * block / 0.5 / 1e9)
        assert fake.asked == [FenceStatus.DONE, FenceStatus.DONE]
    assert not isinstance(base, TimesCopies)


async def test_copy_stats_fall_back_to_time_in_flight(fake: FakeBackend, clock: FakeClock) -> None:
    """A backend that does not time its copies gets the submit → seen-done time, marked as
    not measured."""
    async with WorkerRuntime.open(fake, WorkerOptions(clock=clock)) as rt:
        rt.bind(StepPlan(1, loads=(load(1, "r", [3], [5]),)))
        rt.start_load_kv()
        await wait_all_tasks_blocked()
        clock.jump(2.0)
        fake.release(copies(fake)[0])
        await wait_all_tasks_blocked()
        stats = rt.copy_stats()[Direction.LOAD]
        assert (stats.batches, stats.measured_batches, stats.measured) == (1, 0, False)
        assert stats.seconds == stats.in_flight_s == pytest.approx(2.0)
        assert rt.copy_stats()[Direction.STORE].gbps == 0.0
