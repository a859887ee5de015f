"""The model side of batched decoding: many requests' rows in one forward, one packed KV cache.

Every active request owns a *region* of one cache buffer per layer (``[1, kv_heads, capacity,
head_dim]``): its committed tokens sit at the start of the region, in position order, and a
step's new rows (its tree, or a chunk of its prompt) are written right after them. One forward
takes every request's rows side by side as a batch of one sequence ("packed"), with a 4D mask
that lets each row see only its own region's committed tokens and its own block (tree ancestors,
or the causal part of a prompt chunk), and explicit positions per request. Nothing crosses
between requests, so each request's logits are what it would get alone.

Why packed rather than padded: the cost of a forward on a CPU (and of the linear layers
anywhere) grows with the rows it carries. A padded batch ``[requests, longest step]`` pays for
the longest tree, or a newly admitted prompt's prefill chunk, in every row; packed, a step pays
for the rows that exist. The price is attention over the other requests' columns, masked out:
on the small models this runs on, the linear layers dominate by far. The model stays unpatched:
only a ``DynamicCache`` subclass, a 4D mask, ``position_ids`` and ``logits_to_keep``.

Like :class:`~specdraft.runner.SlotCache`, the buffers are written and compacted in place and
kept across requests; a region is handed to the next request the moment its request ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .packed_attention import LAYOUT_KEYWORD, PACKED_NAME, PackedLayout
from .runner import ModelRunner, UnsupportedModelError, _logits_for_decoding
from .transfer import upload


@dataclass
class Segment:
    """One request's rows in a batched forward.

    ``positions`` are the rows' absolute token positions; ``block[i, j]`` says whether new row
    ``i`` sees new row ``j`` (every row also sees its region's committed tokens); ``logit_rows``
    are the rows whose logits the caller needs (a tree: all of them; a prompt chunk: the last
    one, or none until the prompt's last chunk).
    """

    region: "Region"
    tokens: Sequence[int]
    positions: np.ndarray
    block: np.ndarray
    logit_rows: Sequence[int]


@dataclass
class Region:
    """A request's part of the packed cache: rows ``[start, start + capacity)`` of every layer's
    buffer, of which the first ``length`` hold its committed tokens."""

    start: int
    capacity: int
    length: int = 0
    #: rows the last forward wrote after ``length`` (kept or dropped by :meth:`BatchRunner.keep`)
    pending: int = 0
    released: bool = False

    @property
    def end(self) -> int:
        return self.start + self.capacity


class _PackedLayer(DynamicLayer):
    """One layer's keys and values for every request, in one buffer written by index."""

    def __init__(self, cache: "PackedCache") -> None:
        super().__init__()
        self._cache = cache
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._cache
        if self.key_buffer is None or self.key_buffer.shape[-2] < cache.capacity \
                or self.key_buffer.shape[:-2] != key_states.shape[:-2] or self.key_buffer.dtype != key_states.dtype:
            self._resize(key_states, value_states, cache.capacity)
        self.key_buffer.index_copy_(-2, cache.write_rows, key_states)
        self.value_buffer.index_copy_(-2, cache.write_rows, value_states)
        self.keys = self.key_buffer[..., : cache.view_length, :]
        self.values = self.value_buffer[..., : cache.view_length, :]
        return self.keys, self.values

    def _resize(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        old_k, old_v = self.key_buffer, self.value_buffer
        self.key_buffer = keys.new_zeros((*keys.shape[:-2], capacity, keys.shape[-1]))
        self.value_buffer = values.new_zeros((*values.shape[:-2], capacity, values.shape[-1]))
        if old_k is not None and old_k.shape[:-2] == keys.shape[:-2] and old_k.dtype == keys.dtype:
            held = min(old_k.shape[-2], capacity)
            self.key_buffer[..., :held, :].copy_(old_k[..., :held, :])
            self.value_buffer[..., :held, :].copy_(old_v[..., :held, :])
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy rows ``source`` to rows ``destination`` (gathered first, so ranges may overlap)."""
        if self.key_buffer is None:
            return
        for buf in (self.key_buffer, self.value_buffer):
            buf.index_copy_(-2, destination, buf.index_select(-2, source))

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._cache.view_length


class PackedCache(DynamicCache):
    """A ``DynamicCache`` whose layers hold every request's region of one buffer (see the module
    docstring). Before each forward the runner says where the new rows go (:attr:`write_rows`) and
    how many columns the attention reads (:attr:`view_length`)."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.view_length = 0
        self.write_rows: torch.Tensor = torch.zeros(0, dtype=torch.long)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_PackedLayer(self))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.view_length

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        for layer in self.layers:
            layer.move(source, destination)


class BatchRunner(ModelRunner):
    """Runs forwards of several requests' rows over one :class:`PackedCache`.

    Regions are handed out first-fit; the buffer grows (by doubling, copying what it holds) when
    no free stretch fits a new request, which a caller avoids by reserving enough at the start
    (:meth:`reserve`).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        # GPT-2's eager attention in older transformers releases masks by a causal buffer indexed
        # by cache position, which assumes a forward's rows sit at the end of the cache: true for
        # one request, not for a packed batch
        legacy = [name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool and buffer.dim() == 4
                  and buffer.shape[0] == buffer.shape[1] == 1 and buffer.shape[2] == buffer.shape[3]]
        if legacy and self.mask_kind == "additive":
            raise UnsupportedModelError(
                f"{type(model).__name__}'s eager attention applies its own causal mask from the buffer {legacy[0]!r} "
                "by cache position, which a packed batch does not follow; load the model with "
                "attn_implementation='sdpa' (or use a newer transformers release) to decode it in batches")
        self.packed = PackedCache()
        self.regions: list[Region] = []
        self.rider_tensors = []
        #: cache rows to move (source, destination) before the next forward: what :meth:`keep`
        #: asked, carried in that forward's one upload instead of an upload per request
        self._moves: tuple[list[int], list[int]] = ([], [])

    # -- regions ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every region (a new batch starts; the buffers are kept for it)."""
        self.regions.clear()
        self._moves = ([], [])

    def reserve(self, rows: int) -> None:
        """Make the buffer at least ``rows`` long (allocated at the next forward)."""
        self.packed.capacity = max(self.packed.capacity, int(rows))

    def allocate(self, capacity: int) -> Region:
        """A region of ``capacity`` rows for a new request (first fit; the buffer grows if none fits)."""
        capacity = int(capacity)
        at = 0
        for region in sorted(self.regions, key=lambda r: r.start):
            if region.start - at >= capacity:
                break
            at = max(at, region.end)
        if at + capacity > self.packed.capacity:
            self.packed.capacity = max(at + capacity, 2 * self.packed.capacity)
        region = Region(at, capacity)
        self.regions.append(region)
        return region

    def release(self, region: Region) -> None:
        """The request of ``region`` ended: its rows are free for the next one."""
        if not region.released:
            region.released = True
            self.regions.remove(region)
            # its pending moves are moot, and must not land in rows a new request writes first
            kept = [(a, b) for a, b in zip(*self._moves) if not region.start <= b < region.end]
            self._moves = ([a for a, _ in kept], [b for _, b in kept])

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_segments(self, segments: Sequence[Segment], riders: Sequence[np.ndarray] = ()) -> torch.Tensor:
        """One forward of every segment's rows; returns the logits of their ``logit_rows``, segment
        after segment, ``[sum of logit rows, vocab]``. Each segment's rows are written after its
        region's committed tokens; call :meth:`keep` (a tree) or :meth:`keep_all` (a prompt chunk)
        for each segment next. ``riders`` travel in the same upload (see :attr:`rider_tensors`)."""
        if not segments:
            raise ValueError("a batched forward needs at least one segment")
        total = sum(len(s.tokens) for s in segments)
        ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        write_rows = np.empty(total, dtype=np.int64)
        keep_rows: list[int] = []
        spans: list[tuple[int, int, int, int]] = []
        width = 0
        at = 0
        for seg in segments:
            q, region = len(seg.tokens), seg.region
            if region.released:
                raise ValueError("a segment's region was released")
            if region.length + q > region.capacity:
                raise ValueError(f"a segment of {q} rows does not fit its region ({region.length} of "
                                 f"{region.capacity} rows used)")
            ids[at : at + q] = seg.tokens
            positions[at : at + q] = seg.positions
            write_rows[at : at + q] = np.arange(region.start + region.length, region.start + region.length + q)
            keep_rows.extend(at + int(r) for r in seg.logit_rows)
            spans.append((at, at + q, region.start, region.start + region.length + q))
            width = max(width, region.start + region.length + q)
            at += q
        limit = self.max_positions
        if limit is not None and int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} exceeds the model's context of {limit} tokens")
        masks = self._segment_masks(segments, positions, total, width)
        kinds = list(masks)
        sources, destinations = self._moves
        self._moves = ([], [])
        parts = upload([ids.reshape(1, total), positions.reshape(1, total), write_rows,
                        np.asarray(keep_rows, dtype=np.int64), np.asarray(sources, dtype=np.int64),
                        np.asarray(destinations, dtype=np.int64), *[masks[k] for k in kinds], *riders], self.device)
        ids_t, positions_t, write_t, keep_t, source_t, destination_t = parts[:6]
        mask_ts = parts[6 : 6 + len(kinds)]
        self.rider_tensors = parts[6 + len(kinds):]
        if sources:
            self.packed.move(source_t, destination_t)  # the last step's accepted rows, down into place
        self.packed.write_rows = write_t
        self.packed.view_length = width
        model_masks = {k: self._as_model_mask(m) for k, m in zip(kinds, mask_ts)}
        mask = model_masks[""] if kinds == [""] else model_masks
        kwargs: dict = {self._cache_keyword: self.packed}
        if getattr(self.model.config, "_attn_implementation", None) == PACKED_NAME:
            kwargs[LAYOUT_KEYWORD] = PackedLayout(spans)  # each request's rows against its own columns only
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep_t
        out = self.model(input_ids=ids_t, position_ids=positions_t, attention_mask=mask, use_cache=True, **kwargs)
        logits = out.logits[0] if self._takes_logits_to_keep else out.logits[0].index_select(0, keep_t)
        for seg in segments:
            seg.region.pending = len(seg.tokens)
        return _logits_for_decoding(logits)

    def _segment_masks(self, segments: Sequence[Segment], positions: np.ndarray, total: int, width: int
                       ) -> dict[str, np.ndarray]:
        """``allowed[row, column]`` per layer kind (full attention, sliding window): each row sees
        its region's committed tokens (inside the window, where the model has one) and its block."""
        masks: dict[str, np.ndarray] = {}
        for kind, window in self._layer_windows.items():
            allowed = np.zeros((total, width), dtype=bool)
            at = 0
            for seg in segments:
                q, region = len(seg.tokens), seg.region
                rows = slice(at, at + q)
                new = slice(region.start + region.length, region.start + region.length + q)
                block = np.asarray(seg.block, dtype=bool)
                q_pos = positions[rows]
                if window is None:
                    allowed[rows, region.start : region.start + region.length] = True
                else:
                    k_pos = np.arange(region.length)
                    allowed[rows, region.start : region.start + region.length] = \
                        (q_pos[:, None] - k_pos[None, :]) < window
                    block = block & ((q_pos[:, None] - q_pos[None, :]) < window)
                allowed[rows, new] = block
                at += q
            masks[kind] = allowed
        return masks

    @torch.inference_mode()
    def keep(self, region: Region, keep: Sequence[int]) -> None:
        """After a forward: keep the rows ``keep`` of ``region``'s segment (increasing indices, as a
        tree path is) as its next committed tokens, moved down in place; drop the rest."""
        keep = [int(k) for k in keep]
        if any(not 0 <= k < region.pending for k in keep) or any(b <= a for a, b in zip(keep, keep[1:])):
            raise ValueError(f"keep {keep} must index the {region.pending} rows of the last forward, increasing")
        base = region.start + region.length
        for i, k in enumerate(keep):
            if k != i:  # moved at the start of the next forward, with every request's moves at once
                self._moves[0].append(base + k)
                self._moves[1].append(base + i)
        region.length += len(keep)
        region.pending = 0

    def keep_all(self, region: Region) -> None:
        """After a forward: the segment's rows (a prompt chunk) are all committed, where they are."""
        region.length += region.pending
        region.pending = 0

