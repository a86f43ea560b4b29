"""Backend selection: which backend ``make_backend`` builds, and with which CUDA settings, on
any machine (the CUDA backend's class is stood in for where there is no GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import kvflow.backends.cuda as cuda_pkg
from kvflow.backends import select
from kvflow.backends.cuda import CudaConfig


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, CudaConfig]]:
    """``make_backend``'s CUDA backends, as (device index, config), with CUDA faked present."""
    made: list[tuple[int, CudaConfig]] = []
    monkeypatch.setattr(select, "probe_cuda", lambda: SimpleNamespace(available=True))

    def backend(index: int, config: CudaConfig) -> Any:
        made.append((index, config))
        return object()

    monkeypatch.setattr(cuda_pkg, "CudaBackend", backend)
    return made


@pytest.mark.parametrize("inline", [True, False])
def test_a_cuda_backend_takes_its_threads_from_the_loop_and_the_options_given(
    built: list[tuple[int, CudaConfig]], inline: bool
) -> None:
    """The inline loop gets a CUDA backend without launch or completion threads, a threaded
    loop one with both; ``cuda_options`` set other fields and the device's index is kept."""
    select.make_backend("cuda", "cuda:1", inline=inline, cuda_options={"store_dma": True})
    select.make_backend("auto", "cuda", inline=inline)
    (index, cfg), (index0, plain) = built
    assert (index, index0) == (1, 0)
    assert cfg.launch_thread is cfg.completion_threads is (not inline)
    assert cfg.store_dma
    assert plain == CudaConfig(launch_thread=not inline, completion_threads=not inline)
