"""``kvflow bench``: the main job. Multi-round QA with offload off and on, as a table (and plot)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvflow.bench.config import MODEL_PRESETS, BenchConfig
from kvflow.cli.bench_report import plot, render, render_pd
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
        f"only for its own part (default {d.load_parts}; 1: the forward waits for the whole load)",
    )
    p.add_argument(
        "--backend", choices=("auto", "host", "cuda"), default=d.backend, help="the copy backend"
    )
    p.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="schedule and launch each engine step before reading the tokens of the one in "
        "flight (auto: the engine's default, on for one CUDA device)",
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
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
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


def _check_torch_device(device: str) -> None:
    """After every cheap check: the installed torch can use ``device`` (a CPU build cannot)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"--device {device}: this torch ({torch.__version__}) cannot use the GPU; "
            "install a CUDA build of torch or use --device cpu"
        )


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
    "check_writable",
    "config_from_args",
    "run_bench_command",
    "run_pd_command",
    "validate",
]
