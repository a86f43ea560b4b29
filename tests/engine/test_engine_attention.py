"""Paged attention and the paged model against dense references."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine.kv_cache import (
    DecodeSegment,
    build_attention_metadata,
    paged_attention,
    write_kv,
)
from kvflow.engine.model import model_config
from kvflow.engine.scheduler import StepBatch
from kvflow.errors import ConfigError
from tests.engine.helpers import dense_greedy, make_engine, prompts, requests, shared_model

HEADS, KV_HEADS, DIM, BS = 4, 2, 8, 4


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    t = q.shape[0]
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    rep = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1),
        attn_mask=allowed,
    )
    return out.transpose(0, 1)


def _random_qkv(
    lengths: list[int], gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random queries, keys and values of each request's tokens."""
    return [
        (
            torch.randn(n, HEADS, DIM, generator=gen),
            torch.randn(n, KV_HEADS, DIM, generator=gen),
            torch.randn(n, KV_HEADS, DIM, generator=gen),
        )
        for n in lengths
    ]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("first_ends", [[13, 7], [5, 3], [8, 4], [1, 6]])
def test_paged_attention_matches_dense(window: int | None, first_ends: list[int]) -> None:
    """Two requests batched over scattered blocks, in prefill chunks, attend like dense attention."""
    gen = torch.Generator().manual_seed(0)
    lengths = [13, 7]
    cache = torch.zeros(2, 16, BS, KV_HEADS, DIM)
    free = torch.randperm(15, generator=gen).add(1).tolist()  # block 0 is the null block
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    seqs = _random_qkv(lengths, gen)
    # Each request computes [0, first_end) in one step and the rest in the next.
    for start_of, end_of in ([0, 0], first_ends), (first_ends, lengths):
        starts, ends = list(start_of), list(end_of)
        if all(s == e for s, e in zip(starts, ends, strict=True)):
            continue
        meta = build_attention_metadata(
            tables,
            starts,
            [e - s for s, e in zip(starts, ends, strict=True)],
            BS,
            window,
            torch.device("cpu"),
        )
        q = torch.cat([seq[0][s:e] for seq, s, e in zip(seqs, starts, ends, strict=True)])
        k = torch.cat([seq[1][s:e] for seq, s, e in zip(seqs, starts, ends, strict=True)])
        v = torch.cat([seq[2][s:e] for seq, s, e in zip(seqs, starts, ends, strict=True)])
        write_kv(cache, meta.slot_mapping, k, v)
        got = paged_attention(q, cache, meta)
        want = torch.cat(
            [_dense(*qkv, window)[s:e] for qkv, s, e in zip(seqs, starts, ends, strict=True)]
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=4),
    chunk=st.integers(1, 6),
    window=st.sampled_from([None, 3, 6]),
    seed=st.integers(0, 2**16),
    varlen=st.booleans(),
)
def test_mixed_decode_and_prefill_batches_match_dense(
    lengths: list[int], chunk: int, window: int | None, seed: int, varlen: bool
) -> None:
    """Requests advancing by different chunk sizes in one batch (decodes and prefill chunks mixed,
    some idle), the chunks one by one or as one variable-length batch, each attend exactly like
    dense causal attention over their own keys."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.full((2, 32, BS, KV_HEADS, DIM), float("nan"))
    cache[:, 0] = 0.0  # the null block is zeros; unwritten real slots stay NaN to catch leaks
    free = torch.randperm(31, generator=gen).add(1).tolist()
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in lengths]
    seqs = _random_qkv(lengths, gen)
    done = [0] * len(lengths)
    step = 0
    while done != lengths:
        # Request i takes 1 token, a chunk, or nothing this step, varying by step.
        want = [[1, chunk, 0][(i + step) % 3] for i in range(len(lengths))]
        ns = [min(w, n - d) for w, n, d in zip(want, lengths, done, strict=True)]
        if not any(ns):
            ns = [min(1, n - d) for n, d in zip(lengths, done, strict=True)]
        step += 1
        meta = build_attention_metadata(
            tables, done, ns, BS, window, torch.device("cpu"), varlen=varlen
        )
        chunks = [p for p in meta.prefills if p.mask is None]
        assert (meta.varlen is not None) == (varlen and len(chunks) == len(meta.prefills) >= 2)
        parts = [
            [seq[j][d : d + n] for seq, d, n in zip(seqs, done, ns, strict=True)] for j in range(3)
        ]
        q, k, v = (torch.cat(x) for x in parts)
        assert meta.num_tokens == q.shape[0]
        write_kv(cache, meta.slot_mapping, k, v)
        got = paged_attention(q, cache, meta)
        want_out = torch.cat(
            [_dense(*seq, window)[d : d + n] for seq, d, n in zip(seqs, done, ns, strict=True)]
        )
        torch.testing.assert_close(got, want_out, rtol=1e-5, atol=1e-5)
        done = [d + n for d, n in zip(done, ns, strict=True)]


def test_block_table_too_short_is_a_config_error() -> None:
    """A block table that cannot hold a request's tokens is rejected with the request named."""
    with pytest.raises(ConfigError, match="request 1"):
        build_attention_metadata([[1], [2]], [0, 3], [2, 2], BS, None, torch.device("cpu"))


def test_sliding_window_ignores_blocks_outside_the_window() -> None:
    """Keys outside the window are never gathered, so null blocks there change nothing."""
    gen = torch.Generator().manual_seed(3)
    n, window = 12, 4
    cache = torch.zeros(2, 8, BS, KV_HEADS, DIM)
    table = [1, 2, 3]
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    write_kv(
        cache,
        build_attention_metadata([table], [0], [n], BS, window, cache.device).slot_mapping,
        k,
        v,
    )
    last = build_attention_metadata([[0, 0, 3]], [n - 1], [1], BS, window, cache.device)
    # The last query sees positions 8..11, all in block 3; blocks 1 and 2 are now "freed".
    cache[:, 1:3] = float("nan")
    got = paged_attention(q[n - 1 :], cache, last)
    torch.testing.assert_close(got, _dense(q, k, v, window)[n - 1 :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_engine_greedy_matches_dense_model(name: str) -> None:
    """Chunked prefill and batched decode over the paged cache give the dense model's tokens."""
    engine = make_engine(name, max_num_batched_tokens=7, num_gpu_blocks=64)
    ps = prompts([5, 17, 10])
    results = engine.run_to_completion(requests(ps, 5))
    model = shared_model(name)
    for p, r in zip(ps, results, strict=True):
        assert r.output_token_ids == dense_greedy(model, p, 5)
    assert engine.stats.forward_steps > 17 // 7


def test_paged_logits_match_dense_logits() -> None:
    """The engine's last-position logits equal the dense forward's within float tolerance."""
    engine = make_engine("tiny-swa6", max_num_batched_tokens=6)
    (p,) = prompts([21], seed=9)
    engine.add_request(p, 1, request_id="x")
    captured: list[torch.Tensor] = []
    original = engine.model.forward

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        out: torch.Tensor = original(*args, **kwargs)  # type: ignore[arg-type]
        captured.append(out)
        return out

    engine.model.forward = spy  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    dense = shared_model("tiny-swa6").forward_dense(p)[-1]
    torch.testing.assert_close(captured[-1][0], dense, rtol=1e-4, atol=1e-4)
    assert model_config("tiny-swa6").sliding_window == 6


def test_decode_rows_of_equal_length_need_no_mask() -> None:
    """Decode rows with as many keys as each other carry no mask (so unmasked kernels apply);
    rows of different lengths carry one that hides the padding."""
    cpu = torch.device("cpu")
    same = build_attention_metadata([[1, 2], [3, 4]], [5, 5], [1, 1], BS, None, cpu).decode
    assert isinstance(same, DecodeSegment)
    assert same.mask is None
    ragged = build_attention_metadata([[1, 2], [3, 4]], [5, 2], [1, 1], BS, None, cpu).decode
    assert isinstance(ragged, DecodeSegment)
    assert ragged.mask is not None
    assert ragged.mask[1, 0, 0].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_engine_with_prefill_chunks_as_one_batch_gives_the_same_tokens(name: str) -> None:
    """Steps of several prompt chunks (beside decode rows) run as one variable-length batch per
    layer, chunk by chunk on the host: the tokens do not change."""
    ps = prompts([30, 26, 22, 18, 9], seed=4)
    want = [r.output_token_ids for r in make_engine(name).run_to_completion(requests(ps, 6))]
    engine = make_engine(name, max_num_batched_tokens=64)
    engine.runner.varlen_prefill = True
    built: list[int] = []
    original = engine.runner._prepare

    def spy(batch: StepBatch, patch: Any = None) -> Any:
        built.append(sum(len(c.token_ids) > 1 for c in batch.chunks))
        return original(batch, patch)

    engine.runner._prepare = spy  # type: ignore[method-assign]
    got = [r.output_token_ids for r in engine.run_to_completion(requests(ps, 6))]
    assert got == want
    assert max(built) >= 2  # some step batched several chunks


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=6),
    window=st.sampled_from([None, 5, 16]),
    seed=st.integers(0, 2**16),
)
def test_metadata_indices_are_each_tokens_slot_and_each_chunks_keys(
    rows: list[tuple[int, int]], window: int | None, seed: int
) -> None:
    """Built on the host and copied in one piece, the metadata holds every token's cache slot,
    every chunk's key slots from its window's first key, and the decode rows' tables and
    flat indices, as the block tables give them."""
    gen = torch.Generator().manual_seed(seed)
    computed = [c for c, _ in rows]
    scheduled = [n if n or i else 1 for i, (_, n) in enumerate(rows)]  # one token at least
    free = torch.randperm(500, generator=gen).add(1).tolist()
    tables = [
        tuple(free.pop() for _ in range(-(-(c + n) // BS) + (i % 2)))
        for i, (c, n) in enumerate(zip(computed, scheduled, strict=True))
    ]
    meta = build_attention_metadata(
        tables, computed, scheduled, BS, window, torch.device("cpu"), varlen=True
    )

    def slot(i: int, pos: int) -> int:
        return int(tables[i][pos // BS]) * BS + pos % BS

    pairs = enumerate(zip(computed, scheduled, strict=True))
    want = [slot(i, c + k) for i, (c, n) in pairs for k in range(n)]
    assert meta.slot_mapping.tolist() == want
    assert meta.num_tokens == len(want)
    chunks = [i for i, n in enumerate(scheduled) if n > 1]
    assert len(meta.prefills) == len(chunks)
    for seg, i in zip(meta.prefills, chunks, strict=True):
        c, n = computed[i], scheduled[i]
        first = 0 if window is None else max(0, c - window + 1)
        assert seg.key_slots.tolist() == [[slot(i, p) for p in range(first, c + n)]]
        assert (seg.start, seg.stop) == (sum(scheduled[:i]), sum(scheduled[: i + 1]))
    decodes = [i for i, n in enumerate(scheduled) if n == 1]
    assert (meta.decode is None) == (not decodes)
    if meta.decode is not None:
        assert meta.decode.query_index.tolist() == [sum(scheduled[:i]) for i in decodes]
    if meta.varlen is not None:
        keys = torch.cat([seg.key_slots[0] for seg in meta.prefills])
        assert meta.varlen.key_slots.tolist() == keys.tolist()
