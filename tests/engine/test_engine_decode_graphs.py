"""Decode steps from per-bucket pieces: run uncaptured here ("pieces"), captured on a GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kvflow.engine.decode_graphs import DecodeGraphs, bucket_sizes, mixed_bucket_sizes
from kvflow.engine.engine import Engine, EngineConfig
from kvflow.errors import ConfigError
from tests.engine.helpers import dense_greedy, make_engine, prompts, requests, shared_model


def _graphs_used(engine: Engine) -> int:
    graphs = engine.runner._graphs
    assert graphs is not None
    return graphs.steps_run


def _uncaptured_full_graphs(engine: Engine, rows: int) -> DecodeGraphs:
    r = engine.runner
    return DecodeGraphs(
        r.model,
        r.kv_config,
        r._layers,
        r._layer_group,
        rows,
        capture=False,
        paged_decode=True,
        full=True,
    )


def test_bucket_sizes_are_powers_of_two_capped_by_the_largest() -> None:
    """Buckets double from one row and end at the largest batch exactly."""
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(8) == [1, 2, 4, 8]


def test_unknown_mode_is_rejected() -> None:
    """A decode_graphs value other than auto, pieces or off is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="decode_graphs 'always'"):
        EngineConfig(decode_graphs="always")


def test_auto_does_nothing_on_the_cpu() -> None:
    """ "auto" leaves a CPU engine on its eager path (there is nothing to capture)."""
    assert make_engine().runner._graphs is None


@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_pieces_give_the_dense_reference_tokens(name: str) -> None:
    """Padded decode buckets, one or two cache groups, through preemption: the dense tokens."""
    engine = make_engine(
        name,
        num_gpu_blocks=40 if name == "tiny" else 48,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        decode_graphs="pieces",
    )
    ps = prompts([9, 30, 17, 41, 5], seed=7)
    results = engine.run_to_completion(requests(ps, 12))
    model = shared_model(name)
    for p, r in zip(ps, results, strict=True):
        assert r.output_token_ids == dense_greedy(model, p, 12)
    assert _graphs_used(engine) > 0
    graphs = engine.runner._graphs
    assert graphs is not None
    assert graphs.mixed_steps_run > 0
    assert engine.stats.preemptions > 0


def test_mixed_buckets_pad_a_step_by_at_most_half_within_the_step_budget() -> None:
    """Mixed buckets start at 32 tokens, go up by 1.5× and 4/3× in turn, and end at the step
    budget (at most 1,024); a budget under 32 gets one bucket of its size, 0 none."""
    assert mixed_bucket_sizes(48) == [32, 48]
    assert mixed_bucket_sizes(100) == [32, 48, 64, 96, 100]
    assert mixed_bucket_sizes(8192) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert mixed_bucket_sizes(20) == [20]
    assert mixed_bucket_sizes(0) == []


def test_padding_rows_leave_every_real_block_as_the_eager_path_does() -> None:
    """After a 3-row step in bucket 4 and 1-row steps after it, no real block differs from eager."""
    caches = []
    for mode in ("off", "pieces"):
        engine = make_engine("tiny", num_gpu_blocks=64, max_num_seqs=4, decode_graphs=mode)
        # Different lengths: rows finish at different steps, so buckets shrink mid-run.
        engine.run_to_completion(requests(prompts([6, 13, 21], seed=3), 9))
        engine.run_to_completion(requests(prompts([11], seed=4), 7))
        caches.append({n: t[:, 1:].clone() for n, t in engine.kv_caches.items()})
        if mode == "pieces":
            assert _graphs_used(engine) > 0
            graphs = engine.runner._graphs
            assert graphs is not None
            assert graphs.mixed_steps_run > 0
    off, pieces = caches
    for name, tensor in off.items():
        torch.testing.assert_close(pieces[name], tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_captured_modes_refuse_a_cpu_engine(mode: str) -> None:
    """ "full" and "piecewise" capture CUDA graphs: on a CPU engine they are a ConfigError."""
    with pytest.raises(ConfigError, match=f"decode_graphs '{mode}' captures CUDA graphs"):
        make_engine(decode_graphs=mode)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="runs the Triton kernel on the CPU: needs Triton and TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("name", ["tiny", "tiny-swa6"])
def test_full_steps_on_the_triton_interpreter_give_the_dense_tokens(name: str) -> None:
    """Whole-step inputs (sizes, keys per split, block tables, padding rows), uncaptured on the
    Triton interpreter, through shrinking buckets and preemption: the dense tokens."""
    engine = make_engine(
        name,
        num_gpu_blocks=40 if name == "tiny" else 48,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        decode_graphs="pieces",
    )
    engine.runner._graphs = _uncaptured_full_graphs(engine, 6)
    ps = prompts([9, 30, 17, 41, 5], seed=7)
    results = engine.run_to_completion(requests(ps, 12))
    model = shared_model(name)
    for p, res in zip(ps, results, strict=True):
        assert res.output_token_ids == dense_greedy(model, p, 12)
    assert _graphs_used(engine) > 0
    assert engine.stats.preemptions > 0


def test_full_step_tables_rewrite_a_row_only_when_its_table_changed() -> None:
    """A full bucket's block-table rows hold each row's table after any sequence of steps: a
    row whose table is the same object is left alone, a table that extends the row's gets its
    new ids, a table that does not (shorter, or another prefix) is written whole, and a row
    that padding overwrote is written again when a real row returns to it."""
    engine = make_engine("tiny", num_gpu_blocks=64, max_num_seqs=4, decode_graphs="pieces")
    graphs = _uncaptured_full_graphs(engine, 4)
    bucket = graphs._buckets[4]
    a, b, c = (1, 2, 3), (4, 5), (6, 7, 8, 9)
    steps = [
        [a, b, c, a],
        [a, b, (*c, 10), a],
        [a, b],
        [a, b, c, (11,)],
        [b, a, c, a],
        [(*b, 12), a, c, a],  # grows: only 12 is written
        [(4,), a, c, (1, 2, 3, 14)],  # shorter, then another table with the same prefix
        [(4, 15, 16), a, c, (1, 2, 3, 14)],  # grows past ids a longer table left in the row
        [(17, 15, 16), a, c, a],  # same length, another first id
    ]
    with torch.inference_mode():
        for tables in steps:
            computed = [len(t) * 4 - 1 for t in tables]
            graphs._full_inputs(bucket, [0] * 12, computed, [tables])
            written = bucket.tables[0]
            for row, table in enumerate(tables):
                assert written[row, : len(table)].tolist() == list(table)
            assert all(written[row, 0].item() == 0 for row in range(len(tables), 4))
