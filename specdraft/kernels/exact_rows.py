"""Row-count invariant layers: the width every decode forward is padded to in exact mode.

Why
    A CPU matrix kernel picks its blocking and its order of additions by the shape of the call,
    the number of rows included. Measured on an AMD EPYC with AVX-512 (one thread,
    ``benchmarks/row_invariance.py``): oneDNN's bfloat16 and float32 kernels (the stock bfloat16
    ``nn.Linear`` and ``cpu_kernels="packed"``) sum a one-row product over an inner length above
    1024 in another order than a product of two or more rows, and then every width from 2 to 64
    sums alike; MKL's float32 ``sgemm`` has three orders on one thread (1, 2-3, 4 and more rows;
    on two threads it agrees with 64 rows only at 4, 8 and 12 and more); FBGEMM's
    float16-weight kernel and the stock float16 kernel sum alike at every width. So a forward of
    one row and one of several give different last bits for the same row, and in bfloat16 a near
    tie between two tokens then goes the other way.

The rule
    For the layers a decoder runs (stock, packed or mixed), :func:`probe_rule` finds the widths up
    to :data:`MAX_WIDTH` at which every row is computed bit for bit as at :data:`MAX_WIDTH` rows,
    whatever row index it sits at and whatever the other rows hold: usually every width from some
    ``W`` on (``W = 2`` for oneDNN above, 4 for MKL). Exact mode then pads every decode forward --
    a plain one-token step included -- up to the next such width (:meth:`RowRule.rows_for`,
    :func:`pad_block`). Pad rows are ordinary rows whose outputs nobody
    reads; the row-wise layers never mix rows, and no real row attends to a pad row, so what they
    hold cannot reach a real row.

    Wider forwards (a prompt's prefill chunks) are checked at a few widths (:data:`WIDE_CHECKS`);
    where those agree with :data:`MAX_WIDTH` too, the rule runs wider forwards as they are
    (:attr:`RowRule.wider`), and a prompt's keys and values do not depend on how it was cut into
    chunks. Widths between the checked ones are assumed to agree as well.

Normalization layers count too
    A transformers RMSNorm takes its mean with torch's generic reduction. On a CPU each row is
    summed alike whatever the row count. On CUDA the reduction picks its threads per row by the
    number of rows reduced (torch's ``ReduceConfig.set_block_dimension``: over a row of 512 or more
    values, 512 threads share a row at one row, 32 from 16 rows on), which may change its order of
    additions. So the probe runs the model's RMSNorm and LayerNorm modules (:func:`norm_layers`) at
    every width as well. (On an NVIDIA H200 it found Qwen2's RMSNorm agreeing at every width from
    1 to 64: ``benchmarks/results/gpu-h200-2026-11-28-27af751/cache``.)

What the probe does not see
    Each layer is called alone and eagerly. A decoder on CUDA replays whole forwards as CUDA
    graphs and runs operations between the layers. On that H200 exact-mode speculation parted
    from exact plain decoding on 5 of 20 prompts although every layer agreed at every width;
    ``benchmarks/forward_rows.py`` checks whole forwards per width, captured and eager.

On a GPU
    The probe runs the layers where they are. A GPU library may give a row other bits at every
    width below the widest; on a CPU that leaves no padding worth its price and the probe raises
    :class:`ExactRowsError`, but on a GPU a forward of 64 rows costs about what one of 1 does, so
    the rule is then the one fixed width, and the decoder runs every decode forward at the buckets
    of its captured graphs where the rule holds (:func:`specdraft.engine.widths.exact_buckets`).

The probe times nothing: it runs each distinct layer shape at every width on random rows and
compares bits. A bfloat16 output hides most reorderings (the float32 sums differ in their last
bits, the rounded result only now and then: on an Intel Xeon with AMX about 3 to 6 outputs in
100,000), so in 16-bit dtypes it compares at least :data:`OUTPUTS_PER_WIDTH` outputs per width
and layer, enough that a kernel summing in another order is caught with near certainty (some 13
flips expected at those rates). It takes seconds to a minute for a 0.5B model, so
:func:`load_or_probe` keeps the answer per CPU model, torch version, thread count, dtype, layer
shapes and kernels, next to the kernel-cost measurements (``$XDG_CACHE_HOME/specdraft/exact-rows/``).

What a decoder in exact mode does with it
    * once, after choosing its kernels: ``rule = load_or_probe(model, packed)`` with the
      :class:`~specdraft.kernels.cpu_kernels.PackedModel` it swaps in (``None`` on stock); the rule holds
      for exactly those layers and that thread count, so it is taken again when either changes;
    * every decode forward of ``k`` rows (tree, side blocks, a plain step, a batch's segments
      together) runs ``rule.rows_for(k)`` rows: :func:`pad_block` lays out one request's; pad
      rows come after the real ones and are never kept by a compaction; the cache needs room for
      them (``rule.rows_for(k) - k`` rows past the real ones);
    * the linear layers after the last hidden state count too: a vocabulary head that computes only
      some rows (``logits_to_keep``) runs that many rows, which must also be a width of the rule
      (keep a pad row's logits as well where needed);
    * the attention is :mod:`specdraft.model.exact_attention`, in every forward (prefill included).
"""

from __future__ import annotations

import inspect
import json
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .cpu_kernels import PackedModel, linear_modules
from .kernel_costs import PROGRESS_DELAY_S, cache_dir, cache_key, cache_path, model_dtype, write_cache

#: The widest decode forward the rule covers (the adaptive budget's widest tree).
MAX_WIDTH = 64

#: Wider forwards checked against :data:`MAX_WIDTH` rows (a prefill chunk is up to 512 rows).
WIDE_CHECKS = (96, 128, 256, 512)

#: Rows of random input compared per width, at least (a width of ``M`` runs ``ceil(rows / M)`` forwards).
ROWS_PER_WIDTH = 64

#: Outputs compared per width and layer, at least, in 16-bit dtypes: a layer of ``N`` outputs runs
#: ``max(ROWS_PER_WIDTH, OUTPUTS_PER_WIDTH / N)`` rows per width. Where a kernel sums in another
#: order, only some bfloat16 outputs show it: measured on an Intel Xeon with AMX (one thread), about
#: 3 to 6 in 100,000 for inner lengths of 896 and 4864. 64 rows of a 896-output layer then miss a
#: reordering about one time in seven, so a narrow layer needs many more rows than a vocabulary head.
#: (A float32 or float64 output shows a reordered sum in most of its outputs.)
OUTPUTS_PER_WIDTH = 1 << 18

#: The most rows per width that :data:`OUTPUTS_PER_WIDTH` asks for (a key/value projection of 128
#: outputs runs 2048; tiny test models' layers of 16 outputs would ask for 16,384 one-row forwards).
MAX_ROWS_PER_WIDTH = 2048


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
    inputs = torch.randn(2 * base + rows_per_width + 1, in_features, generator=generator)
    inputs = inputs.to(device=_device_of(layer), dtype=dtype)  # drawn on the CPU: the same rows on every device
    outputs: dict[int, tuple[int, torch.Tensor]] = {}
    with torch.inference_mode():
        for width in widths:
            start = base - width // 2  # blocks start mid-way, so that no width lines up with another's
            forwards = -(-(width // 2 + rows_per_width) // width)
            parts = [layer(_alone(inputs[start + i * width : start + (i + 1) * width]))[0]
                     for i in range(forwards)]
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


def _alone(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a forward passes them, ``[1, width, features]`` in memory of their own: a slice of
    a taller tensor keeps that tensor's stride on the batch dimension, and with it a CPU linear layer
    may take another path than on the same rows alone (measured on an Intel Xeon with AMX: a
    bfloat16 ``nn.Linear`` over 22 rows gave other bits sliced from 33 rows than alone)."""
    return rows.clone(memory_format=torch.contiguous_format)[None]


def _device_of(layer: Callable[[torch.Tensor], torch.Tensor]) -> torch.device:
    """Where ``layer`` computes: its first parameter's or buffer's device (the CPU for a bare function)."""
    tensors = (*layer.parameters(), *layer.buffers()) if isinstance(layer, nn.Module) else ()
    return next((tensor.device for tensor in tensors), torch.device("cpu"))


def _device_name(layers: Sequence[nn.Module]) -> str:
    """The accelerator the layers run on (its name, which decides its kernels), or ``"cpu"``."""
    device = _device_of(layers[0]) if layers else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


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
    measured = sorted(width for members in classes for width in members)
    top = agreeing_widths(classes)
    outside = [width for width in measured if width not in top]
    start = min(width for width in top if not outside or width > outside[-1])
    return start if start < measured[-1] or len(measured) == 1 else None


def agreeing_widths(classes: Sequence[Sequence[int]], anchor: int | None = None) -> tuple[int, ...]:
    """The widths in the class of ``anchor`` (default: the widest), ascending: padding a forward up
    to the next of them gives every row the bits a forward of ``anchor`` rows gives it."""
    if anchor is None:
        anchor = max(w for members in classes for w in members)
    return tuple(sorted(next(members for members in classes if anchor in members)))


@dataclass(frozen=True)
class RowRule:
    """The forward widths at which every row is computed alike (ascending; the widest is the most
    rows the rule covers): exact mode pads a decode forward of ``k`` rows up to the next of them.
    Usually a run ``W, W + 1, ..., 64`` (pad to at least ``W`` rows); some kernels agree only at
    scattered widths (MKL's float32 kernel on two threads: 4, 8 and from 12 up), which then act as
    buckets."""

    widths: tuple[int, ...]
    #: per layer shape ``(in, out)``: the widths at which that layer agrees with its widest forward
    per_shape: tuple[tuple[tuple[int, int], tuple[int, ...]], ...] = ()
    #: forwards wider than :attr:`max_rows` were checked (:data:`WIDE_CHECKS`) and agree: they run unpadded
    wider: bool = False

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1 or list(self.widths) != sorted(set(self.widths)):
            raise ValueError(f"widths must be distinct positive row counts in increasing order, got {self.widths}")

    @property
    def min_rows(self) -> int:
        """The narrowest forward exact mode runs (a plain one-token step is padded to it)."""
        return self.widths[0]

    @property
    def max_rows(self) -> int:
        """The widest decode forward the rule covers."""
        return self.widths[-1]

    def rows_for(self, k: int) -> int:
        """The width a decode forward of ``k`` real rows runs at."""
        if k < 1:
            raise ValueError(f"a forward has at least one row, got {k}")
        if k > self.max_rows:
            if self.wider:
                return k
            raise ValueError(f"a forward of {k} rows is wider than the {self.max_rows} rows the rule covers")
        return next(w for w in self.widths if w >= k)

    def describe(self) -> str:
        """E.g. ``"pad to 2+ rows (up to 64)"``, ``"pad to 4, 8, 12+ rows (up to 64)"`` or ``"no padding (...)"``."""
        widths = self.widths
        last = len(widths) - 1  # the final run of consecutive widths is written ``W+``, earlier ones width by width
        start = last
        while start and widths[start - 1] == widths[start] - 1:
            start -= 1
        parts = [str(w) for w in widths[:start]] + [f"{widths[start]}+" if start < last else str(widths[start])]
        beyond = "; wider as they are" if self.wider else ""
        if self.widths == tuple(range(1, self.max_rows + 1)):
            return f"no padding (1-{self.max_rows} rows agree{beyond})"
        return f"pad to {', '.join(parts)} rows (up to {self.max_rows}{beyond})"


def linear_layers(model: nn.Module, packed: PackedModel | None = None) -> list[nn.Module]:
    """The linear layers a forward of ``model`` runs: its ``nn.Linear`` modules, or where a
    :class:`~specdraft.kernels.cpu_kernels.PackedModel` swaps in stand-ins, those (and the layers it left
    on the stock kernel)."""
    layers: dict[str, nn.Module] = dict(linear_modules(model))
    if packed is not None:
        layers.update(packed.layers)
    return list(layers.values())


#: Class-name endings of the normalization modules the probe runs (row-wise over the last
#: dimension: transformers' ``*RMSNorm`` classes, ``nn.LayerNorm`` and its subclasses)
NORM_CLASS_ENDINGS = ("RMSNorm", "LayerNorm")


def norm_layers(model: nn.Module) -> list[nn.Module]:
    """The normalization layers of ``model`` that act on each row's last dimension alone (see
    :data:`NORM_CLASS_ENDINGS`), with that dimension known from their weight or shape. A norm
    whose forward needs more than the hidden states (a conditioned one) is left out: the probe
    cannot run it on rows alone."""
    return [module for name, module in model.named_modules()
            if name and type(module).__name__.endswith(NORM_CLASS_ENDINGS) and _norm_features(module)
            and _takes_rows_alone(module)]


def _takes_rows_alone(module: nn.Module) -> bool:
    """Whether ``module(x)`` is a complete call: its forward has one required argument."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.default is p.empty and p.kind in positional]
    return len(required) == 1


def _norm_features(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    shape = getattr(module, "normalized_shape", None)
    return int(shape[-1]) if isinstance(shape, (tuple, list)) and len(shape) == 1 else None


def row_layers(model: nn.Module, packed: PackedModel | None = None) -> list[nn.Module]:
    """Every layer whose rows the probe checks: :func:`linear_layers` and :func:`norm_layers`."""
    return linear_layers(model, packed) + norm_layers(model)


def _features(layer: nn.Module) -> tuple[int, int]:
    """``(in, out)`` features of a linear layer or a normalization layer (``(n, n)``)."""
    if hasattr(layer, "in_features"):
        return int(layer.in_features), int(layer.out_features)
    features = _norm_features(layer)
    if features is None:
        raise ValueError(f"cannot tell the row width of {type(layer).__name__}: it is neither linear nor a "
                         f"normalization layer with a 1-D weight")
    return features, features


def probe_rule(layers: Iterable[nn.Module], dtype: torch.dtype, max_rows: int = MAX_WIDTH,
               rows_per_width: int = ROWS_PER_WIDTH, wide: Sequence[int] = WIDE_CHECKS,
               outputs_per_width: int = OUTPUTS_PER_WIDTH) -> RowRule:
    """The :class:`RowRule` of these linear and normalization layers (one of each distinct shape and
    kernel is run, on at least ``rows_per_width`` rows and ``outputs_per_width`` outputs per width;
    see the module docstring). Raises :class:`ExactRowsError` when a layer has no invariant width up
    to ``max_rows``."""
    kinds: dict[tuple[tuple[int, int], str], nn.Module] = {}
    for layer in layers:
        kinds.setdefault((_features(layer), _kernel_id(layer)), layer)
    widths = tuple(range(1, max_rows + 1))
    wide = tuple(sorted(w for w in set(wide) if w > max_rows))
    threads = torch.get_num_threads()
    per_shape = []
    common = set(widths)
    wider = True
    # (a first probe of a real model takes a minute or more: say so on a terminal, after a moment)
    shown = tqdm(sorted(kinds.items(), key=lambda kv: kv[0]), desc="specdraft: probing exact-mode widths",
                 unit="layer kind", delay=PROGRESS_DELAY_S, leave=False, disable=None)
    for (shape, kernel), layer in shown:
        rows = rows_per_width
        if dtype.itemsize <= 2:
            rows = max(rows, min(MAX_ROWS_PER_WIDTH, -(-outputs_per_width // shape[1])))
        key = (shape, kernel, str(_device_of(layer)), dtype, widths + wide, rows, threads)
        classes = _CLASSES.get(key)  # (one lookup and one store, each atomic: no lock needed across threads)
        if classes is None:
            classes = _CLASSES[key] = width_classes(layer, shape[0], dtype, widths + wide, rows)
        agree_all = agreeing_widths(classes, anchor=max_rows)
        agree = tuple(w for w in agree_all if w <= max_rows)
        wider = wider and set(wide) <= set(agree_all)
        if agree == (max_rows,) and max_rows > 1 and _device_of(layer).type == "cpu":
            raise ExactRowsError(f"the {shape[0]}->{shape[1]} layer ({type(layer).__name__}, {dtype}) gives a "
                                 f"{max_rows}-row forward other bits than any narrower width (classes: {classes}); "
                                 "no padding width makes it row-count invariant")
        per_shape.append((shape, agree))
        common &= set(agree)
    return RowRule(tuple(sorted(common)), tuple(per_shape), wider)


def _kernel_id(layer: nn.Module) -> str:
    """What decides a layer's kernel besides its shape: its class, for a mixed layer its plan, for
    a float16-weight layer the float16 terms per weight (two double the inner length), and whether
    it adds a bias (a biased linear calls ``addmm``, an unbiased one ``mm``, which may sum in
    another order: Qwen2's query projection adds a bias, its output projection of the same shape
    does not)."""
    fast = getattr(layer, "fast", layer)
    bias = "+bias" if getattr(layer, "bias", None) is not None else ""
    return f"{type(layer).__name__}{getattr(layer, 'plan', '')}{getattr(fast, 'terms', '')}{bias}"


#: :func:`width_classes` per kind of layer, remembered for the process: a layer's classes depend on
#: its kernel (shape, kernel, dtype, device, threads), not on its weights, and sets of layers that
#: share kinds (one model with its norms swapped, or some of its layers packed) probe each shared
#: kind once.
_CLASSES: dict[tuple, list[list[int]]] = {}


#: Version of the cache files' content (a new one probes again; 2: normalization layers probed too;
#: 3: biased and unbiased layers of one shape probed apart; 4: at least OUTPUTS_PER_WIDTH outputs).
CACHE_VERSION = 4


def rule_cache_key(model: nn.Module, layers: Sequence[nn.Module]) -> dict[str, Any]:
    """What a probe of ``model``'s ``layers`` depends on: what a kernel-cost measurement depends on
    (CPU, torch, threads, dtype) and the kinds of layer (shape and kernel), not how many of each
    (a rule is per kind: models that differ only in depth share one probe)."""
    kernels = sorted({"{}x{}:{}".format(*_features(layer), _kernel_id(layer)) for layer in layers})
    machine = {name: value for name, value in cache_key(model).items() if name != "linears"}
    return {**machine, "device": _device_name(layers), "version": CACHE_VERSION, "kernels": kernels,
            "max_rows": MAX_WIDTH, "rows_per_width": ROWS_PER_WIDTH, "outputs_per_width": OUTPUTS_PER_WIDTH,
            "max_rows_per_width": MAX_ROWS_PER_WIDTH,
            "wide": list(WIDE_CHECKS)}


def rule_cache_path(key: dict[str, Any]) -> Path:
    return cache_dir().parent / "exact-rows" / cache_path(key).name


def load_or_probe(model: nn.Module, packed: PackedModel | None = None) -> RowRule:
    """The :class:`RowRule` of the layers a forward of ``model`` runs (``packed``: the
    :class:`~specdraft.kernels.cpu_kernels.PackedModel` swapped in, if any): read from the cache when this
    machine probed them before, else probed and written there (skipped where it cannot be written)."""
    layers = row_layers(model, packed)
    key = rule_cache_key(model, layers)
    path = rule_cache_path(key)
    with suppress(OSError, ValueError, KeyError, TypeError):  # no cache file, or an unreadable one
        data = json.loads(path.read_text())
        if data["key"] == key:
            return RowRule(tuple(int(w) for w in data["widths"]),
                           tuple((tuple(shape), tuple(widths)) for shape, widths in data["per_shape"]),
                           bool(data["wider"]))
    rule = probe_rule(layers, model_dtype(model))
    write_cache(path, json.dumps({"key": key, **asdict(rule)}))
    return rule


def pad_block(tokens: Sequence[int], offsets: np.ndarray, block: np.ndarray, rows: int
              ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """A forward of ``len(tokens)`` rows laid out for ``rows`` rows (``tokens``, ``offsets`` and
    ``block`` as :meth:`specdraft.model.runner.ModelRunner.forward` takes them).

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
