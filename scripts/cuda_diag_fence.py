"""Device diagnostic: which call of a staged store blocks while the compute stream is busy."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvflow.backends.base import CopyBatch
from kvflow.backends.cuda import CudaBackend, CudaConfig
from kvflow.backends.cuda import driver as drv
from kvflow.core.transfer import Direction

slow: list[tuple[str, float]] = []


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kw: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.perf_counter() - began
            if dt > 0.005:
                slow.append((name, dt))

    return wrapper


def main() -> None:
    for method in ("staged", "direct"):
        kv = {
            f"l{i}": torch.randn((2, 16, 16, 8, 64), dtype=torch.bfloat16, device="cuda")
            for i in range(3)
        }
        backend = CudaBackend(0, CudaConfig(method=method, slot_bytes=2 << 20, num_slots=2))
        backend.register_kv_caches(kv, 16)
        backend.allocate_cpu_tier([8])
        backend.cpu_tier.wait_registered()
        originals = {name: getattr(drv, name) for name in ("wait", "record", "new_event")}
        for name, fn in originals.items():
            setattr(drv, name, timed(name, fn))
        if backend._kernel is not None:
            backend._kernel.launch = timed("launch", backend._kernel.launch)  # type: ignore[method-assign]
        if backend._batch is not None:
            backend._batch.raw = timed("batch", backend._batch.raw)  # type: ignore[method-assign]
        torch.cuda.synchronize()
        for trial in range(3):
            slow.clear()
            torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
            began = time.perf_counter()
            f = backend.submit(CopyBatch(Direction.STORE, ((4,),), ((0,),)))
            took = time.perf_counter() - began
            fc = backend.compute_fence()
            f2 = backend.submit(CopyBatch(Direction.STORE, ((4,),), ((1,),)), [fc])
            print(
                method,
                trial,
                f"submit {took * 1e3:.1f} ms",
                backend.query(f),
                backend.query(f2),
                slow,
            )
            torch.cuda.synchronize()
        for name, fn in originals.items():
            setattr(drv, name, fn)
        backend.close()


if __name__ == "__main__":
    main()
