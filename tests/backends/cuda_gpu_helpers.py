"""Helpers of the CUDA backend's GPU tests: KV tensors of each layout style, a backend with
them registered, batches, and a compute-stream sleep (the ``make_backend`` fixture is in
conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.backends.base import CopyBatch
from kvflow.core.transfer import Direction

torch = pytest.importorskip("torch")

KiB = 1024
TOKENS = 16
SLEEP_CYCLES = 200_000_000  # ~0.1 s on an H200: long enough that a race is certain to show


def make_kv(style: str, dtype: Any, chunk: int, num_blocks: int, layers: int = 3) -> dict[str, Any]:
    """KV tensors of one layout style whose pages are ``chunk`` bytes, filled with random bytes."""
    item = torch.empty(0, dtype=dtype).element_size()
    elems = chunk // item
    dev = "cuda"
    if style == "flash":  # (2, N, tokens, heads, head_dim) per layer
        heads = elems // (TOKENS * 64)
        kv = {
            f"layer{i}": torch.empty((2, num_blocks, TOKENS, heads, 64), dtype=dtype, device=dev)
            for i in range(layers)
        }
    elif style == "mla":  # (N, tokens, latent) per layer
        kv = {
            f"layer{i}": torch.empty((num_blocks, TOKENS, elems // TOKENS), dtype=dtype, device=dev)
            for i in range(layers)
        }
    else:  # cross-layer: one (N, layers, 2, tokens, heads, head_dim) tensor
        heads = elems // (TOKENS * 64)
        kv = {
            "kv": torch.empty((num_blocks, layers, 2, TOKENS, heads, 64), dtype=dtype, device=dev)
        }
    for t in kv.values():
        t.view(torch.uint8).random_(0, 256)
    return kv


def block_bytes(kv: dict[str, Any], style: str, b: int) -> Any:
    """The bytes of GPU block ``b`` in block-major CPU order (regions in registration order)."""
    parts = []
    for t in kv.values():
        u8 = t.view(torch.uint8)
        if style == "flash":
            parts += [u8[0, b].reshape(-1), u8[1, b].reshape(-1)]
        else:
            parts.append(u8[b].reshape(-1))
    return torch.cat(parts).cpu()


def ready(
    make_backend: Any, style: str, dtype: Any, chunk: int, n: int, cpu_blocks: int, **cfg: Any
) -> tuple[dict[str, Any], Any]:
    """Random KV tensors and a backend with them registered and a CPU tier allocated."""
    kv = make_kv(style, dtype, chunk, n)
    backend = make_backend(**cfg)
    backend.register_kv_caches(kv, n)
    backend.allocate_cpu_tier([cpu_blocks])
    return kv, backend


def store(gpu: list[int], cpu: list[int]) -> CopyBatch:
    return CopyBatch(Direction.STORE, (tuple(gpu),), (tuple(cpu),))


def load(cpu: list[int], gpu: list[int]) -> CopyBatch:
    return CopyBatch(Direction.LOAD, (tuple(gpu),), (tuple(cpu),))


def gpu_sleep() -> None:
    """Occupy the current (compute) stream for a while."""
    torch.cuda._sleep(SLEEP_CYCLES)
