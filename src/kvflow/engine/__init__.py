"""A small but real paged-KV inference engine: kvflow's reference client.

Llama-architecture model (``model``), paged KV cache and attention (``kv_cache``), block tables and
GPU prefix caching on kvflow's block pool (``block_manager``), continuous batching with chunked
prefill and preemption (``scheduler``), the worker-side step (``runner``), the engine loop
(``engine``), an async frontend (``frontend``) and the multi-round QA workload (``workload``).
"""
