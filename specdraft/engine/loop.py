"""The loop of one call: admission, cancellation and failure isolation around the step.

A :class:`Batch` runs a call's requests (one for ``generate``, many for ``generate_batch``) up to
``concurrency`` at a time:

* queued requests are admitted as soon as a slot is free (continuous batching: a request that
  ends hands its slot and its cache region to the next one at the next step, nobody waits for
  the longest);
* each step runs every admitted request through :class:`~specdraft.engine.step.Step`;
* a request whose source raises, or that the caller cancels, ends alone and the others go on; an
  exception from outside the requests (the forward, a ``KeyboardInterrupt``) ends every running
  request as failed (their sources abort) and is raised.

Iterating a batch yields ``(request index, committed token ids)`` as steps commit them; after
the iteration :attr:`Batch.outputs` and :attr:`Batch.stats` hold the results.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Callable, Iterator, Sequence

from ..sampling import NodeScorer, PenaltyPrefix
from ..stats import GenerationStats, SourceStats
from .outputs import BatchOutput, BatchStats
from .parts import Parts
from .request import LiveRequest, RequestSpec, now_or_later, request_ids, run_queued
from .step import Emitted, Step

#: Cache rows a request's region holds beyond prompt + new tokens + tree: room for side blocks.
REGION_SLACK = 64


class Batch:
    """One call's requests (see the module docstring)."""

    def __init__(self, engine: Parts, specs: Sequence[RequestSpec], concurrency: int,
                 stats: Sequence[GenerationStats | None] = ()) -> None:
        self.engine = engine
        #: turns an output's token ids into its text (``None`` without a tokenizer)
        self.text = engine.text
        self.specs = list(specs)
        #: statistics objects a caller gave for some requests (filled as the request runs)
        self._given_stats = list(stats)
        self.concurrency = concurrency
        self.outputs: list[BatchOutput | None] = [None] * len(self.specs)
        self.stats = BatchStats()
        self._cancel: set[int] = set()
        #: ends of finished requests' sources waiting for the next forward (see :meth:`finish`)
        self._ends: list[Callable[[], None]] = []

    def cancel(self, index: int) -> None:
        """End request ``index`` at the next step (or before it starts); the others go on."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"a request index must be an int, got {index!r}")
        if not 0 <= index < len(self.specs):
            raise IndexError(f"request index {index} out of range for a batch of {len(self.specs)}")
        self._cancel.add(index)

    def __iter__(self) -> Iterator[Emitted]:
        with self.engine.held(self.concurrency):
            yield from self._loop()

    def _loop(self) -> Iterator[Emitted]:
        clock = self.engine.clock
        started = clock()
        queue = deque(range(len(self.specs)))
        running: list[LiveRequest] = []
        store = self.engine.runner.store
        if self.concurrency > 1 and len(self.specs) > 1:
            self.engine.runner.check_batches()
        store.clear()
        store.reserve(sum(self._region_rows(self.specs[i]) for i in list(queue)[: self.concurrency]))
        try:
            while queue or running:
                while queue and len(running) < self.concurrency:
                    request = self._admit(queue.popleft())
                    if request is not None:
                        running.append(request)
                for request in running:
                    if request.index in self._cancel:
                        request.cancelled = True
                        self.finish(request)
                running = [r for r in running if not r.finished]
                if running:
                    report = Step(self.engine, running, self._ends).run()
                    later = self._ends if self.engine.hides_host_work else None
                    for request in running:
                        if request.ending and not request.finished:
                            self.finish(request, failed=request.error is not None, later=later)
                    self._record(report, len(running))
                    yield from report.emitted
                    running = [r for r in running if not r.finished]
        except BaseException as exc:
            closed = isinstance(exc, GeneratorExit)  # the caller closed the stream: not a failure
            for request in running:
                if not request.finished:
                    if not (request.ending and request.error is None):  # not already at its stop rule
                        request.error = request.error or (None if closed else exc)
                        request.cancelled = closed
                    self.finish(request, failed=request.error is not None)
            for index in queue:  # never started: over too, each with an output
                self.outputs[index] = BatchOutput([], self.text([]), self._new_stats(index), error=None if closed else exc,
                                                  cancelled=closed)
            raise
        finally:
            run_queued(self._ends)  # no forward left to hide them behind
            self.stats.wall_time = clock() - started

    # -- a request's life ---------------------------------------------------------------------

    def _region_rows(self, spec: RequestSpec) -> int:
        return len(spec.prompt_ids) + spec.max_new_tokens + self.engine.drafter.max_tree_nodes + 1 + REGION_SLACK

    def _new_stats(self, index: int) -> GenerationStats:
        """Request ``index``'s statistics (the caller's object, if it gave one), with a counter for
        every source of the decoder."""
        given = self._given_stats[index] if index < len(self._given_stats) else None
        stats = given if given is not None else GenerationStats()
        stats.per_source = {name: SourceStats() for name in self.engine.drafter.names}
        return stats

    def _admit(self, index: int) -> LiveRequest | None:
        """Start request ``index`` (``None``: it ended before its first step)."""
        spec, engine = self.specs[index], self.engine
        if index in self._cancel or spec.max_new_tokens == 0:
            self.outputs[index] = BatchOutput([], self.text([]), self._new_stats(index),
                                              cancelled=index in self._cancel)
            return None
        committed = list(spec.prompt_ids)
        runner = engine.runner
        request = LiveRequest(index=index, spec=spec, committed=committed, prompt_length=len(committed),
                              request_id=next(request_ids), region=runner.store.allocate(self._region_rows(spec)),
                              stats=self._new_stats(index), acceptance=engine.budget.acceptance.start(),
                              scorer=NodeScorer(spec.settings), admitted=engine.clock())
        if spec.settings.needs_prefix:
            request.penalty = PenaltyPrefix(runner.vocab_size, runner.device, committed)
        return request

    def finish(self, request: LiveRequest, failed: bool = False,
               later: list[Callable[[], None]] | None = None) -> None:
        """End ``request``: free its region, keep its output, and finish (or, on failure, abort) its
        sources; given ``later``, the sources' part is queued there to run behind the next forward
        (ending a source can take long: the trie takes a 16k-token prompt's windows back in tens
        of milliseconds). A source that fails then still fails the request: its output's
        ``error`` is set before the call's iteration ends."""
        if request.finished:
            return
        request.finished = True
        self.engine.runner.store.release(request.region)
        request.stats.wall_time = self.engine.clock() - request.admitted
        tokens = list(request.output)
        output = BatchOutput(tokens, self.text(tokens), request.stats, error=request.error, cancelled=request.cancelled)
        self.outputs[request.index] = output
        now_or_later(later, partial(self._end_sources, request, failed, output))

    def _end_sources(self, request: LiveRequest, failed: bool, output: BatchOutput) -> None:
        try:
            run_queued(request.late)  # the sources hear every step before the end
        except Exception as exc:  # noqa: BLE001 - a source failing to learn fails this request alone
            request.error = request.error or exc
            failed = True
        try:
            self.engine.drafter.finish(request, failed)
        except Exception as exc:  # noqa: BLE001 - a source failing to finish ends this request alone
            request.error = request.error or exc
        output.error = request.error

    def _record(self, report, running: int) -> None:
        if not report.width:
            return
        self.stats.forwards += 1
        self.stats.rows += report.width
        self.stats.new_tokens += sum(len(tokens) for _, tokens in report.emitted)
        self.stats.tree_sizes.append((running, report.tree_nodes))
