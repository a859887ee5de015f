"""Many requests at once: one forward per step for every running request, under one budget.

A :class:`BatchLoop` runs requests through the same step as the one-request loop (draft, merge,
one forward, verify, compact, commit), for up to ``concurrency`` requests side by side:

1. queued requests are admitted as soon as a slot is free (continuous batching: a request that
   ends hands its slot and its cache rows to the next one at the next step, nobody waits for the
   longest);
2. every decoding request's sources draft its full tree; the :class:`~specdraft.batch_budget.
   BatchBudget` decides how many of each tree's nodes this forward checks;
3. one forward carries every request's rows: each decoding request's root, tree and side blocks,
   and a chunk of each newly admitted prompt (at most :data:`PREFILL_CHUNK` prompt rows per step,
   so a long prompt does not stall the others) over one packed cache
   (:class:`~specdraft.batch_runner.BatchRunner`);
4. each request verifies its own rows, exactly as alone, commits, and its sources learn.

Each request is as exact as it is alone: its rows see only its own tokens, its verification uses
its own settings and its own random stream (a seed gives the same draws as the one-request
decoder with that seed). A request whose source raises, or that the caller cancels, ends alone;
the others go on.

This module drives a :class:`~specdraft.decoder.Decoder` (its sources, budget facts, verifier
and statistics) without importing it: the decoder imports this module, not the other way round.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .batch_budget import Ask, BatchBudget
from .batch_runner import BatchRunner, Region, Segment
from .budget import AdaptiveBudget, BudgetDecision, StepOutcome
from .packed_attention import packed_attention_for
from .row_draws import RowDraws, request_draws
from .sampling import NodeScorer, PenaltyPrefix, SamplingSettings
from .sources.base import Draft, DraftSource, SideBlock
from .stats import GenerationStats, SourceStats
from .step import Request, Step, finish_sources, path_tokens, request_ids
from .stopping import StopRule
from .tree import TokenTree

#: The most prompt rows one batched forward carries: a long prompt is prefilled in chunks of this
#: size across steps, so the running requests keep decoding while it fills.
PREFILL_CHUNK = 512

#: Cache rows a request's region holds beyond prompt + new tokens + tree, for side blocks.
REGION_SLACK = 64


@dataclass
class BatchRequest:
    """One request of a batch with its own settings. Fields left ``None`` take the values given to
    :meth:`~specdraft.decoder.Decoder.generate_batch` (and from there the model's generation
    config, as in :meth:`~specdraft.decoder.Decoder.generate`)."""

    prompt: Any
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] | str | None = None


@dataclass
class BatchStats:
    """What a whole batch cost: every forward counted once, whatever it carried."""

    forwards: int = 0
    new_tokens: int = 0
    wall_time: float = 0.0
    rows: int = 0  # rows of every forward, summed
    #: (running requests, tree nodes of each decoding request) per forward
    tree_sizes: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_rows(self) -> float:
        """Rows per forward: the width the batch ran at."""
        return self.rows / self.forwards if self.forwards else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.forwards} forwards ({self.mean_rows:.1f} rows each), "
                f"{self.tokens_per_s:.1f} tokens/s ({self.wall_time:.2f} s)")


@dataclass
class BatchOutput:
    """One request's result: its new tokens, text and statistics, and the error that ended it
    (``None`` when it ran to a stop rule; a cancelled request has ``cancelled`` set)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    error: BaseException | None = None
    cancelled: bool = False


class BatchResult(Sequence[BatchOutput]):
    """The outputs of :meth:`~specdraft.decoder.Decoder.generate_batch` in prompt order (a
    sequence of :class:`BatchOutput`), with the batch's totals in :attr:`stats`."""

    def __init__(self, outputs: list[BatchOutput], stats: BatchStats) -> None:
        self.outputs = outputs
        self.stats = stats

    def __getitem__(self, index):  # type: ignore[override]
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)


@dataclass
class _Running:
    """One admitted request between steps."""

    index: int
    request: Request
    rule: StopRule
    settings: SamplingSettings
    scorer: NodeScorer
    seed: int | None
    region: Region
    tracker: AdaptiveBudget
    stats: GenerationStats
    admitted: float
    prefilled: int = 0  # prompt tokens in the cache
    step: Step | None = None  # the step in flight
    drafts: list[Draft] | None = None
    full: TokenTree | None = None  # this step's full tree (the budget checks a prefix of it)
    sides: list[SideBlock | None] | None = None
    draw: Any = None  # the node-by-node walk's sampling draw
    row_draws: RowDraws | None = None  # the batched rows' positional noise (sampling on a device)
    penalty: PenaltyPrefix | None = None
    unmarked: list[int] = field(default_factory=list)
    pending_top: tuple[np.ndarray, np.ndarray] | None = None
    begun: list[DraftSource] = field(default_factory=list)
    finished: bool = False
    error: BaseException | None = None
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)
    batched: bool = False  # rows chosen on the device at once (see Decoder._batched_rows)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.request.prompt_length


class BatchLoop:
    """Runs a list of requests through a decoder's sources and verifier, ``concurrency`` at a time.

    Iterate it for ``(request index, committed token ids)`` pairs as steps commit them; after the
    iteration :attr:`outputs` and :attr:`stats` hold the results. :meth:`cancel` ends one request.
    """

    def __init__(self, decoder: Any, runner: BatchRunner, budget: BatchBudget,
                 requests: Sequence[tuple[list[int], SamplingSettings, StopRule, int | None]],
                 concurrency: int) -> None:
        self.decoder = decoder
        self.runner = runner
        self.budget = budget
        self.requests = list(requests)
        self.concurrency = concurrency
        self.outputs: list[BatchOutput | None] = [None] * len(self.requests)
        self.stats = BatchStats()
        self._cancel: set[int] = set()
        self._clock = decoder.clock

    def cancel(self, index: int) -> None:
        """End request ``index`` at the next step (or before it starts); the others go on."""
        if not 0 <= index < len(self.requests):
            raise IndexError(f"request index {index} out of range for a batch of {len(self.requests)}")
        self._cancel.add(index)

    # -- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        busy = self.decoder._busy
        if not busy.acquire(blocking=False):
            raise RuntimeError("this Decoder is busy with another request or batch; finish or close it first, "
                               "or use one Decoder per thread")
        try:
            with packed_attention_for(self.decoder.model):
                yield from self._run()
        finally:
            busy.release()

    def _run(self) -> Iterator[tuple[int, list[int]]]:
        started = self._clock()
        queue = deque(range(len(self.requests)))
        running: list[_Running] = []
        self.runner.clear()
        self.runner.reserve(sum(self._region_rows(i) for i in list(queue)[: self.concurrency]))
        try:
            while queue or running:
                while queue and len(running) < self.concurrency:
                    index = queue.popleft()
                    if index in self._cancel:
                        self._settle_unstarted(index, cancelled=True)
                        continue
                    run = self._admit(index)
                    if run is not None:
                        running.append(run)
                for run in running:
                    if run.index in self._cancel and not run.finished:
                        run.cancelled = True
                        self._finish(run)
                running = [r for r in running if not r.finished]
                if not running:
                    continue
                for index, tokens in self._step(running):
                    yield index, tokens
                running = [r for r in running if not r.finished]
        except BaseException as exc:
            for run in running:
                if not run.finished:
                    run.error = run.error or (exc if not isinstance(exc, GeneratorExit) else None)
                    run.cancelled = isinstance(exc, GeneratorExit)
                    self._finish(run, failed=not isinstance(exc, GeneratorExit))
            raise
        finally:
            self.stats.wall_time = self._clock() - started

    def _region_rows(self, index: int) -> int:
        prompt_ids, _, rule, _ = self.requests[index]
        return len(prompt_ids) + rule.max_new_tokens + self.decoder.max_tree_nodes + 1 + REGION_SLACK

    def _admit(self, index: int) -> _Running | None:
        prompt_ids, settings, rule, seed = self.requests[index]
        stats = self._new_stats()
        if rule.max_new_tokens == 0:
            self.outputs[index] = BatchOutput([], self._text([]), stats)
            return None
        region = self.runner.allocate(self._region_rows(index))
        return _Running(index=index, request=Request(list(prompt_ids), len(prompt_ids), next(request_ids)),
                        rule=rule, settings=settings, scorer=NodeScorer(settings), seed=seed, region=region,
                        tracker=self.budget.tracker(), stats=stats, admitted=self._clock())

    def _settle_unstarted(self, index: int, cancelled: bool) -> None:
        self.outputs[index] = BatchOutput([], self._text([]), self._new_stats(), cancelled=cancelled)

    def _new_stats(self) -> GenerationStats:
        """A request's statistics, with a counter for every source of the decoder."""
        return GenerationStats(per_source={name: SourceStats() for name in self.decoder._source_names})

    def _text(self, tokens: list[int]) -> str | None:
        tokenizer = self.decoder.tokenizer
        return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None

    def _finish(self, run: _Running, failed: bool = False) -> None:
        """End ``run``: finish (or, on failure, abort) its sources, free its cache rows, keep its output."""
        if run.finished:
            return
        run.finished = True
        try:
            finish_sources(run.begun, run.request.context(), failed)
        except Exception as exc:  # noqa: BLE001 - a source failing to finish ends this request alone
            run.error = run.error or exc
        self.runner.release(run.region)
        run.stats.wall_time = self._clock() - run.admitted
        self.outputs[run.index] = BatchOutput(list(run.tokens), self._text(run.tokens), run.stats, error=run.error,
                                              cancelled=run.cancelled)

    def _fail(self, run: _Running, error: BaseException) -> None:
        run.error = error
        self._finish(run, failed=True)

    # -- one step -----------------------------------------------------------------------------

    def _step(self, running: list[_Running]) -> list[tuple[int, list[int]]]:
        """Draft, allocate, one forward, verify and commit for every running request."""
        decoder = self.decoder
        step_started = self._clock()
        prefill_left = PREFILL_CHUNK
        asks: list[Ask] = []
        for run in running:
            if run.prefilling:
                rows = min(prefill_left, run.request.prompt_length - run.prefilled)
                prefill_left -= rows
                asks.append(Ask((), 0, 0, rows, decoding=False, context=run.prefilled + rows))
                continue
            try:
                if not run.begun and run.step is not None:  # the first draft: the sources read the prompt now
                    prompt = run.request.prompt_context()
                    for source in decoder.sources:
                        source.begin(prompt)
                        run.begun.append(source)
                    run.tracker.start_request()
                run.drafts, run.sides = decoder._drafts(run.request, run.rule, run.region.length)
            except Exception as exc:  # noqa: BLE001 - a source that raises ends its request alone
                self._fail(run, exc)
                asks.append(Ask((), 0, 0, 0, decoding=False))
                continue
            run.full = decoder._full_tree(run.request.root, run.drafts, run.request.request_id)
            side_rows = sum(len(s.tokens) for s in run.sides if s is not None)
            asks.append(Ask(run.tracker.accept_rate, run.full.num_draft_nodes, side_rows, 1,
                            context=run.region.length + 1))
        nodes = self.budget.allocate(asks)
        segments: list[Segment] = []
        members: list[tuple[_Running, str, int]] = []  # run, what it sent ("tree" / "prefill"), prompt rows
        riders: list[np.ndarray] = []
        rider_owner: list[_Running] = []
        for run, ask, n in zip(running, asks, nodes):
            if run.finished:
                continue
            if run.prefilling:
                rows = ask.fixed_rows
                if rows == 0:
                    continue
                at = run.prefilled
                last = at + rows == run.request.prompt_length
                segments.append(Segment(run.region, run.request.committed[at : at + rows],
                                        np.arange(at, at + rows, dtype=np.int64),
                                        np.tril(np.ones((rows, rows), dtype=bool)), [rows - 1] if last else []))
                members.append((run, "prefill", rows))
                continue
            decision = BudgetDecision(n, 0.0, 0.0)
            step = decoder._lay_out(run.full, run.drafts, run.sides, decision, step_started)
            tokens, offsets, block = step.forward_input
            if run.region.length + len(tokens) > run.region.capacity:  # a side block too wide for the region
                step = decoder._lay_out(run.full, run.drafts, run.sides, BudgetDecision(n, 0.0, 0.0, side_blocks=False),
                                        step_started)
                tokens, offsets, block = step.forward_input
            run.step = step
            segments.append(Segment(run.region, tokens, np.asarray(offsets, dtype=np.int64) + run.region.length,
                                    block, range(len(tokens))))
            members.append((run, "tree", 0))
            if run.penalty is not None and run.batched:
                riders += [np.asarray(run.unmarked, dtype=np.int64), path_tokens(step.tree)]
                rider_owner.append(run)
        if not segments:
            return []
        self.stats.tree_sizes.append((len(asks), [n for n, a in zip(nodes, asks) if a.decoding]))
        width = sum(len(s.tokens) for s in segments)
        with decoder._kernels():
            logits = self.runner.forward_segments(segments, riders)
        for k, run in enumerate(rider_owner):
            run.penalty.add(self.runner.rider_tensors[2 * k])
            run.step.path_tokens = self.runner.rider_tensors[2 * k + 1]
            run.unmarked = []
        verifying: list[tuple[_Running, torch.Tensor]] = []
        at = 0
        for (run, kind, rows), seg in zip(members, segments):
            mine = logits[at : at + len(seg.logit_rows)]
            at += len(seg.logit_rows)
            if kind == "prefill":
                self.runner.keep_all(run.region)
                run.prefilled += rows
                if run.prefilling:
                    continue
                run.stats.prefill_time = self._clock() - run.admitted
                self._start_decoding(run, mine)
            verifying.append((run, mine))
        # every request's choices, side-block argmax and top-k, read from the device at once
        parts = [decoder._verdict_parts(run.step, mine, run.settings, run.scorer, run.penalty, run.row_draws,
                                        len(run.request.committed),
                                        run.batched) for run, mine in verifying]
        present = [p for p in parts if p is not None]
        fetched = torch.cat(present).tolist() if present else []  # the step's one read
        emitted: list[tuple[int, list[int]]] = []
        at = 0
        for (run, mine), part in zip(verifying, parts):
            size = part.numel() if part is not None else 0
            tokens = self._settle(run, mine, fetched[at : at + size])
            at += size
            if tokens:
                emitted.append((run.index, tokens))
        seconds = self._clock() - step_started
        self.budget.observe(width, seconds)
        self.stats.forwards += 1
        self.stats.rows += width
        self.stats.new_tokens += sum(len(t) for _, t in emitted)
        return emitted

    def _start_decoding(self, run: _Running, logits: torch.Tensor) -> None:
        """The prompt is in the cache: set up the request's sampling stream and penalty where its
        logits live, and verify the prefill's last row on a root-only tree (step 0)."""
        device = logits.device
        run.batched = self.decoder._batched_rows(device)
        run.draw, run.row_draws = request_draws(device, run.seed, run.batched, run.settings.do_sample)
        if run.settings.needs_prefix:
            run.penalty = PenaltyPrefix(logits.shape[-1], device, run.request.committed)
            run.penalty.add(run.request.committed)
        run.step = Step(TokenTree(run.request.root), [], [None] * len(self.decoder.sources), None,
                        self.decoder._decision0, run.admitted)

    def _settle(self, run: _Running, logits: torch.Tensor, fetched: list[int]) -> list[int]:
        """Verify ``run``'s step on its rows (``fetched``: what was read of its verdict parts),
        commit, compact its cache rows, let its sources and its acceptance estimate learn; returns
        the committed tokens."""
        decoder = self.decoder
        step = run.step
        request = run.request
        verdict, side_argmax, top = decoder._verdict_from(step, fetched, logits, run.settings, run.scorer,
                                                          run.penalty, run.draw, run.batched)
        tokens, done = run.rule.cut(request.output, verdict.tokens)
        decoder._record(run.stats, step.tree, verdict, len(tokens))
        if not done and step.forward_input is not None:
            self.runner.keep(run.region, [0] + verdict.path)
        start = request.commit(tokens)
        run.tokens.extend(tokens)
        if run.penalty is not None:
            if run.batched:
                run.unmarked = list(tokens)
            else:
                run.penalty.add(tokens)
        if top is not None and run.pending_top is not None:
            top = (np.concatenate([run.pending_top[0], top[0]]), np.concatenate([run.pending_top[1], top[1]]))
        if step.forward_input is not None:
            try:
                decoder._feed_back(step, tokens, request.context(), logits, side_argmax, top)
            except Exception as exc:  # noqa: BLE001 - a source that raises ends its request alone
                run.stats.new_tokens += len(tokens)
                self._fail(run, exc)
                return tokens
            run.pending_top = None
            run.tracker.observe_drafts(StepOutcome(step.decision, step.tree, [d.branches for d in step.drafts],
                                                   request.committed, start, step.width, 0.0))
            decoder.calibration.observe(request.request_id, step.tree, tokens)
        else:
            run.pending_top = top
        run.stats.new_tokens += len(tokens)
        run.stats.wall_time = self._clock() - run.admitted
        if done:
            self._finish(run)
        return tokens



class BatchStream:
    """What :meth:`~specdraft.decoder.Decoder.stream_batch` returns: iterate it for ``(request
    index, new text)`` pairs as tokens commit (``(index, token ids)`` without a tokenizer; text is
    held back while a character is incomplete). :meth:`cancel` ends one request, the others go
    on; after the iteration, :attr:`outputs` and :attr:`stats` hold the results."""

    def __init__(self, loop: BatchLoop, tokenizer: Any) -> None:
        self._loop = loop
        self._tokenizer = tokenizer
        self._iterator: Iterator | None = None

    def cancel(self, index: int) -> None:
        self._loop.cancel(index)

    @property
    def outputs(self) -> list[BatchOutput | None]:
        return self._loop.outputs

    @property
    def stats(self) -> BatchStats:
        return self._loop.stats

    def result(self) -> BatchResult:
        """Run what is left and return every request's output (the same as ``generate_batch``)."""
        for _ in self:
            pass
        return BatchResult([o for o in self._loop.outputs if o is not None], self._loop.stats)

    def __iter__(self):
        if self._iterator is None:
            self._iterator = self._pieces()
        return self._iterator

    def __next__(self):
        return next(iter(self))

    def close(self) -> None:
        """Stop now: every running request ends as cancelled (its sources finish normally)."""
        if self._iterator is not None:
            self._iterator.close()

    def _pieces(self):
        if self._tokenizer is None:
            yield from self._loop
            return
        tokens: dict[int, list[int]] = {}
        shown: dict[int, int] = {}
        for index, chunk in self._loop:
            mine = tokens.setdefault(index, [])
            mine.extend(chunk)
            text = self._tokenizer.decode(mine, skip_special_tokens=True)
            finished = self._loop.outputs[index] is not None
            if text.endswith("\ufffd") and not finished:
                continue  # a multi-byte character is split across tokens: wait for the rest
            if len(text) > shown.get(index, 0):
                yield index, text[shown.get(index, 0):]
                shown[index] = len(text)
