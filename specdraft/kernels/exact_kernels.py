"""Exact mode on a CPU: which kernel path it runs, and whether it is worth being the default.

Why
    Exact mode pads every decode forward to a width at which the kernels give each row the bits of
    a plain one-token step (:mod:`specdraft.kernels.exact_rows`). What that costs depends on the
    kernel path as much as on the padding. On an AMD EPYC oneDNN's bfloat16 kernel agrees from two
    rows on, so a plain step pays one row more, which is nearly free. On an Intel Xeon with AMX the
    same kernel agrees only from 37 rows: every plain step then runs 37 rows, about 1.4 times a
    one-row forward, while FBGEMM's float16-weight kernel gives every width from 1 to 64 the same
    bits and runs one row faster than the stock kernel does. Without exact mode
    ``cpu_kernels="auto"`` mixes paths by width (:mod:`specdraft.kernels.kernel_costs`); in exact
    mode a mix would give a row other bits wherever the path changes, so exact mode runs one path:
    the one whose padded forwards cost least.

    The same numbers say whether exact mode may be the default. It is the default only where it
    costs at most :data:`PRICE_LIMIT` of the speed, and that is a property of the machine, not of
    the device kind: the price is measured here, per machine and model, rather than assumed.

How it is priced
    From the kernel-cost curve (the model's linear layers per forward width, measured once per
    machine and model and cached) read at the widths exact mode runs: a forward of ``k`` rows costs
    ``curve[rule.rows_for(k)]`` on a path with rule ``rule``. Its ratio to what the same forward
    costs without exact mode (the kernels ``cpu_kernels`` picks then), averaged over ``k = 1 ..``
    :data:`PRICED_ROWS`, less one, is the price. The narrow widths are the ones that count: a CPU
    step is most often a plain step or a small tree, since the budget keeps trees small where rows
    cost. Attention and norms are left out, as in the curve; in exact mode attention runs the exact
    attention, which on a CPU costs less than ``sdpa`` for a plain step and small trees.

    Each path's rule comes from a probe of its own layers (seconds to a minute or two for a 0.5B
    model the first time, cached). A path is probed only if it could still win: its cost without
    any padding is a lower bound of its price.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence
from torch import nn

from .cpu_kernels import CpuKernelError, check_cpu_kernels, packed_model
from .exact_rows import ExactRowsError, RowRule, load_or_probe
from .kernel_costs import KernelChoice, KernelCosts, auto_mix, load_or_measure, runnable_paths

#: The most exact mode may cost (a fraction of the forwards' price without it) and be the default.
PRICE_LIMIT = 0.05
#: Forward widths the price averages over: a plain step and trees of up to seven nodes.
PRICED_ROWS = 8


@dataclass
class ExactKernels:
    """The kernels exact mode runs on a CPU, their rule, and what exact mode costs on them."""

    #: one path at every width (``plan`` is ``None``), with its packed weights where it has any
    kernels: KernelChoice
    rule: RowRule
    #: exact mode's price against the kernels without it (``None``: not measured, where exact mode
    #: and one path were both asked for)
    price: float | None
    #: per path looked at: its price, or why it was left out
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def cheap(self) -> bool:
        """Whether exact mode costs at most :data:`PRICE_LIMIT` here (so it is the default)."""
        return self.price is not None and self.price <= PRICE_LIMIT

    def describe(self) -> str:
        """One line: the path, its rule and the price, and what the other paths would have cost."""
        text = f"{self.kernels.kind} kernels, {self.rule.describe()}"
        if self.price is not None:
            text += f", {self.price:+.0%} on forwards of 1-{PRICED_ROWS} rows"
        others = [f"{path} {what}" for path, what in self.paths.items() if path != self.kernels.kind]
        return text + (f" (other paths: {'; '.join(others)})" if others else "")


def padded_price(rule: RowRule, curve: list[float], reference: list[float], rows: int = PRICED_ROWS) -> float:
    """The mean over forwards of ``1..rows`` rows of ``curve`` at the width ``rule`` pads them to,
    relative to ``reference`` at their own width, less one; infinite where ``rule`` does not
    cover such a forward."""
    ratios = []
    for k in range(1, rows + 1):
        if k > rule.max_rows and not rule.wider:
            return float("inf")
        ratios.append(curve[min(rule.rows_for(k), len(curve)) - 1] / reference[k - 1])
    return sum(ratios) / len(ratios) - 1


def lowest_price(curve: list[float], reference: list[float], rows: int = PRICED_ROWS) -> float:
    """The least :func:`padded_price` any rule could give ``curve``: padding never narrows a
    forward, so a forward of ``k`` rows costs at least the cheapest width from ``k`` on."""
    floors = [min(curve[k - 1:]) for k in range(1, rows + 1)]
    return sum(f / r for f, r in zip(floors, reference)) / rows - 1


def reference_curve(costs: KernelCosts, requested: str, paths: Sequence[str]) -> list[float]:
    """What each forward width costs without exact mode: on the path asked for, or for ``"auto"``
    on stock and the packed path of ``paths`` it mixes in where that is cheaper."""
    if requested != "auto":
        return costs.curve(requested)
    return auto_mix(costs, [path for path in paths if path != "stock"])[2]


def _on_path(model: nn.Module, requested: str, path: str) -> tuple[KernelChoice, RowRule]:
    """The one-path kernels of ``path`` and their rule (raises :class:`CpuKernelError` or
    :class:`ExactRowsError` where the path cannot run, its copy would not fit in memory, or it
    agrees at no width)."""
    if path == "stock":
        return KernelChoice(requested), load_or_probe(model)
    packed = packed_model(model, path)  # (it refuses a copy that would not fit)
    return KernelChoice(requested, path, packed=packed, extra_bytes=packed.nbytes), load_or_probe(model, packed)


def choose_exact_kernels(model: nn.Module, requested: str = "auto", priced: bool = True) -> ExactKernels:
    """Exact mode's kernels for ``cpu_kernels=requested`` on a CPU (see the module docstring):
    for ``"auto"`` the path whose padded forwards cost least, else the path asked for.
    ``priced=False`` skips the measurement where there is nothing to choose (one path asked for,
    exact mode asked for): the price is then ``None``. Raises :class:`ExactRowsError` where no
    path can run exact mode."""
    check_cpu_kernels(model, requested)
    paths = ["stock", *runnable_paths(model)] if requested == "auto" else [requested]
    if len(paths) == 1 and not priced:
        kernels, rule = _on_path(model, requested, paths[0])
        return ExactKernels(kernels, rule, None)
    costs = load_or_measure(model, paths)
    reference = reference_curve(costs, requested, paths)
    bounds = {path: lowest_price(costs.curve(path), reference) for path in paths if path in costs.seconds}
    best: ExactKernels | None = None
    seen: dict[str, str] = {path: "cannot run this model" for path in paths if path not in bounds}
    for path in sorted(bounds, key=bounds.get):
        if best is not None and bounds[path] >= best.price:
            seen[path] = f"at least {bounds[path]:+.0%} (not probed)"
            continue
        try:
            kernels, rule = _on_path(model, requested, path)
        except (CpuKernelError, ExactRowsError) as exc:
            seen[path] = f"left out: {exc}"
            continue
        price = padded_price(rule, costs.curve(path), reference)
        seen[path] = f"{rule.describe()}, {price:+.0%}"
        if best is None or price < best.price:
            best = ExactKernels(kernels, rule, price)
    if best is None:
        raise ExactRowsError(f"no kernel path gives every row alike here: {seen}")
    if requested == "auto":  # the budget prices widths by the curve of what runs, as auto's does
        best.kernels.costs, best.kernels.curve = costs, costs.curve(best.kernels.kind)
    best.paths = seen
    return best

