"""One decode step of the reference engine: eager or from CUDA graphs (``decode_graphs``), decode
attention by torch (gather + SDPA) or by the Triton paged kernel (``triton_decode``).

For each (rows, context) shape: ``rows`` requests with distinct ``context``-token prompts are
prefilled untimed, then every ``engine.step()`` of pure decode is timed on the host clock (a step
ends when its tokens are read back, so this is the step's full latency; in ``graphs-ahead``, with
``async_scheduling``, the call returns the tokens of the step before, so this is the period of
the pipeline, what a user's token rate sees). Prints a table, and
``--json`` writes the figures. ``--offload`` runs every mode a second time with kvflow's offload
connector (its defaults: eager stores, the inline worker loop, the CUDA backend on a GPU), so the
step's connector calls and the stores of the blocks it completes are in the timed step.

    PYTHONPATH=src python scripts/bench_decode_step.py --model llama-1b --device cuda
    PYTHONPATH=src python scripts/bench_decode_step.py --model llama-1b --device cuda \
        --modes graphs --offload --shapes 1x1024,2x6400,8x2048
    PYTHONPATH=src python scripts/bench_decode_step.py --model tiny --device cpu \
        --modes eager-torch pieces-torch
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.bench.multi_round import offload_engine
from kvflow.connector.config import OffloadConfig
from kvflow.engine.engine import (
    Engine,
    EngineConfig,
    block_bytes_per_group,
    make_kv_cache_config,
)
from kvflow.engine.model import LlamaForCausalLM, ModelConfig, build_model, model_config
from kvflow.runtime.clock import SystemClock

SHAPES = ((1, 1024), (2, 6400), (8, 2048), (32, 1024), (1, 16384))

MODES = {
    # name: (EngineConfig.decode_graphs, EngineConfig.triton_decode, .async_scheduling)
    "eager-torch": ("off", False, False),
    "eager": ("off", True, False),
    "pieces-torch": ("pieces", False, False),
    "graphs-torch": ("auto", False, False),
    "piecewise": ("piecewise", True, False),
    "graphs": ("auto", True, False),  # "full" where Triton serves the attention
    # Each step scheduled and launched before the last one's tokens are read: a step's time
    # is then the pipeline's period, not one step's latency.
    "graphs-ahead": ("auto", True, True),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(MODES),
        default=["eager-torch", "piecewise", "graphs"],
        help="eager-torch is the engine without either change",
    )
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per shape")
    p.add_argument("--warm", type=int, default=5, help="untimed decode steps first")
    p.add_argument("--shapes", default=None, help="ROWSxCONTEXT,... (default: a fixed set)")
    p.add_argument(
        "--offload",
        action="store_true",
        help="also run each mode with kvflow's offload connector (column MODE+offload)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of --steps per shape and run, alternating which runs first (pooled)",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print the device kernels of 5 steps of each shape (torch.profiler), last mode",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warm < 0:
        p.error("--rounds and --steps must be positive, --warm not negative")
    return args


def shapes_of(text: str | None) -> list[tuple[int, int]]:
    if text is None:
        return list(SHAPES)
    return [(int(r), int(c)) for r, c in (s.split("x") for s in text.split(","))]


def step_times(
    engine: Engine, rows: int, context: int, warm: int, steps: int, profile: bool = False
) -> list[float]:
    """Seconds of each timed decode step of ``rows`` requests at about ``context`` tokens."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(rows * 100_003 + context)
    ids = [
        engine.add_request(
            torch.randint(0, vocab, (context,), generator=gen).tolist(), warm + steps + 2
        )
        for _ in range(rows)
    ]
    reqs = engine.scheduler.requests
    while any(reqs[i].num_computed_tokens < reqs[i].num_prompt_tokens for i in ids):
        engine.step()
    for _ in range(warm):
        engine.step()
    if profile:
        kernel_table(engine, f"{rows} × {context}")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.take_result(i)
    return times


def kernel_table(engine: Engine, title: str, steps: int = 5) -> None:
    """The device kernels of ``steps`` engine steps, by total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
    print(f"-- kernels of {steps} steps, {title}")
    print(
        prof.key_averages().table(
            sort_by="device_time_total", row_limit=18, max_name_column_width=60
        )
    )


def make_engine(
    cfg: ModelConfig, econf: EngineConfig, model: LlamaForCausalLM, offload: bool
) -> Engine:
    """The engine of one run: bare, or with kvflow's offload connector at its defaults (a CPU
    tier of 2 GiB, more than any shape here stores)."""
    if not offload:
        return Engine(cfg, econf, model=model)
    kv = make_kv_cache_config(cfg, econf)
    dtype = next(model.parameters()).dtype
    engine, _conn = offload_engine(
        cfg,
        econf,
        model,
        OffloadConfig(cpu_bytes="2GiB"),
        block_bytes_per_group(cfg, kv, dtype),
        now=SystemClock().now,
    )
    return engine


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    shapes = shapes_of(args.shapes)
    if args.device == "cpu":
        # Two-thread parallel regions on a shared two-core box wait for descheduled threads.
        torch.set_num_threads(1)
    cfg = model_config(args.model)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    model = build_model(
        cfg, device=args.device, dtype=None if args.dtype is None else dtypes[args.dtype]
    )
    block = 16
    blocks = max(r * (c + args.warm + args.steps + 2 + block) // block for r, c in shapes) + 2
    results: dict[str, dict[str, list[float]]] = {}
    runs = [(m, o) for m in args.modes for o in ((False, True) if args.offload else (False,))]
    names = [f"{m}+offload" if o else m for m, o in runs]
    rounds = args.rounds
    with Progress(transient=True) as progress:
        task = progress.add_task("decode steps", total=len(runs) * len(shapes) * rounds)
        for mode in args.modes:
            econf = EngineConfig(
                block_size=block,
                num_gpu_blocks=blocks,
                max_num_batched_tokens=8192,
                max_num_seqs=max(r for r, _ in shapes),
                device=args.device,
                dtype=args.dtype,
                decode_graphs=MODES[mode][0],
                triton_decode=MODES[mode][1],
                async_scheduling=MODES[mode][2],
                enable_prefix_caching=False,
            )
            # The mode bare and, with --offload, with the connector: both built up front, so
            # that their rounds interleave (a machine's drift, clocks and neighbours, then
            # falls on both alike).
            engines = {
                name: make_engine(cfg, econf, model, offload)
                for (m, offload), name in zip(runs, names, strict=True)
                if m == mode
            }
            for engine in engines.values():
                # First use of each kernel and shape (module loading, cuBLAS's choice) untimed.
                step_times(engine, *shapes[0], args.warm, args.steps)
            for rows, context in shapes:
                key = f"{rows}x{context}"
                for r in range(rounds):
                    order = list(engines.items())
                    for name, engine in order if r % 2 == 0 else order[::-1]:
                        results.setdefault(key, {}).setdefault(name, []).extend(
                            step_times(
                                engine,
                                rows,
                                context,
                                args.warm,
                                args.steps,
                                profile=args.profile and name == names[-1] and r == 0,
                            )
                        )
                        progress.advance(task)
            for engine in engines.values():
                engine.shutdown()
    table = Table(title=f"decode step, {args.model} on {args.device}: median (mean) ms")
    table.add_column("rows × context")
    for name in names:
        table.add_column(name, justify="right")
    bare = args.modes
    for mode in bare[1:]:
        table.add_column(f"{bare[0]} / {mode}", justify="right")
    if args.offload:
        for mode in bare:
            table.add_column(f"{mode}: offload adds", justify="right")
    summary: dict[str, dict[str, float]] = {}
    for key, by_mode in results.items():
        med = {m: statistics.median(t) * 1e3 for m, t in by_mode.items()}
        mean = {m: statistics.fmean(t) * 1e3 for m, t in by_mode.items()}
        summary[key] = {f"{m}_median_ms": med[m] for m in med} | {
            f"{m}_mean_ms": mean[m] for m in mean
        }
        cells = [f"{med[m]:.2f} ({mean[m]:.2f})" for m in names]
        cells += [f"{med[bare[0]] / med[m]:.2f}×" for m in bare[1:]]
        if args.offload:
            cells += [f"{med[f'{m}+offload'] / med[m] - 1:+.1%}" for m in bare]
        table.add_row(key.replace("x", " × "), *cells)
    Console(width=160).print(table)
    if args.json is not None:
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "device": device,
                    "dtype": args.dtype,
                    "offload": args.offload,
                    "shapes": summary,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
