"""PD data planes: the ``KVTransport`` protocol and its transports (gloo on CPU, a fake for
tests). The GPU transports of PD part 2 (CUDA IPC, NIXL) implement the same protocol."""
