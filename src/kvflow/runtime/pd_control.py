"""The PD control plane: one zmq endpoint per engine, msgspec on the wire, deadlines on the clock.

Each engine binds one ROUTER socket (its endpoint) and opens one DEALER per peer, whose routing
id is its engine id: everything A says to B goes from A's DEALER to B's ROUTER, which learns the
sender from the routing id. ``hello(address)`` exchanges HELLO / HELLO_ACK once per peer and
caches the answer for ``hello_ttl_s``; a peer whose compatibility hash differs is a
``PeerError`` naming the fields that differ, a peer that does not answer in ``hello_timeout_s`` a
``PeerError`` naming what was waited for. Messages about hand-offs go to a bounded inbox that
``recv`` reads with a deadline; messages from a peer that never said HELLO, malformed frames and a
full inbox are logged and dropped (the managers drop stale ``(transfer_id, epoch)`` themselves).

The wire format is msgpack through msgspec: ``[kind, body]`` with ``body`` the attrs message
encoded by msgspec, so ``kvflow.core`` stays free of msgspec. A zmq message carries one or more
of them (one frame each): ``send`` queues, and a flush task sends what one turn of the caller
queued for a peer as one multipart message (each zmq message wakes both sides' zmq I/O threads,
the control path's main cost on a busy machine); the receive loop drains what is queued
without waiting on the event loop between messages.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import msgspec
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from attrs import define, frozen

from kvflow import __version__
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
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        for name, value in (("hello_timeout_s", hello_timeout_s), ("hello_ttl_s", hello_ttl_s)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
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
        # One zmq context per process is zmq's advice: a caller may share its own (not closed
        # here); without one the plane owns a context and terminates it on close.
        self._own_ctx = context is None
        self._ctx = zmq.asyncio.Context() if context is None else context
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(bind)
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.asyncio.Socket] = {}
        self._plain_dealers: dict[str, zmq.Socket[bytes]] = {}  # shadows of _dealers
        self._peers: dict[str, PeerInfo] = {}  # by engine id
        self._by_address: dict[str, str] = {}  # address → engine id
        self._hello_waits: dict[str, _HelloWait] = {}  # by address
        send, receive = anyio.create_memory_object_stream[tuple[str, Message]](inbox_size)
        self._inbox_send: MemoryObjectSendStream[tuple[str, Message]] = send
        self._inbox: MemoryObjectReceiveStream[tuple[str, Message]] = receive
        self._outbox: dict[str, list[bytes]] = {}  # by address, in order
        self._outbox_ready = anyio.Event()
        self.dropped = 0
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
            self._outbox.setdefault(address, []).append(encode(Hello(*self._about())))
            self._outbox_ready.set()
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

    async def send(self, peer: str, msg: Message) -> None:
        """Send ``msg`` to a peer that said HELLO (either way). The message is queued and goes
        out when this task next yields: what one turn of the caller says to a peer (P's GRANT
        and DONE) travels as one zmq message, which wakes each side's zmq I/O thread once."""
        self._check_open()
        info = self.peer(peer)
        if info is None:
            raise PeerError(f"{self.engine_id}: no HELLO with peer {peer!r} (or it expired)")
        self._outbox.setdefault(info.address, []).append(encode(msg))
        self._outbox_ready.set()

    async def recv(self, timeout_s: float, what: str) -> tuple[str, Message]:
        """The next hand-off message and its sender; ``PeerError`` naming ``what`` at the deadline."""
        self._check_open()
        got = self.recv_nowait()
        if got is not None:
            return got
        ok, got = await _before(self.clock, self.clock.now() + timeout_s, self._inbox.receive)
        if not ok or got is None:
            raise PeerError(
                f"{self.engine_id}: no message within {timeout_s} s while waiting for {what}"
            )
        return got

    def recv_nowait(self) -> tuple[str, Message] | None:
        """A message already received, if any."""
        try:
            return self._inbox.receive_nowait()
        except anyio.WouldBlock:
            return None

    # -- the receive loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Receive from the ROUTER until closed (run in a task)."""
        flags = 0
        while not self._closed:
            try:
                # After one awaited receive, take what else is queued without the loop's
                # event machinery (a done future's await does not yield).
                frames = await self._router.recv_multipart(flags=flags)
            except zmq.Again:
                flags = 0
                continue
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            flags = zmq.NOBLOCK
            if len(frames) < 2:
                self._drop("malformed_frames", frames=len(frames))
                continue
            sender = frames[0].decode(errors="replace")
            for frame in frames[1:]:
                await self._dispatch(sender, frame)

    async def flush(self) -> None:
        """Send what ``send`` queued, one zmq message per peer, until closed (run in a task)."""
        while not self._closed:
            await self._outbox_ready.wait()
            self._outbox_ready = anyio.Event()
            outbox, self._outbox = self._outbox, {}
            for address, frames in outbox.items():
                sock = self._dealer(address)
                try:
                    # The plain socket under the asyncio one: no future per message.
                    self._plain(address, sock).send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:  # the peer's queue is full (HWM): wait for room
                    await sock.send_multipart(frames)

    async def _dispatch(self, sender: str, data: bytes) -> None:
        try:
            msg = decode(data)
        except ProtocolError as e:
            self._drop("malformed", peer=sender, error=str(e)[:200])
            return
        if isinstance(msg, Hello):
            await self._on_hello(msg)
        elif isinstance(msg, HelloAck):
            wait = self._hello_waits.get(msg.address)
            if wait is None or wait.event.is_set():
                self._drop("unexpected_hello_ack", peer=msg.engine_id)
                return
            wait.answer = msg
            wait.event.set()
        elif self.peer(sender) is None:
            self._drop("no_hello", peer=sender, message=type(msg).__name__)
        else:
            try:
                self._inbox_send.send_nowait((sender, msg))
            except anyio.WouldBlock:
                self._drop("inbox_full", peer=sender, message=type(msg).__name__)

    async def _on_hello(self, msg: Hello) -> None:
        # The hash covers what must be equal; block and TP sizes are checked by rule.
        refused = self.compat.refusals(msg.compat)
        accepted = msg.compat_hash == self.compat_hash and not refused
        reason = "" if accepted else ", ".join(refused) or "hash"
        if accepted:
            self._remember(msg)
        else:
            log.warning("pd_peer_incompatible", peer=msg.engine_id, fields=reason)
        ack = HelloAck(*self._about(), accepted, reason)
        self._outbox.setdefault(msg.address, []).append(encode(ack))
        self._outbox_ready.set()

    def _about(self) -> tuple[str, int, str, str, str, Compat, int, tuple[str, ...]]:
        """HELLO's and HELLO_ACK's common fields: who this engine is and what its KV is."""
        return (
            PEER_TRANSFER,
            0,
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
        )
        self._peers[msg.engine_id] = info
        self._by_address[msg.address] = msg.engine_id
        log.info("pd_peer_hello", engine_id=self.engine_id, peer=msg.engine_id, address=msg.address)
        return info

    def _dealer(self, address: str) -> zmq.asyncio.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, self.engine_id.encode())
            sock.connect(address)
            self._dealers[address] = sock
        return sock

    def _plain(self, address: str, sock: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
        plain = self._plain_dealers.get(address)
        if plain is None:
            plain = self._plain_dealers[address] = zmq.Socket.shadow(sock.underlying)
        return plain

    def _drop(self, why: str, **fields: Any) -> None:
        self.dropped += 1
        log.info("pd_control_dropped", engine_id=self.engine_id, why=why, **fields)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"control plane {self.engine_id!r} is closed")

    def close(self) -> None:
        """Close every socket and the context (no linger). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for address, frames in self._outbox.items():  # what was said just before closing
            # A full queue at close drops the message: the peer's timers cover a lost one.
            with contextlib.suppress(zmq.ZMQError):
                self._plain(address, self._dealer(address)).send_multipart(
                    frames, flags=zmq.NOBLOCK
                )
        self._outbox.clear()
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._router.close(linger=0)
        self._inbox_send.close()
        self._inbox.close()
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
    context: zmq.asyncio.Context | None = None,
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
    )
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cp.run)
            tg.start_soon(cp.flush)
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
