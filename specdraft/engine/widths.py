"""The widths a forward runs at: as it comes, or padded so that every row is computed alike.

Exact mode pads every forward of ``k`` rows to a width at which the model's linear and
normalization layers give each row the bits a plain one-token step gives it (a
:class:`~specdraft.kernels.exact_rows.RowRule`, probed per machine and model); a plain step is
padded by the same rule, so plain decoding and speculation compute every row alike. Forwards
wider than the rule covers (a prompt's chunks) run as they are where the rule found wide forwards
agreeing too; where it did not, a prompt runs whole and alone in its forward, as when its
request runs by itself (:attr:`Widths.mixes_prompts`), and the budget keeps every decode step
within the rule (:attr:`Widths.widest`), so a request's rows never depend on what else is in the
batch.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..kernels.exact_rows import RowRule
from ..model.exact_attention import triton_runs_on
from ..model.static import WIDTHS


class Widths(Protocol):
    """What the step asks of a padding rule."""

    #: whether a prompt chunk may share a forward with other requests' rows (their prompts or trees)
    mixes_prompts: bool
    #: the most rows a decode forward may have (the budget grants no more); ``None``: no limit
    widest: int | None

    def rows_for(self, k: int) -> int: ...


class RowWidths:
    """A :class:`~specdraft.kernels.exact_rows.RowRule` as the step uses it."""

    def __init__(self, rule: RowRule) -> None:
        self.rule = rule
        self.mixes_prompts = rule.wider
        # a decode forward wider than the rule covers would give its rows other bits: where wider
        # forwards were not found to agree, the budget keeps every step within the rule
        self.widest: int | None = None if rule.wider else rule.max_rows

    def rows_for(self, k: int) -> int:
        """Rows a forward of ``k`` real rows runs at; a forward wider than the rule covers runs as
        it is (a prompt alone in its forward, when wide forwards were not found to agree)."""
        return self.rule.rows_for(k) if k <= self.rule.max_rows or self.rule.wider else k

    def __repr__(self) -> str:
        return f"RowWidths({self.rule.describe()})"


def exact_default(model: Any, attention: str) -> bool:
    """Whether exact mode may be the default for this device and dtype, with the default attention
    (exact mode is the default only where it costs at most 5% of the speed):

    * bfloat16 and float16 on a CPU: where this machine's kernels make it cheap, which the decoder
      measures per machine and model (:mod:`specdraft.kernels.exact_kernels`): on AMD EPYCs a few
      percent (``benchmarks/results/exact-price-*``), on an Intel Xeon with AMX far more;
    * bfloat16 on CUDA where exact attention's Triton kernels run: nothing measurable on an H100
      (``benchmarks/results/gpu-h100-2026-11-27-7a7546a``: exact plain decoding ran at 1.04-1.06x
      the speed of plain decoding, median per prompt, and exact speculation at 1.08-1.16x the
      default's), since every decode forward is one replayed graph at a bucket width either way.
      On an H200 (``benchmarks/results/gpu-h200-2026-11-28-27af751``) exact speculation gave
      exact plain decoding's tokens on 8/10 and 7/10 prompts only, though the probe found every
      layer agreeing at every width (:mod:`specdraft.kernels.exact_rows`): on CUDA exact mode
      narrows the parting, it does not yet close it.

    Never for float32 (exact there already against ``model.generate``, and padding a plain step to
    several rows costs up to 70% on MKL's kernels), nor for float16 on CUDA and on other
    accelerators (not measured)."""
    if attention != "auto":
        return False
    dtype = getattr(model, "dtype", torch.float32)
    device = getattr(model, "device", torch.device("cpu"))
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float16)
    if device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available():
        return triton_runs_on(device)
    return False


def exact_buckets(rule: RowRule) -> tuple[int, ...]:
    """The bucket widths (:data:`~specdraft.model.static.WIDTHS`) at which an exact-mode rule holds,
    and its widest width: on a GPU a forward of 64 rows costs about what one of 1 costs, so padding
    a plain step to the narrowest of these is cheap, and every decode forward stays one captured
    graph (the buckets of the GPU step serve exact mode too)."""
    return tuple(sorted({w for w in WIDTHS if w in rule.widths} | {rule.max_rows}))
