"""The model side of a step: one forward of every request's new rows over the KV store.

Everything here goes through public transformers APIs on a stock, unpatched model: a 4D attention
mask, explicit ``position_ids``, ``logits_to_keep`` and a ``DynamicCache`` subclass
(:class:`~specdraft.model.kv_store.KVStore`) whose layers are written and compacted in place. That
is what keeps specdraft working across transformers releases where peers patch modeling files.

Facts this module relies on (checked on transformers 4.56 to 5.24):

* a 4D mask reaches every layer unchanged; ``sdpa`` takes a bool mask, ``eager`` needs an
  additive float mask (a bool mask is silently wrong there), so eager always gets additive;
* HF's flash-attention integration misreads a tree mask as padding, so ``flash_attention_2`` is
  refused here (specdraft's own flash backend plugs in through the attention registry instead);
* sliding-window caches keep only the window and reject a full-width mask, so the store is a plain
  ``DynamicCache`` and the window is written into the mask (:mod:`specdraft.model.masks`); models
  mixing full and sliding layers receive a dict of masks keyed by layer type.

A forward's input is a list of :class:`Segment` (one request's rows each: a tree with its side
blocks, or a chunk of its prompt); its output is a :class:`ForwardOutput`. Everything the forward
needs from the host (ids, positions, row layout, the trees' blocks, the last step's cache moves
and the caller's riders) goes to the device in one upload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from .compat import cache_keyword, forward_parameters
from .attention import FLASH_NAME
from .exact_attention import EXACT_NAME
from .flash_kernels import FLASH_LAYOUT_KEYWORD
from .kv_store import KVStore, Region, Writes
from .masks import RowLayout, flash_layout, layer_masks
from .packed_attention import LAYOUT_KEYWORD, PACKED_NAME, PackedLayout
from .static import PLAN_FIELDS, WIDTHS, StaticForwards, static_forward
from .transfer import upload

#: Attention implementations that take our 4D tree mask correctly, with the mask kind they need
#: ("specdraft_split" is our own split + merge backend, see attention.py).
_MASK_KIND = {"sdpa": "bool", "eager": "additive", FLASH_NAME: "bool", PACKED_NAME: "bool", EXACT_NAME: "bool"}


class UnsupportedModelError(ValueError):
    """The model cannot be decoded losslessly by specdraft (and we say why rather than guess)."""


def _text_config(model: PreTrainedModel):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def context_limit(model: PreTrainedModel) -> int | None:
    """The most positions the model can attend over (``max_position_embeddings``, or GPT-2's
    ``n_positions``); ``None`` when its config does not say."""
    if getattr(model, "config", None) is None:
        return None
    text = _text_config(model)
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


@dataclass
class Segment:
    """One request's rows in a forward.

    ``positions`` are the rows' absolute token positions; ``block[i, j]`` says whether new row
    ``i`` sees new row ``j`` (a tree and its side blocks), or ``None`` for a prompt chunk, whose
    rows see each other causally; every row also sees its region's committed tokens.
    ``logit_rows`` are the rows whose logits the caller needs (a tree: all; a prompt chunk: its
    last row when it ends the prompt, else none).
    """

    region: Region
    tokens: Sequence[int]
    positions: np.ndarray
    block: np.ndarray | None
    logit_rows: Sequence[int]


@dataclass(frozen=True)
class ForwardOutput:
    """What a forward gives back, on the device: the logits of every segment's ``logit_rows``,
    segment after segment (``logit_spans[s]`` is segment ``s``'s slice of them), the forward's
    input ids (``id_spans[s]``: segment ``s``'s slice), and the caller's riders."""

    logits: torch.Tensor
    logit_spans: list[slice]
    ids: torch.Tensor
    id_spans: list[slice]
    riders: list[torch.Tensor]


class ModelRunner:
    """Runs forwards of segments over one :class:`~specdraft.model.kv_store.KVStore` (see the
    module docstring); the store's regions are the requests' caches."""

    def __init__(self, model: PreTrainedModel) -> None:
        config = model.config
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedModelError(
                f"{type(model).__name__} is an encoder-decoder model; specdraft decodes causal LMs only "
                "(load with AutoModelForCausalLM)")
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no language-modeling head; load the model with AutoModelForCausalLM")
        if not (hasattr(model, "can_generate") and model.can_generate()):
            raise UnsupportedModelError(
                f"{type(model).__name__} is not a causal language model that can generate (e.g. a masked LM); "
                "load a decoder with AutoModelForCausalLM")
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in _MASK_KIND:
            raise UnsupportedModelError(
                f"attention implementation {impl!r} cannot take a tree mask losslessly; load the model with "
                f"attn_implementation='sdpa' or 'eager' (supported: "
                f"{sorted(k for k in _MASK_KIND if k not in (PACKED_NAME, EXACT_NAME))})")
        self.model = model
        text = _text_config(model)
        self.vocab_size: int = int(text.vocab_size)
        self.max_positions: int | None = context_limit(model)
        self.windows = _layer_windows(text)
        self.has_sliding_window = any(w is not None for w in self.windows.values())
        self._takes_logits_to_keep = "logits_to_keep" in forward_parameters(model)
        #: ``cache`` from transformers 5.24, ``past_key_values`` before (see :mod:`specdraft.model.compat`)
        self._cache_keyword = cache_keyword(model)
        #: buffers of GPT-2's eager attention in older transformers releases, which mask by a causal
        #: buffer indexed by cache position: right only while a forward's rows sit at the end of the
        #: cache, i.e. for one region at row 0
        self._legacy_causal = [name for name, buffer in model.named_buffers() if buffer.dtype == torch.bool
                               and buffer.dim() == 4 and buffer.shape[0] == buffer.shape[1] == 1
                               and buffer.shape[2] == buffer.shape[3]]
        self.store = KVStore()
        #: the store's region for pad rows (see :meth:`forward`), made at the first padded forward
        self._scratch: Region | None = None
        #: the pad rows' positions and block per number of pad rows (see :meth:`_pad_segment`)
        self._pad_arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        #: decode forwards at fixed widths over static buffers (:meth:`use_static`); ``None``: eager
        self.static: StaticForwards | None = None

    @property
    def device(self) -> torch.device:
        """Where the model's inputs go (its first parameter's device)."""
        return self.model.device

    def use_static(self, widths: Sequence[int] = WIDTHS, capture: bool | None = None,
                   graph_kind: Callable[[Callable[[], torch.Tensor]], Any] | None = None,
                   compile_backend: str | Callable[..., Any] | None = None) -> StaticForwards:
        """Run decode forwards at the fixed ``widths`` (the caller pads them there) over static
        buffers, each width captured as a CUDA graph where it can be, and compiled by
        ``torch.compile`` with ``compile_backend`` if one is named (:mod:`specdraft.model.static`)."""
        self.static = StaticForwards(self.device, widths, capture, graph_kind, compile_backend)
        return self.static

    @property
    def flash_layouts(self) -> bool:
        """Whether forwards hand the flash split its layout (:mod:`specdraft.model.flash_kernels`):
        on the flash backend without sliding windows (a windowed prefix is masked, so the split
        reads the mask there)."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        return impl == FLASH_NAME and not self.has_sliding_window

    @property
    def mask_kind(self) -> str:
        impl = getattr(self.model.config, "_attn_implementation", None) or "eager"
        return _MASK_KIND.get(impl, "bool")

    # -- the forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], riders: Sequence[np.ndarray] = (),
                padding: Callable[[int], int] | None = None) -> ForwardOutput:
        """One forward of every segment's rows (see the module docstring). Each segment's rows are
        written after its region's committed tokens; call :meth:`KVStore.keep` (a tree) or
        :meth:`KVStore.keep_all` (a prompt chunk) for each segment next.

        ``padding(k)`` gives the rows a forward of ``k`` rows runs at (a fixed width: the same
        kernels for a plain step and a tree, or one shape per captured graph): pad rows are
        added in a scratch region of the store, each seeing only itself and seen by nobody, and
        the rows whose logits are computed are padded the same way."""
        if not segments:
            raise ValueError("a forward needs at least one segment")
        if padding is not None:
            total = sum(len(s.tokens) for s in segments)
            if padding(total) > total:
                segments = [*segments, self._pad_segment(padding(total) - total)]
        plan = _Plan.of(segments, self.max_positions)
        if padding is not None:
            plan.pad_kept(padding(len(plan.keep_rows)))
        if len(segments) > 1 or segments[0].region.start != 0:
            self.check_batches()
        if self.static is not None and all(s.block is not None for s in segments) \
                and self.static.holds(plan.total, riders, self.store.pending_moves) \
                and len(plan.keep_rows) == plan.total:
            scratch = self._scratch_region(1)  # before the test: a new scratch region may grow the store
            if not self.store.needs_growth():
                return self._static_forward(segments, plan, riders, scratch)
        moves = np.asarray(self.store.take_moves(), dtype=np.int64)  # [2, moves]: sources, destinations
        table, keep_rows, moves, tree_rows, tree_block, *rider_tensors = upload(
            [plan.table, plan.keep_rows, moves, plan.tree_rows, plan.tree_block, *riders], self.device)
        ids, positions, write_columns, region_start, region_length, segment = table  # PLAN_FIELDS, in order
        if moves.shape[1]:
            self.store.apply_moves(moves[0], moves[1])  # the last step's accepted rows, into place
        contiguous = plan.contiguous_span()
        self.store.writes = Writes(None if contiguous else write_columns, contiguous, plan.width,
                                   plan.width - plan.total)
        kwargs: dict = {self._cache_keyword: self.store}
        mask = None
        if not self._needs_no_mask(segments):
            layout = RowLayout(positions, region_start, region_length, segment, write_columns,
                               tree_rows if plan.tree_rows.size else None, tree_block if plan.tree_rows.size else None)
            mask = layer_masks(layout, plan.width, self.windows, self.mask_kind, self.model.dtype)
            if getattr(self.model.config, "_attn_implementation", None) == PACKED_NAME:
                kwargs[LAYOUT_KEYWORD] = PackedLayout(plan.spans)  # each request's rows against its own columns
            elif self.flash_layouts:
                kwargs[FLASH_LAYOUT_KEYWORD] = flash_layout(layout, plan.spans)
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep_rows
        try:
            out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, use_cache=True,
                             **kwargs)
        finally:
            self.store.writes = None
        logits = out.logits[0] if self._takes_logits_to_keep else out.logits[0].index_select(0, keep_rows)
        return self._output(segments, plan, logits, ids, rider_tensors)

    def _static_forward(self, segments: Sequence[Segment], plan: "_Plan", riders: Sequence[np.ndarray],
                        scratch: Region) -> ForwardOutput:
        """A decode forward at a bucket width: packed into the static buffers in one copy, then
        the bucket's graph replayed (or run eagerly); unused move slots move ``scratch``'s row."""
        static = self.static
        forward = static_forward(self.model, self.store, self.windows, self.mask_kind, self._cache_keyword,
                                 self.store.capacity, self.flash_layouts, static.model_pass)
        for width in static.uncaptured(self.store):
            if width <= scratch.capacity:  # (a wider one would move the scratch region: at its first use)
                self._capture_on_pad_rows(width, scratch, forward)
        rider_tensors = static.pack(plan, self.store.take_moves(), scratch.start, riders)
        logits = static.run(plan.total, forward, self.store)
        return self._output(segments, plan, logits, static.views(plan.total)[0]["ids"], rider_tensors)

    def _output(self, segments: Sequence[Segment], plan: "_Plan", logits: torch.Tensor, ids: torch.Tensor,
                riders: list[torch.Tensor]) -> ForwardOutput:
        """A forward's output; its segments' new rows are now pending (pad rows never are: never kept)."""
        for seg in segments:
            seg.region.pending = len(seg.tokens)
        if self._scratch is not None:
            self._scratch.pending = 0
        return ForwardOutput(_logits_for_decoding(logits), plan.logit_spans, ids, plan.id_spans, riders)

    def _capture_on_pad_rows(self, width: int, scratch: Region, forward: Callable[..., torch.Tensor]) -> None:
        """Capture the forward of ``width`` over pad rows alone (they write to the scratch region
        only, and no cache move is due), so that the widths a decoder uses are captured together
        before its first tree instead of one by one in the middle of answers (on an H100 a
        capture costs tens of milliseconds, a request's tokens about 4 each)."""
        plan = _Plan.of([self._pad_segment(width)], self.max_positions)
        plan.pad_kept(width)
        self.static.pack(plan, ([], []), scratch.start, [])
        self.static.run(width, forward, self.store)
        scratch.pending = 0

    def _scratch_region(self, rows: int) -> Region:
        """The store's region for pad rows, with room for ``rows``."""
        scratch = self._scratch
        if scratch is None or scratch not in self.store.regions or scratch.capacity < rows:
            if scratch is not None and scratch in self.store.regions:
                self.store.release(scratch)
            scratch = self._scratch = self.store.allocate(max(rows, 64))
        return scratch

    def _pad_segment(self, rows: int) -> Segment:
        """``rows`` pad rows in the store's scratch region: token 0 at position 0, each seeing itself."""
        scratch = self._scratch_region(rows)
        arrays = self._pad_arrays.get(rows)
        if arrays is None:  # made once per width (read only): a step pads to one of a few widths
            arrays = self._pad_arrays[rows] = (np.zeros(rows, dtype=np.int64), np.eye(rows, dtype=bool))
        return Segment(scratch, [0] * rows, arrays[0], arrays[1], [])

    def _needs_no_mask(self, segments: Sequence[Segment]) -> bool:
        """Whether the model's own causal attention is already right: one request at row 0, with no
        sliding window, running one row over its whole cache or its whole prompt from scratch
        (the model's fast, maskless path, as ``model.generate`` runs it)."""
        if len(segments) != 1 or self.has_sliding_window or segments[0].region.start != 0:
            return False
        seg = segments[0]
        return seg.region.length == 0 if seg.block is None else len(seg.tokens) == 1

    @property
    def batches_supported(self) -> bool:
        """Whether several requests' rows can share a forward (see :meth:`check_batches`)."""
        return not self._legacy_causal

    def check_batches(self) -> None:
        """Raise :class:`UnsupportedModelError` if the model cannot run several requests' rows in one
        forward (its attention masks by position in the cache on its own)."""
        if not self.batches_supported:
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s eager attention applies its own causal mask from the buffer "
                f"{self._legacy_causal[0]!r} by cache position, which a batch of requests does not follow; load the "
                "model with attn_implementation='sdpa' (or use a newer transformers release) to decode it in batches")


@dataclass
class _Plan:
    """A forward's rows laid out on the host: what :meth:`ModelRunner.forward` uploads. The
    per-row fields are the rows of one ``[len(PLAN_FIELDS), rows]`` table (:data:`PLAN_FIELDS`),
    filled segment by segment with one slice assignment each: this runs between a step's read and
    the next launch, where every small numpy call counts."""

    table: np.ndarray
    keep_rows: np.ndarray
    tree_rows: np.ndarray
    tree_block: np.ndarray
    spans: list[tuple[int, int, int, int]]
    logit_spans: list[slice]
    id_spans: list[slice]
    width: int

    @property
    def total(self) -> int:
        return self.table.shape[1]

    @classmethod
    def of(cls, segments: Sequence[Segment], max_positions: int | None) -> "_Plan":
        total = sum(len(s.tokens) for s in segments)
        table = np.empty((len(PLAN_FIELDS), total), dtype=np.int64)
        ids, positions, write_columns = table[0], table[1], table[2]
        regions = table[PLAN_FIELDS.index("region_start"):]  # start, length, segment: in this order
        keep_rows: list[np.ndarray] = []
        blocks: list[np.ndarray] = []
        spans, logit_spans, id_spans = [], [], []
        width = at = kept = 0
        for index, seg in enumerate(segments):
            q, region = len(seg.tokens), seg.region
            if region.released:
                raise ValueError("a segment's region was released")
            if q == 0:
                raise ValueError("a segment needs at least one row")
            if region.length + q > region.capacity:
                raise ValueError(f"a segment of {q} rows does not fit its region ({region.length} of "
                                 f"{region.capacity} rows used)")
            rows = slice(at, at + q)
            first = region.start + region.length
            ids[rows] = seg.tokens
            positions[rows] = seg.positions
            write_columns[rows] = np.arange(first, first + q)
            regions[:, rows] = ((region.start,), (region.length,), (index,))
            if seg.block is not None:
                blocks.append(np.asarray(seg.block, dtype=bool))
            logit_rows = seg.logit_rows
            if isinstance(logit_rows, range) and logit_rows.step == 1:
                keep_rows.append(np.arange(at + logit_rows.start, at + logit_rows.stop, dtype=np.int64))
            elif len(logit_rows):
                keep_rows.append(np.asarray(logit_rows, dtype=np.int64) + at)
            logit_spans.append(slice(kept, kept + len(logit_rows)))
            kept += len(logit_rows)
            id_spans.append(rows)
            spans.append((at, at + q, region.start, first + q))
            width = max(width, first + q)
            at += q
        if max_positions is not None and int(positions.max()) >= max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds the model's context of {max_positions} tokens")
        if len(blocks) == len(segments):  # every segment a tree
            tree = np.arange(total, dtype=np.int64)
        else:
            tree = np.concatenate([np.arange(s, e, dtype=np.int64) for (s, e, _, _), seg in zip(spans, segments)
                                   if seg.block is not None] or [np.zeros(0, dtype=np.int64)])
        keep = keep_rows[0] if len(keep_rows) == 1 else np.concatenate(keep_rows) if keep_rows \
            else np.zeros(0, dtype=np.int64)
        return cls(table, keep, tree, _block_diagonal(blocks), spans, logit_spans, id_spans, width)

    def pad_kept(self, rows: int) -> None:
        """Compute logits for ``rows`` rows (the last rows of the forward are added to those kept)."""
        extra = rows - len(self.keep_rows)
        if extra > 0:
            self.keep_rows = np.concatenate([self.keep_rows, np.arange(self.total - extra, self.total, dtype=np.int64)])

    def contiguous_span(self) -> tuple[int, int] | None:
        """(first, end) when the new rows are written to one run of consecutive buffer rows."""
        columns = self.table[PLAN_FIELDS.index("write")]
        first = int(columns[0])
        if int(columns[-1]) - first + 1 == len(columns) and (len(columns) == 1 or bool(np.all(np.diff(columns) == 1))):
            return first, first + len(columns)
        return None


def _block_diagonal(blocks: list[np.ndarray]) -> np.ndarray:
    if len(blocks) == 1:
        return blocks[0]
    n = sum(len(b) for b in blocks)
    out = np.zeros((n, n), dtype=bool)
    at = 0
    for block in blocks:
        out[at : at + len(block), at : at + len(block)] = block
        at += len(block)
    return out


def _layer_windows(text) -> dict[str, int | None]:
    """Each attention layer type's sliding window (``None``: full attention); the key ``""``
    stands for every layer when the model does not mix types."""
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        unknown = kinds - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedModelError(
                f"layer types {sorted(unknown)} are not supported yet (supported: full_attention, sliding_attention)")
        if "sliding_attention" in kinds and not window:
            raise UnsupportedModelError("the config has sliding_attention layers but no sliding_window size")
        return {k: (window if k == "sliding_attention" else None) for k in kinds}
    if window and getattr(text, "use_sliding_window", True):
        return {"": int(window)}  # e.g. Mistral: one window applies to every layer
    return {"": None}


def _logits_for_decoding(logits: torch.Tensor) -> torch.Tensor:
    """Logits as decoding compares them: float32, as ``model.generate`` takes them. A float32,
    bfloat16 or float16 model's logits are returned as they are (float32 holds them exactly, so an
    argmax or top-k gives the same ids without a full-width cast every step); a float64 model's
    are rounded to float32, as ``model.generate`` rounds them (its greedy ties are float32 ties)."""
    return logits if logits.dtype in (torch.float32, torch.bfloat16, torch.float16) else logits.to(torch.float32)
