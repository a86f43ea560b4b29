"""Chained block hashes: every full block of tokens is named by hash(parent, token ids, extra keys).

Hashes are 128-bit xxh3 digests over a canonical byte encoding, so they are identical in every
process and every run (Python's ``hash()`` is salted per process and never used). The chain makes a
block's hash depend on its whole prefix: equal hashes mean equal prefixes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Protocol

import xxhash

from kvflow.errors import ConfigError

BlockHash = bytes
"""A 16-byte digest naming one full block and, through the chain, its whole prefix."""

HASH_BYTES = 16
ROOT_HASH: BlockHash = xxhash.xxh3_128_digest(b"kvflow/root/v1")
"""The parent of a sequence's first block: fixed, so chains agree across processes."""

ExtraKey = int | str | bytes
_TOKEN_TYPECODE = "I"  # 32-bit unsigned: token ids are vocabulary indices
_MAX_TOKEN = 2**32 - 1
_hash = xxhash.xxh3_128_digest

if array(_TOKEN_TYPECODE).itemsize != 4:  # pragma: no cover - every CPython platform we target
    raise ImportError("kvflow.core.hashing needs a 4-byte array typecode 'I'")


def encode_extra_keys(extra_keys: Iterable[ExtraKey]) -> bytes:
    """Canonical, type-tagged, length-prefixed encoding so ("ab",) and ("a", "b") differ."""
    out = bytearray()
    for key in extra_keys:
        if isinstance(key, bool):
            raise ConfigError(f"extra key {key!r}: bool is ambiguous, use an int or str")
        if isinstance(key, int):
            raw, tag = str(key).encode(), b"i"
        elif isinstance(key, str):
            raw, tag = key.encode(), b"s"
        elif isinstance(key, bytes):
            raw, tag = key, b"b"
        else:
            raise ConfigError(
                f"extra key {key!r}: must be int, str or bytes, not {type(key).__name__}"
            )
        out += tag + len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array(_TOKEN_TYPECODE, token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ConfigError(f"token ids must be ints in [0, {_MAX_TOKEN}]: {exc}") from exc


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Iterable[ExtraKey] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash (``ROOT_HASH`` for the first block)."""
    if len(parent) != HASH_BYTES:
        raise ConfigError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    return _hash(parent + _token_bytes(token_ids) + encode_extra_keys(extra_keys))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash = ROOT_HASH,
    extra_keys: Iterable[ExtraKey] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; a trailing partial block gets none."""
    if block_size <= 0:
        raise ConfigError(f"block_size must be positive, got {block_size}")
    if len(parent) != HASH_BYTES:
        raise ConfigError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    extra = encode_extra_keys(extra_keys)
    data = _token_bytes(token_ids)
    step = block_size * 4
    full = len(token_ids) // block_size
    out: list[BlockHash] = []
    append = out.append
    for i in range(full):
        parent = _hash(parent + data[i * step : (i + 1) * step] + extra)
        append(parent)
    return out


class BlockHasher:
    """Incremental hasher for one request: feed tokens as they arrive, get each block's hash once.

    ``extend`` returns only the hashes of blocks completed by this call; ``hashes`` holds all of
    them. Identical to ``hash_blocks`` over the concatenated tokens, however the tokens are split.
    """

    __slots__ = ("_extra", "_parent", "_pending", "block_size", "hashes")

    def __init__(
        self,
        block_size: int,
        extra_keys: Iterable[ExtraKey] = (),
        parent: BlockHash = ROOT_HASH,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._extra = encode_extra_keys(extra_keys)
        self._parent = parent
        self._pending = bytearray()
        self.hashes: list[BlockHash] = []

    @property
    def num_tokens(self) -> int:
        """Tokens fed so far."""
        return len(self.hashes) * self.block_size + len(self._pending) // 4

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Feed more tokens; return the hashes of the blocks they completed, in order."""
        step = self.block_size * 4
        pending = self._pending
        data: bytes | bytearray = _token_bytes(token_ids)
        if pending:
            pending += data
            data = pending
        n = len(data) // step
        if n == 0:
            if data is not pending:
                pending += data
            return []
        parent, extra = self._parent, self._extra
        if n == 1 and len(data) == step:
            # Whole blocks one at a time, as the scheduler feeds them: no copy into the buffer.
            parent = _hash(parent + data + extra)
            new = [parent]
        else:
            new = []
            for i in range(n):
                parent = _hash(parent + data[i * step : (i + 1) * step] + extra)
                new.append(parent)
        if data is pending:
            del pending[: n * step]
        elif len(data) > n * step:
            pending += data[n * step :]
        self._parent = parent
        self.hashes.extend(new)
        return new

    def extend_to(self, token_ids: Sequence[int], num_tokens: int) -> None:
        """Hash every full block of ``token_ids[:num_tokens]`` not hashed yet.

        ``token_ids`` is the whole sequence (the tokens fed so far must be its prefix); only the
        unhashed tail is read. The scheduler's per-step call: with no partial block pending it
        hashes straight from one encoding of the tail, with no buffer and no per-call list.
        """
        bs = self.block_size
        target = num_tokens - num_tokens % bs
        if self._pending:
            have = self.num_tokens
            if target > have:
                self.extend(token_ids[have:target])
            return
        hashes = self.hashes
        have = len(hashes) * bs
        if target <= have:
            return
        data = _token_bytes(token_ids[have:target])
        parent, extra = self._parent, self._extra
        step = bs * 4
        if len(data) == step:
            parent = _hash(parent + data + extra)
            hashes.append(parent)
        else:
            append = hashes.append
            for i in range(0, len(data), step):
                parent = _hash(parent + data[i : i + step] + extra)
                append(parent)
        self._parent = parent


class HashChain(Protocol):
    """A request's block hashes at one block size, as the scheduler-side manager reads them:
    ``hashes[i]`` names block ``i`` (and its prefix); ``extend_to`` makes sure every full block of
    the first ``num_tokens`` tokens has its hash."""

    @property
    def block_size(self) -> int: ...

    @property
    def hashes(self) -> Sequence[BlockHash]: ...

    def extend_to(self, token_ids: Sequence[int], num_tokens: int) -> None: ...


class EngineBlockHashes:
    """An engine's own chained block hashes of one request, which the engine keeps current as
    tokens arrive (vLLM's ``Request.block_hashes`` with a KV connector): the manager reads them
    instead of hashing the tokens a second time, and its CPU prefix cache is keyed by them.

    The engine's list is used as it is, live: it must hold a hash for every full block of the
    request's tokens whenever the manager is called.
    """

    __slots__ = ("block_size", "hashes")

    def __init__(self, block_size: int, hashes: Sequence[BlockHash]) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hashes = hashes

    def extend_to(self, token_ids: Sequence[int], num_tokens: int) -> None:
        # The engine extends its list when it appends tokens: nothing to hash here.
        return None


__all__ = [
    "HASH_BYTES",
    "ROOT_HASH",
    "BlockHash",
    "BlockHasher",
    "EngineBlockHashes",
    "ExtraKey",
    "HashChain",
    "encode_extra_keys",
    "hash_block",
    "hash_blocks",
]
