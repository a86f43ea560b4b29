"""Run benchmark scripts of two source trees interleaved and tabulate the medians, old vs new.

Each repeat runs every benchmark once per tree, alternating which tree goes first, so drift on a
shared machine falls on both alike. Every numeric cell of the scripts' rich tables is a figure
(keyed by its table, row labels and column); the report is the median over the repeats.

    python scripts/bench_compare.py --old /tmp/old19 --new . --repeats 5 \\
        --bench scheduler --bench runtime --bench vllm --json /tmp/compare.json

``--bench vllm`` runs vLLM's real scheduler with ``$KVFLOW_VLLM_PYTHON`` (default
``.venv-vllm/bin/python``, the venv ``scripts/check.sh`` installs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

BENCHES: dict[str, tuple[str, list[str]]] = {
    # name: (python, script and arguments, relative to the tree)
    "scheduler": (sys.executable, ["scripts/bench_scheduler.py"]),
    "runtime": (sys.executable, ["scripts/bench_runtime.py", "--quick"]),
    "pd_control": (sys.executable, ["scripts/bench_pd_control.py"]),
    # vLLM's real scheduler lives in its own venv (scripts/install_vllm_extra.sh makes it).
    "vllm": (
        str(Path(os.environ.get("KVFLOW_VLLM_PYTHON", ".venv-vllm/bin/python")).absolute()),
        ["scripts/bench_vllm_scheduler.py"],
    ),
}
LABELS = {"measure", "goal", "policy", "transfers/step", "coalesced", "steps", "state", "mode"}
LABELS |= {"configuration", "what"}
"""Column headers whose cells name a row rather than measure it."""


def _number(cell: str) -> float | None:
    text = cell.replace(",", "").replace("+", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def parse_tables(text: str) -> dict[str, float]:
    """Every numeric cell of the rich tables in ``text``: "table# | row labels | column" → value."""
    out: dict[str, float] = {}
    table = -1
    headers: list[str] = []
    for line in text.splitlines():
        if line.startswith("┃"):
            table += 1
            headers = [c.strip() for c in line.strip("┃").split("┃")]
        elif line.startswith("│") and headers:
            cells = [c.strip() for c in line.strip("│").split("│")]
            label = " / ".join(c for h, c in zip(headers, cells, strict=False) if h in LABELS)
            for h, c in zip(headers, cells, strict=False):
                value = _number(c)
                if h not in LABELS and value is not None:
                    out[f"{table} | {label} | {h}"] = value
    return out


def run_one(tree: Path, bench: str, extra: Sequence[str] = ()) -> dict[str, float]:
    python, argv = BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "COLUMNS": "400"}
    done = subprocess.run(
        [python, *argv, *extra], cwd=tree, env=env, capture_output=True, text=True, check=True
    )
    return parse_tables(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bench", action="append", choices=sorted(BENCHES), required=True)
    parser.add_argument("--json", type=Path, help="also write every sample here")
    parser.add_argument(
        "--bench-args",
        default="",
        help="arguments passed to every benchmark script, one string "
        "(e.g. '--decode 160 --logging unconfigured')",
    )
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {
        b: {"old": {}, "new": {}} for b in args.bench
    }
    with Progress() as progress:
        task = progress.add_task("benchmarks", total=args.repeats * len(args.bench) * 2)
        for rep in range(args.repeats):
            order = ("old", "new") if rep % 2 == 0 else ("new", "old")
            for bench in args.bench:
                for side in order:
                    extra = shlex.split(args.bench_args)
                    for key, value in run_one(trees[side], bench, extra).items():
                        samples[bench][side].setdefault(key, []).append(value)
                    progress.advance(task)
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
    table = Table(title=f"old vs new, median of {args.repeats} interleaved runs")
    for col in ("bench", "figure", "old", "new", "new / old"):
        table.add_column(col, justify="left" if col in ("bench", "figure") else "right")
    for bench in args.bench:
        old, new = samples[bench]["old"], samples[bench]["new"]
        for key in old:
            if key not in new:
                continue
            a, b = statistics.median(old[key]), statistics.median(new[key])
            ratio = f"{b / a:.3f}" if a else "-"
            table.add_row(bench, key, f"{a:.4g}", f"{b:.4g}", ratio)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
