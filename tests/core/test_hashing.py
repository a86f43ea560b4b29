"""Tests of chained block hashing: stability, chaining, extra keys, incremental use, bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvflow.core.hashing import (
    HASH_BYTES,
    ROOT_HASH,
    BlockHasher,
    encode_extra_keys,
    hash_block,
    hash_blocks,
)
from kvflow.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"

# Pinned digests: changing the encoding silently invalidates every stored CPU block, so it must
# be a deliberate, visible change to this test.
GOLDEN_ROOT = "b0315daaf5cb833b7e78f212190653cd"
GOLDEN_BLOCK = "f53f535dea34e2e2dd5d8bc0b2245e31"


def test_hash_is_128_bits_and_root_is_fixed() -> None:
    """Block hashes are 16 bytes and the root parent is a fixed constant."""
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert len(h) == HASH_BYTES == 16
    assert isinstance(ROOT_HASH, bytes)
    assert ROOT_HASH.hex() == GOLDEN_ROOT


def test_hash_is_identical_in_another_process() -> None:
    """A fresh interpreter (its own hash seed) computes the same chain for the same tokens."""
    code = (
        "from kvflow.core.hashing import hash_blocks;"
        "print(','.join(h.hex() for h in hash_blocks(list(range(100)), 16, extra_keys=('lora-1', 7))))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = ",".join(h.hex() for h in hash_blocks(list(range(100)), 16, extra_keys=("lora-1", 7)))
    assert out == here
    assert len(out.split(",")) == 6


def test_hash_digest_is_pinned() -> None:
    """The encoding is pinned by a golden digest so stored caches stay valid across versions."""
    h = hash_block(ROOT_HASH, [0, 1, 2, 3], ("salt",))
    assert h.hex() == hash_block(bytes.fromhex(ROOT_HASH.hex()), [0, 1, 2, 3], ("salt",)).hex()
    assert h.hex() == GOLDEN_BLOCK


def test_chain_depends_on_the_whole_prefix() -> None:
    """Equal blocks after different prefixes hash differently; equal prefixes hash equally."""
    a = hash_blocks([1] * 16 + [9] * 16, 16)
    b = hash_blocks([2] * 16 + [9] * 16, 16)
    c = hash_blocks([1] * 16 + [9] * 16, 16)
    assert a[1] != b[1]
    assert a == c
    assert a[0] == hash_block(ROOT_HASH, [1] * 16)
    assert a[1] == hash_block(a[0], [9] * 16)


def test_extra_keys_change_the_hash_and_are_unambiguous() -> None:
    """LoRA ids / salts change the hash, and key boundaries and types are part of the encoding."""
    toks = list(range(16))
    base = hash_block(ROOT_HASH, toks)
    assert hash_block(ROOT_HASH, toks, ("lora-a",)) != base
    assert hash_block(ROOT_HASH, toks, ("ab",)) != hash_block(ROOT_HASH, toks, ("a", "b"))
    assert hash_block(ROOT_HASH, toks, (1,)) != hash_block(ROOT_HASH, toks, ("1",))
    assert hash_block(ROOT_HASH, toks, (b"x",)) != hash_block(ROOT_HASH, toks, ("x",))
    assert encode_extra_keys(()) == b""


def test_partial_block_gets_no_hash() -> None:
    """Only full blocks are hashed; a trailing partial block is left out."""
    assert len(hash_blocks(list(range(31)), 16)) == 1
    assert hash_blocks(list(range(15)), 16) == []


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=10),
    block_size=st.integers(1, 33),
)
def test_incremental_hasher_matches_batch(
    tokens: list[int], cuts: list[int], block_size: int
) -> None:
    """Feeding tokens in any split gives the same hashes, each returned exactly once."""
    hasher = BlockHasher(block_size, extra_keys=("salt",))
    got: list[bytes] = []
    prev = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        got += hasher.extend(tokens[prev:cut])
        prev = cut
    want = hash_blocks(tokens, block_size, extra_keys=("salt",))
    assert got == want
    assert hasher.hashes == want
    assert hasher.num_tokens == len(tokens)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: hash_blocks([1, 2], 0), "block_size"),
        (lambda: BlockHasher(-1), "block_size"),
        (lambda: hash_blocks([-1], 1), "token ids"),
        (lambda: hash_blocks([2**32], 1), "token ids"),
        (lambda: hash_block(b"short", [1]), "parent hash"),
        (lambda: hash_blocks([1], 1, parent=b"short"), "parent hash"),
        (lambda: hash_block(ROOT_HASH, [1], (True,)), "bool"),
        (lambda: hash_block(ROOT_HASH, [1], (1.5,)), "must be int, str or bytes"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_raises_config_error(call: object, match: str) -> None:
    """Bad block sizes, token ids, parents and extra keys raise ConfigError naming the problem."""
    assert callable(call)
    with pytest.raises(ConfigError, match=match):
        call()


def test_failed_extend_leaves_hasher_unchanged() -> None:
    """A bad token in extend() raises and the hasher keeps its previous state."""
    hasher = BlockHasher(4)
    hasher.extend([1, 2, 3])
    with pytest.raises(ConfigError):
        hasher.extend([4, -5])
    assert hasher.num_tokens == 3
    assert hasher.extend([4]) == hash_blocks([1, 2, 3, 4], 4)


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=80),
    st.lists(st.integers(0, 80), max_size=6),
    st.integers(1, 9),
)
def test_extend_to_matches_hash_blocks_however_called(
    tokens: list[int], cuts: list[int], block_size: int
) -> None:
    """``extend_to`` over growing prefixes (mixed with ``extend``) hashes exactly the full blocks
    ``hash_blocks`` hashes for the same tokens."""
    hasher = BlockHasher(block_size, ("k",))
    fed = 0
    for i, cut in enumerate(sorted(min(c, len(tokens)) for c in cuts)):
        if i % 2 and cut > fed:
            hasher.extend(tokens[fed:cut])  # may leave a partial block pending
        else:
            hasher.extend_to(tokens, cut)
        fed = hasher.num_tokens
    hasher.extend_to(tokens, len(tokens))
    assert hasher.hashes == hash_blocks(tokens, block_size, extra_keys=("k",))
