"""A small but real paged-KV inference engine: kvflow's reference client.

Llama-architecture model (``model``), paged KV cache and attention (``kv_cache``), block tables and
GPU prefix caching on kvflow's block pool (``block_manager``), a request's life (``request``),
continuous batching with chunked prefill and preemption (``scheduler``), the worker-side step
(``runner``), the engine loop (``engine``), an async frontend (``frontend``) and the multi-round
QA workload (``workload``).
"""

from kvflow.engine.engine import (
    Engine,
    EngineConfig,
    EngineStats,
    GenerationRequest,
    RequestResult,
    make_kv_cache_config,
)
from kvflow.engine.frontend import AsyncEngine
from kvflow.engine.model import MODEL_CONFIGS, ModelConfig, build_model, model_config
from kvflow.engine.workload import MultiRoundQA, WorkloadResult, run_multi_round

__all__ = [
    "MODEL_CONFIGS",
    "AsyncEngine",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "GenerationRequest",
    "ModelConfig",
    "MultiRoundQA",
    "RequestResult",
    "WorkloadResult",
    "build_model",
    "make_kv_cache_config",
    "model_config",
    "run_multi_round",
]
