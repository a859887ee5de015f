"""The one mask builder: which buffer columns each row of a forward may attend to.

A forward carries rows of one or more requests: tree nodes, side-block tokens, prompt chunks. Each
row sees

* its own region's committed tokens (columns ``[start, start + length)`` of the store), inside the
  sliding window where the layer has one (the token in slot ``start + i`` sits at position ``i``);
* among the forward's new rows, those of its own segment that its segment allows: its ancestors
  and itself in a tree (an explicit block from the host), or every row at an earlier or equal
  position in a prompt chunk (causal, computed here).

Everything is computed on the device from per-row numbers (positions, region start and length,
segment id) and the tree rows' block: the host uploads O(rows) values plus the trees' blocks,
never a row per cached position. One function covers a tree step, a prompt chunk, a batch of
both and sliding windows, for one request or many.

Masks are returned as transformers takes them: a bool ``[1, 1, rows, columns]`` for ``sdpa``-like
attention, an additive float mask for ``eager`` (a bool mask there is silently wrong), and a dict
keyed by layer type for models that mix full and sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .flash_kernels import FlashLayout


@dataclass(frozen=True)
class RowLayout:
    """Per row of a forward (device tensors, one entry per row): its absolute position, the first
    column and committed length of its request's region, its segment, and the column it is
    written to; ``tree_rows`` and ``tree_block`` give the tree rows' own block (block-diagonal
    over their segments), ``None`` when the forward carries no tree."""

    positions: torch.Tensor
    region_start: torch.Tensor
    region_length: torch.Tensor
    segment: torch.Tensor
    write_columns: torch.Tensor
    tree_rows: torch.Tensor | None
    tree_block: torch.Tensor | None

    #: ``allowed[row, other]`` (bool, on the device) among the forward's own rows, before any
    #: sliding window: a tree row sees its ancestors and itself (the host's block), a prompt
    #: chunk's row the rows of its segment at earlier or equal positions. Made once per forward
    #: (the mask and the flash split's layout both read it, and never write it).
    new_rows: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        positions = self.positions
        new = (self.segment[:, None] == self.segment[None, :]) & (positions[None, :] <= positions[:, None])
        if self.tree_rows is not None:
            new[self.tree_rows[:, None], self.tree_rows[None, :]] = self.tree_block
        object.__setattr__(self, "new_rows", new)


def allowed_columns(layout: RowLayout, width: int, window: int | None) -> torch.Tensor:
    """``allowed[row, column]`` (bool, on the device) for a forward whose attention reads the
    first ``width`` buffer columns (see the module docstring)."""
    positions = layout.positions
    columns = torch.arange(width, device=positions.device)
    start = layout.region_start[:, None]
    allowed = (columns[None, :] >= start) & (columns[None, :] < start + layout.region_length[:, None])
    new_rows = layout.new_rows
    if window is not None:
        allowed &= (positions[:, None] - (columns[None, :] - start)) < window
        new_rows = new_rows & ((positions[:, None] - positions[None, :]) < window)
    allowed.index_copy_(1, layout.write_columns, new_rows)
    return allowed


def model_mask(allowed: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` as a 4D mask of ``kind`` ("bool" or "additive" in ``dtype``)."""
    allowed = allowed[None, None]
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def layer_masks(layout: RowLayout, width: int, windows: dict[str, int | None], kind: str, dtype: torch.dtype):
    """The mask argument of the model's forward: one 4D mask, or a dict by layer type when the
    model mixes full and sliding-window layers (``windows``: layer type -> window or ``None``;
    the key ``""`` means every layer alike)."""
    masks = {name: model_mask(allowed_columns(layout, width, window), kind, dtype) for name, window in windows.items()}
    return masks[""] if set(masks) == {""} else masks


def visible(mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Read back by an attention function: which of the ``kv_len`` key columns each of the ``q_len``
    query rows may attend to (bool ``[B or 1, 1, q, kv]``), from a 4D bool or additive ``mask``
    whose last ``kv_len`` columns are the keys'. Without a mask the rows are the last ``q_len``
    positions of a causal sequence over the ``kv_len`` columns."""
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        return (torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None])[None, None]
    mask = mask[..., -kv_len:]
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def flash_layout(layout: RowLayout, spans: Sequence[tuple[int, int, int, int]] | None = None) -> FlashLayout:
    """The flash split's layout of a forward (:class:`~specdraft.model.flash_kernels.FlashLayout`);
    ``spans``: the plan's ``(row_start, row_end, first_column, end_column)`` per segment, whose
    committed part ends where the segment's own rows begin."""
    committed = None if spans is None else [(r0, r1, c0, c1 - (r1 - r0)) for r0, r1, c0, c1 in spans]
    return FlashLayout(layout.region_start, layout.region_length, layout.segment, layout.write_columns,
                       layout.new_rows, committed)
