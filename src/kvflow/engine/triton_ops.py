"""Fused elementwise kernels of the decoder layer, in Triton: one launch where torch makes several.

A bf16 llama-1b decode step on the H100 spent about 30 % of its device time in some 15 small
kernels a layer (docs/benchmarks.md, twenty-seventh session): the residual add and the norm, the
rotary embedding's slices, negation, concatenation and products, the two ``index_copy_`` of the
cache write, SiLU and the gate product. At a few rows each is a couple of microseconds of launch
latency on the device, and in an eager step each is a launch from Python. Three kernels replace
them:

- ``add_rms_norm``: the residual add and the RMSNorm after it;
- ``rope_write_kv``: RoPE on the queries and keys, and the keys and values written to their
  cache slots;
- ``silu_mul``: SwiGLU's ``silu(gate) * up``.

Each computes in float32 and rounds once, so its results may differ from torch's chain of
rounded half-precision ops in the last bit; the engine uses them on every path of a run alike
(eager, piecewise and full graphs), so a run agrees with itself. ``usable()`` says whether a
tensor takes them: CUDA with Triton (torch's CUDA builds ship it); elsewhere the model keeps torch.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton
    triton = None

HAVE_TRITON = triton is not None

_add_rms_norm: Any = None
_rope_write: Any = None
_silu_mul: Any = None
if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < N
        at = row * N + cols
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        x += tl.load(delta_ptr + at, mask=keep, other=0.0).to(tl.float32)
        # The residual is kept in the model's dtype, so the norm reads it rounded, as torch's
        # add followed by its norm would.
        s = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + at, s, mask=keep)
        xs = s.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (xs * rstd * w).to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit  # type: ignore[untyped-decorator]
    def _rope_write_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        slots_ptr,
        q_ptr,
        cache_ptr,
        v_offset,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HP: tl.constexpr,
        KVP: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        half: tl.constexpr = HEAD_DIM // 2
        d = tl.arange(0, half)
        row = qkv_ptr + t * (HEADS + 2 * KV_HEADS) * HEAD_DIM
        c1 = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)
        c2 = tl.load(cos_ptr + t * HEAD_DIM + half + d).to(tl.float32)
        s1 = tl.load(sin_ptr + t * HEAD_DIM + d).to(tl.float32)
        s2 = tl.load(sin_ptr + t * HEAD_DIM + half + d).to(tl.float32)
        # Queries: rotate (x1, x2) to (x1 c1 - x2 s1, x2 c2 + x1 s2), Llama's half-split.
        h = tl.arange(0, HP)
        hk = (h < HEADS)[:, None]
        src = row + h[:, None] * HEAD_DIM + d[None, :]
        x1 = tl.load(src, mask=hk, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=hk, other=0.0).to(tl.float32)
        dst = q_ptr + t * HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :]
        ty = q_ptr.dtype.element_ty
        tl.store(dst, (x1 * c1[None, :] - x2 * s1[None, :]).to(ty), mask=hk)
        tl.store(dst + half, (x2 * c2[None, :] + x1 * s2[None, :]).to(ty), mask=hk)
        # Keys rotate the same way, then go with the values straight to the token's cache slot.
        slot = tl.load(slots_ptr + t).to(tl.int64)
        g = tl.arange(0, KVP)
        gk = (g < KV_HEADS)[:, None]
        ksrc = row + (HEADS + g)[:, None] * HEAD_DIM + d[None, :]
        k1 = tl.load(ksrc, mask=gk, other=0.0).to(tl.float32)
        k2 = tl.load(ksrc + half, mask=gk, other=0.0).to(tl.float32)
        kdst = cache_ptr + slot * KV_HEADS * HEAD_DIM + g[:, None] * HEAD_DIM + d[None, :]
        cty = cache_ptr.dtype.element_ty
        k_rot1 = (k1 * c1[None, :] - k2 * s1[None, :]).to(ty)
        k_rot2 = (k2 * c2[None, :] + k1 * s2[None, :]).to(ty)
        tl.store(kdst, k_rot1.to(cty), mask=gk)
        tl.store(kdst + half, k_rot2.to(cty), mask=gk)
        vsrc = ksrc + KV_HEADS * HEAD_DIM
        v1 = tl.load(vsrc, mask=gk, other=0.0)
        v2 = tl.load(vsrc + half, mask=gk, other=0.0)
        tl.store(kdst + v_offset, v1.to(cty), mask=gk)
        tl.store(kdst + v_offset + half, v2.to(cty), mask=gk)

    @triton.jit  # type: ignore[untyped-decorator]
    def _silu_mul_kernel(  # type: ignore[no-untyped-def]
        gu_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < N
        gate = tl.load(gu_ptr + row * 2 * N + cols, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + row * 2 * N + N + cols, mask=keep, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=keep)

    _add_rms_norm = _add_rms_norm_kernel
    _rope_write = _rope_write_kernel
    _silu_mul = _silu_mul_kernel

SILU_BLOCK = 1024
"""Columns of one ``silu_mul`` program."""


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` (an activation) takes the fused kernels: on CUDA, with Triton."""
    return HAVE_TRITON and x.is_cuda


def rope_fits(head_dim: int) -> bool:
    """Whether ``rope_write_kv`` takes heads of ``head_dim`` (a power of two, as Triton's
    ranges need)."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4 if elements >= 1024 else 2


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta) * weight)`` for rows ``(T, N)``, in one pass."""
    assert _add_rms_norm is not None
    x, delta = x.contiguous(), delta.contiguous()
    total = torch.empty_like(x)
    out = torch.empty_like(x)
    n = x.shape[-1]
    rows = x.numel() // n
    if rows:
        block = _pow2(n)
        _add_rms_norm[(rows,)](
            x, delta, weight, total, out, eps, N=n, BLOCK=block, num_warps=_warps(block)
        )
    return total, out


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Rotated queries ``(T, heads, D)`` of ``qkv`` ``(T, heads + 2 kv_heads, D)``; the rotated
    keys and the values are written to ``cache`` (``(2, blocks, block_size, kv_heads, D)``,
    contiguous) at ``slots`` ``(T,)``."""
    assert _rope_write is not None
    t, _, head_dim = qkv.shape
    if not rope_fits(head_dim):
        raise ValueError(f"rope_write_kv needs a power-of-two head size, got {head_dim}")
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = torch.empty((t, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t:
        v_offset = cache.shape[1] * cache.shape[2] * kv_heads * head_dim
        hp, kvp = _pow2(heads), _pow2(kv_heads)
        _rope_write[(t,)](
            qkv,
            cos,
            sin,
            slots,
            q,
            cache,
            v_offset,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            HP=hp,
            KVP=kvp,
            num_warps=_warps(hp * head_dim),
        )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``(T, 2 I)`` (gate first), as ``(T, I)``."""
    assert _silu_mul is not None
    gate_up = gate_up.contiguous()
    n = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * n)
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(SILU_BLOCK, _pow2(n))
        _silu_mul[(rows, -(-n // block))](gate_up, out, N=n, BLOCK=block, num_warps=4)
    return out


__all__ = ["HAVE_TRITON", "add_rms_norm", "rope_fits", "rope_write_kv", "silu_mul", "usable"]
