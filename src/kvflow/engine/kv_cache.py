"""The paged KV cache on the device: tensors, attention metadata, and attention over block tables.

Each layer owns one FlashAttention-style tensor ``(2, num_blocks, block_size, num_kv_heads,
head_dim)`` named ``model.layers.{i}.self_attn`` (``kvflow.core.layout`` classifies it KV_FIRST).
Block 0 of every group is the null block: padding in block tables, never written with real data
that a query can see. A step's tokens are one flat batch; attention gathers keys and values by
block table and runs one SDPA for all single-token (decode) queries together and one per
multi-token (prefill) chunk, causal with the offset of the tokens already computed and, for
sliding-window groups, limited to the window (a half-precision chunk on a recent GPU calls the
flash kernel itself).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from attrs import frozen
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec
from kvflow.engine import triton_decode
from kvflow.errors import ConfigError

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""SDPA takes ``enable_gqa`` (grouped KV heads without copying them) from torch 2.5 on."""


_FLASH_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _flash_device(index: int) -> bool:
    """Whether the CUDA device runs the flash kernel (Ampere and later)."""
    return torch.cuda.get_device_capability(index)[0] >= 8


def _flash_fits(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """A chunk the flash kernel takes as it is: half precision on an Ampere or later GPU, a head
    size it supports with no padding, whole groups of query heads per KV head (grouped heads
    checked on torch 2.5 and later only)."""
    d = q.shape[-1]
    return (
        _SDPA_GQA
        and q.is_cuda
        and q.dtype in _FLASH_DTYPES
        and d % 8 == 0
        and d <= 256
        and q.shape[1] % keys.shape[1] == 0
        and _flash_device(q.device.index or 0)
    )


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def kv_cache_groups(num_layers: int, windows: Sequence[int | None]) -> tuple[KVCacheGroupSpec, ...]:
    """Full-attention layers form group 0; layers sharing one sliding window form the next."""
    if len(windows) != num_layers:
        raise ConfigError(f"{len(windows)} layer windows for {num_layers} layers")
    order: list[int | None] = []
    for w in windows:
        if w not in order:
            order.append(w)
    order.sort(key=lambda w: (w is not None, w or 0))
    return tuple(
        KVCacheGroupSpec(
            group_id=g,
            layer_names=[layer_name(i) for i in range(num_layers) if windows[i] == w],
            sliding_window=w,
        )
        for g, w in enumerate(order)
    )


def allocate_kv_caches(
    kv_config: KVCacheConfig,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """One zeroed tensor per layer; zeros keep masked-out null-block values finite in SDPA."""
    shape = (2, kv_config.num_blocks, kv_config.block_size, num_kv_heads, head_dim)
    names = sorted(
        (name for g in kv_config.groups for name in g.layer_names),
        key=lambda n: int(n.split(".")[2]),
    )
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name in names}


def poison_value(dtype: torch.dtype) -> float | int:
    """What a freed block is overwritten with: NaN for floating point (any read of it turns
    attention's output, then the token, wrong), the dtype's largest value otherwise."""
    if dtype.is_floating_point:
        return float("nan")
    return int(torch.iinfo(dtype).max)


def poison_blocks(kv_caches: dict[str, torch.Tensor], block_ids: Sequence[int]) -> None:
    """Overwrite ``block_ids`` in every layer's ``(2, num_blocks, ...)`` tensor with the poison
    value: the engine's poison-on-free mode, so a use after free shows as wrong output."""
    if not block_ids:
        return
    for t in kv_caches.values():
        idx = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        t.index_fill_(1, idx, poison_value(t.dtype))


@frozen
class DecodeSegment:
    """The step's single-token queries, batched: row ``b`` is flat token ``query_index[b]``.

    Keys are padded to the longest row; ``mask[b, 0, 0, k]`` says whether key ``k`` is real,
    and is ``None`` when every row has as many keys as the longest (nothing padded).
    """

    query_index: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor | None


@frozen
class PagedDecode:
    """The step's decode rows for ``kvflow.engine.triton_decode``: keys stay in the cache.

    Row ``b`` (flat token ``query_index[b]``) attends to ``sizes[1, b]`` keys from position
    ``sizes[0, b]`` on, through block table ``tables[b]``; ``max_keys`` is the largest count.
    """

    query_index: torch.Tensor
    tables: torch.Tensor
    sizes: torch.Tensor
    max_keys: int


@frozen
class PrefillSegment:
    """One request's multi-token chunk: flat tokens ``[start, stop)`` over keys ``key_slots``.

    ``mask`` is ``None`` when the chunk sees every key up to itself (causal, aligned to the last
    key), which SDPA takes as a lower-right causal bias without materialising scores' masks.
    """

    start: int
    stop: int
    key_slots: torch.Tensor
    mask: torch.Tensor | None


@frozen
class VarlenPrefill:
    """Every prefill chunk of a step as one variable-length batch, for one attention call per
    layer instead of one per chunk: the chunks' queries are flat tokens ``queries`` (a slice
    when they are contiguous in the step), their keys ``key_slots`` chunk after chunk; chunk
    ``i`` has queries ``[cu_q[i], cu_q[i + 1])`` and keys ``[cu_k[i], cu_k[i + 1])`` of those
    (``bounds`` holds the same on the host), causal to its last key."""

    queries: slice | torch.Tensor
    key_slots: torch.Tensor
    cu_q: torch.Tensor  # int32, on the device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    bounds: tuple[tuple[int, int, int, int], ...]  # (q start, q stop, k start, k stop)


@frozen
class AttentionMetadata:
    """One step's attention inputs for one KV cache group (shared by all its layers).

    ``slot_mapping[t]``: flat cache slot (block * block_size + offset) where token ``t`` writes.
    Attention runs per segment: one batched call for all single-token (decode) queries, one call
    per multi-token (prefill) chunk. Padding every request to the longest query and key length
    instead would make a 4k-token chunk batched with decodes cost as if every decode were a 4k
    chunk too.
    """

    slot_mapping: torch.Tensor
    num_tokens: int
    decode: DecodeSegment | PagedDecode | None
    prefills: tuple[PrefillSegment, ...]
    varlen: VarlenPrefill | None = None  # the prefills as one batch (``varlen_prefill``)


def _key_start(computed: int, window: int | None) -> int:
    return 0 if window is None else max(0, computed - window + 1)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host wait: to a GPU through pinned memory, copied
    asynchronously (a copy from pageable memory makes torch synchronize the stream, which would
    wait for the step in flight when the engine schedules ahead)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def long_tensor(values: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``values`` as an int64 tensor (on ``device`` by ``to_device``; None: the host), through
    numpy: it takes a list of ints several times faster than ``torch.tensor`` does."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host if device is None else to_device(host, device)


def block_table_host(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """The requests' block tables as one ``(B, longest)`` host tensor, padded with the null
    block; built in one host list."""
    b = len(block_tables)
    width = max(1, max(len(t) for t in block_tables))
    flat = [0] * (b * width)
    for i, t in enumerate(block_tables):
        flat[i * width : i * width + len(t)] = t
    return long_tensor(flat).view(b, width)


def block_table_tensor(block_tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``block_table_host`` on ``device``, copied once."""
    return to_device(block_table_host(block_tables), device)


def key_ranges(num_computed: Sequence[int], window: int | None) -> tuple[list[int], list[int]]:
    """Decode rows' keys: the first key position of each row computing position
    ``num_computed[b]`` (its window's start), and how many keys it attends to."""
    firsts = [_key_start(c, window) for c in num_computed]
    return firsts, [c + 1 - f for c, f in zip(num_computed, firsts, strict=True)]


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_scheduled: Sequence[int],
    block_size: int,
    window: int | None,
    device: torch.device,
    *,
    paged_decode: bool = False,
    flash_if_equal: bool = False,
    varlen: bool = False,
) -> AttentionMetadata:
    """Metadata for requests whose new tokens are contiguous and in order in the flat batch.

    Request ``b`` computes positions ``[num_computed[b], num_computed[b] + num_scheduled[b])``;
    its block table must cover them, and (sliding window) every block inside the window.
    ``paged_decode``: decode rows for the Triton kernel (``PagedDecode``), not gathered keys
    (see ``decode_segment`` for ``flash_if_equal``); ``varlen``: two or more unmasked prefill
    chunks also as one batch (``VarlenPrefill``), which ``paged_attention`` runs as one flash
    call per layer where the flash kernel takes them.
    """
    b = len(block_tables)
    if not b == len(num_computed) == len(num_scheduled):
        raise ConfigError("block_tables, num_computed and num_scheduled differ in length")
    for i, t in enumerate(block_tables):
        if len(t) * block_size < num_computed[i] + num_scheduled[i]:
            raise ConfigError(
                f"request {i}: block table of {len(t)} blocks cannot hold "
                f"{num_computed[i] + num_scheduled[i]} tokens"
            )
    # Every index is computed on the host (numpy) and the lot goes to the device in one copy:
    # built from torch ops, the same took some fifty small kernels a step, each a launch.
    tables = block_table_host(block_tables).numpy()
    c_all = np.asarray(num_computed, dtype=np.int64)
    n_all = np.asarray(num_scheduled, dtype=np.int64)
    total = int(n_all.sum())
    starts = np.cumsum(n_all) - n_all
    req = np.repeat(np.arange(b), n_all)
    positions = c_all[req] + np.arange(total) - starts[req]
    pieces = [tables[req, positions // block_size] * block_size + positions % block_size]
    chunks: list[tuple[int, int, int, int]] = []  # (request, first key, key count, offset)
    for i in np.flatnonzero(n_all > 1).tolist():
        c, n = num_computed[i], num_scheduled[i]
        first = _key_start(c, window)
        k_pos = np.arange(first, c + n)
        pieces.append(tables[i, k_pos // block_size] * block_size + k_pos % block_size)
        chunks.append((i, first, c + n - first, int(starts[i])))
    decode_rows = np.flatnonzero(n_all == 1)
    if decode_rows.size:
        pieces += [tables[decode_rows].ravel(), starts[decode_rows]]
    flat = to_device(torch.from_numpy(np.concatenate(pieces)), device)
    slot_mapping = flat[:total]
    at = total
    prefills: list[PrefillSegment] = []
    for i, first, keys, offset in chunks:
        c, n = num_computed[i], num_scheduled[i]
        mask: torch.Tensor | None = None
        if window is not None and c + n > window:
            q_pos = torch.arange(c, c + n, device=device)[:, None]
            k_pos_t = torch.arange(first, c + n, device=device)[None, :]
            mask = ((k_pos_t <= q_pos) & (k_pos_t > q_pos - window))[None, None]
        prefills.append(
            PrefillSegment(
                start=offset, stop=offset + n, key_slots=flat[at : at + keys][None], mask=mask
            )
        )
        at += keys
    prefill_keys = flat[total:at]
    decode: DecodeSegment | PagedDecode | None = None
    if decode_rows.size:
        rows, width = decode_rows.size, tables.shape[1]
        decode = decode_segment(
            flat[at : at + rows * width].view(rows, width),
            c_all[decode_rows].tolist(),
            window,
            block_size,
            flat[at + rows * width : at + rows * width + rows],
            paged=paged_decode,
            flash_if_equal=flash_if_equal,
        )
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_tokens=total,
        decode=decode,
        prefills=tuple(prefills),
        varlen=varlen_prefill(prefills, prefill_keys, device) if varlen else None,
    )


def varlen_prefill(
    prefills: Sequence[PrefillSegment], key_slots: torch.Tensor, device: torch.device
) -> VarlenPrefill | None:
    """The chunks as one batch, or None: fewer than two, or one with a mask (a sliding window
    that cuts its keys), which the batch's causal mask cannot express. ``key_slots``: the
    chunks' key slots one after another on the device (each chunk's are a view of them)."""
    if len(prefills) < 2 or any(p.mask is not None for p in prefills):
        return None
    bounds: list[tuple[int, int, int, int]] = []
    cu_q, cu_k = [0], [0]
    for p in prefills:
        q0, k0 = cu_q[-1], cu_k[-1]
        cu_q.append(q0 + p.stop - p.start)
        cu_k.append(k0 + p.key_slots.shape[-1])
        bounds.append((q0, cu_q[-1], k0, cu_k[-1]))
    contiguous = all(a.stop == b.start for a, b in itertools.pairwise(prefills))
    queries: slice | torch.Tensor = (
        slice(prefills[0].start, prefills[-1].stop)
        if contiguous
        else long_tensor([t for p in prefills for t in range(p.start, p.stop)], device)
    )
    cu = to_device(torch.tensor([cu_q, cu_k], dtype=torch.int32), device)
    return VarlenPrefill(
        queries=queries,
        key_slots=key_slots,
        cu_q=cu[0],
        cu_k=cu[1],
        max_q=max(b[1] - b[0] for b in bounds),
        max_k=max(b[3] - b[2] for b in bounds),
        bounds=tuple(bounds),
    )


def _varlen_attention(q: torch.Tensor, cache: torch.Tensor, v: VarlenPrefill) -> torch.Tensor:
    """The batch's queries ``(total_q, heads, D)`` over their keys, as ``(total_q, heads, D)``:
    one flash call where the kernel takes them (its causal mask aligned to each chunk's last
    key, as for one chunk), else chunk by chunk as ``paged_attention`` runs them."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    both = cache.view(2, -1, kv_heads, head_dim)[:, v.key_slots]  # one gather for every chunk
    keys, values = both[0], both[1]
    if _flash_fits(q[None].transpose(1, 2), keys[None].transpose(1, 2)):
        flash = torch.ops.aten._flash_attention_forward
        out: torch.Tensor = flash(
            q, keys, values, v.cu_q, v.cu_k, v.max_q, v.max_k, 0.0, True, False
        )[0]
        return out
    parts = [
        _prefill_attention(
            q[q0:q1].transpose(0, 1)[None],
            keys[k0:k1].transpose(0, 1)[None],
            values[k0:k1].transpose(0, 1)[None],
            None,
        )[0].transpose(0, 1)
        for q0, q1, k0, k1 in v.bounds
    ]
    return torch.cat(parts)


def decode_segment(
    tables: torch.Tensor,
    num_computed: Sequence[int],
    window: int | None,
    block_size: int,
    query_index: torch.Tensor,
    *,
    paged: bool = False,
    flash_if_equal: bool = False,
) -> DecodeSegment | PagedDecode:
    """The decode rows' keys: row ``b`` has block table ``tables[b]`` (on the device) and
    computes position ``num_computed[b]``, its query at flat token ``query_index[b]``.
    ``paged``: for the Triton kernel, which reads the keys in place, except, with
    ``flash_if_equal`` (half precision), rows of equal length: unmasked, SDPA runs flash."""
    b, width = tables.shape
    firsts, key_counts = key_ranges(num_computed, window)
    k_max = max(key_counts)
    if paged and not (flash_if_equal and min(key_counts) == k_max):
        sizes = to_device(torch.tensor([firsts, key_counts], dtype=torch.int32), tables.device)
        return PagedDecode(query_index, tables, sizes, k_max)
    # One copy to the device for both columns: each copy is a launch and a host wait.
    both = long_tensor([*num_computed, *firsts], tables.device)
    ctx, first = both[:b], both[b:]
    k_pos = first[:, None] + torch.arange(k_max, device=tables.device)[None, :]
    k_valid = k_pos <= ctx[:, None]
    k_blk = (k_pos // block_size).clamp(max=width - 1)
    key_slots = torch.where(k_valid, tables.gather(1, k_blk) * block_size + k_pos % block_size, 0)
    return DecodeSegment(
        query_index=query_index,
        key_slots=key_slots,
        mask=None if min(key_counts) == k_max else k_valid[:, None, None, :],
    )


def write_kv(
    cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the step's keys/values ``(T, kv_heads, head_dim)`` into their cache slots."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(cache.dtype))
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(cache.dtype))


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` ``(B, K)`` as ``(B, kv_heads, K, head_dim)``, in one gather."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    both = cache.view(2, -1, kv_heads, head_dim)[:, slots].permute(0, 1, 3, 2, 4)
    return both[0], both[1]


def _prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One chunk ``(1, heads, Q, D)`` over its keys ``(1, kv_heads, K, D)``."""
    if mask is None and _flash_fits(q, keys):
        # What SDPA runs for a lower-right causal bias in half precision, called directly: its
        # dispatch (the bias object, input checks, the kernel choice) and the copies of K and V
        # expanded to every query head were most of a chunk's host time (docs/benchmarks.md,
        # twenty-sixth session); the flash kernel takes grouped KV heads as they are, and its
        # causal mask is aligned to the last key.
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        out_flash: torch.Tensor = flash(q, keys, values, 0.0, is_causal=True)[0]
        return out_flash
    rep = q.shape[1] // keys.shape[1]
    if q.device.type != "cpu" or not _SDPA_GQA:
        # On CUDA, expanded heads keep SDPA on its memory-efficient kernel; enable_gqa there
        # may fall back to the math kernel, which materialises every score.
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        rep = 1
    gqa = {"enable_gqa": True} if rep > 1 else {}
    if mask is None:
        bias = causal_lower_right(q.shape[2], keys.shape[2])
        out: torch.Tensor = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, **gqa)
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **gqa)
    return out


def decode_attention(
    rows: torch.Tensor, cache: torch.Tensor, d: DecodeSegment | PagedDecode
) -> torch.Tensor:
    """The decode rows' queries ``(B, heads, D)`` over their keys, as ``(B, heads, D)``."""
    if isinstance(d, PagedDecode):
        return triton_decode.paged_decode_attention(rows, cache, d.tables, d.sizes, d.max_keys)
    kv_heads = cache.shape[3]
    b, heads, head_dim = rows.shape
    keys, values = _gather(cache, d.key_slots)
    # Each KV head's query heads become that head's queries: grouped-query decode as one SDPA
    # over (rows, kv_heads, rep, D) without repeating keys or values.
    queries = rows.view(b, kv_heads, heads // kv_heads, head_dim)
    # Kernel choice, from decode timings on the H200 (docs/benchmarks.md): the fused masked
    # kernel gives each (row, KV head) one thread block that walks every key, a handful of busy
    # SMs for a few long rows (0.86 ms bf16, 1.98 ms fp32 at one row of 16k keys). Unpadded
    # half-precision rows need no mask and get flash attention's split-key kernel (0.17 ms);
    # a few float32 rows are fastest as matmul-softmax-matmul (0.66 ms), which spreads the keys
    # over the GPU; many rows keep the fused kernel, which is then busy enough.
    if d.mask is None and rows.dtype in (torch.float16, torch.bfloat16):
        out = F.scaled_dot_product_attention(queries, keys, values)
    elif rows.device.type == "cuda" and rows.dtype == torch.float32 and b <= 4:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=d.mask)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=d.mask)
    return out.reshape(b, heads, head_dim)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of the flat queries ``(T, heads, head_dim)`` over the paged cache."""
    d = meta.decode
    if not meta.prefills and d is not None:
        # Every token is a decode row, in order: no gather of queries, no scatter of outputs.
        return decode_attention(q, cache, d)
    if d is None and len(meta.prefills) == 1:
        seg = meta.prefills[0]
        keys, values = _gather(cache, seg.key_slots)
        out = _prefill_attention(q[None].transpose(1, 2), keys, values, seg.mask)
        only: torch.Tensor = out[0].transpose(0, 1)
        return only
    v = meta.varlen
    if v is not None:
        out = _varlen_attention(q[v.queries], cache, v)
        if d is None and isinstance(v.queries, slice) and out.shape[0] == q.shape[0]:
            return out
        result = torch.empty_like(q)
        result[v.queries] = out
        if d is not None:
            result[d.query_index] = decode_attention(q[d.query_index], cache, d)
        return result
    result = torch.empty_like(q)
    for seg in meta.prefills:
        keys, values = _gather(cache, seg.key_slots)
        out = _prefill_attention(
            q[seg.start : seg.stop][None].transpose(1, 2), keys, values, seg.mask
        )
        result[seg.start : seg.stop] = out[0].transpose(0, 1)
    if d is not None:
        result[d.query_index] = decode_attention(q[d.query_index], cache, d)
    return result


__all__ = [
    "AttentionMetadata",
    "DecodeSegment",
    "PagedDecode",
    "PrefillSegment",
    "VarlenPrefill",
    "allocate_kv_caches",
    "block_table_host",
    "block_table_tensor",
    "build_attention_metadata",
    "decode_attention",
    "decode_segment",
    "key_ranges",
    "kv_cache_groups",
    "layer_name",
    "long_tensor",
    "paged_attention",
    "to_device",
    "varlen_prefill",
    "write_kv",
]
