"""The worker-role KVFlowConnector over kvflow's real runtime and host backend, with CPU tensors in
vLLM's KV cache layout: a store → evict → load round trip restores the blocks byte for byte."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("kvflow.runtime.portal")
pytest.importorskip("kvflow.backends.host")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvflow.core.protocol import StepPlan, TransferSpec
from kvflow.core.transfer import Direction
from kvflow.integrations.vllm import KVFlowConnector, KVFlowConnectorMetadata
from tests.integrations.vllm_harness import (
    HEAD_SIZE,
    KVFLOW_MODULE,
    LAYERS,
    NUM_KV_HEADS,
    make_kv_cache_config,
    make_vllm_config,
)

BS = 16
NUM_BLOCKS = 12


def run_step(worker: KVFlowConnector, plan: StepPlan) -> tuple[int, ...]:
    """One model-runner step for ``plan``, drained; returns the transfer ids reported complete."""
    meta = KVFlowConnectorMetadata(plan)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    # A flush waits for every copy already handed over: the step's copies are done after it.
    worker.handle_preemptions(KVFlowConnectorMetadata(StepPlan(plan.step, flush=True)))
    worker.get_finished(set())
    assert worker.get_block_ids_with_load_errors() == set()
    out = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return () if out is None else tuple(t for r in out.reports for t in r.completed)


def test_store_evict_load_round_trip_is_byte_exact_in_vllms_layout() -> None:
    """Blocks 3 and 5 stored to the CPU tier, overwritten on the GPU side, then loaded into blocks
    7 and 9 come back identical in every layer, K and V; no other block changes."""
    config = make_vllm_config(
        connector="KVFlowConnector",
        module_path=KVFLOW_MODULE,
        extra_config={"cpu_bytes_to_use": 1 << 20, "backend": "host"},
    )
    worker = KVFlowConnector(config, KVConnectorRole.WORKER, make_kv_cache_config(NUM_BLOCKS, BS))
    gen = torch.Generator().manual_seed(0)
    # vLLM's attention layout: (K/V, num_blocks, block_size, num_kv_heads, head_size) per layer.
    caches = {
        name: torch.randn(2, NUM_BLOCKS, BS, NUM_KV_HEADS, HEAD_SIZE, generator=gen).half()
        for name in LAYERS
    }
    original = {name: t.clone() for name, t in caches.items()}
    try:
        worker.register_kv_caches(caches)
        store = TransferSpec(1, "r", Direction.STORE, ((3, 5),), ((0, 1),))
        assert run_step(worker, StepPlan(0, stores=(store,))) == (1,)
        for t in caches.values():
            t[:, [3, 5]] = torch.randn(2, 2, BS, NUM_KV_HEADS, HEAD_SIZE, generator=gen).half()
        load = TransferSpec(2, "r", Direction.LOAD, ((7, 9),), ((0, 1),))
        assert run_step(worker, StepPlan(1, loads=(load,))) == (2,)
    finally:
        worker.shutdown()
    for name, t in caches.items():
        assert torch.equal(t[:, 7], original[name][:, 3])
        assert torch.equal(t[:, 9], original[name][:, 5])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 5, 7, 9)]
        assert torch.equal(t[:, untouched], original[name][:, untouched])
