"""Per-step time of vLLM's real v1 scheduler on CPU, without and with KV offload connectors.

Workload: N running requests with P-token prompts (all prefilled first, not timed), then D timed
decode steps. A step is ``schedule()`` + ``update_from_output()``, which includes the connector's
scheduler-side work (``build_connector_meta``, ``update_connector_output``, match and alloc
hooks). The workers are played by a stand-in that reports every transfer of a step complete in
that step's output, so stores settle as they would on a fast device.

Configurations, measured side by side in one process: no connector; vLLM's
``SimpleCPUOffloadConnector`` eager and lazy; kvflow's ``KVFlowConnector`` eager and lazy (when
kvflow's scheduler-side manager is importable; otherwise reported as not available).

    PYTHONPATH=src /work/venv-vllm/bin/python scripts/bench_vllm_scheduler.py
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

import structlog
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integrations.vllm_harness import (
    KVFLOW_MODULE,
    LAYERS,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    page_bytes,
)

Echo = Callable[[Any], Any]
EACH_STEP = "kvflow eager, a store each step"
TWIN = f"{EACH_STEP} (twin)"
HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "take_events",
    "get_kv_connector_stats",
)


MANAGER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_step_plan",
    "decode_step",
    "quiet_step",
    "update_from_reports",
    "request_finished",
    "take_events",
    "stats",
)


def time_hooks(connector: Any, sink: list[int], names: tuple[str, ...] = HOOKS) -> None:
    """Wrap the connector's scheduler-side hooks so their time adds up in ``sink[0]`` (ns).

    Timing the hooks directly is robust to machine noise; the step totals also show the indirect
    cost (what vLLM itself does differently because a connector is there).
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                sink[0] += perf_counter_ns() - t0

        return timed

    for name in names:
        if hasattr(connector, name):
            setattr(connector, name, wrap(getattr(connector, name)))


CALLS = (
    (
        "connector: build_connector_meta",
        "kvflow.integrations.vllm.connector",
        "KVFlowConnector",
        "build_connector_meta",
    ),
    (
        "connector: update_connector_output",
        "kvflow.integrations.vllm.connector",
        "KVFlowConnector",
        "update_connector_output",
    ),
    (
        "connector: take_events",
        "kvflow.integrations.vllm.connector",
        "KVFlowConnector",
        "take_events",
    ),
    (
        "adapter: translate_scheduler_output",
        "kvflow.integrations.vllm.connector",
        None,
        "translate_scheduler_output",
    ),
    (
        "manager: build_step_plan",
        "kvflow.core.offload.manager",
        "OffloadManager",
        "build_step_plan",
    ),
    (
        "manager: decode_step (steady decode)",
        "kvflow.core.offload.manager",
        "OffloadManager",
        "decode_step",
    ),
    (
        "manager: quiet_step (steady decode, lazy)",
        "kvflow.core.offload.manager",
        "OffloadManager",
        "quiet_step",
    ),
    ("  eager: advance_one", "kvflow.core.offload.eager", "EagerStore", "advance_one"),
    ("  ledger: launch_store", "kvflow.core.offload.ledger", "TransferLedger", "launch_store"),
    ("  eager: collect", "kvflow.core.offload.eager", "EagerStore", "collect"),
    ("  lazy: walk", "kvflow.core.offload.lazy", "LazyCursor", "walk"),
    ("  ledger: plan_store", "kvflow.core.offload.ledger", "TransferLedger", "plan_store"),
    ("    CPU pool: get_new_blocks", "kvflow.core.run_pool", "RunBlockPool", "get_new_blocks"),
    ("  ledger: launch", "kvflow.core.offload.ledger", "TransferLedger", "launch"),
    ("  validate: step_entries", "kvflow.core.validate", None, "step_entries"),
    (
        "manager: update_from_reports",
        "kvflow.core.offload.manager",
        "OffloadManager",
        "update_from_reports",
    ),
    ("  ledger: apply_reports", "kvflow.core.offload.ledger", "TransferLedger", "apply_reports"),
    ("    ledger: _settle", "kvflow.core.offload.ledger", "TransferLedger", "_settle"),
    ("      ledger: release", "kvflow.core.offload.ledger", "TransferLedger", "release"),
    ("        CPU pool: release_owned", "kvflow.core.run_pool", "RunBlockPool", "release_owned"),
    ("transfer transitions (ledger)", "kvflow.core.offload.ledger", None, "apply"),
    (
        "connector: get_kv_connector_stats",
        "kvflow.integrations.vllm.connector",
        "KVFlowConnector",
        "get_kv_connector_stats",
    ),
)
"""``--calls``: (label, module, class or None for a module function, name). Nested calls are
indented: a caller's time includes its callees'."""

_calls_sink: list[dict[str, int] | None] = [None]  # the stepping rig's per-call totals (ns)


def time_calls() -> None:
    """Wrap ``CALLS`` where they are defined (before any rig exists, so the hook wrappers of
    ``time_hooks`` capture these): each call's time adds to the rig stepping now."""
    import importlib

    for label, module, cls, name in CALLS:
        owner: Any = importlib.import_module(module)
        if cls is not None:
            owner = getattr(owner, cls)
        fn = getattr(owner, name)

        def timed(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **kw: Any) -> Any:
            sink = _calls_sink[0]
            if sink is None:
                return _fn(*a, **kw)
            t0 = perf_counter_ns()
            try:
                return _fn(*a, **kw)
            finally:
                sink[_label] = sink.get(_label, 0) + perf_counter_ns() - t0

        setattr(owner, name, timed)


def simple_echo(scheduler_output: Any) -> Any:
    """SimpleCPUOffloadConnector's workers: this step's store event and loads are done."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.metadata import (
        INVALID_JOB_ID,
        SimpleCPUOffloadWorkerMetadata,
    )

    meta = scheduler_output.kv_connector_metadata
    stores = {} if meta.store_event == INVALID_JOB_ID else {meta.store_event: 1}
    recving = {r for reqs in meta.load_event_to_reqs.values() for r in reqs}
    if not stores and not recving:
        return None
    return KVConnectorOutput(
        finished_recving=recving or None,
        kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(stores) if stores else None,
    )


def kvflow_echo(scheduler_output: Any, package: str = "kvflow") -> Any:
    """kvflow's workers: every transfer of this step's plan is reported complete (``package``:
    the kvflow tree whose connector planned it, see ``--base``)."""
    from vllm.v1.outputs import KVConnectorOutput

    StepReport = importlib.import_module(f"{package}.core.protocol").StepReport
    KVFlowWorkerMetadata = importlib.import_module(
        f"{package}.integrations.vllm"
    ).KVFlowWorkerMetadata

    plan = scheduler_output.kv_connector_metadata.plan
    if plan is None:
        return None  # an idle step: nothing launched
    done = tuple(t.transfer_id for t in (*plan.stores, *plan.loads))
    if not done:
        return None
    return KVConnectorOutput(
        kv_connector_worker_meta=KVFlowWorkerMetadata((StepReport(rank=0, completed=done),))
    )


class EngineClock:
    """The clock kvflow's connector reads here: the time of the rig stepping now, which runs only
    while that rig steps. In a server an engine's connector sees only its own steps' time pass;
    here the other configurations' steps and the collection before each round pass too (several
    times a rig's own step), and the scheduler role's stats, due once a second, would be built
    every few steps instead of once in hundreds. A server's steps also run the forward pass, so
    its second comes sooner in steps than here: this clock errs on the side of fewer payloads
    than a GPU server builds, the wall clock on the side of far more."""

    def __init__(self) -> None:
        self.rig: Rig | None = None

    def now(self) -> float:
        rig = self.rig
        return 0.0 if rig is None else rig.engine_s + (perf_counter() - rig.started)


ENGINE_CLOCK = EngineClock()


class Rig:
    """One configuration: its own scheduler, prefilled, stepped by ``step``."""

    def __init__(
        self,
        connector: str | None,
        module: str | None,
        extra: dict[str, object],
        echo: Echo | None,
        args: argparse.Namespace,
    ) -> None:
        blocks_per_req = (
            args.prompt + args.decode + args.warmup + 2 * args.block_size
        ) // args.block_size
        config = make_vllm_config(
            connector=connector,
            module_path=module,
            extra_config=extra,
            block_size=args.block_size,
            max_num_seqs=args.requests,
            max_num_batched_tokens=args.batch_tokens,
            max_model_len=args.prompt + args.decode + args.warmup + 64,
        )
        self.engine_s = 0.0  # this rig's own time (``EngineClock``), its steps' wall time
        self.started = perf_counter()
        ENGINE_CLOCK.rig = self
        self.scheduler = make_scheduler(config, args.requests * (blocks_per_req + 1) + 64)
        ENGINE_CLOCK.rig = None
        self.echo = echo
        self.hook_ns = [0]
        self.manager_ns = [0]
        self.calls: dict[str, int] = {}  # ``--calls``: ns per call label over the timed steps
        instance = self.scheduler.connector
        if instance is not None:
            time_hooks(instance, self.hook_ns)
            # kvflow: split the hooks' time into the adapter's and the manager's share.
            scheduler_role = getattr(instance, "_scheduler", None)
            if scheduler_role is not None:
                time_hooks(scheduler_role.manager, self.manager_ns, MANAGER_CALLS)
        for i in range(args.requests):
            # Distinct prompts: no GPU prefix hits, every block is new (the offloaders' worst case).
            tokens = [(i * 131 + j * 7) % 30000 + 10 for j in range(args.prompt)]
            self.scheduler.add_request(
                make_request(tokens, max_tokens=args.decode + 1000, block_size=args.block_size)
            )
        while any(
            r.num_computed_tokens < r.num_prompt_tokens for r in self.scheduler.requests.values()
        ):
            self.step()
        self.times: list[int] = []
        self.hooks: list[int] = []
        self.manager: list[int] = []

    def step(self) -> int:
        """One step; returns the ns spent in vLLM's scheduler (not in building the fake output)."""
        scheduler = self.scheduler
        self.started = perf_counter()
        ENGINE_CLOCK.rig = self
        t0 = perf_counter_ns()
        so = scheduler.schedule()
        t1 = perf_counter_ns()
        kv_out = self.echo(so) if self.echo is not None else None
        mro = model_runner_output(scheduler, so, kv_out)
        t2 = perf_counter_ns()
        scheduler.update_from_output(so, mro)
        t3 = perf_counter_ns()
        ENGINE_CLOCK.rig = None
        self.engine_s += perf_counter() - self.started
        return (t1 - t0) + (t3 - t2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=128, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--eager-store-interval",
        type=int,
        default=None,
        help="the 'kvflow eager' row's eager_store_interval (default: kvflow's, 4)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=None,
        metavar="TEXT",
        help="run only the configurations whose name contains TEXT (repeatable; 'no connector' "
        "and 'SimpleCPUOffload eager', the ratios' bases, always run): e.g. --only eager",
    )
    parser.add_argument(
        "--no-collect",
        action="store_true",
        help="no gc.collect() before each round and no automatic collection while timing "
        "(a full collection walks the whole heap, so every step then starts with cold caches)",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="also time kvflow's main calls one by one (a table per call; the wrappers add "
        "their own cost, so the hooks figures of such a run are not the benchmark's)",
    )
    parser.add_argument(
        "--cold-split",
        action="store_true",
        help="also run a twin of 'kvflow eager, a store each step' right after it in every round "
        "(its own scheduler and objects): after the round's collection the first runs with "
        "kvflow's code and data cold, the twin with the code warm and its data cold, so the "
        "difference is what the cold code and shared state cost (a table of its own)",
    )
    parser.add_argument(
        "--logging",
        choices=("structlog-warning", "unconfigured"),
        default="structlog-warning",
        help="structlog configured at WARNING, or nothing configured (kvflow's events then go to "
        "stdlib logging, as in a vLLM server; what a filtered debug event costs there)",
    )
    parser.add_argument(
        "--wall-clock",
        action="store_true",
        help="kvflow's connector reads the wall clock (the other rigs' steps and the collections "
        "between rounds then count as its time), not its own rig's (EngineClock)",
    )
    parser.add_argument(
        "--base",
        metavar="PACKAGE",
        help="also run the store-each-step configuration from PACKAGE, another kvflow tree under "
        "a name of its own on PYTHONPATH (scripts/renamed_tree.sh makes one from a git ref), in "
        "the same rounds: an A/B of two trees in one process",
    )
    parser.add_argument(
        "--base-first",
        action="store_true",
        help="with --base, the other tree's rig steps just before this tree's in each round "
        "(default: just after); the one that follows finds code both trees share warm, so an "
        "A/B runs both orders",
    )
    args = parser.parse_args()
    if args.logging == "structlog-warning":
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.getLogger("vllm").setLevel(logging.ERROR)

    bytes_per_block = page_bytes(args.block_size) * len(LAYERS)
    cpu_bytes = 4 * args.requests * (args.prompt + args.decode) // args.block_size * bytes_per_block
    configs: list[tuple[str, str | None, str | None, dict[str, object], Echo | None]] = [
        ("no connector", None, None, {}, None),
        (
            "SimpleCPUOffload eager",
            "SimpleCPUOffloadConnector",
            None,
            {"cpu_bytes_to_use": cpu_bytes},
            simple_echo,
        ),
        (
            "SimpleCPUOffload lazy",
            "SimpleCPUOffloadConnector",
            None,
            {"cpu_bytes_to_use": cpu_bytes, "lazy_offload": True},
            simple_echo,
        ),
    ]
    kvflow_ready = importlib.util.find_spec("kvflow.core.offload") is not None
    # kvflow's defaults (eager stores coalesced over 4 decode steps), and eager with one store
    # per step, as the other connectors do.
    interval = (
        {}
        if args.eager_store_interval is None
        else {"eager_store_interval": args.eager_store_interval}
    )
    kvflow_configs = [
        (
            "eager" if not interval else f"eager, interval {args.eager_store_interval}",
            "eager",
            interval,
        ),
        ("eager, a store each step", "eager", {"eager_store_interval": 1}),
        ("lazy", "lazy", {}),
    ]
    for label, policy, more in kvflow_configs if kvflow_ready else []:
        extra: dict[str, object] = {"cpu_bytes_to_use": cpu_bytes, "store_policy": policy, **more}
        configs.append((f"kvflow {label}", "KVFlowConnector", KVFLOW_MODULE, extra, kvflow_echo))

    if args.base:
        if (
            importlib.util.find_spec(args.base) is None
            or importlib.util.find_spec(f"{args.base}.integrations.vllm") is None
        ):
            print(f"--base: no package {args.base!r} on PYTHONPATH", file=sys.stderr)
            sys.exit(2)
        extra = {"cpu_bytes_to_use": cpu_bytes, "store_policy": "eager", "eager_store_interval": 1}
        other = (
            f"{args.base} eager, a store each step",
            "KVFlowConnector",
            f"{args.base}.integrations.vllm",
            extra,
            functools.partial(kvflow_echo, package=args.base),
        )
        at = next((i for i, c in enumerate(configs) if c[0] == EACH_STEP), len(configs))
        configs.insert(at if args.base_first else at + 1, other)
    if args.only:
        always = ("no connector", "SimpleCPUOffload eager")
        configs = [c for c in configs if c[0] in always or any(t in c[0] for t in args.only)]
    if args.cold_split:
        each = next((c for c in configs if c[0] == EACH_STEP), None)
        if each is None:
            print(f"--cold-split needs the '{EACH_STEP}' configuration", file=sys.stderr)
            sys.exit(2)
        configs.insert(configs.index(each) + 1, (TWIN, *each[1:]))
    if kvflow_ready and not args.wall_clock:
        for package in ("kvflow", args.base) if args.base else ("kvflow",):
            connector_class = importlib.import_module(
                f"{package}.integrations.vllm.connector"
            ).KVFlowConnector
            connector_class.clock = staticmethod(lambda: ENGINE_CLOCK)
    if args.calls and kvflow_ready:
        time_calls()
    rigs: dict[str, Rig] = {}
    with Progress() as progress:
        task = progress.add_task("prefill", total=len(configs))
        for name, connector, module, extra_config, echo in configs:
            rigs[name] = Rig(connector, module, extra_config, echo, args)
            progress.advance(task)
        # Round robin, one step of each configuration in turn: machine noise hits all alike.
        task = progress.add_task("decode", total=args.warmup + args.decode)
        if args.no_collect:
            gc.collect()
            gc.disable()
        # Rotation units: the twin of ``--cold-split`` always runs right after its original.
        units = [[rig] for name, rig in rigs.items() if name != TWIN]
        if TWIN in rigs:
            next(u for u in units if u[0] is rigs[EACH_STEP]).append(rigs[TWIN])
        for n in range(args.warmup + args.decode):
            if not args.no_collect:
                gc.collect()
            # The first configuration of a round runs right after the collection, with the CPU
            # caches cold from its walk over every object: rotate, so that each one is first as
            # often as the others (a fixed order made "no connector" about 0.2 ms slower a step).
            k = n % len(units)
            for rig in [r for unit in units[k:] + units[:k] for r in unit]:
                before, before_manager = rig.hook_ns[0], rig.manager_ns[0]
                _calls_sink[0] = rig.calls if n >= args.warmup else None
                t = rig.step()
                _calls_sink[0] = None
                if n >= args.warmup:
                    rig.times.append(t)
                    rig.hooks.append(rig.hook_ns[0] - before)
                    rig.manager.append(rig.manager_ns[0] - before_manager)
            progress.advance(task)
        gc.enable()
    for name, rig in rigs.items():
        assert len(rig.scheduler.running) == args.requests, f"{name}: a request stopped running"
    results = {name: rig.times for name, rig in rigs.items()}
    hooks = {name: statistics.fmean(rig.hooks) if rig.hooks else 0.0 for name, rig in rigs.items()}
    simple_hooks = hooks["SimpleCPUOffload eager"]

    # Means, not medians: with equal prompt lengths every request opens a block on the same step,
    # so the per-block work lands on one step in 16; the mean charges it to every step.
    base = statistics.fmean(results["no connector"])
    simple_added = statistics.fmean(results["SimpleCPUOffload eager"]) - base
    table = Table(
        title=(
            f"vLLM scheduler step on CPU: {args.requests} running requests, "
            f"{args.prompt}-token prompts, {args.decode} decode steps"
            + (", no gc.collect() between rounds" if args.no_collect else "")
        )
    )
    for col in (
        "configuration",
        "mean ms",
        "median ms",
        "p90 ms",
        "max ms",
        "added ms (mean)",
        "added / eager simple",
        "connector hooks ms",
        "hooks / eager simple",
    ):
        table.add_column(col, justify="right" if col != "configuration" else "left")
    for name, times in results.items():
        ms = sorted(t / 1e6 for t in times)
        added = statistics.fmean(times) - base
        ratio = (
            f"{added / simple_added:.2f}" if simple_added > 0 and name != "no connector" else "-"
        )
        table.add_row(
            name,
            f"{statistics.fmean(ms):.3f}",
            f"{statistics.median(ms):.3f}",
            f"{ms[int(0.9 * (len(ms) - 1))]:.3f}",
            f"{ms[-1]:.3f}",
            f"{added / 1e6:+.3f}",
            ratio,
            f"{hooks[name] / 1e6:.3f}",
            f"{hooks[name] / simple_hooks:.2f}" if simple_hooks and name != "no connector" else "-",
        )
    if not kvflow_ready:
        table.add_row(
            "kvflow eager / lazy", "n/a", "", "", "", "", "manager not merged yet", "", ""
        )
    console = Console(width=160)
    console.print(table)
    split = Table(title="kvflow's connector hooks per step: adapter vs manager (ms, mean)")
    for col in ("configuration", "hooks", "kvflow manager", "adapter (translation)"):
        split.add_column(col, justify="right" if col != "configuration" else "left")
    for name, rig in rigs.items():
        if rig.manager and any(rig.manager):
            m = statistics.fmean(rig.manager) / 1e6
            split.add_row(
                name, f"{hooks[name] / 1e6:.3f}", f"{m:.3f}", f"{hooks[name] / 1e6 - m:.3f}"
            )
    if split.row_count:
        console.print(split)
    if TWIN in rigs:
        first, twin = hooks[EACH_STEP] / 1e3, hooks[TWIN] / 1e3
        cold = Table(
            title=f"'{EACH_STEP}': its hooks with kvflow's code cold and warm (µs a step, mean)"
        )
        for col in ("rig", "kvflow's code", "its data", "hooks µs"):
            cold.add_column(col, justify="right" if col == "hooks µs" else "left")
        cold.add_row("the first of the two", "cold", "cold", f"{first:.1f}")
        cold.add_row("its twin, right after it", "warm", "cold", f"{twin:.1f}")
        cold.add_row("difference", "", "", f"{first - twin:+.1f}")
        console.print(cold)
    timed = {name: rig for name, rig in rigs.items() if rig.calls}
    if timed:
        calls = Table(
            title="kvflow's calls per step (µs, mean over the timed steps; an indented call is "
            "inside the one above; the wrappers add their own cost)"
        )
        calls.add_column("call")
        for name in timed:
            calls.add_column(name, justify="right")
        for label, *_ in CALLS:
            cells = [rig.calls.get(label, 0) / args.decode / 1e3 for rig in timed.values()]
            if any(cells):
                calls.add_row(label, *(f"{c:.1f}" for c in cells))
        console.print(calls)


if __name__ == "__main__":
    main()
