"""GPU tests of stores issued as 2D copies straight from the KV cache (``CudaConfig.store_dma``):
run on the device, skipped cleanly without CUDA."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tests.backends.cuda_gpu_helpers import KiB, block_bytes, load, make_kv, store

from kvflow.backends.base import FenceStatus
from kvflow.backends.cuda.plan import PITCHED_MIN_ROWS

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def counting_2d_copies(backend: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the backend's 2D copy calls (the copies each call issues) from now on."""
    calls: list[int] = []
    real = backend._memcpy2d

    def counted(copies: Any, stream: Any, lo: int = 0, hi: int = -1) -> None:
        calls.append((len(copies) if hi < 0 else hi) - lo)
        real(copies, stream, lo, hi)

    monkeypatch.setattr(backend, "_memcpy2d", counted)
    return calls


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("runs", [True, False])
@pytest.mark.parametrize("chunk", [4 * KiB, 16 * KiB])
@pytest.mark.parametrize("style", ["flash", "mla", "cross"])
def test_a_store_in_runs_goes_as_2d_copies_and_round_trips(
    make_backend: Any,
    monkeypatch: pytest.MonkeyPatch,
    style: str,
    chunk: int,
    runs: bool,
    batched: bool,
) -> None:
    """With ``store_dma`` a store whose blocks come in runs on both sides (crossing pinned
    chunks of eight blocks) is issued as 2D copies, in one ``cuMemcpy3DBatchAsync`` or one
    ``cuMemcpy2DAsync`` each, scattered blocks take the usual path; either way every CPU block
    holds its GPU block's pages in block-major order, and a load brings them back byte-exact."""
    n = 48
    kv = make_kv(style, torch.bfloat16, chunk, n)
    per_block = block_bytes(kv, style, 0).numel()
    backend = make_backend(
        store_dma=True,
        store_dma_min_run=PITCHED_MIN_ROWS,  # these runs are short: 5 blocks once cut
        register_chunk_bytes=8 * per_block,
        pitched_batch=batched,
    )
    # A CUDA 12.8+ driver resolves the batched call; without it the backend copies one by one.
    assert (backend._memcpy2d.batch is not None) == batched, backend.batch_3d_error
    backend.register_kv_caches(kv, n)
    backend.allocate_cpu_tier([40])
    assert backend.cpu_tier.chunk_blocks(0) == 8
    calls = counting_2d_copies(backend, monkeypatch)
    rng = np.random.default_rng(chunk)
    if runs:  # two requests' blocks, as a prefill step stores them: 5 runs once cut at chunks
        src, cpu = [*range(2, 14), *range(20, 32)], list(range(5, 29))
    else:
        src, cpu = rng.permutation(n)[:20].tolist(), rng.permutation(40)[:20].tolist()
    want = [block_bytes(kv, style, b) for b in src]
    fence = backend.submit(store(src, cpu), [backend.compute_fence()])
    backend.flush()
    assert backend.query(fence) is FenceStatus.DONE
    assert bool(calls) == runs
    for c, w in zip(cpu, want, strict=True):
        assert np.array_equal(backend.cpu_block(0, c), w.numpy())
    for t in kv.values():  # poison the GPU tier, never zeros
        t.view(torch.uint8).random_(0, 256)
    dst = rng.permutation(n)[: len(src)].tolist()
    fence = backend.submit(load(cpu, dst))
    backend.flush()
    assert backend.query(fence) is FenceStatus.DONE
    for d, w in zip(dst, want, strict=True):
        assert torch.equal(block_bytes(kv, style, d), w)


def test_a_store_as_2d_copies_waits_for_the_compute_before_it(
    make_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2D-copy store fenced after compute that is still writing its blocks copies what the
    compute wrote, not what was there before."""
    n = 32
    kv = make_kv("flash", torch.bfloat16, 16 * KiB, n)
    backend = make_backend(store_dma=True, store_dma_min_run=PITCHED_MIN_ROWS)
    backend.register_kv_caches(kv, n)
    backend.allocate_cpu_tier([32])
    calls = counting_2d_copies(backend, monkeypatch)
    src = list(range(4, 20))
    torch.cuda._sleep(200_000_000)  # the compute stream is busy ...
    for t in kv.values():  # ... then writes the blocks the store reads
        t[:, 4:20].fill_(3.0)
    fence = backend.submit(store(src, src), [backend.compute_fence()])
    backend.flush()
    assert backend.query(fence) is FenceStatus.DONE
    assert calls
    for b in src:
        assert np.array_equal(backend.cpu_block(0, b), block_bytes(kv, "flash", b).numpy())
        assert (backend.cpu_block(0, b).view(np.uint16) == 0x4040).all()  # bf16 3.0
