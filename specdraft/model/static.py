"""Decode forwards at fixed widths over preallocated device buffers, each width captured once as a
CUDA graph where it can be.

Why
    An eager forward of a small model on a GPU is bound by kernel launches: measured on an H200,
    the 0.5B model's forward costs about 14 ms whether it checks 1 row or 64, several times what
    the arithmetic needs. A CUDA graph replays a whole forward's launches at once, but it replays
    fixed shapes at fixed addresses. So every decode forward runs at one of a few widths
    (:data:`WIDTHS`, the *buckets*), its inputs live in buffers allocated once (ids, positions,
    the rows' layout from which the mask is built, the last step's cache moves), the KV store is
    preallocated, and the mask covers the store's whole capacity: nothing in the forward depends
    on a host value. Each step packs its inputs on the host, copies them up in one transfer, and
    replays the bucket's graph (or runs it eagerly where capture is impossible, with the reason
    in :attr:`StaticForwards.note`).

When graphs are captured
    A capture runs the forward twice and records it once: tens of milliseconds, several of a
    request's tokens. So the widths a decoder's trees can fill (:attr:`StaticForwards.together`)
    are captured together, on pad rows alone, before its first decode forward runs, and again
    after the store's buffers move; a width outside them is captured at its first use.

Compiled
    With ``Decoder(compile=True)`` the model's part of the forward runs through ``torch.compile``
    before capture (:class:`CompiledPass`): a graph replays every kernel of the eager model, and
    the compiler fuses the small ones.

What runs here: forwards whose rows are all trees (decode steps). A prompt's chunks are as wide as
they come and run eagerly (:meth:`~specdraft.model.runner.ModelRunner.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .kv_store import KVStore, Writes
from .flash_kernels import FLASH_LAYOUT_KEYWORD
from .masks import RowLayout, flash_layout, layer_masks

#: The buckets: every decode forward runs at the smallest of these that holds its rows.
WIDTHS = (1, 8, 16, 32, 64)
#: int64 values the riders of one step may take (a larger step runs eagerly).
RIDER_CAPACITY = 1 << 14

#: The per-row fields of a forward's plan, in the order of the rows of its table
#: (:class:`~specdraft.model.runner.ModelRunner`'s plan fills them; the static buffers take them
#: in this order, in one copy).
PLAN_FIELDS = ("ids", "positions", "write", "region_start", "region_length", "segment")
#: The static buffer's int64 rows: first the plan's table, then the rows to keep, the cache moves
#: and the tree rows.
_FIELDS = PLAN_FIELDS + ("keep", "move_from", "move_to", "tree_rows")
_TABLE_ROWS = slice(0, len(PLAN_FIELDS))
_KEEP = _FIELDS.index("keep")
_MOVES = slice(_FIELDS.index("move_from"), _FIELDS.index("move_to") + 1)
_TREE_ROWS = _FIELDS.index("tree_rows")


@dataclass(frozen=True)
class Buckets:
    """The widths forwards are padded to (what :class:`~specdraft.engine.widths.Widths` asks)."""

    widths: tuple[int, ...] = WIDTHS
    #: a prompt's chunk shares a forward with trees (the chunk runs eagerly, the trees too then)
    mixes_prompts: bool = True

    def rows_for(self, k: int) -> int:
        """The smallest bucket holding ``k`` rows; wider forwards run as they are."""
        return next((w for w in self.widths if w >= k), k)

    def up_to(self, rows: int) -> tuple[int, ...]:
        """The buckets a forward of at most ``rows`` rows may run at."""
        return tuple(w for w in self.widths if w <= self.rows_for(rows))

    @property
    def widest(self) -> int:
        """The widest bucket: the budget keeps a decode forward's rows within it, since a wider
        one runs eagerly (on a GPU several times the price of a captured one)."""
        return self.widths[-1]


class StaticForwards:
    """The static buffers and the captured graphs of one model runner (see the module docstring)."""

    def __init__(self, device: torch.device, widths: Sequence[int] = WIDTHS, capture: bool | None = None,
                 graph_kind: Callable[[Callable[[], torch.Tensor]], Any] | None = None,
                 compile_backend: str | Callable[..., Any] | None = None) -> None:
        self.widths = tuple(sorted(widths))
        w = self.max_width = self.widths[-1]
        self._ints = 8 * w * len(_FIELDS)
        self._bools = w * w
        size = self._ints + self._bools + 8 * RIDER_CAPACITY
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)  # filled by one copy per step
        self.host = torch.zeros(size, dtype=torch.uint8)
        if device.type == "cuda" and torch.cuda.is_available():
            self.host = self.host.pin_memory()
        # numpy views of the host buffer, made once (each step writes through them)
        self._host_bytes = self.host.numpy()
        self._host_ints = self._host_bytes[: self._ints].view(np.int64).reshape(len(_FIELDS), w)
        self._host_block = self._host_bytes[self._ints : self._ints + self._bools].view(np.bool_).reshape(w, w)
        self._host_ints[_TREE_ROWS] = np.arange(w)  # every row of a decode forward is a tree row, in order
        ints = self.buffer[: self._ints].view(torch.int64).view(len(_FIELDS), w)
        self.fields = {name: ints[i] for i, name in enumerate(_FIELDS)}
        self.block = self.buffer[self._ints : self._ints + self._bools].view(torch.bool).view(w, w)
        self.capture = (device.type == "cuda" and torch.cuda.is_available()) if capture is None else capture
        #: why forwards run eagerly (empty while graphs are captured and replayed)
        self._capture_note = "" if self.capture else f"no CUDA graphs on {device.type}: eager forwards at fixed widths"
        #: what runs a forward's body: eagerly, or compiled by ``torch.compile`` (:class:`CompiledPass`)
        self.model_pass: Callable[..., torch.Tensor] = (CompiledPass(compile_backend) if compile_backend
                                                        else model_pass_eager)
        #: what a capture makes: :class:`CudaGraph`, or a stand-in to exercise capture on a CPU
        self._graph_kind = graph_kind or CudaGraph
        self._graphs: dict[int, Any] = {}
        self._views: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
        self._store_key: tuple | None = None
        #: the widths captured together, before the first forward that needs any of them (and
        #: again after the store's buffers move); a wider one is captured at its first use
        self.together: tuple[int, ...] = self.widths

    @property
    def note(self) -> str:
        """Why forwards run eagerly or uncompiled (empty while they run as asked)."""
        failure = getattr(self.model_pass, "failure", None)
        compiled = f"torch.compile failed ({failure}): uncompiled forwards" if failure else ""
        return "; ".join(n for n in (self._capture_note, compiled) if n)

    @property
    def captured(self) -> list[int]:
        """The widths whose forwards replay a captured graph."""
        return sorted(self._graphs)

    def holds(self, rows: int, riders: Sequence[np.ndarray], moves: int = 0) -> bool:
        """Whether a forward of ``rows`` (a bucket) with these riders and ``moves`` pending cache
        moves runs here."""
        return rows in self.widths and moves <= self.max_width \
            and sum(int(np.asarray(r).size) for r in riders) <= RIDER_CAPACITY

    # -- one step ---------------------------------------------------------------------------

    def pack(self, plan: Any, moves: tuple[list[int], list[int]], scratch_row: int, riders: Sequence[np.ndarray]
             ) -> list[torch.Tensor]:
        """Write the step's inputs into the host buffer and copy them up in one transfer; returns
        the riders on the device. Unused move slots move the scratch row onto itself. Only the
        first ``plan.total`` entries of a row field are written: a forward of that width reads
        no further (the move slots, read whole, are all written)."""
        n = plan.total
        ints, block = self._host_ints, self._host_block
        ints[_TABLE_ROWS, :n] = plan.table  # ids, positions, write, region start and length, segment
        ints[_KEEP, :n] = plan.keep_rows
        sources, destinations = moves
        if len(sources) > self.max_width:
            raise ValueError(f"{len(sources)} cache moves do not fit the {self.max_width} slots of the static buffers")
        ints[_MOVES] = scratch_row
        if sources:
            ints[_MOVES, : len(sources)] = (sources, destinations)
        block[:n, :n] = plan.tree_block
        at, out = self._ints + self._bools, []
        for rider in riders:  # (views of the device buffer: the one copy below fills them)
            rider = np.ascontiguousarray(rider, dtype=np.int64)
            self._host_bytes[at : at + rider.nbytes] = rider.reshape(-1).view(np.uint8)
            out.append(self.buffer[at : at + rider.nbytes].view(torch.int64).view(rider.shape))
            at += rider.nbytes
        self.buffer.copy_(self.host, non_blocking=True)
        return out

    def run(self, width: int, forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
            store: KVStore) -> torch.Tensor:
        """The logits ``[width, vocab]`` of a forward of ``width`` rows over the packed inputs:
        the captured graph replayed, or ``forward`` run eagerly."""
        inputs, block = self.views(width)
        self._follow(store)
        if self.capture and width not in self._graphs:
            self._capture(width, lambda: forward(inputs, block), store)
        if self.capture and width in self._graphs:  # (a failed capture stops replays too)
            return self._graphs[width].replay()
        return forward(inputs, block)

    def uncaptured(self, store: KVStore) -> list[int]:
        """The widths of :attr:`together` without a graph for the store's buffers as they are."""
        self._follow(store)
        return [w for w in self.together if w not in self._graphs] if self.capture else []

    def _follow(self, store: KVStore) -> None:
        key = store.layout_key()
        if key != self._store_key:  # the store's buffers moved: graphs hold old addresses
            self._graphs.clear()
            self._store_key = key

    def views(self, width: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The inputs of a forward of ``width`` rows: views of the static buffers, made once per
        width (the buffers never move, and a replayed graph needs none of them)."""
        views = self._views.get(width)
        if views is None:
            # the moves are the last step's (as many as it accepted, whatever this forward's width):
            # every slot, unused ones moving the scratch row onto itself
            views = self._views[width] = ({name: buffer if name in ("move_from", "move_to") else buffer[:width]
                                          for name, buffer in self.fields.items()}, self.block[:width, :width])
        return views

    def _capture(self, width: int, fn: Callable[[], torch.Tensor], store: KVStore) -> None:
        """Capture ``fn`` as a graph of this width; where capture fails, forwards of this width stay
        eager and :attr:`note` says why.

        Capture runs the forward more than once (warm-up runs, then the replay): writing the new
        rows again is harmless, but moving rows again is not (a row moved down is moved over by
        the next move of a chain). So the step's moves are applied here once, and the forward's
        move slots are made to move each row onto itself until the next :meth:`pack` fills them."""
        moves_from, moves_to = self.fields["move_from"], self.fields["move_to"]
        store.apply_moves(moves_from, moves_to)
        moves_from.copy_(moves_to)
        try:
            self._graphs[width] = self._graph_kind(fn)
        except Exception as exc:  # noqa: BLE001 - an uncapturable forward runs eagerly, and says why
            self.capture = False
            self._capture_note = f"CUDA graph capture failed at width {width} ({type(exc).__name__}: {exc}); eager forwards"


class CudaGraph:
    """A forward captured as a CUDA graph (after two eager runs on a side stream, as capture
    requires); :meth:`replay` reruns its kernels over the buffers' current contents."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


def static_forward(model: Any, store: KVStore, windows: dict[str, int | None], mask_kind: str, cache_keyword: str,
                   capacity: int, flash: bool, model_pass: Callable[..., torch.Tensor]
                   ) -> Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]:
    """The forward a bucket runs: the last step's cache moves, then the model over every row, all
    from the static buffers (what a graph captures); ``flash``: hand the flash split its layout;
    ``model_pass``: what runs it (:attr:`StaticForwards.model_pass`: eagerly, or compiled)."""

    def forward(inputs: dict[str, torch.Tensor], block: torch.Tensor) -> torch.Tensor:
        store.apply_moves(inputs["move_from"], inputs["move_to"])
        return model_pass(model, store, windows, mask_kind, cache_keyword, capacity, flash, inputs, block)

    return forward


def model_pass_eager(model: Any, store: KVStore, windows: dict[str, int | None], mask_kind: str,
                     cache_keyword: str, capacity: int, flash: bool, inputs: dict[str, torch.Tensor],
                     block: torch.Tensor) -> torch.Tensor:
    """The model's part of :func:`static_forward`'s forward (a function of its arguments alone, so
    that one compiled copy of it serves every decoder, store and width). Running it twice over the
    same inputs gives the same result (it writes the new rows to the same columns again): the
    cache moves, which must not run twice, stay outside it."""
    width = inputs["ids"].shape[0]
    store.writes = Writes(inputs["write"], None, capacity, capacity - width)
    layout = RowLayout(inputs["positions"], inputs["region_start"], inputs["region_length"], inputs["segment"],
                       inputs["write"], inputs["tree_rows"], block)
    mask = layer_masks(layout, capacity, windows, mask_kind, model.dtype)
    kwargs: dict[str, Any] = {cache_keyword: store}
    if flash:
        kwargs[FLASH_LAYOUT_KEYWORD] = flash_layout(layout)
    try:
        out = model(input_ids=inputs["ids"][None], position_ids=inputs["positions"][None], attention_mask=mask,
                    use_cache=True, logits_to_keep=inputs["keep"], **kwargs)
    finally:
        store.writes = None
    return out.logits[0]


#: ``torch.compile``'s backend for compiled forwards (tests hand a callable backend that runs
#: the traced graph as it is: the same tracing, without generating kernels)
COMPILE_BACKEND = "inductor"
_compiled: dict[Any, Callable[..., torch.Tensor]] = {}
#: How many compiled versions of the forward a process may hold (dynamo's default, 8, is met by
#: a few models or attention implementations at two versions each; past it, dynamo would run the
#: forward uncompiled without a word). Raised only around this forward's calls.
RECOMPILE_LIMIT = 64


class CompiledPass:
    """:func:`model_pass_eager` through ``torch.compile``, one compiled copy per process and backend.

    Why: inside a CUDA graph a forward no longer pays for launches, but it still runs every small
    kernel of the eager model one after another (a norm is seven, a rotary embedding ten per
    layer), each a few microseconds on a GPU however little it computes. The compiler fuses them.
    Shapes are dynamic (``dynamic=True``): the widths, the store's capacity and the decoders
    share two compiled versions (width 1 and the rest) instead of one per width and store size,
    each tens of seconds. What it runs is captured as each width's graph as before.

    Where compiling fails, the forward runs eagerly from then on and :attr:`failure` says why."""

    def __init__(self, backend: str | Callable[..., Any] | None = None) -> None:
        self.backend = backend or COMPILE_BACKEND
        #: why compiling failed (``None``: it has not)
        self.failure: str | None = None

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.failure is None:
            if self.backend not in _compiled:
                _compiled[self.backend] = torch.compile(model_pass_eager, backend=self.backend, dynamic=True)
            # dynamo's name for its recompile limit (``cache_size_limit`` before torch 2.6)
            limit = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
                     else "cache_size_limit")
            try:
                with torch._dynamo.config.patch(**{limit: RECOMPILE_LIMIT}):
                    return _compiled[self.backend](*args)
            except torch._dynamo.exc.TorchDynamoException as exc:  # compiling failed (a rerun is harmless)
                cause = getattr(exc, "inner_exception", None) or exc
                first_line = next(iter(str(cause).strip().splitlines()), "")
                self.failure = f"{type(cause).__name__}: {first_line}"
        return model_pass_eager(*args)
