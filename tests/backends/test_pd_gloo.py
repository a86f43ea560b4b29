"""The gloo PD transport between two spawned processes (CPU): byte-exact blocks at scattered ids
through a staging ring smaller than the hand-off, slot reuse, and a receive nobody sends that
fails by the pair's timeout and leaves the transport broken (later launches fail at once) until
both sides rebuild the pair on a new address.
Deselect with ``-m "not distributed"``."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.gloo import GlooFence, GlooTransport
from kvflow.core.pd.common import LaunchCopies
from kvflow.engine.distributed import free_port, launch
from kvflow.runtime.clock import SystemClock

pytestmark = pytest.mark.distributed

# Scattered pairs, runs consecutive on both sides (20-22 → 50-52, 30-31 → 10-11: sent straight
# between the tensors), and pairs consecutive on one side only (40-41 → 20, 25; 12 → 44-45).
PAIRS_0 = (
    *((3, 40), (17, 2), (5, 5), (60, 33), (8, 9), (9, 8)),
    *((20, 50), (21, 51), (22, 52), (30, 10), (31, 11)),
    *((40, 20), (41, 25), (11, 44), (13, 45)),
)
PAIRS_1 = ((1, 30), (31, 0), (12, 13), (4, 20), (5, 21), (6, 22), (7, 23), (8, 24))
PAIRS_2 = ((1, 6), (7, 0))
PAIRS_3 = ((2, 9), (9, 3), (15, 0), (4, 4))
PAIRS = (PAIRS_0, PAIRS_1, PAIRS_2, PAIRS_3)
SLOT_BYTES = 1024
GROWN_SLOT_BYTES = 2 * 768  # group 3's blocks: staged (rows under direct_min_bytes), > a slot


def kv(rank: int) -> list[list[torch.Tensor]]:
    """Group 0: one (64, 2, 128) fp16 tensor (512 B blocks); group 1: K and V of (32, 256) u8;
    group 2: K and V of (8, 32768) int16 (128 KiB blocks, larger than a slot: each block sent
    straight from its rows); group 3: K and V of (16, 768) u8 (1.5 KiB blocks of short rows:
    staged, so the slots grow to hold one)."""
    if rank == 0:
        g = torch.Generator().manual_seed(7)
        k0 = torch.randn(64, 2, 128, generator=g).half()
        k1 = torch.randint(0, 255, (32, 256), generator=g, dtype=torch.uint8)
        v1 = torch.randint(0, 255, (32, 256), generator=g, dtype=torch.uint8)
        k2 = torch.randint(-999, 999, (8, 32768), generator=g, dtype=torch.int16)
        v2 = torch.randint(-999, 999, (8, 32768), generator=g, dtype=torch.int16)
        k3 = torch.randint(0, 255, (16, 768), generator=g, dtype=torch.uint8)
        v3 = torch.randint(0, 255, (16, 768), generator=g, dtype=torch.uint8)
    else:
        k0 = torch.zeros(64, 2, 128).half()
        k1 = torch.zeros(32, 256, dtype=torch.uint8)
        v1 = torch.zeros(32, 256, dtype=torch.uint8)
        k2 = torch.zeros(8, 32768, dtype=torch.int16)
        v2 = torch.zeros(8, 32768, dtype=torch.int16)
        k3 = torch.zeros(16, 768, dtype=torch.uint8)
        v3 = torch.zeros(16, 768, dtype=torch.uint8)
    return [[k0], [k1, v1], [k2, v2], [k3, v3]]


def _wait(t: GlooTransport, fence: GlooFence, limit_s: float) -> str:
    """Wait for the fence through the transport's wakeup, with a deadline."""
    woke = threading.Event()
    t.set_wakeup(woke.set)
    clock = SystemClock()
    deadline = clock.now() + limit_s
    while t.query(fence) is FenceStatus.PENDING:
        if clock.now() > deadline:
            return "pending"
        woke.wait(0.05)
        woke.clear()
    return t.query(fence).value


def _pair(rank: int, world_size: int, port: int, port2: int, mode: str) -> Any:
    del world_size
    t = GlooTransport(
        pair_rank=rank,
        host="127.0.0.1",
        port=port,
        timeout_s=3.0,
        slots=2,
        slot_bytes=SLOT_BYTES,
        direct_min_bytes=1024,
    )
    try:
        tensors = kv(rank)
        t.register(tensors)
        grown = t.slot_bytes
        send = rank == 0
        pairs = PAIRS if send else tuple(tuple((d, s) for s, d in g) for g in PAIRS)
        first = _wait(t, t.launch(LaunchCopies("h1", 1, "peer", send, pairs, 1)), 30.0)
        again = _wait(t, t.launch(LaunchCopies("h2", 1, "peer", send, pairs, 2)), 30.0)
        out: dict[str, Any] = {"first": first, "again": again, "slot_bytes": grown}
        if rank == 1:
            out["tensors"] = tensors
        if mode == "orphan" and rank == 1:
            out["orphan"] = _wait(
                t, t.launch(LaunchCopies("never", 1, "peer", False, (((0, 1),),), 3)), 30.0
            )
            out["after"] = t.query(
                t.launch(LaunchCopies("later", 1, "peer", False, (((0, 1),),), 4))
            ).value
            out["broken"] = t.broken is not None
        if mode == "orphan":
            # Both sides rebuild the pair on a new address (P's side only now learns of it).
            t.rebuild(host="127.0.0.1", port=port2, wait_s=30.0)
            if rank == 1:
                for tensor in tensors[0]:
                    tensor.zero_()
            rebuilt = _wait(t, t.launch(LaunchCopies("h3", 1, "peer", send, pairs, 5)), 30.0)
            out["rebuilt"] = rebuilt
            out["broken_after_rebuild"] = t.broken is not None
        return out
    finally:
        t.close()


@pytest.fixture(scope="module")
def res() -> list[Any]:
    """One spawned pair runs every scenario (spawning is the slow part on a small machine)."""
    return launch(_pair, (free_port(), free_port(), "orphan"), world_size=2, timeout_s=90)


def test_gloo_pair_moves_scattered_blocks_byte_exact(res: list[Any]) -> None:
    """D's named blocks hold exactly P's source blocks (groups of one and two regions, more
    chunks than slots, twice through the same ring, large blocks sent without staging, blocks
    larger than the configured slot staged in grown slots); every other block is untouched."""
    assert [r["slot_bytes"] for r in res] == [GROWN_SLOT_BYTES, GROWN_SLOT_BYTES]
    assert [r["first"] for r in res] == ["done", "done"]
    assert [r["again"] for r in res] == ["done", "done"]
    src, dst = kv(0), res[1]["tensors"]
    for g, pairs in enumerate(PAIRS):
        for s_t, d_t in zip(src[g], dst[g], strict=True):
            named = {d for _, d in pairs}
            for s, d in pairs:
                assert torch.equal(d_t[d], s_t[s]), (g, s, d)
            for b in range(d_t.shape[0]):
                if b not in named:
                    assert not d_t[b].any(), (g, b)


def test_a_receive_nobody_sends_fails_by_the_timeout_and_breaks_the_pair(res: list[Any]) -> None:
    """A receive with no matching send settles FAILED after the pair's timeout (never hangs);
    the transport is then broken and fails later launches at once."""
    assert res[1]["orphan"] == "failed"
    assert res[1]["after"] == "failed"
    assert res[1]["broken"]


def test_a_broken_pair_is_rebuilt_on_a_new_address_and_moves_blocks_again(
    res: list[Any],
) -> None:
    """After the pair broke, both sides ``rebuild`` on a new store address: the next hand-off
    is done on both sides and group 0's blocks (zeroed on D first) are P's again."""
    assert [r["rebuilt"] for r in res] == ["done", "done"]
    assert not any(r["broken_after_rebuild"] for r in res)
    src, dst = kv(0), res[1]["tensors"]
    for s, d in PAIRS[0]:
        assert torch.equal(dst[0][0][d], src[0][0][s]), (s, d)
