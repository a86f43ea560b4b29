"""The fake PD transport: real bytes between two ends, rendezvous, and each fault mode (drop,
delay, duplicate, reorder, peer death), plus cancel; a reactor awaits its fences like a backend's."""

from __future__ import annotations

from typing import cast

import anyio
import pytest
import torch
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.backends.base import Backend, FenceStatus
from kvflow.backends.pd.fake import FakeLink, FakeTransport
from kvflow.backends.pd.transport import KVTransport, plan_chunks
from kvflow.core.pd.common import LaunchCopies, Pairs
from kvflow.errors import ConfigError, LayoutError, ProtocolError
from kvflow.runtime.clock import FakeClock
from kvflow.runtime.reactor import Reactor

pytestmark = pytest.mark.usefixtures("no_leaks")

PAIRS = (((3, 0), (7, 5), (1, 2)), ((0, 4),))


def ends(link: FakeLink) -> tuple[FakeTransport, FakeTransport, list[list[torch.Tensor]]]:
    p, d = link.pair()
    src = [
        [torch.arange(8 * 64, dtype=torch.uint8).view(8, 64)],
        [torch.full((6, 32), 9, dtype=torch.uint8)],
    ]
    p.register(src)
    d.register([[torch.zeros(8, 64, dtype=torch.uint8)], [torch.zeros(6, 32, dtype=torch.uint8)]])
    return p, d, src


CHANNEL = {"t": 1, "u": 2, "v": 3}


def op(transfer_id: str, send: bool, pairs: Pairs) -> LaunchCopies:
    """The manager's launch action for one side of hand-off ``transfer_id``."""
    return LaunchCopies(transfer_id, 1, "peer", send, pairs, CHANNEL[transfer_id])


def recv_pairs() -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple((r, s) for s, r in g) for g in PAIRS)


def landed(d: FakeTransport, src: list[list[torch.Tensor]]) -> bool:
    return all(
        torch.equal(d.geo[g].views[0][r].view(torch.uint8), src[g][0][s])
        for g, grp in enumerate(PAIRS)
        for s, r in grp
    )


def test_both_ends_finish_together_and_bytes_are_exact() -> None:
    """A send waits for the matching receive (rendezvous); then both fences are done and D's
    named blocks hold P's bytes."""
    link = FakeLink()
    p, d, src = ends(link)
    assert isinstance(p, KVTransport)
    fs = p.launch(op("t", True, PAIRS))
    assert link.step(0.0) == 0
    assert p.query(fs) is FenceStatus.PENDING
    fr = d.launch(op("t", False, recv_pairs()))
    assert link.step(0.0) == 2
    assert (p.query(fs), d.query(fr)) == (FenceStatus.DONE, FenceStatus.DONE)
    assert landed(d, src)


def test_delay_holds_delivery_until_its_time() -> None:
    """A delayed packet is delivered only once the link's time reaches it."""
    link = FakeLink(delay_s=2.0)
    p, d, src = ends(link)
    fr = d.launch(op("t", False, recv_pairs()))
    p.launch(op("t", True, PAIRS))
    link.step(1.9)
    assert d.query(fr) is FenceStatus.PENDING
    link.step(2.0)
    assert d.query(fr) is FenceStatus.DONE
    assert landed(d, src)


def test_a_dropped_packet_fails_the_receive_at_its_deadline() -> None:
    """The sender believes it sent; the receiver's fence fails at its deadline, never hangs."""
    link = FakeLink(recv_timeout_s=3.0)
    p, d, _ = ends(link)
    link.drop(1)
    fs = p.launch(op("t", True, PAIRS))
    fr = d.launch(op("t", False, recv_pairs()))
    link.step(0.0)
    assert p.query(fs) is FenceStatus.DONE
    assert d.query(fr) is FenceStatus.PENDING
    link.step(3.0)
    assert d.query(fr) is FenceStatus.FAILED


def test_a_duplicate_is_dropped_and_never_written() -> None:
    """A second copy of a delivered chunk is counted and dropped; the blocks are not written
    again (they may belong to someone else by then)."""
    link = FakeLink()
    p, d, _src = ends(link)
    link.duplicate(1)
    d.launch(op("t", False, recv_pairs()))
    p.launch(op("t", True, PAIRS))
    link.step(0.0)
    d.geo[0].views[0].fill_(0)  # the blocks are reused after the hand-off
    link.step(0.1)
    assert link.stale_dropped == 1
    assert not d.geo[0].views[0].any()


def test_reordered_chunks_land_in_the_right_blocks() -> None:
    """Chunks arriving last-first still land where their tags say."""
    link = FakeLink(reorder=True)
    p, d, src = ends(link)
    p.launch(op("t", True, PAIRS))
    fr = d.launch(op("t", False, recv_pairs()))
    link.step(0.0)
    assert d.query(fr) is FenceStatus.DONE
    assert landed(d, src)


def test_peer_death_fails_everything_pending_and_later_launches() -> None:
    """kill(): pending fences on both ends fail at once, and so does any later launch."""
    link = FakeLink()
    p, d, _ = ends(link)
    fs = p.launch(op("t", True, PAIRS))
    fr = d.launch(op("u", False, recv_pairs()))
    link.kill()
    assert (p.query(fs), d.query(fr)) == (FenceStatus.FAILED, FenceStatus.FAILED)
    assert d.query(d.launch(op("v", False, recv_pairs()))) is FenceStatus.FAILED


def test_cancel_settles_and_a_late_packet_is_not_written() -> None:
    """A cancelled receive fails at once; P's packet arriving later writes nothing."""
    link = FakeLink()
    p, d, _ = ends(link)
    fr = d.launch(op("t", False, recv_pairs()))
    d.cancel(fr)
    assert d.query(fr) is FenceStatus.FAILED
    p.launch(op("t", True, PAIRS))
    link.step(0.0)
    assert not d.geo[0].views[0].any()
    assert link.stale_dropped == 2


def test_registration_and_launch_errors_are_typed() -> None:
    """Bad tensors, a second registration, unregistered blocks and oversized blocks are typed
    errors."""
    link = FakeLink()
    p, _d = link.pair()
    with pytest.raises(ProtocolError):
        p.launch(op("t", True, PAIRS))
    with pytest.raises(LayoutError):
        p.register([[torch.zeros(4, 8).t()]])
    p.register([[torch.zeros(4, 8, dtype=torch.uint8)]])
    with pytest.raises(ProtocolError):
        p.register([[torch.zeros(4, 8, dtype=torch.uint8)]])
    with pytest.raises(ConfigError):
        p.launch(op("t", True, (((9, 0),),)))
    with pytest.raises(ConfigError):
        plan_chunks(1, (((0, 0),),), p.geo, 4)
    with pytest.raises(ConfigError):
        plan_chunks(0, PAIRS, p.geo, 1 << 20)


def test_chunks_are_the_same_on_both_sides() -> None:
    """Sender and receiver derive the same chunk tags and sizes from the same pairs."""
    link = FakeLink()
    p, d, _ = ends(link)
    a = plan_chunks(3, PAIRS, p.geo, 128)
    b = plan_chunks(3, recv_pairs(), d.geo, 128)
    assert [(c.index, c.group, len(c.local), c.tag) for c in a] == [
        (c.index, c.group, len(c.local), c.tag) for c in b
    ]
    assert len({c.tag for c in a}) == len(a) == 3


@pytest.mark.asyncio
async def test_the_reactor_awaits_a_transport_fence() -> None:
    """The existing Reactor polls a transport's fence like a backend's and wakes its waiter."""
    link = FakeLink()
    p, d, _ = ends(link)
    clock = FakeClock()
    reactor = Reactor(cast(Backend, d), clock)
    fr = d.launch(op("t", False, recv_pairs()))
    p.launch(op("t", True, PAIRS))
    async with anyio.create_task_group() as tg:
        tg.start_soon(reactor.run)
        with anyio.fail_after(5):
            waiter = reactor.wait(fr)
            link.step(0.0)
            assert await waiter is FenceStatus.DONE
        reactor.close()
        tg.cancel_scope.cancel()
