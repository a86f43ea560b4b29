"""A PD engine process runs its threads as ``kvflow bench``'s own process does: the engine's
GIL switch interval and the spec's torch threads, set before its engine is built."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from kvflow.engine.engine import SWITCH_INTERVAL_S
from kvflow.pd.worker import WorkerSpec, setup_process


@pytest.fixture
def restored() -> Iterator[None]:
    interval, threads = sys.getswitchinterval(), torch.get_num_threads()
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("restored")
def test_a_pd_engine_process_takes_the_bench_process_switch_interval_and_its_threads() -> None:
    """``setup_process`` sets the switch interval ``kvflow bench`` sets for the colocated
    engine (not the interpreter's 5 ms default) and the spec's torch thread count."""
    sys.setswitchinterval(0.005)
    spec = WorkerSpec("producer", "P", "D", "tiny", {}, 0, torch_threads=1)
    setup_process(spec)
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    assert SWITCH_INTERVAL_S < 0.005
    assert torch.get_num_threads() == 1
