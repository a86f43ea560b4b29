#!/usr/bin/env python3
"""Where the connector's time on the engine thread goes at 0 % reuse, function by function.

Runs ``scripts/bench_engine_offload.py`` (every argument is passed to it; its own tables come
first) with a timer around each of the functions in ``TARGETS``: the connector's calls, the
inline runtime's store launch, the DMA executor's submit, the CUDA backend's issue path and the
core's planning and commits. A function's time includes what it calls; a call nested in another
call of the same function counts once. The timers cost a fraction of a µs a call, far less than
cProfile, which on Python 3.12 costs more than what it measures here. A second table gives the
garbage collector's passes during the timed runs, by mode and by the innermost timed function
they interrupted. Calls a run count the untimed warm-up run too (it runs the same steps).

    PYTHONPATH=src python scripts/time_offload_parts.py --model llama-1b --device cuda \\
        --scenario noreuse --repeat 3 --parts-json parts.json
"""

from __future__ import annotations

import gc
import importlib
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

try:  # imported as part of the scripts package (tests), or run as a file
    from scripts import bench_engine_offload
except ImportError:
    import bench_engine_offload  # type: ignore[import-not-found,no-redef]

from kvflow.engine.engine import Engine

TARGETS = (
    "kvflow.connector.offload:OffloadWorker.wait_for_save",
    "kvflow.connector.offload:OffloadWorker.bind_connector_metadata",
    "kvflow.connector.offload:OffloadWorker.get_finished",
    "kvflow.connector.offload:OffloadScheduler.build_connector_meta",
    "kvflow.connector.offload:OffloadScheduler.update_connector_output",
    "kvflow.connector.offload:OffloadScheduler.request_finished",
    "kvflow.runtime.inline:InlineSyncWorker._start_stores",
    "kvflow.runtime.worker:WorkerRuntime._launch",
    "kvflow.runtime.executor:DmaExecutor._submit",
    "kvflow.runtime.reactor:Reactor.watch",
    "kvflow.runtime.reactor:Reactor.poll",
    "kvflow.backends.cuda.backend:CudaBackend.submit",
    "kvflow.backends.cuda.backend:CudaBackend._work",
    "kvflow.backends.cuda.backend:CudaBackend.compute_fence",
    "kvflow.backends.cuda.backend:CudaBackend.query",
    "kvflow.backends.cuda.issue:BatchIssue._staged_copy",
    "kvflow.backends.cuda.issue:BatchIssue._copy",
    "kvflow.backends.cuda.issue:ring_plan",
    "kvflow.backends.cuda.kernels:StageKernel.launch",
    "kvflow.backends.cuda.driver:memcpy_each",
    "kvflow.backends.cuda.driver:record",
    "kvflow.backends.cuda.driver:event_synchronize",
    "kvflow.engine.runner:ModelRunner._prepare",
    "kvflow.engine.kv_cache:to_device",
    "kvflow.engine.decode_graphs:DecodeGraphs._reuse_staging",
    "kvflow.backends.cuda.streams:enter_stream",
    "kvflow.core.offload.manager:OffloadManager.build_step_plan",
    "kvflow.core.offload.manager:OffloadManager.update_from_reports",
    "kvflow.core.offload.ledger:TransferLedger.apply_reports",
    "kvflow.core.offload.ledger:TransferLedger.plan_store",
    "kvflow.core.offload.ledger:TransferLedger.release",
    "kvflow.core.run_pool:RunBlockPool.release_owned",
    "kvflow.core.run_pool:RunBlockPool.get_new_blocks",
)


class Timers:
    """The timed functions' calls and seconds, and the collector's passes by where they hit."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.depth: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []
        self.gc: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0])
        self.mode: str | None = None
        self._gc_began = 0.0

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        pc = time.perf_counter
        figures = self.calls[key]
        depth, stack = self.depth, self.stack

        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[key]:
                return fn(*args, **kwargs)
            depth[key] += 1
            stack.append(key)
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                figures[1] += pc() - t0
                figures[0] += 1
                depth[key] -= 1
                stack.pop()

        return call

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self.mode is not None:
            where = self.stack[-1] if self.stack else "(engine)"
            figures = self.gc[(f"{self.mode}: {where}", int(info["generation"]))]
            figures[0] += 1
            figures[1] += time.perf_counter() - self._gc_began


def install(timers: Timers) -> list[str]:
    """Wrap every target that exists (also where a module imported a function by name);
    returns the ones that do not."""
    missing = []
    for target in TARGETS:
        module, _, path = target.partition(":")
        names = path.split(".")
        try:
            owner: Any = importlib.import_module(module)
            for name in names[:-1]:
                owner = getattr(owner, name)
            original = getattr(owner, names[-1])
        except (ImportError, AttributeError):  # a CUDA module without CUDA bindings, say
            missing.append(target)
            continue
        wrapped = timers.wrap(path, original)
        setattr(owner, names[-1], wrapped)
        if len(names) == 1:
            for name, mod in list(sys.modules.items()):
                if name.startswith("kvflow") and getattr(mod, names[-1], None) is original:
                    setattr(mod, names[-1], wrapped)
    run = Engine.run_to_completion

    def timed_run(engine: Engine, requests: Any) -> Any:
        timers.mode = "on" if hasattr(engine.scheduler_connector, "manager") else "off"
        try:
            return run(engine, requests)
        finally:
            timers.mode = None

    setattr(Engine, "run_to_completion", timed_run)  # noqa: B010 (mypy: a method replaced)
    gc.callbacks.append(timers.on_gc)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    out: Path | None = None
    if "--parts-json" in args:
        at = args.index("--parts-json")
        if at + 1 >= len(args):
            print("time_offload_parts: --parts-json needs a file", file=sys.stderr)
            return 2
        out = Path(args[at + 1])
        del args[at : at + 2]
    timers = Timers()
    missing = install(timers)
    try:
        rc = bench_engine_offload.main(args)
    finally:
        gc.callbacks.remove(timers.on_gc)
    if rc:
        return rc
    runs = (int(args[args.index("--repeat") + 1]) if "--repeat" in args else 3) + 1
    rows = sorted(((k, v) for k, v in timers.calls.items() if v[0]), key=lambda kv: -kv[1][1])
    table = Table(title="offload on: time in each function (a run's calls include the warm-up's)")
    for name, justify in (("function", "left"), ("calls a run", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("ms a run", justify="right")
    table.add_column("µs a call", justify="right")
    for key, (n, s) in rows:
        table.add_row(key, f"{n / runs:.1f}", f"{1e3 * s / runs:.2f}", f"{1e6 * s / n:.1f}")
    gc_table = Table(title="the garbage collector in the timed runs, by mode and where it hit")
    for name in ("mode: inside", "generation", "passes a run", "ms a run"):
        gc_table.add_column(name, justify="left" if name == "mode: inside" else "right")
    gc_rows = sorted(timers.gc.items(), key=lambda kv: -kv[1][1])
    for (where, gen), (n, s) in gc_rows:
        gc_table.add_row(where, str(gen), f"{n / runs:.1f}", f"{1e3 * s / runs:.2f}")
    console = Console()
    console.print(table)
    console.print(gc_table)
    if missing:
        console.print(f"not timed (absent here): {', '.join(missing)}")
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "runs_counted": runs,
                    "functions": {k: {"calls": n, "seconds": s} for k, (n, s) in rows},
                    "gc": [
                        {"where": w, "generation": g, "passes": n, "seconds": s}
                        for (w, g), (n, s) in gc_rows
                    ],
                    "not_timed": missing,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
