"""An async frontend: ``async for token in frontend.generate(prompt_ids, max_tokens)``.

One task steps the engine (by default in a worker thread, so the event loop stays responsive and a
connector may drive its own runtime through a blocking portal); every ``generate`` call hands its
request to that task through an inbox and reads its tokens from a memory object stream. Use it as
``async with AsyncEngine(engine) as frontend:`` inside the task that serves requests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
from attrs import frozen

from kvflow.core.logs import get_logger
from kvflow.engine.engine import Engine, RequestResult
from kvflow.errors import ClosedError, KVFlowError

log = get_logger("kvflow.engine.frontend")

_Item = int | KVFlowError


@frozen
class _Submission:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stream: MemoryObjectSendStream[_Item]


class AsyncEngine:
    """Serves many concurrent ``generate`` calls from one ``Engine``."""

    def __init__(self, engine: Engine, *, step_in_thread: bool = True) -> None:
        self.engine = engine
        self.step_in_thread = step_in_thread
        self._inbox: list[_Submission] = []
        self._streams: dict[str, MemoryObjectSendStream[_Item]] = {}
        self._results: dict[str, RequestResult] = {}
        self._ids = itertools.count()
        self._wake = anyio.Event()
        self._closing = False
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> AsyncEngine:
        if self._tg is not None:
            raise ClosedError("AsyncEngine is already running")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._closing = True
        self._wake.set()
        assert self._tg is not None
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def generate(
        self, prompt_token_ids: Sequence[int], max_tokens: int, *, request_id: str | None = None
    ) -> AsyncIterator[int]:
        """Yield the request's tokens as the engine produces them; invalid input raises here."""
        if self._tg is None or self._closing:
            raise ClosedError("AsyncEngine is not running (use `async with AsyncEngine(...)`)")
        rid = request_id if request_id is not None else f"gen-{next(self._ids)}"
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._inbox.append(_Submission(rid, tuple(prompt_token_ids), max_tokens, send))
        self._wake.set()
        async with receive:
            async for item in receive:
                if isinstance(item, KVFlowError):
                    raise item
                yield item

    def result(self, request_id: str) -> RequestResult:
        """Stats of a request whose generation finished."""
        return self._results[request_id]

    def _admit_inbox(self) -> None:
        inbox, self._inbox = self._inbox, []
        for sub in inbox:
            try:
                self.engine.add_request(
                    sub.prompt_token_ids, sub.max_tokens, request_id=sub.request_id
                )
            except KVFlowError as exc:
                sub.stream.send_nowait(exc)
                sub.stream.close()
                continue
            self._streams[sub.request_id] = sub.stream

    async def _run(self) -> None:
        engine = self.engine
        while True:
            self._admit_inbox()
            if not engine.has_unfinished():
                if self._closing:
                    return
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            if self.step_in_thread:
                outputs = await anyio.to_thread.run_sync(engine.step)
            else:
                outputs = engine.step()
                await anyio.lowlevel.checkpoint()
            for out in outputs:
                stream = self._streams[out.request_id]
                for token in out.new_token_ids:
                    try:
                        stream.send_nowait(token)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        # The caller stopped listening; the request still runs to max_tokens.
                        log.debug("generate_listener_gone", request_id=out.request_id)
                if out.finished:
                    stream.close()
                    del self._streams[out.request_id]
                    self._results[out.request_id] = engine.take_result(out.request_id)


__all__ = ["AsyncEngine"]
