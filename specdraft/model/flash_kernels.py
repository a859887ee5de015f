"""The prefix half of the flash split: every new row against its own request's committed tokens.

Why a layout instead of the mask
    In a forward over the KV store (:mod:`specdraft.model.kv_store`) the new rows are written into
    their regions, and in a captured forward the keys handed to attention span the store's whole
    capacity. Read from a 4D mask, "the cached prefix" is then not a slice a flash kernel can take.
    The runner knows it exactly, though: row ``r`` sees the committed columns
    ``[region_start[r], region_start[r] + region_length[r])`` whole (no mask inside: every tree
    node and every row of a prompt chunk sees all of its request's committed tokens), plus some of
    the forward's own new rows. :class:`FlashLayout` carries that to the attention function, so the
    prefix goes to a flash kernel and only the new rows among themselves need a (tiny) mask.

Three kernels for the same arithmetic, chosen per call (:func:`prefix_attention`):

* **FlashAttention 4** (``flash-attn-4``, the CuTe DSL package ``flash_attn.cute``; Hopper and
  Blackwell, and Ampere through its SM80 path) on CUDA in float16/bfloat16: one variable-length
  call per layer. Each segment of the forward is a sequence; its keys start at its region's first
  column (``cu_seqlens_k``) and run for its committed length (``seqused_k``), so the keys are read
  in place from the store. Every input is a device tensor and every shape is fixed by the
  forward's row count: the call is captured in the bucket's CUDA graph like the rest.
* **per segment, on the host's spans** (eager forwards): torch's own flash kernel on a CPU, or
  flash-attn 2 (``flash_attn_func``) on CUDA, over each segment's slice of the store.
* **dense** (anywhere, graph-safe): the same visible columns as a masked float32 product. It is the
  reference, and what runs where no flash kernel can (float32 on CUDA, flash-attn 2 inside a graph).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Sequence

import torch


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here; the message says what is missing."""


#: The forward keyword that carries a :class:`FlashLayout` to the attention function.
FLASH_LAYOUT_KEYWORD = "specdraft_flash_layout"

#: Data types FlashAttention's CUDA kernels take.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashLayout:
    """Where a forward's rows find their keys (device tensors, one entry per row unless noted).

    ``region_start`` / ``region_length``: the first column and committed length of the row's
    request's region; ``segment``: the row's segment (non-decreasing, ``0 .. n-1``);
    ``write_columns``: the column the row is written to; ``new_allowed[row, other]``: which of the
    forward's rows the row sees (its tree ancestors and itself, or the earlier rows of its prompt
    chunk); ``spans``: per segment on the host ``(row_start, row_end, first_column,
    committed_end)``, or ``None`` inside a captured forward."""

    region_start: torch.Tensor
    region_length: torch.Tensor
    segment: torch.Tensor
    write_columns: torch.Tensor
    new_allowed: torch.Tensor
    spans: Sequence[tuple[int, int, int, int]] | None = None

    @functools.cached_property
    def fa4_sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`fa4_sequences` of this layout, made at the first layer and shared by the rest
        (every layer of a forward reads the same layout)."""
        return fa4_sequences(self, self.segment.shape[0])


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # (a parent package that is missing or not a package)
        return False


def fa2_available() -> bool:
    """Whether flash-attn 2 (``flash_attn.flash_attn_interface``) is importable. ``flash-attn-4``
    alone installs ``flash_attn`` as a namespace holding only ``cute``, so the package name says
    nothing."""
    return _importable("flash_attn.flash_attn_interface")


def fa4_available() -> bool:
    """Whether FlashAttention 4 (``flash-attn-4``: ``flash_attn.cute``) is importable."""
    return _importable("flash_attn.cute")


def cpu_flash_available() -> bool:
    """Whether this torch build has its CPU flash kernel that returns the log-sum-exp."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def fa4_runs(query: torch.Tensor) -> bool:
    """Whether FlashAttention 4 takes this query: CUDA, float16/bfloat16, the package installed."""
    return query.is_cuda and query.dtype in FLASH_DTYPES and fa4_available()


def _fa4_varlen() -> Any:
    """FlashAttention 4's variable-length entry point (imported at first use: it compiles kernels)."""
    from flash_attn.cute import flash_attn_varlen_func  # type: ignore[import-not-found]

    return flash_attn_varlen_func


def flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-kernel call of ``q`` ``[B, H, n, D]`` over ``k`` / ``v`` ``[B, Hkv, m, D]`` (their
    heads repeated for the query's, :func:`shared_heads`): ``(out, lse)``, lse ``[B, H, n]``.
    flash-attn 2 or FlashAttention 4 on CUDA, torch's CPU kernel elsewhere."""
    k, v = shared_heads(k, q.shape[1]), shared_heads(v, q.shape[1])
    if q.is_cuda:
        if fa2_available():
            from flash_attn import flash_attn_func  # type: ignore[import-not-found]

            out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          softmax_scale=scale, causal=causal, return_attn_probs=True)
            return out.transpose(1, 2), lse[..., : q.shape[2]]
        if fa4_runs(q):
            from flash_attn.cute import flash_attn_func as fa4_func  # type: ignore[import-not-found]

            out, lse = fa4_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                causal=causal, return_lse=True)
            return out.transpose(1, 2), lse
        raise AttentionBackendError("the flash backend on CUDA needs flash-attn 2 (pip install flash-attn) or, "
                                    "in float16/bfloat16, FlashAttention 4 (pip install flash-attn-4)")
    if not cpu_flash_available():
        raise AttentionBackendError("this torch build has no CPU flash kernel "
                                    "(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu); use attention='sdpa'")
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=None,
                                                                       scale=scale)[:2]


def dense_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of q against k/v (their heads repeated for q's, :func:`shared_heads`) in
    float32 (or float64), with its log-sum-exp.

    Rows with nothing allowed get lse = -inf and a zero output, so they vanish in the merge.
    """
    k, v = shared_heads(k, q.shape[1]), shared_heads(v, q.shape[1])
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.matmul(weights, v.to(work)), lse


def shared_heads(key: torch.Tensor, heads: int) -> torch.Tensor:
    """``key`` with each key/value head repeated for its query heads (grouped-query attention)."""
    groups = heads // key.shape[1]
    return key.repeat_interleave(groups, dim=1) if groups > 1 else key


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: FlashLayout,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``query`` (``[1, H, rows, D]``) against its own request's committed columns of
    ``key`` / ``value`` (``[1, Hkv, columns, D]``, the store's buffers): ``(out [1, H, rows, D],
    lse [1, H, rows])``. A row with no committed column (``layout.region_length == 0``) may hold
    anything there: the merge leaves it out by that length."""
    if fa4_runs(query):
        return _prefix_fa4(query, key, value, layout, scale)
    if layout.spans is not None and (fa2_available() and query.dtype in FLASH_DTYPES if query.is_cuda
                                     else cpu_flash_available()):
        return _prefix_spans(query, key, value, layout.spans, scale)
    return _prefix_dense(query, key, value, layout, scale)


def _prefix_dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: FlashLayout,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    columns = torch.arange(key.shape[2], device=key.device)
    start = layout.region_start[:, None]
    allowed = (columns[None, :] >= start) & (columns[None, :] < start + layout.region_length[:, None])
    return dense_with_lse(query, key, value, scale, allowed[None, None])


def _prefix_spans(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  spans: Sequence[tuple[int, int, int, int]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    heads, rows = query.shape[1], query.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = query.new_zeros((1, heads, rows, query.shape[3]), dtype=work)
    lse = torch.full((1, heads, rows), float("-inf"), dtype=work, device=query.device)
    for row_start, row_end, first, committed_end in spans:
        if committed_end <= first:
            continue  # nothing committed yet: the rows see only each other
        part_out, part_lse = flash_with_lse(query[:, :, row_start:row_end], key[:, :, first:committed_end],
                                            value[:, :, first:committed_end], scale, causal=False)
        out[:, :, row_start:row_end] = part_out.to(work)
        lse[:, :, row_start:row_end] = part_lse.to(work)
    return out, lse


def fa4_sequences(layout: FlashLayout, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_k, seqused_k)`` (int32, on the device) for FlashAttention 4's
    variable-length call: one sequence per segment, and as many sequences as rows (the most
    segments a forward of ``rows`` rows can hold), so the shapes depend on the row count alone.
    Unused sequences hold no rows and no keys. Sequence ``s`` reads its keys from column
    ``cu_seqlens_k[s]`` on for ``seqused_k[s]`` columns."""
    device = layout.segment.device
    bounds = torch.arange(rows + 1, device=device)
    cu_q = (layout.segment[None, :] < bounds[:, None]).sum(dim=1)
    first_row = cu_q[:-1].clamp(max=rows - 1)
    present = cu_q[1:] > cu_q[:-1]
    k_start = torch.where(present, layout.region_start.index_select(0, first_row), 0)
    k_used = torch.where(present, layout.region_length.index_select(0, first_row), 0)
    k_end = (k_start + k_used).max(dim=0, keepdim=True).values
    return (cu_q.to(torch.int32), torch.cat([k_start, k_end]).to(torch.int32), k_used.to(torch.int32))


def _prefix_fa4(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: FlashLayout,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = query.shape[2], key.shape[2]
    cu_q, cu_k, used_k = layout.fa4_sequences
    out, lse = _fa4_varlen()(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used_k, max_seqlen_q=rows,
                             max_seqlen_k=columns, softmax_scale=scale, causal=False, return_lse=True)
    return out.transpose(0, 1)[None], lse[None]  # views: [1, H, rows, D] and [1, H, rows]
