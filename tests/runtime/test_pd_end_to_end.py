"""The PD pieces together, in one process: both managers over real zmq control planes, real
bytes through the fake transport, each side's actions carried out by a small loop in the test
(the runtime driver that will own this loop is the next step). A hand-off commits P's exact
bytes; a lost packet ends in a drained, recomputed hand-off with nothing leaked."""

from __future__ import annotations

import anyio
import pytest
import torch
from tests.core.pd_world import prompt_hashes
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.backends.base import Fence, FenceStatus
from kvflow.backends.pd.fake import FakeLink, FakeTransport
from kvflow.core.pd.common import (
    Action,
    CancelCopies,
    FinishedRecving,
    FinishedSending,
    LaunchCopies,
    PDTimeouts,
    Send,
)
from kvflow.core.pd.consumer import ConsumerManager
from kvflow.core.pd.producer import ProducerManager
from kvflow.runtime.clock import FakeClock
from kvflow.runtime.pd_control import ControlPlane, default_compat, open_control_plane

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_leaks")]

HASHES = prompt_hashes(3, 4)
P_IDS = ((5, 1, 7, 2),)
D_IDS = ((0, 6, 3),)  # D's own cache covers the first block: it claims blocks 1.. of P's
TIMEOUTS = PDTimeouts(claim_s=5, grant_window_s=5, copy_s=5, drain_retry_s=1, peer_timeout_s=60)


class Side:
    """One engine's PD side: a manager, its control plane, its transport end, what it reported."""

    def __init__(
        self, mgr: ProducerManager | ConsumerManager, cp: ControlPlane, end: FakeTransport
    ) -> None:
        self.mgr, self.cp, self.end = mgr, cp, end
        self.fences: list[tuple[LaunchCopies, Fence]] = []
        self.reports: list[Action] = []

    async def do(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Send):
                await self.cp.send(a.peer, a.message)
            elif isinstance(a, LaunchCopies):
                self.fences.append((a, self.end.launch(a)))
            elif isinstance(a, CancelCopies):
                for op, fence in self.fences:
                    if (op.transfer_id, op.epoch) == (a.transfer_id, a.epoch):
                        self.end.cancel(fence)
            else:
                self.reports.append(a)

    async def pump(self, now: float) -> None:
        """Deliver what arrived, report settled copies, fire timers."""
        while (got := self.cp.recv_nowait()) is not None:
            await self.do(self.mgr.on_message(got[0], got[1], now))
        for op, fence in list(self.fences):
            status = self.end.query(fence)
            if status is not FenceStatus.PENDING:
                self.fences.remove((op, fence))
                ok = status is FenceStatus.DONE
                await self.do(self.mgr.copy_done(op.transfer_id, op.epoch, 0, ok, now))
        await self.do(self.mgr.tick(now))


def finished(p: Side, d: Side) -> bool:
    """P gave its blocks back and D reported."""
    return any(isinstance(r, FinishedSending) for r in p.reports) and any(
        isinstance(r, FinishedRecving) for r in d.reports
    )


async def run(
    link: FakeLink, clock: FakeClock, jump_s: float = 0.0
) -> tuple[Side, Side, torch.Tensor, torch.Tensor]:
    """One hand-off of P's blocks 1..3 into D's reserved blocks, stepped until both reported."""
    p_end, d_end = link.pair()
    src = torch.randint(
        0, 255, (8, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    dst = torch.zeros(8, 256, dtype=torch.uint8)
    p_end.register([[src]])
    d_end.register([[dst]])
    async with (
        open_control_plane("P", default_compat(), clock) as p_cp,
        open_control_plane("D", default_compat(), clock) as d_cp,
    ):
        producer = ProducerManager("P", timeouts=TIMEOUTS)
        consumer = ConsumerManager("D", timeouts=TIMEOUTS)
        p, d = Side(producer, p_cp, p_end), Side(consumer, d_cp, d_end)
        await d_cp.hello(p_cp.address)
        await p.do(producer.kv_ready("t", 1, "D", P_IDS, HASHES, clock.now()))
        await d.do(consumer.reserve("t", 1, "P", D_IDS, (1,), 16, HASHES, clock.now()))
        with anyio.fail_after(20):  # real-time safety net
            while not finished(p, d):
                await anyio.sleep(0)  # the control planes' receive loops run
                link.step(clock.now())
                await p.pump(clock.now())
                await d.pump(clock.now())
                if jump_s:
                    clock.jump(jump_s)
        assert p.mgr.num_live == 0
        assert d.mgr.num_live == 0
        assert p.mgr.ledger.num_blocks == 0
        assert d.mgr.ledger.num_blocks == 0
    return p, d, src, dst


async def test_a_hand_off_commits_p_s_exact_bytes() -> None:
    """CLAIM → GRANT → copies through the fake link → DONE both ways: D commits, its claimed
    blocks hold P's bytes of blocks 1..3, its other blocks are untouched; P frees once."""
    clock = FakeClock()
    p, d, src, dst = await run(FakeLink(), clock)
    assert d.reports == [FinishedRecving("t", True, ())]
    assert p.reports == [FinishedSending("t", P_IDS)]
    for p_block, d_block in zip(P_IDS[0][1:], D_IDS[0], strict=True):
        assert torch.equal(dst[d_block], src[p_block])
    assert not dst[[1, 2, 4, 5, 7]].any()


async def test_a_lost_packet_drains_and_recomputes_without_leaks() -> None:
    """The link drops P's data: D's receive fails at its deadline, D drains until P confirms,
    then reports its blocks invalid (recompute); P's blocks come back too."""
    clock = FakeClock()
    link = FakeLink(recv_timeout_s=2.0)
    link.drop(1)
    p, d, _, _ = await run(link, clock, jump_s=0.25)
    assert d.reports == [FinishedRecving("t", False, D_IDS)]
    assert p.reports == [FinishedSending("t", P_IDS)]
