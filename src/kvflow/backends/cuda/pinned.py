"""The pinned CPU tier: host memory kvflow allocates itself and registers with the driver in chunks.

Each KV cache group gets one page-aligned anonymous mapping of exactly ``num_blocks * block_bytes``
bytes (no power-of-two rounding, unlike a caching pinned allocator). Registration
(``cuMemHostRegister``, what ``cudaHostRegister`` calls) runs on a background thread, chunk by
chunk, lowest block ids first; a transfer that needs a chunk not yet registered registers it on
the spot, so the first transfers run within a chunk's registration time of start-up.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvflow.backends.cuda.driver import Context, check, cu
from kvflow.core.logs import get_logger
from kvflow.errors import BackendError, ConfigError, DeadlineError

log = get_logger("kvflow.backends.cuda")


class _GroupBuffer:
    """One group's mapping and which of its chunks are registered."""

    __slots__ = (
        "array",
        "block_bytes",
        "chunk_blocks",
        "claimed",
        "mapping",
        "nbytes",
        "num_blocks",
        "prefix_blocks",
        "ptr",
        "registered",
    )

    def __init__(self, num_blocks: int, block_bytes: int, chunk_bytes: int) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.nbytes = num_blocks * block_bytes
        # Chunks hold whole blocks, so no copy ever spans two registrations.
        self.chunk_blocks = max(1, chunk_bytes // block_bytes) if block_bytes else 1
        num_chunks = -(-num_blocks // self.chunk_blocks) if num_blocks else 0
        self.registered = [False] * num_chunks
        self.claimed = [False] * num_chunks  # a thread is registering (or has registered) it
        self.prefix_blocks = 0  # blocks 0..prefix_blocks-1 are known pinned: the fast check
        self.mapping: mmap.mmap | None = mmap.mmap(-1, self.nbytes) if self.nbytes else None
        self.array: npt.NDArray[np.uint8] = (
            np.frombuffer(self.mapping, dtype=np.uint8)
            if self.mapping is not None
            else np.zeros(0, dtype=np.uint8)
        )
        self.ptr = int(self.array.ctypes.data) if self.nbytes else 0

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        lo = chunk * self.chunk_blocks * self.block_bytes
        hi = min(self.nbytes, lo + self.chunk_blocks * self.block_bytes)
        return lo, hi


class PinnedTier:
    """Block-major host buffers for every group, pinned in the background, unpinned on close."""

    def __init__(
        self,
        ctx: Context,
        num_blocks: Sequence[int],
        block_bytes: Sequence[int],
        *,
        chunk_bytes: int,
        register: Literal["background", "now", "lazy"] = "background",
    ) -> None:
        if len(num_blocks) != len(block_bytes):
            raise ConfigError(
                f"CPU tier: {len(num_blocks)} block counts for {len(block_bytes)} KV cache groups"
            )
        if any(n < 0 for n in num_blocks):
            raise ConfigError(f"CPU tier: negative block count in {list(num_blocks)}")
        if chunk_bytes <= 0:
            raise ConfigError(f"CPU tier: chunk_bytes must be positive, got {chunk_bytes}")
        self._ctx = ctx
        self._groups = [
            _GroupBuffer(n, bb, chunk_bytes) for n, bb in zip(num_blocks, block_bytes, strict=True)
        ]
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._done = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._mode = register
        if register == "background":
            self._thread = threading.Thread(
                target=self._register_all, name="kvflow-pin", daemon=True
            )
            self._thread.start()
        elif register == "now":
            self._register_all()
        else:  # lazy: only what transfers ask for (tests, tiny tiers)
            self._done.set()

    @property
    def nbytes(self) -> int:
        """Bytes allocated (and, once registration finishes, pinned): exactly what was asked."""
        return sum(g.nbytes for g in self._groups)

    @property
    def pinning_finished(self) -> bool:
        """Whether the background registration has run to its end (or failed)."""
        return self._done.is_set()

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return sum(
                hi - lo
                for g in self._groups
                for c, done in enumerate(g.registered)
                if done
                for lo, hi in (g.chunk_range(c),)
            )

    def ptr(self, group: int) -> int:
        return self._groups[group].ptr

    def chunk_blocks(self, group: int) -> int:
        return self._groups[group].chunk_blocks

    def num_blocks(self, group: int) -> int:
        return self._groups[group].num_blocks

    def array(self, group: int) -> npt.NDArray[np.uint8]:
        """Group ``group``'s bytes as ``(num_blocks, block_bytes)``; a view, not a copy."""
        g = self._groups[group]
        return g.array.reshape(g.num_blocks, g.block_bytes)

    def wait_registered(self, timeout_s: float = 600.0) -> None:
        """Block until every chunk is registered (start-up; tests and benchmarks); after
        ``timeout_s`` seconds (each of the two waits) raise ``DeadlineError``."""
        if not self._done.wait(timeout_s):
            raise DeadlineError(f"pinning the CPU tier: not done after {timeout_s:g} s")
        if self._error is not None:
            raise BackendError(f"pinning the CPU tier failed: {self._error}") from self._error
        with self._changed:
            done = self._changed.wait_for(
                lambda: (
                    self._mode == "lazy"
                    or self._stop
                    or all(all(g.registered) for g in self._groups)
                ),
                timeout_s,
            )
        if not done:
            raise DeadlineError(
                f"pinning the CPU tier: chunks claimed on demand still unpinned after "
                f"{timeout_s:g} s"
            )

    def ensure(self, group: int, max_block: int) -> None:
        """Make sure blocks ``0..max_block`` of ``group`` are pinned; registers missing chunks now.

        Only the first seconds after start-up ever get past the first check. No lock is held
        while the driver registers, so a transfer never queues behind the background thread's
        whole backlog: at most behind the one chunk it needs.
        """
        g = self._groups[group]
        if max_block < g.prefix_blocks:
            return
        self._ctx.enter()
        for chunk in range(max_block // g.chunk_blocks + 1):
            self._register(g, chunk, wait=True)

    def _register(self, g: _GroupBuffer, chunk: int, *, wait: bool) -> None:
        with self._changed:
            while g.claimed[chunk] and not g.registered[chunk]:
                if not wait:
                    return
                self._changed.wait()
            if g.registered[chunk] or self._stop:
                return
            g.claimed[chunk] = True
        lo, hi = g.chunk_range(chunk)
        try:
            check(cu.cuMemHostRegister(g.ptr + lo, hi - lo, 0), "cuMemHostRegister")
        except BaseException:
            with self._changed:
                g.claimed[chunk] = False
                self._changed.notify_all()
            raise
        with self._changed:
            g.registered[chunk] = True
            while (
                g.prefix_blocks < g.num_blocks and g.registered[g.prefix_blocks // g.chunk_blocks]
            ):
                g.prefix_blocks = min(g.num_blocks, g.prefix_blocks + g.chunk_blocks)
            self._changed.notify_all()

    def _register_all(self) -> None:
        try:
            self._ctx.enter()
            most = max((len(g.registered) for g in self._groups), default=0)
            # Round-robin over groups, so every group's low block ids are pinned early.
            for chunk in range(most):
                for g in self._groups:
                    if chunk < len(g.registered):
                        self._register(g, chunk, wait=False)
                if self._stop:
                    break
        except BaseException as exc:
            self._error = exc
            log.error("cpu_tier_pin_failed", error=str(exc))
        finally:
            self._done.set()
        if self._error is None:
            log.info("cpu_tier_pinned", bytes=self.nbytes, groups=len(self._groups))

    def close(self) -> None:
        """Stop registering, unregister every registered chunk, drop the mappings. Idempotent."""
        with self._lock:
            self._stop = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._ctx.enter()
        unpinned = 0
        with self._changed:
            # A chunk another thread claimed but has not finished is waited for, then unpinned.
            while any(
                c and not r
                for g in self._groups
                for c, r in zip(g.claimed, g.registered, strict=True)
            ):
                self._changed.wait()
            for g in self._groups:
                for c, done in enumerate(g.registered):
                    if done:
                        lo, hi = g.chunk_range(c)
                        check(cu.cuMemHostUnregister(g.ptr + lo), "cuMemHostUnregister")
                        g.registered[c] = g.claimed[c] = False
                        unpinned += hi - lo
                g.prefix_blocks = 0
        if unpinned:
            log.info("cpu_tier_unpinned", bytes=unpinned)


def is_registered(ptr: int) -> bool:
    """Whether the driver knows ``ptr`` as page-locked host memory (for tests and doctor)."""
    err, _flags = cu.cuMemHostGetFlags(ptr)
    return int(err) == 0


__all__ = ["PinnedTier", "is_registered"]
