"""Tensor parallelism with offload: tp=1 vs tp=2, offload off vs on, the multi-round workload.

Each run starts its ranks as processes with ``kvflow.engine.distributed.launch``: on CPU through
gloo with the host backend, with ``--device cuda`` one GPU per rank, NCCL for the row-parallel
sums and the CUDA backend. Rank 0 runs the engine and kvflow's manager, every rank its own worker
runtime and its own CPU tier (its shard's block bytes). A run first serves a one-round warm-up
workload on a throw-away engine, then the measured one. Reports per run TTFT p50/p90 and whether
the greedy outputs equal the tp=1 offload-off run's, and per rank the store/load GB/s of its
copies (bytes / seconds in flight, from ``OffloadWorker.copy_throughput()``).

    PYTHONPATH=src python scripts/bench_tp.py --model small --users 4 --rounds 4 --answer 8 \
        --cache-fraction 0.25 --max-batched-tokens 1024 --cpu-bytes 1GiB --json out.json
    PYTHONPATH=src python scripts/bench_tp.py --users 2 --rounds 2     # tiny model, a smoke run
    PYTHONPATH=src python scripts/bench_tp.py --model llama-1b --device cuda --dtype float32 \
        --users 8 --rounds 4 --system 2048 --first-question 4096 --question 256 --answer 16 \
        --cache-fraction 0.3 --max-batched-tokens 8192 --cpu-bytes 8GiB --repeat 2   # 2 GPUs

Options are ``kvflow bench``'s (``--cpu-bytes`` is each rank's tier, default 1 GiB; ``--threads``
torch threads per rank, default 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import structlog
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.bench.multi_round import gpu_blocks_for, workload_of
from kvflow.cli.bench import add_arguments, config_from_args
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import copy_gbps
from kvflow.core.transfer import Direction
from kvflow.engine.distributed import launch
from kvflow.engine.engine import EngineConfig, make_kv_cache_config
from kvflow.engine.model import model_config
from kvflow.engine.tp import (
    RankStatus,
    RankZeroResult,
    TPEngine,
    TPSpec,
    build_shard,
    run_rank,
)
from kvflow.engine.workload import MultiRoundQA, run_multi_round
from kvflow.errors import ConfigError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p)  # kvflow bench's options; --cpu-bytes is each rank's CPU tier here
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--repeat", type=int, default=3, help="runs of each configuration (medians)")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        raise ConfigError(f"bench_tp runs on 'cpu' or 'cuda' (one GPU per rank), not {args.device}")
    if args.plot is not None or args.trace is not None:
        raise ConfigError("bench_tp has no --plot/--trace; use kvflow bench for those")
    return args


def _quiet() -> None:
    # Ranks print structlog's default console output; keep the table readable.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _warm_job(workload: MultiRoundQA, tp: TPEngine) -> None:
    run_multi_round(tp.engine, workload)


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
    rank: int, world_size: int, spec: TPSpec, workload: MultiRoundQA, warm: MultiRoundQA
) -> RankZeroResult[dict[str, Any]] | None:
    """One rank: the ``warm`` workload on a throw-away engine of the same spec, then the
    measured one, both on one model shard."""
    _quiet()
    # As in kvflow bench: the engine thread shares the GIL with kvflow's copy and loop threads.
    sys.setswitchinterval(5e-4)
    shard = build_shard(spec, rank, world_size)
    run_rank(rank, world_size, spec, lambda tp: _warm_job(warm, tp), shard=shard)
    return run_rank(rank, world_size, spec, lambda tp: _measure_job(workload, tp), shard=shard)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _quiet()
    cfg = config_from_args(args)
    model = model_config(cfg.model)
    workload = workload_of(cfg, model)
    probe = make_kv_cache_config(model, EngineConfig(block_size=cfg.block_size))
    engine = EngineConfig(
        block_size=cfg.block_size,
        num_gpu_blocks=gpu_blocks_for(cfg, workload, len(probe.groups)),
        max_num_batched_tokens=cfg.max_batched_tokens,
        dtype=cfg.dtype,
        seed=cfg.seed,
        device=cfg.device,
    )
    cpu_bytes = cfg.cpu_bytes or 1 << 30
    # As kvflow bench's --warmup: every shape the measured run meets costs once (allocator,
    # GEMM and attention kernel choice), so "full" serves the same workload untimed first.
    warm = (
        workload
        if cfg.warmup == "full"
        else attrs.evolve(workload, num_rounds=1, seed=workload.seed + 1)
    )

    def one_run(tp: int, offload: bool) -> dict[str, Any]:
        off_cfg = (
            OffloadConfig(
                cpu_bytes=cpu_bytes,
                store_policy=cfg.store_policy,
                backend=cfg.backend,
                world_size=tp,
            )
            if offload
            else None
        )
        spec = TPSpec(model=cfg.model, engine=engine, offload=off_cfg)
        first = launch(
            bench_rank,
            (spec, workload, warm),
            world_size=tp,
            timeout_s=args.timeout,
            threads=args.threads or 1,
            device=cfg.device,
        )[0]
        assert isinstance(first, RankZeroResult)
        return {"tp": tp, "offload": offload, **first.value, "ranks": _per_rank(first.statuses)}

    # Interleaved repeats: load from other jobs on the box spreads over every configuration.
    plan = [(tp, offload) for tp in (1, 2) for offload in (False, True)]
    records: list[dict[str, Any]] = []
    console = Console(width=160)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("tp runs", total=len(plan) * args.repeat)
        for _ in range(args.repeat):
            for tp, offload in plan:
                rec = one_run(tp, offload)
                records.append(rec)
                # A line per run, also where no terminal shows the bar (a log, a remote job).
                progress.console.print(
                    f"tp={tp} offload={'on' if offload else 'off'}: TTFT p50 "
                    f"{rec['ttft_p50_s'] * 1e3:.1f} ms, wall {rec['wall_s']:.2f} s"
                )
                progress.advance(task)
    reference = records[0]["outputs"]
    for rec in records:
        rec["outputs_identical_to_tp1"] = rec.pop("outputs") == reference
    summary = [_summarize([r for r in records if (r["tp"], r["offload"]) == key]) for key in plan]
    where = (
        f"{torch.cuda.get_device_name(0)} × tp (NCCL, CUDA backend)"
        if cfg.device == "cuda"
        else "CPU (gloo, host backend)"
    )
    console.print(_table(summary, where, cfg.model, cfg.users, cfg.rounds, engine.num_gpu_blocks))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "config": attrs.asdict(cfg),
                    "repeat": args.repeat,
                    "num_gpu_blocks": engine.num_gpu_blocks,
                    "cpu_bytes_per_rank": cpu_bytes,
                    "backend": "cuda" if cfg.device == "cuda" else "host",
                    "device": where,
                    "machine": platform.node() or platform.machine(),
                    "summary": summary,
                    "runs": records,
                },
                indent=2,
            )
        )
    return 0 if all(r["outputs_identical_to_tp1"] for r in records) else 1


def _per_rank(statuses: Sequence[RankStatus]) -> list[dict[str, Any]]:
    out = []
    for st in statuses:
        moved = {d: st.copies.get(d, (0, 0.0))[0] for d in Direction}
        out.append(
            {
                "rank": st.rank,
                "store_gbps": copy_gbps(st.copies, Direction.STORE),
                "load_gbps": copy_gbps(st.copies, Direction.LOAD),
                "bytes_stored": moved[Direction.STORE],
                "bytes_loaded": moved[Direction.LOAD],
            }
        )
    return out


def _summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one (tp, offload); counts must agree between repeats."""
    first = runs[0]

    def med(key: str) -> float:
        return float(statistics.median(r[key] for r in runs))

    ranks = [
        {
            "rank": rank["rank"],
            "store_gbps": statistics.median(r["ranks"][i]["store_gbps"] for r in runs),
            "load_gbps": statistics.median(r["ranks"][i]["load_gbps"] for r in runs),
            "bytes_stored": rank["bytes_stored"],
            "bytes_loaded": rank["bytes_loaded"],
        }
        for i, rank in enumerate(first["ranks"])
    ]
    return {
        "tp": first["tp"],
        "offload": first["offload"],
        "repeats": len(runs),
        "ttft_p50_s": med("ttft_p50_s"),
        "ttft_p50_s_range": (
            min(r["ttft_p50_s"] for r in runs),
            max(r["ttft_p50_s"] for r in runs),
        ),
        "ttft_p90_s": med("ttft_p90_s"),
        "wall_s": med("wall_s"),
        "prefill_tokens_computed": first["prefill_tokens_computed"],
        "prefill_tokens_loaded": first["prefill_tokens_loaded"],
        "counts_repeat": all(
            (r["prefill_tokens_loaded"], r["blocks_stored"], r["blocks_loaded"])
            == (first["prefill_tokens_loaded"], first["blocks_stored"], first["blocks_loaded"])
            for r in runs
        ),
        "outputs_identical_to_tp1": all(r["outputs_identical_to_tp1"] for r in runs),
        "ranks": ranks,
    }


def _table(
    summary: Sequence[dict[str, Any]], where: str, model: str, users: int, rounds: int, blocks: int
) -> Table:
    table = Table(
        title=f"tensor parallel on {where}: {model}, {users} users × {rounds} "
        f"rounds, {blocks} GPU blocks; medians of {summary[0]['repeats']} runs"
    )
    for col in (
        "tp",
        "offload",
        "TTFT p50 ms (min–max)",
        "TTFT p90 ms",
        "wall s",
        "prefill computed / loaded",
        "outputs = tp1",
        "rank",
        "store GB/s",
        "load GB/s",
        "stored / loaded MiB",
    ):
        table.add_column(col, justify="right")
    for run in summary:
        lo, hi = run["ttft_p50_s_range"]
        shown = run["ranks"] if run["offload"] else run["ranks"][:1]
        for i, rank in enumerate(shown):
            head = (
                [
                    str(run["tp"]),
                    "on" if run["offload"] else "off",
                    f"{run['ttft_p50_s'] * 1e3:.0f} ({lo * 1e3:.0f}–{hi * 1e3:.0f})",
                    f"{run['ttft_p90_s'] * 1e3:.0f}",
                    f"{run['wall_s']:.2f}",
                    f"{run['prefill_tokens_computed']} / {run['prefill_tokens_loaded']}",
                    "yes" if run["outputs_identical_to_tp1"] else "NO",
                ]
                if i == 0
                else [""] * 7
            )
            tail = (
                [
                    str(rank["rank"]),
                    f"{rank['store_gbps']:.2f}",
                    f"{rank['load_gbps']:.2f}",
                    f"{rank['bytes_stored'] / 2**20:.1f} / {rank['bytes_loaded'] / 2**20:.1f}",
                ]
                if run["offload"]
                else ["–"] * 4
            )
            table.add_row(*head, *tail)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
