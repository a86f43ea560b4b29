"""Pick and build a backend by name: ``auto`` takes CUDA for CUDA tensors when a driver is there."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.backends.base import Backend
from kvflow.backends.probe import probe_cuda
from kvflow.errors import BackendError, ConfigError


def make_backend(
    kind: str,
    device: str,
    *,
    inline: bool = False,
    cuda_options: Mapping[str, Any] | None = None,
) -> Backend:
    """A backend for KV tensors on ``device`` ("cpu", "cuda", "cuda:1"); ``kind`` auto/host/cuda.

    ``inline``: for a runtime whose loop runs on the engine's thread (``InlineSyncWorker``):
    the CUDA backend then launches copies inside ``submit`` and starts no completion threads.
    The host backend keeps its copy thread either way (its copies are the CPU's own work).
    ``cuda_options``: other ``CudaConfig`` fields of a CUDA backend (a benchmark's copy path)."""
    on_cuda = device.startswith("cuda")
    if kind == "auto":
        kind = "cuda" if on_cuda and probe_cuda().available else "host"
    if kind == "host":
        if on_cuda:
            raise ConfigError(f"backend 'host' cannot copy KV tensors on {device}; use 'cuda'")
        from kvflow.backends.host import HostBackend

        return HostBackend()
    if kind == "cuda":
        if not on_cuda:
            raise ConfigError(f"backend 'cuda' needs KV tensors on a CUDA device, not {device}")
        probe = probe_cuda()
        if not probe.available:
            raise BackendError(f"backend 'cuda' asked for, but no CUDA: {probe.error}")
        from kvflow.backends.cuda import CudaBackend, CudaConfig

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        threads = not inline
        return CudaBackend(
            index,
            CudaConfig(launch_thread=threads, completion_threads=threads, **(cuda_options or {})),
        )
    raise ConfigError(f"unknown backend {kind!r}: one of auto, host, cuda")


__all__ = ["make_backend"]
