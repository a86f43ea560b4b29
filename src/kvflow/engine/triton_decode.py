"""Paged decode attention as a Triton kernel: keys read in place through the block tables.

The torch path gathers every decode row's keys and values into one padded tensor and runs SDPA
on it. On the H200 (profiles in docs/benchmarks.md) that costs, per layer, a 52 MB gather and a
copy to contiguous for two rows of 6,400 float32 keys, and a batched GEMM over the long key axis
that cuBLAS runs nearly serially (0.21 ms of the 0.34 ms); with rows of unequal length no
flash kernel applies. This kernel is flash-decoding over the paged cache: program
``(row, kv_head, split)`` walks its share of the row's keys straight from the cache blocks with an
online softmax, for all the query heads of that KV head at once; a second kernel merges the
splits by their log-sum-exp. Splits keep the GPU busy when there are few rows.

Used on CUDA when Triton imports (it ships with torch's CUDA builds); ``available()`` says so.
Half-precision rows of equal length stay on torch's path, where SDPA's flash kernel needs no mask
and was faster than this one on the H200 (one row: 2.7 against 4.5 ms per llama-1b step).
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

HAVE_TRITON = triton is not None

BLOCK_N = 32
"""Keys per loop iteration of one program."""

MERGE_SPLITS = 64
"""Splits the merge kernel reads per iteration."""

TARGET_PROGRAMS = 1024
"""Programs to aim for when splitting keys: several per SM of an H200 (132)."""

_kernel: Any = None
_merge: Any = None
if triton is not None:
    # Triton compiles a variant per divisibility of each integer argument; these change from
    # step to step, and a compile takes about a second, so they are left unspecialised.
    @triton.jit(  # type: ignore[untyped-decorator]
        do_not_specialize=["rows", "stride_qb", "stride_qh", "stride_tb", "split_len", "num_splits"]
    )
    def _decode_split_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        cache_ptr,
        tables_ptr,
        sizes_ptr,
        rows,
        acc_ptr,
        m_ptr,
        l_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_tb,
        v_offset,
        split_len,
        num_splits,
        BLOCK_SIZE: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        REP: tl.constexpr,
        REP_P: tl.constexpr,
        QR: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLIT_FROM_SIZES: tl.constexpr,
        DOT: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        if SPLIT_FROM_SIZES:
            # A captured step: the grid is fixed, the keys per split follow the step's rows.
            split_len = tl.load(sizes_ptr + 2 * rows)
        first = tl.load(sizes_ptr + b)
        count = tl.load(sizes_ptr + rows + b)
        lo = s * split_len
        hi = tl.minimum(lo + split_len, count)
        # QR query rows: the KV head's REP query heads, padded to what tl.dot takes (16) when
        # the tensor cores serve half precision; only the first REP_P rows are stored.
        r = tl.arange(0, QR)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + b * stride_qb + (h * REP + r)[:, None] * stride_qh + d[None, :],
            mask=(r < REP)[:, None],
            other=0.0,
        )
        if not DOT:
            q = q.to(tl.float32)
        m = tl.full([QR], float("-inf"), tl.float32)
        l_sum = tl.zeros([QR], tl.float32)
        acc = tl.zeros([QR, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            valid = n < hi
            pos = first + n
            blk = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            off = slot[:, None] * (KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d[None, :]
            k = tl.load(cache_ptr + off, mask=valid[:, None], other=0.0)
            v = tl.load(cache_ptr + v_offset + off, mask=valid[:, None], other=0.0)
            if DOT:
                scores = tl.dot(q, tl.trans(k)) * scale
            else:
                scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
                acc = acc * alpha[:, None] + pv
            m = m_new
        keep = r < REP_P
        base = ((b * KV_HEADS + h) * num_splits + s) * REP_P + r
        tl.store(m_ptr + base, m, mask=keep)
        tl.store(l_ptr + base, l_sum, mask=keep)
        tl.store(acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])

    @triton.jit(do_not_specialize=["num_splits", "stride_ob", "stride_oh"])  # type: ignore[untyped-decorator]
    def _merge_splits_kernel(  # type: ignore[no-untyped-def]
        acc_ptr,
        m_ptr,
        l_ptr,
        out_ptr,
        num_splits,
        stride_ob,
        stride_oh,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        REP: tl.constexpr,
        REP_P: tl.constexpr,
        SC: tl.constexpr,
    ):
        # One program per query head: a program per KV head merged its REP heads' splits in a
        # loop of dependent loads, 11 us a layer at two rows on the H100 (docs/benchmarks.md).
        b = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        d = tl.arange(0, HEAD_DIM)
        c = tl.arange(0, SC)
        base = (b * KV_HEADS + h) * num_splits * REP_P + r
        top = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        out = tl.zeros([HEAD_DIM], tl.float32)
        # An empty split (m = -inf) weighs 0; the maximum is taken as 0 while every split so far
        # was empty, so no -inf - -inf arises.
        for s0 in range(0, num_splits, SC):
            sv = (s0 + c) < num_splits
            at = base + (s0 + c) * REP_P
            m_s = tl.load(m_ptr + at, mask=sv, other=float("-inf"))
            l_s = tl.load(l_ptr + at, mask=sv, other=0.0)
            new_top = tl.maximum(top, tl.max(m_s, axis=0))
            ref = tl.where(new_top == float("-inf"), 0.0, new_top)
            old_w = tl.exp(top - ref)
            w = tl.exp(m_s - ref)
            total = total * old_w + tl.sum(l_s * w, axis=0)
            acc_s = tl.load(
                acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=sv[:, None], other=0.0
            )
            out = out * old_w + tl.sum(acc_s * w[:, None], axis=0)
            top = new_top
        out = out / total
        dst = out_ptr + b * stride_ob + (h * REP + r) * stride_oh + d
        tl.store(dst, out.to(out_ptr.dtype.element_ty))

    _kernel = _decode_split_kernel
    _merge = _merge_splits_kernel


def available(device: torch.device, head_dim: int) -> bool:
    """Whether the kernel serves decode attention on ``device`` for heads of ``head_dim``."""
    return (
        _kernel is not None
        and device.type == "cuda"
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def num_splits(rows: int, kv_heads: int, max_keys: int) -> int:
    """Splits of the key axis: enough programs to fill the GPU, none without a tile of keys."""
    tiles = max(1, math.ceil(max_keys / BLOCK_N))
    return max(1, min(tiles, math.ceil(TARGET_PROGRAMS / (rows * kv_heads))))


def split_len_for(splits: int, max_keys: int) -> int:
    """Keys per split, a whole number of tiles, so that ``splits`` splits cover ``max_keys``."""
    return math.ceil(math.ceil(max_keys / splits) / BLOCK_N) * BLOCK_N


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    sizes: torch.Tensor,
    max_keys: int,
    *,
    splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of decode queries ``(B, heads, D)`` over their paged keys, as ``(B, heads, D)``.

    ``sizes`` is int32 ``(2, B)``: row ``b`` attends to the ``sizes[1, b]`` keys from position
    ``sizes[0, b]`` on, found through its block table ``tables[b]``; ``max_keys`` is the largest
    count, given by the caller, who knows it without reading the device. ``cache`` is one layer's
    contiguous ``(2, num_blocks, block_size, kv_heads, head_dim)`` tensor.

    ``splits`` fixes the grid for a CUDA graph: ``sizes`` is then flat, ``2 * B + 1`` long, its
    last entry the keys per split (``split_len_for``) written on every replay, and ``max_keys``
    is ignored. ``out``, when given, receives the result (contiguous, ``q``'s shape and dtype).
    """
    assert _kernel is not None
    b, heads, head_dim = q.shape
    _, num_blocks, block_size, kv_heads, _ = cache.shape
    if not cache.is_contiguous() or not sizes.is_contiguous() or q.stride(2) != 1:
        raise ValueError("paged decode attention needs a contiguous cache, sizes and query rows")
    if out is not None and (
        out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()
    ):
        raise ValueError("paged decode attention's out must be contiguous, of the queries' shape")
    rep = heads // kv_heads
    rep_p = max(2, 1 << (rep - 1).bit_length())
    dot = q.dtype in (torch.float16, torch.bfloat16) and cache.dtype == q.dtype
    from_sizes = splits is not None
    if splits is None:
        splits = num_splits(b, kv_heads, max_keys)
        split_len = split_len_for(splits, max_keys)
    else:
        split_len = BLOCK_N  # unused: the kernel reads it from ``sizes``
    acc = torch.empty((b, kv_heads, splits, rep_p, head_dim), dtype=torch.float32, device=q.device)
    m = torch.empty((b, kv_heads, splits, rep_p), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    _kernel[(b, kv_heads, splits)](
        q,
        cache,
        tables,
        sizes,
        b,
        acc,
        m,
        lse,
        1.0 / math.sqrt(head_dim),
        q.stride(0),
        q.stride(1),
        tables.stride(0),
        num_blocks * block_size * kv_heads * head_dim,
        split_len,
        splits,
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        REP=rep,
        REP_P=rep_p,
        QR=max(16, rep_p) if dot else rep_p,
        BLOCK=BLOCK_N,
        SPLIT_FROM_SIZES=from_sizes,
        DOT=dot,
    )
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _merge[(b, kv_heads, rep)](
        acc,
        m,
        lse,
        out,
        splits,
        out.stride(0),
        out.stride(1),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        REP=rep,
        REP_P=rep_p,
        SC=MERGE_SPLITS,
    )
    return out


__all__ = [
    "BLOCK_N",
    "HAVE_TRITON",
    "available",
    "num_splits",
    "paged_decode_attention",
    "split_len_for",
]
