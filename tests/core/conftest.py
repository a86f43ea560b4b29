"""Fixtures of the core tests: ``make_sim`` builds offload-manager simulations and, after the test,
drains each one and checks that no block reference leaked on the CPU or GPU pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.core.scheduler_harness import Sim

MakeSim = Callable[..., Sim]


@pytest.fixture
def make_sim() -> Iterator[MakeSim]:
    sims: list[Sim] = []

    def make(*args: Any, **kwargs: Any) -> Sim:
        sim = Sim(*args, **kwargs)
        sims.append(sim)
        return sim

    yield make
    for sim in sims:
        sim.drain()
