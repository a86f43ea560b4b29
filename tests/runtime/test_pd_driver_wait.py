"""``PDDriver.wait`` with copies in flight on a transport whose fences never call back (CUDA
IPC's, NIXL's): it returns once a fence settled, found by looking at the fences, not at the end
of its whole timeout; on a transport that pushes completions (gloo), or with no copy in flight,
it waits on the wake-up alone. An idle PD engine's wait (``idle_wait``) watches the router's
pipe and, while a hand-off is live, the driver."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvflow.backends.base import FenceStatus
from kvflow.core.pd.common import BlockPairs, LaunchCopies
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.pd.worker import WAKE_SLICE_S, idle_wait
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
    assert driver.wait(1000 * FENCE_POLL_S) is True
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
    assert driver.wait(1.0) is False
    assert transport.queries == 0


class _Driver:
    """``idle_wait``'s view of a driver: busy or not, and a wait that reports a wake-up at its
    ``wake_at``-th call (never, at 0), recording each call's timeout."""

    def __init__(self, busy: bool, wake_at: int = 0) -> None:
        self._busy = busy
        self.wake_at = wake_at
        self.timeouts: list[float] = []

    def busy(self) -> bool:
        return self._busy

    def wait(self, timeout_s: float) -> bool:
        self.timeouts.append(timeout_s)
        return len(self.timeouts) == self.wake_at


def test_an_idle_engine_with_a_live_hand_off_wakes_on_the_driver() -> None:
    """While a hand-off is live an idle engine waits on the driver in slices of WAKE_SLICE_S and
    returns at its first wake-up (a CLAIM for P's KV is answered when it comes), well before the
    whole wait's end."""
    conn, _other = mp.Pipe()
    driver = _Driver(busy=True, wake_at=3)
    idle_wait(conn, driver, 3600.0)  # type: ignore[arg-type]
    assert len(driver.timeouts) == 3
    assert max(driver.timeouts) <= WAKE_SLICE_S


def test_an_idle_engine_with_a_request_waiting_does_not_wait() -> None:
    """A request already in the router's pipe: no wait on the driver at all, busy or not."""
    conn, other = mp.Pipe()
    other.send(("add",))
    for busy in (True, False):
        driver = _Driver(busy=busy)
        idle_wait(conn, driver, 3600.0)  # type: ignore[arg-type]
        assert driver.timeouts == []


def test_an_idle_engine_without_hand_offs_waits_on_the_pipe_alone() -> None:
    """No live hand-off: the driver is not waited on (the pipe's poll is the whole wait)."""
    conn, _other = mp.Pipe()
    driver = _Driver(busy=False)
    idle_wait(conn, driver, 0.0)  # type: ignore[arg-type]
    assert driver.timeouts == []


def test_an_idle_pd_engine_acts_on_what_woke_its_wait_before_the_next_step(
    polled: tuple[PDDriver, _Polled], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PDConnector.wait_for_progress`` (an engine with nothing to compute): the copy whose
    settling ended the wait is taken off the driver within the same call, not at the engine's
    next step."""
    from kvflow.connector.pd import PDConnector
    from kvflow.engine.engine import EngineConfig, make_kv_cache_config
    from kvflow.engine.model import model_config

    driver, _transport = polled
    kv = make_kv_cache_config(model_config("tiny"), EngineConfig(block_size=16))
    connector = PDConnector("consumer", kv, driver)
    settled: list[str] = []  # the copy has no hand-off behind it: record what the manager hears

    def copy_done(transfer_id: str, *_args: Any) -> list[Any]:
        settled.append(transfer_id)
        return []

    monkeypatch.setattr(driver.manager, "copy_done", copy_done)
    driver.apply([LaunchCopies("t", 1, "P", False, (BlockPairs((0,), (1,)),), 1)])
    assert driver.busy()
    connector.wait_for_progress(1000 * FENCE_POLL_S)
    assert settled == ["t"]
    assert not driver.busy()
