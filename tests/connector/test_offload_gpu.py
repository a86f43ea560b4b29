"""The reference engine with offload on a CUDA device: the CUDA backend end to end."""

from __future__ import annotations

import threading
from typing import Any

import attrs
import pytest
import torch

from kvflow.connector.api import KVCacheConfig
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.core.gpu_view import GpuCacheView
from kvflow.engine.engine import Engine, EngineConfig
from kvflow.engine.model import build_model, model_config
from kvflow.engine.workload import MultiRoundQA, run_multi_round

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("fence", ["never", "always"])
@pytest.mark.parametrize("loop", ["thread", "inline", "inline-ahead"])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_cuda_offload_outputs_identical_across_reloads(
    name: str, policy: str, loop: str, fence: str
) -> None:
    """On the GPU with the CUDA backend, offload changes no token and really reloads blocks,
    with the worker runtime's loop on its own thread or inline on the engine's (no launch or
    completion thread then: copies are launched and polled from the engine's calls), each load
    waited for by its request in the scheduler or fenced (the forward that reads it waits for
    its copies on the device), and with the engine's steps scheduled ahead of the one in
    flight."""
    ahead = loop.endswith("-ahead")
    loop = loop.split("-")[0]
    cfg = model_config(name)
    model = build_model(cfg, device="cuda", dtype=torch.float32)
    econf = EngineConfig(
        block_size=16,
        num_gpu_blocks=30 if "-swa" not in name else 36,
        max_num_batched_tokens=256,
        device="cuda",
        dtype="float32",
    )
    work = MultiRoundQA(
        num_users=4,
        num_rounds=3,
        system_prompt_len=64,
        first_question_len=48,
        question_len=16,
        answer_len=8,
        vocab_size=1024,
    )
    off = Engine(cfg, econf, model=model)
    want = run_multi_round(off, work).outputs()
    off.shutdown()
    built: list[OffloadConnector] = []

    def factory(kv: KVCacheConfig, view: GpuCacheView) -> tuple[Any, Any]:
        per_layer = 2 * kv.block_size * cfg.num_kv_heads * cfg.head_dim * 4
        conn = OffloadConnector.build(
            OffloadConfig(
                cpu_bytes="256MiB",
                store_policy=policy,
                lazy_watermark=16,
                worker_loop=loop,
                fence_loads=fence,
            ),
            kv,
            [per_layer * len(g.layer_names) for g in kv.groups],
            gpu_view=view,
        )
        built.append(conn)
        return conn.scheduler, conn.worker

    on = Engine(
        cfg, attrs.evolve(econf, async_scheduling=ahead), model=model, connector_factory=factory
    )
    try:
        got = run_multi_round(on, work)
        (conn,) = built
        assert conn.worker.backend.name == "cuda"
        names = {t.name for t in threading.enumerate()}
        kvflow_threads = {n for n in names if n.startswith(("kvflow-cuda", "asyncio-portal"))}
        if loop == "inline":
            assert not kvflow_threads
        else:
            assert "kvflow-cuda-launch" in kvflow_threads
        assert got.outputs() == want
        assert (on.stats.steps_ahead > 0) == ahead
        stats = conn.scheduler.stats().manager
        assert stats.blocks_stored > 0
        assert stats.blocks_loaded > 0
        assert stats.failed_transfers == 0
        loaded = [r.result for r in got.records if r.result.external_loaded_tokens > 0]
        assert loaded
        if fence == "always":  # no load phase: the copies ran inside the first step
            assert all(r.timeline is not None and r.timeline.load_copy == 0 for r in loaded)
    finally:
        on.shutdown()
    assert conn.scheduler.manager.num_live_transfers() == 0


def test_wait_cpu_tier_returns_with_the_whole_tier_pinned() -> None:
    """``OffloadWorker.wait_cpu_tier`` returns only once every byte of the CUDA tier is pinned."""
    from kvflow.backends.cuda import CudaBackend
    from kvflow.engine.engine import block_bytes_per_group, make_kv_cache_config
    from kvflow.engine.kv_cache import allocate_kv_caches

    cfg = model_config("tiny")
    econf = EngineConfig(block_size=16, num_gpu_blocks=16, device="cuda", dtype="float32")
    kv = make_kv_cache_config(cfg, econf)
    conn = OffloadConnector.build(
        OffloadConfig(cpu_bytes="512MiB", backend="cuda"),
        kv,
        block_bytes_per_group(cfg, kv, torch.float32),
    )
    worker = conn.worker
    try:
        caches = allocate_kv_caches(
            kv, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float32, device=torch.device("cuda")
        )
        worker.register_kv_caches(caches)
        backend = worker.backend
        assert isinstance(backend, CudaBackend)
        worker.wait_cpu_tier()
        assert backend.cpu_tier.registered_bytes == backend.cpu_tier.nbytes > 0
    finally:
        worker.shutdown()
