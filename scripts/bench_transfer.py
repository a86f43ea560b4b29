#!/usr/bin/env python3
"""Benchmark GPU↔CPU KV block transfers on a CUDA device: kvflow against the baselines.

One run, per chunk (page) size: 512 scattered blocks × 32 layers × K/V of a FlashAttention-style
bf16 cache, both directions, for

- ``ceiling``: contiguous copies of the same bytes (one ``cuMemcpyAsync`` per pinned chunk);
- ``per_chunk``: one ``cuMemcpyAsync`` (what ``cudaMemcpyAsync`` calls) per page;
- ``batch``: one ``cuMemcpyBatchAsync`` per step over all pages (kvflow's direct path);
- ``staged``: kvflow's gather → whole-block DMA path (and DMA → scatter for loads);
- ``kvflow``: what kvflow's ``auto`` choice runs;

then the slowdown each causes to a bf16 8192³ matmul loop on another stream, store and load
together, the Python-side cost of launching one step, and how soon the CPU tier is usable.

    python scripts/bench_transfer.py --json out.json           # on the GPU machine
    python scripts/bench_transfer.py --plot docs/transfer_bandwidth.png --from-json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=180)
KiB = 1024
METHODS = ("ceiling", "per_chunk", "batch", "staged", "kvflow")
DIRECTIONS = ("store", "load")

Issue = Callable[[Any], Any]
"""Queue one step's copies after a gate fence; return the event after them."""


def bench_chunk(args: argparse.Namespace, chunk: int) -> dict[str, Any]:
    import numpy as np
    import torch as _torch

    from kvflow.backends.base import CopyBatch
    from kvflow.backends.cuda import CudaBackend, CudaConfig, CudaFence
    from kvflow.backends.cuda import driver as drv
    from kvflow.backends.cuda.plan import RegionTable, direct_descriptors
    from kvflow.core.transfer import Direction

    torch: Any = _torch  # torch's stream/event constructors are untyped
    nblocks, layers, step = int(args.gpu_blocks), int(args.layers), int(args.blocks)
    heads = chunk // (2 * 16 * 128)
    kv = {
        f"layer{i}": torch.empty((2, nblocks, 16, heads, 128), dtype=torch.bfloat16, device="cuda")
        for i in range(layers)
    }
    for t in kv.values():
        t.view(torch.uint8).random_(0, 256)
    config = CudaConfig(
        slot_bytes=args.slot_mib << 20,
        num_slots=args.slots,
        register_chunk_bytes=args.pin_chunk_mib << 20,
    )
    backend = CudaBackend(0, config)
    layout = backend.register_kv_caches(kv, nblocks)
    block_bytes = layout.groups[0].block_bytes
    step_bytes = step * block_bytes
    t0 = time.perf_counter()
    backend.allocate_cpu_tier([2 * step])
    first = backend.submit(CopyBatch(Direction.STORE, ((0,),), ((0,),)))
    while backend.query(first).value == "pending":
        pass
    t_first = time.perf_counter() - t0
    # How long an engine's kernel launch can stall while the rest of the tier is being pinned.
    probe = torch.zeros(1, device="cuda")
    stalls = [0.0]
    while not backend.cpu_tier.pinning_finished:
        began = time.perf_counter()
        probe.add_(1)
        stalls.append(time.perf_counter() - began)
    backend.cpu_tier.wait_registered()
    t_pinned = time.perf_counter() - t0
    torch.cuda.synchronize()
    auto_path = backend.path(0)

    rng = np.random.default_rng(chunk)
    perm = rng.permutation(nblocks)
    gpu_a, gpu_b = perm[:step].tolist(), perm[step : 2 * step].tolist()
    cpu_perm = rng.permutation(2 * step)
    cpu_a, cpu_b = cpu_perm[:step].tolist(), cpu_perm[step:].tolist()
    batches = {
        "store": CopyBatch(Direction.STORE, (tuple(gpu_a),), (tuple(cpu_a),)),
        "load": CopyBatch(Direction.LOAD, (tuple(gpu_b),), (tuple(cpu_b),)),
    }

    timer = torch.cuda.Stream()
    timer_h = drv.stream_of(timer.cuda_stream)
    own_streams = {d: drv.lowest_priority_stream() for d in DIRECTIONS}
    table = RegionTable.from_group(layout.groups[0])
    cpu_base = backend.cpu_tier.ptr(0)
    chunk_bytes = backend.cpu_tier.chunk_blocks(0) * block_bytes
    contiguous = torch.empty(step_bytes, dtype=torch.uint8, device="cuda")
    contiguous.random_(0, 256)
    torch.cuda.synchronize()

    def own_event(stream: Any) -> Any:
        ev = drv.new_event()
        drv.record(ev, stream)
        return CudaFence(ev, backend)

    def ceiling(direction: str) -> Issue:
        store = direction == "store"
        own = own_streams[direction]

        def issue(gate: Any) -> Any:
            drv.wait(own, gate.event)
            for lo in range(0, step_bytes, chunk_bytes):
                n = min(chunk_bytes, step_bytes - lo)
                gpu, cpu = int(contiguous.data_ptr()) + lo, cpu_base + lo
                dst, src = (cpu, gpu) if store else (gpu, cpu)
                drv.check(drv.cu.cuMemcpyAsync(dst, src, n, own), "cuMemcpyAsync")
            return own_event(own)

        return issue

    def per_chunk(direction: str) -> Issue:
        b = batches[direction]
        desc = direct_descriptors(
            table,
            np.asarray(b.gpu_block_ids[0]),
            np.asarray(b.cpu_block_ids[0]),
            cpu_base,
            store=direction == "store",
        )
        own = own_streams[direction]

        def issue(gate: Any) -> Any:
            drv.wait(own, gate.event)
            drv.memcpy_each(desc, own)
            return own_event(own)

        return issue

    def via_backend(direction: str, method: str) -> Issue:
        def issue(gate: Any) -> Any:
            return backend.submit(batches[direction], [gate])

        backend.set_method(method)  # type: ignore[arg-type]
        return issue

    def make(method: str, direction: str) -> Issue:
        if method == "ceiling":
            return ceiling(direction)
        if method == "per_chunk":
            return per_chunk(direction)
        return via_backend(
            direction, {"batch": "direct", "staged": "staged", "kvflow": "auto"}[method]
        )

    def gate() -> tuple[Any, Any]:
        """A fence that opens ~20 ms from now, so every rep is queued before timing starts."""
        start = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(timer):
            torch.cuda._sleep(40_000_000)
            fence = backend.compute_fence()
            start.record(timer)
        return fence, start

    def finish(fences: list[Any]) -> Any:
        end = torch.cuda.Event(enable_timing=True)
        for f in fences:
            drv.wait(timer_h, f.event)
        end.record(timer)
        return end

    def bandwidth(issues: list[Issue], reps: int) -> float:
        for issue in issues:  # warm-up
            issue(backend.compute_fence())
        torch.cuda.synchronize()
        backend.flush()
        fence, start = gate()
        last = []
        for _ in range(reps):
            last = [issue(fence) for issue in issues]
        backend.wait_launched()  # kvflow fences are recorded on its launch thread
        end = finish(last)
        end.synchronize()
        backend.flush()
        seconds = float(start.elapsed_time(end)) * 1e-3
        return len(issues) * reps * step_bytes / seconds / 1e9

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    bmat = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_stream = torch.cuda.Stream()

    def matmuls(n: int) -> tuple[Any, Any]:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(mm_stream):
            e0.record(mm_stream)
            for _ in range(n):
                torch.mm(a, bmat)
            e1.record(mm_stream)
        return e0, e1

    e0, e1 = matmuls(3)
    e1.synchronize()
    e0, e1 = matmuls(args.matmuls)
    e1.synchronize()
    mm_alone = e0.elapsed_time(e1)

    def interference(issue: Issue) -> tuple[float, float]:
        """(matmul slowdown ×, matmul ms lost per GB copied) with ``issue`` running alongside."""
        torch.cuda.synchronize()
        e0, e1 = matmuls(args.matmuls)
        done: list[Any] = []
        inflight: list[Any] = []
        while not e1.query() and len(done) < 400:
            f = issue(backend.compute_fence())
            backend.wait_launched()
            ev = torch.cuda.Event(enable_timing=True)
            drv.wait(timer_h, f.event)
            ev.record(timer)
            inflight.append(ev)
            done.append(ev)
            if len(inflight) >= 2:
                inflight.pop(0).synchronize()
        torch.cuda.synchronize()
        backend.flush()
        window = e0.elapsed_time(e1)
        # Copy rate while the loop ran (steady state assumed), times the window: GB moved beside it.
        gb_per_ms = len(done) * step_bytes / 1e9 / e0.elapsed_time(done[-1]) if done else 0.0
        lost = window - mm_alone
        per_gb = lost / (gb_per_ms * window) if gb_per_ms else float("nan")
        return window / mm_alone, per_gb

    def launch_breakdown() -> dict[str, float]:
        """Where one staged 512-block store's launch time goes, each part alone (µs, median)."""
        from kvflow.backends.cuda.kernels import MAX_IDS
        from kvflow.backends.cuda.plan import Descriptors, block_ids, staged_plan

        backend.set_method("staged")
        b = batches["store"]
        per_slot = min(MAX_IDS, (args.slot_mib << 20) // block_bytes)

        def plan_only() -> None:
            block_ids(b.gpu_block_ids[0], nblocks, "GPU")
            cpu = block_ids(b.cpu_block_ids[0], 2 * step, "CPU")
            staged_plan(
                table,
                cpu,
                cpu_base,
                blocks_per_slot=per_slot,
                chunk_blocks=backend.cpu_tier.chunk_blocks(0),
                store=True,
            )

        src = (int(contiguous.data_ptr()) + np.arange(step) * block_bytes).astype(np.uint64)
        dst = (cpu_base + np.asarray(cpu_a) * block_bytes).astype(np.uint64)
        scattered = Descriptors(dst, src, np.full(step, block_bytes, dtype=np.uint64))
        one = Descriptors(dst[:1], src[:1], np.array([block_bytes], dtype=np.uint64))
        lane = backend._lanes[Direction.STORE]  # benchmark-only peek at the store lane
        batch = backend._batch
        own = own_streams["store"]

        def timed(fn: Callable[[], Any]) -> float:
            times = []
            for _ in range(15):
                torch.cuda.synchronize()
                backend.flush()
                began = time.perf_counter()
                fn()
                times.append(time.perf_counter() - began)
            torch.cuda.synchronize()
            return statistics.median(times[3:]) * 1e6

        runs = CopyBatch(Direction.STORE, (tuple(gpu_a),), (tuple(range(step)),))

        def submit_runs_issued() -> None:
            backend.submit(runs)
            backend.wait_launched()

        parts = {
            "plan": timed(plan_only),
            "kvflow_cpu_runs": timed(lambda: backend.submit(runs)),
            "kvflow_cpu_runs_issued": timed(submit_runs_issued),
        }
        if batch is not None:
            parts["batch_512_blocks"] = timed(lambda: batch(scattered, lane.attrs, own))
            parts["batch_1_copy"] = timed(lambda: batch(one, lane.attrs, own))
        # What CudaConfig.batch_min_copies weighs: the same single copy as one cuMemcpyAsync.
        parts["memcpy_1_copy"] = timed(lambda: drv.memcpy_each(one, own))
        backend.set_method("auto")
        return parts

    out: dict[str, Any] = {
        "chunk_kib": chunk // KiB,
        "block_bytes": block_bytes,
        "step_bytes": step_bytes,
        "auto_path": auto_path,
        "first_transfer_s": t_first,
        "pinned_s": t_pinned,
        "pinned_bytes": backend.cpu_tier.nbytes,
        "pin_stall_max_ms": max(stalls) * 1e3,
        "gbps": {},
        "slowdown": {},
        "ms_lost_per_gb": {},
        "matmul_ms": mm_alone / args.matmuls,
    }
    for method in METHODS:
        for direction in DIRECTIONS:
            issue = make(method, direction)
            reps = 2 if method == "per_chunk" else args.reps
            key = f"{method}/{direction}"
            out["gbps"][key] = bandwidth([issue], reps)
            slow, per_gb = interference(issue)
            out["slowdown"][key] = slow
            out["ms_lost_per_gb"][key] = per_gb
    backend.set_method("auto")
    out["gbps"]["kvflow/both"] = bandwidth(
        [make("kvflow", "store"), make("kvflow", "load")], args.reps
    )
    out["gbps"]["ceiling/both"] = bandwidth([ceiling("store"), ceiling("load")], args.reps)

    # Python-side launch cost: the submit call alone, with the copy queues drained before it.
    # "issued": until the launch thread has made every driver call of the step.
    out["launch_us"] = {}
    for name, method in (("kvflow", "auto"), ("staged", "staged"), ("batch", "direct")):
        backend.set_method(method)  # type: ignore[arg-type]
        times, issued = [], []
        for _ in range(25):
            backend.flush()
            began = time.perf_counter()
            backend.submit(batches["store"])
            times.append(time.perf_counter() - began)
            backend.wait_launched()
            issued.append(time.perf_counter() - began)
        backend.flush()
        out["launch_us"][name] = statistics.median(times[5:]) * 1e6
        out["launch_us"][f"{name}_issued"] = statistics.median(issued[5:]) * 1e6
    out["launch_us"].update(launch_breakdown())
    backend.close()
    for stream in own_streams.values():
        drv.cu.cuStreamDestroy(stream)
    return out


def new_table(title: str, columns: list[str], first: int = 0) -> Table:
    """A rich table; columns from index ``first`` on are right-aligned figures."""
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="right" if i >= first else "left")
    return table


def show(results: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    table = new_table(
        f"GPU↔CPU transfer, {meta['device']} (driver {meta['driver']})",
        ["chunk", "dir", *(f"{m} GB/s" for m in METHODS), "kvflow/ceil"],
        first=2,
    )
    for r in results:
        for d in DIRECTIONS:
            g = r["gbps"]
            table.add_row(
                f"{r['chunk_kib']} KiB",
                d,
                *(f"{g[f'{m}/{d}']:.1f}" for m in METHODS),
                f"{100 * g[f'kvflow/{d}'] / g[f'ceiling/{d}']:.0f}%",
            )
    console.print(table)
    t2 = new_table(
        "bf16 8192³ matmul slowdown (×) / matmul ms lost per GB copied",
        ["chunk", "dir", *METHODS],
        first=2,
    )
    for r in results:
        for d in DIRECTIONS:
            t2.add_row(
                f"{r['chunk_kib']} KiB",
                d,
                *(
                    f"{r['slowdown'][f'{m}/{d}']:.2f} / {r['ms_lost_per_gb'][f'{m}/{d}']:.1f}"
                    for m in METHODS
                ),
            )
    console.print(t2)
    t3 = new_table(
        "store+load together, launch cost, CPU tier start-up",
        [
            "chunk",
            "auto path",
            "kvflow both GB/s",
            "ceiling both GB/s",
            "launch µs kvflow",
            "… issued",
            "launch µs batch",
            "… issued",
            "launch µs kvflow, CPU ids in runs",
            "… issued",
            "first copy s",
            "max launch stall while pinning ms",
            "all pinned s",
            "pinned GiB",
        ],
    )
    for r in results:
        lu = r["launch_us"]
        t3.add_row(
            f"{r['chunk_kib']} KiB",
            r["auto_path"],
            f"{r['gbps']['kvflow/both']:.1f}",
            f"{r['gbps']['ceiling/both']:.1f}",
            *(
                f"{lu.get(k, float('nan')):.0f}"
                for k in (
                    "kvflow",
                    "kvflow_issued",
                    "batch",
                    "batch_issued",
                    "kvflow_cpu_runs",
                    "kvflow_cpu_runs_issued",
                )
            ),
            f"{r['first_transfer_s']:.2f}",
            f"{r.get('pin_stall_max_ms', float('nan')):.0f}",
            f"{r['pinned_s']:.2f}",
            f"{r['pinned_bytes'] / 2**30:.2f}",
        )
    console.print(t3)
    t4 = new_table(
        "launch cost breakdown, µs (each part alone, queues drained)",
        [
            "chunk",
            "kvflow issued",
            "numpy plan",
            "1 cuMemcpyBatchAsync, 512 blocks",
            "…, 1 block",
            "1 cuMemcpyAsync, 1 block",
        ],
    )
    for r in results:
        lu = r["launch_us"]
        t4.add_row(
            f"{r['chunk_kib']} KiB",
            *(
                f"{lu.get(k, float('nan')):.0f}"
                for k in (
                    "kvflow_issued",
                    "plan",
                    "batch_512_blocks",
                    "batch_1_copy",
                    "memcpy_1_copy",
                )
            ),
        )
    console.print(t4)


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    chunks = [r["chunk_kib"] for r in results]
    for ax, d, title in zip(axes, DIRECTIONS, ("store (GPU→CPU)", "load (CPU→GPU)"), strict=True):
        for m in METHODS:
            style = "--" if m == "staged" else "-"
            ax.plot(chunks, [r["gbps"][f"{m}/{d}"] for r in results], style, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(chunks, [f"{c} KiB" for c in chunks])
        ax.set_xlabel("chunk (page) size")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(
        f"512 scattered blocks × 32 layers × K/V, {meta['device']}, driver {meta['driver']}, {meta['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plan_only(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The host side of one staged step without a GPU: planning time and DMA descriptors for
    scattered CPU ids, ascending runs from a churned CPU pool, and one run (numpy timing only)."""
    import numpy as np

    from kvflow.backends.cuda import CudaConfig
    from kvflow.backends.cuda.kernels import MAX_IDS
    from kvflow.backends.cuda.plan import RegionTable, block_ids, staged_plan
    from kvflow.core.block_pool import BlockPool
    from kvflow.core.layout import TensorDesc, derive_layout

    cfg = CudaConfig(slot_bytes=args.slot_mib << 20, register_chunk_bytes=args.pin_chunk_mib << 20)
    step, n_gpu, layers = int(args.blocks), int(args.gpu_blocks), int(args.layers)
    rng = np.random.default_rng(0)
    # A CPU pool that has stored and evicted steps of uneven sizes: the runs it hands out now.
    pool = BlockPool(4 * step, ascending_runs=True)
    held: list[list[int]] = []
    for i in range(40):
        size = int(rng.integers(step // 8, step)) if i % 3 else step
        size = min(size, pool.num_free_blocks)
        ids = pool.get_new_blocks(size)
        pool.release_owned(ids, [bytes([i % 256, j % 256, j // 256]) * 6 for j in range(size)])
        held.append(ids)
    churned = pool.get_new_blocks(step)
    out = []
    for chunk in (int(x) * KiB for x in args.chunks.split(",")):
        heads = chunk // (2 * 16 * 128)
        descs = {
            f"l{i}": TensorDesc(
                f"l{i}",
                (2, n_gpu, 16, heads, 128),
                (n_gpu * 16 * heads * 128, 16 * heads * 128, heads * 128, 128, 1),
                2,
                (i + 1) << 36,
                "cuda:0",
            )
            for i in range(layers)
        }
        table = RegionTable.from_group(derive_layout(descs, n_gpu).groups[0])
        bb = table.block_bytes
        per_slot = min(MAX_IDS, cfg.slot_bytes // bb)
        chunk_blocks = max(1, cfg.register_chunk_bytes // bb)
        ramp = max(1, cfg.ramp_bytes // bb)
        row: dict[str, Any] = {"chunk_kib": chunk // KiB, "subbatches": 0}
        for name, ids in (
            ("scattered", rng.permutation(4 * step)[:step].tolist()),
            ("churned_pool", churned),
            ("one_run", list(range(7, 7 + step))),
        ):
            cpu = block_ids(tuple(ids), 4 * step, "cpu")
            best = float("inf")
            for _ in range(7):
                t0 = time.perf_counter()
                for _ in range(50):
                    plan = staged_plan(
                        table,
                        block_ids(tuple(ids), 4 * step, "cpu"),
                        1 << 40,
                        blocks_per_slot=per_slot,
                        chunk_blocks=chunk_blocks,
                        store=True,
                        ramp_blocks=ramp,
                    )
                best = min(best, (time.perf_counter() - t0) / 50)
            plan = staged_plan(
                table,
                cpu,
                1 << 40,
                blocks_per_slot=per_slot,
                chunk_blocks=chunk_blocks,
                store=True,
                ramp_blocks=ramp,
            )
            row[f"{name}_plan_us"] = best * 1e6
            row[f"{name}_descriptors"] = len(plan.dma)
            row["subbatches"] = plan.num_subbatches
        out.append(row)
    table_ = new_table(
        f"planning one staged {step}-block store on the host (µs, best of 7 × 50; ids "
        "validated too) and its DMA descriptors",
        ["chunk", "sub-batches", "scattered", "desc", "churned pool", "desc", "one run", "desc"],
    )
    for r in out:
        table_.add_row(
            f"{r['chunk_kib']} KiB",
            str(r["subbatches"]),
            *(
                x
                for k in ("scattered", "churned_pool", "one_run")
                for x in (f"{r[k + '_plan_us']:.0f}", str(r[k + "_descriptors"]))
            ),
        )
    console.print(table_)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--chunks", default="4,16,32,128", help="page sizes in KiB")
    p.add_argument("--blocks", type=int, default=512, help="blocks per step")
    p.add_argument("--gpu-blocks", type=int, default=1024, help="blocks in the GPU cache")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--matmuls", type=int, default=20, help="matmuls per interference window")
    p.add_argument("--slot-mib", type=int, default=128, help="kvflow staging slot size")
    p.add_argument("--slots", type=int, default=2, help="kvflow staging slots per direction")
    p.add_argument("--pin-chunk-mib", type=int, default=64, help="CPU tier registration chunk")
    p.add_argument("--json", help="write results here")
    p.add_argument("--from-json", help="read results instead of measuring")
    p.add_argument("--plot", help="write the bandwidth plot (PNG) here")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="no GPU: time the host-side planning of a staged step and count its descriptors",
    )
    args = p.parse_args(argv)
    if args.plan_only:
        planned = plan_only(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"plan_only": planned}, f, indent=1)
        return 0
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        results, meta = data["results"], data["meta"]
    else:
        import torch

        from kvflow.backends.cuda import driver as drv

        if not torch.cuda.is_available():
            console.print("no CUDA device: nothing to measure")
            return 1
        drv.require_driver()
        meta = {
            "device": torch.cuda.get_device_name(0),
            "driver": int(drv.check(drv.cu.cuDriverGetVersion(), "cuDriverGetVersion")),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": " ".join(["scripts/bench_transfer.py", *(argv or sys.argv[1:])]),
        }
        results = []
        for c in (int(x) * KiB for x in args.chunks.split(",")):
            console.print(f"measuring {c // KiB} KiB chunks …")
            results.append(bench_chunk(args, c))
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"meta": meta, "results": results}, f, indent=1)
    show(results, meta)
    if args.plot:
        plot(results, meta, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
