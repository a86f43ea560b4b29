"""End to end: the reference engine with kvflow's offload connector on the host backend."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from attrs import define, field

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.host import HostBackend, HostFence
from kvflow.cli.main import main
from kvflow.connector.api import KVCacheConfig
from kvflow.connector.config import OffloadConfig
from kvflow.connector.offload import OffloadConnector
from kvflow.core.gpu_view import GpuCacheView
from kvflow.core.layout import LayerParts
from kvflow.core.transfer import Direction
from kvflow.engine.engine import Engine, EngineConfig, GenerationRequest
from kvflow.engine.frontend import AsyncEngine
from kvflow.engine.model import model_config
from kvflow.engine.workload import MultiRoundQA, run_multi_round
from tests.engine.helpers import shared_model


@define(eq=False)
class FailingCopies(HostBackend):
    """The host backend, but the first ``fail`` load batches (or store batches, with
    ``direction``) fail on the device."""

    fail: int = 1
    failed: int = 0
    direction: Direction = Direction.LOAD
    _fences: list[HostFence] = field(factory=list)

    def submit(self, batch: CopyBatch, wait_for: Sequence[Fence] = ()) -> HostFence:
        if batch.direction is self.direction and self.failed < self.fail:
            return self._failed()
        return super().submit(batch, wait_for)

    def submit_parts(
        self, batch: CopyBatch, parts: LayerParts, wait_for: Sequence[Fence] = ()
    ) -> tuple[HostFence, tuple[HostFence, ...]]:
        if batch.direction is self.direction and self.failed < self.fail:
            fence = self._failed()
            return fence, tuple(fence for _ in range(parts.count))
        return super().submit_parts(batch, parts, wait_for)

    def _failed(self) -> HostFence:
        self.failed += 1
        fence = HostFence(-self.failed, FenceStatus.FAILED, error="injected copy failure")
        fence.finished.set()
        return fence

    def query(self, fence: Fence) -> FenceStatus:
        if isinstance(fence, HostFence) and fence.fence_id < 0:
            return fence.status
        return super().query(fence)


_LIVE: list[Engine] = []


@pytest.fixture(autouse=True)
def _shut_engines_down() -> Iterator[None]:
    """Shut down every engine a test built, even one that failed: the runtime's loop thread
    would otherwise keep the interpreter alive."""
    yield
    while _LIVE:
        _LIVE.pop().shutdown()


def _engine(
    name: str,
    *,
    offload: OffloadConfig | None,
    num_gpu_blocks: int,
    budget: int = 64,
    backend: HostBackend | None = None,
    ahead: bool = False,
) -> tuple[Engine, list[OffloadConnector]]:
    cfg = model_config(name)
    built: list[OffloadConnector] = []

    def factory(kv: KVCacheConfig, view: GpuCacheView) -> tuple[Any, Any]:
        assert offload is not None
        per_layer = 2 * kv.block_size * cfg.num_kv_heads * cfg.head_dim * 4
        block_bytes = [per_layer * len(g.layer_names) for g in kv.groups]
        conn = OffloadConnector.build(offload, kv, block_bytes, gpu_view=view, backend=backend)
        built.append(conn)
        return conn.scheduler, conn.worker

    engine = Engine(
        cfg,
        EngineConfig(
            block_size=4,
            num_gpu_blocks=num_gpu_blocks,
            max_num_batched_tokens=budget,
            async_scheduling=ahead,
        ),
        model=shared_model(name),
        connector_factory=factory if offload is not None else None,
    )
    _LIVE.append(engine)
    return engine, built


def _assert_nothing_leaked(engine: Engine, conn: OffloadConnector) -> None:
    manager = conn.scheduler.manager
    assert manager.num_live_transfers() == 0
    assert all(not refs for refs in manager.cpu_refs())
    for pool in manager.cpu_pools:
        assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.blocks.num_free_blocks() == engine.blocks.num_usable_blocks
    assert conn.worker.runtime.runtime.in_flight == 0


WORKLOAD = MultiRoundQA(
    num_users=4,
    num_rounds=3,
    system_prompt_len=24,
    first_question_len=16,
    question_len=8,
    answer_len=4,
    vocab_size=1024,
)


@pytest.mark.parametrize(
    "policy",
    [
        "eager",
        "eager-each-step",
        "lazy",
        "eager-inline",
        "lazy-inline",
        "eager-inline-ahead",
        "eager-each-step-ahead",
        "lazy-inline-ahead",
    ],
)
@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_outputs_identical_with_offload_across_evictions_and_reloads(
    name: str, policy: str
) -> None:
    """Greedy outputs with offload equal those without; blocks were stored, evicted and reloaded
    (eager stores coalesced over decode steps, the default, or one store each step; the worker
    runtime's loop on a thread of its own, the default, or inline on the engine's thread; steps
    scheduled ahead of the one in flight, or not)."""
    # Far below the working set, so histories are evicted between rounds; the hybrid model's
    # sliding group holds only a few blocks per request on top of the full group's.
    blocks = 46 if "-swa" in name else 41
    off, _ = _engine(name, offload=None, num_gpu_blocks=blocks)
    want = run_multi_round(off, WORKLOAD).outputs()
    on, (conn,) = _engine(
        name,
        offload=OffloadConfig(
            cpu_bytes="64MiB",
            store_policy=policy.split("-")[0],
            lazy_watermark=16,
            eager_store_interval=1 if policy.startswith("eager-each-step") else 4,
            worker_loop="inline" if "-inline" in policy else "thread",
        ),
        num_gpu_blocks=blocks,
        ahead=policy.endswith("-ahead"),
    )
    got = run_multi_round(on, WORKLOAD)
    assert got.outputs() == want
    assert (on.stats.steps_ahead > 0) == policy.endswith("-ahead")
    stats = conn.scheduler.stats().manager
    assert stats.blocks_stored > 0
    assert stats.blocks_loaded > 0
    assert got.total("external_loaded_tokens") > 0
    on.shutdown()
    _assert_nothing_leaked(on, conn)


@pytest.mark.parametrize("loop", ["thread", "inline"])
def test_a_reloaded_requests_ttft_splits_its_load_at_landing(loop: str) -> None:
    """Every request served by an asynchronous CPU reload has a dated load: its TTFT's parts
    (launch, copies until they landed, landed until the scheduler saw it, ...) are >= 0 and sum
    to the TTFT."""
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(cpu_bytes="64MiB", worker_loop=loop, fence_loads="never"),
        num_gpu_blocks=41,
    )
    got = run_multi_round(on, WORKLOAD)
    reloaded = [r.result for r in got.records if r.result.external_loaded_tokens > 0]
    assert reloaded
    for res in reloaded:
        t = res.timeline
        assert t is not None
        assert t.dated
        parts = [t.queue, t.load_launch, t.load_copy, t.load_seen, t.to_compute, t.prefill]
        assert min(parts) >= 0
        assert t.load_copy > 0
        assert sum(parts) + t.first_step == pytest.approx(res.ttft_s)
    on.shutdown()
    _assert_nothing_leaked(on, conn)


class _PartsSeen(HostBackend):
    """The host backend, counting the loads it was asked to land in parts."""

    parted: int = 0

    def submit_parts(self, batch: CopyBatch, parts: Any, wait_for: Sequence[Fence] = ()) -> Any:
        type(self).parted += 1
        return super().submit_parts(batch, parts, wait_for)


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("loop", ["thread", "inline"])
def test_fenced_reloads_run_in_the_step_that_loads_them(loop: str, parts: int) -> None:
    """With every load fenced, no request waits for its load in the scheduler: a reloaded
    request's copies run inside the step that samples its first token (no load phases), the
    outputs equal the run without offload, and nothing leaks; with ``load_parts`` the loads
    land layer by layer, each layer's attention waiting for its own."""
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=41)
    want = run_multi_round(off, WORKLOAD).outputs()
    _PartsSeen.parted = 0
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(
            cpu_bytes="64MiB", worker_loop=loop, fence_loads="always", load_parts=parts
        ),
        num_gpu_blocks=41,
        backend=_PartsSeen(),
    )
    got = run_multi_round(on, WORKLOAD)
    assert (_PartsSeen.parted > 0) == (parts > 1)
    assert got.outputs() == want
    reloaded = [r.result for r in got.records if r.result.external_loaded_tokens > 0]
    assert reloaded
    for res in reloaded:
        t = res.timeline
        assert t is not None
        assert (t.load_launch, t.load_copy, t.load_seen) == (0, 0, 0)
        assert t.first_step > 0
    assert on.scheduler.num_waiting_for_remote == 0
    on.shutdown()
    _assert_nothing_leaked(on, conn)


@define(eq=False)
class _GatedParts(HostBackend):
    """The host backend, whose copy thread copies a load's part after the first only once the
    engine's compute asks for it (``compute_wait`` on that part): what lands after the compute
    of the earlier layers is then the rule, not luck. Notes the order of asks and copies."""

    events: list[tuple[str, int]] = field(factory=list)
    _gates: dict[int, Any] = field(factory=dict)  # id(part fence) → its threading.Event
    _index: dict[int, tuple[Any, int]] = field(factory=dict)  # id(batch) → (gates, part)

    def submit_parts(self, batch: CopyBatch, parts: Any, wait_for: Sequence[Fence] = ()) -> Any:
        import threading

        fence, part_fences = super().submit_parts(batch, parts, wait_for)
        gates = [threading.Event() for _ in part_fences]
        gates[0].set()
        for k, p in enumerate(part_fences):
            self._gates[id(p)] = (gates[k], k)
        self._index[id(batch)] = (gates, 0)
        return fence, part_fences

    def compute_wait(self, fence: Fence, timeout_s: float) -> bool:
        found = self._gates.get(id(fence))
        if found is not None:
            gate, k = found
            self.events.append(("asked", k))
            gate.set()
        return super().compute_wait(fence, timeout_s)

    def _copy(self, batch: CopyBatch, spans: Sequence[tuple[int, int]] | None = None) -> None:
        if spans is not None:
            gates, k = self._index[id(batch)]
            self._index[id(batch)] = (gates, k + 1)
            if not gates[k].wait(10.0):
                self.events.append(("gate_timed_out", k))
            self.events.append(("copied", k))
        super()._copy(batch, spans)


@pytest.mark.parametrize("loop", ["thread", "inline"])
def test_a_layer_computes_before_a_later_parts_copies_and_outputs_do_not_change(
    loop: str,
) -> None:
    """With loads in three parts (one a layer of the CPU model) and a copy thread that copies
    a part only once the compute asks for it, every part after the first is copied after the
    engine computed the layers before it, and the outputs equal the run without offload."""
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=41)
    want = run_multi_round(off, WORKLOAD).outputs()
    backend = _GatedParts()
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(
            cpu_bytes="64MiB", worker_loop=loop, fence_loads="always", load_parts=3
        ),
        num_gpu_blocks=41,
        backend=backend,
    )
    got = run_multi_round(on, WORKLOAD)
    assert got.outputs() == want
    events = backend.events
    assert ("gate_timed_out", 1) not in events
    assert ("gate_timed_out", 2) not in events
    copies = events.count(("copied", 2))
    assert copies > 0
    assert events.count(("asked", 2)) == copies
    # Per parted load: asked 1 before copied 1, asked 2 before copied 2.
    for k in (1, 2):
        asked = [i for i, e in enumerate(events) if e == ("asked", k)]
        copied = [i for i, e in enumerate(events) if e == ("copied", k)]
        assert all(a < c for a, c in zip(asked, copied, strict=True))
    on.shutdown()
    _assert_nothing_leaked(on, conn)


@pytest.mark.parametrize("loop", ["thread", "inline", "inline-ahead"])
def test_outputs_identical_with_offload_under_preemption(loop: str) -> None:
    """A cache so small that requests are preempted mid-run still gives identical outputs (with
    steps scheduled ahead too)."""
    prompts = [[(7 * i + j) % 1000 for j in range(40)] for i in range(4)]
    reqs = [GenerationRequest(p, 12, request_id=f"p{i}") for i, p in enumerate(prompts)]
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=200)
    want = [r.output_token_ids for r in off.run_to_completion(reqs)]
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(cpu_bytes="16MiB", worker_loop=loop.split("-")[0]),
        num_gpu_blocks=30,
        budget=16,
        ahead=loop.endswith("-ahead"),
    )
    got = on.run_to_completion(reqs)
    assert [r.output_token_ids for r in got] == want
    assert on.stats.preemptions > 0
    again = on.run_to_completion(
        [GenerationRequest(p, 12, request_id=f"again{i}") for i, p in enumerate(prompts)]
    )
    assert [r.output_token_ids for r in again] == want
    assert sum(r.external_loaded_tokens for r in again) > 0
    on.shutdown()
    _assert_nothing_leaked(on, conn)


@pytest.mark.parametrize("fence", ["never", "idle"])
@pytest.mark.parametrize("loop", ["thread", "inline", "inline-ahead"])
def test_failed_load_recovers_by_recompute_with_identical_output(loop: str, fence: str) -> None:
    """A load that fails on the device is recomputed and the output does not change: one the
    request waited for, or a fenced one whose step computed on its blocks (that step's token
    is dropped), with steps scheduled ahead too."""
    prompt = list(range(100, 160))
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=64)
    (want,) = off.run_to_completion([GenerationRequest(prompt, 6, request_id="a")])
    backend = FailingCopies(fail=1)
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(cpu_bytes="16MiB", worker_loop=loop.split("-")[0], fence_loads=fence),
        num_gpu_blocks=64,
        backend=backend,
        ahead=loop.endswith("-ahead"),
    )
    on.run_to_completion([GenerationRequest(prompt, 6, request_id="a")])
    assert on.scheduler.reset_prefix_cache()  # the GPU cache only: the CPU copy stays
    for cache in on.kv_caches.values():
        cache.fill_(1e4)  # what a forward reading the failed load's blocks would see
    (got,) = on.run_to_completion([GenerationRequest(prompt, 6, request_id="b")])
    assert got.output_token_ids == want.output_token_ids
    assert backend.failed == 1
    assert conn.scheduler.stats().manager.failed_transfers >= 1
    assert got.prefill_tokens_computed > 0
    on.shutdown()
    _assert_nothing_leaked(on, conn)


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["thread", "inline", "inline-ahead"])
async def test_async_frontend_serves_concurrent_requests_with_offload(loop: str) -> None:
    """Concurrent generate() streams over an offloading engine match a plain engine's tokens
    (inline: the worker runtime's loop is stepped from the frontend's worker threads; ahead:
    each step's tokens come with the next)."""
    prompts = [[(11 * i + j) % 1000 for j in range(30)] for i in range(5)]
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=200)
    want = [
        r.output_token_ids
        for r in off.run_to_completion([GenerationRequest(p, 5) for p in prompts])
    ]
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(cpu_bytes="16MiB", worker_loop=loop.split("-")[0]),
        num_gpu_blocks=40,
        ahead=loop.endswith("-ahead"),
    )
    got: dict[int, list[int]] = {}

    async def client(i: int, frontend: AsyncEngine) -> None:
        got[i] = [t async for t in frontend.generate(prompts[i], 5, request_id=f"c{i}")]

    async with AsyncEngine(on) as frontend, anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(client, i, frontend)
    assert [tuple(got[i]) for i in range(len(prompts))] == want
    on.shutdown()
    _assert_nothing_leaked(on, conn)


def _tiny_bench(*extra: str) -> int:
    """``kvflow bench`` at a tiny size with ``extra`` arguments; its exit status."""
    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    try:
        return main(
            [
                "bench",
                "--users", "2",
                "--rounds", "2",
                "--system", "32",
                "--first-question", "16",
                "--question", "8",
                "--answer", "4",
                *extra,
            ]
        )  # fmt: skip
    finally:
        # The command sets both for its whole process: later tests' threads keep theirs.
        torch.set_num_threads(threads)
        sys.setswitchinterval(interval)


def test_bench_command_writes_the_json_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow bench` runs at a tiny size and its JSON has every documented field; on CPU it
    leaves one core to kvflow's threads; the host backend times every copy, so its table's
    GB/s are the measured copy time (not the inline loop's lower bound)."""
    out = tmp_path / "bench.json"
    trace = tmp_path / "trace.jsonl"
    assert _tiny_bench("--json", str(out), "--trace", str(trace)) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "store GB/s (copy time measured)" in shown
    assert "lower bounds" not in shown
    data = json.loads(out.read_text())
    assert data["runs"][1]["copy_time_measured"] is True
    assert data["torch_threads"] == max(1, (os.cpu_count() or 1) - 1)
    assert data["outputs_identical"] is True
    assert data["backend"] == "host"
    assert data["device"] == "cpu"
    assert data["model"] == "tiny"
    off, on = data["runs"]
    assert (off["offload"], on["offload"]) == (False, True)
    for run in (off, on):
        for key in (
            "ttft_p50_s",
            "ttft_p90_s",
            "prefill_tokens_computed",
            "prefill_tokens_loaded",
            "cpu_hit_rate",
            "wall_s",
        ):
            assert key in run
    assert off["prefill_tokens_loaded"] == 0
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(e["event"] == "transfer_transition" for e in events)
    assert main(["trace", str(trace)]) == 0


def test_bench_command_with_steps_scheduled_ahead_keeps_identical_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow bench --async-scheduling on` (off by default on the host) runs both engines with
    steps scheduled ahead, says so in its JSON, and float32 outputs stay identical."""
    out = tmp_path / "bench.json"
    assert _tiny_bench("--async-scheduling", "on", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["config"]["async_scheduling"] is True
    assert data["outputs_identical"] is True
    assert "identical" in capsys.readouterr().out


@pytest.mark.parametrize("ahead", [False, True])
def test_an_abort_mid_run_with_offload_leaks_nothing(ahead: bool) -> None:
    """A request aborted while its step is in flight (scheduled ahead) or between steps, with
    its stores launched, leaves the others' tokens unchanged and every GPU and CPU block and
    transfer released."""
    prompts = [[(13 * i + j) % 1000 for j in range(48)] for i in range(3)]
    reqs = [GenerationRequest(p, 8, request_id=f"a{i}") for i, p in enumerate(prompts)]
    off, _ = _engine("tiny", offload=None, num_gpu_blocks=200)
    want = {r.request_id: r.output_token_ids for r in off.run_to_completion(reqs)}
    on, (conn,) = _engine(
        "tiny",
        offload=OffloadConfig(cpu_bytes="16MiB", worker_loop="inline", eager_store_interval=1),
        num_gpu_blocks=64,
        budget=32,
        ahead=ahead,
    )
    for r in reqs:
        on.add_request(r.prompt_token_ids, r.max_tokens, request_id=r.request_id)
    got: dict[str, list[int]] = {f"a{i}": [] for i in range(len(reqs))}
    for _ in range(5):
        for out in on.step():
            got[out.request_id] += out.new_token_ids
    in_flight = on._inflight is not None and any(
        c.request_id == "a1" for c in on._inflight.batch.chunks
    )
    assert in_flight == ahead
    assert on.abort_request("a1")
    while on.has_unfinished():
        for out in on.step():
            got[out.request_id] += out.new_token_ids
    assert tuple(got["a0"]) == want["a0"]
    assert tuple(got["a2"]) == want["a2"]
    assert tuple(got["a1"]) == want["a1"][: len(got["a1"])]
    assert conn.scheduler.stats().manager.blocks_stored > 0
    on.shutdown()
    _assert_nothing_leaked(on, conn)
