"""The paged KV cache on the device: tensors, attention metadata, and attention over block tables.

Each layer owns one FlashAttention-style tensor ``(2, num_blocks, block_size, num_kv_heads,
head_dim)`` named ``model.layers.{i}.self_attn`` (``kvflow.core.layout`` classifies it KV_FIRST).
Block 0 of every group is the null block: padding in block tables, never written with real data
that a query can see. A step's tokens are one flat batch; attention gathers each request's keys
and values by block table into a padded batch and runs one masked SDPA per layer, with the causal
mask offset by the tokens already computed (chunked prefill) and, for sliding-window groups,
limited to the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from attrs import frozen

from kvflow.connector.api import KVCacheConfig, KVCacheGroupSpec
from kvflow.errors import ConfigError

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
"""SDPA takes ``enable_gqa`` (grouped KV heads without copying them) from torch 2.5 on."""


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


@frozen
class AttentionMetadata:
    """One step's attention inputs for one KV cache group (shared by all its layers).

    ``slot_mapping[t]``: flat cache slot (block * block_size + offset) where token ``t`` writes.
    ``key_slots[b, k]``: slot of request ``b``'s ``k``-th visible key (0 past its end).
    ``query_index[b, q]``: flat token index of request ``b``'s ``q``-th query (valid where
    ``query_valid``); ``mask[b, 0, q, k]``: may query ``q`` see key ``k``.
    """

    slot_mapping: torch.Tensor
    key_slots: torch.Tensor
    query_index: torch.Tensor
    query_valid: torch.Tensor
    mask: torch.Tensor


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    num_scheduled: Sequence[int],
    block_size: int,
    window: int | None,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for requests whose new tokens are contiguous and in order in the flat batch.

    Request ``b`` computes positions ``[num_computed[b], num_computed[b] + num_scheduled[b])``;
    its block table must cover them, and (sliding window) every block inside the window.
    """
    b = len(block_tables)
    if not b == len(num_computed) == len(num_scheduled):
        raise ConfigError("block_tables, num_computed and num_scheduled differ in length")
    width = max(1, max(len(t) for t in block_tables))
    tables = torch.zeros((b, width), dtype=torch.long)
    for i, t in enumerate(block_tables):
        if t:
            tables[i, : len(t)] = torch.tensor(list(t), dtype=torch.long)
    tables = tables.to(device)
    c = torch.tensor(list(num_computed), dtype=torch.long, device=device)
    n = torch.tensor(list(num_scheduled), dtype=torch.long, device=device)
    end = c + n
    offsets = torch.cumsum(n, 0) - n
    # Sizes come from the Python lists: reading them off the device would sync every step.
    total = sum(num_scheduled)
    req = torch.repeat_interleave(torch.arange(b, device=device), n)
    positions = c[req] + torch.arange(total, device=device) - offsets[req]
    slot_mapping = tables[req, positions // block_size] * block_size + positions % block_size

    q_max = max(1, *num_scheduled)
    q_ar = torch.arange(q_max, device=device)
    query_valid = q_ar[None, :] < n[:, None]
    query_index = torch.where(query_valid, offsets[:, None] + q_ar[None, :], 0)
    q_pos = c[:, None] + q_ar[None, :]

    start = torch.zeros_like(c) if window is None else (c - window + 1).clamp(min=0)
    k_max = max(
        1,
        *(
            cc + nn - (0 if window is None else max(0, cc - window + 1))
            for cc, nn in zip(num_computed, num_scheduled, strict=True)
        ),
    )
    k_ar = torch.arange(k_max, device=device)
    k_pos = start[:, None] + k_ar[None, :]
    k_valid = k_pos < end[:, None]
    k_blk = (k_pos // block_size).clamp(max=width - 1)
    key_slots = torch.where(k_valid, tables.gather(1, k_blk) * block_size + k_pos % block_size, 0)
    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    # A padded query row must see something or SDPA returns NaN; its output is discarded.
    mask |= (~query_valid)[:, :, None] & (k_ar == 0)[None, None, :]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        key_slots=key_slots,
        query_index=query_index,
        query_valid=query_valid,
        mask=mask[:, None, :, :],
    )


def write_kv(
    cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the step's keys/values ``(T, kv_heads, head_dim)`` into their cache slots."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(cache.dtype))
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(cache.dtype))


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Attention of the flat queries ``(T, heads, head_dim)`` over the paged cache."""
    kv_heads, head_dim = cache.shape[3], cache.shape[4]
    rep = q.shape[1] // kv_heads
    keys = cache[0].view(-1, kv_heads, head_dim)[meta.key_slots]  # (B, K, kv_heads, D)
    values = cache[1].view(-1, kv_heads, head_dim)[meta.key_slots]
    keys = keys.permute(0, 2, 1, 3)
    values = values.permute(0, 2, 1, 3)
    queries = q[meta.query_index].permute(0, 2, 1, 3)  # (B, heads, Q, D)
    # On CUDA, expanded heads keep SDPA on its memory-efficient masked kernel; enable_gqa with
    # a mask may fall back to the math kernel, which materialises every score.
    if _SDPA_GQA and q.device.type == "cpu":
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.mask, enable_gqa=rep > 1
        )
    else:
        keys = keys.repeat_interleave(rep, dim=1)
        values = values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask)
    result: torch.Tensor = out.permute(0, 2, 1, 3)[meta.query_valid]
    return result


__all__ = [
    "AttentionMetadata",
    "allocate_kv_caches",
    "build_attention_metadata",
    "kv_cache_groups",
    "layer_name",
    "paged_attention",
    "write_kv",
]
