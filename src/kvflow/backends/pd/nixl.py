"""The NIXL data plane of PD (the optional extra ``kvflow[nixl]``): one-sided READ or WRITE
between one rank of P and one rank of D through a NIXL agent (UCX: RDMA, CUDA IPC, shared
memory / CMA, TCP), host (DRAM) or GPU (VRAM) KV tensors.

At ``register`` each side registers its KV tensors with its agent once and publishes its agent
metadata and layout on the pair's store (``PairStore``, P's side hosts it); each side loads the
peer's agent and prepares, once, two descriptor lists: one descriptor per (region, block) of its
own tensors and of the peer's. A launch is then only two index arrays (``make_prepped_xfer``),
ordered by local block and region-major, so that a run of blocks consecutive on both sides is a
run of adjacent descriptors, which NIXL merges into one (measured: 1,024 consecutive 32 KiB
blocks post as one descriptor).

Who moves the bytes is the ``mode``, the same on both sides: ``read`` (pull, the default: D
reads P's blocks; D's memory is written only by D's own transfer) or ``write`` (push: P writes
D's blocks). The initiating side's fence is ``check_xfer_state``; the transfer carries a
notification naming the hand-off (channel, epoch, transfer id), and the other side's fence
settles when that notification arrives (``get_new_notifs``): P learns that D's read finished, D
that P's write landed. Fences are polled (``pushes_completions`` is false); NIXL's progress
thread is off by default (it spins a core), so each ``query`` makes NIXL's progress. A passive
fence fails after ``timeout_s`` without its notification; an initiated transfer past
``timeout_s`` is cancelled (``release``), and its fence stays pending until NIXL says nothing of
it runs any more, so the blocks it writes are never freed under it.

``stats`` reports what was chosen: the NIXL backend of the transfers and, from UCX's own
protocol report (``UCX_PROTO_INFO`` into a log file of the process, set only if the user set
neither), the UCX transports per operation (``cma/memory`` for DRAM on one host, ``cuda_ipc``,
``rc_mlx5``, ``tcp``...): a silent fall-back to TCP shows there.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import itertools
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from attrs import define, field

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.cuda.plan import runs
from kvflow.backends.pd.rendezvous import (
    MODES,
    PairStore,
    SideLayout,
    check_launch,
    sorted_pairs,
)
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies
from kvflow.errors import BackendError, ClosedError, ConfigError, LayoutError, ProtocolError

log = get_logger("kvflow.backend.pd.nixl")

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
"""Import names of NIXL's Python API, preferred first (the CUDA 13 wheel bundles UCX)."""
DISTRIBUTIONS = ("nixl-cu13", "nixl-cu12", "nixl")


def load_nixl() -> tuple[Any | None, str]:
    """NIXL's API module and its version, or ``(None, why not)``."""
    why = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # a broken install raises more than ImportError
            why.append(f"{name}: {e}")
            continue
        if not hasattr(mod, "nixl_agent"):
            try:
                mod = importlib.import_module(f"{name}._api")
            except Exception as e:
                why.append(f"{name}._api: {e}")
                continue
        return mod, nixl_version()
    return None, "; ".join(why)


def nixl_version() -> str:
    for dist in DISTRIBUTIONS:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


_TITLE = re.compile(r"^\|([^|]*)\|$")
_ROW = re.compile(r"^\|([^|]*)\|([^|]*)\|([^|]*)\|$")
_TRANSPORT = re.compile(r"[A-Za-z_][\w]*/[\w:.\-]+")
_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\[[^\]]*\]\s*")


def parse_ucx_proto_info(text: str) -> dict[str, list[str]]:
    """The UCX transports per operation in UCX's protocol report (``UCX_PROTO_INFO=y``):
    ``read`` / ``write`` (remote memory access) and ``am`` (active messages: NIXL's
    notifications), each sorted, e.g. ``{"read": ["cma/memory"], "am": ["tcp/lo"]}``."""
    found: dict[str, set[str]] = {}
    current: str | None = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if (m := _TITLE.match(line)) is not None:
            title = m.group(1)
            if "remote memory read" in title:
                current = "read"
            elif "remote memory write" in title:
                current = "write"
            elif "active message" in title:
                current = "am"
            elif "cfg#" not in title:
                current = None
            continue
        if current is not None and (m := _ROW.match(line)) is not None:
            if not re.search(r"\d|inf", m.group(1)) or "Range" in m.group(1):
                continue
            for t in _TRANSPORT.findall(m.group(3)):
                found.setdefault(current, set()).add(t)
    return {op: sorted(ts) for op, ts in sorted(found.items())}


@define(eq=False)
class NixlFence:
    """One side of one launch: the initiator's transfer handle, or the notification awaited."""

    fence_id: int
    transfer_id: str
    key: bytes
    initiator: bool
    deadline: float
    handle: Any = None
    status: FenceStatus = FenceStatus.PENDING
    cancelled: bool = False
    stuck_logged: bool = False


@define(eq=False)
class _Prepped:
    """Descriptor lists prepared once per peer, and where each group starts in them."""

    local: Any
    remote: Any
    local_offsets: tuple[int, ...]
    remote_offsets: tuple[int, ...]


@define
class NixlStats:
    launches: int = 0
    transfers: int = 0
    bytes: int = 0
    descriptors: int = 0  # after coalescing runs (what NIXL merges the indices into)
    indices: int = 0  # one per (block, region): what the launch names
    failed: int = 0
    backends: set[str] = field(factory=set)


def _descriptor_array(layout: SideLayout) -> tuple[np.ndarray[Any, Any], tuple[int, ...]]:
    """``(addr, len, dev)`` rows: per group, per region, every block; and each group's start."""
    rows = []
    offsets = []
    pos = 0
    for regions in layout.groups:
        offsets.append(pos)
        for r in regions:
            blocks = np.arange(r.num_blocks, dtype=np.uint64)
            arr = np.empty((r.num_blocks, 3), dtype=np.uint64)
            arr[:, 0] = np.uint64(r.base) + blocks * np.uint64(r.stride)
            arr[:, 1] = r.row_bytes
            arr[:, 2] = max(r.device, 0)
            rows.append(arr)
            pos += r.num_blocks
    return np.concatenate(rows) if rows else np.zeros((0, 3), dtype=np.uint64), tuple(offsets)


def xfer_indices(
    pairs: Sequence[Any],
    local: SideLayout,
    remote: SideLayout,
    local_offsets: Sequence[int],
    remote_offsets: Sequence[int],
) -> tuple[Any, Any, int, int]:
    """Index arrays of one launch into the prepared lists (``_descriptor_array``'s order), int32,
    region-major with the pairs ordered by local block, so runs consecutive on both sides are
    adjacent; the number of descriptors the runs coalesce to; the bytes moved."""
    local_parts, remote_parts = [], []
    ndesc = nbytes = 0
    for g, gp in enumerate(pairs):
        if not len(gp):
            continue
        loc, rem = sorted_pairs(gp)
        nl, nr = local.num_blocks(g), remote.num_blocks(g)
        r = np.arange(len(local.groups[g]), dtype=np.int64)[:, None]
        local_parts.append((local_offsets[g] + r * nl + loc[None, :]).reshape(-1))
        remote_parts.append((remote_offsets[g] + r * nr + rem[None, :]).reshape(-1))
        ndesc += len(runs(loc, rem)[0]) * len(local.groups[g])
        nbytes += len(loc) * local.block_bytes(g)
    if not local_parts:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty, 0, 0
    li = np.concatenate(local_parts).astype(np.int32)
    ri = np.concatenate(remote_parts).astype(np.int32)
    return li, ri, ndesc, nbytes


def mem_type_of(layout: SideLayout, *, what: str) -> str:
    """``DRAM`` or ``VRAM``: one NIXL descriptor list holds one memory type."""
    kinds = {r.device >= 0 for g in layout.groups for r in g}
    if len(kinds) != 1:
        raise LayoutError(f"{what}: KV tensors on both host and GPU; register one kind")
    return "VRAM" if kinds.pop() else "DRAM"


class NixlTransport:
    """One rank's NIXL data plane to one peer rank (``pair_rank`` 0 hosts the pair's store)."""

    name = "nixl"
    pushes_completions = False

    def __init__(
        self,
        *,
        pair_rank: int,
        host: str,
        port: int,
        now: Callable[[], float],
        timeout_s: float = 30.0,
        mode: str = "read",
        backends: Sequence[str] = ("UCX",),
        probe_ucx: bool = True,
        progress_thread: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"nixl transport: mode must be one of {MODES}, not {mode!r}")
        mod, version = load_nixl()
        if mod is None:
            raise BackendError(
                f"nixl transport: NIXL is not importable ({version}); pip install 'kvflow[nixl]'"
            )
        self.mode = mode
        self.version = version
        self.timeout_s = timeout_s
        self._now = now
        self._op = "READ" if mode == "read" else "WRITE"
        self._store = PairStore(
            pair_rank=pair_rank, host=host, port=port, timeout_s=timeout_s, what="nixl transport"
        )
        self._ucx_log = self._probe_env() if probe_ucx else None
        self._ucx: dict[str, list[str]] = {}
        name = f"kvflow-{'p' if pair_rank == 0 else 'd'}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        restore = self._ucx_log[1] if self._ucx_log else {}
        try:
            # NIXL's progress thread polls without pause (measured: it took a core from each
            # engine on the dev box, ITL ×10); without it, every query makes progress instead.
            config = mod.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=list(backends)
            )
            self._agent = mod.nixl_agent(name, config)
        except Exception as e:
            raise BackendError(f"nixl transport: creating the agent failed: {e}") from e
        finally:
            for k, v in restore.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise BackendError(
                f"nixl transport: backend(s) {missing} unavailable; plugins: "
                f"{self._agent.get_plugin_list()}"
            )
        self.agent_name = name
        self.backends = tuple(backends)
        self._layout: SideLayout | None = None
        self._peer_layout: SideLayout | None = None
        self._reg: Any = None
        self._tensors: list[list[torch.Tensor]] = []
        self._remote: str | None = None
        self._prepped: _Prepped | None = None
        self._ids = itertools.count()
        self._waiting: dict[bytes, NixlFence] = {}
        self._early: dict[bytes, float] = {}  # notifications that came before their launch
        self._live: list[NixlFence] = []  # initiated transfers not yet settled
        self._closed = False
        self.broken: str | None = None
        self.counters = NixlStats()
        log.info("pd_transport_ready", transport="nixl", agent=name, mode=mode, version=version)

    # -- setup --------------------------------------------------------------------------------

    @staticmethod
    def _probe_env() -> tuple[str, dict[str, str | None]] | None:
        """Point UCX's protocol report at a file of this process (before the agent exists),
        unless the user configured UCX's logging; returns the file and the variables to restore."""
        if any(k in os.environ for k in ("UCX_LOG_FILE", "UCX_PROTO_INFO")):
            return None
        path = os.path.join(
            tempfile.gettempdir(), f"kvflow-ucx-{os.getpid()}-{uuid.uuid4().hex[:8]}.log"
        )
        os.environ["UCX_LOG_FILE"] = path
        os.environ["UCX_PROTO_INFO"] = "y"
        return path, {"UCX_LOG_FILE": None, "UCX_PROTO_INFO": None}

    def register(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if self._closed:
            raise ClosedError("nixl transport is closed")
        if self._layout is not None:
            raise ProtocolError("nixl transport: KV tensors are registered once")
        layout = SideLayout.of(groups, what="nixl transport")
        mem = mem_type_of(layout, what="nixl transport")
        spans = np.array(
            [(r.base, r.span, max(r.device, 0)) for g in layout.groups for r in g], dtype=np.uint64
        )
        agent = self._agent
        try:
            self._reg = agent.register_memory(spans, mem)
            self._store.publish("layout", mem.encode() + b"\n" + layout.to_bytes())
            self._store.publish("agent", agent.get_agent_metadata())
        except Exception as e:
            raise BackendError(f"nixl transport: registering the KV tensors failed: {e}") from e
        self._layout = layout
        # Registered memory must outlive every transfer: hold the tensors, not only addresses.
        self._tensors = [list(g) for g in groups]
        peer_mem, _, peer_raw = self._store.fetch("layout").partition(b"\n")
        peer = SideLayout.from_bytes(peer_raw)
        layout.check_peer(peer, what="nixl transport")
        try:
            remote_name = agent.add_remote_agent(self._store.fetch("agent"))
            # The bindings answer bytes here but key notifications by str.
            if isinstance(remote_name, bytes):
                remote_name = remote_name.decode()
            self._remote = str(remote_name)
            local, local_off = _descriptor_array(layout)
            remote, remote_off = _descriptor_array(peer)
            self._prepped = _Prepped(
                agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem),
                agent.prep_xfer_dlist(self._remote, remote, peer_mem.decode()),
                local_off,
                remote_off,
            )
        except Exception as e:
            raise BackendError(
                f"nixl transport: preparing the peer's descriptors failed: {e}"
            ) from e
        self._peer_layout = peer
        log.info(
            "pd_nixl_registered",
            peer=self._remote,
            mem=mem,
            peer_mem=peer_mem.decode(),
            descriptors=len(local) + len(remote),
        )

    # -- the protocol -------------------------------------------------------------------------

    def launch(self, op: LaunchCopies) -> NixlFence:
        if self._closed:
            raise ClosedError("nixl transport is closed")
        if self._prepped is None or self._layout is None or self._peer_layout is None:
            raise ProtocolError("nixl transport: register the KV tensors before launching")
        arrays = check_launch(
            op.pairs, self._layout, self._peer_layout, op.channel, what="nixl transport"
        )
        initiator = op.send == (self.mode == "write")
        key = f"kvflow:{op.channel}:{op.epoch}:{op.transfer_id}".encode()
        fence = NixlFence(
            next(self._ids), op.transfer_id, key, initiator, self._now() + self.timeout_s
        )
        self.counters.launches += 1
        if not any(len(a) for a in arrays):
            fence.status = FenceStatus.DONE
            return fence
        if self.broken is not None:
            fence.status = FenceStatus.FAILED
            return fence
        if not initiator:
            if self._early.pop(key, None) is not None:
                fence.status = FenceStatus.DONE
            else:
                self._waiting[key] = fence
            return fence
        p = self._prepped
        local_idx, remote_idx, ndesc, nbytes = xfer_indices(
            arrays, self._layout, self._peer_layout, p.local_offsets, p.remote_offsets
        )
        agent = self._agent
        try:
            fence.handle = agent.make_prepped_xfer(
                self._op, self._prepped.local, local_idx, self._prepped.remote, remote_idx, key
            )
            state = agent.transfer(fence.handle)
        except Exception as e:
            log.error("pd_nixl_post_failed", transfer_id=op.transfer_id, error=str(e)[:200])
            self._release(fence)
            fence.status = FenceStatus.FAILED
            self.counters.failed += 1
            return fence
        c = self.counters
        c.transfers += 1
        c.bytes += nbytes
        c.descriptors += ndesc
        c.indices += len(local_idx)
        if not c.backends:
            try:
                c.backends.add(agent.query_xfer_backend(fence.handle))
            except Exception:  # reporting only
                c.backends.add("unknown")
        if state == "ERR":
            self._settle(fence, FenceStatus.FAILED)
        else:
            self._live.append(fence)
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        if not isinstance(fence, NixlFence):
            raise ProtocolError(f"not a nixl transport fence: {fence!r}")
        if fence.status is not FenceStatus.PENDING:
            return fence.status
        if fence.initiator:
            self._check_initiated(fence)
        else:
            self._pump_notifs()
            if fence.status is FenceStatus.PENDING and (
                fence.cancelled or self._now() > fence.deadline
            ):
                self._waiting.pop(fence.key, None)
                log.warning("pd_nixl_notification_missed", transfer_id=fence.transfer_id)
                self._settle(fence, FenceStatus.FAILED)
        return fence.status

    def _check_initiated(self, fence: NixlFence) -> None:
        try:
            state = self._agent.check_xfer_state(fence.handle)
        except Exception as e:
            log.error("pd_nixl_state_failed", transfer_id=fence.transfer_id, error=str(e)[:200])
            state = "ERR"
        if state == "DONE":
            self._settle(fence, FenceStatus.DONE)
        elif state != "PROC":
            log.error("pd_nixl_transfer_failed", transfer_id=fence.transfer_id)
            self._settle(fence, FenceStatus.FAILED)
        elif fence.cancelled or self._now() > fence.deadline:
            # Freed only once NIXL says nothing of it runs: a cancel that did not take keeps
            # the fence pending (its blocks may still be written).
            if self._release(fence):
                log.warning("pd_nixl_transfer_aborted", transfer_id=fence.transfer_id)
                self._settle(fence, FenceStatus.FAILED)
            elif not fence.stuck_logged:
                fence.stuck_logged = True
                log.error("pd_nixl_transfer_not_cancellable", transfer_id=fence.transfer_id)

    def _pump_notifs(self) -> None:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:
            log.error("pd_nixl_notifs_failed", error=str(e)[:200])
            return
        now = self._now()
        for sender, msgs in notifs.items():
            for m in msgs:
                if sender != self._remote:
                    log.info("pd_nixl_notification_dropped", why="wrong_peer", sender=sender)
                    continue
                fence = self._waiting.pop(m, None)
                if fence is not None:
                    self._settle(fence, FenceStatus.DONE)
                else:
                    self._early[m] = now
        for k, at in list(self._early.items()):
            if now - at > self.timeout_s:
                del self._early[k]
                log.info(
                    "pd_nixl_notification_dropped", why="stale", key=k.decode(errors="replace")
                )

    def _settle(self, fence: NixlFence, status: FenceStatus) -> None:
        fence.status = status
        if status is FenceStatus.FAILED:
            self.counters.failed += 1
        if fence.handle is not None:
            self._release(fence)
        if fence in self._live:
            self._live.remove(fence)

    def _release(self, fence: NixlFence) -> bool:
        """Release the fence's transfer handle (cancelling it if it runs); True when it is gone."""
        if fence.handle is None:
            return True
        try:
            self._agent.release_xfer_handle(fence.handle)
        except Exception as e:
            log.info("pd_nixl_release_refused", transfer_id=fence.transfer_id, error=str(e)[:120])
            return False
        fence.handle = None
        return True

    def cancel(self, fence: Fence) -> None:
        if not isinstance(fence, NixlFence) or fence.status is not FenceStatus.PENDING:
            return
        fence.cancelled = True
        if not fence.initiator:
            self._waiting.pop(fence.key, None)
            self._settle(fence, FenceStatus.FAILED)
        else:
            self._check_initiated(fence)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        del wakeup  # polled: NIXL's progress thread has no hook to call

    @property
    def stats(self) -> dict[str, Any]:
        """What was chosen and moved: NIXL backend, UCX transports per operation, counters."""
        if self._ucx_log is not None and not self._closed:
            # UCX writes its report as it configures endpoints (buffered): read it each time.
            with contextlib.suppress(OSError), open(self._ucx_log[0], errors="replace") as f:
                self._ucx = parse_ucx_proto_info(f.read())
        c = self.counters
        return {
            "transport": "nixl",
            "nixl": self.version,
            "mode": self.mode,
            "backend": ",".join(sorted(c.backends)) or ",".join(self.backends),
            "ucx": {k: ",".join(v) for k, v in self._ucx.items()}
            if self._ucx_log is not None
            else "not probed (UCX_LOG_FILE / UCX_PROTO_INFO set by the user)",
            "launches": c.launches,
            "transfers": c.transfers,
            "bytes": c.bytes,
            "descriptors": c.descriptors,
            "indices": c.indices,
            "failed": c.failed,
        }

    def close(self) -> None:
        if self._closed:
            return
        stats = self.stats
        self._closed = True
        for f in list(self._live):
            if not self._release(f):
                log.error("pd_nixl_close_with_running_transfer", transfer_id=f.transfer_id)
            f.status = FenceStatus.FAILED
        self._live.clear()
        for f in self._waiting.values():
            f.status = FenceStatus.FAILED
        self._waiting.clear()
        agent = self._agent
        steps: list[tuple[str, Callable[[], object]]] = []
        if self._prepped is not None:
            p = self._prepped
            steps += [("dlist", p.local.release), ("dlist", p.remote.release)]
        if self._remote is not None:
            remote = self._remote
            steps.append(("remote_agent", lambda: agent.remove_remote_agent(remote)))
        if self._reg is not None:
            reg = self._reg
            steps.append(("memory", lambda: agent.deregister_memory(reg)))
        for what, step in steps:
            try:
                step()
            except Exception as e:
                log.warning("pd_nixl_close_step_failed", step=what, error=str(e)[:120])
        self._prepped = None
        self._tensors = []
        if self._ucx_log is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._ucx_log[0])
        log.info("pd_transport_closed", transport="nixl", stats=stats)


__all__ = [
    "MODES",
    "NixlFence",
    "NixlTransport",
    "load_nixl",
    "mem_type_of",
    "nixl_version",
    "parse_ucx_proto_info",
    "xfer_indices",
]
