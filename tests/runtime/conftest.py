"""Fixtures for runtime tests: a FakeClock and a fake backend with a small registered layout.

Fixtures build plain objects only; each test opens the runtime (and its task group) itself.
"""

from __future__ import annotations

import pytest

from kvflow.backends.fake import FakeBackend
from kvflow.core.layout import TensorDesc
from kvflow.runtime.clock import FakeClock

GPU_BLOCKS = 16
CPU_BLOCKS = 32


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fake(clock: FakeClock) -> FakeBackend:
    backend = FakeBackend(now=clock.now)
    descs = {
        f"layer{i}": TensorDesc(
            name=f"layer{i}",
            shape=(2, GPU_BLOCKS, 4, 8),
            strides=(GPU_BLOCKS * 32, 32, 8, 1),
            itemsize=2,
            data_ptr=0x10000 * (i + 1),
            device="cuda:0",
        )
        for i in range(2)
    }
    backend.register_kv_caches(descs, GPU_BLOCKS)
    backend.allocate_cpu_tier([CPU_BLOCKS])
    return backend
