"""Exact attention in two Triton kernels per layer, for GPUs.

Why
    The exact attention's fixed layout in torch operations (:mod:`specdraft.model.exact_attention`)
    can be captured in a CUDA graph, but it runs about 30 small kernels per layer where ``sdpa``
    runs one. On a GPU whose forward is bound by kernel launches, that is most of a step.

How
    A row's visible keys are walked in rank order, :data:`CHUNK` at a time, with an online softmax
    (the running maximum, the sum of weights and the weighted values, rescaled at each chunk), in
    float32 with fixed block shapes. The ranks are cut into segments of :data:`SEGMENT`, each
    walked by its own program (one per row, key/value head and segment), so that a long context
    is walked in parallel as in flash-decoding; a second kernel combines a row's segments in rank
    order. The segments are fixed by rank, so a row's result is computed by the same instructions
    in the same order from its own keys alone, whatever else the forward holds: how many rows,
    which columns the keys sit at, how large the store is. The rank -> column table and each
    row's count of visible keys are made from the mask once per forward, at fixed shapes on the
    device (no host read), so the kernels' launches are captured in the forward's CUDA graph like
    any other.

The products run with ``input_precision="ieee"`` (no TF32), so the values are float32 attention's
to rounding. :func:`available` says whether Triton can run here; with ``TRITON_INTERPRET=1`` set
before this module is imported, Triton's interpreter runs the kernel on a CPU (how the tests check
it without a GPU).
"""

from __future__ import annotations

import torch

try:  # an optional dependency: present with CUDA builds of torch
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

#: Keys per step of a row's walk (the exact attention's chunk).
CHUNK = 64

#: Keys per segment: a row's walk is split into segments of this many ranks, walked in parallel.
SEGMENT = 4 * CHUNK


def available() -> bool:
    """Whether the Triton package is importable here."""
    return triton is not None


if triton is not None:

    @triton.jit(do_not_specialize=["sqb", "sqh", "sqm", "skb", "skh", "skn", "svb", "svh", "svn", "s_ob", "s_om",
                                   "s_cb", "spb", "sps", "spm"])
    def _segment_kernel(Q, K, V, Order, Count, Acc, Top, Total, scale, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn,
                        s_ob, s_om, s_cb, spb, sps, spm, segments, GROUPS: tl.constexpr,
                        BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, STEP: tl.constexpr,
                        SEGMENT: tl.constexpr):
        """One row's walk over one segment of its ranks: the segment's running maximum, sum of
        weights and weighted values, for each query head of one key/value head."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        b = tl.program_id(2) // segments
        segment = tl.program_id(2) % segments
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        c = tl.arange(0, STEP)
        head_ok = g < GROUPS
        dim_ok = d < D
        heads = kv_head * GROUPS + g
        q = tl.load(Q + b * sqb + heads[:, None] * sqh + row * sqm + d[None, :], mask=head_ok[:, None] & dim_ok[None, :],
                    other=0.0).to(tl.float32) * scale
        first = segment * SEGMENT
        end = tl.minimum(tl.load(Count + b * s_cb + row), first + SEGMENT)
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(first, end, STEP):
            ranks = start + c
            seen = ranks < end
            cols = tl.load(Order + b * s_ob + row * s_om + ranks, mask=seen, other=0)
            kv_ok = seen[:, None] & dim_ok[None, :]
            k = tl.load(K + b * skb + kv_head * skh + cols[:, None] * skn + d[None, :], mask=kv_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            scores = tl.where(seen[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(scores - new_top[:, None])
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(V + b * svb + kv_head * svh + cols[:, None] * svn + d[None, :], mask=kv_ok, other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights, v.to(tl.float32), input_precision="ieee")
            top = new_top
        at = b * spb + segment * sps + row * spm + heads
        tl.store(Top + at, top, mask=head_ok)
        tl.store(Total + at, total, mask=head_ok)
        tl.store(Acc + at[:, None] * D + d[None, :], acc, mask=head_ok[:, None] & dim_ok[None, :])

    @triton.jit(do_not_specialize=["s_cb", "spb", "sps", "spm", "sob", "som", "soh"])
    def _combine_kernel(Acc, Top, Total, Count, Out, s_cb, spb, sps, spm, sob, som, soh, GROUPS: tl.constexpr,
                        BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, SEGMENT: tl.constexpr):
        """One row's segments combined in rank order (a segment past the row's keys would change
        nothing: its maximum is -inf and its sums 0)."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        b = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        head_ok = g < GROUPS
        dim_ok = d < D
        heads = kv_head * GROUPS + g
        both_ok = head_ok[:, None] & dim_ok[None, :]
        count = tl.load(Count + b * s_cb + row)
        top = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for segment in range(0, tl.cdiv(count, SEGMENT)):
            at = b * spb + segment * sps + row * spm + heads
            part_top = tl.load(Top + at, mask=head_ok, other=0.0)  # pad heads: finite, so no NaN
            new_top = tl.maximum(top, part_top)
            mine = tl.exp(top - new_top)
            theirs = tl.exp(part_top - new_top)
            total = total * mine + tl.load(Total + at, mask=head_ok, other=0.0) * theirs
            acc = acc * mine[:, None] + tl.load(Acc + at[:, None] * D + d[None, :], mask=both_ok, other=0.0) * theirs[:, None]
            top = new_top
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees nothing: zeros
        tl.store(Out + b * sob + row * som + heads[:, None] * soh + d[None, :], out, mask=both_ok)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, order: torch.Tensor, count: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Exact attention: ``query`` ``[B, H, q, D]``, ``key``/``value`` ``[B, Hkv, kv, D]``, ``order``
    ``[B, q, >= kv]`` int32 (row ``r``'s visible columns first, in column order), ``count``
    ``[B, q]`` int32 (how many it sees). Returns ``[B, q, H, D]`` float32.

    Each row's ranks are walked in segments of :data:`SEGMENT` keys by separate programs (so that a
    long context is walked in parallel, as flash-decoding splits it), then the segments are
    combined in rank order: the segments are fixed by rank, so a row's rounding is still its own."""
    if triton is None:
        raise RuntimeError("the Triton kernel of exact attention needs the triton package")
    batch, heads, q_len, dim = query.shape
    heads_kv = key.shape[1]
    groups = heads // heads_kv
    segments = max(1, -(-order.shape[2] // SEGMENT))
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    device = query.device
    tops = torch.empty(batch, segments, q_len, heads, dtype=torch.float32, device=device)
    totals = torch.empty_like(tops)
    accs = torch.empty(batch, segments, q_len, heads, dim, dtype=torch.float32, device=device)
    blocks = dict(GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), D=dim,
                  BLOCK_D=max(16, triton.next_power_of_2(dim)), SEGMENT=SEGMENT)
    _segment_kernel[(q_len, heads_kv, batch * segments)](
        query, key, value, order, count, accs, tops, totals, scale,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), order.stride(0), order.stride(1), count.stride(0),
        tops.stride(0), tops.stride(1), tops.stride(2), segments, STEP=CHUNK, **blocks)
    out = torch.empty(batch, q_len, heads, dim, dtype=torch.float32, device=device)
    _combine_kernel[(q_len, heads_kv, batch)](
        accs, tops, totals, count, out, count.stride(0), tops.stride(0), tops.stride(1), tops.stride(2),
        out.stride(0), out.stride(1), out.stride(2), **blocks)
    return out
