"""Benchmark the reference engine alone (no offload) on the multi-round QA workload.

Runs the same workload with GPU prefix caching off and on, checks the greedy outputs agree, and
prints a table (wall time, computed tokens/s, TTFT p50/p90, prefill tokens computed, prefix-cache
hits, preemptions) and TTFT p50 per round. Figures go into docs/benchmarks.md (## engine).

    PYTHONPATH=src python scripts/bench_engine.py                       # tiny model on CPU
    PYTHONPATH=src python scripts/bench_engine.py --model llama-1b --device cuda --users 16 \
        --system 1024 --first-question 512 --question 64 --answer 32 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from kvflow.bench.config import BenchConfig
from kvflow.bench.multi_round import gpu_blocks_for, workload_of
from kvflow.engine.engine import Engine, EngineConfig, make_kv_cache_config
from kvflow.engine.model import build_model, model_config
from kvflow.engine.workload import RoundRecord, WorkloadResult, run_multi_round


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="preset: tiny, small, llama-1b, or NAME-swaW")
    p.add_argument("--device", default="cpu")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system", type=int, default=256, help="system prompt tokens")
    p.add_argument("--first-question", type=int, default=128)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.5,
        help="GPU blocks as a fraction of the workload's working set",
    )
    p.add_argument("--budget", type=int, default=2048, help="max tokens per step")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON")
    return p.parse_args(argv)


_HEADERS = {
    "run": "run",
    "wall_s": "wall s",
    "tokens_per_s": "tok/s",
    "ttft_p50_s": "TTFT p50 s",
    "ttft_p90_s": "TTFT p90 s",
    "prefill_tokens_computed": "prefill computed",
    "gpu_cached_tokens": "GPU hits",
    "preemptions": "preempt",
    "steps": "steps",
}


def _row(name: str, engine: Engine, result: WorkloadResult) -> dict[str, float | int | str]:
    wall = result.wall_s
    return {
        "run": name,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(engine.stats.tokens_computed / wall, 1),
        "ttft_p50_s": round(result.ttft_percentile(50), 4),
        "ttft_p90_s": round(result.ttft_percentile(90), 4),
        "prefill_tokens_computed": result.total("prefill_tokens_computed"),
        "gpu_cached_tokens": result.total("gpu_cached_tokens"),
        "preemptions": engine.stats.preemptions,
        "steps": engine.stats.steps,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(args.threads)
    console = Console()
    cfg = model_config(args.model)
    bench = BenchConfig(
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
        seed=args.seed,
    )
    workload = workload_of(bench, cfg)
    working_blocks = -(-workload.working_set_tokens // args.block_size)
    groups = len(make_kv_cache_config(cfg, EngineConfig(block_size=args.block_size)).groups)
    num_blocks = gpu_blocks_for(bench, workload, groups)
    model = build_model(cfg, device=args.device, seed=args.seed)
    rows: list[dict[str, float | int | str]] = []
    per_round: dict[str, list[float]] = {}
    outputs = []
    with Progress(console=console, transient=True) as progress:
        for name, caching in (("prefix cache off", False), ("prefix cache on", True)):
            engine = Engine(
                cfg,
                EngineConfig(
                    block_size=args.block_size,
                    num_gpu_blocks=num_blocks,
                    max_num_batched_tokens=args.budget,
                    enable_prefix_caching=caching,
                    device=args.device,
                ),
                model=model,
            )
            task = progress.add_task(name, total=args.rounds)

            def advance(_round: int, _records: Sequence[RoundRecord], task: TaskID = task) -> None:
                progress.advance(task)

            result = run_multi_round(engine, workload, on_round_done=advance)
            rows.append(_row(name, engine, result))
            per_round[name] = [result.ttft_percentile(50, r) for r in range(args.rounds)]
            outputs.append(result.outputs())
    identical = outputs[0] == outputs[1]

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    title = (
        f"{cfg.name} on {device}: {args.users} users x {args.rounds} rounds, working set "
        f"{working_blocks} blocks of {args.block_size}, GPU cache {num_blocks - 1} blocks"
    )
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(_HEADERS[key], justify="left" if key == "run" else "right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    rounds = Table(title="TTFT p50 per round (s)")
    rounds.add_column("run")
    for r in range(args.rounds):
        rounds.add_column(f"round {r}", justify="right")
    for name, values in per_round.items():
        rounds.add_row(name, *(f"{v:.4f}" for v in values))
    console.print(rounds)
    console.print(f"greedy outputs identical: {identical}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"model": cfg.name, "device": device, "outputs_identical": identical, "runs": rows},
                indent=2,
            )
        )
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
