"""Run the multi-round QA workload twice on the reference engine, offload off and on, and compare.

Both runs use the same model weights, the same workload and the same GPU cache size (a fraction
of the workload's working set, so earlier users' histories are evicted before their next round).
The offload run adds kvflow's CPU tier through ``OffloadConnector``.

Correctness (``CorrectnessCheck``). In float32 the engine's kernels give the same tokens whatever
the batch, so the two runs' greedy outputs must be identical. In half precision they are not: the
run without offload recomputes evicted histories in other batch shapes, and a bf16 GEMM's result
depends on its shape. The reference there is a third, untimed run with a GPU cache large enough
that nothing is evicted, replaying the offload run's prompts (its answers join the histories):
its history KV is the originally computed KV, which is exactly what a CPU reload brings back.
Its tokens must match the offload run's; where the question tails computed in other batches
still move a token, the first-token logits of every request must agree within
``LOGITS_TOLERANCE`` (relative L2 distance), which a wrong or stale block exceeds many times.
"""

from __future__ import annotations

import gc
import itertools
import math
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import asdict, evolve, field, frozen

from kvflow.backends.base import Backend
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
from kvflow.engine.step_parts import summarize
from kvflow.engine.workload import MultiRoundQA, WorkloadResult, run_multi_round
from kvflow.errors import ConfigError
from kvflow.runtime.clock import SystemClock
from kvflow.tracing import trace_to

LOGITS_TOLERANCE = 0.05
"""Largest relative L2 distance of a request's first-token logits from the reference's."""

REFERENCE_RUN = "reference (no eviction)"
"""The name ``on_round`` gets for the half-precision check's run."""

PHASES = (
    "queue",
    "match",
    "load_launch",
    "load_copy",
    "load_seen",
    "to_compute",
    "prefill",
    "first_step",
)
"""``RequestTimeline``'s parts, in order."""


@frozen
class CorrectnessCheck:
    """How the offload run's outputs were checked, and whether they passed."""

    kind: str  # "tokens" or "first_token_logits"
    reference: str
    tokens_identical: bool
    requests: int
    requests_identical: int
    max_rel_logits_err: float | None
    tolerance: float | None
    passed: bool


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
    # Whether store / load GB/s come from the backend's timing of every copy (CUDA events, the
    # host backend's copy thread) rather than from submit until the copy was seen done.
    copy_time_measured: bool = False
    # Mean and median ms of each TTFT phase over requests with a history (rounds after the
    # first); the means add up to the mean TTFT of those requests.
    history_ttft_phases_mean_ms: dict[str, float] = field(factory=dict)
    history_ttft_phases_p50_ms: dict[str, float] = field(factory=dict)
    # Requests with a history that waited for an async load, and of those, how many loads the
    # connector dated (when their copies landed: the load_copy / load_seen split).
    history_loads: int = 0
    history_loads_dated: int = 0
    # Requests with a history whose load was fenced: copied inside the step that sampled their
    # first token (``fence_loads``), so no load phase of their own.
    history_fenced_loads: int = 0
    # Per kind of engine step (kvflow.engine.step_parts), means per round with a history: steps,
    # tokens, and ms of each part of a step.
    history_step_parts: dict[str, dict[str, float]] = field(factory=dict)


@frozen
class BenchResult:
    config: BenchConfig
    runs: tuple[RunResult, RunResult]
    outputs_identical: bool
    check: CorrectnessCheck
    backend: str
    device: str
    model: str
    num_gpu_blocks: int
    cpu_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": [asdict(r) for r in self.runs],
            "outputs_identical": self.outputs_identical,
            "check": asdict(self.check),
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
    backend: Backend | None = None,
) -> tuple[Engine, OffloadConnector]:
    """An engine with kvflow's offload connector, ready to be timed (on ``backend``, else the
    one ``offload_cfg`` selects).

    The CUDA backend pins its CPU tier in the background; this waits for it, so benchmarks time
    the steady state, not the start-up.
    """
    built: list[OffloadConnector] = []

    def factory(kv_cfg: KVCacheConfig, gpu_view: GpuCacheView) -> tuple[Any, Any]:
        conn = OffloadConnector.build(
            offload_cfg, kv_cfg, block_bytes, gpu_view=gpu_view, now=now, backend=backend
        )
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
) -> tuple[WorkloadResult, list[float]]:
    """The workload's result, and when it began and each round ended (engine clock)."""
    ends = [engine.clock()]

    def done(rnd: int, _records: object) -> None:
        ends.append(engine.clock())
        on_round(name, rnd)

    return run_multi_round(engine, workload, on_round_done=done), ends


def _result(
    offload: bool,
    engine: Engine,
    result: WorkloadResult,
    ends: list[float],
    rounds: int,
    stats: ConnectorStats | None,
    copies: dict[Direction, tuple[int, float]] | None = None,
    measured: bool = False,
) -> RunResult:
    computed = result.total("prefill_tokens_computed")
    loaded = result.total("external_loaded_tokens")
    m = stats.manager if stats is not None else None
    history = [r.result.timeline for r in result.records if r.round > 0]
    # Reloaded with no load phase: the load was fenced, its copies inside the first step.
    fenced = sum(
        1
        for r in result.records
        if r.round > 0
        and r.result.external_loaded_tokens > 0
        and r.result.timeline is not None
        and r.result.timeline.load_copy + r.result.timeline.load_seen == 0
    )
    phases = {p: [getattr(t, p) * 1e3 for t in history if t is not None] for p in PHASES}
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
        copy_time_measured=measured,
        history_ttft_phases_mean_ms={p: statistics.fmean(v) for p, v in phases.items() if v},
        history_ttft_phases_p50_ms={p: statistics.median(v) for p, v in phases.items() if v},
        history_loads=sum(1 for t in history if t is not None and t.load_copy + t.load_seen > 0),
        history_loads_dated=sum(1 for t in history if t is not None and t.dated),
        history_fenced_loads=fenced,
        # Rounds after the first: ends[1] closes round 0.
        history_step_parts=summarize(engine.step_parts, itertools.pairwise(ends[1:])),
    )


def _copies_measured(connector: OffloadConnector) -> bool:
    """Some copies ran, and the backend timed every one of them."""
    stats = [st for st in connector.worker.copy_stats().values() if st.batches]
    return bool(stats) and all(st.measured for st in stats)


def _settle(device: str) -> None:
    """Free finished engines now, untimed: collected later, inside the next timed run, freeing
    their device memory would wait for the whole device."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _check_against_reference(
    cfg: BenchConfig,
    workload: MultiRoundQA,
    model_cfg: ModelConfig,
    engine_cfg: EngineConfig,
    model: LlamaForCausalLM,
    on: WorkloadResult,
    clock: SystemClock,
    on_round: Callable[[str, int], None],
) -> CorrectnessCheck:
    """The half-precision check: the offload run against an untimed replay of its prompts on a
    GPU cache that holds the whole workload twice over, so that nothing is evicted."""
    probe = make_kv_cache_config(model_cfg, engine_cfg)
    roomy = evolve(
        engine_cfg,
        num_gpu_blocks=gpu_blocks_for(evolve(cfg, cache_fraction=2.0), workload, len(probe.groups)),
        record_first_logits=True,
    )
    reference = Engine(model_cfg, roomy, model=model, clock=clock.now)
    answers = on.outputs()
    ref = run_multi_round(
        reference,
        workload,
        answers=answers,
        on_round_done=lambda rnd, _records: on_round(REFERENCE_RUN, rnd),
    )
    reference.shutdown()
    del reference
    _settle(cfg.device)
    return compare_to_reference(on, ref)


def compare_to_reference(
    on: WorkloadResult, ref: WorkloadResult, tolerance: float = LOGITS_TOLERANCE
) -> CorrectnessCheck:
    """The offload run against the no-eviction replay of its prompts: tokens, else every
    request's first-token logits within ``tolerance`` (relative L2 distance)."""
    ref_by_key = {(r.user, r.round): r.result for r in ref.records}
    pairs = []
    for rec in on.records:
        theirs = ref_by_key[(rec.user, rec.round)]
        pairs.append(
            (
                rec.result.request_id,
                rec.result.output_token_ids,
                theirs.output_token_ids,
                rec.result.first_logits,
                theirs.first_logits,
            )
        )
    return check_outputs(pairs, "no-eviction replay of the offload run's prompts", tolerance)


def check_outputs(
    pairs: Sequence[tuple[str, Sequence[int], Sequence[int], Any, Any]],
    reference: str,
    tolerance: float = LOGITS_TOLERANCE,
) -> CorrectnessCheck:
    """Requests' ``(id, tokens, reference tokens, first-token logits, reference logits)``:
    tokens identical, else every request's first-token logits within ``tolerance``."""
    same, worst = 0, 0.0
    for request_id, mine, theirs, logits, expected in pairs:
        same += tuple(mine) == tuple(theirs)
        if logits is None or expected is None:
            raise ConfigError(f"request {request_id}: first-token logits not recorded")
        err = float(
            torch.linalg.vector_norm(logits - expected) / torch.linalg.vector_norm(expected)
        )
        worst = max(worst, err)
    tokens_identical = same == len(pairs)
    return CorrectnessCheck(
        kind="tokens" if tokens_identical else "first_token_logits",
        reference=reference,
        tokens_identical=tokens_identical,
        requests=len(pairs),
        requests_identical=same,
        max_rel_logits_err=worst,
        tolerance=tolerance,
        passed=tokens_identical or worst <= tolerance,
    )


def run_bench(
    cfg: BenchConfig,
    *,
    on_round: Callable[[str, int], None] = lambda _name, _round: None,
    trace: Path | None = None,
) -> BenchResult:
    """Run the workload with offload off, then on (then, in half precision, the reference run);
    ``on_round(run, round)`` reports progress."""
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
        record_step_parts=True,
        async_scheduling=cfg.async_scheduling,
    )
    kv = make_kv_cache_config(model_cfg, engine_cfg)
    block_bytes = block_bytes_per_group(model_cfg, kv, dtype)
    working_bytes = math.ceil(workload.working_set_tokens / cfg.block_size) * sum(block_bytes)
    cpu_bytes = cfg.cpu_bytes or 2 * working_bytes
    offload_cfg = OffloadConfig(
        cpu_bytes=cpu_bytes,
        store_policy=cfg.store_policy,
        fence_loads=cfg.fence_loads,
        load_parts=cfg.load_parts,
        backend=cfg.backend,
        worker_loop=cfg.worker_loop,
    )

    built: list[OffloadConnector] = []
    exact = dtype == torch.float32
    on_cfg = engine_cfg if exact else evolve(engine_cfg, record_first_logits=True)

    def engine(offload: bool) -> Engine:
        if not offload:
            return Engine(model_cfg, engine_cfg, model=model, clock=clock.now)
        made, conn = offload_engine(
            model_cfg, on_cfg, model, offload_cfg, block_bytes, now=clock.now
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
    off, off_ends = _run("offload off", baseline, workload, on_round)
    off_result = _result(False, baseline, off, off_ends, cfg.rounds, None)
    baseline.shutdown()
    del baseline
    _settle(cfg.device)

    if trace is not None:
        with trace_to(trace, clock.now):
            offloaded = engine(True)
            on, on_ends = _run("offload on", offloaded, workload, on_round)
    else:
        offloaded = engine(True)
        on, on_ends = _run("offload on", offloaded, workload, on_round)
    connector = built[-1]
    on_result = _result(
        True,
        offloaded,
        on,
        on_ends,
        cfg.rounds,
        connector.scheduler.stats(),
        connector.worker.copy_throughput(),
        measured=_copies_measured(connector),
    )
    backend = connector.worker.backend.name
    offloaded.shutdown()
    del offloaded
    _settle(cfg.device)
    if exact:
        same = sum(off.outputs()[k] == v for k, v in on.outputs().items())
        check = CorrectnessCheck(
            kind="tokens",
            reference="offload off",
            tokens_identical=same == len(on.records),
            requests=len(on.records),
            requests_identical=same,
            max_rel_logits_err=None,
            tolerance=None,
            passed=same == len(on.records),
        )
    else:
        check = _check_against_reference(
            cfg, workload, model_cfg, engine_cfg, model, on, clock, on_round
        )
    device = torch.cuda.get_device_name() if cfg.device.startswith("cuda") else "cpu"
    return BenchResult(
        config=cfg,
        runs=(off_result, on_result),
        outputs_identical=check.tokens_identical,
        check=check,
        backend=backend,
        device=device,
        model=cfg.model,
        num_gpu_blocks=num_blocks,
        cpu_bytes=cpu_bytes,
    )


__all__ = [
    "LOGITS_TOLERANCE",
    "PHASES",
    "REFERENCE_RUN",
    "BenchConfig",
    "BenchResult",
    "CorrectnessCheck",
    "RunResult",
    "block_bytes_per_group",
    "check_outputs",
    "compare_to_reference",
    "gpu_blocks_for",
    "offload_engine",
    "run_bench",
    "workload_of",
]
