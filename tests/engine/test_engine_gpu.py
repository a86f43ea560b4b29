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


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_cuda_engine_matches_dense_reference(name: str, ahead: bool) -> None:
    """float32 on CUDA: chunked prefill, prefix hits and preemption give the dense tokens, with
    steps scheduled ahead of the one in flight too (pending tokens taken on the device)."""
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
            async_scheduling=ahead,
        ),
        model=model,
    )
    ps = prompts([40, 70, 33, 90], seed=11)
    results = engine.run_to_completion(requests(ps, 8))
    for p, r in zip(ps, results, strict=True):
        assert r.output_token_ids == dense_greedy(model, p, 8)
    assert engine.stats.preemptions > 0
    graphs = engine.runner._graphs
    assert graphs is not None
    assert graphs.captured
    assert graphs.steps_run > 0
    assert (engine.stats.steps_ahead > 0) == ahead


def test_decode_graphs_and_triton_attention_match_the_eager_torch_path() -> None:
    """llama-1b fp32, padded buckets: full and piecewise graphs, their pieces, Triton and torch
    attention, with steps scheduled ahead or not, agree on tokens and KV."""
    cfg = model_config("llama-1b")
    model = build_model(cfg, device="cuda", dtype=torch.float32)
    ps = prompts([300, 77, 1000], seed=5, vocab=cfg.vocab_size)
    outputs, caches = [], []
    # (decode_graphs, triton_decode, async_scheduling); the first is the engine without any.
    modes = (
        ("off", False, False),
        ("off", True, False),
        ("pieces", True, False),
        ("piecewise", True, False),
        ("piecewise", False, False),
        ("full", True, False),
        ("auto", True, False),
        ("off", True, True),
        ("piecewise", True, True),
        ("full", True, True),
    )
    for graphs_mode, triton, ahead in modes:
        engine = Engine(
            cfg,
            EngineConfig(
                block_size=16,
                num_gpu_blocks=256,
                max_num_batched_tokens=2048,
                max_num_seqs=8,
                device="cuda",
                dtype="float32",
                decode_graphs=graphs_mode,
                triton_decode=triton,
                async_scheduling=ahead,
            ),
            model=model,
        )
        graphs = engine.runner._graphs
        assert (graphs is None) == (graphs_mode == "off")
        assert engine.runner._paged_decode == triton
        # Unequal lengths: rows finish at different steps, so the bucket shrinks mid-run.
        outputs.append(
            [r.output_token_ids for r in engine.run_to_completion(requests(ps, 24))]
            + [r.output_token_ids for r in engine.run_to_completion(requests(ps[:1], 5))]
        )
        if graphs is not None:
            assert graphs.captured == (graphs_mode != "pieces")
            assert graphs.full == (graphs_mode in ("full", "auto"))
            assert graphs.steps_run > 0
        assert (engine.stats.steps_ahead > 0) == ahead
        caches.append({n: t[:, 1:].clone() for n, t in engine.kv_caches.items()})
        engine.shutdown()
    assert all(o == outputs[0] for o in outputs[1:])
    for other in caches[1:]:
        for name, tensor in caches[0].items():
            torch.testing.assert_close(other[name], tensor, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("queries", "keys"), [(272, 4608), (64, 64), (17, 1041)])
def test_a_half_precision_chunk_takes_flash_directly_and_agrees_with_sdpa(
    dtype: torch.dtype, queries: int, keys: int
) -> None:
    """A chunk of 32 query heads over 8 KV heads, causal to its last key: the direct flash call
    (grouped heads as they are) gives what SDPA gives with the heads expanded and a lower-right
    causal bias, on the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from kvflow.engine import kv_cache

    gen = torch.Generator(device="cuda").manual_seed(queries)
    q = torch.randn(1, queries, 32, 64, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    both = torch.randn(2, 1, keys, 8, 64, device="cuda", dtype=dtype, generator=gen)
    k, v = both.permute(0, 1, 3, 2, 4)  # strided as the gather from the paged cache leaves them
    assert kv_cache._flash_fits(q, k)
    got = kv_cache._prefill_attention(q, k, v, None)
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float(),
            k.float().repeat_interleave(4, dim=1),
            v.float().repeat_interleave(4, dim=1),
            attn_mask=causal_lower_right(queries, keys),
        )
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_chunks_in_one_flash_call_agree_with_one_call_each(dtype: torch.dtype) -> None:
    """Three prefill chunks (one after cached keys) and two decode rows between them: the
    chunks as one varlen flash call give what one flash call per chunk gives."""
    from kvflow.engine import kv_cache

    gen = torch.Generator(device="cuda").manual_seed(7)
    bs, blocks = 16, 64
    cache = torch.randn(2, blocks, bs, 8, 64, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(blocks - 1).add(1).tolist()
    computed, scheduled = [0, 40, 130, 0, 7], [96, 1, 300, 1, 33]
    tables = [
        [perm.pop() for _ in range(-(-(c + n) // bs))]
        for c, n in zip(computed, scheduled, strict=True)
    ]
    dev = torch.device("cuda")
    q = torch.randn(sum(scheduled), 32, 64, device="cuda", dtype=dtype, generator=gen)
    one = kv_cache.build_attention_metadata(tables, computed, scheduled, bs, None, dev)
    batch = kv_cache.build_attention_metadata(
        tables, computed, scheduled, bs, None, dev, varlen=True
    )
    assert one.varlen is None
    assert batch.varlen is not None
    assert isinstance(batch.varlen.queries, torch.Tensor)  # the decode rows split the chunks
    torch.testing.assert_close(
        kv_cache.paged_attention(q, cache, batch).float(),
        kv_cache.paged_attention(q, cache, one).float(),
        atol=2e-2,
        rtol=2e-2,
    )
