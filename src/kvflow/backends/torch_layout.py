"""torch tensors ↔ kvflow layouts: describe KV tensors for ``core.layout`` and view regions as bytes.

``core`` never imports torch, so backends turn the engine's tensors into ``TensorDesc`` here, and
use ``region_view`` to address one region's pages as a ``(num_blocks, page_bytes)`` uint8 view that
shares the tensor's memory (for host copies and staged GPU gathers).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvflow.core.layout import KVLayout, Region, TensorDesc, derive_layout
from kvflow.errors import LayoutError


def describe(name: str, tensor: object) -> TensorDesc:
    """The ``TensorDesc`` of one torch tensor; a non-tensor raises ``LayoutError`` naming it."""
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    return TensorDesc(
        name=name,
        shape=tensor.shape,
        strides=tensor.stride(),
        itemsize=tensor.element_size(),
        data_ptr=tensor.data_ptr(),
        device=str(tensor.device),
        dtype=str(tensor.dtype).removeprefix("torch."),
    )


def describe_all(tensors: Mapping[str, object]) -> dict[str, TensorDesc]:
    """``describe`` every tensor of a name → tensor mapping, keeping its order."""
    return {name: describe(name, t) for name, t in tensors.items()}


def layout_of(
    tensors: Mapping[str, object],
    num_blocks: int | Mapping[int, int],
    groups: Mapping[str, int] | None = None,
    device: str | None = None,
) -> KVLayout:
    """``derive_layout`` over torch tensors."""
    return derive_layout(describe_all(tensors), num_blocks, groups, device)


def region_view(tensor: torch.Tensor, region: Region) -> torch.Tensor:
    """A ``(num_blocks, page_bytes)`` uint8 view of ``region``'s pages, sharing ``tensor``'s memory."""
    storage = tensor.untyped_storage()
    offset = tensor.storage_offset() * tensor.element_size() + region.offset_bytes
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(
        storage, offset, (region.num_blocks, region.page_bytes), (region.block_stride_bytes, 1)
    )
    return view


__all__ = ["describe", "describe_all", "layout_of", "region_view"]
