"""The Triton paged decode kernel agrees with the torch path (gather + SDPA) it replaces.

On a GPU it runs compiled; elsewhere only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Python starts, and Triton installed), which CI's CPU machines do not have.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvflow.engine import triton_decode
from kvflow.engine.kv_cache import DecodeSegment, PagedDecode, decode_attention, decode_segment

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(not triton_decode.HAVE_TRITON, reason="Triton is not installed")


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if not INTERPRET:
        pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")
    return "cpu"


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "head_dim", "contexts", "window"),
    [
        (torch.float32, 8, 2, 32, [0, 5, 40, 77], None),
        (torch.float32, 32, 8, 64, [6399, 6400], None),
        (torch.bfloat16, 32, 8, 64, [100, 2047, 1], None),
        (torch.float32, 4, 2, 32, [3, 30, 61], 6),
        (torch.float16, 6, 2, 16, [15, 16, 17], None),
    ],
)
def test_kernel_matches_gather_and_sdpa(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    contexts: list[int],
    window: int | None,
) -> None:
    """Rows of unequal length, odd head groups and sliding windows: the torch path's output."""
    device = _device()
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter check runs float32 only")
    gen = torch.Generator().manual_seed(len(contexts) * 31 + head_dim)
    block_size, num_blocks = 16, 1024
    cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=gen)
    cache = cache.to(device=device, dtype=dtype)
    need = [c // block_size + 1 for c in contexts]
    perm = torch.randperm(num_blocks - 1, generator=gen)[: sum(need)] + 1
    tables_list, at = [], 0
    for n in need:
        tables_list.append(perm[at : at + n].tolist())
        at += n
    width = max(need)
    tables = torch.zeros((len(contexts), width), dtype=torch.long)
    for i, t in enumerate(tables_list):
        tables[i, : len(t)] = torch.tensor(t)
    tables = tables.to(device)
    q = torch.randn((len(contexts), heads, head_dim), generator=gen).to(device=device, dtype=dtype)
    reference = decode_segment(
        tables, contexts, window, block_size, torch.arange(len(contexts), device=device)
    )
    assert isinstance(reference, DecodeSegment)
    expected = decode_attention(q, cache, reference)
    firsts = [0 if window is None else max(0, c - window + 1) for c in contexts]
    counts = [c + 1 - f for c, f in zip(contexts, firsts, strict=True)]
    got = triton_decode.paged_decode_attention(
        q,
        cache,
        tables,
        torch.tensor([firsts, counts], dtype=torch.int32, device=device),
        max(counts),
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_splits_fill_the_gpu_without_empty_tiles() -> None:
    """Few long rows get many splits, many rows few, and never more splits than key tiles."""
    assert triton_decode.num_splits(2, 8, 6400) == 64
    assert triton_decode.num_splits(64, 8, 1024) == 2
    assert triton_decode.num_splits(1, 8, 10) == 1


def test_paged_rows_carry_their_first_key_and_count() -> None:
    """Ragged rows become PagedDecode with each row's window start and key count, on any device."""
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]])
    d = decode_segment(tables, [40, 9], 6, 16, torch.arange(2), paged=True)
    assert isinstance(d, PagedDecode)
    assert d.sizes.tolist() == [[35, 4], [6, 6]]
    assert d.max_keys == 6


def test_equal_half_precision_rows_keep_flash() -> None:
    """With flash_if_equal, rows of equal length stay on torch's unmasked path; ragged do not."""
    tables = torch.tensor([[1, 2], [3, 4]])
    index = torch.arange(2)
    equal = decode_segment(tables, [20, 20], None, 16, index, paged=True, flash_if_equal=True)
    assert isinstance(equal, DecodeSegment)
    assert equal.mask is None
    ragged = decode_segment(tables, [20, 19], None, 16, index, paged=True, flash_if_equal=True)
    assert isinstance(ragged, PagedDecode)
    fp32 = decode_segment(tables, [20, 20], None, 16, index, paged=True)
    assert isinstance(fp32, PagedDecode)
