"""GPU test of the NIXL PD transport: P and D as two spawned processes on one GPU, their KV
tensors in device memory (VRAM registrations), moved by NIXL/UCX (skipped cleanly without CUDA
or without the ``kvflow[nixl]`` extra). The same scenarios as the host-memory test."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.backends.test_pd_nixl import _pair, assert_moved

from kvflow.backends.pd.nixl import load_nixl
from kvflow.engine.distributed import free_port, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["read", "write"])
def res(request: pytest.FixtureRequest) -> list[Any]:
    """One spawned pair per mode, device memory on both sides."""
    nixl, why = load_nixl()
    if nixl is None:
        pytest.skip(f"NIXL is not importable: {why}")
    return launch(_pair, (free_port(), request.param, "cuda"), world_size=2, timeout_s=180)


def test_nixl_moves_device_blocks_byte_exact_and_names_the_ucx_transport(res: list[Any]) -> None:
    """D's named device blocks hold exactly P's, twice, every other block untouched; both
    fences settle DONE; the stats name the UCX transport chosen for device memory."""
    assert_moved(res)
    initiator = next(r for r in res if r["stats"]["transfers"])
    assert initiator["stats"]["backend"] == "UCX"
    assert initiator["stats"]["ucx"].get("read") or initiator["stats"]["ucx"].get("write")
