"""The flash split's second half in one Triton kernel per layer: the new rows among themselves,
merged with the prefix's result.

Why
    Written in torch operations, part (b) of the split (gather the new rows' keys and values,
    repeat them for grouped query heads, a masked float32 product, its log-sum-exp) and the merge
    with part (a) take about 25 small kernels per layer. Inside a decode forward's CUDA graph each
    still costs a few microseconds of the GPU's time, which over a 24-layer model is more than the
    attention itself. Here one program per (row, key/value head) does all of it.

How
    The prefix's result enters as one more element of an online softmax: its log-sum-exp is the
    running maximum, its weight 1 and its output the running sum (a row whose request has nothing
    committed starts empty instead). The row's new keys, gathered by their columns in the store,
    are then walked in blocks of :data:`BLOCK_N`, with the row's line of the new rows' mask, in
    float32; the output is written in the query's dtype, already in transformers' ``[B, q, H, D]``
    layout.

:func:`available` says whether Triton can run here; with ``TRITON_INTERPRET=1`` set before Triton is
first imported, its interpreter runs the kernel on a CPU (how the tests check it without a GPU).
"""

from __future__ import annotations

import torch

try:  # an optional dependency: present with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

#: New rows walked per block of a row's online softmax.
BLOCK_N = 16


def available() -> bool:
    """Whether the Triton package is importable here."""
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["rows", "sqh", "sqm", "skh", "skn", "svh", "svn", "s_al", "sam", "sah",
                                   "slh", "slm", "som", "soh"])
    def _new_rows_kernel(Q, K, V, Columns, Allowed, OutA, LseA, Committed, Out, scale, rows, sqh, sqm, skh, skn,
                         svh, svn, s_al, sam, sah, slh, slm, som, soh, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        """One row's query heads of one key/value head: the prefix's result, then its new keys."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        c = tl.arange(0, BLOCK_N)
        head_ok = g < GROUPS
        dim_ok = d < D
        both_ok = head_ok[:, None] & dim_ok[None, :]
        heads = kv_head * GROUPS + g
        q = tl.load(Q + heads[:, None] * sqh + row * sqm + d[None, :], mask=both_ok, other=0.0).to(tl.float32) * scale
        seen = (tl.zeros([BLOCK_G], tl.int64) + tl.load(Committed + row)) > 0  # (per head: a load mask)
        top = tl.load(LseA + heads * slh + row * slm, mask=head_ok & seen, other=float("-inf")).to(tl.float32)
        total = tl.where(seen, 1.0, 0.0)
        acc = tl.load(OutA + row * sam + heads[:, None] * sah + d[None, :], mask=both_ok & seen[:, None],
                      other=0.0).to(tl.float32)
        for start in range(0, rows, BLOCK_N):
            j = start + c
            j_ok = j < rows
            allowed = tl.load(Allowed + row * s_al + j, mask=j_ok, other=0) != 0
            cols = tl.load(Columns + j, mask=j_ok, other=0)
            kv_ok = j_ok[:, None] & dim_ok[None, :]
            k = tl.load(K + kv_head * skh + cols[:, None] * skn + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            scores = tl.where(allowed[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # nothing seen yet: no NaN from -inf - -inf
            rescale = tl.exp(top - safe)
            weights = tl.exp(scores - safe[:, None])
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(V + kv_head * svh + cols[:, None] * svn + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision="ieee")
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(Out + row * som + heads[:, None] * soh + d[None, :], out.to(Out.dtype.element_ty), mask=both_ok)


def attend_new_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor,
                    allowed: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, committed: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The split's result for one sequence of rows: ``query`` ``[1, H, rows, D]``, ``key`` /
    ``value`` ``[1, Hkv, columns, D]`` (the store), ``columns`` ``[rows]`` (where each new row's key
    is), ``allowed`` ``[rows, rows]`` (which new rows each row sees), the prefix's ``out_a``
    ``[1, H, rows, D]`` and ``lse_a`` ``[1, H, rows]`` (read only where ``committed[row] > 0``).
    Returns ``[1, rows, H, D]`` in the query's dtype."""
    if triton is None:
        raise RuntimeError("the flash split's Triton kernel needs the triton package")
    _, heads, rows, dim = query.shape
    heads_kv = key.shape[1]
    groups = heads // heads_kv
    query, key, value, out_a = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, out_a))
    allowed = allowed.to(torch.int8) if allowed.dtype == torch.bool else allowed
    out = torch.empty(1, rows, heads, dim, dtype=query.dtype, device=query.device)
    _new_rows_kernel[(rows, heads_kv)](
        query, key, value, columns, allowed, out_a, lse_a, committed, out, scale, rows,
        query.stride(1), query.stride(2), key.stride(1), key.stride(2), value.stride(1), value.stride(2),
        allowed.stride(0), out_a.stride(2), out_a.stride(1), lse_a.stride(1), lse_a.stride(2),
        out.stride(1), out.stride(2),
        GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), D=dim,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=BLOCK_N)
    return out
