"""The engine side of ``bench_connector_transfer.py``: the KV layouts it runs, requests with their
engine's hashes, the connector it builds, and ``Driver``, which makes one connector's calls in an
engine's order for a measured store or load step. ``NullCopies`` is the floor's backend: copies
that finish at once, so that a step's wall is kvflow's own work.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from attrs import define, field, frozen

from kvflow.backends.base import CopyBatch, FenceStatus
from kvflow.backends.select import make_backend
from kvflow.backends.torch_layout import layout_of
from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec, KVConnectorOutput
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.core.hashing import BlockHash, hash_blocks
from kvflow.core.layout import KVLayout
from kvflow.core.requests import KVRequest, NewRequest, SchedulerOutput

TOKENS = 16  # per block
DEADLINE_S = 60.0  # one step that takes longer than this is a hang, not a figure


@frozen
class LayoutSpec:
    """One KV cache layout: how its tensors are shaped (per layer, or one for all layers)."""

    name: str
    what: str

    def tensors(self, layers: int, num_blocks: int, device: str) -> dict[str, torch.Tensor]:
        def new(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.bfloat16, device=device)

        if self.name == "4k":  # FlashAttention (2, N, 16, 1, 128): 4 KiB pages, K and V
            return {f"layer{i}": new(2, num_blocks, TOKENS, 1, 128) for i in range(layers)}
        if self.name == "32k":  # FlashAttention (2, N, 16, 8, 128): 32 KiB pages
            return {f"layer{i}": new(2, num_blocks, TOKENS, 8, 128) for i in range(layers)}
        if self.name == "mla":  # one latent per layer (N, 16, 576): 18 KiB pages
            return {f"layer{i}": new(num_blocks, TOKENS, 576) for i in range(layers)}
        if self.name == "cross":  # every layer of a block in one piece (N, L, 2, 16, 8, 128)
            return {"kv": new(num_blocks, layers, 2, TOKENS, 8, 128)}
        raise ValueError(self.name)


@define(eq=False)
class HashedRequest(KVRequest):
    """A request that carries its engine's block hashes (vLLM's ``Request.block_hashes``,
    kvflow's engine's ``Request``), computed when the request is made."""

    hashes: list[BlockHash] = field(factory=list)

    def engine_block_hashes(self, block_size: int) -> list[BlockHash] | None:
        return self.hashes if block_size == TOKENS else None


def make_request(args: argparse.Namespace, request_id: str, tokens: list[int]) -> KVRequest:
    """The engine's request for ``tokens``: hashed by the engine or (``--hashes kvflow``) not."""
    if args.hashes == "kvflow":
        return KVRequest.from_prompt(request_id, tokens)
    return HashedRequest(request_id, tokens, len(tokens), hashes=hash_blocks(tokens, TOKENS))


LAYOUTS = {
    s.name: s
    for s in (
        LayoutSpec("4k", "FlashAttention K/V, 4 KiB pages (16 × 1 × 128 bf16)"),
        LayoutSpec("mla", "MLA latent, 18 KiB pages (16 × 576 bf16), one tensor per layer"),
        LayoutSpec("32k", "FlashAttention K/V, 32 KiB pages (16 × 8 × 128 bf16)"),
        LayoutSpec("cross", "cross-layer, one tensor (N, L, 2, 16, 8, 128): a block in one piece"),
    )
}


class Driver:
    """Plays the engine around one connector: requests, scattered GPU ids, the step calls."""

    def __init__(
        self,
        conn: OffloadConnector,
        num_gpu_blocks: int,
        seed: int,
        profiler: cProfile.Profile | None = None,
    ) -> None:
        self.conn = conn
        self.rng = np.random.default_rng(seed)
        self.num_gpu_blocks = num_gpu_blocks
        self.step_no = 0
        self.profiler = profiler  # on during the timed spans only
        self.stamps: dict[str, Any] = {}
        """The last measured step's host times (``perf_counter``): its start (``t0``), after
        the plan (``meta``) and the bind (``bind``), around the launch call, each poll's start
        (``polls``) and when the scheduler saw the result (``seen``); with a CUDA backend's
        clock mark (``mark``) the device's copy span can be placed among them."""
        backend = conn.worker.backend
        self._clock = getattr(backend, "clock_mark", None)

    def gpu_ids(self, n: int) -> tuple[int, ...]:
        """``n`` scattered GPU block ids (block 0 is the engine's null block)."""
        ids = self.rng.choice(np.arange(1, self.num_gpu_blocks), size=n, replace=False)
        return tuple(int(i) for i in ids)

    def prompt(self, blocks: int, tag: int) -> list[int]:
        return [tag, *self.rng.integers(0, 32000, size=blocks * TOKENS - 1).tolist()]

    def _poll(self, done: Callable[[KVConnectorOutput], bool], what: str) -> None:
        sched, worker = self.conn.scheduler, self.conn.worker
        deadline = time.perf_counter() + DEADLINE_S
        polls: list[float] = self.stamps.setdefault("polls", [])
        while True:
            polls.append(time.perf_counter())
            worker.get_finished(set())
            report = worker.build_worker_report()
            out = sched.update_connector_output(KVConnectorOutput(reports=(report,)))
            if done(out):
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{what}: not seen done after {DEADLINE_S:.0f} s")

    def _step(self, output: SchedulerOutput) -> float:
        """Plan, bind and launch one step; returns seconds in the launch call of the step's
        direction (``wait_for_save`` for stores, ``start_load_kv`` for loads)."""
        stamps = self.stamps
        meta = self.conn.scheduler.build_connector_meta(output)
        stamps["meta"] = time.perf_counter()
        worker = self.conn.worker
        worker.bind_connector_metadata(meta)
        t0 = stamps["bind"] = time.perf_counter()
        worker.start_load_kv()
        t1 = stamps["loaded"] = time.perf_counter()
        worker.wait_for_save()
        t2 = stamps["saved"] = time.perf_counter()
        return (t2 - t1) if meta.stores else (t1 - t0)

    def begin(self) -> float:
        """A measured step starts now: fresh stamps, a clock mark (the device is idle), and
        its start time."""
        self.stamps = {"mark": self._clock() if self._clock is not None else None}
        t0 = self.stamps["t0"] = time.perf_counter()
        return t0

    def seen(self) -> float:
        """The scheduler has seen the step's result: the step's wall seconds."""
        t = self.stamps["seen"] = time.perf_counter()
        return float(t - self.stamps["t0"])

    def from_launch(self) -> float:
        """The last measured step's seconds from its first launch call (``start_load_kv``,
        after the bind) until the scheduler saw the result: the span issue 25 names, without
        the plan and the bind, which an engine makes before the step's forward pass."""
        return float(self.stamps["seen"] - self.stamps["bind"])

    def next_step(self) -> int:
        self.step_no += 1
        return self.step_no

    def store(self, req: KVRequest, gpu: tuple[int, ...]) -> tuple[float, float]:
        """The step that computes a new request's blocks on ``gpu`` and stores them; (wall
        seconds, launch seconds). The wall starts at the step's plan: the match and the
        allocation came at scheduling time, before the step's forward pass."""
        sched = self.conn.scheduler
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, (gpu,), 0)
        n = len(req.all_token_ids)
        new = NewRequest(req.request_id, (gpu,), 0, n)
        prof = self.profiler
        if prof is not None:
            prof.enable()
        self.begin()
        launch = self._step(SchedulerOutput(self.next_step(), new_requests=(new,)))
        self._poll(lambda _: not sched.has_pending_push_work(), f"store of {req.request_id}")
        wall = self.seen()
        if prof is not None:
            prof.disable()
        return wall, launch

    def load(self, req: KVRequest, gpu: tuple[int, ...]) -> tuple[float, float]:
        """The load step of a request whose prefix is on the CPU tier; (wall, launch) seconds."""
        sched = self.conn.scheduler
        rid = req.request_id
        prof = self.profiler
        if prof is not None:
            prof.enable()
        self.begin()
        hit, _ = sched.get_num_new_matched_tokens(req, 0)
        if not hit:
            raise RuntimeError(f"{rid}: no CPU hit for a stored prompt")
        sched.update_state_after_alloc(req, (gpu,), hit)
        launch = self._step(SchedulerOutput(self.next_step()))
        self._poll(lambda out: rid in out.finished_recving, f"load of {rid}")
        wall = self.seen()
        if prof is not None:
            prof.disable()
        return wall, launch

    def finish(self, req: KVRequest, gpu: tuple[int, ...]) -> None:
        """The request leaves (unmeasured): finished, then an empty step that says so."""
        self.conn.scheduler.request_finished(req, (gpu,))
        done = frozenset({req.request_id})
        self._step(SchedulerOutput(self.next_step(), finished_request_ids=done))
        self._poll(lambda _: True, "an empty step")


class NullCopies:
    """A backend whose copies finish at once and move nothing: what is left of a step is
    kvflow's own work on the engine's thread (the connector floor)."""

    name = "null"

    def __init__(self) -> None:
        self.layout: KVLayout | None = None

    def register_kv_caches(
        self,
        tensors: Mapping[str, object],
        num_blocks: int | Mapping[int, int],
        groups: Mapping[str, int] | None = None,
    ) -> KVLayout:
        self.layout = layout_of(tensors, num_blocks, groups)
        return self.layout

    def allocate_cpu_tier(self, num_blocks: Sequence[int]) -> None:
        return None

    def compute_fence(self) -> object:
        return self

    def compute_wait(self, fence: object, timeout_s: float) -> bool:
        return True

    def submit(self, batch: CopyBatch, wait_for: Sequence[object] = ()) -> object:
        return self

    def query(self, fence: object) -> FenceStatus:
        return FenceStatus.DONE

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        return None

    def close(self) -> None:
        return None


def build_connector(
    args: argparse.Namespace,
    tensors: dict[str, torch.Tensor],
    num_gpu: int,
    block_bytes: int,
    cpu_blocks: int,
    backend: Any = None,
) -> OffloadConnector:
    device = args.device
    kv = KVCacheConfig(
        block_size=TOKENS,
        num_blocks=num_gpu,
        groups=(KVCacheGroupSpec(0, tuple(tensors)),),
        device=device,
    )
    config = OffloadConfig(
        cpu_bytes=cpu_blocks * block_bytes,
        backend="cuda" if device.startswith("cuda") else "host",
        worker_loop=args.worker_loop,
        eager_store_interval=1,
        # Loads as vLLM's asynchronous ones: timed until the scheduler role sees them done.
        fence_loads="never",
    )
    options: dict[str, Any] = {} if args.method == "auto" else {"method": args.method}
    ramp_mib = getattr(args, "ramp_mib", None)
    if ramp_mib is not None:
        options["ramp_bytes"] = int(ramp_mib * (1 << 20))
    if backend is None and device.startswith("cuda") and options:
        backend = make_backend(
            "cuda", device, inline=args.worker_loop == "inline", cuda_options=options
        )
    conn = OffloadConnector.build(config, kv, [block_bytes], now=time.perf_counter, backend=backend)
    conn.worker.register_kv_caches(tensors)
    conn.worker.wait_cpu_tier()
    gc.collect()
    gc.freeze()
    return conn
