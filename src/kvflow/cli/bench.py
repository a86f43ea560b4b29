"""``kvflow bench``: the main job. Multi-round QA with offload off and on, as a table (and plot)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvflow.bench.multi_round import BenchResult, RunResult
    from kvflow.bench.pd import PDBenchResult

from kvflow.bench.config import MODEL_PRESETS, BenchConfig
from kvflow.cli.main import non_negative_int, positive_int
from kvflow.errors import ConfigError

PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _fraction(text: str) -> float:
    """argparse type: the GPU cache as a fraction of the working set, in (0, 4]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 4]") from None
    if not 0 < value <= 4:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 4]")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    presets = ", ".join(MODEL_PRESETS)
    p.add_argument(
        "--model", default=d.model, help=f"{presets}; suffix -swaW: hybrid, W-token window"
    )
    p.add_argument(
        "--device", default=d.device, help="cpu, cuda or cuda:N (cuda uses the CUDA backend)"
    )
    p.add_argument("--users", type=positive_int, default=d.users, help="conversations")
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help="questions per user")
    p.add_argument(
        "--system", type=non_negative_int, default=d.system_prompt, help="system prompt tokens"
    )
    p.add_argument(
        "--first-question",
        type=non_negative_int,
        default=d.first_question,
        help="tokens of a user's first question",
    )
    p.add_argument(
        "--question", type=positive_int, default=d.question, help="tokens of each later question"
    )
    p.add_argument(
        "--answer", type=positive_int, default=d.answer, help="tokens generated per answer"
    )
    p.add_argument(
        "--block-size", type=positive_int, default=d.block_size, help="tokens per KV block"
    )
    p.add_argument(
        "--cache-fraction",
        type=_fraction,
        default=d.cache_fraction,
        help="GPU cache size as a fraction of the working set, in (0, 4]",
    )
    p.add_argument(
        "--cpu-bytes",
        default=None,
        help="CPU tier size: bytes, or with a unit, e.g. 512MiB, 2GiB (default: 2x working set)",
    )
    p.add_argument(
        "--store-policy",
        choices=("eager", "lazy"),
        default=d.store_policy,
        help="when blocks are stored to CPU",
    )
    p.add_argument(
        "--fence-loads",
        choices=("never", "idle", "always"),
        default=d.fence_loads,
        help="which CPU hits load in the step that computes them, the forward waiting for the "
        "copies on the device (idle: while no request runs; never: every request waits for "
        "its load in the scheduler)",
    )
    p.add_argument(
        "--load-parts",
        type=int,
        default=d.load_parts,
        help="a fenced load lands in this many parts by layer, each layer's attention waiting "
        "only for its own part (1: the forward waits for the whole load)",
    )
    p.add_argument(
        "--backend", choices=("auto", "host", "cuda"), default=d.backend, help="the copy backend"
    )
    p.add_argument(
        "--worker-loop",
        choices=("thread", "inline"),
        default=d.worker_loop,
        help="the worker runtime's event loop on a thread of its own, or on the engine's thread",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=positive_int,
        default=d.max_batched_tokens,
        help="tokens per engine step",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="model weights and workload")
    p.add_argument(
        "--warmup",
        choices=("round", "full"),
        default=d.warmup,
        help="untimed warm-up: both runs once (fair), or one round (faster)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model and KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads, the same for both runs (default on CPU: one core fewer than the "
        "machine has, left to the copy and event-loop threads; on CUDA: torch's default)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON to this file")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"write TTFT per round as a figure ({', '.join(PLOT_SUFFIXES)}; needs matplotlib)",
    )
    p.add_argument(
        "--trace", type=Path, default=None, help="write every log event to this file as JSON lines"
    )
    p.add_argument(
        "--step-parts",
        action="store_true",
        help="also print where the engine's steps went in the rounds with a history: per kind "
        "of step, steps and ms per round of each part (schedule, connector, launch, the wait for "
        "the tokens, ...); the JSON has them either way",
    )
    p.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: one P and one D process (CPU, gloo) against one "
        "colocated engine, instead of offload off vs on",
    )
    p.add_argument(
        "--pd-flow",
        choices=("sequential", "concurrent"),
        default=None,
        help="with --pd: P first then D (default), or both at once",
    )
    p.add_argument(
        "--pd-first-token",
        choices=("decode", "prefill"),
        default=None,
        help="with --pd (sequential flow): who samples the first token: D, recomputing the "
        "prompt's last token (vLLM's semantics, default), or P, whose token rides along to D",
    )
    p.add_argument(
        "--pd-transport",
        choices=("gloo", "nixl", "cuda-ipc"),
        default=None,
        help="with --pd: the data plane between P and D: gloo (CPU, default), nixl (the "
        "kvflow[nixl] extra; CPU or GPU), cuda-ipc (two processes on one GPU, --device cuda)",
    )
    p.add_argument(
        "--pd-tp",
        default=None,
        metavar="P,D",
        help="with --pd (gloo): P's and D's tensor-parallel sizes, e.g. 1,2 (default 1,1); "
        "each rank a process, kv heads moved slice by slice between the ranks",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration; raises ConfigError naming the flag and its accepted form."""
    from kvflow.connector.config import OffloadConfig

    cpu_bytes = None
    if args.cpu_bytes is not None:
        try:
            cpu_bytes = OffloadConfig(cpu_bytes=args.cpu_bytes).cpu_bytes
        except ConfigError as exc:
            raise ConfigError(
                f"--cpu-bytes {args.cpu_bytes!r}: a positive size in bytes, or with a unit "
                "(B, KiB, MiB, GiB, TiB), e.g. 512MiB or 2GiB"
            ) from exc
    try:
        return BenchConfig(
            model=args.model,
            device=args.device,
            users=args.users,
            rounds=args.rounds,
            system_prompt=args.system,
            first_question=args.first_question,
            question=args.question,
            answer=args.answer,
            block_size=args.block_size,
            cache_fraction=args.cache_fraction,
            cpu_bytes=cpu_bytes,
            store_policy=args.store_policy,
            fence_loads=args.fence_loads,
            load_parts=args.load_parts,
            backend=args.backend,
            worker_loop=args.worker_loop,
            max_batched_tokens=args.max_batched_tokens,
            seed=args.seed,
            dtype=args.dtype,
            warmup=args.warmup,
        )
    except ConfigError as exc:
        raise ConfigError(f"--{exc}") from exc


def check_writable(flag: str, path: Path) -> None:
    """Raise ConfigError unless ``path`` can be written as a file (checked before the run)."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable; give a file in a writable directory")


def check_cuda(device: str) -> None:
    """Raise ConfigError unless the CUDA driver sees the GPU ``device`` names (no torch import)."""
    from kvflow.backends.probe import probe_cuda

    probe = probe_cuda()
    if not probe.available:
        raise ConfigError(
            f"--device {device}: no CUDA GPU on this machine ({probe.error or 'no device'}); "
            "use --device cpu"
        )
    index = int(device.partition(":")[2] or 0)
    if index >= probe.device_count:
        raise ConfigError(
            f"--device {device}: this machine has {probe.device_count} GPU(s), "
            f"cuda:0 to cuda:{probe.device_count - 1}"
        )


def pd_tp_of(args: argparse.Namespace) -> tuple[int, int]:
    """``--pd-tp P,D`` as two sizes; ConfigError naming the accepted form."""
    text = getattr(args, "pd_tp", None)
    if text is None:
        return (1, 1)
    parts = str(text).split(",")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
        raise ConfigError(f"--pd-tp {text!r}: two positive sizes, P's and D's, like 1,2")
    return (int(parts[0]), int(parts[1]))


def validate(args: argparse.Namespace) -> BenchConfig:
    """Every check a run can fail that needs no torch: values, output paths, matplotlib, GPU."""
    cfg = config_from_args(args)
    if getattr(args, "pd_flow", None) is not None and not args.pd:
        raise ConfigError("--pd-flow needs --pd")
    if getattr(args, "pd_transport", None) is not None and not args.pd:
        raise ConfigError("--pd-transport needs --pd")
    if getattr(args, "pd_first_token", None) is not None:
        if not args.pd:
            raise ConfigError("--pd-first-token needs --pd")
        if args.pd_first_token == "prefill" and (args.pd_flow or "sequential") != "sequential":
            raise ConfigError("--pd-first-token prefill needs the sequential flow")
    if getattr(args, "step_parts", False) and getattr(args, "pd", False):
        raise ConfigError("--step-parts is for offload off vs on, not --pd")
    if getattr(args, "pd_tp", None) is not None:
        if not args.pd:
            raise ConfigError("--pd-tp needs --pd")
        if pd_tp_of(args) != (1, 1) and (args.pd_transport or "gloo") != "gloo":
            raise ConfigError("--pd-tp runs on --pd-transport gloo")
    if getattr(args, "pd", False):
        from kvflow.bench.pd import check_pd_transport

        check_pd_transport(args.pd_transport or "gloo", cfg.device)
        if args.plot is not None:
            raise ConfigError("--plot is not available with --pd yet")
    for flag in ("json", "plot", "trace"):
        path = getattr(args, flag)
        if path is not None:
            check_writable(f"--{flag}", path)
    if args.plot is not None:
        if args.plot.suffix.lower() not in PLOT_SUFFIXES:
            raise ConfigError(
                f"--plot {args.plot}: the file name ends in one of {', '.join(PLOT_SUFFIXES)}"
            )
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError(
                "--plot needs matplotlib, which is not installed: pip install 'kvflow[plot]'"
            )
    if cfg.device.startswith("cuda"):
        check_cuda(cfg.device)
    return cfg


PHASE_LABELS = {
    "queue": "queue for GPU blocks",
    "match": "match (connector, within the queue's end)",
    "load_launch": "load: blocks given → launched",
    "load_copy": "load: launched → copies landed on the device",
    "load_seen": "load: landed → seen done by the scheduler",
    "to_compute": "loaded → first step computing it",
    "prefill": "prefill chunks before the last",
    "first_step": "step sampling the first token",
}


def check_line(result: BenchResult) -> str:
    """One line: how the offload run's outputs were checked, and the verdict."""
    c = result.check
    if c.reference == "offload off":
        verdict = "[green]identical[/]" if c.passed else "[red]DIFFERENT[/]"
        return f"greedy outputs, offload off vs on: {verdict}"
    head = (
        f"outputs vs a no-eviction replay ({result.config.resolved_dtype}): tokens "
        f"identical in {c.requests_identical}/{c.requests} requests"
    )
    if c.tokens_identical:
        return f"{head}: [green]identical[/]"
    verdict = "[green]equivalent[/]" if c.passed else "[red]MISMATCH[/]"
    return (
        f"{head}; first-token logits, largest relative L2 distance "
        f"{c.max_rel_logits_err:.4f} (tolerance {c.tolerance}): {verdict}"
    )


def render(result: BenchResult, console: Console, *, step_parts: bool = False) -> None:
    """The bench's tables; ``step_parts`` adds where the engine's steps went."""
    off, on = result.runs
    table = Table(
        title=(
            f"kvflow bench: {result.model} on {result.device}, backend {result.backend}, "
            f"{result.config.users} users × {result.config.rounds} rounds"
        )
    )
    table.add_column("measure")
    table.add_column("offload off", justify="right")
    table.add_column("offload on", justify="right")
    table.add_column("on / off", justify="right")

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.2f}×" if a else "—"

    timed = "copy time measured" if on.copy_time_measured else "copy submitted → seen done"
    rows: list[tuple[str, float, float, str]] = [
        ("TTFT p50 (ms)", off.ttft_p50_s * 1e3, on.ttft_p50_s * 1e3, ".2f"),
        ("TTFT p90 (ms)", off.ttft_p90_s * 1e3, on.ttft_p90_s * 1e3, ".2f"),
        (
            "prefill tokens computed",
            off.prefill_tokens_computed,
            on.prefill_tokens_computed,
            ",.0f",
        ),
        (
            "prefill tokens loaded from CPU",
            off.prefill_tokens_loaded,
            on.prefill_tokens_loaded,
            ",.0f",
        ),
        (
            "prefill tokens from GPU prefix cache",
            off.gpu_cached_tokens,
            on.gpu_cached_tokens,
            ",.0f",
        ),
        ("CPU hit rate (loaded / (loaded + computed))", off.cpu_hit_rate, on.cpu_hit_rate, ".1%"),
        (f"store GB/s ({timed})", off.store_gbps, on.store_gbps, ".2f"),
        (f"load GB/s ({timed})", off.load_gbps, on.load_gbps, ".2f"),
        ("blocks stored / loaded", off.blocks_stored, on.blocks_stored, ",.0f"),
        ("preemptions", off.preemptions, on.preemptions, ",.0f"),
        ("wall time (s)", off.wall_s, on.wall_s, ".2f"),
    ]
    for label, a, b, fmt in rows:
        if label == "blocks stored / loaded":
            table.add_row(label, "—", f"{on.blocks_stored:,} / {on.blocks_loaded:,}", "")
            continue
        shown_ratio = (
            ratio(a, b) if label.startswith(("TTFT", "prefill tokens computed", "wall")) else ""
        )
        table.add_row(label, format(a, fmt), format(b, fmt), shown_ratio)
    console.print(table)
    if result.config.worker_loop == "inline" and not on.copy_time_measured:
        # A busy engine calls the connector once a step: a store is seen done a step after its
        # copy ended, so its figure is a floor, not the copy engine's speed.
        console.print(
            "worker loop inline: a copy is seen done at the engine's next connector call; "
            "the GB/s figures are lower bounds (docs/benchmarks.md)"
        )
    console.print(check_line(result))
    phases = Table(title="TTFT of requests with a history (rounds after the first), by phase, ms")
    phases.add_column("phase")
    for name in ("off mean", "off p50", "on mean", "on p50"):
        phases.add_column(name, justify="right")
    for name in PHASE_LABELS:
        if name == "load_seen" and not on.history_loads_dated:
            continue  # no load was dated: its wait is all in load_copy
        cells = [
            f"{run_phases.get(name, 0.0):.2f}"
            for run in (off, on)
            for run_phases in (run.history_ttft_phases_mean_ms, run.history_ttft_phases_p50_ms)
        ]
        phases.add_row(PHASE_LABELS[name], *cells)
    console.print(phases)
    if on.history_loads:
        console.print(
            f"loads dated (landed on the device, from the backend's copy timing): "
            f"{on.history_loads_dated} of {on.history_loads}"
        )
    if on.history_fenced_loads:
        console.print(
            f"fenced loads (copied inside the step that samples the first token, "
            f"--fence-loads {result.config.fence_loads}, --load-parts "
            f"{result.config.load_parts}): {on.history_fenced_loads}"
        )
    if step_parts:
        console.print(step_parts_table(off, on))
    per_round = Table(title="TTFT p50 per round (ms)")
    per_round.add_column("round", justify="right")
    per_round.add_column("offload off", justify="right")
    per_round.add_column("offload on", justify="right")
    for r, (a, b) in enumerate(zip(off.ttft_p50_per_round_s, on.ttft_p50_per_round_s, strict=True)):
        per_round.add_row(str(r), f"{a * 1e3:.2f}", f"{b * 1e3:.2f}")
    console.print(per_round)


STEP_PART_LABELS = {
    "schedule_ms": "sched",
    "meta_ms": "meta",
    "launch_ms": "launch",
    "connector_output_ms": "conn",
    "tokens_ms": "tokens",
    "outputs_ms": "out",
    "wait_ms": "wait",
    "total_ms": "total",
}


def step_parts_table(off: RunResult, on: RunResult) -> Table:
    """Per run and kind of step, the steps and ms of each part per round with a history."""
    table = Table(
        box=box.SIMPLE_HEAD,  # eleven columns: no room for cell borders in 80 columns
        pad_edge=False,
        collapse_padding=True,
        title="Engine steps per round with a history (means; ms but steps)",
        caption="sched: schedule; meta: build_connector_meta; launch: the connector's worker "
        "calls and the forward pass enqueued; conn: update_connector_output; tokens: the wait "
        "for the sampled tokens; out: update_from_output; wait: an idle step's "
        "wait_for_progress",
    )
    for name in ("run", "kind", "steps", *STEP_PART_LABELS.values()):
        left = name in ("run", "kind")
        table.add_column(name, justify="left" if left else "right", min_width=len(name))
    for name, run in (("off", off), ("on", on)):
        for kind, parts in run.history_step_parts.items():
            cells = [f"{parts[key]:.1f}" for key in STEP_PART_LABELS]
            table.add_row(name, kind, f"{parts['steps']:.1f}", *cells)
    return table


def figure(result: BenchResult) -> Figure:
    """TTFT p50 per round, offload off vs on, both axes from 0 (``validate`` checked matplotlib)."""
    from matplotlib.figure import Figure

    off, on = result.runs
    rounds = list(range(len(off.ttft_p50_per_round_s)))
    fig = Figure(figsize=(6, 3.5), dpi=120)
    ax = fig.subplots()
    ax.plot(rounds, [t * 1e3 for t in off.ttft_p50_per_round_s], "o-", label="offload off")
    ax.plot(rounds, [t * 1e3 for t in on.ttft_p50_per_round_s], "s-", label="offload on (kvflow)")
    ax.set_xlabel("round (each user's n-th question)")
    ax.set_ylabel("TTFT p50 (ms), lower is better")
    ax.set_xticks(rounds)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result.model} on {result.device}: time to first token per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot(result: BenchResult, path: Path) -> None:
    """Write ``figure(result)`` to ``path`` (its suffix picks the format)."""
    figure(result).savefig(path)


def _check_torch_device(device: str) -> None:
    """After every cheap check: the installed torch can use ``device`` (a CPU build cannot)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: this torch ({torch.__version__}) cannot use the GPU; "
            "install a CUDA build of torch or use --device cpu"
        )


def render_pd(result: PDBenchResult, console: Console) -> None:
    """The ``--pd`` table: the colocated engine next to P → D."""
    c, pd = result.colocated, result.pd
    table = Table(
        title=(
            f"kvflow bench --pd ({result.flow} flow, "
            f"{'P samples the first token, ' if result.first_token == 'prefill' else ''}"
            f"{result.transport}"
            f"{'' if result.tp == (1, 1) else f', P tp{result.tp[0]} → D tp{result.tp[1]}'}): "
            f"{result.config.model} "
            f"on {result.config.device}, "
            f"{result.requests} requests ({result.config.users} users × {result.config.rounds} "
            "rounds)"
        )
    )
    table.add_column("measure")
    table.add_column("colocated", justify="right")
    table.add_column("P → D", justify="right")
    ms = 1e3
    for label, a, b in (
        ("TTFT p50 (ms)", c.ttft_p50_s * ms, pd.ttft_p50_s * ms),
        ("TTFT p90 (ms)", c.ttft_p90_s * ms, pd.ttft_p90_s * ms),
        ("second token p50 (ms)", c.second_token_p50_s * ms, pd.second_token_p50_s * ms),
        ("ITL p50 (ms)", c.itl_p50_s * ms, pd.itl_p50_s * ms),
        ("ITL p99 (ms)", c.itl_p99_s * ms, pd.itl_p99_s * ms),
    ):
        table.add_row(label, f"{a:.2f}", f"{b:.2f}")
    table.add_row(
        "prompt tokens computed (D for P → D)",
        f"{c.prompt_tokens_computed:,}",
        f"{result.decode_prompt_tokens_computed:,}",
    )
    table.add_row("prompt tokens computed on P", "—", f"{result.prefill_prompt_tokens_computed:,}")
    table.add_row(
        "preemptions (D for P → D)",
        f"{result.colocated_preemptions}",
        f"{result.decode_preemptions}",
    )
    table.add_row(
        "hand-offs committed / failed", "—", f"{result.handoffs_ok} / {result.handoffs_failed}"
    )
    table.add_row("bytes moved (P → D)", "—", f"{result.bytes_moved:,}")
    table.add_row("send GB/s (launch → seen settled)", "—", f"{result.send_gbps:.3f}")
    table.add_row("leaked blocks (P + D)", "—", f"{result.leaked_blocks}")
    table.add_row(
        "router → P's engine p50 (ms, not in TTFT)", "—", f"{result.delivery_p50_s * ms:.2f}"
    )
    for side, stats in sorted(result.transport_stats.items()):
        chosen = ", ".join(
            f"{k}={_flat(v)}"
            for k, v in stats.items()
            if k in ("backend", "ucx", "mode", "paths") and v
        )
        if chosen:
            table.add_row(f"transport chosen ({side})", "—", chosen)
    table.add_row("wall time (s)", f"{c.wall_s:.2f}", f"{pd.wall_s:.2f}")
    console.print(table)
    if c.ttft_parts_mean_s or pd.ttft_parts_mean_s:
        console.print(_ttft_parts_table(c.ttft_parts_mean_s, pd.ttft_parts_mean_s, result))
    check = result.check
    if check is None:
        verdict = "[green]identical[/]" if result.outputs_identical else "[red]DIFFERENT[/]"
        console.print(f"greedy outputs, colocated vs P → D: {verdict}")
        return
    head = (
        f"outputs vs the {check.reference}: tokens identical in {check.requests_identical}/"
        f"{check.requests} requests"
    )
    if check.tokens_identical:
        console.print(f"{head}: [green]identical[/]")
        return
    verdict = "[green]equivalent[/]" if check.passed else "[red]MISMATCH[/]"
    console.print(
        f"{head}; first-token logits, largest relative L2 distance "
        f"{check.max_rel_logits_err:.2e} (tolerance {check.tolerance}): {verdict}"
    )


def _ttft_parts_table(c: dict[str, float], pd: dict[str, float], result: PDBenchResult) -> Table:
    """The TTFT's parts (means, ms) on the engine that sampled the first token, each side."""
    sampler = "P" if result.first_token == "prefill" else "D"
    parts = Table(title=f"TTFT by part, means in ms (P → D: {sampler}'s engine sampled it)")
    parts.add_column("part")
    parts.add_column("colocated", justify="right")
    parts.add_column("P → D", justify="right")
    labels = {
        **PHASE_LABELS,
        "outside": (
            "outside the sampling engine's timeline (admission checks, the step after sampling"
            + (")" if sampler == "P" else "; P's part and the hops to D)")
        ),
    }
    for name, label in labels.items():
        a, b = c.get(name, 0.0), pd.get(name, 0.0)
        if a or b:
            parts.add_row(label, f"{a * 1e3:.2f}", f"{b * 1e3:.2f}")
    return parts


def _flat(value: object) -> str:
    """A stats value for a table cell: a mapping as ``key: value`` pairs."""
    if isinstance(value, dict):
        return " ".join(f"{k}:{v}" for k, v in value.items())
    return str(value)


def _progress(console: Console) -> Progress:
    """A transient bar per run, counting rounds."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("round {task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def run_pd_command(args: argparse.Namespace, cfg: BenchConfig, console: Console) -> int:
    from kvflow.bench.pd import run_pd_bench

    flow = args.pd_flow or "sequential"
    with _progress(console) as progress:
        tasks = {name: progress.add_task(name, total=cfg.rounds) for name in ("colocated", "P → D")}
        result = run_pd_bench(
            cfg,
            flow=flow,
            transport=args.pd_transport or "gloo",
            tp=pd_tp_of(args),
            first_token=args.pd_first_token or "decode",
            on_round=lambda name, _r: progress.advance(tasks[name]),
            trace=args.trace,
        )
    render_pd(result, console)
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {args.json}")
    if args.trace is not None:
        console.print(f"wrote {args.trace} (every process's events; 'process' names it)")
    return 0 if result.passed else 1


def run_bench_command(args: argparse.Namespace, console: Console | None = None) -> int:
    cfg = validate(args)
    _check_torch_device(cfg.device)
    console = console or Console()
    from kvflow.engine.engine import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    threads = args.threads
    if threads is None and args.device == "cpu":
        # On CPU the host backend's copy thread and the runtime's loop need a core: with torch's
        # intra-op threads on every core, each parallel region waits for a thread the copies
        # preempted (dev box, 2 cores: TTFT p50 59 → 110 ms with offload on; with 1 torch
        # thread 83 → 63 ms).
        threads = max(1, (os.cpu_count() or 1) - 1)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if getattr(args, "pd", False):
        return run_pd_command(args, cfg, console)
    # No logging set up here: unless the host configured structlog, kvflow's events go to stdlib
    # logging, whose default shows warnings only; --trace sends them to its file alone.
    from kvflow.bench.multi_round import REFERENCE_RUN, run_bench

    runs = ["offload off", "offload on"]
    if cfg.resolved_dtype != "float32":
        runs.append(REFERENCE_RUN)
    with _progress(console) as progress:
        tasks = {name: progress.add_task(name, total=cfg.rounds) for name in runs}
        result = run_bench(
            cfg, on_round=lambda name, _r: progress.advance(tasks[name]), trace=args.trace
        )
    render(result, console, step_parts=getattr(args, "step_parts", False))
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    if args.trace is not None:
        console.print(f"wrote {args.trace} (summarize with: kvflow trace {args.trace})")
    return 0 if result.check.passed else 1


__all__ = [
    "add_arguments",
    "check_cuda",
    "check_line",
    "check_writable",
    "config_from_args",
    "figure",
    "plot",
    "render",
    "render_pd",
    "run_bench_command",
    "run_pd_command",
    "validate",
]
