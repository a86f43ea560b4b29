"""The PD control plane: one zmq endpoint per engine, msgspec on the wire, deadlines on the clock.

Each engine binds one ROUTER socket (its endpoint) and opens one DEALER per peer, whose routing
id is its engine id: everything A says to B goes from A's DEALER to B's ROUTER, which learns the
sender from the routing id. ``hello(address)`` exchanges HELLO / HELLO_ACK once per peer and
caches the answer for ``hello_ttl_s``; a peer whose compatibility hash differs is a
``PeerError`` naming the fields that differ, a peer that does not answer in ``hello_timeout_s`` a
``PeerError`` naming what was waited for. Messages about hand-offs go to a bounded inbox that
``recv`` reads with a deadline; messages from a peer that never said HELLO, malformed frames and a
full inbox are logged and dropped (the managers drop stale ``(transfer_id, epoch)`` themselves).
Closing a plane still sends what it posted, for up to ``close_linger_s``.

The wire format is msgpack through msgspec: ``[kind, body]`` with ``body`` the attrs message
encoded by msgspec, so ``kvflow.core`` stays free of msgspec. A zmq message carries one or more
of them (one frame each): ``post(peer, *msgs)`` sends what one turn says to a peer as one
multipart message at once, from any thread (each zmq message wakes both sides' zmq I/O threads,
the control path's main cost on a busy machine). The sockets are plain zmq sockets: the receive
loop waits on the ROUTER's descriptor with the event loop and then drains what is queued without
the loop, and a sender (the event loop's task or the engine's thread) writes under one lock, so
neither side needs a thread hop or a future per message. The inbox is a deque that the engine's
thread may read (``recv_nowait``) while the loop fills it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
import zmq
from attrs import define, frozen
from zmq.utils.monitor import parse_monitor_message

from kvflow import __version__
from kvflow.core import validate
from kvflow.core.logs import get_logger
from kvflow.core.pd.messages import (
    MESSAGE_TYPES,
    PEER_TRANSFER,
    Compat,
    Hello,
    HelloAck,
    Message,
)
from kvflow.errors import ClosedError, ConfigError, PeerError, ProtocolError
from kvflow.runtime.clock import Clock, SystemClock

log = get_logger("kvflow.pd.control")
T = TypeVar("T")
# How long close waits for what was posted to leave: a loopback turn leaves in well under a
# millisecond; the bound is for a peer that is gone.
CLOSE_LINGER_S = 1.0


class _Envelope(msgspec.Struct, array_like=True):
    kind: str
    body: msgspec.Raw


_BY_NAME: dict[str, type[Message]] = {cls.__name__: cls for cls in MESSAGE_TYPES}
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    name: msgspec.msgpack.Decoder(cls) for name, cls in _BY_NAME.items()
}


def encode(msg: Message) -> bytes:
    """One message as bytes on the wire."""
    return _ENCODER.encode(_Envelope(type(msg).__name__, msgspec.Raw(_ENCODER.encode(msg))))


def decode(data: bytes) -> Message:
    """A message from the wire; ``ProtocolError`` for anything that is not one."""
    try:
        env = _ENVELOPE.decode(data)
        decoder = _DECODERS.get(env.kind)
        if decoder is None:
            raise ProtocolError(f"unknown control-plane message kind {env.kind!r}")
        msg: Message = decoder.decode(env.body)
        return msg
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise ProtocolError(f"malformed control-plane message: {e}") from e


@frozen
class PeerInfo:
    """What a peer said in its HELLO (or HELLO_ACK), cached until ``expires_at``."""

    engine_id: str
    address: str
    compat_hash: str
    tp_size: int
    endpoints: tuple[str, ...]
    expires_at: float
    incarnation: int = 0  # the peer process's (its HELLO's epoch): a new one is a restart


@define(eq=False)
class _HelloWait:
    event: anyio.Event
    answer: HelloAck | None = None


async def _before(
    clock: Clock, deadline: float, fn: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``fn()`` until the clock reaches ``deadline``: (True, result), or (False, None)."""
    if isinstance(clock, SystemClock):
        # The real clock is the loop's: its own timer is the deadline, no watchdog task.
        with anyio.move_on_after(max(deadline - clock.now(), 0.0)):
            return True, await fn()
        return False, None
    box: list[T] = []
    async with anyio.create_task_group() as tg:

        async def watchdog() -> None:
            await clock.sleep_until(deadline)
            tg.cancel_scope.cancel()

        tg.start_soon(watchdog)
        box.append(await fn())
        tg.cancel_scope.cancel()
    return (True, box[0]) if box else (False, None)


def _take(q: deque[str]) -> list[str]:
    out = []
    while q:
        out.append(q.popleft())
    return out


def _resolve(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


async def _await(waiter: asyncio.Future[None]) -> None:
    await waiter


class ControlPlane:
    """One engine's control-plane endpoint. Open it with ``open_control_plane``."""

    def __init__(
        self,
        engine_id: str,
        compat: Compat,
        clock: Clock,
        *,
        bind: str,
        tp_size: int,
        endpoints: tuple[str, ...],
        hello_timeout_s: float,
        hello_ttl_s: float,
        inbox_size: int,
        context: zmq.Context[Any] | None = None,
        close_linger_s: float = CLOSE_LINGER_S,
    ) -> None:
        for name, value in (("hello_timeout_s", hello_timeout_s), ("hello_ttl_s", hello_ttl_s)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        close_linger_s = validate.timeout_s("close_linger_s", close_linger_s)
        if inbox_size < 1 or tp_size < 1:
            raise ConfigError(f"inbox_size and tp_size must be positive ({inbox_size}, {tp_size})")
        self.engine_id = engine_id
        self.compat = compat
        self.compat_hash = compat.digest()
        self.clock = clock
        self.tp_size = tp_size
        self.endpoints = endpoints
        self.hello_timeout_s = hello_timeout_s
        self.hello_ttl_s = hello_ttl_s
        self.close_linger_s = close_linger_s
        # One zmq context per process is zmq's advice: a caller may share its own (not closed
        # here); without one the plane owns a context and terminates it on close.
        self._own_ctx = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = (
            zmq.Context() if context is None else zmq.Context.shadow(context.underlying)
        )
        self._router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # A peer that restarts on its endpoint reconnects with the same routing id before the
        # old connection is seen closed: the new one takes over instead of being refused.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.bind(bind)
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.Socket[bytes]] = {}  # by address
        self._send_lock = threading.Lock()  # the dealers are written from any thread
        self._peers: dict[str, PeerInfo] = {}  # by engine id
        self._by_address: dict[str, str] = {}  # address → engine id
        self._hello_waits: dict[str, _HelloWait] = {}  # by address
        self._inbox: deque[tuple[str, Message]] = deque()
        self._inbox_size = inbox_size
        self._waiter: asyncio.Future[None] | None = None  # a ``recv`` waiting, on the loop
        self._loop: asyncio.AbstractEventLoop | None = None  # while ``run`` runs
        self._loop_thread = 0
        self._monitors: dict[str, zmq.Socket[bytes]] = {}  # by address: each dealer's events
        self._incarnations: dict[str, int] = {}  # by engine id, kept across ``forget``
        self._lost: deque[str] = deque()
        self._restarted: deque[str] = deque()
        # This process's incarnation, in its HELLO's epoch: a peer tells a restart by it.
        self.incarnation = secrets.randbits(62)
        self._stopped: asyncio.Future[None] | None = None
        self.on_arrival: Callable[[], object] | None = None  # called on the loop per arrival
        self.dropped = 0
        self.disconnects = 0  # connections to a peer that dropped
        self.wire_in = 0  # zmq messages received (each carries one or more hand-off messages)
        self._closed = False

    # -- public -------------------------------------------------------------------------------

    def peer(self, engine_id: str) -> PeerInfo | None:
        """The cached HELLO of ``engine_id`` if it has not expired."""
        info = self._peers.get(engine_id)
        return info if info is not None and info.expires_at > self.clock.now() else None

    async def hello(self, address: str) -> PeerInfo:
        """The peer at ``address``, after a HELLO exchange unless one is cached."""
        self._check_open()
        cached = self._by_address.get(address)
        if cached is not None and (info := self.peer(cached)) is not None:
            return info
        wait = self._hello_waits.get(address)
        if wait is None:
            wait = self._hello_waits[address] = _HelloWait(anyio.Event())
            self._write(address, [encode(Hello(*self._about()))])
        deadline = self.clock.now() + self.hello_timeout_s
        ok, _ = await _before(self.clock, deadline, wait.event.wait)
        self._hello_waits.pop(address, None)
        if not ok or wait.answer is None:
            raise PeerError(
                f"{self.engine_id}: the peer at {address} did not answer HELLO within "
                f"{self.hello_timeout_s} s"
            )
        ack = wait.answer
        if not ack.accepted:
            raise PeerError(
                f"{self.engine_id}: peer {ack.engine_id!r} at {address} is incompatible: "
                f"{', '.join(self.compat.refusals(ack.compat)) or ack.reason}"
            )
        return self._remember(ack)

    def forget(self, engine_id: str) -> None:
        """Drop the cached HELLO of ``engine_id`` (it restarted): the next ``hello`` asks again."""
        info = self._peers.pop(engine_id, None)
        if info is not None and self._by_address.get(info.address) == engine_id:
            del self._by_address[info.address]

    def post(self, peer: str, *msgs: Message) -> None:
        """Send ``msgs`` to a peer that said HELLO (either way), now, as one zmq message (one
        wake-up of each side's zmq I/O thread). Safe from any thread. A peer whose queue is full
        (zmq's high-water mark: it stopped reading) loses them, logged: its timers cover a lost
        message, and no sender ever waits on a peer. The HELLO's TTL does not apply: it says
        when ``hello`` asks again, and the peer's cache of this engine can outlive this one's
        of it (a CLAIM in between must still be answered); a dropped connection does."""
        self._check_open()
        info = self._peers.get(peer)
        if info is None:
            raise PeerError(
                f"{self.engine_id}: no HELLO with peer {peer!r} (never, or its connection "
                "dropped since)"
            )
        self._write(info.address, [encode(m) for m in msgs], peer=peer)

    async def send(self, peer: str, msg: Message) -> None:
        """``post(peer, msg)`` for a task on the event loop."""
        self.post(peer, msg)

    async def recv(self, timeout_s: float, what: str) -> tuple[str, Message]:
        """The next hand-off message and its sender; ``PeerError`` naming ``what`` at the deadline."""
        self._check_open()
        got = self.recv_nowait()
        if got is not None:
            return got
        deadline = self.clock.now() + timeout_s
        loop = asyncio.get_running_loop()
        while True:
            # A bare future that the receive loop resolves: no anyio event or cancel scope per
            # message (they cost tens of µs on this path).
            waiter = self._waiter = loop.create_future()
            try:
                if isinstance(self.clock, SystemClock):
                    timer = loop.call_later(max(deadline - self.clock.now(), 0.0), _resolve, waiter)
                    try:
                        await waiter
                    finally:
                        timer.cancel()
                else:
                    await _before(self.clock, deadline, functools.partial(_await, waiter))
            finally:
                self._waiter = None
            got = self.recv_nowait()
            if got is not None:
                return got
            self._check_open()
            if self.clock.now() >= deadline:
                raise PeerError(
                    f"{self.engine_id}: no message within {timeout_s} s while waiting for {what}"
                )

    def recv_nowait(self) -> tuple[str, Message] | None:
        """A message already received, if any. Safe from any thread."""
        try:
            return self._inbox.popleft()
        except IndexError:
            return None

    # -- the receive loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Receive from the ROUTER until closed (run in a task): the loop calls ``_drain``
        whenever the socket's descriptor turns readable, with no task woken in between."""
        loop = asyncio.get_running_loop()
        fd = self._router.fileno()
        self._stopped = loop.create_future()
        self._loop, self._loop_thread = loop, threading.get_ident()
        loop.add_reader(fd, self._drain)
        for address, mon in self._monitors.items():
            self._watch(loop, address, mon)
        try:
            self._drain()  # what came before the reader was added
            await self._stopped
        finally:
            with self._send_lock:
                self._loop = None
                monitors = list(self._monitors.values())
            loop.remove_reader(fd)
            for mon in monitors:
                loop.remove_reader(mon)

    def _drain(self) -> None:
        # zmq's descriptor is edge-triggered: it turns readable when messages come after a
        # receive found none, so each wake-up takes everything queued.
        sock = self._router
        while not self._closed:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                stopped = self._stopped
                if not self._closed and stopped is not None and not stopped.done():
                    stopped.set_exception(e)  # ``run`` raises it
                return
            self.wire_in += 1
            if len(frames) < 2:
                self._drop("malformed_frames", frames=len(frames))
                continue
            sender = frames[0].decode(errors="replace")
            batch: list[tuple[str, Message]] = []
            for frame in frames[1:]:
                self._dispatch(sender, frame, batch)
            if batch:
                # One zmq message lands in the inbox at once: a reader on another thread sees
                # all of what one turn of the peer said, or none of it.
                self._inbox.extend(batch)
                _resolve(self._waiter)
                if self.on_arrival is not None:
                    self.on_arrival()

    def _write(self, address: str, frames: list[bytes], peer: str = "") -> None:
        with self._send_lock:
            if self._closed:
                return
            try:
                self._dealer(address).send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._drop("peer_queue_full", peer=peer or address, messages=len(frames))

    def _dispatch(self, sender: str, data: bytes, batch: list[tuple[str, Message]]) -> None:
        try:
            msg = decode(data)
        except ProtocolError as e:
            self._drop("malformed", peer=sender, error=str(e)[:200])
            return
        if isinstance(msg, Hello):
            self._on_hello(msg)
        elif isinstance(msg, HelloAck):
            wait = self._hello_waits.get(msg.address)
            if wait is None or wait.event.is_set():
                self._drop("unexpected_hello_ack", peer=msg.engine_id)
                return
            wait.answer = msg
            wait.event.set()
        elif sender not in self._incarnations:
            # Only a peer that never said HELLO is refused. Its cached HELLO expiring, or its
            # connection dropping, does not make what it sent before stale: a DONE can land
            # after the disconnect is seen (two connections, no order between them).
            self._drop("no_hello", peer=sender, message=type(msg).__name__)
        elif len(self._inbox) + len(batch) >= self._inbox_size:
            self._drop("inbox_full", peer=sender, message=type(msg).__name__)
        else:
            batch.append((sender, msg))

    def _on_hello(self, msg: Hello) -> None:
        # The hash covers what must be equal; block and TP sizes are checked by rule.
        refused = self.compat.refusals(msg.compat)
        accepted = msg.compat_hash == self.compat_hash and not refused
        reason = "" if accepted else ", ".join(refused) or "hash"
        if accepted:
            self._remember(msg)
        else:
            log.warning("pd_peer_incompatible", peer=msg.engine_id, fields=reason)
        self._write(msg.address, [encode(HelloAck(*self._about(), accepted, reason))])

    def _about(self) -> tuple[str, int, str, str, str, Compat, int, tuple[str, ...]]:
        """HELLO's and HELLO_ACK's common fields: who this engine is and what its KV is."""
        return (
            PEER_TRANSFER,
            self.incarnation,
            self.engine_id,
            self.address,
            self.compat_hash,
            self.compat,
            self.tp_size,
            self.endpoints,
        )

    def _remember(self, msg: Hello | HelloAck) -> PeerInfo:
        info = PeerInfo(
            msg.engine_id,
            msg.address,
            msg.compat_hash,
            msg.tp_size,
            msg.endpoints,
            self.clock.now() + self.hello_ttl_s,
            msg.epoch,
        )
        old = self._peers.get(msg.engine_id)
        if old is not None and old.address != msg.address:
            self._by_address.pop(old.address, None)
        self._peers[msg.engine_id] = info
        self._by_address[msg.address] = msg.engine_id
        known = self._incarnations.get(msg.engine_id)
        self._incarnations[msg.engine_id] = msg.epoch
        if known is not None and known != msg.epoch:
            # Another process under this engine id: what it holds of the old one's is gone.
            log.warning("pd_peer_restarted", engine_id=self.engine_id, peer=msg.engine_id)
            self._restarted.append(msg.engine_id)
            self._wake()
        log.info("pd_peer_hello", engine_id=self.engine_id, peer=msg.engine_id, address=msg.address)
        return info

    def take_peer_events(self) -> tuple[list[str], list[str]]:
        """The peers whose connection dropped (their cached HELLO is gone) and the peers that
        came back as a new process (a HELLO of a new incarnation), since the last call, in
        order. Safe from any thread."""
        return _take(self._lost), _take(self._restarted)

    def _wake(self) -> None:
        if self.on_arrival is not None:
            self.on_arrival()

    def _on_monitor(self, address: str, mon: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = parse_monitor_message(mon.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closing
            if event["event"] != zmq.EVENT_DISCONNECTED or self._closed:
                continue
            self.disconnects += 1
            peer = self._by_address.pop(address, None)
            info = self._peers.get(peer) if peer is not None else None
            if peer is None or info is None or info.address != address:
                continue  # an old address of a peer that came back at another one
            # The process behind it died or closed; a later HELLO says whether it came back.
            log.warning("pd_peer_disconnected", engine_id=self.engine_id, peer=peer)
            self.forget(peer)
            self._lost.append(peer)
            self._wake()

    def _dealer(self, address: str) -> zmq.Socket[bytes]:
        sock = self._dealers.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, self.engine_id.encode())
            # zmq reports the connection dropping on a socket of its own, which the loop reads.
            mon = self._monitors[address] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            self._dealers[address] = sock
            loop = self._loop
            if loop is not None:
                watch = functools.partial(self._watch, loop, address, mon)
                if self._loop_thread == threading.get_ident():
                    watch()
                else:
                    loop.call_soon_threadsafe(watch)
        return sock

    def _watch(self, loop: asyncio.AbstractEventLoop, address: str, mon: zmq.Socket[bytes]) -> None:
        loop.add_reader(mon, self._on_monitor, address, mon)
        # A read that finds nothing arms zmq's descriptor (it signals only after one).
        self._on_monitor(address, mon)

    def _drop(self, why: str, **fields: Any) -> None:
        self.dropped += 1
        log.info("pd_control_dropped", engine_id=self.engine_id, why=why, **fields)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"control plane {self.engine_id!r} is closed")

    def close(self) -> None:
        """Close every socket and the context. What was posted still goes out, for up to
        ``close_linger_s``: an engine's last DONE must reach its peer, or the peer holds
        those blocks until its lease ends. A peer that is gone holds close no longer than that.
        Idempotent."""
        linger_ms = round(self.close_linger_s * 1000)
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            for address, sock in self._dealers.items():
                sock.disable_monitor()
                self._monitors[address].close(linger=0)
                sock.close(linger=linger_ms)
        self._router.close(linger=0)
        _resolve(self._waiter)  # a waiting ``recv`` sees the plane closed
        if self._own_ctx:
            self._ctx.term()


@asynccontextmanager
async def open_control_plane(
    engine_id: str,
    compat: Compat,
    clock: Clock,
    *,
    bind: str = "tcp://127.0.0.1:0",
    tp_size: int = 1,
    endpoints: tuple[str, ...] = (),
    hello_timeout_s: float = 5.0,
    hello_ttl_s: float = 300.0,
    inbox_size: int = 1024,
    context: zmq.Context[Any] | None = None,
    close_linger_s: float = CLOSE_LINGER_S,
) -> AsyncIterator[ControlPlane]:
    """An open control plane with its receive loop running; closed on exit."""
    cp = ControlPlane(
        engine_id,
        compat,
        clock,
        bind=bind,
        tp_size=tp_size,
        endpoints=endpoints,
        hello_timeout_s=hello_timeout_s,
        hello_ttl_s=hello_ttl_s,
        inbox_size=inbox_size,
        context=context,
        close_linger_s=close_linger_s,
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cp.run)
            try:
                yield cp
            finally:
                tg.cancel_scope.cancel()
    finally:
        cp.close()


def default_compat(**overrides: Any) -> Compat:
    """A ``Compat`` with this kvflow's version (tests, benchmarks)."""
    fields: dict[str, Any] = {
        "model": "tiny",
        "dtype": "float32",
        "block_size": 16,
        "layout": "flash_attn",
        "num_kv_heads": 2,
        "head_dim": 16,
        "num_layers": 2,
        "shard": "tp1/0",
        "kvflow_version": __version__,
    }
    fields.update(overrides)
    return Compat(**fields)


__all__ = ["ControlPlane", "PeerInfo", "decode", "default_compat", "encode", "open_control_plane"]
