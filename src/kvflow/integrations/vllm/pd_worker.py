"""PD in vLLM, the worker side: the data plane of a P or D instance's worker.

The scheduler's ``PDDriver`` decides every copy; its relay hands them here in the connector
metadata (``PDLaunch`` / ``PDCancel``), and this side launches them on a real ``KVTransport``
over the worker's KV tensors and reports each settled fence back (fence id, ok) in the worker
metadata. One transport per pair, built at its first launch on a thread of its own (a gloo
pair is a rendezvous of both engines' workers, which the first GRANT starts on both sides at
about the same time), so no engine step ever blocks on the peer: launches wait in a queue until
the pair is up, and all of them fail if it cannot be built within its timeout (the hand-off then
drains and D recomputes).

Pairs are keyed by side and endpoint: a producer-side launch names the endpoint this worker
hosts for that D (one per D), a consumer-side one the endpoint of the P it pulls from (one per
P), so one worker serves several peers, and a ``kv_both`` worker is both at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from attrs import define, field

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.transport import KVTransport
from kvflow.connector.api import KVCacheConfig
from kvflow.core.logs import get_logger
from kvflow.core.pd.common import LaunchCopies
from kvflow.errors import ConfigError
from kvflow.integrations.vllm.pd_relay import PDCancel, PDLaunch, free_port

if TYPE_CHECKING:
    import torch

log = get_logger("kvflow.integrations.vllm.pd")

TransportFactory = Callable[[int, str, int], KVTransport]
"""(pair rank, host, port) → a transport to that peer; pair rank 0 (P) hosts the pair."""


def pd_groups(kv_caches: Mapping[str, torch.Tensor], kv: KVCacheConfig) -> list[list[torch.Tensor]]:
    """Per KV cache group, the tensors whose first dimension is the block: K and V of each
    layer in vLLM's ``(2, num_blocks, ...)`` layout, or the layer's tensor when the block comes
    first."""
    groups: list[list[torch.Tensor]] = []
    for g in kv.groups:
        tensors: list[torch.Tensor] = []
        for name in g.layer_names:
            t = kv_caches[name]
            if t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == kv.num_blocks:
                tensors.extend((t[0], t[1]))
            elif t.shape[0] == kv.num_blocks:
                tensors.append(t)
            else:
                raise ConfigError(
                    f"PD: layer {name!r} has shape {tuple(t.shape)}; kvflow moves KV tensors "
                    f"of shape (2, {kv.num_blocks}, ...) or ({kv.num_blocks}, ...)"
                )
        groups.append(tensors)
    return groups


@define(eq=False)
class _Pair:
    """One pair's transport: being built (launches queue), up, or failed."""

    key: tuple[str, str]  # (side, endpoint)
    transport: KVTransport | None = None
    queued: list[tuple[int, LaunchCopies]] = field(factory=list)
    thread: threading.Thread | None = None


class PDWorkerSide:
    """A worker's PD data plane: launches the scheduler's copies, reports their fences."""

    def __init__(
        self,
        role: str,
        factory: TransportFactory,
        *,
        host: str,
        data_port: int,
        transport_name: str,
    ) -> None:
        self.role = role
        self.host = host
        # P (or kv_both, P for some requests): the first D's pair is hosted here.
        self.data_port = data_port if data_port or role == "consumer" else free_port(host)
        self.transport_name = transport_name
        self._factory = factory
        self._groups: list[list[torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._live: dict[int, tuple[KVTransport, Fence]] = {}
        self._results: list[tuple[int, bool]] = []
        self._closed = False

    def register(self, groups: list[list[torch.Tensor]]) -> None:
        self._groups = groups

    def apply(self, ops: Sequence[PDLaunch | PDCancel]) -> None:
        for op in ops:
            if isinstance(op, PDLaunch):
                self._launch(op)
            else:
                self._cancel(op.fence_id)

    def _launch(self, launch: PDLaunch) -> None:
        endpoint = launch.data
        if not endpoint and launch.side == "producer":
            endpoint = f"{self.host}:{self.data_port}"
        key = (launch.side, endpoint)
        with self._lock:
            pair = self._pairs.get(key)
            if pair is None:
                pair = self._pairs[key] = self._start(key)
            if pair.transport is None:
                pair.queued.append((launch.fence_id, launch.op))
                return
            self._launch_on(pair.transport, launch.fence_id, launch.op)

    def _launch_on(self, transport: KVTransport, fence_id: int, op: LaunchCopies) -> None:
        try:
            self._live[fence_id] = (transport, transport.launch(op))
        except Exception as e:  # a broken or closed transport: the copy failed
            log.warning("pd_launch_failed", transfer_id=op.transfer_id, error=str(e))
            self._results.append((fence_id, False))

    def _start(self, key: tuple[str, str]) -> _Pair:
        if self._groups is None or self._closed:
            raise ConfigError("PD worker: copies before the KV tensors were registered")
        side, endpoint = key
        host, _, port_text = endpoint.rpartition(":")
        rank, port = (0 if side == "producer" else 1), int(port_text or 0)
        pair = _Pair(key)
        pair.thread = threading.Thread(
            target=self._build, args=(pair, rank, host, port), name="kvflow-pd-pair", daemon=True
        )
        pair.thread.start()
        return pair

    def _build(self, pair: _Pair, rank: int, host: str, port: int) -> None:
        try:
            transport = self._factory(rank, host, port)
            assert self._groups is not None
            transport.register(self._groups)
        except Exception as e:
            log.error("pd_pair_failed", side=pair.key[0], peer=pair.key[1], error=str(e))
            with self._lock:
                self._results.extend((fid, False) for fid, _ in pair.queued)
                pair.queued.clear()
                if self._pairs.get(pair.key) is pair:
                    del self._pairs[pair.key]  # the next launch tries again
            return
        with self._lock:
            if self._closed:
                transport.close()
                return
            pair.transport = transport
            log.info(
                "pd_pair_ready",
                side=pair.key[0],
                peer=pair.key[1],
                transport=self.transport_name,
            )
            for fid, op in pair.queued:
                self._launch_on(transport, fid, op)
            pair.queued.clear()

    def _cancel(self, fence_id: int) -> None:
        with self._lock:
            for pair in self._pairs.values():
                for item in pair.queued:
                    if item[0] == fence_id:
                        pair.queued.remove(item)
                        self._results.append((fence_id, False))
                        return
            live = self._live.get(fence_id)
        if live is not None:
            live[0].cancel(live[1])

    def take_results(self) -> tuple[tuple[int, bool], ...]:
        """The copies that settled since the last call (never blocks)."""
        with self._lock:
            for fid, (transport, fence) in list(self._live.items()):
                status = transport.query(fence)
                if status is not FenceStatus.PENDING:
                    del self._live[fid]
                    self._results.append((fid, status is FenceStatus.DONE))
            out, self._results = tuple(self._results), []
        return out

    @property
    def busy(self) -> bool:
        return bool(self._live or self._results or any(p.queued for p in self._pairs.values()))

    def wait_pairs(self, timeout_s: float) -> bool:
        """Block until no data-plane pair is being built on its thread, at most ``timeout_s``
        (each thread joined in turn); True when none is. A pair's build is real time, not
        engine steps: a caller that steps a fixed number of times may outrun it."""
        with self._lock:
            threads = [
                p.thread
                for p in self._pairs.values()
                if p.thread is not None and p.transport is None and p.thread.is_alive()
            ]
        for t in threads:
            t.join(timeout_s)
        return not any(t.is_alive() for t in threads)

    def close(self, join_s: float = 5.0) -> None:
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
            self._pairs.clear()
        for pair in pairs:
            if pair.thread is not None:
                pair.thread.join(join_s)
            if pair.transport is not None:
                pair.transport.close()


__all__ = ["PDWorkerSide", "TransportFactory", "free_port", "pd_groups"]
