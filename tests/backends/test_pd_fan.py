"""Head slices between ranks of different TP sizes, in one process over fake links: each D rank's
block rows get exactly its heads from the P ranks the plan names (strided views staged on the
sliced side), a rank's fence settles only once every part has, and one failing part fails the
whole launch without settling before the other parts stop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.backends.base import FenceStatus
from kvflow.backends.pd.fake import FakeLink
from kvflow.backends.pd.fan import FanFence, FanTransport
from kvflow.backends.pd.gloo import GlooTransport
from kvflow.backends.pd.transport import KVTransport, gather_rows, geometry, scatter_rows
from kvflow.core.pd.common import LaunchCopies
from kvflow.core.pd.tp import plan_head_slices, rank_slices
from kvflow.engine.distributed import free_port, launch
from kvflow.errors import ConfigError
from kvflow.runtime.clock import SystemClock

pytestmark = pytest.mark.usefixtures("no_leaks")

HEADS, BLOCKS, TOKENS, DIM = 4, 8, 2, 4
PAIRS_P = ((1, 3), (4, 0), (6, 7))  # (P block, D block)


def _kv(tp: int, rank: int, fill: bool) -> list[torch.Tensor]:
    """A rank's K and V of one layer: (blocks, tokens, heads of the rank, dim); P's rows hold
    their global head index in every element, D's start at -1."""
    n = HEADS // tp
    if not fill:
        return [torch.full((BLOCKS, TOKENS, n, DIM), -1.0) for _ in range(2)]
    heads = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)
    kv = []
    for which in range(2):
        t = torch.empty(BLOCKS, TOKENS, n, DIM)
        t[:] = heads.view(1, 1, n, 1) + 100 * torch.arange(BLOCKS).view(BLOCKS, 1, 1, 1) + which
        kv.append(t)
    return kv


def _fans(p_tp: int, d_tp: int) -> tuple[list[FanTransport], list[FanTransport], list[FakeLink]]:
    plan = plan_head_slices(HEADS, p_tp, d_tp)
    links = [FakeLink() for _ in plan]
    ends = [link.pair() for link in links]

    def fan(rank: int, producer: bool) -> FanTransport:
        parts: list[tuple[KVTransport, tuple[int, int] | None]] = []
        for i in rank_slices(plan, rank, producer):
            s = plan[i]
            shard = s.p_shard if producer else s.d_shard
            heads = s.local(producer)
            parts.append((ends[i][0 if producer else 1], None if heads == (0, shard) else heads))
        return FanTransport(parts)

    return [fan(r, True) for r in range(p_tp)], [fan(r, False) for r in range(d_tp)], links


def _launch(fan: FanTransport, send: bool) -> FanFence:
    pairs = PAIRS_P if send else tuple((d, p) for p, d in PAIRS_P)
    return fan.launch(LaunchCopies("t", 1, "peer", send, (pairs,), 1))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2)])
def test_each_d_rank_gets_exactly_its_heads_from_the_p_ranks_holding_them(
    p_tp: int, d_tp: int
) -> None:
    """P tp → D tp over fake links: every named D block holds P's block with D's own heads;
    blocks not named keep their bytes; every fence on both sides ends DONE."""
    p_fans, d_fans, links = _fans(p_tp, d_tp)
    p_kv = [_kv(p_tp, r, True) for r in range(p_tp)]
    d_kv = [_kv(d_tp, r, False) for r in range(d_tp)]
    for f, kv in zip(p_fans, p_kv, strict=True):
        f.register([kv])
    for f, kv in zip(d_fans, d_kv, strict=True):
        f.register([kv])
    fences = [(f, _launch(f, True)) for f in p_fans] + [(f, _launch(f, False)) for f in d_fans]
    for link in links:
        link.step(0.0)
    assert all(f.query(x) is FenceStatus.DONE for f, x in fences)
    n = HEADS // d_tp
    for r, kv in enumerate(d_kv):
        heads = torch.arange(r * n, (r + 1) * n, dtype=torch.float32).view(1, n, 1)
        for which, t in enumerate(kv):
            for p, d in PAIRS_P:
                assert torch.equal(t[d], (heads + 100 * p + which).expand(TOKENS, n, DIM))
            named = {d for _, d in PAIRS_P}
            assert all(bool((t[b] == -1).all()) for b in range(BLOCKS) if b not in named)
    for f in p_fans + d_fans:
        f.close()


def test_a_failing_part_fails_the_rank_s_launch_only_once_every_part_settled() -> None:
    """D tp1 from P tp2: the link of P rank 1 dies while P rank 0's part is still pending;
    D's fence stays PENDING until the other part lands, then FAILED (nothing still writes)."""
    p_fans, (d_fan,), links = _fans(2, 1)
    for r, f in enumerate(p_fans):
        f.register([_kv(2, r, True)])
    d_fan.register([_kv(1, 0, False)])
    d_fence = _launch(d_fan, False)
    links[1].kill()
    assert d_fan.query(d_fence) is FenceStatus.PENDING
    p0 = _launch(p_fans[0], True)
    links[0].step(0.0)
    assert p_fans[0].query(p0) is FenceStatus.DONE
    assert d_fan.query(d_fence) is FenceStatus.FAILED
    for f in [*p_fans, d_fan]:
        f.close()


def test_a_rank_with_no_parts_is_done_at_once_and_bad_slices_are_refused() -> None:
    """A fan with no parts (a P rank nobody reads) ends each launch DONE at once; a head range
    past the tensor's heads or an empty one is a ConfigError."""
    empty = FanTransport([])
    empty.register([_kv(1, 0, True)])
    assert empty.query(_launch(empty, True)) is FenceStatus.DONE
    link = FakeLink()
    p, d = link.pair()
    with pytest.raises(ConfigError, match="empty"):
        FanTransport([(p, (2, 2))])
    with pytest.raises(ConfigError, match="outside"):
        FanTransport([(p, (2, 9))]).register([_kv(1, 0, True)])
    for t in (p, d):
        t.close()


def test_strided_head_slices_gather_and_scatter_like_their_rows() -> None:
    """``gather_rows`` of a head slice (a strided view) packs exactly those heads' rows, and
    ``scatter_rows`` into another slice writes them there and nowhere else."""
    src = torch.randn(BLOCKS, TOKENS, HEADS, DIM)
    dst = torch.zeros(BLOCKS, TOKENS, HEADS, DIM)
    (g_src,) = geometry([[src[:, :, 1:3]]])
    (g_dst,) = geometry([[dst[:, :, 2:4]]])
    assert g_src.strided
    assert g_src.block_bytes == TOKENS * 2 * DIM * 4
    out = torch.empty(3 * g_src.block_bytes, dtype=torch.uint8)
    data = gather_rows(g_src, [5, 0, 2], out)
    scatter_rows(g_dst, [1, 6, 3], data)
    assert torch.equal(dst[[1, 6, 3]][:, :, 2:4], src[[5, 0, 2]][:, :, 1:3])
    assert not dst[:, :, :2].any()
    assert not dst[[0, 2, 4, 5, 7]].any()


def _gloo_pair(direct_min_bytes: int | None) -> tuple[GlooTransport, GlooTransport]:
    """Both ends of a gloo pair in this process (the second end's rendezvous on a thread)."""
    port = free_port()
    box: list[GlooTransport] = []

    def other() -> None:
        box.append(
            GlooTransport(pair_rank=1, host="127.0.0.1", port=port, timeout_s=10,
                          direct_min_bytes=direct_min_bytes)
        )  # fmt: skip

    th = threading.Thread(target=other)
    th.start()
    p = GlooTransport(
        pair_rank=0, host="127.0.0.1", port=port, timeout_s=10, direct_min_bytes=direct_min_bytes
    )
    th.join(10)
    return p, box[0]


def _tp1_to_tp2(rank: int, world_size: int) -> dict[str, Any]:
    """In a spawned process (gloo keeps process-wide pipes): P tp1 → D tp2 over real pairs."""
    del rank, world_size
    plan = plan_head_slices(HEADS, 1, 2)
    pairs = [_gloo_pair(None) for _ in plan]
    out: dict[str, Any] = {}
    try:
        p_fan = FanTransport([(pairs[i][0], s.p_local) for i, s in enumerate(plan)])
        d_fans = [FanTransport([(pairs[i][1], None)]) for i in range(len(plan))]
        src, dst = _kv(1, 0, True), [_kv(2, r, False) for r in range(2)]
        p_fan.register([src])
        for f, kv in zip(d_fans, dst, strict=True):
            f.register([kv])
        woke = threading.Event()
        for f in [p_fan, *d_fans]:
            f.set_wakeup(woke.set)
        fences = [(f, _launch(f, False)) for f in d_fans] + [(p_fan, _launch(p_fan, True))]
        clock = SystemClock()
        deadline = clock.now() + 10
        while any(f.query(x) is FenceStatus.PENDING for f, x in fences) and clock.now() < deadline:
            woke.wait(0.05)
            woke.clear()
        out["status"] = [f.query(x).value for f, x in fences]
        out["src"], out["dst"] = src, dst
    finally:
        for a, b in pairs:
            a.close()
            b.close()
    a, b = _gloo_pair(1 << 20)
    try:
        a.register([[torch.zeros(BLOCKS, TOKENS, HEADS, DIM)[:, :, :2]]])
    except ConfigError as e:
        out["refused"] = str(e)
    finally:
        a.close()
        b.close()
    return out


@pytest.fixture(scope="module")
def gloo_res() -> dict[str, Any]:
    """The real-gloo scenario, run once in a spawned process (before the per-test leak check:
    ``launch`` itself keeps a pipe of torch's)."""
    (res,) = launch(_tp1_to_tp2, world_size=1, timeout_s=60)
    assert isinstance(res, dict)
    return res


def test_gloo_moves_head_slices_from_tp1_to_tp2_and_refuses_unstaged_slices(
    gloo_res: dict[str, Any],
) -> None:
    """Real gloo pairs: P tp1's rank sends half its heads to each D rank's blocks; a head
    slice registered with direct runs allowed is a ConfigError naming the fix."""
    res = gloo_res
    assert res["status"] == ["done", "done", "done"]
    src = res["src"]
    for r, kv in enumerate(res["dst"]):
        for which in range(2):
            for p, d in PAIRS_P:
                assert torch.equal(kv[which][d], src[which][p][:, 2 * r : 2 * r + 2])
    assert "direct_min_bytes=None" in res["refused"]
