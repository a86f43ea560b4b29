#!/usr/bin/env python3
"""Benchmark GPU↔CPU block transfers through kvflow's connector, driven the way an engine drives it.

Not the backend alone (that is ``bench_transfer.py``): one ``OffloadConnector`` per layout over a
real KV cache, and per measured step the engine's own calls, in its order.

- store: a new request of ``--blocks`` full blocks is matched and allocated on scattered GPU ids
  (untimed: that is scheduling, before the forward pass); then, timed, the scheduler role plans
  the step that computes the blocks (``build_connector_meta``), the worker role binds the plan,
  ``start_load_kv``, ``wait_for_save``, and ``get_finished`` / ``build_worker_report`` →
  ``update_connector_output`` run until the scheduler has committed the store (no live
  transfer left);
- load: a request whose prompt is the stored one plus a token: ``get_num_new_matched_tokens``
  (a ``--blocks`` hit), ``update_state_after_alloc`` on fresh scattered GPU ids,
  ``build_connector_meta``, bind, ``start_load_kv``, ``wait_for_save``, then the same poll until
  the request is in ``finished_recving``.

Wall time runs from the step's first timed engine call until the scheduler sees the result;
"from launch" from the step's first launch call (``start_load_kv``, after the plan and the bind)
until then, the span issue 25 defines (an engine plans and binds before the forward pass);
copy time is what the backend measured of the copies (CUDA events around each batch, the host
backend's copy thread: ``OffloadWorker.copy_stats``); launch is the time the engine's thread
spends in ``wait_for_save`` (store) or ``start_load_kv`` (load); issue is the CUDA backend's
own time planning and making the driver calls (``CudaBackend.issue_stats``). The ceiling is
measured in the same run: contiguous copies of the same bytes between one GPU buffer and the
connector's own CPU tier (one ``cuMemcpyAsync`` per pinned chunk, CUDA events; on CPU a
``copy_`` of one tensor). Fixed cost per step = wall − bytes / ceiling. The floor is a second
run of the same steps on a backend whose copies finish at once: kvflow's own work per step.
The first measured load is compared byte for byte with what was stored (a sample of blocks).
Start-up objects are frozen out of the garbage collector (``gc.freeze``), as vLLM does.
Requests carry their engine's block hashes (``--hashes engine``, computed when the request is
made, as vLLM and kvflow's engine do); ``--hashes kvflow`` has the connector hash the prompt
inside the timed load instead.

``--floor-only`` runs only the floor (no copies, no ceiling: any machine, the CUDA mode's
host-side work on the host backend's terms) and prints its per-step medians and interquartile
ranges; ``--profile PATH`` writes a cProfile of the floor's timed spans (``pstats`` format; with
``--no-floor``, of the real copies' steps).

    PYTHONPATH=src python scripts/bench_connector_transfer.py --json out.json        # on a GPU
    PYTHONPATH=src python scripts/bench_connector_transfer.py --device cpu --blocks 16 \\
        --layers 2 --steps 2                                                         # CPU smoke
    PYTHONPATH=src python scripts/bench_connector_transfer.py --device cpu --floor-only \\
        --blocks 512 --profile floor.prof                                            # host work
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch
from rich.console import Console
from rich.progress import Progress

from kvflow.connector.offload import OffloadConnector
from kvflow.core.transfer import Direction

try:  # imported as part of the scripts package (tests), or run as a file
    from scripts.connector_rig import (
        LAYOUTS,
        Driver,
        LayoutSpec,
        NullCopies,
        build_connector,
        make_request,
    )
    from scripts.connector_tables import (
        DIRECTIONS,
        TIMELINE,
        device_name,
        floor_figures,
        render,
        render_floor,
    )
except ImportError:
    from connector_rig import (  # type: ignore[import-not-found,no-redef]
        LAYOUTS,
        Driver,
        LayoutSpec,
        NullCopies,
        build_connector,
        make_request,
    )
    from connector_tables import (  # type: ignore[import-not-found,no-redef]
        DIRECTIONS,
        TIMELINE,
        device_name,
        floor_figures,
        render,
        render_floor,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (CUDA backend) or cpu (host backend)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--blocks", default="512,4096", help="blocks per step, comma-separated")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="measured store + load steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    p.add_argument("--worker-loop", choices=("inline", "thread"), default="inline")
    p.add_argument(
        "--method",
        choices=("auto", "staged", "direct"),
        default="auto",
        help="--device cuda: the CUDA backend's copy path (auto: what kvflow picks per layout)",
    )
    p.add_argument(
        "--ramp-mib",
        type=float,
        default=None,
        help="--device cuda: the staged path's ramp (CudaConfig.ramp_bytes, in MiB: a store's "
        "first sub-batch, a load's last); default kvflow's",
    )
    p.add_argument("--ceiling-reps", type=int, default=5)
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the second run per case with copies that finish at once (kvflow's own cost)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="--device cpu: torch's intra-op threads (1: a busy box's thread wake-ups, tens "
        "of ms, stay out of the copies)",
    )
    p.add_argument(
        "--hashes",
        choices=("engine", "kvflow"),
        default="engine",
        help="engine: requests carry their block hashes, as vLLM's and kvflow's engines give "
        "them; kvflow: the connector hashes each prompt itself (inside the timed load)",
    )
    p.add_argument(
        "--floor-only",
        action="store_true",
        help="only the floor (copies that finish at once): kvflow's host work per step, any "
        "machine; prints medians and interquartile ranges",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a cProfile of the floor's timed spans to this file (pstats format); with "
        "--no-floor, of the real copies' timed spans",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.layout_names = [x for x in args.layouts.split(",") if x]
    args.block_counts = [int(x) for x in args.blocks.split(",") if x]
    bad = [x for x in args.layout_names if x not in LAYOUTS]
    if bad:
        p.error(f"unknown layout(s) {bad}; known: {', '.join(LAYOUTS)}")
    if args.floor_only and not args.floor:
        p.error("--floor-only and --no-floor leave nothing to run")
    if not args.block_counts or min(args.block_counts) < 1:
        p.error("--blocks needs positive counts")
    if args.steps < 1 or args.warmup < 0 or args.layers < 1 or args.ceiling_reps < 1:
        p.error("--steps, --layers and --ceiling-reps must be positive, --warmup not negative")
    if args.ramp_mib is not None and args.ramp_mib < 0:
        p.error("--ramp-mib must not be negative")
    return args


def settle(device: str) -> None:
    """Let the device finish what was queued (a step starts on an idle device)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ceiling_gbps(
    conn: OffloadConnector, nbytes: int, block_bytes: int, device: str, reps: int
) -> dict[str, float]:
    """Contiguous copies of ``nbytes`` between one device buffer and the connector's CPU tier."""
    backend: Any = conn.worker.backend
    out: dict[str, float] = {}
    if device.startswith("cuda"):
        from kvflow.backends.cuda import driver as drv

        cuda: Any = torch.cuda  # its Stream and Event constructors are untyped
        tier = backend.cpu_tier
        base, chunk = tier.ptr(0), tier.chunk_blocks(0) * block_bytes
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = cuda.Stream()
        handle = drv.stream_of(stream.cuda_stream)
        for d in DIRECTIONS:
            runs = []
            for _ in range(reps + 1):  # the first is a warm-up
                start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
                start.record(stream)
                for lo in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - lo)
                    gpu, cpu = int(buf.data_ptr()) + lo, base + lo
                    dst, src = (cpu, gpu) if d == "store" else (gpu, cpu)
                    drv.check(drv.cu.cuMemcpyAsync(dst, src, n, handle), "cuMemcpyAsync")
                end.record(stream)
                end.synchronize()
                runs.append(float(start.elapsed_time(end)) * 1e-3)
            out[d] = nbytes / statistics.median(runs[1:]) / 1e9
        return out
    tier_t = backend.cpu_tier(0).view(-1)[:nbytes]
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for d in DIRECTIONS:
        runs = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            (tier_t.copy_(buf) if d == "store" else buf.copy_(tier_t))
            runs.append(time.perf_counter() - t0)
        out[d] = nbytes / statistics.median(runs[1:]) / 1e9
    return out


def case_fields(spec: LayoutSpec, blocks: int, layers: int, block_bytes: int) -> dict[str, Any]:
    """What names one case in the JSON, for both the full run and the floor."""
    return {
        "layout": spec.name,
        "what": spec.what,
        "blocks": blocks,
        "layers": layers,
        "block_bytes": block_bytes,
        "step_bytes": blocks * block_bytes,
    }


def sample_pages(tensors: dict[str, torch.Tensor], ids: Sequence[int]) -> list[torch.Tensor]:
    """Copies of the pages of blocks ``ids`` in every tensor, as raw bytes."""
    index = torch.tensor(list(ids), dtype=torch.long)
    out = []
    for t in tensors.values():
        dim = 1 if t.shape[0] == 2 and t.dim() == 5 else 0
        out.append(t.index_select(dim, index.to(t.device)).view(torch.uint8).cpu())
    return out


def issued_s(conn: OffloadConnector) -> dict[Direction, float]:
    """Host seconds the CUDA backend has spent issuing each direction's copies (else 0)."""
    stats = getattr(conn.worker.backend, "issue_stats", None)
    return {d: stats[d].seconds if stats else 0.0 for d in Direction}


TL = "timeline_"  # the timeline's phases among a step's figures (some share their names)
PHASES = tuple(key for key, _ in TIMELINE)


def timeline(drv: Driver, direction: Direction) -> dict[str, float] | None:
    """Where the step just measured spent its wall, in µs (``polls``: a count), with the
    device's copy span placed on the host clock: ``pre`` from the step's start until the
    device began copying, ``post`` from its end until the scheduler saw the result (``detect``
    until the poll that saw it began, ``settle`` that poll). None without a CUDA backend."""
    st = drv.stamps
    backend: Any = drv.conn.worker.backend
    mark = st.get("mark")
    span = backend.last_copy_span(direction, mark) if mark is not None else None
    if span is None:
        return None
    issue = backend.issue_stats[direction]
    start, end = span
    last_poll = st["polls"][-1]
    us = {
        "plan": st["meta"] - st["t0"],
        "bind": st["bind"] - st["meta"],
        "to_issue": issue.last_began - st["bind"],
        "issue": issue.last_ended - issue.last_began,
        "pre": start - st["t0"],
        "start_in_issue": start - issue.last_began,
        "copy": end - start,
        "detect": last_poll - end,
        "settle": st["seen"] - last_poll,
        "post": st["seen"] - end,
    }
    out = {k: v * 1e6 for k, v in us.items()}
    out["polls"] = float(len(st["polls"]))
    return out


def measure(
    args: argparse.Namespace,
    conn: OffloadConnector,
    tensors: dict[str, torch.Tensor] | None,
    blocks: int,
    num_gpu: int,
    tick: Callable[[], None],
    profiler: cProfile.Profile | None = None,
) -> tuple[dict[str, dict[str, list[float]]], bool | None]:
    """The measured store and load steps on one connector: per direction the wall, launch,
    copy (measured by the backend) and issue seconds of each step; and whether the sampled
    blocks came back byte for byte (None when ``tensors`` is None: not checked). With
    ``profiler``, the measured steps' timed spans are profiled."""
    device = args.device
    drv = Driver(conn, num_gpu, args.seed)
    rows: dict[str, dict[str, list[float]]] = {
        d: {
            "wall": [],
            "from_launch": [],
            "launch": [],
            "copy": [],
            "issue": [],
            **{TL + p: [] for p in PHASES},
        }
        for d in DIRECTIONS
    }
    verified: bool | None = None
    for i in range(args.warmup + args.steps):
        measured = i >= args.warmup
        drv.profiler = profiler if measured else None
        store_req = make_request(args, f"s{i}", drv.prompt(blocks, i))
        src = drv.gpu_ids(blocks)
        check = measured and verified is None and tensors is not None
        if check:
            assert tensors is not None
            positions = sorted(drv.rng.choice(blocks, size=min(blocks, 8), replace=False))
            want = sample_pages(tensors, [src[p] for p in positions])
        settle(device)
        copies0, issued0 = conn.worker.copy_stats(), issued_s(conn)
        wall, launch = drv.store(store_req, src)
        span = drv.from_launch()
        copies1, issued1 = conn.worker.copy_stats(), issued_s(conn)
        phases = {"store": timeline(drv, Direction.STORE)}
        drv.finish(store_req, src)
        load_req = make_request(args, f"l{i}", [*store_req.all_token_ids, 1])
        dst = drv.gpu_ids(blocks + 1)  # the hit's blocks and one for the new token
        settle(device)
        copies_l, issued_l = conn.worker.copy_stats(), issued_s(conn)
        wall_l, launch_l = drv.load(load_req, dst)
        span_l = drv.from_launch()
        copies2, issued2 = conn.worker.copy_stats(), issued_s(conn)
        phases["load"] = timeline(drv, Direction.LOAD)
        if check:
            assert tensors is not None
            got = sample_pages(tensors, [dst[p] for p in positions])
            verified = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        drv.finish(load_req, dst)
        if measured:
            for d, direction, w, sp, la, c0, c1, i0, i1 in (
                ("store", Direction.STORE, wall, span, launch, copies0, copies1, issued0, issued1),
                (
                    "load",
                    Direction.LOAD,
                    wall_l,
                    span_l,
                    launch_l,
                    copies_l,
                    copies2,
                    issued_l,
                    issued2,
                ),
            ):
                rows[d]["wall"].append(w)
                rows[d]["from_launch"].append(sp)
                rows[d]["launch"].append(la)
                rows[d]["copy"].append(c1[direction].copy_s - c0[direction].copy_s)
                rows[d]["issue"].append(i1[direction] - i0[direction])
                for p, v in (phases[d] or {}).items():
                    rows[d][TL + p].append(v)
        tick()
    return rows, verified


def bench_layout(
    args: argparse.Namespace,
    spec: LayoutSpec,
    blocks: int,
    tick: Callable[[], None],
) -> dict[str, Any]:
    device = args.device
    num_gpu = 2 * blocks + 2
    tensors = spec.tensors(args.layers, num_gpu, device)
    block_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) // num_gpu
    step_bytes = blocks * block_bytes
    cpu_blocks = 2 * blocks + 8  # two steps' worth: every store from the third on evicts
    if args.floor_only:
        return bench_floor(args, spec, blocks, tensors, block_bytes, cpu_blocks, tick)
    for t in tensors.values():
        t.view(torch.uint8).random_(0, 256)
    conn = build_connector(args, tensors, num_gpu, block_bytes, cpu_blocks)
    try:
        backend: Any = conn.worker.backend
        path = backend.path(0) if hasattr(backend, "path") else "host"
        ceiling = ceiling_gbps(conn, step_bytes, block_bytes, device, args.ceiling_reps)
        # With --no-floor a profile covers these, the real copies' steps.
        profiler = None if args.floor else args.profiler
        rows, verified = measure(args, conn, tensors, blocks, num_gpu, tick, profiler)
        stats = conn.worker.copy_stats()
    finally:
        conn.worker.shutdown()
    floor: dict[str, dict[str, list[float]]] | None = None
    if args.floor:
        null = build_connector(args, tensors, num_gpu, block_bytes, cpu_blocks, NullCopies())
        try:
            floor, _ = measure(args, null, None, blocks, num_gpu, tick, args.profiler)
        finally:
            null.worker.shutdown()
    # The next case must not find this one's pinned tier or KV tensors held by frozen cycles.
    del conn, tensors
    gc.unfreeze()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    result: dict[str, Any] = {
        **case_fields(spec, blocks, args.layers, block_bytes),
        "path": path,
        "bytes_match": verified,
        "copy_time_measured": all(s.measured for s in stats.values() if s.batches),
    }
    for d in DIRECTIONS:
        r = rows[d]
        wall, span, copy, launch, issue = (
            statistics.median(r[k]) for k in ("wall", "from_launch", "copy", "launch", "issue")
        )
        ceil = ceiling[d]
        at_ceiling = step_bytes / (ceil * 1e9)  # seconds the step's bytes take at the ceiling

        def of_ceiling(seconds: float, at: float = at_ceiling) -> float:
            return at / seconds

        result[d] = {
            "ceiling_gbps": ceil,
            "wall_ms": wall * 1e3,
            "wall_ms_max": max(r["wall"]) * 1e3,
            "copy_ms": copy * 1e3,
            "wall_gbps": step_bytes / wall / 1e9,
            "copy_gbps": step_bytes / copy / 1e9 if copy > 0 else 0.0,
            "fraction_of_ceiling": of_ceiling(wall),
            "copy_fraction_of_ceiling": of_ceiling(copy) if copy > 0 else 0.0,
            "fixed_ms": (wall - at_ceiling) * 1e3,
            "from_launch_ms": span * 1e3,
            "from_launch_fraction": of_ceiling(span),
            "from_launch_fixed_ms": (span - at_ceiling) * 1e3,
            "from_launch_ms_all": [s * 1e3 for s in r["from_launch"]],
            "from_launch_fractions": [of_ceiling(s) for s in r["from_launch"]],
            "launch_us": launch * 1e6,
            "launch_us_max": max(r["launch"]) * 1e6,
            "issue_us": issue * 1e6,
            "walls_ms": [w * 1e3 for w in r["wall"]],
            "launches_us": [la * 1e6 for la in r["launch"]],
            "issues_us": [i * 1e6 for i in r["issue"]],
            "fractions": [of_ceiling(w) for w in r["wall"]],
        }
        if r[TL + "pre"]:  # the device's copy span on the host clock (a CUDA backend)
            result[d]["timeline"] = {p: statistics.median(r[TL + p]) for p in PHASES}
            result[d]["timelines"] = {p: r[TL + p] for p in PHASES}
        if floor is not None:
            result[d].update(floor_figures(floor[d]))
    return result


def bench_floor(
    args: argparse.Namespace,
    spec: LayoutSpec,
    blocks: int,
    tensors: dict[str, torch.Tensor],
    block_bytes: int,
    cpu_blocks: int,
    tick: Callable[[], None],
) -> dict[str, Any]:
    """``--floor-only``: the steps on copies that finish at once, nothing else (the tensors
    are only registered: never written, so on CPU their pages are never touched)."""
    num_gpu = 2 * blocks + 2
    null = build_connector(args, tensors, num_gpu, block_bytes, cpu_blocks, NullCopies())
    try:
        floor, _ = measure(args, null, None, blocks, num_gpu, tick, args.profiler)
    finally:
        null.worker.shutdown()
    del tensors
    gc.unfreeze()
    gc.collect()
    result = case_fields(spec, blocks, args.layers, block_bytes)
    for d in DIRECTIONS:
        result[d] = floor_figures(floor[d])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=200)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print(
            "bench_connector_transfer: --device cuda needs a CUDA device (or --device cpu)"
        )
        return 2
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("kvflow").setLevel(logging.WARNING)
    sys.setswitchinterval(5e-4)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.torch_threads)
    args.profiler = cProfile.Profile() if args.profile is not None else None
    results = []
    cases = [(LAYOUTS[n], b) for b in args.block_counts for n in args.layout_names]
    try:
        with Progress(console=console, transient=True) as progress:
            runs = (args.warmup + args.steps) * (2 if args.floor and not args.floor_only else 1)
            for spec, blocks in cases:
                task = progress.add_task(f"{spec.name}, {blocks} blocks", total=runs)
                tick = functools.partial(progress.advance, task)
                results.append(bench_layout(args, spec, blocks, tick))
                progress.remove_task(task)
    finally:
        structlog.reset_defaults()
        gc.unfreeze()
    if args.floor_only:
        render_floor(results, args, console)
    else:
        render(results, args, console)
    if args.profiler is not None:
        args.profiler.dump_stats(str(args.profile))
        what = "the floor's" if args.floor else "the real copies'"
        console.print(f"profile of {what} timed spans: {args.profile}")
    out = {
        "device": device_name(args.device),
        "worker_loop": args.worker_loop,
        "method": args.method,
        "ramp_mib": args.ramp_mib,
        "layers": args.layers,
        "steps": args.steps,
        "hashes": args.hashes,
        "floor_only": args.floor_only,
        "results": results,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    bad = [r["layout"] for r in results if r.get("bytes_match") is False]
    if bad:
        console.print(f"bytes differ after a round trip: {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
