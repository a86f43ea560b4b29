"""Benchmark what the CPU tier buys the reference engine, beyond the multi-round ``kvflow bench``.

Two scenarios, each run with offload off and on in one process, on one model:

- ``reload``: one long context (default 16k tokens). Its prefill is computed once; then the GPU
  prefix cache is dropped and the same prompt comes back: with offload on, its KV is loaded from
  the CPU tier instead of recomputed. Goal (issue 6): reload ≥ 5× faster than recompute.
- ``noreuse``: every prompt unique (0 % reuse): offload only stores, never loads. Goal: offload on
  costs ≤ 1 % in wall time and TTFT (issue 25). ``--calls`` adds each public connector method's
  time on the engine thread; ``--null-copies`` runs offload on a backend whose copies finish at
  once, so that what is left is kvflow's own host work, measurable on any machine.

    PYTHONPATH=src python scripts/bench_engine_offload.py --model llama-1b --device cuda
    PYTHONPATH=src python scripts/bench_engine_offload.py --model tiny --context 2048   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.backends.cuda.config import CudaConfig
from kvflow.backends.select import make_backend
from kvflow.bench.multi_round import block_bytes_per_group, offload_engine
from kvflow.cli.bench_report import STEP_PART_LABELS
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.core.transfer import Direction
from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest, make_kv_cache_config
from kvflow.engine.model import LlamaForCausalLM, ModelConfig, build_model, model_config
from kvflow.engine.step_parts import summarize
from kvflow.runtime.clock import SystemClock
from kvflow.tracing import trace_to

try:  # imported as part of the scripts package (tests), or run as a file
    from scripts.connector_rig import NullCopies
except ImportError:
    from connector_rig import NullCopies  # type: ignore[import-not-found,no-redef]


def store_options(args: argparse.Namespace) -> dict[str, Any]:
    """The CUDA backend's store and gather options this run asks for, the backend's defaults
    elsewhere."""
    default = CudaConfig()
    return {
        "store_dma": default.store_dma if args.store is None else args.store == "dma",
        "store_dma_min_run": (
            default.store_dma_min_run if args.store_min_run is None else args.store_min_run
        ),
        "pitched_batch": args.pitched_batch,
        "gather_ctas": default.gather_ctas if args.gather_ctas is None else args.gather_ctas,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=16384, help="reload: prompt tokens")
    p.add_argument("--reloads", type=int, default=5, help="reload: recomputes and reloads timed")
    p.add_argument("--requests", type=int, default=64, help="noreuse: requests per run")
    p.add_argument("--prompt", type=int, default=1024, help="noreuse: prompt tokens")
    p.add_argument("--answer", type=int, default=32, help="noreuse: output tokens")
    p.add_argument("--repeat", type=int, default=3, help="noreuse: runs of each, alternating")
    p.add_argument("--budget", type=int, default=4096, help="max tokens per step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cpu-bytes", default="4GiB")
    p.add_argument("--store-policy", choices=("eager", "lazy"), default="eager")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model and KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--worker-loop", choices=("thread", "inline"), default="inline")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine schedules each step before reading the tokens of the one in flight",
    )
    p.add_argument("--scenario", choices=("reload", "noreuse", "both"), default="both")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--step-parts",
        action="store_true",
        help="noreuse: where each kind of engine step's time goes, off and on (means per run)",
    )
    p.add_argument(
        "--trace", type=Path, default=None, help="reload: JSON-lines trace of the reload"
    )
    p.add_argument(
        "--calls",
        action="store_true",
        help="noreuse: each public connector method's time on the engine thread, offload on",
    )
    p.add_argument(
        "--null-copies",
        action="store_true",
        help="offload on a backend whose copies finish at once and move nothing (no loads are "
        "checked: 0 %% reuse only): kvflow's own host work, on any machine",
    )
    p.add_argument(
        "--store",
        choices=("staged", "dma"),
        help="CUDA: stores through the staging ring's gather kernel, or as 2D copies straight "
        "from the KV cache (CudaConfig.store_dma); default: the backend's default",
    )
    p.add_argument(
        "--store-min-run",
        type=int,
        help="CUDA, with --store dma: the fewest blocks a store's runs may average and still go "
        "as 2D copies (CudaConfig.store_dma_min_run)",
    )
    p.add_argument(
        "--pitched-batch",
        action="store_true",
        help="CUDA: a call's 2D copies in one cuMemcpy3DBatchAsync (CudaConfig.pitched_batch)",
    )
    p.add_argument(
        "--gather-ctas",
        type=int,
        help="CUDA: CTAs of one staged gather or scatter launch (CudaConfig.gather_ctas)",
    )
    return p.parse_args(argv)


class Bench:
    """Builds engines on one shared model, with or without kvflow's connector."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cfg: ModelConfig = model_config(args.model)
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        self.model: LlamaForCausalLM = build_model(
            self.cfg,
            device=args.device,
            seed=0,
            dtype=None if args.dtype is None else dtypes[args.dtype],
        )
        self.dtype = next(self.model.parameters()).dtype
        self.clock = SystemClock()
        self.connectors: list[OffloadConnector] = []

    def engine(self, num_blocks: int, offload: bool) -> Engine:
        args = self.args
        econf = EngineConfig(
            block_size=args.block_size,
            num_gpu_blocks=num_blocks,
            max_num_batched_tokens=args.budget,
            max_num_seqs=256,
            device=args.device,
            dtype=args.dtype,
            record_step_parts=args.step_parts,
            async_scheduling=args.async_scheduling,
        )
        if not offload:
            return Engine(self.cfg, econf, model=self.model, clock=self.clock.now)
        kv = make_kv_cache_config(self.cfg, econf)
        engine, conn = offload_engine(
            self.cfg,
            econf,
            self.model,
            OffloadConfig(
                cpu_bytes=args.cpu_bytes,
                store_policy=args.store_policy,
                worker_loop=args.worker_loop,
            ),
            block_bytes_per_group(self.cfg, kv, self.dtype),
            now=self.clock.now,
            backend=self.backend(),
        )
        self.connectors.append(conn)
        return engine

    def backend(self) -> Any:
        """The offload engine's backend: the null one, the CUDA one with this run's store and
        gather options, or None (the connector's default for the device)."""
        args = self.args
        if args.null_copies:
            return NullCopies()
        if (
            args.store is None
            and not args.pitched_batch
            and args.store_min_run is None
            and args.gather_ctas is None
        ):
            return None
        return make_backend(
            "cuda",
            args.device,
            inline=args.worker_loop == "inline",
            cuda_options=store_options(args),
        )

    def prompt(self, n: int, seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, min(self.cfg.vocab_size, 32000), (n,), generator=gen).tolist()


def reload_scenario(b: Bench, progress: Progress) -> dict[str, Any]:
    args = b.args
    blocks = 2 * (args.context // args.block_size + 2) + 1
    n = args.reloads
    task = progress.add_task("reload: long context", total=2 * n + 2)
    prompt = b.prompt(args.context, seed=1)

    def ttft(engine: Engine, rid: str) -> tuple[float, int, int]:
        (r,) = engine.run_to_completion([GenerationRequest(prompt, 1, request_id=rid)])
        return r.ttft_s, r.prefill_tokens_computed, r.external_loaded_tokens

    off = b.engine(blocks, offload=False)
    # Warm up with a prompt as long as the measured one: the first long prefill pays one-time
    # costs (allocator growth, kernel selection for new shapes) that are not recompute.
    # Two tokens: the decode step at full context is a shape of its own.
    off.run_to_completion([GenerationRequest(b.prompt(args.context, seed=3), 2)])
    recomputes: list[float] = []
    computed_off = 0
    for i in range(n):
        assert off.scheduler.reset_prefix_cache(), "GPU prefix cache still in use"
        t, computed_off, _ = ttft(off, f"off{i}")
        recomputes.append(t)
        progress.advance(task)
    off.shutdown()
    on = b.engine(blocks, offload=True)
    on.run_to_completion([GenerationRequest(b.prompt(args.context, seed=4), 2)])
    compute_on, _, _ = ttft(on, "first")
    progress.advance(task)
    conn = b.connectors[-1]

    def settle(engine: Engine) -> None:
        """Step until every transfer landed, so the GPU copy can be dropped."""
        for _ in range(100_000):
            if not engine.has_unfinished() and conn.scheduler.manager.num_live_transfers() == 0:
                return
            engine.step()

    before = conn.worker.copy_throughput()[Direction.LOAD]
    reloads: list[float] = []
    computed = loaded = 0
    for i in range(n):
        settle(on)
        assert on.scheduler.reset_prefix_cache(), "GPU prefix cache still in use"
        if i == 0 and args.trace is not None:
            with trace_to(args.trace, b.clock.now):
                t, computed, loaded = ttft(on, "again0")
        else:
            t, computed, loaded = ttft(on, f"again{i}")
        reloads.append(t)
        progress.advance(task)
    after = conn.worker.copy_throughput()[Direction.LOAD]
    latency = conn.scheduler.stats().load_latency
    on.shutdown()
    progress.advance(task)
    recompute = statistics.median(recomputes)
    reload = statistics.median(reloads)
    return {
        "context_tokens": args.context,
        "repeats": n,
        "recompute_ttft_s": recompute,
        "recompute_ttft_all_s": recomputes,
        "first_prefill_with_offload_ttft_s": compute_on,
        "reload_ttft_s": reload,
        "reload_ttft_all_s": reloads,
        "first_reload_ttft_s": reloads[0],
        "reload_tokens_loaded": loaded,
        "reload_tokens_computed": computed,
        "recompute_tokens": computed_off,
        "speedup": recompute / reload,
        "first_reload_speedup": recompute / reloads[0],
        "load_bytes_per_reload": (after[0] - before[0]) / n,
        "load_copy_in_flight_s": (after[1] - before[1]) / n,
        "load_launch_to_commit_s": latency[1],
    }


def time_connector_calls(
    engine: Engine, per_call: dict[str, list[float]] | None = None
) -> list[float]:
    """Wrap every public method of the engine's connector (both roles; one object serving both
    is wrapped once) so its wall time adds up in the returned ``[seconds]``: what the connector
    costs the engine's thread (the copy threads' time is not in it). The null connector of an
    offload-off engine is timed the same way, so both modes pay the same wrapper cost. A
    connector method that calls another public one (``update_connector_output`` calls
    ``update_from_reports``) counts once: only the outermost call adds its time, also to
    ``per_call[name]`` (``[calls, seconds]``) when given."""
    spent = [0.0]
    depth = [0]

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    dt = time.perf_counter() - t0
                    spent[0] += dt
                    if per_call is not None:
                        figures = per_call.setdefault(name, [0.0, 0.0])
                        figures[0] += 1
                        figures[1] += dt

        return call

    roles = {id(r): r for r in (engine.scheduler_connector, engine.worker_connector)}
    for role in roles.values():
        for name in dir(role):
            fn = None if name.startswith("_") else getattr(role, name)
            if callable(fn):
                setattr(role, name, timed(name, fn))
    return spent


def settle_device(device: str) -> None:
    """Free a finished engine now, untimed: its reference cycles would otherwise be collected
    during a later timed run, and freeing its device memory (KV cache, graph pools) waits for the
    whole device."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def quartiles(values: Sequence[float]) -> list[float]:
    """First and third quartile (both the value itself for a single value)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def noreuse_scenario(b: Bench, progress: Progress) -> dict[str, Any]:
    args = b.args
    per_req = -(-(args.prompt + args.answer) // args.block_size)
    blocks = per_req * min(args.requests, 64) + 1
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    hooks: dict[bool, list[float]] = {False: [], True: []}  # connector calls, s per run
    # Every request's TTFT of every run, per mode: the p50 of 64 simultaneous requests moves by
    # whole prefill steps when batch boundaries shift, so the pooled figure is the steadier one.
    pooled: dict[bool, list[float]] = {False: [], True: []}
    parts: dict[bool, list[dict[str, dict[str, float]]]] = {False: [], True: []}
    on_calls: dict[str, list[float]] = {}  # per public connector method: [calls, seconds]
    task = progress.add_task("noreuse: unique prompts", total=2 * args.repeat + 2)
    seed = 100
    # One untimed run in each mode at full size first: the first runs of a process pay one-time
    # costs (allocator and cache growth, first use of each kernel shape and of kvflow's code
    # paths) that are not what offload costs a serving engine in steady state.
    for offload in (False, True):
        warm = b.engine(blocks, offload=offload)
        warm.run_to_completion(
            [
                GenerationRequest(b.prompt(args.prompt, 99 - i), args.answer)
                for i in range(args.requests)
            ]
        )
        warm.shutdown()
        del warm
        settle_device(args.device)
        progress.advance(task)
    for i in range(args.repeat):
        # Alternate which mode runs first, so neither always inherits the other's leftovers.
        for offload in (False, True) if i % 2 == 0 else (True, False):
            engine = b.engine(blocks, offload=offload)
            spent = time_connector_calls(engine, on_calls if offload else None)
            reqs = [
                GenerationRequest(b.prompt(args.prompt, seed + i), args.answer)
                for i in range(args.requests)
            ]
            seed += args.requests  # never the same prompt twice, in any run
            t0 = b.clock.now()
            results = engine.run_to_completion(reqs)
            wall = b.clock.now() - t0
            assert all(r.external_loaded_tokens == 0 for r in results)
            runs[offload].append((wall, statistics.median(r.ttft_s for r in results)))
            hooks[offload].append(spent[0])
            pooled[offload].extend(r.ttft_s for r in results)
            parts[offload].append(summarize(engine.step_parts, [(t0, t0 + wall)]))
            engine.shutdown()
            del engine
            settle_device(args.device)
            progress.advance(task)
    off_wall = statistics.median(w for w, _ in runs[False])
    on_wall = statistics.median(w for w, _ in runs[True])
    off_ttft = statistics.median(t for _, t in runs[False])
    on_ttft = statistics.median(t for _, t in runs[True])
    stats = b.connectors[-1].scheduler.stats().manager
    paired_wall = [on[0] / off[0] - 1 for off, on in zip(runs[False], runs[True], strict=True)]
    paired_ttft = [on[1] / off[1] - 1 for off, on in zip(runs[False], runs[True], strict=True)]
    return {
        "requests": args.requests,
        "prompt_tokens": args.prompt,
        "off_wall_s": off_wall,
        "on_wall_s": on_wall,
        "wall_overhead": on_wall / off_wall - 1,
        "off_ttft_p50_s": off_ttft,
        "on_ttft_p50_s": on_ttft,
        "ttft_overhead": on_ttft / off_ttft - 1,
        "off_ttft_pooled_p50_s": statistics.median(pooled[False]),
        "on_ttft_pooled_p50_s": statistics.median(pooled[True]),
        "ttft_pooled_overhead": statistics.median(pooled[True]) / statistics.median(pooled[False])
        - 1,
        "off_ttft_mean_s": statistics.fmean(pooled[False]),
        "on_ttft_mean_s": statistics.fmean(pooled[True]),
        # Each repeat's on/off pair ran back to back: their ratio cancels drift between repeats.
        "wall_overhead_paired_median": statistics.median(paired_wall),
        "wall_overhead_paired_iqr": quartiles(paired_wall),
        # The host's own spread over runs that are alike: a paired figure smaller than this is
        # not resolved on this host.
        "off_wall_spread": (max(w for w, _ in runs[False]) - min(w for w, _ in runs[False]))
        / off_wall,
        "ttft_overhead_paired_median": statistics.median(paired_ttft),
        "ttft_overhead_paired_iqr": quartiles(paired_ttft),
        # The connector's calls on the engine's thread: a floor of what offload costs there.
        "off_connector_calls_s": statistics.median(hooks[False]),
        "on_connector_calls_s": statistics.median(hooks[True]),
        "connector_calls_share": statistics.median(
            (on_h - off_h) / off[0]
            for on_h, off_h, off in zip(hooks[True], hooks[False], runs[False], strict=True)
        ),
        "runs_off": [
            {"wall_s": w, "ttft_p50_s": t, "connector_calls_s": c}
            for (w, t), c in zip(runs[False], hooks[False], strict=True)
        ],
        "runs_on": [
            {"wall_s": w, "ttft_p50_s": t, "connector_calls_s": c}
            for (w, t), c in zip(runs[True], hooks[True], strict=True)
        ],
        "blocks_stored_last_run": stats.blocks_stored,
        "step_parts": {"off": mean_parts(parts[False]), "on": mean_parts(parts[True])},
        "null_copies": args.null_copies,
        **store_options(args),
        # Per public method of the connector, offload on: calls and ms per run, µs per call.
        "on_calls": {
            name: {
                "calls_per_run": n / args.repeat,
                "ms_per_run": sec * 1e3 / args.repeat,
                "us_per_call": sec * 1e6 / n,
            }
            for name, (n, sec) in sorted(on_calls.items(), key=lambda kv: -kv[1][1])
            if name not in ("shutdown", "stats")  # the bench's own calls, after the timed span
        },
    }


def calls_table(calls: dict[str, dict[str, float]]) -> Table:
    """Each public connector method's share of the engine thread, offload on (``--calls``)."""
    table = Table(title="0 % reuse, offload on: the connector's calls on the engine thread")
    for name in ("method", "calls per run", "ms per run", "µs per call"):
        table.add_column(name, justify="left" if name == "method" else "right")
    for name, f in calls.items():
        table.add_row(
            name, f"{f['calls_per_run']:.0f}", f"{f['ms_per_run']:.2f}", f"{f['us_per_call']:.1f}"
        )
    table.add_row(
        "all",
        f"{sum(f['calls_per_run'] for f in calls.values()):.0f}",
        f"{sum(f['ms_per_run'] for f in calls.values()):.2f}",
        "",
    )
    return table


def mean_parts(runs: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per kind of step, the mean over runs of each figure (a kind a run lacks counts 0)."""
    kinds = sorted({kind for run in runs for kind in run})
    return {
        kind: {
            key: statistics.fmean(run.get(kind, {}).get(key, 0.0) for run in runs)
            for key in ("steps", *STEP_PART_LABELS)
        }
        for kind in kinds
    }


def step_parts_table(parts: dict[str, dict[str, dict[str, float]]]) -> Table:
    """Per mode and kind of step: steps and ms of each part per run (``--step-parts``)."""
    table = Table(
        box=box.SIMPLE_HEAD,  # eleven columns: no room for cell borders in 80 columns
        pad_edge=False,
        collapse_padding=True,
        title="0 % reuse: engine steps per run (means; ms but steps)",
    )
    for name in ("run", "kind", "steps", *STEP_PART_LABELS.values()):
        table.add_column(name, justify="left" if name in ("run", "kind") else "right")
    for mode in ("off", "on"):
        for kind, figures in parts[mode].items():
            table.add_row(
                mode,
                kind,
                f"{figures['steps']:.1f}",
                *(f"{figures[key]:.1f}" for key in STEP_PART_LABELS),
            )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.null_copies and args.scenario != "noreuse":
        print("bench_engine_offload: --null-copies moves no bytes: use it with --scenario noreuse")
        return 2
    for flag, value in (
        ("--store-min-run", args.store_min_run),
        ("--gather-ctas", args.gather_ctas),
    ):
        if value is not None and value <= 0:
            print(f"bench_engine_offload: {flag} must be positive")
            return 2
    for flag, on in (
        ("--store", args.store is not None),
        ("--store-min-run", args.store_min_run is not None),
        ("--pitched-batch", args.pitched_batch),
        ("--gather-ctas", args.gather_ctas is not None),
    ):
        if on and (args.null_copies or not args.device.startswith("cuda")):
            print(f"bench_engine_offload: {flag} is the CUDA backend's, without --null-copies")
            return 2
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.setswitchinterval(5e-4)  # as kvflow bench: keep the copy threads' GIL waits short
    console = Console()
    b = Bench(args)
    out: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
    }
    with Progress(console=console, transient=True) as progress:
        if args.scenario in ("reload", "both"):
            out["reload"] = reload_scenario(b, progress)
        if args.scenario in ("noreuse", "both"):
            out["noreuse"] = noreuse_scenario(b, progress)
    table = Table(title=f"offload on the reference engine: {args.model} on {out['device']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    if "reload" in out:
        r = out["reload"]
        table.add_row(
            f"recompute {r['context_tokens']:,}-token prefill, TTFT, median of {r['repeats']} (ms)",
            f"{r['recompute_ttft_s'] * 1e3:.1f}",
            "",
        )
        table.add_row(
            "reload it from CPU, TTFT, median (ms)", f"{r['reload_ttft_s'] * 1e3:.1f}", ""
        )
        table.add_row(
            "  first reload after engine start (ms)",
            f"{r['first_reload_ttft_s'] * 1e3:.1f}",
            "",
        )
        table.add_row(
            "  tokens loaded / computed on reload",
            f"{r['reload_tokens_loaded']:,} / {r['reload_tokens_computed']:,}",
            "",
        )
        table.add_row(
            "  load: MB, copy (ms, the backend's timing), launch → commit (ms)",
            f"{r['load_bytes_per_reload'] / 1e6:.0f}, {r['load_copy_in_flight_s'] * 1e3:.1f}, "
            f"{r['load_launch_to_commit_s'] * 1e3:.1f}",
            "",
        )
        table.add_row("reload speed-up over recompute", f"{r['speedup']:.1f}×", "≥ 5×")
        table.add_row("  first reload's speed-up", f"{r['first_reload_speedup']:.1f}×", "")
    if "noreuse" in out:
        n = out["noreuse"]
        nulled = ", offload's copies null" if n["null_copies"] else ""
        table.add_row(
            f"0 % reuse, {n['requests']} × {n['prompt_tokens']} tokens{nulled}: wall off / on (s)",
            f"{n['off_wall_s']:.3f} / {n['on_wall_s']:.3f}",
            "",
        )
        table.add_row("  offload overhead, wall", f"{n['wall_overhead']:+.1%}", "≤ +1 %")
        q1, q3 = n["wall_overhead_paired_iqr"]
        table.add_row(
            "  … paired runs: median (interquartile range)",
            f"{n['wall_overhead_paired_median']:+.1%} ({q1:+.1%} … {q3:+.1%})",
            "",
        )
        table.add_row(
            "  … the host's own spread: offload off, (slowest − fastest) / median",
            f"{n['off_wall_spread']:.1%}",
            "",
        )
        table.add_row(
            "  connector calls on the engine thread, off / on (ms per run)",
            f"{n['off_connector_calls_s'] * 1e3:.1f} / {n['on_connector_calls_s'] * 1e3:.1f} "
            f"({n['connector_calls_share']:+.1%} of wall)",
            "",
        )
        table.add_row(
            "  TTFT p50 off / on (ms)",
            f"{n['off_ttft_p50_s'] * 1e3:.1f} / {n['on_ttft_p50_s'] * 1e3:.1f}",
            "",
        )
        table.add_row("  offload overhead, TTFT p50", f"{n['ttft_overhead']:+.1%}", "≤ +1 %")
        q1, q3 = n["ttft_overhead_paired_iqr"]
        table.add_row(
            "  … paired runs: median (interquartile range)",
            f"{n['ttft_overhead_paired_median']:+.1%} ({q1:+.1%} … {q3:+.1%})",
            "",
        )
        table.add_row(
            "  TTFT p50 over every request of every run, off / on (ms)",
            f"{n['off_ttft_pooled_p50_s'] * 1e3:.1f} / {n['on_ttft_pooled_p50_s'] * 1e3:.1f}",
            "",
        )
        table.add_row(
            "  offload overhead, pooled TTFT p50", f"{n['ttft_pooled_overhead']:+.1%}", ""
        )
        table.add_row(
            "  TTFT mean off / on (ms)",
            f"{n['off_ttft_mean_s'] * 1e3:.1f} / {n['on_ttft_mean_s'] * 1e3:.1f}",
            "",
        )
    console.print(table)
    if args.step_parts and "noreuse" in out:
        console.print(step_parts_table(out["noreuse"]["step_parts"]))
    if args.calls and "noreuse" in out:
        console.print(calls_table(out["noreuse"]["on_calls"]))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
