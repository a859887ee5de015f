"""What a forward costs, as a price relative to a one-row forward: width, and attention over context.

The adaptive budget (:mod:`specdraft.budget`) compares widths: a tree is worth checking when the
tokens it is expected to commit beat its price in one-token steps. It needs *relative* prices, and
those belong to the kernels and the model, while the absolute step time belongs to the moment: on
a busy machine every step may take twice as long for a minute, then not. Keeping one moving average
of seconds per width mixes the two. A width measured during a slow minute keeps a price set by
that minute, and since the budget only measures widths it runs, a width priced too dear is never
run, so never measured again. Plain steps track the machine's present speed and wide ones keep
its past, so the relative price of width grows with a load that has already gone.

So the cost of a step is split into two numbers:

``level``
    seconds of a one-token step now (the machine's present speed), a moving average;
``shape(width)``
    the cost of a forward of ``width`` rows in one-token steps. It comes from a measured cost
    curve when one is given (:mod:`specdraft.kernel_costs` measures one per machine, model and
    kernel path), and is then fixed: every step, of any width, only updates ``level``, so noise and
    load move all prices together and never change which width is best. Without a curve each width's
    shape is learned from its own steps, as seconds divided by the level of the plain steps around
    it, with a new observation allowed to move it at most by :data:`MAX_CHANGE` (one slow outlier
    cannot price a width out of use) and never above ``width`` (rows can always be run one by one).
    Widths not measured yet are interpolated between measured neighbours (one-token steps cost
    1.0) and take the widest measured one's shape beyond it: optimistic guesses that make the
    budget try them, after which they are known. Where forwards are padded to fixed widths, a
    one-token step is one at the narrowest (:attr:`StepCosts.plain_width`), and shapes are
    learned relative to it.

Each width is priced on its own: kernels do not follow powers of two (FBGEMM streams weights in
blocks of six rows; MKL on AMD makes 2-3 rows dearer than 4).

Attention
    The curve prices a forward's linear layers, nearly all of a one-request step on a CPU. Every
    row also attends over its own request's context, and with long contexts or several requests
    that is a good part of a forward. So a forward of rows ``r_i`` over contexts ``c_i`` costs
    ``shape(sum r_i) + attention * sum r_i c_i`` one-row forwards, where ``attention`` is the
    measured seconds of a row of attention per cached position
    (:mod:`specdraft.kernels.attention_cost`) over the seconds of a one-row forward.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

#: The most one observation may move a learned shape (a factor either way).
MAX_CHANGE = 2.0


def _moving_average(old: float | None, new: float, weight: float) -> float:
    """Geometric moving average: a slow outlier of ``k`` times moves it by ``k ** weight``, not by
    ``1 + weight * (k - 1)`` (step times are noisy by factors, not by amounts)."""
    return new if old is None else math.exp((1 - weight) * math.log(old) + weight * math.log(new))


class StepCosts:
    """Seconds of a step by forward width: ``level * shape(width)``, plus attention (see the
    module docstring).

    ``curve`` is the measured cost of a forward of 1, 2, ... rows in seconds (it is normalised by
    its first entry); ``None`` learns the shape from the steps themselves. ``attention_seconds``
    is a row's attention per cached position (0: not priced).
    """

    def __init__(self, curve: Sequence[float] | None = None, smoothing: float = 0.5,
                 attention_seconds: float = 0.0) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not attention_seconds >= 0.0:
            raise ValueError(f"attention_seconds must be >= 0, got {attention_seconds}")
        self.weight = smoothing  # (not named smoothing: copies of a budget holding it must pickle alike)
        self.attention_seconds = float(attention_seconds)
        #: the widths forwards run at (:class:`~specdraft.engine.widths.Widths`): a forward of ``k``
        #: rows costs what one of ``padding.rows_for(k)`` does; ``None``: as they come
        self.padding: Any = None
        self.level: float | None = None  # seconds of a one-token step now
        self.learned: dict[int, float] = {}  # width -> shape, learned (no curve)
        self._unpriced: dict[int, float] = {}  # width -> seconds, seen before any plain step (no curve)
        self.set_curve(curve)

    def set_curve(self, curve: Sequence[float] | None) -> None:
        """Price widths from ``curve`` (seconds, or any unit, of a forward of 1, 2, ... rows) from
        now on (``None``: learn them from the steps)."""
        if curve is None:
            self.curve: list[float] | None = None
            self._one_row_seconds: float | None = None
            return
        values = [float(c) for c in curve]
        if not values:
            raise ValueError("a cost curve needs at least the cost of a one-row forward, got an empty curve")
        bad = [c for c in values if not (math.isfinite(c) and c > 0)]
        if bad:
            raise ValueError(f"cost curve values must be finite and > 0 (the cost of a forward of 1, 2, ... "
                             f"rows), got {bad[:3]}")
        self.curve = [c / values[0] for c in values]
        self._one_row_seconds = values[0]

    @property
    def plain_width(self) -> int:
        """Rows a one-token step's forward runs at: the unit learned shapes are measured in. Where
        every forward is padded (exact mode pads to the narrowest width its probe allows), a
        one-token step runs at the narrowest width, and a tree that fits in it costs what a plain
        step does."""
        return self.padding.rows_for(1) if self.padding is not None else 1

    @property
    def known(self) -> bool:
        """Whether any step has been measured yet (before that :meth:`seconds` is ``None``)."""
        return self.level is not None or bool(self._unpriced)

    # -- prices ---------------------------------------------------------------------------

    def shape(self, width: int) -> float:
        """Cost of a step of ``width`` rows in one-token steps."""
        if self.padding is not None:
            width = self.padding.rows_for(max(1, width))
        if self.curve is not None:
            return 1.0 if width <= 1 else _from_curve(self.curve, width)
        plain = self.plain_width
        if width <= plain:
            return 1.0
        # before any plain step the wide ones seen count as two plain steps: a guess that makes
        # the budget try a plain step, after which the real prices are known
        points = sorted(self.learned.items()) or [(w, min(2.0, w / plain)) for w in sorted(self._unpriced)]
        below = [(plain, 1.0)] + [(w, s) for w, s in points if w < width]
        above = [(w, s) for w, s in points if w >= width]
        if not above:
            return below[-1][1]  # wider than anything measured: the widest's price (optimistic)
        (w0, s0), (w1, s1) = below[-1], above[0]
        return s1 if w1 == width else s0 + (s1 - s0) * (width - w0) / (w1 - w0)

    def attention_price(self) -> float:
        """A row's attention per cached position, in one-row forwards (0 when unknown)."""
        if not self.attention_seconds:
            return 0.0
        unit = self._one_row_seconds or self.seconds(1)
        return self.attention_seconds / unit if unit else 0.0

    def price(self, width: int, row_columns: int = 0) -> float:
        """A forward of ``width`` rows whose rows attend over ``row_columns`` cached positions in
        all (the sum over rows), in one-row forwards."""
        return self.shape(width) + self.attention_price() * row_columns

    def seconds(self, width: int) -> float | None:
        """Estimated seconds of a step of ``width`` rows now; ``None`` before any measurement."""
        if self.level is not None:
            return self.level * self.shape(width)
        if self._unpriced:  # only wide steps so far (warm-up): the nearest measured one, as it was
            nearest = min(self._unpriced, key=lambda w: (abs(w - width), w))
            return self._unpriced[nearest] * self.shape(width) / self.shape(nearest)
        return None

    # -- learning -------------------------------------------------------------------------

    def observe(self, width: int, seconds: float) -> None:
        """A step of forward width ``width`` took ``seconds``."""
        if not (math.isfinite(seconds) and seconds > 0):
            return  # a clock that did not move says nothing about prices
        width = max(1, int(width))
        if self.curve is not None:
            self.level = _moving_average(self.level, seconds / self.shape(width), self.weight)
            return
        if width <= self.plain_width:
            self.level = _moving_average(self.level, seconds, self.weight)
            for w, s in self._unpriced.items():  # the warm-up's wide steps, now that a plain one is known
                self._learn(w, s / self.level)
            self._unpriced.clear()
        elif self.level is None:
            self._unpriced[width] = _moving_average(self._unpriced.get(width), seconds, self.weight)
        else:
            self._learn(width, seconds / self.level)

    def _learn(self, width: int, ratio: float) -> None:
        old = self.learned.get(width)
        if old is not None:
            ratio = min(max(ratio, old / MAX_CHANGE), old * MAX_CHANGE)
        ratio = min(ratio, float(width))  # rows one at a time never cost more than that
        self.learned[width] = _moving_average(old, ratio, self.weight)


def _from_curve(curve: Sequence[float], width: int) -> float:
    """``curve[width - 1]``; past its end, the slope of its last quarter carries on."""
    n = len(curve)
    if width <= n:
        return curve[width - 1]
    if n == 1:
        return curve[0] * width
    tail = max(2, n // 4)
    slope = max(0.0, (curve[-1] - curve[-tail]) / (tail - 1))
    return curve[-1] + slope * (width - n)
