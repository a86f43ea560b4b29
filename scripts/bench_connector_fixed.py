#!/usr/bin/env python3
"""A connector step, one revision against another, interleaved in one run.

Runs ``bench_connector_transfer.py`` (this checkout's script: the same engine calls for both) in
a fresh process per round and revision, alternating which goes first, with ``PYTHONPATH`` at
this checkout's ``src`` or at ``--base``'s (``git archive``, or a tree already unpacked:
``--base-src``, for a machine without the repository's history). Every measured step of every
round is pooled per revision, layout and direction; the table gives medians and interquartile
ranges, with the machine's load average before and after.

- ``--device cpu`` (the default): ``--floor-only``, kvflow's host work per step (the floor: a
  step's wall on copies that finish at once) and its launch;
- ``--device cuda``: the real copies (no floor run), each step's fraction of its process's
  ceiling (from the step's plan, and from its first launch call: the span issue 25 defines),
  the launch on the engine's thread and the CUDA backend's issue time.

    PYTHONPATH=src python scripts/bench_connector_fixed.py --base 2621fd2 --rounds 6 \\
        --json docs/data/connector_fixed_devbox.json
    PYTHONPATH=src python scripts/bench_connector_fixed.py --device cuda --base-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "scripts" / "bench_connector_transfer.py"
DIRECTIONS = ("store", "load")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", default="2621fd2", help="the revision to compare against")
    p.add_argument(
        "--base-src",
        type=Path,
        default=None,
        help="the base's src tree, already unpacked (instead of exporting --base)",
    )
    p.add_argument(
        "--branch-src",
        type=Path,
        default=ROOT / "src",
        help="the src tree measured against the base (default: this checkout's)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rounds", type=int, default=6, help="processes per revision, interleaved")
    p.add_argument("--layouts", default="4k,mla,32k,cross")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="measured steps per process")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hashes", choices=("engine", "kvflow"), default="engine")
    p.add_argument("--worker-loop", choices=("inline", "thread"), default="inline")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.blocks < 1:
        p.error("--rounds, --steps and --blocks must be positive")
    for opt, tree in (("--base-src", args.base_src), ("--branch-src", args.branch_src)):
        if tree is not None and not (tree / "kvflow").is_dir():
            p.error(f"{opt} {tree} holds no kvflow package")
    return args


# Per mode: the pooled metrics (JSON key of each step's list → column name, digits).
METRICS: dict[str, dict[str, tuple[str, int]]] = {
    "cpu": {"floors_ms": ("floor ms", 3), "floor_launches_us": ("launch µs", 0)},
    "cuda": {
        "fractions": ("of ceiling", 3),
        "from_launch_fractions": ("of ceiling from launch", 3),
        "launches_us": ("launch µs", 0),
        "issues_us": ("issue µs", 0),
    },
}


def export_src(rev: str, into: Path) -> Path:
    """``rev``'s ``src`` tree, unpacked under ``into``; its path."""
    archive = into / "src.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def one_run(args: argparse.Namespace, src: Path, out: Path) -> dict[str, Any]:
    """One benchmark process over ``src`` (``--floor-only`` on CPU); its JSON."""
    mode = ["--device", "cpu", "--floor-only"] if args.device == "cpu" else ["--no-floor"]
    cmd = [
        sys.executable,
        str(BENCH),
        *mode,
        "--layouts",
        args.layouts,
        "--blocks",
        str(args.blocks),
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--hashes",
        args.hashes,
        "--worker-loop",
        args.worker_loop,
        "--json",
        str(out),
    ]
    # The tree first; what the caller's path adds (packages installed beside) after it.
    rest = os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(src), rest) if x)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{src}: bench_connector_transfer exited {done.returncode}: {tail[0]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``xs``."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=190)
    revs = {"base": args.base, "branch": str(args.branch_src)}
    metrics = METRICS[args.device]
    pooled: dict[tuple[str, str, str], dict[str, list[float]]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvflow-fixed-") as tmp:
        if args.base_src is not None:
            base_src = args.base_src
            revs["base"] = str(args.base_src)
        else:
            try:
                base_src = export_src(args.base, Path(tmp))
            except subprocess.CalledProcessError:
                console.print(f"bench_connector_fixed: cannot export revision {args.base!r}")
                return 2
        trees = {"base": base_src, "branch": args.branch_src}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=2 * args.rounds)
            for r in range(args.rounds):
                order = ("base", "branch") if r % 2 == 0 else ("branch", "base")
                for name in order:
                    out = one_run(args, trees[name], Path(tmp) / f"{name}{r}.json")
                    for res in out["results"]:
                        for d in DIRECTIONS:
                            acc = pooled.setdefault((res["layout"], d, name), {})
                            for key in metrics:
                                acc.setdefault(key, []).extend(res[d][key])
                    progress.advance(task)
    load_after = os.getloadavg()
    what = "floor" if args.device == "cpu" else "step through the connector"
    table = Table(
        title=(
            f"connector {what}, {revs['base']} vs {revs['branch']}, interleaved "
            f"({args.rounds} processes × {args.steps} steps each; {args.blocks} scattered "
            f"blocks × {args.layers} layers, {args.worker_loop} loop, {args.hashes} hashes; "
            "medians, interquartile ranges in brackets)"
        )
    )
    columns = ["layout", "dir"]
    for title, _ in metrics.values():
        columns += [f"base {title}", f"branch {title}", "change"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("layout", "dir") else "right")
    rows = []
    for layout in [x for x in args.layouts.split(",") if x]:
        for d in DIRECTIONS:
            b, n = pooled[(layout, d, "base")], pooled[(layout, d, "branch")]
            row: dict[str, Any] = {"layout": layout, "dir": d, "steps": len(b[next(iter(b))])}
            cells = [layout, d]
            for key, (_title, digits) in metrics.items():
                bq, nq = quartiles(b[key]), quartiles(n[key])
                row[f"base_{key}"], row[f"branch_{key}"] = bq, nq
                cells += [
                    f"{bq[1]:.{digits}f} ({bq[0]:.{digits}f}–{bq[2]:.{digits}f})",
                    f"{nq[1]:.{digits}f} ({nq[0]:.{digits}f}–{nq[2]:.{digits}f})",
                    f"{nq[1] / bq[1] - 1:+.0%}",
                ]
            rows.append(row)
            table.add_row(*cells)
    console.print(table)
    console.print(
        f"load average (1, 5, 15 min) before {', '.join(f'{x:.1f}' for x in load_before)}, "
        f"after {', '.join(f'{x:.1f}' for x in load_after)}; {os.cpu_count()} cores"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "revisions": revs,
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "load_before": load_before,
                    "load_after": load_after,
                    "rows": rows,
                    "steps": {"|".join(k): v for k, v in pooled.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
