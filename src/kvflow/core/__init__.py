"""Sans-IO core: pure Python, no torch, anyio or cuda. Hashing, block pools, transfer state machines,
KV layouts, the scheduler/worker protocol and the scheduler-side manager."""
