"""The worker-role KVFlowConnector over kvflow's real runtime and host backend, with CPU tensors in
vLLM's KV cache layout: a store → evict → load round trip restores the blocks byte for byte."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("kvflow.runtime.threaded")
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


@pytest.mark.parametrize("worker_loop", ["thread", "inline"])
def test_store_evict_load_round_trip_is_byte_exact_in_vllms_layout(worker_loop: str) -> None:
    """Blocks 3 and 5 stored to the CPU tier, overwritten on the GPU side, then loaded into blocks
    7 and 9 come back identical in every layer, K and V; no other block changes; the worker's
    stats carry the bytes it copied. With either ``worker_loop``."""
    config = make_vllm_config(
        connector="KVFlowConnector",
        module_path=KVFLOW_MODULE,
        extra_config={"cpu_bytes_to_use": 1 << 20, "backend": "host", "worker_loop": worker_loop},
    )
    worker = KVFlowConnector(config, KVConnectorRole.WORKER, make_kv_cache_config(NUM_BLOCKS, BS))
    assert worker.worker.config.worker_loop == worker_loop  # type: ignore[attr-defined]
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
        stats = worker.get_kv_connector_stats()  # this rank's copies, for vLLM's aggregator
        assert stats is not None
        assert stats.counters["copy_bytes_store"] == 2 * 2 * BS * NUM_KV_HEADS * HEAD_SIZE * 2 * 2
        assert stats.counters["copy_seconds_store"] > 0
        assert worker.get_kv_connector_stats() is None, "nothing copied since"
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


def kv_value(token: int, pos: int, layer: int, kv: int) -> float:
    """What the stand-in model writes for one token: exact in fp16, distinct per slot."""
    return float((token * 7 + pos * 3 + layer * 11 + kv * 5) % 2000)


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_end_to_end_repeated_prompt_gets_its_exact_kv_back_from_the_cpu_tier(
    dcp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's scheduler, kvflow's manager, runtime and host backend, CPU tensors in vLLM's layout,
    with ``dcp`` decode-context-parallel ranks (each vLLM block spans 16 × dcp tokens, each rank
    holds every dcp-th token): a prompt's KV is stored by every rank, the GPU caches are wiped,
    and the repeated prompt's loaded blocks hold exactly the KV the first run computed."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvflow.integrations.vllm import connector as connector_module
    from tests.integrations.vllm_fakes import worker_connector
    from tests.integrations.vllm_harness import VLLMHarness

    num_blocks = 32
    span = BS * dcp  # tokens per vLLM block
    h = VLLMHarness.build(
        num_blocks=num_blocks,
        connector="KVFlowConnector",
        module_path=KVFLOW_MODULE,
        extra_config={"cpu_bytes_to_use": dcp << 20, "backend": "host"},
        dcp=dcp,
    )
    ranks = iter(range(dcp))
    monkeypatch.setattr(connector_module, "_world_rank", lambda: next(ranks))
    workers = [worker_connector(h.connector) for _ in range(dcp)]
    caches = [
        {
            name: torch.zeros(2, num_blocks, BS, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.float16)
            for name in LAYERS
        }
        for _ in range(dcp)
    ]
    for worker, rank_caches in zip(workers, caches, strict=True):
        worker.register_kv_caches(rank_caches)
    manager = h.connector._scheduler.manager

    def slot(pos: int, table: list[int]) -> tuple[int, int, int]:
        """(rank, block, offset) of a token under DCP's token-level interleave."""
        return pos % dcp, table[pos // span], (pos // dcp) % BS

    def forward(so: object) -> None:
        """The model: each rank writes the KV of the scheduled tokens it holds."""
        for rid, n in so.num_scheduled_tokens.items():  # type: ignore[attr-defined]
            request = h.scheduler.requests[rid]
            table = h.block_ids(request)[0]
            for pos in range(request.num_computed_tokens - n, request.num_computed_tokens):
                rank, block, offset = slot(pos, table)
                token = request.all_token_ids[pos]
                for layer, name in enumerate(LAYERS):
                    for kv in (0, 1):
                        caches[rank][name][kv, block, offset] = kv_value(token, pos, layer, kv)

    def step() -> object:
        """One engine step, each rank's worker in the model runner's order with its copies
        drained before it reports; the ranks' outputs merged as vLLM's aggregator does."""
        so = h.schedule()
        meta = so.kv_connector_metadata
        metas = []
        invalid: set[int] = set()
        for worker in workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
        forward(so)
        for worker in workers:
            worker.wait_for_save()
            worker.handle_preemptions(
                KVFlowConnectorMetadata(StepPlan(meta.plan.step if meta.plan else 0, flush=True))
            )
            worker.get_transfer_results(so.finished_req_ids)
            invalid |= worker.get_block_ids_with_load_errors()
            metas.append(worker.build_connector_worker_meta())
            worker.clear_connector_metadata()
        merged = None
        for m in metas:
            if m is not None:
                merged = m if merged is None else merged.aggregate(m)
        output = KVConnectorOutput(invalid_block_ids=invalid, kv_connector_worker_meta=merged)
        h.finish(so, None if output.is_empty() else output)
        return so

    prompt = [(i * 37) % 30000 + 10 for i in range(4 * span + 6)]  # 4 full blocks + 6 tokens
    try:
        h.add(prompt, max_tokens=1)
        for _ in range(20):
            step()
            if not h.scheduler.requests and manager.num_live_transfers() == 0:
                break
        assert manager.num_live_transfers() == 0
        assert manager.stats().blocks_stored == 4
        assert h.scheduler.kv_cache_manager.reset_prefix_cache()
        for rank_caches in caches:
            for t in rank_caches.values():
                t.fill_(-1.0)  # the GPU cache was reused for something else
        again = h.add(prompt, max_tokens=3)
        for _ in range(5):
            so = step()
            if again.request_id in so.num_scheduled_tokens:  # type: ignore[attr-defined]
                break
        assert so.num_scheduled_tokens == {again.request_id: 6}  # type: ignore[attr-defined]
        table = h.block_ids(again)[0]
        for pos in range(4 * span):
            rank, block, offset = slot(pos, table)
            for layer, name in enumerate(LAYERS):
                for kv in (0, 1):
                    got = caches[rank][name][kv, block, offset]
                    want = kv_value(prompt[pos], pos, layer, kv)
                    assert torch.all(got == want), (pos, layer, kv)
    finally:
        for worker in workers:
            worker.shutdown()
