"""The CUDA IPC PD transport's logic on CPU, through a fake device (tensors and events in one
process): who exports and who maps, the doorbell tokens that order P's compute → the copy →
P's release in both launch orders, events still running keep fences pending, timeouts, cancel,
peer death, the exporter outliving the mappings at close, typed errors, local events handed
back to the device; and the pure copy planning of ``cuda_copy`` (coalesced D2D descriptors, the
kernel's parameter blocks, the split of a hand-off into by-value launches or one upload). The
real device runs in ``test_pd_cuda_ipc_gpu.py`` (``-m gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.cuda_copy import (
    CHUNK_BYTES,
    MAX_PARAM_BYTES,
    SOURCE,
    VALUE_CAPACITIES,
    VALUE_LAUNCHES,
    PairTable,
    ParamBlock,
    ValueParams,
    choose_method,
    chunks_of,
    d2d_descriptors,
    plan_launches,
    value_capacities,
)
from kvflow.backends.pd.cuda_ipc import CudaIpcTransport, Doorbell, process_start, token_of
from kvflow.backends.pd.rendezvous import Region, SideLayout
from kvflow.core.pd.common import LaunchCopies
from kvflow.engine.distributed import free_port
from kvflow.errors import BackendError, ClosedError, ConfigError, LayoutError, ProtocolError

# -- the fake device ------------------------------------------------------------------------


class FakeEvent:
    def __init__(self, world: World) -> None:
        self.world = world
        self.records = 0
        world.all_events.append(self)


class World:
    """What both fake devices share: tensors by address, events by handle, a hold switch."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.events: dict[bytes, FakeEvent] = {}
        self.all_events: list[FakeEvent] = []
        self.hold = False  # events recorded while held do not complete until released
        self.log: list[tuple[Any, ...]] = []


class FakeDevice:
    def __init__(self, world: World, name: str) -> None:
        self.world, self.name = world, name
        self.src: SideLayout | None = None
        self.dst: SideLayout | None = None
        self.closed = False
        self.lent: set[FakeEvent] = set()  # local events the transport has not handed back

    def check(self, layout: SideLayout) -> None:
        if any(r.device != -1 for g in layout.groups for r in g):
            raise LayoutError("fake device: CPU tensors only")

    def export(self, t: torch.Tensor) -> bytes:
        self.world.log.append(("export", self.name))
        return str(t.data_ptr()).encode()

    def open(self, data: bytes) -> torch.Tensor:
        self.world.log.append(("map", self.name))
        return self.world.tensors[int(data)]

    def new_event(self, *, interprocess: bool) -> FakeEvent:
        event = FakeEvent(self.world)
        if not interprocess:
            self.lent.add(event)
        return event

    def free_event(self, event: FakeEvent) -> None:
        assert event in self.lent, "freed an event the device did not lend"
        self.lent.discard(event)

    def event_handle(self, event: FakeEvent) -> bytes:
        key = uuid.uuid4().bytes
        self.world.events[key] = event
        return key

    def open_event(self, data: bytes) -> FakeEvent:
        return self.world.events[data]

    def record(self, event: FakeEvent, *, on_copy_stream: bool) -> None:
        event.records = -1 if self.world.hold else event.records + 1
        self.world.log.append(("record", self.name, on_copy_stream))

    def wait(self, event: FakeEvent) -> None:
        assert event.records != 0, "waited on an event nobody recorded"
        self.world.log.append(("wait", self.name))

    def query(self, event: FakeEvent) -> bool:
        return event.records > 0

    def prepare(self, src: SideLayout, dst: SideLayout) -> list[str]:
        self.src, self.dst = src, dst
        return ["dma" for _ in src.groups]

    def copy(self, group: int, src_ids: Any, dst_ids: Any) -> int:
        assert self.src is not None
        assert self.dst is not None
        s_idx, d_idx = torch.from_numpy(src_ids), torch.from_numpy(dst_ids)
        for s, d in zip(self.src.groups[group], self.dst.groups[group], strict=True):
            self.world.tensors[d.base][d_idx] = self.world.tensors[s.base][s_idx]
        self.world.log.append(("copy", self.name))
        return len(src_ids)

    def close(self, *, synchronize: bool) -> None:
        self.closed = True
        self.synchronized = synchronize


def release(world: World) -> None:
    world.hold = False
    for e in world.all_events:
        e.records = 1 if e.records < 0 else e.records


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


def tensors(fill: int, blocks: int, rows: tuple[int, ...] = (64, 32)) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(fill)
    return [[torch.randint(0, 255, (blocks, r), generator=g, dtype=torch.uint8) for r in rows]]


def pair(
    mode: str = "read", *, rows_d: tuple[int, ...] = (64, 32), **kw: Any
) -> tuple[CudaIpcTransport, CudaIpcTransport, World, Clock, list[Any]]:
    """P (rank 0) and D (rank 1) registered against each other in one process."""
    world, clock, port = World(), Clock(), free_port()
    kv = [tensors(1, 16), [[torch.zeros(12, r, dtype=torch.uint8) for r in rows_d]]]
    for side in kv:
        for t in side[0]:
            world.tensors[t.data_ptr()] = t
    ends = [
        CudaIpcTransport(
            pair_rank=r,
            host="127.0.0.1",
            port=port,
            now=clock.now,
            timeout_s=5.0,
            mode=mode,
            device=FakeDevice(world, "PD"[r]),
            **kw,
        )
        for r in (0, 1)
    ]
    errors: list[BaseException] = []

    def reg(r: int) -> None:
        try:
            ends[r].register(kv[r])
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=reg, args=(0,))
    th.start()
    reg(1)
    th.join(10)
    if errors:
        for e in ends:
            e.close()
        raise errors[0]
    return ends[0], ends[1], world, clock, kv


PAIRS = (((3, 0), (4, 1), (5, 2), (9, 7), (15, 11)),)


def ops(channel: int = 1, tid: str = "h1") -> tuple[LaunchCopies, LaunchCopies]:
    back = tuple(tuple((d, s) for s, d in g) for g in PAIRS)
    return (
        LaunchCopies(tid, 1, "D", True, PAIRS, channel),
        LaunchCopies(tid, 1, "P", False, back, channel),
    )


def assert_copied(kv: list[Any]) -> None:
    for s_t, d_t in zip(kv[0][0], kv[1][0], strict=True):
        for s, d in PAIRS[0]:
            assert torch.equal(d_t[d], s_t[s])
        named = {d for _, d in PAIRS[0]}
        assert all(not d_t[b].any() for b in range(d_t.shape[0]) if b not in named)


def test_read_mode_exports_p_maps_on_d_and_orders_ready_copy_release() -> None:
    """In read mode P exports and D maps (once, at register); P's launch records its ready event
    before ringing; D's copy waits on its own compute and P's ready; both fences settle DONE only
    once the copied event completed; D's blocks hold P's bytes."""
    p, d, world, _, kv = pair("read")
    try:
        assert [e for e in world.log if e[0] in ("export", "map")] == [("export", "P")] * 2 + [
            ("map", "D")
        ] * 2
        world.log.clear()
        world.hold = True
        send, recv = ops()
        pf = p.launch(send)
        df = d.launch(recv)
        assert world.log[:2] == [("record", "P", False), ("record", "D", False)]
        assert ("wait", "D") in world.log
        assert world.log.index(("copy", "D")) > world.log.index(("wait", "D"))
        assert p.query(pf) is FenceStatus.PENDING  # D's copied event has not completed
        assert d.query(df) is FenceStatus.PENDING
        release(world)
        assert d.query(df) is FenceStatus.DONE
        assert p.query(pf) is FenceStatus.DONE
        assert_copied(kv)
        assert d.stats["copies"] == len(PAIRS[0])
        assert d.stats["bytes"] == len(PAIRS[0]) * 96
        assert d.stats["initiates"]
    finally:
        d.close()
        p.close()


def test_d_launching_first_issues_its_copies_when_p_rings() -> None:
    """D's launch before P's issues nothing; its next query after P's launch copies."""
    p, d, world, _, kv = pair("read")
    try:
        send, recv = ops()
        df = d.launch(recv)
        assert d.query(df) is FenceStatus.PENDING
        assert ("copy", "D") not in world.log
        pf = p.launch(send)
        assert d.query(df) is FenceStatus.DONE
        assert p.query(pf) is FenceStatus.DONE
        assert_copied(kv)
    finally:
        d.close()
        p.close()


def test_write_mode_maps_d_on_p_and_p_copies() -> None:
    """In write mode D exports, P maps and copies into D's blocks after D's ready event."""
    p, d, world, _, kv = pair("write")
    try:
        assert ("map", "P") in world.log
        assert ("export", "D") in world.log
        send, recv = ops()
        df = d.launch(recv)
        pf = p.launch(send)
        assert p.query(pf) is FenceStatus.DONE
        assert d.query(df) is FenceStatus.DONE
        assert_copied(kv)
    finally:
        p.close()
        d.close()


def test_a_peer_that_never_launches_times_out_and_a_cancel_waits_for_issued_copies() -> None:
    """Both sides fail at the deadline when the other never launches (nothing issued); a
    cancel before issue fails at once; a cancel after issue settles FAILED only once the copy
    finished; a later hand-off on the same channel is unaffected."""
    p, d, world, clock, _ = pair("read")
    try:
        send, recv = ops(1, "lonely-d")
        df = d.launch(recv)
        clock.t += 5.1
        with capture_logs() as logs:
            assert d.query(df) is FenceStatus.FAILED
        assert any(e["event"] == "pd_cuda_ipc_timeout" for e in logs)
        pf = p.launch(ops(2, "lonely-p")[0])
        clock.t += 5.1
        assert p.query(pf) is FenceStatus.FAILED
        early = d.launch(ops(3, "early")[1])
        d.cancel(early)
        assert d.query(early) is FenceStatus.FAILED
        world.hold = True
        p.launch(ops(4, "late")[0])
        late = d.launch(ops(4, "late")[1])
        d.cancel(late)
        assert d.query(late) is FenceStatus.PENDING  # its copy is on the stream
        release(world)
        assert d.query(late) is FenceStatus.FAILED
        send, recv = ops(1, "again")
        pf, df = p.launch(send), d.launch(recv)
        assert (d.query(df), p.query(pf)) == (FenceStatus.DONE, FenceStatus.DONE)
    finally:
        d.close()
        p.close()


def test_local_events_go_back_to_the_device_once_past_use() -> None:
    """D's compute event goes back as soon as its copy stream waits on it, its copied event
    once the fence settled: after a hand-off, a timeout and a cancel behind a running copy,
    D's device has lent out no event."""
    p, d, world, clock, _ = pair("read")
    lent = d._dev.lent  # type: ignore[attr-defined]
    try:
        world.hold = True
        send, recv = ops()
        pf, df = p.launch(send), d.launch(recv)
        assert len(lent) == 1  # the copied event; the compute event is back already
        release(world)
        assert (d.query(df), p.query(pf)) == (FenceStatus.DONE, FenceStatus.DONE)
        assert not lent
        lonely = d.launch(ops(2, "lonely")[1])
        assert len(lent) == 1  # recorded, not yet waited on: P has not rung
        clock.t += 5.1
        assert d.query(lonely) is FenceStatus.FAILED
        assert not lent
        world.hold = True
        p.launch(ops(3, "late")[0])
        late = d.launch(ops(3, "late")[1])
        d.cancel(late)
        assert d.query(late) is FenceStatus.PENDING
        assert len(lent) == 1
        release(world)
        assert d.query(late) is FenceStatus.FAILED
        assert not lent
    finally:
        d.close()
        p.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_peer_death_fails_pending_fences_breaks_the_pair_and_never_abandons_a_running_copy() -> (
    None
):
    """When P's pid is gone, D's unissued fence fails, an issued one fails only once its copy
    finished, and later launches fail at once; P's fence fails when D is gone."""
    p, d, world, _, _ = pair("read")
    try:
        world.hold = True
        p.launch(ops(1, "running")[0])
        running = d.launch(ops(1, "running")[1])
        waiting = d.launch(ops(2, "waiting")[1])
        d.peer_pid = _dead_pid()
        with capture_logs() as logs:
            assert d.query(waiting) is FenceStatus.FAILED
        assert any(e["event"] == "pd_cuda_ipc_peer_lost" for e in logs)
        assert d.query(running) is FenceStatus.PENDING
        release(world)
        assert d.query(running) is FenceStatus.FAILED
        assert d.broken is not None
        assert d.query(d.launch(ops(3, "later")[1])) is FenceStatus.FAILED
        pf = p.launch(ops(5, "p-side")[0])
        p.peer_pid = _dead_pid()
        assert p.query(pf) is FenceStatus.FAILED
    finally:
        d.close()
        p.close()


def test_the_exporter_waits_for_the_mappings_to_go_at_close() -> None:
    """D's close drops its mappings and says so; P's close then returns at once. P closing while
    D still maps waits at most ``close_wait_s`` and logs that it did not see D let go."""
    p, d, *_ = pair("read", close_wait_s=0.0)
    d.close()
    with capture_logs() as logs:
        p.close()
    assert not any(e["event"] == "pd_cuda_ipc_close_before_peer_unmapped" for e in logs)
    p, d, _world, _, _ = pair("read", close_wait_s=0.0)
    with capture_logs() as logs:
        p.close()
    assert any(e["event"] == "pd_cuda_ipc_close_before_peer_unmapped" for e in logs)
    d.close()
    d.close()  # idempotent
    with pytest.raises(ClosedError):
        d.launch(ops()[1])


def test_close_never_unmaps_under_a_copy_that_does_not_finish() -> None:
    """D closing while its issued copy never completes waits ``close_wait_s``, logs it, keeps
    the mappings and does not synchronize the stream (which would hang); P then sees no
    "unmapped" flag and stops waiting at its own bound."""
    p, d, world, _, _ = pair("read", close_wait_s=0.0)
    world.hold = True
    p.launch(ops()[0])
    d.launch(ops()[1])
    with capture_logs() as logs:
        d.close()
    assert any(e["event"] == "pd_cuda_ipc_close_with_running_copy" for e in logs)
    assert d._dev.synchronized is False  # type: ignore[attr-defined]
    with capture_logs() as logs:
        p.close()
    assert any(e["event"] == "pd_cuda_ipc_close_before_peer_unmapped" for e in logs)
    assert p._dev.synchronized is True  # type: ignore[attr-defined]


def test_misuse_and_mismatched_layouts_are_typed_errors() -> None:
    """A launch of the wrong role, an unregistered block, a second register are typed errors;
    a peer with other page sizes fails both registers with LayoutError."""
    p, d, _, _, kv = pair("read")
    try:
        with pytest.raises(ProtocolError, match="does not fit read mode"):
            d.launch(ops()[0])
        with pytest.raises(ConfigError, match="block 99"):
            p.launch(LaunchCopies("x", 1, "D", True, (((99, 0),),), 1))
        with pytest.raises(ProtocolError, match="once"):
            p.register(kv[0])
    finally:
        d.close()
        p.close()
    with pytest.raises(LayoutError, match="row bytes"):
        pair("read", rows_d=(64, 16))


def test_doorbell_cells_are_shared_and_tokens_name_one_hand_off(tmp_path: Any) -> None:
    """Two mappings of one doorbell see each other's cells; the owner's close unlinks the file;
    tokens are non-zero and differ by transfer id, epoch and channel; a reaped pid has no
    start time."""
    path = str(tmp_path / "bell")
    a, b = Doorbell(path, create=True), Doorbell(path, create=False)
    t = token_of("x", 1, 7)
    a.ring(7, False, t)
    assert b.rung(7, False, t)
    assert not b.rung(7, True, t)
    b.set_flag(3)
    assert a.flag(3)
    b.close()
    a.close()
    assert not (tmp_path / "bell").exists()
    tokens = {token_of(i, e, c) for i in ("a", "b") for e in (1, 2) for c in (1, 2)}
    assert len(tokens) == 8
    assert 0 not in tokens
    assert process_start(_dead_pid()) is None

    assert process_start(os.getpid()) is not None


# -- copy planning ------------------------------------------------------------------------------


def _table(src_stride: int, dst_stride: int, page: int = 16) -> PairTable:
    return PairTable.of(
        [Region(1000, page, src_stride, 8, 0), Region(5000, 8, 8, 8, 0)],
        [Region(9000, page, dst_stride, 8, 0), Region(20000, 8, 8, 8, 0)],
        group=0,
    )


def test_d2d_descriptors_coalesce_runs_only_where_rows_are_back_to_back() -> None:
    """A run consecutive on both sides is one copy in a dense region and one copy per block in
    a strided one; addresses are base + id × stride, region-major."""
    src, dst = np.array([2, 3, 4, 7]), np.array([0, 1, 2, 5])
    dense = d2d_descriptors(_table(16, 16), src, dst)
    assert dense.size.tolist() == [48, 16, 24, 8]
    assert dense.src.tolist() == [1000 + 32, 1000 + 112, 5000 + 16, 5000 + 56]
    assert dense.dst.tolist() == [9000, 9000 + 80, 20000, 20000 + 40]
    strided = d2d_descriptors(_table(64, 16), src, dst)
    assert strided.size.tolist() == [16, 16, 16, 16, 24, 8]
    assert strided.src.tolist()[:4] == [1000 + 128, 1000 + 192, 1000 + 256, 1000 + 448]


def test_pair_tables_methods_and_the_kernel_parameter_block() -> None:
    """Sides with different pages are a LayoutError; auto picks the kernel for small pages and
    DMA for large; the parameter block carries the regions, the chunks and the device ids, and
    a page is split into CHUNK_BYTES work items."""
    with pytest.raises(LayoutError, match="page sizes"):
        PairTable.of([Region(0, 16, 16, 2, 0)], [Region(0, 32, 32, 2, 0)], group=0)
    t = _table(16, 16)
    assert choose_method("auto", t, 4) == "dma"  # the smallest page is 8 B
    assert choose_method("auto", t, 512 << 10) == "kernel"
    assert choose_method("dma", t, 512 << 10) == "dma"
    with pytest.raises(ConfigError):
        choose_method("fast", t, 1)  # type: ignore[arg-type]
    pb = ParamBlock()
    items = pb.fill(0xABC, 2, 3, 5, 0x1000)
    assert items == 2 * 3 * 5
    i64, i32 = pb.raw.view(np.int64), pb.raw.view(np.int32)
    assert int(i64[0]) == 0xABC
    assert (int(i32[2]), int(i32[3])) == (2, 3)
    assert int(i64[2]) == 5
    assert (int(i64[3]), int(i64[4])) == (0x1000, 0x1000 + 4 * 5)
    with pytest.raises(BackendError, match="chunks"):
        pb.fill(0, 1, 0, 1, 0)
    assert chunks_of(_table(16, 16)) == 1
    assert chunks_of(PairTable.of([Region(0, 9000, 9000, 2, 0)] * 2,
                                  [Region(0, 9000, 9000, 2, 0)] * 2, group=0)) == 3  # fmt: skip
    assert CHUNK_BYTES == 4096


def test_a_hand_off_is_cut_into_the_fewest_by_value_launches_or_uploaded() -> None:
    """Pairs go by value in the smallest parameter block that holds them, a hand-off too large
    for one block in the fewest even launches, and past ``max_launches`` blocks in one launch
    of uploaded ids (capacity 0); bad arguments are a BackendError."""
    caps = VALUE_CAPACITIES
    assert plan_launches(0, caps, 4) == ()
    assert plan_launches(1, caps, 4) == ((0, 1, 256),)
    assert plan_launches(256, caps, 4) == ((0, 256, 256),)
    assert plan_launches(257, caps, 4) == ((0, 257, 1024),)
    assert plan_launches(2048, caps, 4) == ((0, 2048, 2048),)
    assert plan_launches(2049, caps, 4) == ((0, 2049, 4092),)
    assert plan_launches(4092, caps, 4) == ((0, 4092, 4092),)
    assert plan_launches(5000, caps, 4) == ((0, 2500, 4092), (2500, 5000, 4092))
    assert plan_launches(8193, caps, 4) == ((0, 2731, 4092), (2731, 5462, 4092),
                                            (5462, 8193, 4092))  # fmt: skip
    four = plan_launches(4 * 4092, caps, 4)
    assert [b - a for a, b, _ in four] == [4092] * 4
    assert plan_launches(4 * 4092 + 1, caps, 4) == ((0, 4 * 4092 + 1, 0),)
    assert plan_launches(10, caps, 0) == ((0, 10, 0),)
    assert plan_launches(10, (), 4) == ((0, 10, 0),)
    assert plan_launches(300, (256,), 4) == ((0, 150, 256), (150, 300, 256))
    with pytest.raises(BackendError):
        plan_launches(-1, caps, 4)
    with pytest.raises(BackendError):
        plan_launches(5, (0,), 4)
    assert plan_launches(5000, caps, VALUE_LAUNCHES) == ((0, 5000, 0),)  # the default: upload


def test_by_value_parameter_blocks_fit_the_driver_and_pack_the_ids() -> None:
    """Every by-value kernel is in the source and its block fits CUDA's 32,764 bytes (drivers
    before 12.1 or pre-Volta devices get the 4 KiB one alone); a block holds the scalars, then
    the source ids, then the destination ids as int32; too many pairs, unequal columns and
    capacities past the limit are errors."""
    for c in VALUE_CAPACITIES:
        assert f"kvf_pair_copy_v{c}(" in SOURCE
        assert ValueParams(c).raw.nbytes <= MAX_PARAM_BYTES
    assert value_capacities(13000, 9) == VALUE_CAPACITIES
    assert value_capacities(12000, 9) == (256,)
    assert value_capacities(13000, 6) == (256,)
    with pytest.raises(ConfigError):
        ValueParams(4093)
    vp = ValueParams(256)
    items = vp.fill(0xABC, 32, 2, np.array([5, 6, 7]), np.array([1, 2, 3]))
    assert items == 3 * 32 * 2
    i64, i32 = vp.raw[:24].view(np.int64), vp.raw[:24].view(np.int32)
    assert int(i64[0]) == 0xABC
    assert (int(i32[2]), int(i32[3]), int(i64[2])) == (32, 2, 3)
    assert vp.ids[:6].tolist() == [5, 6, 7, 1, 2, 3]
    assert vp.pointers.tolist() == [vp.raw.ctypes.data + o for o in (0, 8, 12, 16, 24)]
    with pytest.raises(BackendError, match="block of 256"):
        vp.fill(0, 1, 1, np.zeros(257, dtype=np.int64), np.zeros(257, dtype=np.int64))
    with pytest.raises(BackendError, match="destination"):
        vp.fill(0, 1, 1, np.zeros(3, dtype=np.int64), np.zeros(2, dtype=np.int64))
