"""The NIXL PD transport: its pure parts on any machine (UCX's protocol report, index planning,
layout and launch checks), and, where NIXL is importable (``kvflow[nixl]``), two spawned
processes on this machine moving scattered host-memory blocks byte-exact by READ (the default:
D pulls, P's fence settles on D's notification) and by WRITE, runs coalesced, the UCX transport
reported, a notification nobody sends failing by the timeout, and bad launches refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.nixl import load_nixl, parse_ucx_proto_info, xfer_indices
from kvflow.backends.pd.rendezvous import SideLayout, check_launch
from kvflow.core.pd.common import LaunchCopies
from kvflow.engine.distributed import free_port, launch
from kvflow.errors import ConfigError, LayoutError
from kvflow.runtime.clock import SystemClock

NIXL, _WHY = load_nixl()
needs_nixl = pytest.mark.skipif(NIXL is None, reason=f"NIXL is not importable: {_WHY}")

UCX_REPORT = """\
[1796127831.729011] [vm:4451 :0]   +--------+-------------+-------------------------------+
[1796127831.729011] [vm:4451 :0]   | B intra-node cfg#1                                     |
[1796127831.729011] [vm:4451 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796127831.729011] [vm:4451 :0]   +--------+-------------+-------------------------------+
[1796127831.729011] [vm:4451 :0]   | Range  | Description |            Config             |
[1796127831.729011] [vm:4451 :0]   +--------+-------------+-------------------------------+
[1796127831.729011] [vm:4451 :0]   | 0..inf | zero-copy   | cma/memory                    |
[1796127831.729011] [vm:4451 :0]   +--------+-------------+-------------------------------+
[1796127831.763214] [vm:4451 :0]   | B intra-node cfg#1                                   |
[1796127831.763214] [vm:4451 :0]   | active message by ucp_am_send*(egr) from host memory |
[1796127831.763214] [vm:4451 :0]   |   Range    |    Description     |       Config       |
[1796127831.763214] [vm:4451 :0]   |          0 | short              | tcp/lo             |
[1796127831.763214] [vm:4451 :0]   | 16516..inf | multi-frag copy-in | tcp/lo             |
[1796127831.800000] [vm:4451 :0]   | A inter-node cfg#2                                   |
[1796127831.800000] [vm:4451 :0]   | remote memory write by ucp_put* from cuda memory to cuda |
[1796127831.800000] [vm:4451 :0]   | 0..8K   | zero-copy | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |
[1796127831.800000] [vm:4451 :0]   | tag matching by ucp_tag_send* from host memory |
[1796127831.800000] [vm:4451 :0]   | 0..inf  | eager     | posix/memory |
"""


def test_ucx_protocol_report_names_the_transports_per_operation() -> None:
    """The parser takes each remote-memory and active-message table's transports and ignores
    other tables (tag matching) and the header rows."""
    assert parse_ucx_proto_info(UCX_REPORT) == {
        "am": ["tcp/lo"],
        "read": ["cma/memory"],
        "write": ["rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1"],
    }
    assert parse_ucx_proto_info("") == {}


def _layout(blocks: int, rows: list[int], base: int = 1 << 20) -> SideLayout:
    tensors = [torch.zeros(blocks, r, dtype=torch.uint8) for r in rows]
    return SideLayout.of([tensors], what="test")


def test_indices_are_region_major_sorted_by_local_block_and_count_coalesced_runs() -> None:
    """Pairs are ordered by local block; each region's indices follow the last one's; a run
    consecutive on both sides counts as one descriptor per region."""
    local, remote = _layout(10, [16, 32]), _layout(20, [16, 32])
    pairs = (((5, 11), (3, 9), (4, 10), (8, 0)),)
    li, ri, ndesc, nbytes = xfer_indices(pairs, local, remote, (0,), (0,))
    assert li.tolist() == [3, 4, 5, 8, 13, 14, 15, 18]
    assert ri.tolist() == [9, 10, 11, 0, 29, 30, 31, 20]
    assert ndesc == 2 * 2  # the run 3-5 ↔ 9-11 and the lone 8 ↔ 0, in both regions
    assert nbytes == 4 * 48
    assert li.dtype == np.int32
    empty = xfer_indices(((),), local, remote, (0,), (0,))
    assert empty[0].size == 0
    assert empty[2:] == (0, 0)


def test_layouts_that_cannot_meet_and_bad_launches_are_typed_errors() -> None:
    """A peer with other row sizes or group counts is a LayoutError; a launch naming a block or
    group that is not registered, or a channel out of range, is a ConfigError."""
    mine = _layout(8, [16, 32])
    with pytest.raises(LayoutError, match="row bytes"):
        mine.check_peer(_layout(8, [16, 16]), what="t")
    with pytest.raises(LayoutError, match="groups"):
        mine.check_peer(SideLayout(()), what="t")
    mine.check_peer(_layout(3, [16, 32]), what="t")  # block counts may differ
    with pytest.raises(ConfigError, match="remote block 3"):
        check_launch((((0, 3),),), mine, _layout(3, [16, 32]), 1, what="t")
    with pytest.raises(ConfigError, match="local block 8"):
        check_launch((((8, 0),),), mine, mine, 1, what="t")
    with pytest.raises(ConfigError, match="groups"):
        check_launch(((), ()), mine, mine, 1, what="t")
    with pytest.raises(ConfigError, match="channel"):
        check_launch(((),), mine, mine, 0, what="t")
    with pytest.raises(LayoutError, match="contiguous"):
        SideLayout.of([[torch.zeros(4, 8)[:, ::2]]], what="t")
    with pytest.raises(LayoutError, match="number of blocks"):
        SideLayout.of([[torch.zeros(4, 8), torch.zeros(5, 8)]], what="t")


# -- two processes, host memory ----------------------------------------------------------------

PAIRS_0 = ((3, 40), (17, 2), (5, 5), (60, 33), (8, 9), (9, 10), (10, 11), (11, 12))
PAIRS_1 = ((1, 30), (31, 0), (12, 13))
PAIRS = (PAIRS_0, PAIRS_1)


def kv(rank: int) -> list[list[torch.Tensor]]:
    """Group 0: one (64, 2, 128) fp16 tensor; group 1: K and V of (32, 4096) u8 (P's blocks
    random, D's zero; D's pool smaller than P's in group 0)."""
    if rank == 0:
        g = torch.Generator().manual_seed(7)
        k0 = torch.randn(64, 2, 128, generator=g).half()
        k1 = torch.randint(0, 255, (32, 4096), generator=g, dtype=torch.uint8)
        v1 = torch.randint(0, 255, (32, 4096), generator=g, dtype=torch.uint8)
    else:
        k0 = torch.zeros(48, 2, 128).half()
        k1 = torch.zeros(32, 4096, dtype=torch.uint8)
        v1 = torch.zeros(32, 4096, dtype=torch.uint8)
    return [[k0], [k1, v1]]


def _wait(t: Any, fence: Any, limit_s: float) -> str:
    clock = SystemClock()
    deadline = clock.now() + limit_s
    while t.query(fence) is FenceStatus.PENDING:
        if clock.now() > deadline:
            return "pending"
    return str(t.query(fence).value)


def _pair(rank: int, world_size: int, port: int, mode: str, device: str = "cpu") -> Any:
    """One rank of P (0) and D (1): two hand-offs, then the error paths."""
    del world_size
    if device == "cuda":
        torch.cuda.set_device(0)
    from kvflow.backends.pd.nixl import NixlTransport

    clock = SystemClock()
    t = NixlTransport(
        pair_rank=rank, host="127.0.0.1", port=port, now=clock.now, timeout_s=3.0, mode=mode
    )
    out: dict[str, Any] = {}
    try:
        tensors = [[x.to(device) for x in g] for g in kv(rank)]
        t.register(tensors)
        send = rank == 0
        pairs = PAIRS if send else tuple(tuple((d, s) for s, d in g) for g in PAIRS)
        out["first"] = _wait(t, t.launch(LaunchCopies("h1", 1, "peer", send, pairs, 1)), 20.0)
        out["again"] = _wait(t, t.launch(LaunchCopies("h2", 1, "peer", send, pairs, 2)), 20.0)
        try:
            t.launch(LaunchCopies("bad", 1, "peer", send, (((99, 0),),), 3))
        except ConfigError as e:
            out["bad"] = str(e)
        # A launch whose peer never launches: the passive side's notification never comes.
        passive_send = mode == "read"
        if send == passive_send:
            out["orphan"] = _wait(
                t, t.launch(LaunchCopies("never", 1, "peer", send, (((0, 1),),), 4)), 20.0
            )
            cancelled = t.launch(LaunchCopies("cancelled", 1, "peer", send, (((0, 1),),), 5))
            t.cancel(cancelled)
            out["cancelled"] = t.query(cancelled).value
        out["stats"] = t.stats
        if rank == 1:
            out["tensors"] = [[x.cpu() for x in g] for g in tensors]
        return out
    finally:
        t.close()


def assert_moved(res: list[Any]) -> None:
    """Both hand-offs DONE on both sides; D's named blocks hold exactly P's, the rest zero."""
    assert [r["first"] for r in res] == ["done", "done"]
    assert [r["again"] for r in res] == ["done", "done"]
    src, dst = kv(0), res[1]["tensors"]
    for g, pairs in enumerate(PAIRS):
        named = {d for _, d in pairs}
        for s_t, d_t in zip(src[g], dst[g], strict=True):
            for s, d in pairs:
                assert torch.equal(d_t[d], s_t[s]), (g, s, d)
            for b in range(d_t.shape[0]):
                if b not in named:
                    assert not d_t[b].any(), (g, b)


@pytest.fixture(scope="module", params=["read", "write"])
def res(request: pytest.FixtureRequest) -> list[Any]:
    """One spawned pair per mode runs every scenario (spawning is the slow part)."""
    if NIXL is None:
        pytest.skip(f"NIXL is not importable: {_WHY}")
    return launch(_pair, (free_port(), request.param), world_size=2, timeout_s=120)


@needs_nixl
def test_nixl_pair_moves_scattered_blocks_byte_exact(res: list[Any]) -> None:
    """D's named blocks hold exactly P's source blocks (one- and two-region groups, different
    pool sizes, twice); every other block of D is untouched; both sides' fences settle DONE
    (the passive one on the notification)."""
    assert_moved(res)


@needs_nixl
def test_nixl_coalesces_runs_and_reports_the_ucx_transport(res: list[Any]) -> None:
    """The initiator names one index per (block, region) but its runs coalesce to fewer
    descriptors; the stats name the NIXL backend and UCX's remote-memory transport."""
    initiator = next(r for r in res if r["stats"]["transfers"])
    s = initiator["stats"]
    assert s["transfers"] == 2
    assert s["indices"] == 2 * (len(PAIRS_0) + 2 * len(PAIRS_1))
    assert s["descriptors"] < s["indices"]
    assert s["backend"] == "UCX"
    # UCX reports the endpoint's remote-memory lanes (cma/memory between two processes here)
    assert s["ucx"].get("read") or s["ucx"].get("write"), s["ucx"]


@needs_nixl
def test_a_missing_notification_fails_by_the_timeout_and_bad_launches_are_refused(
    res: list[Any],
) -> None:
    """A passive launch whose peer never transfers settles FAILED after the timeout, never
    hangs; a cancelled one FAILED at once; a launch naming an unregistered block is a
    ConfigError on either side."""
    passive = next(r for r in res if "orphan" in r)
    assert passive["orphan"] == "failed"
    assert passive["cancelled"] == "failed"
    assert all("block 99" in r["bad"] for r in res)
