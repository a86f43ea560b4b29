"""Run the multi-round QA workload twice on the reference engine, offload off and on, and compare.

Both runs use the same model weights, the same workload and the same GPU cache size (a fraction
of the workload's working set, so earlier users' histories are evicted before their next round).
The offload run adds kvflow's CPU tier through ``OffloadConnector``. Outputs are greedy, so the two
runs must produce the same tokens: ``outputs_identical`` checks it.
"""

from __future__ import annotations

import gc
import math
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import asdict, evolve, frozen

from kvflow.bench.config import BenchConfig
from kvflow.connector.api import KVCacheConfig
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import ConnectorStats, OffloadConnector, copy_gbps
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.transfer import Direction
from kvflow.engine.engine import (
    Engine,
    EngineConfig,
    block_bytes_per_group,
    make_kv_cache_config,
)
from kvflow.engine.model import LlamaForCausalLM, ModelConfig, build_model, model_config
from kvflow.engine.workload import MultiRoundQA, WorkloadResult, run_multi_round
from kvflow.runtime.clock import SystemClock
from kvflow.tracing import trace_to


@frozen
class RunResult:
    """One of the two runs, with the figures ``--json`` writes."""

    offload: bool
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p50_per_round_s: tuple[float, ...]
    prefill_tokens_computed: int
    prefill_tokens_loaded: int
    gpu_cached_tokens: int
    cpu_hit_rate: float
    store_gbps: float
    load_gbps: float
    blocks_stored: int
    blocks_loaded: int
    bytes_stored: int
    bytes_loaded: int
    skipped_stores: int
    failed_transfers: int
    preemptions: int
    wall_s: float


@frozen
class BenchResult:
    config: BenchConfig
    runs: tuple[RunResult, RunResult]
    outputs_identical: bool
    backend: str
    device: str
    model: str
    num_gpu_blocks: int
    cpu_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": [asdict(r) for r in self.runs],
            "outputs_identical": self.outputs_identical,
            "backend": self.backend,
            "device": self.device,
            "model": self.model,
            "num_gpu_blocks": self.num_gpu_blocks,
            "cpu_bytes": self.cpu_bytes,
            "config": asdict(self.config),
            "machine": platform.node() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        }


def workload_of(cfg: BenchConfig, model: ModelConfig) -> MultiRoundQA:
    return MultiRoundQA(
        num_users=cfg.users,
        num_rounds=cfg.rounds,
        system_prompt_len=cfg.system_prompt,
        first_question_len=cfg.first_question,
        question_len=cfg.question,
        answer_len=cfg.answer,
        vocab_size=min(model.vocab_size, 32000),
        seed=cfg.seed,
    )


def gpu_blocks_for(cfg: BenchConfig, workload: MultiRoundQA, groups: int) -> int:
    """GPU blocks: ``cache_fraction`` of the working set, at least two longest requests' worth."""
    working = math.ceil(workload.working_set_tokens / cfg.block_size)
    longest = math.ceil((workload.prompt_len(cfg.rounds - 1) + cfg.answer) / cfg.block_size)
    return groups * max(int(working * cfg.cache_fraction), 2 * longest) + 1


def offload_engine(
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    model: LlamaForCausalLM,
    offload_cfg: OffloadConfig,
    block_bytes: Sequence[int],
    *,
    now: Callable[[], float],
) -> tuple[Engine, OffloadConnector]:
    """An engine with kvflow's offload connector, ready to be timed.

    The CUDA backend pins its CPU tier in the background; this waits for it, so benchmarks time
    the steady state, not the start-up.
    """
    built: list[OffloadConnector] = []

    def factory(kv_cfg: KVCacheConfig, gpu_view: GpuCacheView) -> tuple[Any, Any]:
        conn = OffloadConnector.build(offload_cfg, kv_cfg, block_bytes, gpu_view=gpu_view, now=now)
        built.append(conn)
        return conn.scheduler, conn.worker

    engine = Engine(model_cfg, engine_cfg, model=model, clock=now, connector_factory=factory)
    (conn,) = built
    conn.worker.wait_cpu_tier()
    return engine, conn


def _run(
    name: str,
    engine: Engine,
    workload: MultiRoundQA,
    on_round: Callable[[str, int], None],
) -> WorkloadResult:
    def done(rnd: int, _records: object) -> None:
        on_round(name, rnd)

    return run_multi_round(engine, workload, on_round_done=done)


def _result(
    offload: bool,
    engine: Engine,
    result: WorkloadResult,
    rounds: int,
    stats: ConnectorStats | None,
    copies: dict[Direction, tuple[int, float]] | None = None,
) -> RunResult:
    computed = result.total("prefill_tokens_computed")
    loaded = result.total("external_loaded_tokens")
    m = stats.manager if stats is not None else None
    return RunResult(
        offload=offload,
        ttft_p50_s=result.ttft_percentile(50),
        ttft_p90_s=result.ttft_percentile(90),
        ttft_p50_per_round_s=tuple(result.ttft_percentile(50, r) for r in range(rounds)),
        prefill_tokens_computed=computed,
        prefill_tokens_loaded=loaded,
        gpu_cached_tokens=result.total("gpu_cached_tokens"),
        cpu_hit_rate=loaded / (loaded + computed) if loaded + computed else 0.0,
        store_gbps=copy_gbps(copies or {}, Direction.STORE),
        load_gbps=copy_gbps(copies or {}, Direction.LOAD),
        blocks_stored=m.blocks_stored if m else 0,
        blocks_loaded=m.blocks_loaded if m else 0,
        bytes_stored=m.bytes_stored if m else 0,
        bytes_loaded=m.bytes_loaded if m else 0,
        skipped_stores=m.skipped_stores if m else 0,
        failed_transfers=m.failed_transfers if m else 0,
        preemptions=engine.stats.preemptions,
        wall_s=result.wall_s,
    )


def _settle(device: str) -> None:
    """Free finished engines now, untimed: collected later, inside the next timed run, freeing
    their device memory would wait for the whole device."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_bench(
    cfg: BenchConfig,
    *,
    on_round: Callable[[str, int], None] = lambda _name, _round: None,
    trace: Path | None = None,
) -> BenchResult:
    """Run the workload with offload off, then on; ``on_round(run, round)`` reports progress."""
    model_cfg = model_config(cfg.model)
    clock = SystemClock()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model: LlamaForCausalLM = build_model(
        model_cfg,
        device=cfg.device,
        seed=cfg.seed,
        dtype=None if cfg.dtype is None else dtypes[cfg.dtype],
    )
    dtype = next(model.parameters()).dtype
    workload = workload_of(cfg, model_cfg)
    probe_kv = make_kv_cache_config(model_cfg, EngineConfig(block_size=cfg.block_size))
    num_blocks = gpu_blocks_for(cfg, workload, len(probe_kv.groups))
    engine_cfg = EngineConfig(
        block_size=cfg.block_size,
        num_gpu_blocks=num_blocks,
        max_num_batched_tokens=cfg.max_batched_tokens,
        device=cfg.device,
        dtype=cfg.dtype,
    )
    kv = make_kv_cache_config(model_cfg, engine_cfg)
    block_bytes = block_bytes_per_group(model_cfg, kv, dtype)
    working_bytes = math.ceil(workload.working_set_tokens / cfg.block_size) * sum(block_bytes)
    cpu_bytes = cfg.cpu_bytes or 2 * working_bytes
    offload_cfg = OffloadConfig(
        cpu_bytes=cpu_bytes,
        store_policy=cfg.store_policy,
        backend=cfg.backend,
        worker_loop=cfg.worker_loop,
    )

    built: list[OffloadConnector] = []

    def engine(offload: bool) -> Engine:
        if not offload:
            return Engine(model_cfg, engine_cfg, model=model, clock=clock.now)
        made, conn = offload_engine(
            model_cfg, engine_cfg, model, offload_cfg, block_bytes, now=clock.now
        )
        built.append(conn)
        return made

    # Warm up (first-call allocations, kernel and primitive selection per shape, lazy CUDA
    # module loading) so neither timed run pays for it: each new (query, context) shape costs
    # once, hundreds of ms on the H200 and tens on the CPU, and the two runs meet different
    # shapes, so "full" runs both once untimed. Warm-up engines are thrown away with their caches.
    full = cfg.warmup == "full"
    for offload in (False, True) if full else (False,):
        warm = engine(offload)
        run_multi_round(
            warm, workload if full else evolve(workload, num_rounds=1, seed=workload.seed + 1)
        )
        warm.shutdown()
        del warm
        _settle(cfg.device)

    baseline = engine(False)
    off = _run("offload off", baseline, workload, on_round)
    off_result = _result(False, baseline, off, cfg.rounds, None)
    baseline.shutdown()
    del baseline
    _settle(cfg.device)

    if trace is not None:
        with trace_to(trace, clock.now):
            offloaded = engine(True)
            on = _run("offload on", offloaded, workload, on_round)
    else:
        offloaded = engine(True)
        on = _run("offload on", offloaded, workload, on_round)
    connector = built[-1]
    on_result = _result(
        True,
        offloaded,
        on,
        cfg.rounds,
        connector.scheduler.stats(),
        connector.worker.copy_throughput(),
    )
    backend = connector.worker.backend.name
    offloaded.shutdown()
    device = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"
    return BenchResult(
        config=cfg,
        runs=(off_result, on_result),
        outputs_identical=off.outputs() == on.outputs(),
        backend=backend,
        device=device,
        model=cfg.model,
        num_gpu_blocks=num_blocks,
        cpu_bytes=cpu_bytes,
    )


__all__ = [
    "BenchConfig",
    "BenchResult",
    "RunResult",
    "block_bytes_per_group",
    "gpu_blocks_for",
    "offload_engine",
    "run_bench",
    "workload_of",
]
