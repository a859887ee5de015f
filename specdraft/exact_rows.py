"""Row-count invariant linear layers: the width every decode forward is padded to in exact mode.

Why
    A CPU matrix kernel picks its blocking and its order of additions by the shape of the call,
    the number of rows included. Measured on an AMD EPYC with AVX-512 (one thread,
    ``benchmarks/row_invariance.py``): oneDNN's bfloat16 and float32 kernels (the stock bfloat16
    ``nn.Linear`` and ``cpu_kernels="packed"``) sum a one-row product over an inner length above
    1024 in another order than a product of two or more rows, and then every width from 2 to 64
    sums alike; MKL's float32 ``sgemm`` has three orders (1, 2-3, 4 and more rows); FBGEMM's
    float16-weight kernel and the stock float16 kernel sum alike at every width. So a forward of
    one row and one of several give different last bits for the same row, and in bfloat16 a near
    tie between two tokens then goes the other way.

The rule
    For the layers a decoder runs (stock, packed or mixed), :func:`probe_rule` finds the smallest
    width ``W`` such that every width from ``W`` to :data:`MAX_WIDTH` computes each row bit for bit
    alike, whatever row index it sits at and whatever the other rows hold. Exact mode then pads
    every decode forward of ``k < W`` rows -- a plain one-token step included -- to ``W`` rows
    (:meth:`RowRule.rows_for`, :func:`pad_block`). Pad rows are ordinary rows whose outputs nobody
    reads; the row-wise layers never mix rows, and no real row attends to a pad row, so what they
    hold cannot reach a real row.

    Widths above :data:`MAX_WIDTH` are not covered by the rule (a wide prefill may take another
    kernel); :func:`probe_rule` can be asked for more.

The probe times nothing: it runs each distinct layer shape at every width on random rows, about
``ROWS_PER_WIDTH`` rows per width, and compares bits. A bfloat16 output hides most reorderings
(the float32 sums differ in their last bits, the rounded result only now and then), so it looks at
enough rows that a kernel summing in another order is caught with near certainty (a different
order flips about one bfloat16 output in a few thousand). The answer is kept per process for each
set of layer shapes, kernels and thread count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

#: The widest decode forward the rule covers (the adaptive budget's widest tree).
MAX_WIDTH = 64

#: Rows of random input compared per width (a width of ``M`` runs ``ceil(ROWS_PER_WIDTH / M)`` forwards).
ROWS_PER_WIDTH = 64


class ExactRowsError(RuntimeError):
    """No padding width makes these layers row-count invariant; the message says which layer and widths."""


def width_classes(layer: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                  widths: Sequence[int] = tuple(range(1, MAX_WIDTH + 1)), rows_per_width: int = ROWS_PER_WIDTH,
                  seed: int = 0) -> list[list[int]]:
    """The widths, partitioned so that two widths are in one class exactly when ``layer`` gives
    every input row the same bits at both (at whatever index the row sits, whatever the other
    rows hold). Each width runs over the same random rows, in consecutive forwards of that width;
    a row therefore sits at different indices, among different neighbours, at different widths.
    """
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be positive row counts, got {list(widths)[:8]}")
    generator = torch.Generator().manual_seed(seed)
    base = max(widths)  # every width computes the input rows [base, base + rows_per_width)
    inputs = torch.randn(2 * base + rows_per_width + 1, in_features, generator=generator).to(dtype)
    outputs: dict[int, tuple[int, torch.Tensor]] = {}
    with torch.inference_mode():
        for width in widths:
            start = base - width // 2  # blocks start mid-way, so that no width lines up with another's
            forwards = -(-(width // 2 + rows_per_width) // width)
            parts = [layer(inputs[None, start + i * width : start + (i + 1) * width])[0] for i in range(forwards)]
            outputs[width] = (start, torch.cat(parts))
    classes: list[list[int]] = []
    for width in widths:
        for members in classes:
            if _same_rows(outputs[width], outputs[members[0]]):
                members.append(width)
                break
        else:
            classes.append([width])
    return classes


def _same_rows(a: tuple[int, torch.Tensor], b: tuple[int, torch.Tensor]) -> bool:
    """Whether two runs agree bit for bit on the input rows both computed."""
    (start_a, out_a), (start_b, out_b) = a, b
    start, stop = max(start_a, start_b), min(start_a + len(out_a), start_b + len(out_b))
    if stop <= start:
        raise ValueError("two widths computed no input row in common; raise rows_per_width")
    return torch.equal(out_a[start - start_a : stop - start_a], out_b[start - start_b : stop - start_b])


def invariant_from(classes: Sequence[Sequence[int]]) -> int | None:
    """The smallest width ``W`` such that every measured width from ``W`` up is in the class of the
    widest; ``None`` when the widest width is alone in its class."""
    widest = max(w for members in classes for w in members)
    top = next(members for members in classes if widest in members)
    measured = sorted(w for members in classes for w in members)
    start = widest
    for w in reversed(measured):
        if w not in top:
            break
        start = w
    return start if start < widest or len(measured) == 1 else None


@dataclass(frozen=True)
class RowRule:
    """Pad every decode forward to at least ``min_rows`` rows; widths up to ``max_rows`` are then
    row-count invariant (checked by :func:`probe_rule`)."""

    min_rows: int
    max_rows: int = MAX_WIDTH
    #: per layer shape ``(in, out)``: the smallest invariant width found for it
    per_shape: tuple[tuple[tuple[int, int], int], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.min_rows <= self.max_rows:
            raise ValueError(f"min_rows must be in [1, max_rows={self.max_rows}], got {self.min_rows}")

    def rows_for(self, k: int) -> int:
        """The width a decode forward of ``k`` real rows runs at."""
        if k < 1:
            raise ValueError(f"a forward has at least one row, got {k}")
        if k > self.max_rows:
            raise ValueError(f"a forward of {k} rows is wider than the {self.max_rows} rows the rule covers")
        return max(k, self.min_rows)

    def padding(self, k: int) -> int:
        """Pad rows added to a forward of ``k`` real rows."""
        return self.rows_for(k) - k


def linear_layers(model: nn.Module, packed: "object | None" = None) -> list[nn.Module]:
    """The linear layers a forward of ``model`` runs: its ``nn.Linear`` modules, or where a
    :class:`~specdraft.cpu_kernels.PackedModel` swaps in stand-ins, those (and the layers it left
    on the stock kernel)."""
    layers = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear) and name}
    if packed is not None:
        layers.update(getattr(packed, "layers"))
    return list(layers.values())


def probe_rule(layers: Iterable[nn.Module], dtype: torch.dtype, max_rows: int = MAX_WIDTH,
               rows_per_width: int = ROWS_PER_WIDTH) -> RowRule:
    """The :class:`RowRule` of these linear layers (one of each distinct shape is run; see the module
    docstring). Raises :class:`ExactRowsError` when a layer has no invariant width up to ``max_rows``."""
    shapes: dict[tuple[int, int], nn.Module] = {}
    for layer in layers:
        shapes.setdefault((int(layer.in_features), int(layer.out_features)), layer)
    if not shapes:
        return RowRule(1, max_rows)
    return _probe(tuple(sorted((shape, _kernel_id(layer), layer) for shape, layer in shapes.items())), dtype,
                  max_rows, rows_per_width, torch.get_num_threads())


def _kernel_id(layer: nn.Module) -> str:
    """What decides a layer's kernel besides its shape: its class and, for a mixed layer, its plan."""
    return f"{type(layer).__name__}{getattr(layer, 'plan', '')}"


_PROBE_LOCK = threading.Lock()


def _probe(entries: tuple, dtype: torch.dtype, max_rows: int, rows_per_width: int, threads: int) -> RowRule:
    key = tuple((shape, kernel) for shape, kernel, _ in entries)
    with _PROBE_LOCK:
        cached = _RULES.get((key, dtype, max_rows, rows_per_width, threads))
    if cached is not None:
        return cached
    widths = tuple(range(1, max_rows + 1))
    per_shape = []
    for shape, _, layer in entries:
        classes = width_classes(layer, shape[0], dtype, widths, rows_per_width)
        start = invariant_from(classes)
        if start is None:
            raise ExactRowsError(f"the {shape[0]}->{shape[1]} linear layer ({type(layer).__name__}, {dtype}) gives a "
                                 f"{max_rows}-row forward other bits than any narrower width (classes: {classes}); "
                                 "no padding width makes it row-count invariant")
        per_shape.append((shape, start))
    rule = RowRule(max(start for _, start in per_shape), max_rows, tuple(per_shape))
    with _PROBE_LOCK:
        _RULES[(key, dtype, max_rows, rows_per_width, threads)] = rule
    return rule


_RULES: dict[tuple, RowRule] = {}


def pad_block(tokens: Sequence[int], offsets: np.ndarray, block: np.ndarray, rows: int
              ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A forward of ``len(tokens)`` rows laid out for ``rows`` rows (``tokens``, ``offsets`` and
    ``block`` as :meth:`specdraft.runner.ModelRunner.forward` takes them).

    Each pad row repeats the last real row's token and offset and sees, among the new rows, only
    itself; no real row sees a pad row. Pad rows are appended after the real rows, so the real
    rows keep their indices and a compaction that keeps real rows only drops them.
    """
    k = len(tokens)
    if rows < k:
        raise ValueError(f"cannot pad a forward of {k} rows to {rows}")
    block = np.asarray(block, dtype=bool)
    offsets = np.asarray(offsets, dtype=np.int64)
    if block.shape != (k, k) or offsets.shape != (k,):
        raise ValueError(f"block must be [{k}, {k}] and offsets [{k}], got {block.shape} and {offsets.shape}")
    if rows == k:
        return list(tokens), offsets, block
    padded = np.zeros((rows, rows), dtype=bool)
    padded[:k, :k] = block
    padded[np.arange(k, rows), np.arange(k, rows)] = True
    return (list(tokens) + [int(tokens[-1])] * (rows - k), np.concatenate([offsets, np.full(rows - k, offsets[-1])]),
            padded)
