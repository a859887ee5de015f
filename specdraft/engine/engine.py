"""The engine: the parts a decoder keeps from call to call, and the one way requests run through them.

An :class:`Engine` holds the model runner and its KV store, the draft sources (through a
:class:`~specdraft.engine.drafting.Drafter`), the budget with everything it has learned, and the
CPU kernels swapped in around each forward. Every call, one request or many, is a
:class:`~specdraft.engine.loop.Batch` run through the same :class:`~specdraft.engine.step.Step`.
One call runs at a time (the engine owns its KV store); a second caller fails fast.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator, Sequence

from ..budget import Budget
from ..model.packed_attention import packed_attention_for
from ..model.runner import ModelRunner
from ..stats import GenerationStats
from .drafting import Drafter
from .loop import Batch
from .request import RequestSpec
from .widths import Widths


class Engine:
    """See the module docstring. ``kernels`` makes the context entered around each forward (the
    packed CPU weights swapped in, or nothing); ``text`` turns token ids into the output's text
    (``None`` without a tokenizer)."""

    def __init__(self, runner: ModelRunner, drafter: Drafter, budget: Budget,
                 kernels: Callable[[], ContextManager[Any]] = nullcontext,
                 text: Callable[[Sequence[int]], str | None] = lambda ids: None,
                 attention: str | None = None) -> None:
        self.runner = runner
        self.drafter = drafter
        self.budget = budget
        self.kernels = kernels
        self.text = text
        #: the attention implementation the model runs under this engine (set again at each call:
        #: another decoder over the same model may have switched it)
        self.attention = attention
        self._padding: Widths | None = None
        #: The timer behind the statistics and the budget's step costs. A replay of recorded outputs
        #: on a simulated clock (``benchmarks/budget_replay.py``) swaps it, with the runner.
        self.clock: Callable[[], float] = time.perf_counter
        #: how each step chooses every tree row's token: "auto" (all rows at once on an
        #: accelerator, node by node on a CPU), "batched" or "walk"; see :attr:`batched_rows`
        self.row_choices: str = "auto"
        #: whether the host work the next read does not need (the learning from the last step, the
        #: prompt indexing, the ends of finished requests' sources) runs behind each forward
        #: (:meth:`~specdraft.engine.step.Step.behind_forward`): ``None`` = on an accelerator,
        #: whose forward runs while the host goes on (on a CPU it would only hold the read back)
        self.hide_host_work: bool | None = None
        self._busy = threading.Lock()

    @property
    def padding(self) -> Widths | None:
        """The widths forwards are padded to (exact mode, static shapes); ``None``: as they come.
        The budget prices a forward at the width it runs at."""
        return self._padding

    @padding.setter
    def padding(self, padding: Widths | None) -> None:
        self._padding = padding
        self.budget.costs.padding = padding

    def run(self, specs: Sequence[RequestSpec], concurrency: int, stats: Sequence[GenerationStats | None] = ()
            ) -> Batch:
        """A batch of ``specs``, ``concurrency`` at a time; iterate it to run it. ``stats[i]``, if
        given, is filled with request ``i``'s statistics as it runs."""
        return Batch(self, specs, concurrency, stats)

    @property
    def hides_host_work(self) -> bool:
        """See :attr:`hide_host_work`."""
        if self.hide_host_work is None:
            return self.runner.device.type != "cpu"
        return bool(self.hide_host_work)

    @property
    def batched_rows(self) -> bool:
        """Whether each step chooses every tree row's token on the device at once (one read per
        step) rather than walking node by node (a read per node visited). On a CPU a read costs
        nothing and the walk touches only the rows it visits, so it stays the cheaper; elsewhere
        one read per step is what keeps the device busy. (:attr:`Decoder.row_choices
        <specdraft.decoder.Decoder.row_choices>` checks the choice as it is set.)"""
        if self.row_choices == "auto":
            return self.runner.device.type != "cpu"
        return self.row_choices == "batched"

    @contextmanager
    def held(self, concurrency: int) -> Iterator[None]:
        """Hold the engine for one call, with the model on the engine's attention for the call
        only: the model goes back to the implementation it had, so that ``model.generate`` and
        other decoders over the same model run what they expect. Several requests at once
        attend per request (:mod:`specdraft.model.packed_attention`); one request alone needs
        nothing of it."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this Decoder is busy with another request or batch (a stream not yet exhausted or "
                               "closed, or another thread); finish or close it first, or use one Decoder per thread")
        model = getattr(self.runner, "model", None)  # (a replay's stand-in runner has none)
        previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
        try:
            if self.attention is not None and model is not None and previous != self.attention:
                model.set_attn_implementation(self.attention)
            with packed_attention_for(model) if concurrency > 1 and model is not None else nullcontext():
                yield
        finally:
            if model is not None and previous is not None \
                    and getattr(model.config, "_attn_implementation", None) != previous:
                model.set_attn_implementation(previous)
            self._busy.release()

