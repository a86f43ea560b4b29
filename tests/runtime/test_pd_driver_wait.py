"""``PDDriver.wait`` with copies in flight on a transport whose fences never call back (CUDA
IPC's, NIXL's): it returns once a fence settled, found by looking at the fences, not at the end
of its whole timeout; on a transport that pushes completions (gloo), or with no copy in flight,
it waits on the wake-up alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvflow.backends.base import FenceStatus
from kvflow.core.pd.common import BlockPairs, LaunchCopies
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.runtime.pd_control import default_compat
from kvflow.runtime.pd_driver import FENCE_POLL_S, PDDriver


class _Fence:
    def __init__(self, settle_after: int) -> None:
        self.left = settle_after


class _Polled:
    """A transport whose fence settles at its ``settle_after``-th query; no wake-up ever
    (unless it says it pushes completions, like gloo's)."""

    name = "polled"

    def __init__(self, settle_after: int, *, pushes: bool = False) -> None:
        self.pushes_completions = pushes
        self.settle_after = settle_after
        self.queries = 0

    def register(self, groups: Sequence[Sequence[Any]]) -> None:
        del groups

    def launch(self, op: LaunchCopies) -> _Fence:
        del op
        return _Fence(self.settle_after)

    def query(self, fence: Any) -> FenceStatus:
        self.queries += 1
        fence.left -= 1
        return FenceStatus.DONE if fence.left <= 0 else FenceStatus.PENDING

    def cancel(self, fence: Any) -> None:
        del fence

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        del wakeup

    def close(self) -> None:
        pass


@pytest.fixture
def polled() -> Iterator[tuple[PDDriver, _Polled]]:
    transport = _Polled(settle_after=3)
    driver = PDDriver(ConsumerManager("D"), default_compat(), transport)
    try:
        yield driver, transport
    finally:
        driver.close()


def test_wait_returns_when_a_polled_fence_settles(polled: tuple[PDDriver, _Polled]) -> None:
    """A copy in flight whose fence settles at its third look: a wait of 1,000 slices returns
    after three looks, one a slice, without a wake-up."""
    driver, transport = polled
    driver.apply([LaunchCopies("t", 1, "P", False, (BlockPairs((0,), (1,)),), 1)])
    driver.wait(1000 * FENCE_POLL_S)
    assert transport.queries == 3


def test_a_transport_that_pushes_completions_is_not_polled() -> None:
    """gloo's fences wake the driver: its wait blocks on the wake-up alone, with no look at a
    fence."""
    transport = _Polled(settle_after=1, pushes=True)
    driver = PDDriver(ConsumerManager("D"), default_compat(), transport)
    try:
        driver.apply([LaunchCopies("t", 1, "P", False, (BlockPairs((0,), (1,)),), 1)])
        driver.wait(FENCE_POLL_S)
        assert transport.queries == 0
    finally:
        driver.close()


def test_wait_without_copies_looks_at_no_fence(polled: tuple[PDDriver, _Polled]) -> None:
    """No hand-off and no copy: the wait returns at once and queries nothing."""
    driver, transport = polled
    driver.wait(1.0)
    assert transport.queries == 0
