"""PD data planes: the ``KVTransport`` protocol and its transports — gloo (CPU), NIXL (the
``kvflow[nixl]`` extra: RDMA, TCP, shared memory, GPU), CUDA IPC (two engine processes on one
GPU) and a fake for tests — chosen by name through ``make_transport`` (``registry``)."""

from kvflow.backends.pd.registry import TRANSPORTS, make_transport, transport_status

__all__ = ["TRANSPORTS", "make_transport", "transport_status"]
