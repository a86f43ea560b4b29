"""``kvflow bench``: the main job. Multi-round QA with offload off and on, as a table (and plot)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from kvflow.bench.multi_round import BenchResult

from kvflow.bench.config import BenchConfig
from kvflow.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument("--model", default=d.model, help="tiny, small, llama-1b (suffix -swaN: hybrid)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (uses the CUDA backend)")
    p.add_argument("--users", type=int, default=d.users)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--system", type=int, default=d.system_prompt, help="system prompt tokens")
    p.add_argument("--first-question", type=int, default=d.first_question)
    p.add_argument("--question", type=int, default=d.question)
    p.add_argument("--answer", type=int, default=d.answer)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=d.cache_fraction,
        help="GPU cache size as a fraction of the working set",
    )
    p.add_argument(
        "--cpu-bytes", default=None, help="CPU tier size, e.g. 2GiB (default: 2x working set)"
    )
    p.add_argument("--store-policy", choices=("eager", "lazy"), default=d.store_policy)
    p.add_argument("--backend", choices=("auto", "host", "cuda"), default=d.backend)
    p.add_argument(
        "--worker-loop",
        choices=("thread", "inline"),
        default=d.worker_loop,
        help="the worker runtime's event loop on a thread of its own, or on the engine's thread",
    )
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--warmup",
        choices=("round", "full"),
        default=d.warmup,
        help="untimed warm-up: both runs once (default, fair), or one round (faster)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model and KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads, the same for both runs (default on CPU: one core fewer than the "
        "machine has, left to the copy and event-loop threads; on CUDA: torch's default)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write TTFT per round as a PNG")
    p.add_argument("--trace", type=Path, default=None, help="write every log event as JSON lines")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from kvflow.connector.config import OffloadConfig

    cpu_bytes = None
    if args.cpu_bytes is not None:
        cpu_bytes = OffloadConfig(cpu_bytes=args.cpu_bytes).cpu_bytes
    return BenchConfig(
        model=args.model,
        device=args.device,
        users=args.users,
        rounds=args.rounds,
        system_prompt=args.system,
        first_question=args.first_question,
        question=args.question,
        answer=args.answer,
        block_size=args.block_size,
        cache_fraction=args.cache_fraction,
        cpu_bytes=cpu_bytes,
        store_policy=args.store_policy,
        backend=args.backend,
        worker_loop=args.worker_loop,
        max_batched_tokens=args.max_batched_tokens,
        seed=args.seed,
        dtype=args.dtype,
        warmup=args.warmup,
    )


def render(result: BenchResult, console: Console) -> None:
    off, on = result.runs
    table = Table(
        title=(
            f"kvflow bench: {result.model} on {result.device}, backend {result.backend}, "
            f"{result.config.users} users × {result.config.rounds} rounds"
        )
    )
    table.add_column("measure")
    table.add_column("offload off", justify="right")
    table.add_column("offload on", justify="right")
    table.add_column("on / off", justify="right")

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}×" if a else "—"

    rows: list[tuple[str, float, float, str]] = [
        ("TTFT p50 (ms)", off.ttft_p50_s * 1e3, on.ttft_p50_s * 1e3, ".2f"),
        ("TTFT p90 (ms)", off.ttft_p90_s * 1e3, on.ttft_p90_s * 1e3, ".2f"),
        (
            "prefill tokens computed",
            off.prefill_tokens_computed,
            on.prefill_tokens_computed,
            ",.0f",
        ),
        (
            "prefill tokens loaded from CPU",
            off.prefill_tokens_loaded,
            on.prefill_tokens_loaded,
            ",.0f",
        ),
        (
            "prefill tokens from GPU prefix cache",
            off.gpu_cached_tokens,
            on.gpu_cached_tokens,
            ",.0f",
        ),
        ("CPU hit rate (loaded / (loaded + computed))", off.cpu_hit_rate, on.cpu_hit_rate, ".1%"),
        ("store GB/s (copy submitted → seen done)", off.store_gbps, on.store_gbps, ".2f"),
        ("load GB/s (copy submitted → seen done)", off.load_gbps, on.load_gbps, ".2f"),
        ("blocks stored / loaded", off.blocks_stored, on.blocks_stored, ",.0f"),
        ("preemptions", off.preemptions, on.preemptions, ",.0f"),
        ("wall time (s)", off.wall_s, on.wall_s, ".2f"),
    ]
    for label, a, b, fmt in rows:
        if label == "blocks stored / loaded":
            table.add_row(label, "—", f"{on.blocks_stored:,} / {on.blocks_loaded:,}", "")
            continue
        shown_ratio = (
            ratio(a, b) if label.startswith(("TTFT", "prefill tokens computed", "wall")) else ""
        )
        table.add_row(label, format(a, fmt), format(b, fmt), shown_ratio)
    console.print(table)
    if result.config.worker_loop == "inline":
        # A busy engine calls the connector once a step: a store is seen done a step after its
        # copy ended, so its figure is a floor, not the copy engine's speed.
        console.print(
            "worker loop inline: a copy is seen done at the engine's next connector call; "
            "the GB/s figures are lower bounds (docs/benchmarks.md)"
        )
    verdict = "[green]identical[/]" if result.outputs_identical else "[red]DIFFERENT[/]"
    console.print(f"greedy outputs, offload off vs on: {verdict}")
    per_round = Table(title="TTFT p50 per round (ms)")
    per_round.add_column("round", justify="right")
    per_round.add_column("offload off", justify="right")
    per_round.add_column("offload on", justify="right")
    for r, (a, b) in enumerate(zip(off.ttft_p50_per_round_s, on.ttft_p50_per_round_s, strict=True)):
        per_round.add_row(str(r), f"{a * 1e3:.2f}", f"{b * 1e3:.2f}")
    console.print(per_round)


def plot(result: BenchResult, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # matplotlib is the optional "plot" extra
        raise ConfigError("--plot needs matplotlib: pip install 'kvflow[plot]'") from exc
    off, on = result.runs
    rounds = list(range(len(off.ttft_p50_per_round_s)))
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(rounds, [t * 1e3 for t in off.ttft_p50_per_round_s], "o-", label="offload off")
    ax.plot(rounds, [t * 1e3 for t in on.ttft_p50_per_round_s], "s-", label="offload on (kvflow)")
    ax.set_xlabel("round")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_xticks(rounds)
    ax.set_title(f"{result.model} on {result.device}: TTFT per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_bench_command(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    # The engine thread and kvflow's copy/loop threads share the GIL; at the default 5 ms
    # switch interval a busy engine thread holds the copy threads off for whole milliseconds.
    sys.setswitchinterval(5e-4)
    threads = args.threads
    if threads is None and args.device == "cpu":
        # On CPU the host backend's copy thread and the runtime's loop need a core: with torch's
        # intra-op threads on every core, each parallel region waits for a thread the copies
        # preempted (dev box, 2 cores: TTFT p50 59 → 110 ms with offload on; with 1 torch
        # thread 83 → 63 ms).
        threads = max(1, (os.cpu_count() or 1) - 1)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if args.trace is None:
        # The library never configures logging; the command quiets debug events it would print.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvflow.bench.multi_round import run_bench

    cfg = config_from_args(args)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("round {task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        tasks = {
            name: progress.add_task(name, total=cfg.rounds)
            for name in ("offload off", "offload on")
        }
        result = run_bench(
            cfg, on_round=lambda name, _r: progress.advance(tasks[name]), trace=args.trace
        )
    render(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    if args.trace is not None:
        console.print(f"wrote {args.trace} (summarize with: kvflow trace {args.trace})")
    return 0 if result.outputs_identical else 1


__all__ = ["add_arguments", "config_from_args", "plot", "render", "run_bench_command"]
