"""Benchmark the scheduler-side offload manager: per-step planning cost on one core.

Usage: python scripts/bench_scheduler.py [--requests N] [--cpu-blocks N] [--steps N] [--json FILE]
Goals (issue 3): steady-state decode of 256 running requests with a 1 M-block CPU pool and nothing
to store <= 50 µs per step; a step storing 512 blocks <= 1 ms.

Only ``build_step_plan`` / ``update_from_reports`` / ``get_num_new_matched_tokens`` are timed; the
engine's side (building ``SchedulerOutput``\\ s, appending tokens) is prepared outside the clock.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.core.block_pool import BlockPool
from kvflow.core.gpu_view import BlockPoolGpuView
from kvflow.core.offload import GroupSpec, OffloadManager, OffloadManagerConfig, StorePolicy
from kvflow.core.protocol import StepPlan, StepReport
from kvflow.core.requests import CachedRequest, KVRequest, NewRequest, SchedulerOutput

BLOCK = 16
PROMPT = 1000  # 62 full blocks + 8 tokens: every request completes a block 8 steps into decode


class Engine:
    """Just enough of an engine to drive the manager: GPU blocks, requests, scheduler outputs."""

    def __init__(self, mgr: OffloadManager, gpu: BlockPool) -> None:
        self.mgr = mgr
        self.gpu = gpu
        self.step_no = 0
        self.requests: list[KVRequest] = []
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def settle(self, plan: StepPlan) -> float:
        """Every rank reports every transfer of ``plan`` done; returns the seconds it took."""
        tids = tuple(s.transfer_id for s in (*plan.stores, *plan.loads))
        reports = [StepReport(r, tids) for r in range(self.mgr.config.world_size)]
        t0 = time.perf_counter()
        self.mgr.update_from_reports(reports)
        return time.perf_counter() - t0

    def prefill(self, prompts: Sequence[Sequence[int]], prefix: str) -> tuple[float, StepPlan]:
        """Admit and prefill new requests in one step; returns the planning time and the plan."""
        news = []
        for i, prompt in enumerate(prompts):
            rid = f"{prefix}{i}"
            req = KVRequest.from_prompt(rid, list(prompt))
            # Decode tokens are known up front: the manager never reads past what was computed.
            req.all_token_ids.extend(range(50_000, 50_000 + 4 * BLOCK * 64))
            self.mgr.get_num_new_matched_tokens(req, 0)
            ids = self.gpu.get_new_blocks(-(-len(prompt) // BLOCK) + 1)
            self.mgr.update_state_after_alloc(req, [ids], 0)
            self.requests.append(req)
            self.tables[rid] = ids
            self.computed[rid] = len(prompt)
            news.append(NewRequest(rid, [ids], 0, len(prompt)))
        self.step_no += 1
        so = SchedulerOutput(self.step_no, new_requests=tuple(news))
        t0 = time.perf_counter()
        plan = self.mgr.build_step_plan(so)
        return time.perf_counter() - t0, plan

    def decode_outputs(self, steps: int) -> list[SchedulerOutput]:
        """The next ``steps`` decode steps of every request, one token each, built in advance."""
        outs = []
        for _ in range(steps):
            self.step_no += 1
            cached = []
            for req in self.requests:
                rid = req.request_id
                done = self.computed[rid]
                table = self.tables[rid]
                new: tuple[int, ...] = ()
                if done + 1 > len(table) * BLOCK:
                    new = tuple(self.gpu.get_new_blocks(1))
                    table.extend(new)
                cached.append(CachedRequest(rid, [new], done, 1))
                self.computed[rid] = done + 1
            outs.append(SchedulerOutput(self.step_no, cached_requests=tuple(cached)))
        return outs

    def finish_all(self) -> None:
        for req in self.requests:
            self.mgr.request_finished(req, [self.tables[req.request_id]])
            self.gpu.free(reversed(self.tables.pop(req.request_id)))
        self.requests.clear()


def run_decode(
    engine: Engine, steps: int, progress: Progress, label: str
) -> dict[str, list[float]]:
    """Time ``build_step_plan`` over ``steps`` decode steps, split into steps that stored, steps
    where requests got a new GPU block but stored nothing, and the rest (nothing changed)."""
    outs = engine.decode_outputs(steps)
    times: dict[str, list[float]] = {"idle": [], "store": [], "new_block": []}
    stored: list[int] = []
    task = progress.add_task(label, total=steps)
    gc.collect()
    gc.disable()  # a collection inside one 30 µs step would dominate its figure
    try:
        for so in outs:
            t0 = time.perf_counter()
            plan = engine.mgr.build_step_plan(so)
            dt = time.perf_counter() - t0
            n = sum(s.num_blocks for s in plan.stores)
            if n:
                times["store"].append(dt)
            elif any(c.new_block_ids[0] for c in so.cached_requests):
                times["new_block"].append(dt)
            else:
                times["idle"].append(dt)
            if n:
                stored.append(n)
            engine.settle(plan)
            progress.advance(task)
    finally:
        gc.enable()
    times["blocks_per_store_step"] = [float(x) for x in stored]
    return times


def make(num_cpu_blocks: int, policy: StorePolicy, gpu_blocks: int, watermark: int = 64) -> Engine:
    gpu = BlockPool(gpu_blocks, name="gpu")
    cfg = OffloadManagerConfig(
        groups=(GroupSpec(block_size=BLOCK, num_cpu_blocks=num_cpu_blocks, block_bytes=2 << 20),),
        store_policy=policy,
        lazy_watermark=watermark,
    )
    return Engine(OffloadManager(cfg, gpu_view=BlockPoolGpuView(gpu)), gpu)


def us(xs: Sequence[float], q: float = 0.5) -> float:
    if not xs:
        return float("nan")
    if q == 0.5:
        return statistics.median(xs) * 1e6
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--cpu-blocks", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=640, help="decode steps per scenario")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    # A library never configures logging; a script may: keep debug events out of the timings.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        cache_logger_on_first_use=True,
    )
    n = args.requests
    gpu_blocks = n * (PROMPT // BLOCK + 2 + args.steps // BLOCK + 2) + 4096
    rows: list[tuple[str, float, str, str]] = []
    with Progress(transient=True) as progress:
        # 1. Eager, aligned: every request completes a block on the same step, else nothing.
        eng = make(args.cpu_blocks, StorePolicy.EAGER, gpu_blocks)
        _, plan = eng.prefill([range(i * PROMPT, (i + 1) * PROMPT) for i in range(n)], "r")
        eng.settle(plan)
        t = run_decode(eng, args.steps, progress, "eager decode, aligned")
        rows.append(
            (f"decode, {n} requests, nothing to store: median (µs)", us(t["idle"]), "≤ 50", "eager")
        )
        rows.append(
            (f"decode, {n} requests, nothing to store: p90 (µs)", us(t["idle"], 0.9), "—", "eager")
        )
        rows.append(
            (
                f"decode step where all {n} requests get a new GPU block: median (µs)",
                us(t["new_block"]),
                "—",
                "eager, nothing stored",
            )
        )
        rows.append(
            (
                f"decode step where all {n} requests complete a block: median (µs)",
                us(t["store"]),
                "—",
                f"eager, {int(t['blocks_per_store_step'][0])} blocks stored",
            )
        )
        eng.finish_all()
        # 2. Eager, staggered: requests complete blocks on different steps (n/16 per step).
        eng = make(args.cpu_blocks, StorePolicy.EAGER, gpu_blocks)
        prompts = [range(i * PROMPT, i * PROMPT + PROMPT - i % BLOCK) for i in range(n)]
        _, plan = eng.prefill(prompts, "s")
        eng.settle(plan)
        t = run_decode(eng, args.steps, progress, "eager decode, staggered")
        both = t["idle"] + t["store"]
        rows.append(
            (
                f"decode, {n} requests, staggered ({n // BLOCK} blocks/step): median (µs)",
                us(both),
                "—",
                "eager",
            )
        )
        eng.finish_all()

        # 3. A step storing 512 blocks: 32 new 256-token prompts prefilled together.
        def store_512() -> float:
            e = make(args.cpu_blocks, StorePolicy.EAGER, 4096)
            dt, plan = e.prefill([range(i * 256, (i + 1) * 256) for i in range(32)], "p")
            assert sum(s.num_blocks for s in plan.stores) == 512
            return dt

        def commit_512() -> float:
            e = make(args.cpu_blocks, StorePolicy.EAGER, 4096)
            _, plan = e.prefill([range(i * 256, (i + 1) * 256) for i in range(32)], "p")
            return e.settle(plan)

        rows.append(
            (
                "prefill step storing 512 blocks (32 × 256-token prompts, hashing included) (ms)",
                best(store_512, 5) * 1e3,
                "≤ 1",
                "eager",
            )
        )
        rows.append(
            (
                "commit of those 512 stored blocks (update_from_reports) (ms)",
                best(commit_512, 5) * 1e3,
                "—",
                "eager",
            )
        )

        # 4. Matching: a 512-block hit is found and pinned, then planned as a load.
        def match_512() -> float:
            e = make(args.cpu_blocks, StorePolicy.EAGER, 8192)
            _, plan = e.prefill([range(8192)], "m")
            e.settle(plan)
            req = KVRequest.from_prompt("hit", [*range(8192), 7])
            t0 = time.perf_counter()
            got, _ = e.mgr.get_num_new_matched_tokens(req, 0)
            dt = time.perf_counter() - t0
            assert got == 8192
            return dt

        rows.append(
            (
                "match + pin a 512-block CPU hit (8192-token prompt, hashing included) (ms)",
                best(match_512, 5) * 1e3,
                "—",
                "eager",
            )
        )
        # 5. Lazy: the cursor walk runs every step; the window is covered once, then only the
        # blocks that enter it (allocations pop the queue head) are walked.
        for watermark in (64, 512):
            eng = make(args.cpu_blocks, StorePolicy.LAZY, gpu_blocks, watermark=watermark)
            _, plan = eng.prefill([range(i * PROMPT, (i + 1) * PROMPT) for i in range(n)], "l")
            eng.settle(plan)
            t = run_decode(eng, args.steps, progress, f"lazy decode, watermark {watermark}")
            rows.append(
                (
                    f"decode, {n} requests: median per step (µs)",
                    us(t["idle"] + t["store"] + t["new_block"]),
                    "—",
                    f"lazy, watermark {watermark}",
                )
            )
            eng.finish_all()

    table = Table(title=f"kvflow scheduler on {platform.processor() or platform.machine()}, 1 core")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    table.add_column("policy")
    for name, value, goal, policy in rows:
        table.add_row(name, f"{value:.1f}" if value >= 10 else f"{value:.2f}", goal, policy)
    Console().print(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                [dict(zip(("measure", "value", "goal", "policy"), r, strict=True)) for r in rows],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
