"""The fake backend: fences finish only when the test says, copies move block versions, and
hazards (a copy reading before compute, a load overwriting a block being stored) are recorded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.backends.base import Backend, CopyBatch, FenceStatus
from kvflow.backends.fake import GARBAGE, FakeBackend
from kvflow.core.layout import TensorDesc
from kvflow.core.transfer import Direction
from kvflow.errors import BackendError, ClosedError, ConfigError
from kvflow.runtime.clock import FakeClock


def make(clock: FakeClock | None = None, *, auto: bool = False) -> FakeBackend:
    fake = FakeBackend(now=None if clock is None else clock.now, auto_complete=auto)
    desc = TensorDesc("kv", (8, 16), (16, 1), 2, 0x1000, "cuda:0")
    fake.register_kv_caches({"kv": desc}, 8)
    fake.allocate_cpu_tier([8])
    return fake


def batch(direction: Direction, gpu: int, cpu: int) -> CopyBatch:
    return CopyBatch(direction, ((gpu,),), ((cpu,),))


def test_nothing_finishes_until_released() -> None:
    """A submitted copy stays pending, however often queried, until the test releases it."""
    fake = make()
    assert isinstance(fake, Backend)
    fence = fake.submit(batch(Direction.STORE, 1, 1))
    for _ in range(3):
        assert fake.query(fence) is FenceStatus.PENDING
    fake.release(fence)
    assert fake.query(fence) is FenceStatus.DONE
    assert fake.queries == 4


def test_copy_waits_for_its_fences_and_moves_versions() -> None:
    """A released copy runs only once what it waits for is done, then carries the version."""
    fake = make()
    version = fake.write([2])
    compute = fake.compute_fence()
    copy = fake.submit(batch(Direction.STORE, 2, 5), [compute])
    fake.release(copy)
    assert copy.status is FenceStatus.PENDING
    fake.release(compute)
    assert fake.query(copy) is FenceStatus.DONE
    assert fake.cpu_version[(0, 5)] == version
    load = fake.submit(batch(Direction.LOAD, 7, 5))
    fake.release(load)
    assert fake.gpu_version[(0, 7)] == version
    assert fake.violations == []


def test_reading_before_compute_is_a_violation() -> None:
    """A store run before the compute that writes its block reads the stale version."""
    fake = make()
    fake.write([3])
    copy = fake.submit(batch(Direction.STORE, 3, 0))
    fake.release(copy)
    assert fake.cpu_version[(0, 0)] == 0
    assert len(fake.violations) == 1


def test_overwriting_a_block_being_stored_is_a_violation() -> None:
    """A load landing in a GPU block before an earlier store of it finished is recorded."""
    fake = make()
    st_ = fake.submit(batch(Direction.STORE, 3, 0))
    ld = fake.submit(batch(Direction.LOAD, 3, 1))
    fake.release(ld)
    assert "was still reading it" in fake.violations[0]
    fake.release(st_)
    fenced = fake.submit(batch(Direction.LOAD, 4, 1), [fake.submit(batch(Direction.STORE, 4, 2))])
    fake.release_all()
    assert fenced.status is FenceStatus.DONE
    assert len(fake.violations) == 1


def test_failed_load_leaves_garbage() -> None:
    """A failed load's fence is FAILED and its destination blocks hold garbage."""
    fake = make()
    fence = fake.submit(batch(Direction.LOAD, 6, 1))
    fake.fail(fence)
    assert fence.status is FenceStatus.FAILED
    assert fake.gpu_version[(0, 6)] == GARBAGE


def test_out_of_range_blocks_fail_the_copy() -> None:
    """Block ids beyond either tier fail the copy like a device error."""
    fake = make()
    fence = fake.submit(batch(Direction.STORE, 1, 8))
    fake.release(fence)
    assert fence.status is FenceStatus.FAILED


def test_release_at_finishes_on_the_clock_and_wakeup_fires() -> None:
    """release_at finishes a fence at the first query at or after that time; wakeups fire."""
    clock = FakeClock()
    fake = make(clock)
    woken: list[int] = []
    fake.set_wakeup(lambda: woken.append(1))
    fence = fake.submit(batch(Direction.STORE, 1, 1))
    fake.release_at(fence, 2.0)
    clock.jump(1.0)
    assert fake.query(fence) is FenceStatus.PENDING
    clock.jump(1.0)
    assert fake.query(fence) is FenceStatus.DONE
    assert woken == [1]
    with pytest.raises(ConfigError):
        make().release_at(fence, 1.0)


def test_auto_complete_and_lifecycle_errors() -> None:
    """auto_complete finishes everything at once; foreign fences and a closed backend raise."""
    fake = make(auto=True)
    v = fake.write([0])
    compute = fake.compute_fence()
    assert compute.status is FenceStatus.DONE
    copy = fake.submit(batch(Direction.STORE, 0, 0), [compute])
    assert copy.status is FenceStatus.DONE
    assert fake.cpu_version[(0, 0)] == v
    with pytest.raises(BackendError):
        fake.query(object())
    with pytest.raises(BackendError):
        FakeBackend().allocate_cpu_tier([1])
    fake.close()
    with pytest.raises(ClosedError):
        fake.submit(batch(Direction.STORE, 0, 0))


@given(st.permutations(range(6)))
def test_any_release_order_respects_fences(order: list[int]) -> None:
    """Whatever order the test releases fences in, fenced copies never read stale data."""
    fake = make()
    version = fake.write([1, 2])
    compute = fake.compute_fence()
    s1 = fake.submit(batch(Direction.STORE, 1, 1), [compute])
    s2 = fake.submit(batch(Direction.STORE, 2, 2), [compute])
    l1 = fake.submit(batch(Direction.LOAD, 1, 3), [s1])
    l2 = fake.submit(batch(Direction.LOAD, 2, 4), [s2])
    other = fake.submit(batch(Direction.LOAD, 5, 5))
    fences = [compute, s1, s2, l1, l2, other]
    for i in order:
        fake.release(fences[i])
    assert all(f.status is FenceStatus.DONE for f in fences)
    assert fake.violations == []
    assert fake.cpu_version[(0, 1)] == fake.cpu_version[(0, 2)] == version
