"""Tensor parallelism with offload on CPU: tp=1 vs tp=2, offload off vs on, the multi-round workload.

Each run starts its ranks as processes (torch.distributed, gloo, one intra-op thread per rank) with
``kvflow.engine.distributed.launch``; rank 0 runs the engine and kvflow's manager, every rank its
own worker runtime with the host backend and its own CPU tier (its shard's block bytes). A run
first serves a one-round warm-up workload on a throw-away engine, then the measured one. Reports
per run TTFT p50/p90 and whether the greedy outputs equal the tp=1 offload-off run's, and per rank
the store/load GB/s of its copies (bytes / seconds in flight, from ``OffloadWorker.
copy_throughput()``).

    PYTHONPATH=src python scripts/bench_tp.py
    PYTHONPATH=src python scripts/bench_tp.py --model tiny --users 2 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.bench.config import BenchConfig
from kvflow.bench.multi_round import gpu_blocks_for, workload_of
from kvflow.connector.config import OffloadConfig
from kvflow.core.transfer import Direction
from kvflow.engine.distributed import launch
from kvflow.engine.engine import EngineConfig, make_kv_cache_config
from kvflow.engine.model import model_config
from kvflow.engine.tp import RankStatus, RankZeroResult, TPEngine, TPSpec, run_rank
from kvflow.engine.workload import MultiRoundQA, run_multi_round


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system", type=int, default=256, help="system prompt tokens")
    p.add_argument("--first-question", type=int, default=128)
    p.add_argument("--question", type=int, default=32)
    p.add_argument("--answer", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-fraction", type=float, default=0.4)
    p.add_argument("--budget", type=int, default=1024, help="max tokens per step")
    p.add_argument("--cpu-bytes", default="1GiB", help="CPU tier of each rank")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def _quiet() -> None:
    # Ranks print structlog's default console output; keep the table readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _warm_job(tp: TPEngine) -> None:
    run_multi_round(tp.engine, MultiRoundQA(num_users=2, num_rounds=1, seed=99))


def _measure_job(workload: MultiRoundQA, tp: TPEngine) -> dict[str, Any]:
    result = run_multi_round(tp.engine, workload)
    stats = tp.scheduler.stats().manager if tp.scheduler is not None else None
    return {
        "outputs": result.outputs(),
        "ttft_p50_s": result.ttft_percentile(50),
        "ttft_p90_s": result.ttft_percentile(90),
        "wall_s": result.wall_s,
        "prefill_tokens_computed": result.total("prefill_tokens_computed"),
        "prefill_tokens_loaded": result.total("external_loaded_tokens"),
        "blocks_stored": stats.blocks_stored if stats else 0,
        "blocks_loaded": stats.blocks_loaded if stats else 0,
    }


def bench_rank(
    rank: int, world_size: int, spec: TPSpec, workload: MultiRoundQA
) -> RankZeroResult[dict[str, Any]] | None:
    """One rank: a warm-up engine (thrown away), then the measured one."""
    _quiet()
    run_rank(rank, world_size, spec, _warm_job)
    return run_rank(rank, world_size, spec, lambda tp: _measure_job(workload, tp))


def _gbps(status: RankStatus, direction: Direction) -> float:
    moved, busy = status.copies.get(direction, (0, 0.0))
    return moved / busy / 1e9 if busy > 0 else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    cfg = BenchConfig(
        model=args.model,
        users=args.users,
        rounds=args.rounds,
        system_prompt=args.system,
        first_question=args.first_question,
        question=args.question,
        answer=args.answer,
        block_size=args.block_size,
        cache_fraction=args.cache_fraction,
        max_batched_tokens=args.budget,
        backend="host",
    )
    model = model_config(cfg.model)
    workload = workload_of(cfg, model)
    probe = make_kv_cache_config(model, EngineConfig(block_size=cfg.block_size))
    engine = EngineConfig(
        block_size=cfg.block_size,
        num_gpu_blocks=gpu_blocks_for(cfg, workload, len(probe.groups)),
        max_num_batched_tokens=cfg.max_batched_tokens,
    )
    runs: list[dict[str, Any]] = []
    console = Console(width=160)
    plan = [(tp, offload) for tp in (1, 2) for offload in (False, True)]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("tp runs", total=len(plan))
        for tp, offload in plan:
            off_cfg = (
                OffloadConfig(cpu_bytes=args.cpu_bytes, backend="host", world_size=tp)
                if offload
                else None
            )
            spec = TPSpec(model=cfg.model, engine=engine, offload=off_cfg)
            first = launch(bench_rank, (spec, workload), world_size=tp, timeout_s=args.timeout)[0]
            assert isinstance(first, RankZeroResult)
            runs.append({"tp": tp, "offload": offload, **first.value, "ranks": first.statuses})
            progress.advance(task)
    reference = runs[0]["outputs"]
    table = Table(
        title=f"tensor parallel on CPU (gloo, host backend): {cfg.model}, "
        f"{cfg.users} users × {cfg.rounds} rounds, {engine.num_gpu_blocks} GPU blocks"
    )
    for col in (
        "tp",
        "offload",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "prefill computed / loaded",
        "outputs = tp1",
        "rank",
        "store GB/s",
        "load GB/s",
        "stored / loaded MiB",
    ):
        table.add_column(col, justify="right")
    out_runs: list[dict[str, Any]] = []
    for run in runs:
        identical = run["outputs"] == reference
        ranks: list[RankStatus] = run["ranks"] if run["offload"] else run["ranks"][:1]
        per_rank = []
        for i, st in enumerate(ranks):
            moved = {d: st.copies.get(d, (0, 0.0))[0] for d in Direction}
            per_rank.append(
                {
                    "rank": st.rank,
                    "store_gbps": _gbps(st, Direction.STORE),
                    "load_gbps": _gbps(st, Direction.LOAD),
                    "bytes_stored": moved[Direction.STORE],
                    "bytes_loaded": moved[Direction.LOAD],
                }
            )
            head = (
                [
                    str(run["tp"]),
                    "on" if run["offload"] else "off",
                    f"{run['ttft_p50_s'] * 1e3:.1f}",
                    f"{run['ttft_p90_s'] * 1e3:.1f}",
                    f"{run['prefill_tokens_computed']} / {run['prefill_tokens_loaded']}",
                    "yes" if identical else "NO",
                ]
                if i == 0
                else [""] * 6
            )
            tail = (
                [
                    str(st.rank),
                    f"{_gbps(st, Direction.STORE):.2f}",
                    f"{_gbps(st, Direction.LOAD):.2f}",
                    f"{moved[Direction.STORE] / 2**20:.1f} / {moved[Direction.LOAD] / 2**20:.1f}",
                ]
                if run["offload"]
                else ["-", "-", "-", "-"]
            )
            table.add_row(*head, *tail)
        out_runs.append(
            {k: v for k, v in run.items() if k not in ("outputs", "ranks")}
            | {"outputs_identical_to_tp1": identical, "ranks": per_rank}
        )
    console.print(table)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": attrs.asdict(cfg),
                    "num_gpu_blocks": engine.num_gpu_blocks,
                    "cpu_bytes_per_rank": args.cpu_bytes,
                    "backend": "host",
                    "machine": platform.node() or platform.machine(),
                    "runs": out_runs,
                },
                indent=2,
            )
        )
    return 0 if all(r["outputs_identical_to_tp1"] for r in out_runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
