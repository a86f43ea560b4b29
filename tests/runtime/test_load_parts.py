"""Fenced loads landing in parts by layer (``WorkerOptions.load_parts``): each layer's compute
waits only for its own part when the engine waits layer by layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.runtime.fenced_helpers import FACADES, load_spec, stored

from kvflow.backends.base import CopyBatch, Fence, FenceStatus
from kvflow.backends.fake import FakeBackend
from kvflow.backends.host import HostBackend
from kvflow.connector.config import OffloadConfig
from kvflow.core.protocol import StepPlan
from kvflow.core.transfer import Direction
from kvflow.errors import ConfigError, ProtocolError
from kvflow.runtime.inline import InlineSyncWorker
from kvflow.runtime.worker import WorkerOptions

LAYERS = [f"l{i}" for i in range(4)]


def _caches() -> dict[str, torch.Tensor]:
    return {name: torch.randn(2, 8, 4, 2, 8) for name in LAYERS}


def _ready(rt: Any, caches: dict[str, torch.Tensor] | None = None) -> None:
    """Register ``caches`` (fresh ones by default) and a CPU tier of four blocks."""
    rt.register_kv_caches(caches if caches is not None else _caches(), 8)
    rt.allocate_cpu_tier(4)


def _fenced_load_plan(step: int, tid: int = 2) -> StepPlan:
    return StepPlan(step, loads=(load_spec(tid, [5, 6], [0, 3]),), fenced_loads=(tid,))


def _start_fenced(rt: Any, step: int) -> None:
    """Bind a plan fencing one load (transfer ``step``) and start it, layer by layer."""
    rt.bind_connector_metadata(_fenced_load_plan(step, tid=step))
    rt.start_load_kv(layerwise=True)


@FACADES
def test_each_layer_waits_for_its_own_part_on_the_host(facade: Any) -> None:
    """With two parts, once the engine waited for layer l1 its part's layers (l0, l1) are in
    the caches; after l3, every layer is; the load then reports as one."""
    caches = _caches()
    with facade(HostBackend(), WorkerOptions(load_parts=2)) as rt:
        _ready(rt, caches)
        assert rt.runtime.load_parts_of is not None
        want = stored(rt, caches)
        rt.bind_connector_metadata(_fenced_load_plan(2))
        rt.start_load_kv(layerwise=True)
        rt.wait_for_layer_load("l1")
        for name in ("l0", "l1"):
            assert torch.equal(caches[name][:, 5:7], want[name])
        rt.wait_for_layer_load("l3")
        for name in LAYERS:
            assert torch.equal(caches[name][:, 5:7], want[name])
        rt.wait_for_save()
        _, recving = rt.get_finished()
        assert recving == {"r2"}


@FACADES
def test_the_compute_waits_part_by_part_as_the_layers_ask(facade: Any) -> None:
    """On the fake backend: nothing is waited for at ``start_load_kv(layerwise=True)``; a
    layer of part 1 waits for parts 0 and 1 of the batch in order; an earlier layer after that
    waits for nothing more. Without ``layerwise`` every part is waited for at once. The
    backend prepared the parts once, at registration."""
    backend = FakeBackend(auto_complete=True)
    with facade(backend, WorkerOptions(load_parts=2)) as rt:
        _ready(rt)
        _start_fenced(rt, 1)
        assert backend.compute_waits == []
        ((batch, parts),) = backend.parted
        assert parts.count == 2
        assert backend.prepared == [parts], "made ready once, at registration"
        rt.wait_for_layer_load("l2")
        assert [f.kind for f in backend.compute_waits] == ["part", "part"]
        assert all(f.wait_for == (batch,) for f in backend.compute_waits)
        rt.wait_for_layer_load("l0")
        rt.wait_for_layer_load("l3")
        assert len(backend.compute_waits) == 2
        rt.wait_for_save()
        rt.get_finished()
        rt.bind_connector_metadata(_fenced_load_plan(2, tid=2))
        rt.start_load_kv()
        assert len(backend.compute_waits) == 4, "not layerwise: both parts at once"
        rt.wait_for_layer_load("l0")  # nothing in parts to wait for: a no-op
        rt.wait_for_save()
        rt.get_finished()


def test_layers_the_engine_never_waited_for_are_a_protocol_error() -> None:
    """An engine that asked for layer waits but skipped the last layers gets a ProtocolError
    naming them at ``wait_for_save``, the parts waited for by then; the next step runs."""
    backend = FakeBackend(auto_complete=True)
    with InlineSyncWorker(backend, WorkerOptions(load_parts=2)) as rt:
        _ready(rt)
        _start_fenced(rt, 1)
        rt.wait_for_layer_load("l0")
        with pytest.raises(ProtocolError, match=r"1 of 2 load parts: l2, l3"):
            rt.wait_for_save()
        assert len(backend.compute_waits) == 2
        rt.wait_for_save()  # the error closed the layer waits: the step goes on
        rt.get_finished()
        rt.bind_connector_metadata(_fenced_load_plan(2, tid=2))
        rt.start_load_kv(layerwise=True)
        for name in LAYERS:
            rt.wait_for_layer_load(name)
        rt.wait_for_save()
        rt.get_finished()


def test_an_unknown_layer_is_a_config_error_that_waits_for_nothing() -> None:
    """``wait_for_layer_load`` of a name that is not a registered KV tensor raises a
    ConfigError naming it, and waits for nothing."""
    backend = FakeBackend(auto_complete=True)
    with InlineSyncWorker(backend, WorkerOptions(load_parts=2)) as rt:
        _ready(rt)
        _start_fenced(rt, 1)
        with pytest.raises(ConfigError, match="'attn9' is not a registered KV cache tensor"):
            rt.wait_for_layer_load("attn9")
        assert backend.compute_waits == []
        for name in LAYERS:
            rt.wait_for_layer_load(name)
        rt.wait_for_save()
        rt.get_finished()


class _SecondPartFails(HostBackend):
    """The host backend, but a parted load's second part fails on the device."""

    def _copy(self, batch: CopyBatch, spans: Sequence[tuple[int, int]] | None = None) -> None:
        if spans is not None and spans[0][0] > 0:
            raise RuntimeError("injected failure of the second part")
        super()._copy(batch, spans)


@FACADES
def test_a_failed_part_fails_its_load_and_lets_the_step_report_it(facade: Any) -> None:
    """The first part lands, the second fails: its layer's wait finds it failed, the load is
    settled at once (the step's report names it) and its GPU blocks are load errors."""
    caches = _caches()
    with facade(_SecondPartFails(), WorkerOptions(load_parts=2)) as rt:
        _ready(rt, caches)
        want = stored(rt, caches)
        rt.bind_connector_metadata(_fenced_load_plan(2))
        rt.start_load_kv(layerwise=True)
        rt.wait_for_layer_load("l0")
        assert torch.equal(caches["l0"][:, 5:7], want["l0"])
        rt.wait_for_layer_load("l3")
        rt.wait_for_save()
        _, _, report = rt.finish_step()
        assert report.failed == (2,)


def test_one_part_or_a_backend_without_parts_loads_whole() -> None:
    """``load_parts=1`` (the default) leaves loads whole; so does a backend that cannot land
    a load in parts, whatever is asked."""

    class Whole(FakeBackend):
        submit_parts = None  # type: ignore[assignment]

    for backend, opts in (
        (FakeBackend(auto_complete=True), WorkerOptions()),
        (Whole(auto_complete=True), WorkerOptions(load_parts=4)),
    ):
        with InlineSyncWorker(backend, opts) as rt:
            _ready(rt)
            assert rt.runtime.load_parts_of is None
            rt.bind_connector_metadata(_fenced_load_plan(1, tid=1))
            rt.start_load_kv(layerwise=True)
            assert [f.kind for f in backend.compute_waits] == ["copy"]
            rt.wait_for_save()
            rt.get_finished()


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_a_bad_part_count_is_refused_where_it_is_given(bad: Any) -> None:
    """A part count that is not a positive int is a ConfigError from the connector's options
    and from the worker runtime's."""
    with pytest.raises(ConfigError, match="load_parts must be a positive int"):
        OffloadConfig(cpu_bytes="1MiB", load_parts=bad)
    with pytest.raises(ConfigError, match="load_parts must be a positive int"):
        WorkerOptions(load_parts=bad)


@FACADES
def test_a_runtime_that_cannot_start_raises_instead_of_waiting(facade: Any) -> None:
    """A worker runtime refused at start (a negative rank) raises its ConfigError from the
    facade's constructor; the inline facade used to wait for it forever."""
    with pytest.raises(ConfigError, match="negative rank -1"):
        facade(FakeBackend(), WorkerOptions(rank=-1))


def test_a_part_fence_reports_its_batchs_failure() -> None:
    """On the fake backend a failed parted batch fails its parts' fences too."""
    backend = FakeBackend()
    with InlineSyncWorker(backend, WorkerOptions(load_parts=2)) as rt:
        _ready(rt)
        parts = rt.runtime.load_parts_of
        assert parts is not None
        batch = CopyBatch(Direction.LOAD, ((1,),), ((0,),))
        fence, part_fences = backend.submit_parts(batch, parts)
        backend.fail(fence)
        assert backend.query(fence) is FenceStatus.FAILED
        assert [backend.query(p) for p in part_fences] == [FenceStatus.FAILED] * 2


class _FailureSeenLate(_SecondPartFails):
    """``_SecondPartFails``, whose queries see a failed batch only at the fiftieth look (more than a step polls)."""

    looks: int = 0

    def query(self, fence: Fence) -> FenceStatus:
        status = super().query(fence)
        if status is FenceStatus.FAILED and self.looks < 49:
            self.looks += 1
            return FenceStatus.PENDING
        return status


@FACADES
def test_a_failed_part_is_in_the_steps_report_even_when_the_backend_reports_it_late(
    facade: Any,
) -> None:
    """The compute wait finds the second part failed while the batch's queries still read
    pending: the worker waits (bounded) until the backend reports the batch finished, so the
    step's report names the failed load (a report without it lets the engine keep tokens
    computed from garbage: the soak found it)."""
    caches = _caches()
    with facade(_FailureSeenLate(), WorkerOptions(load_parts=2)) as rt:
        _ready(rt, caches)
        stored(rt, caches)
        rt.bind_connector_metadata(_fenced_load_plan(2))
        rt.start_load_kv(layerwise=True)
        for name in LAYERS:
            rt.wait_for_layer_load(name)
        rt.wait_for_save()
        _, _, report = rt.finish_step()
        assert report.failed == (2,)


@settings(max_examples=60, deadline=None)
@given(
    parts=st.integers(1, 4),
    asked=st.lists(st.sampled_from(LAYERS), max_size=8),
    fail=st.booleans(),
)
def test_layer_waits_hold_the_compute_behind_each_part_once_in_order(
    parts: int, asked: list[str], fail: bool
) -> None:
    """Whatever layers the engine asks for, in whatever order: each part's fence is waited for
    at most once, in layer order, only once a layer of it (or a later one) was asked; the rest
    at ``wait_for_save``, with a ProtocolError when any was left; a failed batch is in the
    step's report."""
    backend = FakeBackend()
    with InlineSyncWorker(backend, WorkerOptions(load_parts=parts)) as rt:
        _ready(rt)
        layer_parts = rt.runtime.load_parts_of
        count = 1 if layer_parts is None else layer_parts.count
        rt.bind_connector_metadata(_fenced_load_plan(1, tid=1))
        rt.start_load_kv(layerwise=True)
        (batch,) = backend.submitted
        if fail:
            backend.fail(batch)
        else:
            backend.release(batch)
        highest = -1
        for name in asked:
            rt.wait_for_layer_load(name)
            if layer_parts is not None:
                highest = max(highest, layer_parts.part_of[name])
            want = count if layer_parts is None else highest + 1
            assert len(backend.compute_waits) == want
        if len(backend.compute_waits) < count:
            with pytest.raises(ProtocolError, match="wait_for_layer_load never came"):
                rt.wait_for_save()
        rt.wait_for_save()
        waited = backend.compute_waits
        assert len(waited) == count
        if layer_parts is not None:
            assert len({id(f) for f in waited}) == count
            assert [f.wait_for for f in waited] == [(batch,)] * count
        _, _, report = rt.finish_step()
        assert report.failed == ((1,) if fail else ())
        assert report.completed == (() if fail else (1,))
