"""Decode-only steps replayed from CUDA graphs, piece by piece around the attention.

An eager decode step of llama-1b launches about 450 kernels from Python, and on the H200 the
launches, not the GPU, set its time (about 12 ms for two rows). A step whose tokens are all
single-token decodes runs here instead: the rows are padded to a bucket size (1, 2, 4, ... up to
``max_num_seqs``), and everything outside the attention (embedding, norms, projections, RoPE, the
KV write, MLP, LM head and argmax) is captured once per bucket into ``num_layers + 1`` graphs,
as vLLM's piecewise capture does. Attention runs eagerly between them on the real rows, with the
same kernels as an eager step, so its key lengths never have to be padded to a bucket.

Padding rows compute token 0 at position 0 and write their keys into slot 0 of the null block,
which no query reads unmasked; every step rewrites every row of the static inputs, so a padding
row never reuses a real row's slot from an earlier, larger step.

``capture=False`` runs the same pieces on the same static buffers without capturing them: the
CPU test suite checks this path's plumbing (buckets, padding, several cache groups) that way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from kvflow.connector.api import KVCacheConfig
from kvflow.core.logs import get_logger
from kvflow.engine import triton_decode
from kvflow.engine.kv_cache import (
    AttentionMetadata,
    block_table_tensor,
    decode_attention,
    decode_segment,
    key_ranges,
    layer_name,
    paged_attention,
)
from kvflow.engine.model import SDPA_BACKENDS, LlamaForCausalLM

log = get_logger("kvflow.engine.decode_graphs")

Piece = Callable[[], None]


MIXED_MIN_TOKENS = 32
"""The smallest mixed bucket: smaller mixed steps are rare and pad up to it."""

MIXED_MAX_TOKENS = 1024
"""The largest mixed bucket: steps of more tokens keep the eager path, where the device's work,
not the launches, sets their time."""


def mixed_bucket_sizes(max_tokens: int) -> list[int]:
    """Token buckets of mixed steps: powers of two from ``MIXED_MIN_TOKENS`` and the midpoints
    between them (a step pads to at most 1.5× its tokens), capped by ``min(max_tokens,
    MIXED_MAX_TOKENS)``, which is a bucket itself; none for 0."""
    top = min(max_tokens, MIXED_MAX_TOKENS)
    if top <= 0:
        return []
    sizes, n = [], MIXED_MIN_TOKENS
    while n < top:
        sizes += [s for s in (n, n * 3 // 2) if s < top]
        n *= 2
    return [*sizes, top]


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, and ``max_rows`` itself."""
    sizes = []
    n = 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    sizes.append(max_rows)
    return sizes


class _Bucket:
    """Static inputs, outputs and pieces of decode steps of up to ``rows`` rows, or of mixed
    steps of up to ``rows`` tokens."""

    def __init__(
        self,
        runner: DecodeGraphs,
        rows: int,
        capture: bool,
        pool: Any,
        *,
        full: bool = False,
        samples: int | None = None,
    ) -> None:
        model, device = runner.model, runner.device
        cfg = model.config
        self.rows = rows
        self.full = full
        # A mixed bucket's rows are tokens, of which up to ``samples`` are sampled: their
        # indices are an input too. A decode bucket samples every row.
        self.samples = rows if samples is None else samples
        groups = runner.num_groups
        n_inputs = (2 + groups) * rows
        n_index = 0 if samples is None else samples
        # Full capture: the attention's row sizes (first key, key count per row, then the keys
        # per split) sit after the inputs in one buffer, so a step's inputs are one copy.
        size_len = 2 * rows + 1 if full else 0
        n_small = n_inputs + n_index + groups * size_len
        self.small = torch.zeros(n_small, dtype=torch.long, device=device)
        self.small_host = _host_like(self.small)
        # numpy views of the pinned buffers: a Python list lands in one in a fraction of what
        # ``torch.tensor`` takes to build a tensor from it.
        self.small_np = self.small_host.numpy()
        # Row 0: token ids, 1: positions, 2 + g: group g's cache slots.
        self.inputs = self.small[:n_inputs].view(2 + groups, rows)
        sizes_at = n_inputs + n_index
        self.sizes = [
            self.small[sizes_at + g * size_len : sizes_at + (g + 1) * size_len]
            for g in range(groups if full else 0)
        ]
        width = runner.kv_caches[0].shape[1]
        self.tables = [
            torch.zeros((rows, width), dtype=torch.int32, device=device) for _ in self.sizes
        ]
        self.tables_host = [_host_like(t) for t in self.tables]
        self.tables_np = [t.numpy() for t in self.tables_host]
        # The block table each row of ``tables_host`` holds, per group, as the engine handed
        # it (an immutable tuple): a row is rewritten only when its table is another object,
        # which in a decode step is one row in sixteen.
        self.tables_written: list[list[Sequence[int] | None]] = [[None] * rows for _ in self.tables]
        kv_heads = cfg.num_kv_heads
        capacity = [width * runner.kv_config.block_size] * len(self.sizes)
        for g, window in enumerate(runner.windows[: len(self.sizes)]):
            if window is not None:
                capacity[g] = min(capacity[g], window)
        self.splits = [triton_decode.num_splits(rows, kv_heads, c) for c in capacity]
        for sizes in self.sizes:  # valid rows for the warm-up and the capture
            sizes[rows : 2 * rows] = 1
            sizes[2 * rows] = triton_decode.BLOCK_N
        self.attn = torch.zeros(
            (rows, cfg.num_heads, cfg.head_dim), dtype=runner.dtype, device=device
        )
        self.query_index = (
            torch.arange(rows, device=device)
            if samples is None
            else self.small[n_inputs : n_inputs + n_index]
        )
        self.q: list[torch.Tensor] = []
        self.tokens = torch.zeros(self.samples, dtype=torch.long, device=device)
        self.logits = torch.zeros((self.samples, 1), device=device)  # the head's, once run
        # The residual and the rotary tables one piece hands the next. Once captured, these hold
        # the tensors the previous graph writes on every replay, which the next graph reads.
        x: list[torch.Tensor] = []
        rope: list[torch.Tensor] = []
        caches, group_of = runner.kv_caches, runner.layer_group
        slots = [self.inputs[2 + g] for g in range(runner.num_groups)]
        last = cfg.num_layers - 1

        def first() -> None:
            h, cos, sin = model.embed(self.inputs[0], self.inputs[1])
            rope[:] = [cos, sin]
            q, h = model.pre_attention(0, h, cos, sin, caches[0], slots[group_of[0]])
            x[:] = [h]
            self._set_q(0, q)

        def middle(i: int) -> Piece:
            def piece() -> None:
                h, mlp_out = model.post_attention(i - 1, x[0], self.attn)
                q, h = model.pre_attention(
                    i, h, rope[0], rope[1], caches[i], slots[group_of[i]], mlp_out
                )
                x[:] = [h]
                self._set_q(i, q)

            return piece

        def final() -> None:
            h, mlp_out = model.post_attention(last, x[0], self.attn)
            self.logits = model.head(h, self.query_index, mlp_out)
            self.tokens = self.logits.argmax(dim=-1)

        parts: list[Piece] = [first, *(middle(i) for i in range(1, cfg.num_layers)), final]
        pieces = parts
        if self.full:

            def whole() -> None:
                for i, piece in enumerate(parts[:-1]):
                    piece()
                    g = group_of[i]
                    triton_decode.paged_decode_attention(
                        self.q[i],
                        caches[i],
                        self.tables[g],
                        self.sizes[g],
                        0,
                        splits=self.splits[g],
                        out=self.attn,
                    )
                parts[-1]()

            pieces = [whole]
        self.pieces = pieces
        if capture:
            self.pieces = self._capture(pieces, pool)

    def _set_q(self, i: int, q: torch.Tensor) -> None:
        if i < len(self.q):
            self.q[i] = q
        else:
            self.q.append(q)

    @staticmethod
    def _capture(pieces: list[Piece], pool: Any) -> list[Piece]:  # torch's pool type is private
        # One whole uncaptured pass on a side stream first: cuBLAS picks its algorithms and
        # lazily loaded modules load outside the capture, where either would fail. Then the
        # pieces are captured in order, so each graph reads the outputs the previous graph
        # captured (the warm-up's tensors are gone by then).
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for piece in pieces:
                piece()
        torch.cuda.current_stream().wait_stream(side)
        replays: list[Piece] = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the connector's copy and pinning threads keep calling CUDA while the
            # engine captures; "global" would fail their calls (or the capture) meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                piece()
            replays.append(graph.replay)
        return replays


def _host_like(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``'s shape, pinned when ``t`` is on a GPU (its copies are then async)."""
    host = torch.zeros(t.shape, dtype=t.dtype)
    return host.pin_memory() if t.device.type == "cuda" else host


class DecodeGraphs:
    """Runs decode-only steps of up to ``max_rows`` rows from per-bucket pieces, or, ``full``,
    each step as one graph with the Triton paged attention captured too."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_config: KVCacheConfig,
        kv_caches: Sequence[torch.Tensor],
        layer_group: Sequence[int],
        max_rows: int,
        *,
        capture: bool,
        paged_decode: bool = False,
        flash_if_equal: bool = False,
        full: bool = False,
        max_mixed_tokens: int = 0,
    ) -> None:
        if full and not paged_decode:
            raise ValueError("full decode graphs capture the Triton paged attention: none here")
        self.full = full
        self.model = model
        self.kv_config = kv_config
        self.kv_caches = list(kv_caches)
        self.layer_group = list(layer_group)
        self.num_groups = len(kv_config.groups)
        self.windows = [g.sliding_window for g in kv_config.groups]
        self.device = kv_caches[0].device
        self.dtype = kv_caches[0].dtype
        self.max_rows = max_rows
        self.captured = capture
        # Decode attention as the eager path runs it (``decode_segment``).
        self.paged_decode = paged_decode
        self.flash_if_equal = flash_if_equal
        self.steps_run = 0
        # Recorded after a step's copies from the pinned input buffers: a step scheduled ahead
        # writes them while the step before it may not have run its copies yet.
        self._staged: torch.cuda.Event | None = None
        pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, _Bucket] = {}
        self._mixed: dict[int, _Bucket] = {}
        self.mixed_steps_run = 0
        # Largest first, as vLLM does: smaller graphs then fit in the memory the largest freed.
        with torch.inference_mode():
            for tokens in reversed(mixed_bucket_sizes(max_mixed_tokens)):
                samples = min(max_rows, tokens)
                self._mixed[tokens] = _Bucket(self, tokens, capture, pool, samples=samples)
            for rows in reversed(bucket_sizes(max_rows)):
                self._buckets[rows] = _Bucket(self, rows, capture, pool, full=full)
        if capture:
            torch.cuda.synchronize(self.device)
        self._sizes = sorted(self._buckets)
        self._mixed_sizes = sorted(self._mixed)
        log.info(
            "decode_graphs_ready",
            buckets=self._sizes,
            mixed_buckets=self._mixed_sizes,
            pieces_per_bucket=1 if full else model.config.num_layers + 1,
            captured=capture,
            full=full,
        )

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` rows."""
        for size in self._sizes:
            if size >= rows:
                return size
        raise ValueError(f"{rows} decode rows exceed the largest bucket {self.max_rows}")

    def tables_fit(self, tables: Iterable[Sequence[Sequence[int]]]) -> bool:
        """Whether the rows' block tables (per row, per group) fit the full buckets' static
        tables (one column per cache block: a sliding-window group's table, null blocks
        included, can be longer; such steps run eagerly). Read only for full graphs."""
        if not self.full:
            return True
        width = self.kv_caches[0].shape[1]
        return all(len(t) <= width for row in tables for t in row)

    def mixed_bucket_for(self, tokens: int, samples: int) -> int | None:
        """The smallest mixed bucket that holds ``tokens`` tokens, or None: too many tokens
        (such steps are bound by the device, not by their launches) or sampled rows."""
        for size in self._mixed_sizes:
            if size >= tokens:
                return size if samples <= self._mixed[size].samples else None
        return None

    @torch.inference_mode()
    def run_mixed(
        self,
        size: int,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slot_mappings: Sequence[torch.Tensor],
        sample_at: Sequence[int],
        metadata: Sequence[AttentionMetadata],
        before_attention: Callable[[int], None] | None = None,
        patch: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens and float32 logits (rewritten by the bucket's next step) at the flat
        tokens ``sample_at`` of a step of any shape (prefill chunks
        and decode rows), from mixed bucket ``size`` (``mixed_bucket_for``): the pieces between
        the attention are replayed, the attention runs eagerly on ``metadata``, cache group
        ``g``'s tokens write to ``slot_mappings[g]`` (on the device); ``before_attention(i)``
        is called before layer ``i`` writes or reads its cache; ``patch`` writes tokens an
        earlier step samples into the token ids on the device. Padding tokens compute
        token 0 at position 0 into slot 0 of the null block, as padding decode rows do."""
        bucket = self._mixed[size]
        self.mixed_steps_run += 1
        self._reuse_staging()
        t, rows = len(token_ids), bucket.rows
        pad = [0] * (rows - t)
        host = [*token_ids, *pad, *positions, *pad]
        host += [0] * (self.num_groups * rows)
        host += [*sample_at, *([0] * (bucket.samples - len(sample_at)))]
        bucket.small_np[:] = host
        bucket.small.copy_(bucket.small_host, non_blocking=bucket.small.is_cuda)
        self._inputs_copied(bucket, patch)
        for g, slots in enumerate(slot_mappings):
            bucket.inputs[2 + g, :t].copy_(slots)
        caches, group_of = self.kv_caches, self.layer_group
        with sdpa_kernel(SDPA_BACKENDS):
            for i, piece in enumerate(bucket.pieces[:-1]):
                if before_attention is not None:
                    before_attention(i)  # piece ``i`` writes layer ``i``'s new keys and values
                piece()
                out = paged_attention(bucket.q[i][:t], caches[i], metadata[group_of[i]])
                bucket.attn[:t].copy_(out)
            bucket.pieces[-1]()
        n = len(sample_at)
        return bucket.tokens[:n], bucket.logits[:n]

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[Sequence[int]]],
        patch: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens of one decode step, ``(rows,)`` on the device, not yet waited for, and
        their float32 logits (rewritten by the bucket's next step).

        Row ``b`` computes token ``token_ids[b]`` at position ``num_computed[b]`` with block
        table ``block_tables[g][b]`` in cache group ``g``; ``patch`` writes tokens an earlier
        step samples into the token ids on the device.
        """
        b = len(token_ids)
        bucket = self._buckets[self.bucket_for(b)]
        self.steps_run += 1
        self._reuse_staging()
        pad = [0] * (bucket.rows - b)
        bs = self.kv_config.block_size
        host = [*token_ids, *pad, *num_computed, *pad]
        for tables in block_tables:
            host += [t[c // bs] * bs + c % bs for t, c in zip(tables, num_computed, strict=True)]
            host += pad
        if bucket.full:
            self._full_inputs(bucket, host, num_computed, block_tables)
            self._inputs_copied(bucket, patch)
            bucket.pieces[0]()
            return bucket.tokens[:b], bucket.logits[:b]
        n = bucket.inputs.numel()
        bucket.small_np[:n] = host
        bucket.inputs.copy_(
            bucket.small_host[:n].view(bucket.inputs.shape), non_blocking=bucket.small.is_cuda
        )
        self._inputs_copied(bucket, patch)
        segments = []
        for g, tables in enumerate(block_tables):
            segments.append(
                decode_segment(
                    block_table_tensor(tables, self.device),
                    num_computed,
                    self.windows[g],
                    bs,
                    bucket.query_index[:b],
                    paged=self.paged_decode,
                    flash_if_equal=self.flash_if_equal,
                )
            )
        pieces, caches, group_of = bucket.pieces, self.kv_caches, self.layer_group
        with sdpa_kernel(SDPA_BACKENDS):
            for i, piece in enumerate(pieces[:-1]):
                piece()
                out = decode_attention(bucket.q[i][:b], caches[i], segments[group_of[i]])
                bucket.attn[:b].copy_(out)
            pieces[-1]()
        return bucket.tokens[:b], bucket.logits[:b]

    def _reuse_staging(self) -> None:
        """Before a step writes the pinned input buffers: the last step's copies from them ran."""
        if self._staged is not None:
            self._staged.synchronize()

    def _inputs_copied(self, bucket: _Bucket, patch: Callable[[torch.Tensor], None] | None) -> None:
        """After a step's copies from the pinned input buffers are enqueued: mark them for
        ``_reuse_staging``, then write the tokens an earlier step samples (``patch``) over the
        copied token ids, in stream order before the pieces read them."""
        if self.device.type == "cuda":  # host buffers are copied synchronously
            if self._staged is None:
                self._staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._staged.record()
        if patch is not None:
            patch(bucket.inputs[0])

    def _full_inputs(
        self,
        bucket: _Bucket,
        host: list[int],
        num_computed: Sequence[int],
        block_tables: Sequence[Sequence[Sequence[int]]],
    ) -> None:
        """A full bucket's inputs for this step, copied without waiting (``_reuse_staging``
        keeps the next step from writing the pinned buffers before these copies ran).
        Padding rows attend to slot 0 of the null block, one key, as the padding writes it."""
        b, rows = len(num_computed), bucket.rows
        pad = rows - b
        for g, tables in enumerate(block_tables):
            firsts, counts = key_ranges(num_computed, self.windows[g])
            split = triton_decode.split_len_for(bucket.splits[g], max(counts))
            host += [*firsts, *([0] * pad), *counts, *([1] * pad), split]
            table_np, written = bucket.tables_np[g], bucket.tables_written[g]
            # Entries past a row's own table may be stale: its key count keeps them unread.
            for row, table in enumerate(tables):
                old = written[row]
                if table is not old:
                    # A running request's table only grows: when the row holds a prefix of it,
                    # only the new ids are written (the row then holds the table either way).
                    at = len(old) if old is not None and table[: len(old)] == old else 0
                    if at < len(table):
                        table_np[row, at : len(table)] = table[at:]
                    written[row] = table
            if pad:
                table_np[b:, 0] = 0
                written[b:] = [None] * pad
            bucket.tables[g].copy_(bucket.tables_host[g], non_blocking=True)
        bucket.small_np[:] = host
        bucket.small.copy_(bucket.small_host, non_blocking=True)


def layer_groups(kv_config: KVCacheConfig, num_layers: int) -> list[int]:
    """Cache group of each layer, by index."""
    group_of = kv_config.tensor_groups
    return [group_of[layer_name(i)] for i in range(num_layers)]


__all__ = [
    "MIXED_MAX_TOKENS",
    "DecodeGraphs",
    "bucket_sizes",
    "layer_groups",
    "mixed_bucket_sizes",
]
