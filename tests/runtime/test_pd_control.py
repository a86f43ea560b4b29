"""The PD control plane over loopback zmq: HELLO round trip and cache, incompatible peers, peers
that never answer (deadlines on the FakeClock), messages from peers without HELLO, malformed
frames, and duplicates / stale messages dropped by the manager behind it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
import zmq
from structlog.testing import capture_logs
from tests.core.pd_world import prompt_hashes
from tests.pd_leaks import no_leaks  # noqa: F401 - the fixture, used by pytestmark

from kvflow.core.pd.common import Send
from kvflow.core.pd.messages import Claim, Grant, hashes_digest
from kvflow.core.pd.producer import ProducerManager
from kvflow.engine.distributed import free_port
from kvflow.errors import ClosedError, ConfigError, PeerError, ProtocolError
from kvflow.runtime.clock import FakeClock, SystemClock, wait_all_tasks_blocked
from kvflow.runtime.pd_control import (
    ControlPlane,
    PeerInfo,
    decode,
    default_compat,
    encode,
    open_control_plane,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("no_leaks")]

HASHES = prompt_hashes(1, 2)
CLAIM = Claim("t", 1, ((0, 1),), (0,), 8, hashes_digest(HASHES))
GUARD_S = 20.0  # real-time safety net: a broken test fails instead of hanging CI


@contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    """A bare zmq DEALER (routing id ``X``, a peer that never said HELLO) connected to ``address``."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.ROUTING_ID, b"X")
        raw.connect(address)
        yield raw
    finally:
        raw.close(linger=0)
        ctx.term()


async def test_hello_round_trip_then_messages_both_ways() -> None:
    """D's HELLO makes both sides know each other (tp size, endpoints); then a CLAIM and a
    GRANT cross, each arriving with its sender's engine id."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock, endpoints=("gloo://p0",)) as p,
            open_control_plane("D", default_compat(), clock, tp_size=1) as d,
        ):
            info = await d.hello(p.address)
            assert (info.engine_id, info.endpoints, info.tp_size) == ("P", ("gloo://p0",), 1)
            assert p.peer("D") is not None
            await d.send("P", CLAIM)
            assert await p.recv(1.0, "a claim") == ("D", CLAIM)
            grant = Grant("t", 1, ((5, 6),), HASHES, 2.0)
            await p.send("D", grant)
            assert await d.recv(1.0, "a grant") == ("P", grant)


async def test_hello_is_cached_until_its_ttl() -> None:
    """A second hello() within the TTL sends nothing; after it a new exchange happens."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(), clock, hello_ttl_s=10.0) as d,
        ):
            with capture_logs() as logs:
                first = await d.hello(p.address)
                assert await d.hello(p.address) is first
                clock.jump(11.0)
                assert await d.hello(p.address) is not first
            on_d = [e for e in logs if e["event"] == "pd_peer_hello" and e["engine_id"] == "D"]
            assert len(on_d) == 2


async def test_an_incompatible_peer_is_a_typed_error_naming_the_fields() -> None:
    """Different dtype and block size (no common wire unit): PeerError names both; neither side
    caches the other."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(dtype="bfloat16", block_size=32), clock) as d,
        ):
            with capture_logs() as logs, pytest.raises(PeerError, match="dtype, wire_block_size"):
                await d.hello(p.address)
            assert "pd_peer_incompatible" in [e["event"] for e in logs]
            assert p.peer("D") is None
            assert d.peer("P") is None
            with pytest.raises(PeerError, match="no HELLO"):
                await d.send("P", CLAIM)


async def test_a_silent_peer_times_out_on_the_clock_naming_what_was_awaited() -> None:
    """hello() to an address nobody serves and recv() with nothing coming end at their
    deadlines on the injected clock with PeerError saying what was waited for."""
    clock = FakeClock()
    errors: list[str] = []
    with anyio.fail_after(GUARD_S):
        async with open_control_plane("D", default_compat(), clock, hello_timeout_s=5.0) as d:

            async def call(fn: object) -> None:
                try:
                    await fn()  # type: ignore[operator]
                except PeerError as e:
                    errors.append(str(e))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, lambda: d.hello(f"tcp://127.0.0.1:{free_port()}"))
                tg.start_soon(call, lambda: d.recv(3.0, "P's grant of t"))
                await wait_all_tasks_blocked()
                assert errors == []
                clock.jump(3.0)
                await wait_all_tasks_blocked()
                assert len(errors) == 1
                assert "P's grant of t" in errors[0]
                clock.jump(2.0)
            assert "did not answer HELLO within 5.0 s" in errors[1]


async def test_messages_without_hello_and_malformed_frames_are_dropped() -> None:
    """A peer that never said HELLO, and bytes that are no message, are logged and dropped."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with open_control_plane("P", default_compat(), clock) as p:
            with raw_dealer(p.address) as raw:
                with capture_logs() as logs:
                    raw.send(encode(CLAIM))
                    raw.send(b"\x93garbage")
                    while p.dropped < 2:
                        await anyio.sleep(0)  # yields to the receive loop; no time passes
                whys = [e["why"] for e in logs if e["event"] == "pd_control_dropped"]
                assert whys == ["no_hello", "malformed"]
                assert p.recv_nowait() is None


async def test_what_a_closing_plane_posted_still_reaches_its_peer() -> None:
    """A turn posted just before its plane closes still arrives whole, and is delivered although
    the peer has seen the connection drop by then (the engine's last DONE must release P's hold)."""
    clock = SystemClock()
    big = Grant("t", 1, (tuple(range(100_000)),), HASHES, 2.0)  # a turn that takes a while to go
    with anyio.fail_after(GUARD_S):
        async with open_control_plane("P", default_compat(), clock) as p:
            async with open_control_plane("D", default_compat(), clock) as d:
                await d.hello(p.address)
                d.post("P", *([big] * 32))
            got = [await p.recv(GUARD_S, f"message {i}") for i in range(32)]
            assert got == [("D", big)] * 32
            assert p.dropped == 0


async def test_a_peer_whose_cached_hello_expired_is_still_heard_and_answered() -> None:
    """Once P's cache of D's HELLO expires, D's next CLAIM (sent on D's own, later-expiring cache)
    is delivered, not dropped as from a stranger, and P's GRANT reaches D."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock, hello_ttl_s=10.0) as p,
            open_control_plane("D", default_compat(), clock, hello_ttl_s=60.0) as d,
        ):
            await d.hello(p.address)
            clock.jump(11.0)
            assert p.peer("D") is None
            assert d.peer("P") is not None
            d.post("P", CLAIM)
            assert await p.recv(1.0, "a claim") == ("D", CLAIM)
            grant = Grant("t", 1, ((5, 6),), HASHES, 2.0)
            p.post("D", grant)
            assert await d.recv(1.0, "the grant") == ("P", grant)
            assert p.dropped == 0


async def test_closing_with_a_message_to_nobody_waits_only_the_linger() -> None:
    """A HELLO queued to an address nobody listens at holds close for the linger, no longer."""
    clock, real = FakeClock(), SystemClock()  # the plane's deadlines, and close's real wait
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with anyio.fail_after(GUARD_S):
        async with open_control_plane("D", default_compat(), clock, close_linger_s=0.3) as d:
            async with anyio.create_task_group() as tg:
                tg.start_soon(d.hello, nobody)
                await wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
            t0 = real.now()
        assert 0.25 <= real.now() - t0 < 0.3 + 5.0


async def test_close_linger_is_validated() -> None:
    """A negative or non-finite close linger is a ConfigError naming it."""
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="close_linger_s"):
            ControlPlane(
                "P",
                default_compat(),
                FakeClock(),
                bind="tcp://127.0.0.1:0",
                tp_size=1,
                endpoints=(),
                hello_timeout_s=1.0,
                hello_ttl_s=1.0,
                inbox_size=8,
                close_linger_s=bad,
            )


async def test_duplicate_and_stale_messages_are_dropped_by_the_manager() -> None:
    """The control plane delivers what arrives; P's manager grants the first CLAIM and drops
    its duplicate and a CLAIM of another epoch, logging why."""
    clock = FakeClock()
    mgr = ProducerManager("P")
    mgr.kv_ready("t", 1, "D", ((10, 11),), HASHES, clock.now())
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(), clock) as d,
        ):
            await d.hello(p.address)
            for claim in (CLAIM, CLAIM, Claim("t", 0, ((0, 1),), (0,), 8, CLAIM.digest)):
                await d.send("P", claim)
            answers = []
            with capture_logs() as logs:
                for _ in range(3):
                    peer, msg = await p.recv(1.0, "claims")
                    for action in mgr.on_message(peer, msg, clock.now()):
                        if isinstance(action, Send):
                            await p.send(action.peer, action.message)
                            answers.append(action.message)
            assert [type(m) for m in answers] == [Grant]
            whys = [e["why"] for e in logs if e["event"] == "pd_message_dropped"]
            assert whys == ["duplicate_claim_in_in_flight", "stale_epoch"]
            assert isinstance((await d.recv(1.0, "the grant"))[1], Grant)


async def test_closed_plane_refuses_and_wire_errors_are_typed() -> None:
    """After close every call raises ClosedError; decode() of junk raises ProtocolError."""
    clock = FakeClock()
    async with open_control_plane("P", default_compat(), clock) as p:
        pass
    with pytest.raises(ClosedError):
        await p.send("D", CLAIM)
    with pytest.raises(ProtocolError):
        decode(b"\x92\xa4Nope\xc0")
    with pytest.raises(ProtocolError):
        decode(b"not msgpack")


async def test_the_system_clock_deadline_needs_no_watchdog() -> None:
    """With the real clock the deadline is the loop's own timer: a zero timeout with nothing
    waiting raises PeerError at once, and a waiting message is returned without any wait."""
    clock = SystemClock()
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(), clock) as d,
        ):
            with pytest.raises(PeerError, match="while waiting for nothing"):
                await p.recv(0.0, "nothing")
            await d.hello(p.address)
            await d.send("P", CLAIM)
            assert await p.recv(GUARD_S, "a claim") == ("D", CLAIM)


async def test_what_one_turn_says_to_a_peer_travels_as_one_zmq_message() -> None:
    """Messages posted together arrive in order, as one multipart zmq message (one wake-up of
    each side's zmq I/O thread); each part of a zmq message is judged on its own."""
    clock = FakeClock()
    second = Claim("u", 1, ((2, 3),), (0,), 8, CLAIM.digest)
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(), clock) as d,
        ):
            await d.hello(p.address)
            before = p.wire_in
            d.post("P", CLAIM, second)
            assert await p.recv(1.0, "the first") == ("D", CLAIM)
            assert await p.recv(1.0, "the second") == ("D", second)
            assert p.wire_in == before + 1
            with raw_dealer(p.address) as raw:
                with capture_logs() as logs:
                    raw.send_multipart([encode(second), b"\x93garbage", encode(CLAIM)])
                    while p.dropped < 3:
                        await anyio.sleep(0)  # yields to the receive loop; no time passes
                whys = [e["why"] for e in logs if e["event"] == "pd_control_dropped"]
                assert whys == ["no_hello", "malformed", "no_hello"]


async def test_another_thread_posts_and_reads_without_the_loop() -> None:
    """An engine's thread posts to a peer and reads the inbox directly (no hop to the loop's
    thread): its CLAIM reaches P, and P's answer is read by that thread in order."""
    clock = FakeClock()
    got: list[object] = []
    with anyio.fail_after(GUARD_S):
        async with (
            open_control_plane("P", default_compat(), clock) as p,
            open_control_plane("D", default_compat(), clock) as d,
        ):
            await d.hello(p.address)
            await anyio.to_thread.run_sync(d.post, "P", CLAIM)
            assert await p.recv(1.0, "the claim") == ("D", CLAIM)
            p.post("D", CLAIM, CLAIM)
            while len(d._inbox) < 2:
                await anyio.sleep(0)  # yields to the receive loop; no time passes
            got.append(await anyio.to_thread.run_sync(d.recv_nowait))
            got.append(await anyio.to_thread.run_sync(d.recv_nowait))
            got.append(await anyio.to_thread.run_sync(d.recv_nowait))
    assert got == [("P", CLAIM), ("P", CLAIM), None]


async def test_a_peer_that_stopped_reading_loses_messages_and_nobody_waits() -> None:
    """With the peer's zmq queue full (its high-water mark), ``post`` returns at once and the
    message is logged and dropped: no sender ever waits on a peer."""
    clock = FakeClock()
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # accepts the connection, never reads
    try:
        sink.setsockopt(zmq.LINGER, 0)
        sink.setsockopt(zmq.RCVHWM, 1)
        port = sink.bind_to_random_port("tcp://127.0.0.1")
        with anyio.fail_after(GUARD_S):
            async with open_control_plane("D", default_compat(), clock) as d:
                d._peers["P"] = PeerInfo("P", f"tcp://127.0.0.1:{port}", "", 1, (), 1e9)
                d._dealer(f"tcp://127.0.0.1:{port}").setsockopt(zmq.SNDHWM, 1)
                with capture_logs() as logs:
                    while d.dropped == 0:
                        d.post("P", CLAIM)
                        await anyio.sleep(0)
                whys = {e["why"] for e in logs if e["event"] == "pd_control_dropped"}
                assert whys == {"peer_queue_full"}
    finally:
        sink.close(linger=0)
        ctx.term()


async def test_a_peer_that_drops_is_lost_and_one_back_as_a_new_process_is_a_restart() -> None:
    """D's connection dropping makes P forget D's HELLO (a lost peer); D back as a new process
    (a new incarnation at another address) is a restart; the drop of an address that D left
    for another one forgets nothing."""
    clock = FakeClock()
    with anyio.fail_after(GUARD_S):
        async with open_control_plane("P", default_compat(), clock) as p:
            async with open_control_plane("D", default_compat(), clock) as d1:
                await d1.hello(p.address)
                assert p.peer("D") is not None
            with capture_logs() as logs:
                while p.disconnects < 1:
                    await anyio.sleep(0)  # yields to the loop's readers; no time passes
            assert p.take_peer_events() == (["D"], [])
            assert p.peer("D") is None
            assert [e["event"] for e in logs] == ["pd_peer_disconnected"]
            async with open_control_plane("D", default_compat(), clock) as d3:
                async with open_control_plane("D", default_compat(), clock) as d2:
                    await d2.hello(p.address)
                    assert p.take_peer_events() == ([], ["D"])
                    await d3.hello(p.address)  # another new D, at a third address
                    assert p.take_peer_events() == ([], ["D"])
                while p.disconnects < 2:  # d2 closed: its old address dropped
                    await anyio.sleep(0)
                info = p.peer("D")
                assert info is not None
                assert info.address == d3.address
                assert p.take_peer_events() == ([], [])
