"""The CUDA backend: batched copy-engine DMA and a staged gather/scatter path, via cuda-python.

Importing this package never touches the driver, so it imports on machines without a GPU;
``CudaBackend(...)`` raises ``BackendError`` there.
"""

from __future__ import annotations

from kvflow.backends.cuda.backend import CudaBackend, CudaConfig, CudaFence, IssueStats

__all__ = ["CudaBackend", "CudaConfig", "CudaFence", "IssueStats"]
