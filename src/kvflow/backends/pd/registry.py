"""Choosing a PD data plane by name: ``make_transport("gloo" | "nixl" | "cuda-ipc", ...)`` builds
one rank's end of a pair (``pair_rank`` 0 is P and hosts the pair's store at ``host:port``), and
``transport_status`` says which ones this machine can use and why not. Transports are imported
only when chosen, so an optional one that is missing costs nothing until asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.errors import ConfigError

TRANSPORTS = ("gloo", "nixl", "cuda-ipc")
"""Every PD transport kvflow has (``fake`` is the tests', built directly)."""


def make_transport(
    name: str,
    *,
    pair_rank: int,
    host: str,
    port: int,
    now: Callable[[], float],
    timeout_s: float = 30.0,
    device: int = 0,
    options: dict[str, Any] | None = None,
) -> Any:
    """One rank's end of a ``name`` pair (a ``KVTransport``); ``options`` go to its constructor
    (e.g. ``mode`` for nixl and cuda-ipc, ``slots`` for gloo). ``ConfigError`` for an unknown
    name, ``BackendError`` when the transport cannot run here."""
    opts = dict(options or {})
    common: dict[str, Any] = {
        "pair_rank": pair_rank,
        "host": host,
        "port": port,
        "timeout_s": timeout_s,
    }
    if name == "gloo":
        from kvflow.backends.pd.gloo import GlooTransport

        return GlooTransport(**common, **opts)
    if name == "nixl":
        from kvflow.backends.pd.nixl import NixlTransport

        return NixlTransport(**common, now=now, **opts)
    if name == "cuda-ipc":
        from kvflow.backends.pd.cuda_ipc import CudaIpcDevice, CudaIpcTransport

        dev_opts = {k: opts.pop(k) for k in ("method", "kernel_ctas") if k in opts}
        return CudaIpcTransport(**common, now=now, device=CudaIpcDevice(device, **dev_opts), **opts)
    raise ConfigError(f"PD transport {name!r}: one of {', '.join(TRANSPORTS)}")


def transport_status(*, probe_nixl: bool = False) -> dict[str, tuple[bool, str]]:
    """Per transport: can it run here, and what was found (version, devices) or why not.
    ``probe_nixl`` creates a NIXL agent to list its backends (a UCX context: ~0.1 s)."""
    out: dict[str, tuple[bool, str]] = {}
    try:
        import torch.distributed as dist

        ok = dist.is_available() and dist.is_gloo_available()
        out["gloo"] = (ok, "torch.distributed gloo" if ok else "torch built without gloo")
    except Exception as e:  # a report, never a crash
        out["gloo"] = (False, f"torch.distributed: {e}")
    from kvflow.backends.pd.nixl import load_nixl

    mod, found = load_nixl()
    if mod is None:
        out["nixl"] = (False, f"not installed (pip install 'kvflow[nixl]'): {found[:120]}")
    elif probe_nixl:
        out["nixl"] = nixl_backends(mod, found)
    else:
        out["nixl"] = (True, found)
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["cuda-ipc"] = (
            (True, f"{n} GPU(s): two processes per GPU")
            if n
            else (False, "no CUDA device (two engine processes on one GPU)")
        )
    except Exception as e:
        out["cuda-ipc"] = (False, f"torch.cuda: {e}")
    return out


def nixl_backends(mod: Any, version: str) -> tuple[bool, str]:
    """NIXL's plugins and the memory types its UCX backend takes, from a throw-away agent."""
    try:
        agent = mod.nixl_agent("kvflow-doctor", mod.nixl_agent_config(backends=["UCX"]))
        plugins = agent.get_plugin_list()
        mems = agent.backend_mems.get("UCX")
        del agent
    except Exception as e:
        return False, f"{version}; creating an agent failed: {str(e)[:120]}"
    if mems is None:
        return False, f"{version}; no UCX backend (plugins: {', '.join(plugins)})"
    return True, f"{version}; UCX backend ({', '.join(mems)}); plugins: {', '.join(plugins)}"


__all__ = ["TRANSPORTS", "make_transport", "nixl_backends", "transport_status"]
