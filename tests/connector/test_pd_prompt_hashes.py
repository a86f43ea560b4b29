"""``prompt_hashes``, the block identity both sides of a PD hand-off digest: the engine's own
hashes are taken where they are kvflow's (the reference engine's), and the result always equals
kvflow hashing every block itself, whatever the engine gives; and the wire rows a hand-off names
of a request's blocks."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from attrs import define
from hypothesis import given
from hypothesis import strategies as st

from kvflow.connector.pd import PDConnector, prompt_hashes
from kvflow.core.hashing import BlockHash, ExtraKey
from kvflow.core.requests import KVRequest
from kvflow.engine.request import Request, RequestStats


@define(eq=False)
class _Hashed(KVRequest):
    """A request whose engine gives ``given`` as its hashes at ``size``."""

    given: Sequence[BlockHash] | None = None
    size: int = 4
    asked: int = 0

    def engine_block_hashes(self, block_size: int) -> Sequence[BlockHash] | None:
        self.asked += 1
        return self.given if block_size == self.size else None


def _engine_request(
    tokens: list[int], num_prompt: int, bs: int, keys: tuple[ExtraKey, ...]
) -> Request:
    r = Request("r", tokens[:num_prompt], 8, RequestStats(arrival_time=0.0), keys, bs)
    for t in tokens[num_prompt:]:
        r.append_token(t)
    return r


@given(
    tokens=st.lists(st.integers(0, 1023), min_size=1, max_size=80),
    cut=st.integers(0, 80),
    bs=st.sampled_from([1, 2, 4, 16]),
    keys=st.sampled_from([(), ("lora-7",), (b"salt", 3)]),
    num_tokens=st.none() | st.integers(1, 80),
)
def test_the_reference_engine_s_hashes_give_what_kvflow_s_hashing_gives(
    tokens: list[int],
    cut: int,
    bs: int,
    keys: tuple[ExtraKey, ...],
    num_tokens: int | None,
) -> None:
    """A reference-engine request (prompt, output tokens after it, any block size and extra
    keys, the whole prompt or its head): the hashes equal those of a request with no engine
    hashes, partial tail hash included."""
    num_prompt = max(1, min(cut, len(tokens)))
    n = None if num_tokens is None else min(num_tokens, num_prompt)
    engine = _engine_request(tokens, num_prompt, bs, keys)
    plain = KVRequest("r", list(tokens), num_prompt, keys)
    assert prompt_hashes(engine, bs, n) == prompt_hashes(plain, bs, n)


def test_an_engine_hashing_another_way_is_not_trusted() -> None:
    """Hashes of another function (vLLM's), too few hashes, or none at this block size: kvflow
    hashes every block itself, and the result is the same as with no engine hashes."""
    tokens = list(range(11))
    plain = prompt_hashes(KVRequest("r", tokens, 11), 4)
    for theirs, size in (([b"x" * 16] * 2, 4), (plain[:1], 4), (plain[:2], 8)):
        r = _Hashed("r", tokens, 11, given=theirs, size=size)
        assert prompt_hashes(r, 4) == plain
        assert r.asked == 1


def test_the_engine_s_hashes_are_used_not_recomputed() -> None:
    """Where the engine's first hash is kvflow's, the full blocks' hashes are the engine's list
    (here a marked one after the first block, which kvflow's hashing would never give)."""
    tokens = list(range(11))
    plain = prompt_hashes(KVRequest("r", tokens, 11), 4)
    marked = [plain[0], b"m" * 16]
    got = prompt_hashes(_Hashed("r", tokens, 11, given=marked), 4)
    assert got[:2] == marked
    assert len(got) == 3  # and the partial tail's hash, chained on the engine's last one


@given(
    tables=st.lists(st.lists(st.integers(0, 500), max_size=12), min_size=1, max_size=3),
    first=st.integers(0, 14),
    span=st.integers(0, 14),
    k=st.sampled_from([1, 2, 4]),
)
def test_wire_rows_are_the_block_table_s_rows(
    tables: list[list[int]], first: int, span: int, k: int
) -> None:
    """``PDConnector.rows``: row ``r`` of group ``g`` is block ``g[r // k]``'s row ``r % k``, at
    every rows-per-block (one: the table's slice); rows past a table raise ``IndexError``."""
    end = first + span
    conn = object.__new__(PDConnector)
    conn.rows_per_block = k
    want: list[tuple[int, ...]] = []
    for g in tables:
        if span and end > len(g) * k:
            with pytest.raises(IndexError):
                conn.rows(tuple(tuple(t) for t in tables), first, end)
            return
        want.append(tuple(g[r // k] * k + r % k for r in range(first, end)))
    assert conn.rows(tuple(tuple(t) for t in tables), first, end) == tuple(want)
