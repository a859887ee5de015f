"""Attention whose result for a query row depends only on that row and its visible keys.

Why
    Exact mode promises that every logit row of a decode forward is bit for bit what a plain
    one-token step gives for the same prefix, whatever else shares the forward (other tree nodes,
    side blocks, other requests, padding). transformers' ``sdpa`` and ``eager`` attention do not
    keep that promise on a CPU (``benchmarks/row_invariance.py`` measures it): their matrix
    products pick blocking and reduction order by the number of query rows and keys, ``sdpa``
    packs a one-row step's query heads differently from a many-row forward's, and a tree node's
    ancestors sit at other columns, among masked keys, than the same keys in a plain step. A
    handful of last-bit differences is enough to flip a bfloat16 near-tie.

How
    Each row is computed over its visible keys *in column order* (the cache holds the committed
    tokens in position order and a tree's nodes come after their ancestors, so that is position
    order), counted by rank ``0 .. n-1`` and cut into chunks of :data:`CHUNK` ranks:

    1. scores ``q . k`` for every column, one float32 matrix product (each score is a dot over
       the head dimension alone);
    2. the visible scores gathered to their ranks, padded with ``-inf`` to whole chunks, and a
       float32 ``softmax`` over that row (its maximum is exact in any order; its sum adds the
       padding's zeros, which change nothing);
    3. per chunk, ``p @ v`` over exactly :data:`CHUNK` ranks, a float32 matrix product of fixed
       shape;
    4. the chunks' partial outputs added pairwise in rank order over a power of two (a row with
       fewer chunks than the widest adds zeros at the end, which change nothing).

    Every reduction therefore has a length and an order fixed by the row's own visible keys. The
    matrix products are float32 ``bmm`` calls with at least :data:`MIN_ROWS` rows, :data:`MIN_COLUMNS`
    columns and two batch entries (padded with zeros where needed): measured, the per-element result of the
    float32 kernel is then the same for any row count, batch size and position of the row
    (below four rows, or with one batch entry and several threads, the kernel sums in another
    order). The keys of chunks that are whole runs of contiguous columns are shared by every row
    that sees them and read in place; only a row's last chunks (the end of the cache and its tree
    ancestors) are gathered per row.

Two layouts of the same rule
    On a CPU the rows are laid out on the host: grouped by their first visible column, each
    group's chunks sized to its widest row. A CUDA graph cannot capture that (it reads the mask
    back and makes shapes from it: measured on an H100, exact mode then ran every forward eagerly,
    at 0.13-0.15x the speed of plain decoding). Everywhere else (:func:`uses_fixed_shapes`) the
    layout is computed on the device at shapes fixed by the forward's row and column counts alone
    (:func:`_fixed_block`): the scores and weights of every column, the *body* chunks (all but a
    row's last two) multiplied in place for every store chunk at once and shifted to the row's
    rank order, the last two chunks gathered per row, the softmax's denominator summed in the
    numerator's order (a column of ones beside the values). That needs a row's committed tokens to
    start at a multiple of :data:`CHUNK` in the store (:attr:`~specdraft.model.kv_store.KVStore.align`,
    set in exact mode), and the result is then the same whatever the store's size. The two layouts
    round differently from each other; each device uses one, so speculation and plain decoding
    there round alike. On CUDA, where Triton is installed, the fixed shapes run as two kernels per
    layer instead (:mod:`specdraft.model.exact_triton`: programs walk each row's keys in rank
    order, segment by segment, then combine the segments in order), which need no alignment; the
    torch operations remain where they cannot run.

Cost
    About a dense masked attention's arithmetic in float32 plus a gather of a few chunks per row.
    Measured per layer on an AVX-512 CPU with Qwen2.5-0.5B's heads (``benchmarks/exact_price.py``):
    a plain step padded to two rows costs half of ``sdpa``'s one-row step (0.3-0.5x), trees of
    2-4 rows cost about what ``sdpa`` does, and wider ones more (1.1-1.3x at 8 rows, 1.6-2x at
    64), since ``sdpa``'s flash kernel multiplies bfloat16 where this multiplies float32. The fixed
    layout does the body's product for every store chunk and carries a partial per chunk, so it
    costs more arithmetic than the host layout at long contexts (on that CPU 2-5x per layer), in
    about 30 small kernels per layer: a GPU replays them in the forward's graph.

Requirements on the caller
    Each row's visible keys, in column order, must be in position order (a cache that holds the
    committed tokens in position order, new rows after them, a tree's nodes after their
    ancestors: what specdraft's runners do). The mask must be ``[B, 1, q, kv]`` (one for all
    heads). Rows are grouped by their first visible column, so the rows of a sliding-window layer
    (each starting elsewhere) are attended one group each: correct, but slow.

The function is registered in transformers' ``AttentionInterface`` as :data:`EXACT_NAME` (with
``sdpa``'s bool mask builder), so the model stays unpatched; the decoder must then build bool
masks for it, as for ``sdpa``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .masks import visible
from .packed_attention import register_backend

#: The registered name (no "flash" in it: transformers treats such names specially).
EXACT_NAME = "specdraft_exact"

#: Ranks per chunk of a row's visible keys: every ``p @ v`` product has this inner length.
CHUNK = 64

#: Rows a float32 ``bmm`` is padded to at least: below four rows the CPU kernel sums in another
#: order than at four or more (measured; see the module docstring).
MIN_ROWS = 4

#: Columns a float32 ``bmm`` is padded to at least: narrower products take another kernel (measured:
#: up to 12 columns with a head dimension of 8 or 64).
MIN_COLUMNS = 32

#: Query rows attended at once (memory: the scores of a block are ``rows x heads x keys``).
ROW_BLOCK = 64


class ExactAttentionError(RuntimeError):
    """The exact attention cannot run this call; the message says what is unsupported."""


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` with at least :data:`MIN_ROWS` rows, :data:`MIN_COLUMNS` columns and
    two batch entries (zero padding, cut off again), so that every call runs the same float32
    kernel whatever its shape."""
    batch, rows, columns = a.shape[0], a.shape[1], b.shape[2]
    a = _zero_padded(_zero_padded(a, 1, MIN_ROWS), 0, 2)
    b = _zero_padded(_zero_padded(b, 2, MIN_COLUMNS), 0, 2)
    return torch.bmm(a, b)[:batch, :rows, :columns]


def _zero_padded(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` entries (``x`` itself when it has as many)."""
    missing = size - x.shape[dim]
    if missing <= 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], missing, *x.shape[dim + 1 :])], dim=dim)


def _allowed(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device: torch.device,
             columns: int = 0) -> torch.Tensor:
    """``[batch, q, kv]`` bool, contiguous: which key columns each query row may attend to, padded
    with hidden columns to ``columns`` where that is more. Without a mask the ``q`` rows are the
    last ``q`` positions of a causal sequence over the ``kv`` columns."""
    allowed = visible(mask, q_len, kv_len, device)[:, 0]  # a [B, 1, q, kv] mask (checked by exact_attention)
    return _zero_padded(allowed.expand(batch, q_len, kv_len).contiguous(), 2, columns)


def _rank_columns(allowed: torch.Tensor) -> torch.Tensor:
    """Along the last dimension of a bool mask, the visible columns first, in column order: rank
    ``r`` of a row is its ``r``-th visible key (a stable sort, of the mask's own shape)."""
    return torch.argsort(allowed.logical_not().to(torch.uint8), dim=-1, stable=True)


def _pairwise_sum(partial: torch.Tensor) -> torch.Tensor:
    """``partial`` summed over dimension 1 pairwise, padded with zeros to a power of two: the order
    of additions is fixed by the index alone, and zeros past the last nonzero entry change nothing,
    however many there are."""
    size = 1 << (partial.shape[1] - 1).bit_length()
    partial = _zero_padded(partial, 1, size)
    while size > 1:
        partial = partial[:, 0::2] + partial[:, 1::2]
        size //= 2
    return partial[:, 0]


@dataclass
class _Block:
    """Up to :data:`ROW_BLOCK` query rows whose first visible key is the same column, and how their
    visible keys map to ranks (the same for every layer of a forward, so computed once)."""

    rows: torch.Tensor  # [R] the rows' indices in the forward
    start: int  # their first visible column; columns [start, stop) hold every key they see
    stop: int
    chunks: int  # chunks of the widest row
    index: torch.Tensor  # [R, chunks * CHUNK] column (minus start) of each rank, 0 past the row's count
    bias: torch.Tensor  # [R, chunks * CHUNK] 0 for a rank < the row's count, -inf past it
    pairs: torch.Tensor  # chunk * R + row of the (row, chunk) pairs whose keys are not in place
    pair_columns: torch.Tensor  # [pairs * CHUNK] their columns (minus start)


def _block(rows: torch.Tensor, allowed: torch.Tensor, start: int, stop: int) -> _Block:
    """The layout of ``rows`` (``allowed``: their ``[R, stop - start]`` part of the mask)."""
    device = allowed.device
    count = allowed.sum(dim=1)
    chunks = max(1, -(-int(count.max()) // CHUNK))
    width = chunks * CHUNK
    kv = allowed.shape[1]
    n = len(rows)
    # rank -> column: visible columns first, in column order
    order = _rank_columns(allowed)
    ranks = torch.arange(width, device=device)
    valid = ranks[None, :] < count[:, None]
    index = order[:, :width] if width <= kv else torch.cat([order, order.new_zeros(n, width - kv)], dim=1)
    index = index.masked_fill(~valid, 0)
    bias = torch.zeros(n, width, device=device).masked_fill_(~valid, float("-inf"))
    # a chunk is in place for a row when each of its ranks is its own column (past the count: any)
    in_place = ((index == ranks[None, :]) | ~valid).view(n, chunks, CHUNK).all(dim=2)
    pair_row, pair_chunk = (~in_place).nonzero(as_tuple=True)
    pair_columns = index.view(n, chunks, CHUNK)[pair_row, pair_chunk].reshape(-1)
    return _Block(rows, start, stop, chunks, index, bias, pair_chunk * n + pair_row, pair_columns)


def _layout(allowed: torch.Tensor) -> list[_Block]:
    """The row blocks of one batch entry's ``[q, kv]`` mask: rows grouped by their first visible
    column (one group per request in a packed batch), then cut into :data:`ROW_BLOCK` rows."""
    seen = allowed.any(dim=1)
    first = torch.where(seen, allowed.to(torch.uint8).argmax(dim=1), -1)
    blocks = []
    for start in torch.unique(first[seen]).tolist():
        rows = (first == start).nonzero(as_tuple=True)[0]
        group = allowed[rows]
        stop = int(group.any(dim=0).nonzero().max()) + 1
        for at in range(0, rows.numel(), ROW_BLOCK):
            blocks.append(_block(rows[at : at + ROW_BLOCK], group[at : at + ROW_BLOCK, start:stop].contiguous(),
                                 start, stop))
    return blocks


def _attend_block(block: _Block, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of one block's rows. ``q`` is ``[kv_heads, groups, R, D]`` float32 (scaled),
    ``k``/``v`` ``[kv_heads, stop - start, D]`` float32. Returns ``[R, kv_heads, groups, D]``."""
    heads_kv, groups, rows, dim = q.shape
    kv = k.shape[1]
    chunks, width = block.chunks, block.chunks * CHUNK
    # 1. scores for every column: one dot over the head dimension each
    scores = _bmm(q.reshape(heads_kv, groups * rows, dim), k.transpose(1, 2)).view(heads_kv, groups, rows, kv)
    # 2. gathered to ranks, padded with -inf to whole chunks, softmax in float32
    ranked = scores.gather(3, block.index.expand(heads_kv, groups, rows, width)).add_(block.bias)
    probs = torch.softmax(ranked, dim=-1)
    # 3. per chunk, p @ v over CHUNK ranks: for all rows as if the chunk's keys were in place, then
    #    again from gathered keys for the chunks that are not (a tree's ancestors after a gap)
    v_in_place = v[:, :width] if width <= kv else torch.cat([v, v.new_zeros(heads_kv, width - kv, dim)], dim=1)
    p = probs.view(heads_kv, groups, rows, chunks, CHUNK).permute(0, 3, 2, 1, 4)  # [Hkv, chunks, R, groups, C]
    partial = _bmm(p.reshape(heads_kv * chunks, rows * groups, CHUNK),
                   v_in_place.reshape(heads_kv * chunks, CHUNK, dim)).view(heads_kv, chunks * rows, groups, dim)
    pairs = block.pairs.numel()
    if pairs:
        vals = v.index_select(1, block.pair_columns).view(heads_kv, pairs, CHUNK, dim).transpose(0, 1)
        p = p.reshape(heads_kv, chunks * rows, groups, CHUNK).index_select(1, block.pairs)
        out = _bmm(p.transpose(0, 1).reshape(pairs * heads_kv, groups, CHUNK),
                   vals.reshape(pairs * heads_kv, CHUNK, dim))
        partial.index_copy_(1, block.pairs, out.view(pairs, heads_kv, groups, dim).transpose(0, 1))
    # 4. chunks added in rank order, pairwise over a power-of-two count: the zeros of chunks a row
    #    does not have change nothing, so the sum is the same as over the row's own chunks
    return _pairwise_sum(partial.view(heads_kv, chunks, rows, groups, dim)).transpose(0, 1)


# -- fixed shapes: what a CUDA graph can capture ----------------------------------------------------

#: Whether the fixed-shape layout runs (:func:`uses_fixed_shapes`): ``None`` picks it on every device
#: but the CPU; ``True``/``False`` force it either way (tests run it on a CPU).
FIXED_SHAPES: bool | None = None

#: Float32 elements the per-chunk partials of one row block may take (rows per block shrink past it).
FIXED_BLOCK_ELEMENTS = 1 << 23


def uses_fixed_shapes(device: torch.device) -> bool:
    """Whether exact attention on ``device`` lays out its rows at fixed shapes on the device (see
    :func:`_fixed_block`) rather than on the host. Every exact forward on a device takes the same
    layout, so speculation and plain decoding round alike."""
    return FIXED_SHAPES if FIXED_SHAPES is not None else device.type != "cpu"


@dataclass
class _FixedBlock:
    """Rows ``[at, at + R)`` of a forward laid out at shapes fixed by ``R`` and the padded key count
    ``Cp`` alone: device tensors, computed once per forward with no host read.

    A row's visible keys are cut by rank into chunks of :data:`CHUNK`. All but its last two chunks
    (the *body*) are committed tokens of its region, which start at a store row that is a multiple
    of :data:`CHUNK` (:attr:`~specdraft.model.kv_store.KVStore.align`), so body chunk ``j`` is
    store chunk ``first // CHUNK + j``, read in place; the last two chunks (the *tail*: the end of
    the committed tokens and the row's tree ancestors, at most 64 keys past them) are gathered."""

    at: int
    rows: int
    hidden: torch.Tensor  # [R, Cp] bool: not visible
    off_body: torch.Tensor  # [R, Cp] not visible, or not in a body chunk
    shift: torch.Tensor  # [S, R] store chunk of rank chunk s (the zero chunk M past the row's first)
    tail_columns: torch.Tensor  # [R, 2 * CHUNK] column of each tail rank (0 past the row's count)
    past_count: torch.Tensor  # [R, 2 * CHUNK] tail ranks past the row's count
    tail_pick: torch.Tensor  # [S, R] at rank chunk s: the tail's first (0) or second (1) chunk, or nothing (2)
    slots: int  # S: a power of two above the store's chunk count


def _fixed_block(allowed: torch.Tensor, at: int) -> _FixedBlock:
    """The layout of rows whose ``[R, Cp]`` part of the mask is ``allowed`` (``Cp`` a multiple of
    :data:`CHUNK`)."""
    rows, columns = allowed.shape
    chunks = columns // CHUNK
    device = allowed.device
    order = _rank_columns(allowed)  # rank -> column, at the mask's fixed shape
    count = allowed.sum(dim=1)
    first = allowed.to(torch.uint8).argmax(dim=1)
    tail_chunk = ((count - 1).clamp(min=0) // CHUNK - 1).clamp(min=0)
    ranks = allowed.to(torch.int64).cumsum(dim=1) - 1
    off_body = ~(allowed & (ranks < (tail_chunk * CHUNK)[:, None]))
    tail_ranks = tail_chunk[:, None] * CHUNK + torch.arange(2 * CHUNK, device=device)
    tail_valid = tail_ranks < count[:, None]
    tail_columns = order.gather(1, tail_ranks.clamp(max=columns - 1)).masked_fill(~tail_valid, 0)
    slots = 1 << chunks.bit_length()  # room for every chunk and the tail's second past the last
    shift = ((first // CHUNK)[None, :] + torch.arange(slots, device=device)[:, None]).clamp(max=chunks)
    tail_pick = (torch.arange(slots, device=device)[:, None] - tail_chunk[None, :]).clamp(min=-1)
    tail_pick = torch.where((tail_pick == 0) | (tail_pick == 1), tail_pick, 2)
    return _FixedBlock(at, rows, ~allowed, off_body, shift, tail_columns, ~tail_valid, tail_pick, slots)


def _attend_fixed(block: _FixedBlock, q: torch.Tensor, k: torch.Tensor, v_ext: torch.Tensor) -> torch.Tensor:
    """Attention of one fixed block's rows. ``q`` is ``[kv_heads, groups, R, D]`` float32 (scaled),
    ``k`` ``[kv_heads, Cp, D]`` and ``v_ext`` ``[kv_heads, Cp, D + 1]`` float32, the values with a
    column of ones (so each chunk's product also sums its weights: the softmax's denominator takes
    the numerator's order). Returns ``[R, kv_heads, groups, D]``.

    Every step is of fixed shape, and every sum's order is a function of the row's own ranks: the
    scores are one dot each; the weights ``exp(score - max)`` are elementwise (the maximum is
    exact in any order); each chunk's product has the inner length :data:`CHUNK`; the chunks are
    put in rank order (the body's shifted by the row's first chunk, the tail's placed at its rank
    chunks) and added pairwise over a power of two, where the zeros of chunks past the row's last
    change nothing, whatever the store's size."""
    heads_kv, groups, rows, dim = q.shape
    columns = k.shape[1]
    chunks, width = columns // CHUNK, dim + 1
    scores = _bmm(q.reshape(heads_kv, groups * rows, dim), k.transpose(1, 2)).view(heads_kv, groups, rows,
                                                                                          columns)
    scores = scores.masked_fill(block.hidden, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # a row seeing nothing: 0s
    weights = torch.exp(scores - top)
    # the body: every store chunk in place, each row's weights outside its body zeroed
    body = weights.masked_fill(block.off_body, 0.0).view(heads_kv, groups, rows, chunks, CHUNK).permute(0, 3, 2, 1, 4)
    partial = _bmm(body.reshape(heads_kv * chunks, rows * groups, CHUNK),
                         v_ext.reshape(heads_kv * chunks, CHUNK, width)).view(heads_kv, chunks, rows, groups, width)
    partial = torch.cat([partial, partial.new_zeros(heads_kv, 1, rows, groups, width)], dim=1)
    ordered = partial.gather(1, block.shift.view(1, block.slots, rows, 1, 1).expand(heads_kv, block.slots, rows,
                                                                                    groups, width))
    # the tail: its two chunks gathered per row, added at their rank chunks (zeros in the body there)
    tail = weights.gather(3, block.tail_columns.expand(heads_kv, groups, rows, 2 * CHUNK))
    tail = tail.masked_fill(block.past_count, 0.0).view(heads_kv, groups, rows, 2, CHUNK).permute(0, 2, 3, 1, 4)
    values = v_ext.index_select(1, block.tail_columns.reshape(-1)).view(heads_kv * rows * 2, CHUNK, width)
    tail = _bmm(tail.reshape(heads_kv * rows * 2, groups, CHUNK), values).view(heads_kv, rows, 2, groups, width)
    tail = torch.cat([tail.transpose(1, 2), tail.new_zeros(heads_kv, 1, rows, groups, width)], dim=1)
    ordered = ordered + tail.gather(1, block.tail_pick.view(1, block.slots, rows, 1, 1).expand(
        heads_kv, block.slots, rows, groups, width))
    total = _pairwise_sum(ordered)  # [Hkv, R, groups, D + 1]
    numerator, denominator = total[..., :dim], total[..., dim:]
    return (numerator / denominator.clamp(min=torch.finfo(torch.float32).tiny)).transpose(0, 1)  # nothing seen: 0


class _PerMask:
    """What was laid out for the mask of the current forward. Every layer gets the same mask object,
    so the layout is kept for that object (held, so that no later mask can take its identity) and
    made again for any other: no comparison of contents, which would read the device. The host
    layout (``by_contents``) keeps a copy of the mask instead and compares contents bit for bit, a
    cheap pass on the host; ``key`` then holds the mask's shape and dtype (or ``None`` for none)."""

    def __init__(self, by_contents: bool = False) -> None:
        self._by_contents = by_contents
        self._mask: torch.Tensor | None = None
        self._key: tuple | None = None
        self._value: Any = None
        self._lock = threading.Lock()

    def get(self, mask: torch.Tensor | None, key: tuple, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key == self._key and (mask is self._mask or (self._by_contents and mask is not None
                                                            and torch.equal(mask, self._mask))):
                return self._value
        value = make()
        with self._lock:
            self._key, self._value = key, value
            self._mask = mask.clone() if self._by_contents and mask is not None else mask
        return value


_LAYOUTS = _PerMask(by_contents=True)
_FIXED_LAYOUTS = _PerMask()
_ROW_ORDERS = _PerMask()


def _fixed_layout(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, columns: int,
                  device: torch.device, heads_kv: int, groups: int) -> list[list[_FixedBlock]]:
    """Each batch entry's row blocks (rows per block bounded by :data:`FIXED_BLOCK_ELEMENTS`)."""
    allowed = _allowed(mask, batch, q_len, kv_len, device, columns)
    slots = 1 << (columns // CHUNK).bit_length()
    per_block = max(1, min(ROW_BLOCK, FIXED_BLOCK_ELEMENTS // (slots * heads_kv * groups * CHUNK)))
    return [[_fixed_block(allowed[b, at : at + per_block], at) for at in range(0, q_len, per_block)]
            for b in range(batch)]


def _row_order(mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, columns: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the Triton kernel: ``[B, q, columns]`` int32, each row's visible columns first in column
    order, and ``[B, q]`` int32, how many it sees (fixed shapes, on the device)."""
    allowed = _allowed(mask, batch, q_len, kv_len, device, columns)
    return _rank_columns(allowed).to(torch.int32).contiguous(), allowed.sum(dim=2).to(torch.int32).contiguous()


def _exact_fixed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scale: float, groups: int, columns: int) -> torch.Tensor:
    """:func:`exact_attention` at fixed shapes over ``columns`` (the keys padded to whole chunks):
    ``[B, q, H, D]`` float32."""
    batch, heads, q_len, dim = query.shape
    heads_kv, kv_len = key.shape[1], key.shape[2]
    layout = _FIXED_LAYOUTS.get(mask, (batch, q_len, kv_len, columns, str(query.device), heads_kv, groups),
                                lambda: _fixed_layout(mask, batch, q_len, kv_len, columns, query.device, heads_kv,
                                                      groups))
    out = query.new_zeros(batch, q_len, heads, dim, dtype=torch.float32)
    for b in range(batch):
        q = (query[b].to(torch.float32) * scale).reshape(heads_kv, groups, q_len, dim)
        k = _zero_padded(key[b].to(torch.float32), 1, columns)
        v = _zero_padded(value[b].to(torch.float32), 1, columns)
        v_ext = torch.cat([v, v.new_ones(heads_kv, columns, 1)], dim=2)
        for block in layout[b]:
            rows = slice(block.at, block.at + block.rows)
            out[b, rows] = _attend_fixed(block, q[:, :, rows], k, v_ext).reshape(block.rows, heads, dim)
    return out


#: Whether the fixed shapes run as Triton kernels (:mod:`specdraft.model.exact_triton`):
#: ``None`` on CUDA where Triton is installed and its kernels run (:func:`triton_runs_on`);
#: ``True``/``False`` force it.
TRITON: bool | None = None

#: Per device, why the Triton kernels do not run there (their first call failed).
TRITON_NOTE: dict[str, str] = {}

#: Per device, whether the Triton kernels ran there (:func:`triton_runs_on`'s answers).
_TRITON_RUNS: dict[str, bool] = {}

#: Why the torch layout is refused on CUDA, for error messages.
CUDA_NEEDS_TRITON = ("on CUDA exact attention runs as Triton kernels: the same rows as torch operations are not "
                     "row-invariant there (cuBLAS picks its matrix kernels by shape; measured on an H100, rows of a "
                     "32-row forward differed from their one-row results), so exact mode cannot keep its promise "
                     "without them; install triton (it comes with torch's CUDA wheels) or use exact=False")


def triton_runs_on(device: torch.device) -> bool:
    """Whether exact attention's Triton kernels run on ``device``: a CUDA device, Triton installed,
    and one small call that works (made once per device, so a GPU or driver that Triton does not
    support is found before the first real forward; :data:`TRITON_NOTE` says why not)."""
    device = torch.device(device)
    key = str(device)
    if key not in _TRITON_RUNS:
        from . import exact_triton

        runs = False
        if device.type == "cuda" and exact_triton.available() and key not in TRITON_NOTE:
            try:
                probe = torch.zeros(1, 1, 1, 64, device=device, dtype=torch.bfloat16)
                exact_triton.attend(probe, probe, probe, *_row_order(None, 1, 1, 1, CHUNK, device), 0.125)
                torch.cuda.synchronize(device)
                runs = True
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here: say why, once
                TRITON_NOTE[key] = f"{type(exc).__name__}: {exc}"
        _TRITON_RUNS[key] = runs
    return _TRITON_RUNS[key]


def check_exact_runs_on(device: torch.device) -> None:
    """Raise :class:`ExactAttentionError` where exact attention cannot keep its promise on
    ``device``: CUDA without working Triton kernels (:data:`CUDA_NEEDS_TRITON`). Called when a
    decoder turns exact mode on, so the error comes before the first forward."""
    device = torch.device(device)
    if TRITON is None and device.type == "cuda" and not triton_runs_on(device):
        note = TRITON_NOTE.get(str(device))
        raise ExactAttentionError(CUDA_NEEDS_TRITON + (f" (the Triton kernels cannot run here: {note})" if note else ""))


def _uses_triton(device: torch.device) -> bool:
    return TRITON if TRITON is not None else device.type == "cuda" and triton_runs_on(device)


def _exact_triton(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, columns: int) -> torch.Tensor:
    """:func:`exact_attention` in the Triton kernels: ``[B, q, H, D]`` float32. A failure raises:
    there is no other exact layout on CUDA (:data:`CUDA_NEEDS_TRITON`), and switching layouts
    mid-way elsewhere would change the rounding of what is being decoded."""
    from . import exact_triton

    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    device = str(query.device)
    order, count = _ROW_ORDERS.get(mask, (batch, q_len, kv_len, columns, device),
                                   lambda: _row_order(mask, batch, q_len, kv_len, columns, query.device))
    try:  # the kernels' launch alone: the layout above is torch's, and its errors are not the kernels'
        return exact_triton.attend(query, key, value, order, count, scale)
    except Exception as exc:  # noqa: BLE001 - say which path failed and what to do
        raise ExactAttentionError(f"the Triton kernels of exact attention failed on {device} ({type(exc).__name__}: "
                                  f"{exc}); use exact=False") from exc


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface`` signature), row by row invariant.

    ``query`` is ``[B, H, q, D]``, ``key``/``value`` ``[B, Hkv, kv, D]``; ``attention_mask`` a 4D
    ``[B, 1, q, kv]`` bool (or additive) mask, or ``None`` for the last ``q`` positions of a causal
    sequence. Returns ``([B, q, H, D], None)`` in the query's dtype. A row with no visible key gets
    zeros. On a CPU the rows are laid out on the host; elsewhere at fixed shapes on the device
    (:func:`uses_fixed_shapes`), with no host read, so that a CUDA graph can capture the forward.
    """
    if dropout and module.training:
        raise ExactAttentionError("exact attention does not implement attention dropout; call model.eval()")
    if kwargs.get("softcap") is not None or getattr(module, "attn_logit_softcapping", None) is not None:
        raise ExactAttentionError("exact attention does not implement attention logit soft-capping")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ExactAttentionError("exact attention does not implement attention sinks")
    batch, heads, q_len, dim = query.shape
    heads_kv, kv_len = key.shape[1], key.shape[2]
    if heads % heads_kv:
        raise ExactAttentionError(f"{heads} query heads cannot share {heads_kv} key/value heads evenly")
    groups = heads // heads_kv
    scale = scaling if scaling is not None else dim ** -0.5
    if attention_mask is not None and (attention_mask.dim() != 4 or attention_mask.shape[1] != 1):
        raise ExactAttentionError(f"exact attention takes a [batch, 1, q, kv] mask shared by all heads, got shape "
                                  f"{tuple(attention_mask.shape)}")
    if uses_fixed_shapes(query.device):
        columns = -(-kv_len // CHUNK) * CHUNK
        if _uses_triton(query.device):
            out = _exact_triton(query, key, value, attention_mask, scale, columns)
        else:
            check_exact_runs_on(query.device)  # (TRITON = False: the torch layout on purpose, anywhere)
            out = _exact_fixed(query, key, value, attention_mask, scale, groups, columns)
        return out.to(query.dtype), None
    layout_key = (batch, q_len, kv_len, str(query.device),
                  None if attention_mask is None else (tuple(attention_mask.shape), attention_mask.dtype))
    layout = _LAYOUTS.get(attention_mask, layout_key, lambda: [  # (laid out once for all layers of a forward)
        _layout(allowed) for allowed in _allowed(attention_mask, batch, q_len, kv_len, query.device)])
    out = query.new_zeros(batch, q_len, heads, dim, dtype=torch.float32)
    for b in range(batch):
        q = (query[b].to(torch.float32) * scale).reshape(heads_kv, groups, q_len, dim)
        for block in layout[b]:
            k = key[b, :, block.start : block.stop].to(torch.float32)
            v = value[b, :, block.start : block.stop].to(torch.float32)
            rows = block.rows
            mine = q if rows.numel() == q_len else q.index_select(2, rows)
            result = _attend_block(block, mine, k, v).reshape(rows.numel(), heads, dim)
            out[b].index_copy_(0, rows, result)
    return out.to(query.dtype), None


def register_exact_backend() -> str:
    """Register :func:`exact_attention` with transformers (idempotent); returns its name."""
    return register_backend(EXACT_NAME, exact_attention)
