"""The KV cache as a store of regions: allocate, write, keep a path, release.

Every request owns a *region* of one buffer per layer: rows ``[start, start + capacity)``, of which
the first ``length`` hold its committed tokens (slot ``i`` holds position ``i``). A forward writes
each request's new rows right after its committed ones; after verification the request keeps
the rows of its accepted path (:meth:`KVStore.keep`) and the rest are overwritten by the next
forward. One request is the special case of one region at row 0: its rows are contiguous and
every write is a plain slice copy, exactly what a single-sequence cache does.

The compaction rule (one, for one request or many): the accepted rows are moved down to the slots
right after the region's committed tokens at the start of the next forward, all requests' moves
in one gather and one scatter per layer. The work is O(accepted tokens), whatever the context, and
nothing is copied whole; deferring the moves lets them ride the next forward's single upload.

The store is a transformers ``DynamicCache`` (public ``Cache`` API: ``update``, ``get_seq_length``,
``layers``), so the model stays unpatched. The buffers are kept across requests and grow by
doubling when a region does not fit; a caller avoids that by reserving enough at the start
(:meth:`KVStore.reserve`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass
class Region:
    """A request's part of the store: rows ``[start, start + capacity)`` of every layer's buffer,
    of which the first ``length`` hold its committed tokens."""

    start: int
    capacity: int
    length: int = 0
    #: rows the last forward wrote after ``length`` (kept or dropped by :meth:`KVStore.keep`)
    pending: int = 0
    released: bool = False

    @property
    def end(self) -> int:
        return self.start + self.capacity

    @property
    def free(self) -> int:
        """Rows still free after the committed ones."""
        return self.capacity - self.length


@dataclass(frozen=True)
class Writes:
    """Where one forward's new rows go: ``rows`` (a device tensor of buffer rows, in the order of
    the forward's tokens) or, when they are one consecutive run, ``span`` (first, end) for a slice
    copy; ``view`` is how many buffer rows the attention reads; ``past`` the rows that count as
    already seen (what ``get_seq_length`` reports while the forward runs)."""

    rows: torch.Tensor | None
    span: tuple[int, int] | None
    view: int
    past: int


def _holds(buffer: torch.Tensor | None, states: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold rows of ``states``: same heads, head size, dtype and device."""
    return buffer is not None and buffer.shape[:-2] == states.shape[:-2] and buffer.dtype == states.dtype \
        and buffer.device == states.device


class _StoreLayer(DynamicLayer):
    """One layer's keys and values for every region, in one buffer written in place."""

    def __init__(self, store: "KVStore") -> None:
        super().__init__()
        self._store = store
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        store = self._store
        writes = store.writes
        if writes is None:
            raise RuntimeError("the KV store was written outside a forward of the model runner")
        if not _holds(self.key_buffer, key_states) or self.key_buffer.shape[-2] < store.capacity:
            self._resize(key_states, value_states, store.capacity)
        for buffer, states in ((self.key_buffer, key_states), (self.value_buffer, value_states)):
            if writes.span is not None:
                buffer[..., writes.span[0] : writes.span[1], :].copy_(states)
            else:
                buffer.index_copy_(-2, writes.rows, states)
        self.keys = self.key_buffer[..., : writes.view, :]
        self.values = self.value_buffer[..., : writes.view, :]
        return self.keys, self.values

    def _resize(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """A buffer of ``capacity`` rows, keeping what the old one held when its layout matches."""
        old_k, old_v = self.key_buffer, self.value_buffer
        self.key_buffer = keys.new_zeros((*keys.shape[:-2], capacity, keys.shape[-1]))
        self.value_buffer = values.new_zeros((*values.shape[:-2], capacity, values.shape[-1]))
        if _holds(old_k, keys):
            held = min(old_k.shape[-2], capacity)
            self.key_buffer[..., :held, :].copy_(old_k[..., :held, :])
            self.value_buffer[..., :held, :].copy_(old_v[..., :held, :])
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._store._buffers = None  # the buffers moved

    def move(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Copy rows ``source`` to rows ``destination`` (gathered first, so ranges may overlap)."""
        if self.key_buffer is None:
            return
        for buffer in (self.key_buffer, self.value_buffer):
            buffer.index_copy_(-2, destination, buffer.index_select(-2, source))

    def get_seq_length(self, *args, **kwargs) -> int:
        return self._store.get_seq_length()


class KVStore(DynamicCache):
    """Regions of one buffer per layer (see the module docstring).

    The model runner says, before each forward, where the new rows go (:attr:`writes`, ``None``
    outside a forward);
    the layers write there and hand the attention a view of the first ``view`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 0
        self.regions: list[Region] = []
        self.writes: Writes | None = None
        #: every region starts at a multiple of this (exact attention at fixed shapes reads a
        #: region's committed tokens in place, chunk by chunk, when its start is a chunk boundary)
        self.align = 1
        #: accepted rows to move (source, destination) before the next forward writes
        self._moves: tuple[list[int], list[int]] = ([], [])
        #: (layers, rows every layer's buffer holds, the buffers' addresses), remembered until a
        #: buffer is reallocated: each step asks both, and a walk of every layer costs microseconds
        self._buffers: tuple[int, int, tuple[int, ...]] | None = None

    # -- the Cache API the model calls -----------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_StoreLayer(self))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int | None = 0, *args, **kwargs) -> int:
        return self.writes.past if self.writes is not None else 0

    # -- regions ------------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget every region (the buffers are kept for what comes next)."""
        self.regions.clear()
        self._moves = ([], [])

    def reserve(self, rows: int) -> None:
        """Make the buffers at least ``rows`` long (allocated at the next forward)."""
        self.capacity = max(self.capacity, int(rows))

    def allocate(self, capacity: int) -> Region:
        """A region of ``capacity`` rows starting at a multiple of :attr:`align` (first fit; the
        buffers grow when none fits)."""
        capacity = int(capacity)
        if capacity < 1:
            raise ValueError(f"a region needs at least one row, got {capacity}")
        at = 0
        for region in sorted(self.regions, key=lambda r: r.start):
            if region.start - at >= capacity:
                break
            at = -(-max(at, region.end) // self.align) * self.align
        if at + capacity > self.capacity:
            self.capacity = max(at + capacity, 2 * self.capacity)
        region = Region(at, capacity)
        self.regions.append(region)
        return region

    def release(self, region: Region) -> None:
        """The region's request ended: its rows are free for the next one."""
        if region.released:
            return
        region.released = True
        self.regions.remove(region)
        # its pending moves are moot, and must not land in rows a new request writes first
        kept = [(a, b) for a, b in zip(*self._moves) if not region.start <= b < region.end]
        self._moves = ([a for a, _ in kept], [b for _, b in kept])

    # -- compaction ---------------------------------------------------------------------------

    def keep(self, region: Region, path: list[int]) -> None:
        """After a forward: keep the rows ``path`` of the region's new rows (increasing indices,
        as a tree path is) as its next committed tokens; drop the rest."""
        if any(not 0 <= k < region.pending for k in path) or any(b <= a for a, b in zip(path, path[1:])):
            raise ValueError(f"keep {path} must index the {region.pending} rows of the last forward, increasing")
        base = region.start + region.length
        for i, k in enumerate(path):
            if k != i:
                self._moves[0].append(base + k)
                self._moves[1].append(base + i)
        region.length += len(path)
        region.pending = 0

    def keep_all(self, region: Region) -> None:
        """After a forward: every new row of the region (a prompt chunk) is committed where it is."""
        region.length += region.pending
        region.pending = 0

    @property
    def pending_moves(self) -> int:
        """How many rows :meth:`take_moves` would hand over now."""
        return len(self._moves[0])

    def take_moves(self) -> tuple[list[int], list[int]]:
        """The moves :meth:`keep` asked for since the last forward (and forget them)."""
        moves, self._moves = self._moves, ([], [])
        return moves

    def apply_moves(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """Move the accepted rows down into place (before the forward writes its new rows)."""
        for layer in self.layers:
            layer.move(source, destination)

    def _held(self) -> tuple[int, int, tuple[int, ...]]:
        """(layers, rows every layer's buffer holds, the buffers' addresses); see :attr:`_buffers`."""
        held = self._buffers
        if held is None or held[0] != len(self.layers):
            buffers = [layer.key_buffer for layer in self.layers]
            rows = min((b.shape[-2] if b is not None else -1 for b in buffers), default=-1)
            held = self._buffers = (len(buffers), rows, tuple(b.data_ptr() if b is not None else 0 for b in buffers))
        return held

    def needs_growth(self) -> bool:
        """Whether the next write will reallocate the buffers (a region past their end)."""
        return not self.layers or self._held()[1] < self.capacity

    def layout_key(self) -> tuple:
        """Where the buffers are: a captured graph that wrote elsewhere must be captured again."""
        return (self.capacity, *self._held()[2])
