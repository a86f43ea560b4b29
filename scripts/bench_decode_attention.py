"""Decode attention kernels on the GPU: time per call of each SDPA backend for decode-shaped
inputs (a few query heads per KV head, one row per request, long keys), the data behind the
engine's choice in ``kvflow.engine.kv_cache``.

    PYTHONPATH=src python scripts/bench_decode_attention.py
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = ((1, 16384), (2, 6400), (16, 2048), (64, 1024))


def time_ms(fn: Callable[[], object], calls: int) -> float:
    """Mean ms per call on the device, after 3 untimed calls."""
    for _ in range(3):
        fn()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / calls


def row(dtype: torch.dtype, rows: int, keys: int, calls: int) -> list[str]:
    q = torch.randn(rows, 8, 4, 64, device="cuda", dtype=dtype)
    kv = torch.randn(2, rows, keys, 8, 64, device="cuda", dtype=dtype).permute(0, 1, 3, 2, 4)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool, device="cuda")
    mask[0, ..., keys // 2 :] = False  # one padded row, as in a batch of unequal contexts

    def masked(backend: SDPBackend) -> Callable[[], object]:
        def run() -> object:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)

        return run

    def flash() -> object:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kv[0], kv[1])

    cells = [
        f"{time_ms(masked(SDPBackend.EFFICIENT_ATTENTION), calls):.3f}",
        f"{time_ms(masked(SDPBackend.MATH), calls):.3f}",
    ]
    cells.append(f"{time_ms(flash, calls):.3f}" if dtype != torch.float32 else "—")
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    table = Table(title=f"decode attention, ms per call, {torch.cuda.get_device_name()}")
    for col in ("dtype", "rows × keys", "fused masked", "math masked", "flash, no mask"):
        table.add_column(col, justify="right")
    for dtype in (torch.bfloat16, torch.float32):
        for rows, keys in SHAPES:
            table.add_row(
                str(dtype).removeprefix("torch."),
                f"{rows} × {keys:,}",
                *row(dtype, rows, keys, args.calls),
            )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
