"""The engine on a CUDA device: paged attention there agrees with the dense reference."""

from __future__ import annotations

import pytest
import torch

from kvflow.engine.engine import Engine, EngineConfig
from kvflow.engine.model import build_model, model_config
from tests.engine.helpers import dense_greedy, prompts, requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_cuda_engine_matches_dense_reference(name: str) -> None:
    """float32 on CUDA: chunked prefill, prefix hits and preemption give the dense tokens."""
    cfg = model_config(name)
    model = build_model(cfg, device="cuda", dtype=torch.float32)
    engine = Engine(
        cfg,
        EngineConfig(
            block_size=16,
            num_gpu_blocks=12 if name == "tiny" else 24,  # two groups share the pool
            max_num_batched_tokens=48,
            device="cuda",
            dtype="float32",
        ),
        model=model,
    )
    ps = prompts([40, 70, 33, 90], seed=11)
    results = engine.run_to_completion(requests(ps, 8))
    for p, r in zip(ps, results, strict=True):
        assert r.output_token_ids == dense_greedy(model, p, 8)
    assert engine.stats.preemptions > 0


def test_llama_1b_bf16_serves_a_batch() -> None:
    """The ~1B config runs in bf16 on the GPU, with prefix hits on a shared prompt."""
    cfg = model_config("llama-1b")
    engine = Engine(
        cfg,
        EngineConfig(
            block_size=16, num_gpu_blocks=2048, max_num_batched_tokens=4096, device="cuda"
        ),
    )
    assert 0.9e9 < cfg.num_params < 1.6e9
    (shared,) = prompts([1024], seed=3, vocab=cfg.vocab_size)
    tails = prompts([64, 64, 64, 64], seed=4, vocab=cfg.vocab_size)
    first = engine.run_to_completion(requests([shared + tails[0]], 16))
    rest = engine.run_to_completion(requests([shared + t for t in tails[1:]], 16))
    assert all(len(r.output_token_ids) == 16 for r in [*first, *rest])
    assert all(r.gpu_cached_tokens == 1024 for r in rest)
    assert engine.kv_caches["model.layers.0.self_attn"].dtype == torch.bfloat16
