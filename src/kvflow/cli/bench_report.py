"""``kvflow bench``'s report: its tables, the TTFT plot and the line on how outputs were checked."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvflow.bench.multi_round import BenchResult, RunResult
    from kvflow.bench.pd import PDBenchResult

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


__all__ = ["check_line", "figure", "plot", "render", "render_pd", "step_parts_table"]
