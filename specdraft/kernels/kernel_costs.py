"""``cpu_kernels="auto"``: each forward width on the kernel path that is cheapest for it here.

Why
    Which CPU kernel makes a tree forward cheap depends on the CPU, its vector units, the BLAS
    torch ships and the model's dtype, and no one path wins everywhere: on an AMD EPYC without
    AVX-512, float32 runs fastest on oneDNN's packed weights from 2 rows up, while one row may be
    cheaper on the stock kernel; bfloat16 has no fast stock path there at all and runs best on
    FBGEMM's float16 weights. A user should not need to know that. So on first use the decoder
    measures the paths this machine can run, exactly, on this model, and takes the cheapest per
    forward width: plain one-token steps never run slower than stock, and trees as cheap as the
    machine allows. The measured curve also prices every width for the adaptive budget
    (:mod:`specdraft.step_costs`) from the first step.

What is measured
    The cost of the model's linear layers -- the part that differs between paths, and nearly all of
    a forward on a CPU -- at forward widths of 1 to 64 rows (:data:`WIDTHS`, interpolated in between),
    on each exact path available (``stock``; ``packed``, which oneDNN refuses for bfloat16 on CPUs
    without AVX-512; ``fbgemm``, which takes only weights float16 holds exactly). To take seconds,
    not minutes, it runs a sample of the real weights: up to :data:`SAMPLE_PER_SHAPE` layers of each
    distinct shape (an output of more than :data:`MAX_SAMPLE_ROWS` rows, a vocabulary head, is cut
    to that many), scaled to the model's count, with widths and paths interleaved and the fastest
    of :data:`REPEATS` rounds kept (a busy machine only ever adds time). The rest of a forward
    (attention, norms) costs the same on every path and is left out, which overstates what width
    costs, slightly: the budget errs to plain steps.

The cache
    One JSON file per CPU model, torch version, thread count, dtype and model shape, under
    ``$XDG_CACHE_HOME/specdraft/kernel-costs/`` (``~/.cache/...`` without it); delete it to measure
    again. A cache that cannot be written is skipped (the measurement is then redone per process).

Which path runs
    At most one packed copy of the weights is kept (memory): the packed path that saves the most
    over widths 1..64, used at the widths where it beats stock (a :class:`~specdraft.cpu_kernels.MixedLinear`
    per layer, switched by the forward's row count), stock at the others. Where the packed copy would
    not fit in the memory available, ``auto`` stays on stock and says why
    (:attr:`KernelChoice.note`). :meth:`KernelChoice.describe` is the one-line account the CLI prints.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from collections import Counter
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .cpu_kernels import (PACKED_KINDS, CpuKernelError, PackedLinear, PackedModel, check_cpu_kernels,
                          linear_modules, memory_problem, packed_model, proc_field)
from .fp16_linear import Fp16Linear

#: Forward widths measured (rows); the curve is interpolated linearly in between.
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
#: The widest forward the plan and the curve cover; wider forwards (a prefill) follow the last width.
MAX_ROWS = WIDTHS[-1]
#: Layers of each distinct shape whose real weights are timed.
SAMPLE_PER_SHAPE = 2
#: Output rows of a sampled layer at most (a vocabulary head is cut, and its time scaled).
MAX_SAMPLE_ROWS = 8192
#: Rounds over all widths and paths; the fastest is kept.
REPEATS = 3
#: Version of the cache files' content (a new one measures again).
CACHE_VERSION = 1
#: Seconds of first-use work (a measurement, a probe) before a progress bar shows (on a terminal).
PROGRESS_DELAY_S = 3.0


def cache_dir() -> Path:
    """Where measurements are kept: ``$XDG_CACHE_HOME/specdraft/kernel-costs`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdraft" / "kernel-costs"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    name = proc_field("/proc/cpuinfo", "model name")
    return name if name is not None else platform.processor() or platform.machine() or "unknown CPU"


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's linear weights (the first one's; ``float32`` without any)."""
    linears = linear_modules(model)
    return linears[0][1].weight.dtype if linears else torch.float32


def cache_key(model: nn.Module) -> dict[str, Any]:
    """What a measurement depends on: CPU, torch, threads, dtype and the linear layers' shapes."""
    shapes = Counter((m.out_features, m.in_features, m.bias is not None) for _, m in linear_modules(model))
    return {"version": CACHE_VERSION, "cpu": cpu_name(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": str(model_dtype(model)).removeprefix("torch."),
            "linears": sorted([list(shape) + [count] for shape, count in shapes.items()])}


def cache_path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


@dataclass
class KernelCosts:
    """Seconds of the model's linear layers per forward of ``widths[i]`` rows, per path."""

    key: dict[str, Any]
    widths: list[int]
    seconds: dict[str, list[float]]
    measured_s: float = 0.0  # how long the measurement took

    def curve(self, path: str) -> list[float]:
        """Seconds per forward of 1..:data:`MAX_ROWS` rows on ``path``, interpolated."""
        return _interpolate(self.widths, self.seconds[path], MAX_ROWS)

    @classmethod
    def from_json(cls, text: str) -> "KernelCosts":
        data = json.loads(text)
        costs = cls(dict(data["key"]), [int(w) for w in data["widths"]],
                    {str(k): [float(s) for s in v] for k, v in data["seconds"].items()}, float(data.get("measured_s", 0)))
        if not costs.seconds or any(len(v) != len(costs.widths) for v in costs.seconds.values()):
            raise ValueError("a kernel-cost file whose curves do not match its widths")
        return costs


def _interpolate(widths: Sequence[int], values: Sequence[float], upto: int) -> list[float]:
    out = []
    for w in range(1, upto + 1):
        j = next((i for i, x in enumerate(widths) if x >= w), len(widths) - 1)
        if widths[j] == w or j == 0:
            out.append(values[j])
        else:
            w0, w1, v0, v1 = widths[j - 1], widths[j], values[j - 1], values[j]
            out.append(v0 + (v1 - v0) * (w - w0) / (w1 - w0))
    return out


def _sample(model: nn.Module) -> list[tuple[nn.Linear, float]]:
    """Copies of up to :data:`SAMPLE_PER_SHAPE` real layers per distinct shape, each with the factor
    that scales its time to all layers of that shape."""
    groups: dict[tuple[int, int, bool], list[nn.Linear]] = {}
    for _, m in linear_modules(model):
        groups.setdefault((m.out_features, m.in_features, m.bias is not None), []).append(m)
    sample = []
    for (out, inp, _), layers in groups.items():
        picked = layers[:: max(1, len(layers) // SAMPLE_PER_SHAPE)][:SAMPLE_PER_SHAPE]
        rows = min(out, MAX_SAMPLE_ROWS)
        for layer in picked:
            # (skip_init: no random initialization, whose draws would move the caller's random stream)
            copy = nn.utils.skip_init(nn.Linear, inp, rows, bias=layer.bias is not None, dtype=layer.weight.dtype)
            with torch.no_grad():
                copy.weight.copy_(layer.weight[:rows])
                if layer.bias is not None:
                    copy.bias.copy_(layer.bias[:rows])
            copy.requires_grad_(False)
            sample.append((copy, len(layers) / len(picked) * out / rows))
    return sample


def _path_layers(sample: list[tuple[nn.Linear, float]], path: str) -> list[tuple[nn.Module, float]] | None:
    """The sampled layers as ``path`` runs them (``None``: the path cannot run any of them). Under
    ``fbgemm`` a layer float16 cannot hold keeps the stock kernel, as in :class:`PackedModel`."""
    if path == "stock":
        return list(sample)
    fast = [PackedLinear(linear) if path == "packed" else Fp16Linear.build(linear) for linear, _ in sample]
    if all(layer is None for layer in fast):
        return None
    return [(linear if layer is None else layer, scale) for layer, (linear, scale) in zip(fast, sample)]


def measure(model: nn.Module, paths: Sequence[str], repeats: int = REPEATS) -> KernelCosts:
    """Time ``paths`` on a sample of ``model``'s linear layers at :data:`WIDTHS` (see the module
    docstring). A path that cannot run any sampled layer is left out of the result."""
    started = time.perf_counter()
    sample = _sample(model)
    runs = {path: layers for path in paths if (layers := _path_layers(sample, path)) is not None}
    dtype = model_dtype(model)
    generator = torch.Generator().manual_seed(0)  # (its own: the caller's random stream stays where it was)
    inputs = {(w, inp): torch.randn(1, w, inp, generator=generator).to(dtype)
              for w in WIDTHS for inp in {l.in_features for l, _ in sample}}
    best = {path: [float("inf")] * len(WIDTHS) for path in runs}
    rounds = tqdm(range(max(1, repeats)), desc="specdraft: measuring CPU kernels", unit="round",
                  delay=PROGRESS_DELAY_S, leave=False, disable=None)
    with torch.inference_mode():
        for _ in rounds:
            for i, w in enumerate(WIDTHS):
                for path, layers in runs.items():
                    total = 0.0
                    for layer, scale in layers:
                        x = inputs[(w, layer.in_features)]
                        t0 = time.perf_counter()
                        layer(x)
                        total += (time.perf_counter() - t0) * scale
                    best[path][i] = min(best[path][i], total)
    return KernelCosts(cache_key(model), list(WIDTHS), best, time.perf_counter() - started)


def load_or_measure(model: nn.Module, paths: Sequence[str]) -> KernelCosts:
    """The cached measurement for this machine and model if it covers ``paths``, else a new one,
    written to the cache (skipped where the cache cannot be written)."""
    key = cache_key(model)
    path = cache_path(key)
    with suppress(OSError, ValueError, KeyError, TypeError):  # no cache file, or an unreadable one
        cached = KernelCosts.from_json(path.read_text())
        same = {k: v for k, v in cached.key.items() if k != "unrunnable"} == key
        if same and set(paths) <= set(cached.seconds) | set(cached.key.get("unrunnable", [])):
            return cached
    costs = measure(model, paths)
    costs.key["unrunnable"] = sorted(set(paths) - set(costs.seconds))
    write_cache(path, json.dumps(asdict(costs), indent=1))
    return costs


def write_cache(path: Path, text: str) -> None:
    """Write a cache file whole (through a temporary file and a rename, so that a reader never
    sees half of it); skipped where the cache cannot be written."""
    with suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


@dataclass
class KernelChoice:
    """What ``Decoder(cpu_kernels=...)`` runs: the packed path (``kind``, ``"stock"`` for none), on
    which row counts (``plan``, ``None``: all), the packed weights, and the measured cost curve of
    the mix (seconds per forward of 1..64 rows, for the budget; ``None`` when not measured)."""

    requested: str
    kind: str = "stock"
    plan: tuple[bool, ...] | None = None
    packed: PackedModel | None = None
    curve: list[float] | None = None
    costs: KernelCosts | None = None
    note: str = ""
    extra_bytes: int = 0  # memory the packed weights add to the model's (0 on stock)

    def release_packed(self) -> PackedModel | None:
        """Hand the packed weights to their user (the decoder) and keep no reference to them here,
        so that ``Decoder.close()`` frees them."""
        packed, self.packed = self.packed, None
        return packed

    def describe(self) -> str:
        """One line: which path runs which widths, what the packed copy costs in memory, and why a
        path was left out."""
        if self.plan is None:
            text = self.kind if self.kind == "stock" else f"{self.kind} (+{self.extra_bytes / 2**30:.2f} GiB)"
        else:
            fast = [width for width, use in enumerate(self.plan, 1) if use]
            on = {"stock": [width for width in range(1, MAX_ROWS + 1) if width not in fast], self.kind: fast}
            parts = [f"{path} at {_ranges(widths)} rows" for path, widths in on.items() if widths]
            text = ", ".join(parts) + f" (+{self.extra_bytes / 2**30:.2f} GiB)"
        if self.requested == "auto":
            text = f"auto: {text}"
        if self.curve is not None:
            c = self.curve
            text += f"; forward of 1/2/8/32 rows = {1000 * c[0]:.0f}/{1000 * c[1]:.0f}/{1000 * c[7]:.0f}/{1000 * c[31]:.0f} ms"
        return text + (f"; {self.note}" if self.note else "")


def _ranges(widths: list[int]) -> str:
    """Ascending ``widths`` as runs (``"1,3-5"``), with a ``+`` when the last reaches :data:`MAX_ROWS`."""
    # consecutive widths keep the same difference to their index: groupby on it yields the runs
    runs = [[width for _, width in run]
            for _, run in groupby(enumerate(widths), lambda pair: pair[1] - pair[0])]
    spans = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return ",".join(spans) + ("+" if widths and widths[-1] == MAX_ROWS else "")


def runnable_paths(model: nn.Module) -> list[str]:
    """The packed paths that can run ``model`` here (those :func:`check_cpu_kernels` accepts)."""
    ok = []
    for kind in PACKED_KINDS:
        with suppress(CpuKernelError):
            check_cpu_kernels(model, kind)
            ok.append(kind)
    return ok


def choose_kernels(model: nn.Module, requested: str = "auto") -> KernelChoice:
    """The kernels a decoder over ``model`` runs for ``cpu_kernels=requested`` (see the module
    docstring for ``"auto"``); ``"stock"``, ``"packed"`` and ``"fbgemm"`` are taken as asked."""
    check_cpu_kernels(model, requested)
    if requested == "stock":
        return KernelChoice(requested)
    if requested in PACKED_KINDS:
        packed = packed_model(model, requested)
        return KernelChoice(requested, requested, packed=packed, extra_bytes=packed.nbytes)
    device = getattr(model, "device", torch.device("cpu"))
    if torch.device(device).type != "cpu":
        return KernelChoice(requested, note=f"the model is on {device}: stock kernels")
    kinds = runnable_paths(model)
    if not kinds:
        return KernelChoice(requested, note="no packed path runs this model here")
    costs = load_or_measure(model, ["stock", *kinds])
    stock = costs.curve("stock")
    best, plan, mixed = auto_mix(costs, kinds)
    choice = KernelChoice(requested, costs=costs, curve=stock)
    if best is None:
        choice.note = "stock is cheapest at every width"
        return choice
    problem = memory_problem(model, best)
    if problem is not None:
        choice.note = f"{best} would be faster but {problem}"
        warnings.warn(f"cpu_kernels='auto' stays on stock kernels: {choice.note}", RuntimeWarning, stacklevel=3)
        return choice
    try:
        packed = packed_model(model, best, plan=plan)
    except CpuKernelError as exc:  # e.g. fbgemm: the weights turned out not to be float16 numbers
        choice.note = f"{best} left out: {exc}"
        return choice
    return replace(choice, kind=best, plan=plan, packed=packed, curve=mixed, extra_bytes=packed.nbytes)


def auto_mix(costs: KernelCosts, kinds: Sequence[str]) -> tuple[str | None, tuple[bool, ...], list[float]]:
    """The packed path of ``kinds`` that ``"auto"`` mixes with stock (the one that saves the most
    over widths 1..64; ``None`` where none saves anything), at which widths it runs it, and what
    each width then costs (stock's curve where nothing is mixed in)."""
    stock = costs.curve("stock")
    curves = {kind: costs.curve(kind) for kind in kinds if kind in costs.seconds}
    saving = {kind: sum(max(0.0, base - fast) for base, fast in zip(stock, curve))
              for kind, curve in curves.items()}
    best = max(curves, key=lambda kind: saving[kind], default=None)
    if best is None or saving[best] <= 0:
        return None, (), stock
    fast = curves[best]
    return best, tuple(c < s for s, c in zip(stock, fast)), [min(s, c) for s, c in zip(stock, fast)]
