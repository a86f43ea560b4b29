"""Benchmark PD transports side by side: GB/s of scattered-block hand-offs against the ceiling of
the same link in the same run, descriptors (or copies) issued and the host cost of a launch.

Usage: python scripts/bench_pd_transports.py [--transports gloo nixl] [--device cpu]
           [--sizes-kib 4 8 16 32 64 128] [--mib 32] [--repeat 5] [--mode read]
           [--method auto] [--regions 1] [--barrier spin] [--pin] [--in-flight 8] [--json FILE]
       python scripts/bench_pd_transports.py --device cuda --transports cuda-ipc nixl
Goals (issue 22): >= 90 % of the ceiling at >= 32 KiB blocks, >= 70 % at 4 KiB; CUDA IPC >= 2x a
torch index gather of the same blocks.

Two spawned processes, P (rank 0) and D (rank 1), one transport pair each. Per block size, P's
``--mib`` MiB are N blocks at scattered ids of a 2N-block tensor, moved to scattered ids on D
(and, for reference, the same N blocks consecutive on both sides: "contig", the transport's own
large-copy speed over the same link);
time is the initiator's (D for a pull, P for gloo and pushes), from a barrier to its fence
settled; the median of ``--repeat`` runs after one warm-up. The barrier spins on shared memory
(``--barrier store`` blocks on the rendezvous store's socket instead, the method before the
fourteenth session); ``--pin`` puts P and D on CPUs of two different physical cores. "launch µs" is the initiator's
launch call, "passive µs" the other side's (for CUDA IPC and NIXL the passive side's launch
gates the copy). The ceiling, in the same process:
on CPU a memcpy of the same bytes (one contiguous ``copy_``, pages touched first); on CUDA a
contiguous device-to-device copy through the mapping of the peer's tensor (cuda-ipc), or of
local memory (nixl). On CUDA also a torch index gather of the same blocks (``index_select``
through the mapping). Bytes are checked on D.

"in flight" is ``--in-flight`` K hand-offs of the same blocks launched back to back, each on its
own channel (as an engine with K requests in flight launches them), from a barrier until the
last fence settled, against K contiguous copies back to back with one synchronize: a transport's
bandwidth when its host work overlaps the copy before it. The single hand-off's figure is
latency-bound: its host work (P's launch and ring, D's launch, the fence) adds to one copy.

``--regions R`` makes each block R pages of the given size, one per registered tensor (a real
KV cache: a block is a K page and a V page per layer), so the same bytes are R x fewer blocks;
the gather then runs region by region and the ceiling copies the same bytes between two local
buffers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.rendezvous import PairStore
from kvflow.backends.pd.transport import geometry, plan_chunks
from kvflow.core.pd.common import BlockPairs, LaunchCopies
from kvflow.engine.distributed import free_port
from kvflow.runtime.clock import SystemClock


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _copy_times(
    src: torch.Tensor, dst: torch.Tensor, device: str, repeat: int, k: int
) -> tuple[float, float]:
    """Median seconds of one contiguous ``copy_`` and of ``k`` back to back (one synchronize
    after the last: the in-flight ceiling), after a warm-up of each."""
    one, back_to_back = [], []
    for _ in range(repeat + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        one.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(k):
            dst.copy_(src)
        _sync(device)
        back_to_back.append(time.perf_counter() - t0)
    return statistics.median(one[1:]), statistics.median(back_to_back[1:])


def _ceiling(device: str, nbytes: int, repeat: int, k: int) -> tuple[float, float]:
    """Seconds for one contiguous copy of ``nbytes`` in this process (pages touched first), and
    for ``k`` of them back to back."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return _copy_times(src, dst, device, repeat, k)


def _counter(t: Any) -> int:
    stats = getattr(t, "stats", None) or {}
    return int(stats.get("descriptors", stats.get("copies", 0)))


class SpinBarrier:
    """Both processes spin on a shared-memory counter a side instead of blocking on the store's
    socket: a process woken from a blocking wait runs its first host calls on a cold core, which
    the ceiling (timed in a process that only spins on ``synchronize``) never pays, and a
    serving engine's loop does not sleep between steps either."""

    def __init__(self, store: PairStore, rank: int) -> None:
        if rank == 0:
            self.path = f"/dev/shm/kvflow-bench-bar-{os.getpid()}-{time.time_ns()}"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 16)
            store.publish("spin", self.path.encode())
        else:
            self.path = store.fetch("spin").decode()
            fd = os.open(self.path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 16)
        finally:
            os.close(fd)
        self._cells = np.frombuffer(self._mm, dtype=np.int64)
        self._rank = rank
        store.publish(f"spin-ready{rank}", b"1")
        store.fetch(f"spin-ready{1 - rank}")

    def wait(self, step: int, timeout_s: float = 120.0) -> None:
        cells, peer = self._cells, 1 - self._rank
        cells[self._rank] = step
        deadline = time.perf_counter() + timeout_s
        while cells[peer] < step:
            if time.perf_counter() > deadline:
                raise SystemExit(f"bench_pd_transports: the peer never reached barrier {step}")

    def close(self) -> None:
        del self._cells
        self._mm.close()
        if self._rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def two_cores() -> tuple[int, int] | None:
    """Two CPUs of this process's affinity on different physical cores (no shared hyperthread),
    or None if there are not two."""
    seen: dict[tuple[str, str], int] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((base / "physical_package_id").read_text(), (base / "core_id").read_text())
        except OSError:
            key = (str(cpu), "")
        seen.setdefault(key, cpu)
    # Not the first core: interrupts and the runner's own threads tend to land there.
    cpus = list(seen.values())[1:3] if len(seen) > 2 else list(seen.values())[:2]
    return (cpus[0], cpus[1]) if len(cpus) == 2 else None


def _rank(rank: int, name: str, ports: tuple[int, int], cfg: dict[str, Any]) -> dict[str, Any]:
    from kvflow.backends.pd.registry import make_transport

    device = cfg["device"]
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    clock = SystemClock()
    options: dict[str, Any] = {}
    if name in ("nixl", "cuda-ipc"):
        options["mode"] = cfg["mode"]
    if name == "cuda-ipc":
        options["method"] = cfg["method"]
    if name == "gloo":
        options.update(slots=4, slot_bytes=8 << 20)
    t = make_transport(
        name,
        pair_rank=rank,
        host="127.0.0.1",
        port=ports[0],
        now=clock.now,
        timeout_s=120.0,
        options=options,
    )
    bar = PairStore(pair_rank=rank, host="127.0.0.1", port=ports[1], timeout_s=120.0, what="bar")
    if cfg["pin"]:
        os.sched_setaffinity(0, {cfg["cpus"][rank]})
    spin = SpinBarrier(bar, rank) if cfg["barrier"] == "spin" else None
    total = cfg["mib"] << 20
    nreg = cfg["regions"]
    sizes = [kib << 10 for kib in cfg["sizes_kib"]]
    caches = []
    for bs in sizes:
        n = 2 * (total // (bs * nreg))
        c = (
            torch.randint(0, 255, (nreg, n, bs), dtype=torch.uint8, generator=_gen(bs))
            if rank == 0
            else torch.zeros(nreg, n, bs, dtype=torch.uint8)
        )
        caches.append(list(c.to(device).unbind(0)))
    out: dict[str, Any] = {"sizes": {}}
    step = 0

    def barrier() -> None:
        nonlocal step
        step += 1
        if spin is not None:
            spin.wait(step)
            return
        bar.publish(f"b{step}", b"1")
        bar.fetch(f"b{step}")

    try:
        t.register(caches)
        # The side whose fence means the bytes are in place: D for gloo and pulls, P for pushes.
        initiator = rank == (1 if name == "gloo" or cfg["mode"] == "read" else 0)
        out["stats"] = getattr(t, "stats", {})
        for g, bs in enumerate(sizes):
            n = total // (bs * nreg)
            perm = torch.randperm(2 * n, generator=_gen(bs + 1))
            src, dst = perm[:n].tolist(), perm[n:].tolist()
            mine, theirs = (src, dst) if rank == 0 else (dst, src)
            # As the PD managers hand them: a group's pairs in two columns.
            none = BlockPairs((), ())
            pairs = tuple(BlockPairs(mine, theirs) if k == g else none for k in range(len(sizes)))
            contiguous = tuple(
                BlockPairs(range(n), range(n)) if k == g else none for k in range(len(sizes))
            )
            times, launch_s, issued, contig = [], [], [], []
            for r in range(cfg["repeat"] + 1):
                # Contiguous first: the scattered copy is the last, so D checks its bytes.
                for label, ps in (("c", contiguous), ("s", pairs)):
                    barrier()
                    before = _counter(t)
                    t0 = time.perf_counter()
                    op = LaunchCopies(f"b{bs}{label}", r, "peer", rank == 0, ps, g + 1)
                    fence = t.launch(op)
                    launched = time.perf_counter() - t0
                    while t.query(fence) is FenceStatus.PENDING:
                        pass
                    took = time.perf_counter() - t0
                    if t.query(fence) is not FenceStatus.DONE:
                        raise SystemExit(f"bench_pd_transports: a {name} launch failed")
                    if label == "s":
                        times.append(took)
                        launch_s.append(launched)
                        issued.append(_counter(t) - before)
                    else:
                        contig.append(took)
                    barrier()
            # In flight: ``--in-flight`` hand-offs of the same blocks launched back to back, each
            # on its own channel, as an engine with several requests in flight launches them:
            # the next one's host work overlaps this one's copy.
            k = cfg["in_flight"]
            in_flight = []
            for r in range(cfg["repeat"] + 1 if k > 1 else 0):
                barrier()
                t0 = time.perf_counter()
                fences = [
                    t.launch(LaunchCopies(f"b{bs}k{j}", r, "peer", rank == 0, pairs, 1000 + j))
                    for j in range(k)
                ]
                pending = list(fences)
                while pending:
                    pending = [f for f in pending if t.query(f) is FenceStatus.PENDING]
                in_flight.append(time.perf_counter() - t0)
                if any(t.query(f) is not FenceStatus.DONE for f in fences):
                    raise SystemExit(f"bench_pd_transports: an in-flight {name} launch failed")
                barrier()
            fig: dict[str, Any] = {
                "blocks": n,
                "regions": nreg,
                "bytes": n * bs * nreg,
                "initiator": initiator,
            }
            if initiator:
                fig.update(
                    seconds=statistics.median(times[1:]),
                    contiguous_s=statistics.median(contig[1:]),
                    launch_us=statistics.median(launch_s[1:]) * 1e6,
                    issued=issued[-1],
                )
                if in_flight:
                    fig["in_flight_s"] = statistics.median(in_flight[1:])
                    fig["in_flight"] = k
                if name == "gloo":  # staging chunks, one wire op each
                    geo = geometry(caches)
                    fig["issued"] = len(plan_chunks(g + 1, pairs, geo, 8 << 20))
            else:  # the passive side's launch gates the initiator's copy (CUDA IPC, NIXL)
                fig["passive_launch_us"] = statistics.median(launch_s[1:]) * 1e6
            if rank == 1:
                want = torch.randint(
                    0, 255, (nreg, 2 * n, bs), dtype=torch.uint8, generator=_gen(bs)
                )
                got = torch.stack([c.cpu() for c in caches[g]])
                fig["bytes_match"] = bool(
                    torch.equal(got[:, torch.tensor(dst)], want[:, torch.tensor(src)])
                )
                mapped = getattr(t, "_mapped", None)
                if device == "cuda" and mapped:
                    fig.update(_cuda_baselines(mapped[g], caches[g], src, dst, cfg["repeat"], k))
                else:
                    fig["ceiling_s"], fig["in_flight_ceiling_s"] = _ceiling(
                        device, n * bs * nreg, cfg["repeat"], k
                    )
            out["sizes"][str(bs >> 10)] = fig
        out["stats"] = getattr(t, "stats", {})
        out["done_at"] = clock.now()  # perf_counter: CLOCK_MONOTONIC on Linux, one for both
        # D's checks and ceilings above read P's tensors through its mappings, and P's close
        # waits (bounded) for D to drop them: P closes only once D is through with them.
        barrier()
        out["close_at"] = clock.now()
    finally:
        t.close()
        if spin is not None:
            spin.close()
    return out


def _cuda_baselines(
    peer: list[torch.Tensor],
    local: list[torch.Tensor],
    src: list[int],
    dst: list[int],
    repeat: int,
    k: int,
) -> dict[str, float]:
    """The ceiling: one contiguous device-to-device copy of the same bytes, through the mapping
    of the peer's tensor when it is one region (with more, two local buffers of that size: on
    one GPU the mapping is the same memory); and a torch index gather of the blocks, region by
    region (what a torch user writes)."""
    n = len(src)
    nbytes = n * sum(t[0].numel() * t.element_size() for t in local)
    if len(peer) == 1:
        a, b = peer[0][:n], local[0][:n]
    else:
        a = torch.empty(nbytes, dtype=torch.uint8, device=local[0].device)
        b = torch.empty_like(a)
    si, di = torch.tensor(src, device=local[0].device), torch.tensor(dst, device=local[0].device)
    ceiling, back_to_back = _copy_times(a, b, "cuda", repeat, k)
    gather = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for p, lo in zip(peer, local, strict=True):
            lo.index_copy_(0, di, p.index_select(0, si))
        torch.cuda.synchronize()
        gather.append(time.perf_counter() - t0)
    return {
        "ceiling_s": ceiling,
        "in_flight_ceiling_s": back_to_back,
        "index_gather_s": statistics.median(gather[1:]),
    }


def _pair(name: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    ports = (free_port(), free_port())
    with ctx.Pool(2) as pool:
        jobs = [pool.apply_async(_rank, (r, name, ports, cfg)) for r in (0, 1)]
        return [j.get(timeout=cfg["timeout_s"]) for j in jobs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--transports",
        nargs="+",
        default=None,
        help="default: gloo nixl on cpu, cuda-ipc nixl on cuda",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--mib", type=int, default=32, help="bytes per hand-off, MiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mode", choices=("read", "write"), default="read")
    parser.add_argument("--method", choices=("auto", "dma", "kernel"), default="auto")
    parser.add_argument("--regions", type=int, default=1, help="pages per block (tensors)")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument(
        "--barrier",
        choices=("spin", "store"),
        default="spin",
        help="spin on shared memory between hand-offs (default), or block on the store's socket",
    )
    parser.add_argument(
        "--pin", action="store_true", help="pin P and D to CPUs of two different physical cores"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=8,
        help="hand-offs launched back to back for the in-flight GB/s (1: single hand-offs only)",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    cpus = two_cores() if args.pin else None
    if args.pin and cpus is None:
        parser.error("--pin needs two physical cores in this process's CPU affinity")
    if args.regions < 1 or args.mib < 1 or args.repeat < 1 or args.in_flight < 1:
        parser.error("--regions, --mib, --repeat and --in-flight must be positive")
    transports = args.transports or (
        ["gloo", "nixl"] if args.device == "cpu" else ["cuda-ipc", "nixl"]
    )
    cfg = {
        "device": args.device,
        "sizes_kib": args.sizes_kib,
        "mib": args.mib,
        "repeat": args.repeat,
        "mode": args.mode,
        "method": args.method,
        "regions": args.regions,
        "timeout_s": args.timeout_s,
        "barrier": args.barrier,
        "pin": args.pin,
        "cpus": cpus,
        "in_flight": args.in_flight,
    }
    console = Console(width=max(Console().width, 120))
    rows: dict[str, Any] = {}
    for i, name in enumerate(transports, 1):
        with console.status(
            f"[{i}/{len(transports)}] {name}: two processes, {args.mib} MiB per size ..."
        ):
            res = _pair(name, cfg)
        rows[name] = _merge(res)
        console.print(f"{name}: done ({len(rows[name]['sizes'])} sizes)")
    table = Table(
        title=f"PD transports, {args.mib} MiB of scattered blocks per hand-off ({args.device}, "
        f"{args.regions} page(s) a block; in flight: {args.in_flight} back to back)"
    )
    for col in ("transport", "page KiB", "blocks", "GB/s", "contig GB/s", "ceiling GB/s",
                "of ceiling", "in flight GB/s", "in flight: of ceiling", "vs gather",
                "issued", "launch µs", "passive µs", "ok"):  # fmt: skip
        table.add_column(col, justify="right")
    for name, r in rows.items():
        for kib, f in r["sizes"].items():
            gather = f.get("vs_index_gather")
            passive = f.get("passive_launch_us")
            in_flight = f.get("in_flight_gbs")
            table.add_row(name, kib, str(f["blocks"]), f"{f['gbs']:.2f}",
                          f"{f['contiguous_gbs']:.2f}", f"{f['ceiling_gbs']:.2f}",
                          f"{f['of_ceiling']:.0%}",
                          "—" if in_flight is None else f"{in_flight:.2f}",
                          "—" if in_flight is None else f"{f['of_in_flight_ceiling']:.0%}",
                          "—" if gather is None else f"{gather:.2f}×",
                          str(f["issued"]), f"{f['launch_us']:.0f}",
                          "—" if passive is None else f"{passive:.0f}",
                          "yes" if f["bytes_match"] else "NO")  # fmt: skip
    console.print(table)
    for name, r in rows.items():
        chosen = {k: v for k, v in r["stats"].items() if k in ("backend", "ucx", "mode", "paths")}
        if chosen:
            console.print(f"{name} chose: {chosen}")
    if args.json:
        figures = {
            "machine": platform.node(),
            "date": time.strftime("%Y-%m-%d"),
            "config": cfg,
            "transports": rows,
            "load_average_1m": os.getloadavg()[0],
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if all(f["bytes_match"] for r in rows.values() for f in r["sizes"].values()) else 1


def _merge(res: list[dict[str, Any]]) -> dict[str, Any]:
    """The initiator's timings and D's checks and ceilings, per size."""
    sizes = {}
    for kib, d_fig in res[1]["sizes"].items():
        fig = {**res[0]["sizes"][kib], **d_fig}
        timed = res[0]["sizes"][kib] if res[0]["sizes"][kib]["initiator"] else d_fig
        fig.update({k: timed[k] for k in ("seconds", "contiguous_s", "launch_us", "issued")})
        if "in_flight_s" in timed:
            k = fig["in_flight"] = timed["in_flight"]
            fig["in_flight_s"] = timed["in_flight_s"]
            fig["in_flight_gbs"] = k * fig["bytes"] / fig["in_flight_s"] / 1e9
            fig["of_in_flight_ceiling"] = fig["in_flight_ceiling_s"] / fig["in_flight_s"]
        fig["gbs"] = fig["bytes"] / fig["seconds"] / 1e9
        fig["contiguous_gbs"] = fig["bytes"] / fig["contiguous_s"] / 1e9
        fig["ceiling_gbs"] = fig["bytes"] / fig["ceiling_s"] / 1e9
        fig["of_ceiling"] = fig["gbs"] / fig["ceiling_gbs"]
        if "index_gather_s" in fig:
            fig["vs_index_gather"] = fig["index_gather_s"] / fig["seconds"]
        sizes[kib] = fig
    d_initiates = any(f["initiator"] for f in res[1]["sizes"].values())
    return {
        "sizes": sizes,
        "stats": res[1 if d_initiates else 0]["stats"],
        "p_closed_after_d_done": res[0]["close_at"] >= res[1]["done_at"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
