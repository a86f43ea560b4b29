"""Fixtures of the backend tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def make_backend() -> Iterator[Any]:
    """Builds CUDA backends and closes every one after the test."""
    from kvflow.backends.cuda import CudaBackend, CudaConfig

    made: list[Any] = []

    def build(**cfg: Any) -> Any:
        cfg.setdefault("slot_bytes", 2 << 20)
        cfg.setdefault("num_slots", 2)
        backend = CudaBackend(0, CudaConfig(**cfg))
        made.append(backend)
        return backend

    yield build
    for b in made:
        b.close()
