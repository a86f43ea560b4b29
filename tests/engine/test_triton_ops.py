"""The fused Triton kernels of the decoder layer agree with the torch ops they replace.

On a GPU in every dtype; elsewhere in float32 under Triton's interpreter (``TRITON_INTERPRET=1``
set before Python starts, and Triton installed), which CI's CPU machines do not have.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F

from kvflow.engine import triton_decode, triton_ops
from kvflow.engine.kv_cache import write_kv
from kvflow.engine.model import apply_rope, build_model, model_config, rope_cos_sin

F_ = TypeVar("F_", bound=Callable[..., None])

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def on_gpu(test: F_) -> F_:
    marked: F_ = pytest.mark.gpu(
        pytest.mark.skipif(not triton_ops.HAVE_TRITON, reason="needs Triton")(test)
    )
    return marked


def _device(dtype: torch.dtype) -> str:
    """CUDA, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before Python
    starts), which rounds half precision its own way: float32 only there."""
    if torch.cuda.is_available():
        return "cuda"
    if not INTERPRET or dtype != torch.float32:
        pytest.skip("needs a CUDA device, or TRITON_INTERPRET=1 for float32")
    return "cpu"


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=_device(dtype), dtype=dtype)


def test_cpu_tensors_keep_torch_and_odd_heads_are_refused() -> None:
    """A CPU activation never takes the kernels; RoPE's kernel takes power-of-two heads only."""
    assert not triton_ops.usable(torch.zeros(2, 4))
    assert triton_ops.rope_fits(64)
    assert triton_ops.rope_fits(16)
    assert not triton_ops.rope_fits(96)
    assert not triton_ops.rope_fits(1)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "hidden"), [(2, 2048), (300, 2048), (3, 100), (0, 64)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    """The residual equals torch's add exactly; the normed rows equal F.rms_norm of it."""
    x = _randn(rows, hidden, dtype=dtype, seed=1)
    delta = _randn(rows, hidden, dtype=dtype, seed=2)
    weight = _randn(hidden, dtype=dtype, seed=3)
    total, normed = triton_ops.add_rms_norm(x, delta, weight, 1e-5)
    want = x + delta
    assert torch.equal(total, want)
    expected = F.rms_norm(want.float(), (hidden,), weight.float(), 1e-5).to(dtype)
    torch.testing.assert_close(normed, expected, rtol=TOL[dtype], atol=TOL[dtype])


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 64), (6, 2, 16), (4, 4, 128)])
def test_rope_write_kv_rotates_and_writes_only_the_given_slots(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Queries as apply_rope gives them; rotated keys and the values land in their slots of a
    paged cache and nowhere else."""
    t, blocks, block_size = 37, 20, 16
    qkv = _randn(t, heads + 2 * kv_heads, head_dim, dtype=dtype, seed=4)
    positions = torch.randint(0, 9000, (t,), generator=torch.Generator().manual_seed(5))
    device = _device(dtype)
    cos, sin = rope_cos_sin(positions.to(device), head_dim, 500000.0, dtype)
    gen = torch.Generator().manual_seed(6)
    slots = torch.randperm(blocks * block_size, generator=gen)[:t].to(device)
    cache = _randn(2, blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=7)
    expected_cache = cache.clone()
    q_want = apply_rope(qkv[:, :heads], cos, sin)
    k_want = apply_rope(qkv[:, heads : heads + kv_heads], cos, sin)
    write_kv(expected_cache, slots, k_want, qkv[:, heads + kv_heads :])
    q = triton_ops.rope_write_kv(qkv, cos, sin, cache, slots, heads, kv_heads)
    tol = TOL[dtype]
    torch.testing.assert_close(q, q_want, rtol=tol, atol=tol)
    torch.testing.assert_close(cache, expected_cache, rtol=tol, atol=tol)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots] = False
    flat = cache.view(2, -1, kv_heads, head_dim)
    before = expected_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], before[:, untouched])
    assert torch.equal(flat[1, slots], qkv[:, heads + kv_heads :])


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(2, 8192), (513, 100), (1, 1)])
def test_silu_mul_is_silu_of_the_gate_times_up(dtype: torch.dtype, rows: int, width: int) -> None:
    """The gate half's SiLU times the up half, as torch computes it."""
    gate_up = _randn(rows, 2 * width, dtype=dtype, seed=8)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (F.silu(gate.float()) * up.float()).to(dtype)
    got = triton_ops.silu_mul(gate_up)
    torch.testing.assert_close(got, expected, rtol=TOL[dtype], atol=TOL[dtype])


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_with_the_kernels_agrees_with_torchs_layer(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-1b's layers with the fused kernels give torch's queries, caches, residuals, MLP
    output and logits, up to rounding."""
    device = _device(dtype)
    cfg = model_config("llama-1b")
    model = build_model(cfg, device=device, dtype=dtype)
    t = 24
    x = _randn(t, cfg.hidden_size, dtype=dtype, seed=9) * 0.1
    cos, sin = rope_cos_sin(torch.arange(100, 100 + t, device=device), cfg.head_dim, 5e5, dtype)
    slots = torch.arange(t, device=device) * 3
    results = []
    for fused in (True, False):
        monkeypatch.setattr(triton_ops, "usable", lambda _x, fused=fused: fused)
        shape = (2, 8, 16, cfg.num_kv_heads, cfg.head_dim)
        caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)]
        q, resid = model.pre_attention(0, x, cos, sin, caches[0], slots)
        resid, mlp_out = model.post_attention(0, resid, q * 0.5)
        # The next layer adds the MLP's output to the residual in its input norm.
        q1, resid1 = model.pre_attention(1, resid, cos, sin, caches[1], slots, mlp_out)
        logits = model.head(resid1, torch.tensor([0, t - 1], device=device), mlp_out)
        results.append((q, *caches, resid, mlp_out, q1, resid1, logits))
    tol = TOL[dtype] * 2
    *states, logits = results[0]
    *want_states, want_logits = results[1]
    for got, want in zip(states, want_states, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # The randomly initialised head's logits reach the hundreds (bf16 steps of 0.5 to 1 there),
    # and a norm's sum taken in another order flips an input's last bit: logits are compared
    # against their own scale, as a whole and element by element.
    scale = float(want_logits.abs().max())
    assert float((logits - want_logits).norm() / want_logits.norm()) <= tol
    torch.testing.assert_close(logits, want_logits, rtol=tol, atol=tol * scale)


@on_gpu
def test_decode_attention_writes_into_a_given_output() -> None:
    """With ``out`` the kernel fills that tensor and returns it; a misshapen one is refused."""
    kv_heads, head_dim, heads = 8, 64, 32
    cache = _randn(2, 64, 16, kv_heads, head_dim, dtype=torch.bfloat16, seed=10)
    q = _randn(2, heads, head_dim, dtype=torch.bfloat16, seed=11)
    tables = torch.arange(1, 33, device=q.device).view(2, 16).to(torch.int32)
    sizes = torch.tensor([[0, 0], [200, 77]], dtype=torch.int32, device=q.device)
    fresh = triton_decode.paged_decode_attention(q, cache, tables, sizes, 200)
    out = torch.full_like(q, float("nan"))
    got = triton_decode.paged_decode_attention(q, cache, tables, sizes, 200, out=out)
    assert got is out
    assert torch.equal(out, fresh)
    with pytest.raises(ValueError, match="out must be contiguous"):
        triton_decode.paged_decode_attention(q, cache, tables, sizes, 200, out=out[:1])
