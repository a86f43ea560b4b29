"""What a store costs the compute it runs beside, by how its bytes leave the GPU.

At 0 % reuse every block an engine computes is stored: a 4,096-token prefill step of llama-1b
leaves 128 MiB (256 blocks of 16 layers' K and V pages of 16 KiB) to copy while the next step's
GEMMs run. This times such a step's GEMM chain alone and beside one store of its size, issued
each way below on the same GPU, round by round so clock drift hits every variant alike:

- ``staged/N``: kvflow's CUDA backend as the engine's inline worker loop drives it (a gather
  kernel of ``N`` CTAs, ``CudaConfig.gather_ctas``, packs the pages into a staging slot, one DMA
  copies the slot to the pinned CPU tier), for each ``N`` of ``--gather-ctas``;
- ``2d``: no kernel at all, one ``cuMemcpy2DAsync`` per region per run of consecutive blocks
  (the GPU pages a page apart, the CPU pages a CPU block apart): the copy engines alone, the
  copies exactly as ``CudaConfig.store_dma`` issues them (``plan.pitched_direct`` and the
  backend's ``pitched_copy.Memcpy2D``);
- ``2d-batch``: the same 2D copies in one ``cuMemcpy3DBatchAsync`` (``pitched_copy.Memcpy3DBatch``,
  what the backend issues with ``CudaConfig.pitched_batch``): one driver call;
- ``2d-split``: the same 2D copies, every other region on a second stream, so that two copy
  engines can serve them;
- ``contiguous``: one ``cudaMemcpyAsync`` of the same bytes from one contiguous GPU buffer, the
  floor of any DMA of that size;
- ``none``: the GEMMs alone.

Per variant: the GEMM step's median time and its excess over ``none`` in the same rounds, the
store's own copy time (CUDA events) and GB/s, the host time to issue it, and, where
``nvidia-smi`` is on the PATH, the median SM clock and board power while the variant ran.

``--kv-heads`` sets the page size (2 KiB a head): 2 gives 4 KiB pages, where a 2D copy's rows
are shortest.

    PYTHONPATH=src python scripts/bench_store_beside_compute.py [--rounds 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import evolve
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflow.backends.base import CopyBatch, FenceStatus
from kvflow.backends.cuda import CudaBackend, CudaConfig
from kvflow.backends.cuda import driver as drv
from kvflow.backends.cuda.pitched_copy import Memcpy2D, Memcpy3DBatch
from kvflow.backends.cuda.plan import PITCHED_MIN_ROWS, RegionTable, as_i64, pitched_direct
from kvflow.backends.torch_layout import layout_of
from kvflow.core.transfer import Direction

DMA_VARIANTS = ("2d", "2d-batch", "2d-split", "contiguous")


def variants(gather_ctas: Sequence[int]) -> list[str]:
    """Every variant timed: none, the staged store at each gather width, the DMA-only ones."""
    return ["none", *(f"staged/{c}" for c in gather_ctas), *DMA_VARIANTS]


LAYERS, BLOCK_TOKENS, HEAD_DIM = 16, 16, 64  # llama-1b's KV cache, with --kv-heads 8
GPU_BLOCKS, CPU_BLOCKS = 4096, 1024


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=256, help="blocks a store copies (≤ 1,024)")
    p.add_argument(
        "--runs", type=int, default=4, help="runs of consecutive GPU blocks (each 4 or more)"
    )
    p.add_argument(
        "--kv-heads",
        type=int,
        default=8,
        help="KV heads a layer: a page is 2 KiB a head (8: llama-1b's 16 KiB pages)",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds over every variant")
    p.add_argument("--reps", type=int, default=15, help="steps of each variant a round")
    p.add_argument(
        "--gather-ctas",
        type=lambda v: [int(c) for c in v.split(",")],
        default=[64, 16],
        help="the staged store's gather widths, comma-separated (64 is the default config's)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if any(c <= 0 for c in args.gather_ctas):
        p.error("--gather-ctas takes positive CTA counts")
    if not 1 <= args.runs * PITCHED_MIN_ROWS <= args.blocks <= CPU_BLOCKS // 2:
        p.error(
            f"need 1 <= --runs, --runs x {PITCHED_MIN_ROWS} <= --blocks <= {CPU_BLOCKS // 2} "
            "(runs shorter than that get no 2D copies)"
        )
    if not 1 <= args.kv_heads <= 64:
        p.error("--kv-heads takes 1 to 64")
    if args.rounds < 1 or args.reps < 4:
        p.error("need --rounds >= 1 and --reps >= 4 (the first three steps of a round are warm-up)")
    return args


def timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class ClockSampler:
    """``nvidia-smi`` sampled every 20 ms on a thread: (host time, SM MHz, watts)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        exe = shutil.which("nvidia-smi")
        self._proc = (
            None
            if exe is None
            else subprocess.Popen(
                [
                    exe,
                    "--query-gpu=clocks.sm,power.draw",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "20",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
        if self._proc is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stdout = None if self._proc is None else self._proc.stdout
        if stdout is None:
            return
        for line in stdout:
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" on boards that do not report one of them
                continue
            self.samples.append((time.perf_counter(), clock, power))

    def between(self, spans: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
        """Median SM clock and power of the samples inside ``spans``, or None."""
        inside = [(c, w) for t, c, w in self.samples if any(a <= t <= b for a, b in spans)]
        if not inside:
            return None
        return statistics.median(c for c, _ in inside), statistics.median(w for _, w in inside)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()


class Rig:
    """A llama-1b-shaped KV cache, the GEMM chain of a 4k-token step, and one store, four ways."""

    def __init__(
        self, blocks: int, runs: int, gather_ctas: Sequence[int], kv_heads: int = 8
    ) -> None:
        dev = torch.device("cuda")
        shape = (2, GPU_BLOCKS, BLOCK_TOKENS, kv_heads, HEAD_DIM)
        self.kv = {
            f"model.layers.{i}.self_attn": torch.randn(shape, dtype=torch.bfloat16, device=dev)
            for i in range(LAYERS)
        }
        self.page = BLOCK_TOKENS * kv_heads * HEAD_DIM * 2
        self.block_bytes = 2 * LAYERS * self.page
        # Runs far apart in the GPU cache, as a step's requests' blocks are; CPU ids ascending,
        # as kvflow's CPU pool hands them out.
        per_run = [blocks // runs + (1 if r < blocks % runs else 0) for r in range(runs)]
        gap = GPU_BLOCKS // runs
        self.gpu_runs = [(r * gap + 7, n) for r, n in enumerate(per_run)]
        gpu_ids = [g for start, n in self.gpu_runs for g in range(start, start + n)]
        self.cpu_first = CPU_BLOCKS // 2
        cpu_ids = list(range(self.cpu_first, self.cpu_first + blocks))
        self.bytes = blocks * self.block_bytes
        self.backends = {}
        for ctas in gather_ctas:
            cfg = CudaConfig(launch_thread=False, completion_threads=False, gather_ctas=ctas)
            backend = self.backends[f"staged/{ctas}"] = CudaBackend(0, cfg)
            backend.register_kv_caches(self.kv, GPU_BLOCKS)
            backend.allocate_cpu_tier([CPU_BLOCKS])
        self.batch = CopyBatch(Direction.STORE, (tuple(gpu_ids),), (tuple(cpu_ids),))
        self.cpu = torch.empty(CPU_BLOCKS * self.block_bytes, dtype=torch.uint8, pin_memory=True)
        self.flat = torch.empty(self.bytes, dtype=torch.uint8, device=dev)
        self.flat_host = torch.empty(self.bytes, dtype=torch.uint8, pin_memory=True)
        self.side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.side2 = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        # The 2D copies exactly as ``CudaConfig.store_dma`` issues them: the backend's plan and
        # driver call, into this script's own pinned buffer.
        table = RegionTable.from_group(layout_of(self.kv, GPU_BLOCKS).groups[0])
        copies = pitched_direct(
            table, as_i64(gpu_ids), as_i64(cpu_ids), self.cpu.data_ptr(), store=True
        )
        assert copies is not None, "parse_args keeps the runs long enough for 2D copies"
        self.copies_2d = copies
        self._memcpy2d = Memcpy2D()
        version = int(drv.check(drv.cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        self._batch3d = Memcpy3DBatch.resolve(version, 0)
        w1 = torch.randn(2048, 8192, dtype=torch.bfloat16, device=dev)
        w2 = torch.randn(8192, 2048, dtype=torch.bfloat16, device=dev)
        x = torch.randn(4096, 2048, dtype=torch.bfloat16, device=dev)

        def gemms() -> None:
            y = x
            for _ in range(LAYERS):
                y = (y @ w1) @ w2 * 1e-3

        self.gemms = gemms

    def store_2d(self, streams: Sequence[torch.cuda.Stream], *, batch: bool = False) -> None:
        """The store as DMA only: one 2D copy per region per run (run by run, the regions in
        order), copy ``i`` on ``streams[i % len(streams)]``; ``batch``: all of a stream's
        copies in one ``cuMemcpy3DBatchAsync``, else one ``cuMemcpy2DAsync`` each."""
        copies, k = self.copies_2d, len(streams)
        call = self._batch3d if batch else self._memcpy2d
        for j, stream in enumerate(streams):
            part = evolve(
                copies, dst=copies.dst[j::k], src=copies.src[j::k], rows=copies.rows[j::k]
            )
            call(part, stream.cuda_stream)

    def check_2d(self) -> None:
        """The 2D store, on one stream and on two, one call per copy and batched, puts every
        page where the CPU tier's block-major layout puts it."""
        for streams, batch in (
            ([self.side], False),
            ([self.side, self.side2], False),
            ([self.side], True),
        ):
            self.cpu.zero_()
            for s in streams:
                s.wait_stream(torch.cuda.current_stream())
            self.store_2d(streams, batch=batch)
            torch.cuda.synchronize()
            self._check_placed()

    def _check_placed(self) -> None:
        cpu_id = self.cpu_first
        for start, n in self.gpu_runs:
            for g in range(start, start + n):
                for r in range(2 * LAYERS):  # block-major: each layer's K page, then its V
                    layer, k = divmod(r, 2)
                    offset = r * self.page
                    page = self.kv[f"model.layers.{layer}.self_attn"][k, g]
                    at = cpu_id * self.block_bytes + offset
                    got = self.cpu[at : at + self.page]
                    if not torch.equal(got, page.contiguous().view(torch.uint8).reshape(-1).cpu()):
                        raise AssertionError(f"2D store: block {g} region {r} misplaced")
                cpu_id += 1

    def step(self, variant: str) -> tuple[float, float, float]:
        """One step beside one store: (GEMM ms, store copy ms, issue µs on the host)."""
        torch.cuda.synchronize()
        self.gemms()  # the step whose KV the store copies
        begin, end, s0, s1 = (timing_event() for _ in range(4))
        begin.record()
        t0 = time.perf_counter()
        fence, backend = None, self.backends.get(variant)
        if backend is not None:
            fence = backend.submit(self.batch, [backend.compute_fence()])
        elif variant != "none":
            self.side.wait_event(begin)
            s0.record(self.side)
            if variant in ("2d", "2d-batch"):
                self.store_2d([self.side], batch=variant == "2d-batch")
            elif variant == "2d-split":
                self.side2.wait_stream(self.side)  # starts at s0 too
                self.store_2d([self.side, self.side2])
                self.side.wait_stream(self.side2)  # s1 after both streams' copies
            else:
                with torch.cuda.stream(self.side):
                    self.flat_host.copy_(self.flat, non_blocking=True)
            s1.record(self.side)
        issue_us = (time.perf_counter() - t0) * 1e6
        self.gemms()  # the step the store runs beside
        end.record()
        torch.cuda.synchronize()
        store_ms = 0.0
        if backend is not None and fence is not None:
            if backend.query(fence) is not FenceStatus.DONE:
                raise RuntimeError("the staged store's fence did not settle after a synchronize")
            store_ms = (backend.copy_seconds(fence) or 0.0) * 1e3
        elif variant != "none":
            store_ms = s0.elapsed_time(s1)
        return begin.elapsed_time(end), store_ms, issue_us

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


def measure(
    rig: Rig, args: argparse.Namespace, clocks: ClockSampler, advance: Callable[[], None]
) -> dict[str, Any]:
    names = variants(args.gather_ctas)
    cells: dict[str, list[tuple[float, float, float]]] = {v: [] for v in names}
    spans: dict[str, list[tuple[float, float]]] = {v: [] for v in names}
    excess: dict[str, list[float]] = {v: [] for v in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        medians = {}
        for variant in order:
            t0 = time.perf_counter()
            steps = [rig.step(variant) for _ in range(args.reps)][3:]
            spans[variant].append((t0, time.perf_counter()))
            cells[variant] += steps
            medians[variant] = statistics.median(s[0] for s in steps)
            advance()
        for variant in names:
            excess[variant].append(medians[variant] / medians["none"] - 1)
    out: dict[str, Any] = {}
    for variant in names:
        steps = cells[variant]
        store_ms = statistics.median(s[1] for s in steps)
        clock = clocks.between(spans[variant])
        out[variant] = {
            "gemm_ms": statistics.median(s[0] for s in steps),
            "gemm_excess_median": statistics.median(excess[variant]),
            "gemm_excess_by_round": excess[variant],
            "store_ms": store_ms,
            "store_gbps": rig.bytes / store_ms / 1e6 if store_ms else None,
            "issue_us": statistics.median(s[2] for s in steps),
            "sm_mhz": None if clock is None else clock[0],
            "watts": None if clock is None else clock[1],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not torch.cuda.is_available():
        console.print("bench_store_beside_compute: needs a CUDA device")
        return 2
    rig = Rig(args.blocks, args.runs, args.gather_ctas, args.kv_heads)
    rig.check_2d()
    clocks = ClockSampler()
    device = torch.cuda.get_device_name()
    try:
        with Progress(console=console, transient=True) as progress:
            names = variants(args.gather_ctas)
            task = progress.add_task("store beside compute", total=args.rounds * len(names))
            for variant in names:  # warm-up: kernels, pinning, the backend's first batch
                rig.step(variant)
            out = measure(rig, args, clocks, lambda: progress.advance(task))
    finally:
        clocks.close()
        rig.close()
    table = Table(
        title=f"a {rig.bytes / 2**20:.0f} MiB store ({args.blocks} blocks in {args.runs} runs, "
        f"{rig.page // 1024} KiB pages) beside a 4k-token step's GEMMs, {device}"
    )
    for col in (
        "store",
        "GEMM step ms",
        "vs none (median of rounds)",
        "store ms",
        "GB/s",
        "issue µs",
        "SM MHz",
        "W",
    ):
        table.add_column(col, justify="left" if col == "store" else "right")
    for variant, f in out.items():
        table.add_row(
            variant,
            f"{f['gemm_ms']:.3f}",
            "" if variant == "none" else f"{f['gemm_excess_median'] * 100:+.1f} %",
            "" if variant == "none" else f"{f['store_ms']:.2f}",
            "" if f["store_gbps"] is None else f"{f['store_gbps']:.1f}",
            "" if variant == "none" else f"{f['issue_us']:.0f}",
            "" if f["sm_mhz"] is None else f"{f['sm_mhz']:.0f}",
            "" if f["watts"] is None else f"{f['watts']:.0f}",
        )
    console.print(table)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "bytes": rig.bytes,
                    "page_bytes": rig.page,
                    **vars_json(args),
                    "variants": out,
                }
            )
        )
        console.print(f"wrote {args.json}")
    return 0


def vars_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "json"}


if __name__ == "__main__":
    sys.exit(main())
