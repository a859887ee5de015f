"""One step, for every running request at once: draft -> plan -> lay out -> forward -> read back -> settle.

1. **draft**: each decoding request's sources propose, and their branches merge into its full
   tree (:mod:`specdraft.engine.drafting`); a request whose source raises ends alone; a request
   whose recent drafts did not pay for their host time skips drafting for a few steps, and on an
   accelerator checks instead what it drafted behind the last forward (:mod:`specdraft.engine.pause`);
2. **plan**: the budget grants each request a number of its tree's nodes, weighing every
   request's expected tokens against the forward's cost (:mod:`specdraft.budget`);
3. **lay out**: each request's checked tree and side blocks become rows of the forward
   (:mod:`specdraft.engine.layout`); a request still prefilling sends a chunk of its prompt;
4. **forward**: one forward of all rows over the KV store (:mod:`specdraft.model.runner`), with
   everything the host sends in one upload; on an accelerator, what the read does not need (the
   learning from the last step, the ends of finished requests' sources, the indexing of a prompt
   that ends here) runs while the forward does;
5. **read back**: every request's choices, side-block argmax and top-k, read from the device at
   once (:mod:`specdraft.engine.readback`);
6. **settle**: each request verifies its own rows, commits, keeps its accepted path in the cache,
   and its sources and acceptance learn (:mod:`specdraft.engine.settle`).

A request that finished its prompt in this step's forward settles its *prompt step* here too:
the prompt's last row verified on a root-only tree gives its first token, as in ``model.generate``.
Each request is as exact as it is alone: its rows see only its own tokens, its verification uses
its own settings and its own random draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np
import torch

from ..budget import Ask, Grant
from ..model.runner import ForwardOutput, Segment
from ..tree import TokenTree
from .drafting import Proposal
from .parts import Parts
from .layout import tree_rows
from .readback import ReadPlan, ReadSlots
from .request import LiveRequest, PendingStep, path_tokens, run_queued
from .row_draws import request_draws
from .settle import settle
from .topk import top_k_ids

#: The most prompt rows a forward carries while other requests decode: a long prompt is
#: prefilled in chunks of this size across steps, so the running requests keep decoding.
PREFILL_CHUNK = 512

Emitted = tuple[int, list[int]]


@dataclass
class StepReport:
    """What a step did: the tokens each request committed, and the forward it ran (its rows, and
    the tree nodes of each decoding request)."""

    emitted: list[Emitted] = field(default_factory=list)
    width: int = 0
    tree_nodes: list[int] = field(default_factory=list)


@dataclass
class Member:
    """One request's part of the step: a chunk of its prompt, or a tree."""

    request: LiveRequest
    kind: Literal["chunk", "tree"]
    proposal: Proposal | None = None
    chunk_rows: int = 0
    segment: Segment | None = None
    rider_index: int | None = None
    #: its sources draft behind this forward, for the next step (a drafting pause on an accelerator)
    drafts_behind: bool = False


class Step:
    """See the module docstring; :meth:`run` is the whole step, read top to bottom."""

    def __init__(self, parts: Parts, running: Sequence[LiveRequest],
                 behind: list[Callable[[], None]] | None = None) -> None:
        self.engine = parts
        self.running = list(running)
        #: other work waiting for this step's forward (the loop's ends of finished requests)
        self.behind = behind if behind is not None else []

    def run(self) -> StepReport:
        """The step; a request that ends in it (a stop rule, or a failure: its ``error``) is left
        ``ending`` for the caller to finish."""
        started = self.engine.clock()
        members = self.draft()
        grants = self.plan(members)
        riders = self.lay_out(members, grants)
        members = [m for m in members if m.segment is not None]
        if not members:
            return StepReport()
        output = self.forward(members, riders)
        if self.engine.hides_host_work:
            self.behind_forward(members)
        fetched = self.read_back(members, output)
        emitted = self.settle(members, output, fetched)
        return self.account(members, emitted, started)

    # -- 1. draft -----------------------------------------------------------------------------

    def draft(self) -> list[Member]:
        members = []
        padding = self.engine.padding
        if padding is not None and not padding.mixes_prompts:
            # exact mode where wide forwards compute rows in other bits: a prompt runs alone in
            # its forward, whole, as when its request runs by itself, so its keys and values do
            # not depend on the other requests (their prompts or their trees)
            prefilling = next((r for r in self.running if r.prefilling), None)
            if prefilling is not None:
                return [Member(prefilling, "chunk", chunk_rows=prefilling.prompt_length - prefilling.prefilled)]
        chunk_left = PREFILL_CHUNK if any(r.decoding for r in self.running) else None
        for request in self.running:
            if request.prefilling:
                rows = request.prompt_length - request.prefilled
                if chunk_left is not None:
                    rows = min(rows, chunk_left)
                    chunk_left -= rows
                members.append(Member(request, "chunk", chunk_rows=rows))
                continue
            drafting = not request.pause.skip()  # no drafts in a pause (see engine.pause)
            if not drafting:
                request.stats.skipped_drafts += 1
                if self.engine.hides_host_work and request.begun:  # the drafts made behind the last forward
                    members.append(Member(request, "tree", proposal=self.engine.drafter.propose_lagged(request),
                                          drafts_behind=True))
                    continue
            timed = drafting and bool(request.begun)  # (not the first draft: it also reads the prompt)
            started = self.engine.clock()
            try:
                proposal = self.engine.drafter.propose(request, drafting)
            except Exception as exc:  # noqa: BLE001 - a source that raises ends its request alone
                request.fail(exc)
                continue
            if timed:
                request.pause.drafted(self.engine.clock() - started)
            members.append(Member(request, "tree", proposal=proposal))
        return members

    # -- 2. plan --------------------------------------------------------------------------------

    def plan(self, members: Sequence[Member]) -> list[Grant]:
        asks = []
        for m in members:
            request = m.request
            if m.kind == "chunk":
                asks.append(Ask((), 0, 0, m.chunk_rows, decoding=False, context=request.prefilled + m.chunk_rows))
            else:
                asks.append(Ask(request.acceptance.rank_rates, m.proposal.full.num_draft_nodes, m.proposal.side_rows,
                                1, context=request.region.length + 1, opening=request.acceptance.tree_steps == 0))
        return self.engine.budget.allocate(asks)

    # -- 3. lay out -----------------------------------------------------------------------------

    def lay_out(self, members: Sequence[Member], grants: Sequence[Grant]) -> list[np.ndarray]:
        """Each member's segment; returns the riders (host arrays that travel in the upload)."""
        riders: list[np.ndarray] = []
        for m, grant in zip(members, grants):
            request, region = m.request, m.request.region
            if m.kind == "chunk":
                if m.chunk_rows == 0:
                    continue
                at, rows = request.prefilled, m.chunk_rows
                ends = at + rows == request.prompt_length
                m.segment = Segment(region, request.committed[at : at + rows], np.arange(at, at + rows),
                                    None, [rows - 1] if ends else [])
                continue
            proposal = m.proposal
            tree = proposal.full.prefix(grant.nodes)
            sides = proposal.sides if grant.side_blocks else [None] * len(proposal.sides)
            rows = tree_rows(tree, sides)
            if len(rows.tokens) > region.free:  # side blocks too wide for the region: they stay out
                rows = tree_rows(tree, [None] * len(sides))
            request.step = PendingStep("tree", tree, rows.side_slices, drafted=proposal.drafted, lagged=proposal.lagged,
                                       exploring=self.engine.budget.exploring)
            m.segment = Segment(region, rows.tokens, rows.offsets + region.length, rows.block, range(len(rows.tokens)))
            if request.penalty is not None and request.batched:
                m.rider_index = len(riders)
                riders += [np.asarray(request.unmarked, dtype=np.int64), path_tokens(tree)]
        return riders

    # -- 4. forward -----------------------------------------------------------------------------

    def forward(self, members: Sequence[Member], riders: list[np.ndarray]) -> ForwardOutput:
        engine = self.engine
        with engine.kernels():
            padding = engine.padding.rows_for if engine.padding is not None else None
            output = engine.runner.forward([m.segment for m in members], riders, padding=padding)
        for index, m in enumerate(members):
            request = m.request
            if m.rider_index is not None:
                request.penalty.add(output.riders[m.rider_index])
                request.step.path_tokens = output.riders[m.rider_index + 1]
                request.unmarked = []
            if m.kind == "chunk":
                engine.runner.store.keep_all(request.region)
                if request.penalty is not None:
                    request.penalty.add(output.ids[output.id_spans[index]])
                request.prefilled += m.chunk_rows
                if not request.prefilling:
                    self._start_decoding(request)
        return output

    def _start_decoding(self, request: LiveRequest) -> None:
        """The prompt is in the cache: choose where the request's rows are chosen, make its random
        draws where its logits live, and set up its prompt step (the prompt's last row, whose token
        is the root, verified on a root-only tree)."""
        request.stats.prefill_time = self.engine.clock() - request.admitted
        request.batched = self.engine.batched_rows
        request.draw, request.row_draws = request_draws(self.engine.runner.device, request.spec.seed, request.batched,
                                                        request.spec.settings.do_sample)
        tree = TokenTree(request.root)
        request.step = PendingStep("prompt", tree, [None] * len(self.engine.drafter.sources))

    def behind_forward(self, members: Sequence[Member]) -> None:
        """On an accelerator, while the forward runs: what the last step taught is learned (the
        sources that observe late, the acceptance walk, the statistics: each request's ``late``
        list, filled by its settling), the sources of requests that ended last step are ended
        (``behind``), the sources index the prompts that ended in this forward (their first
        draft then finds them indexed), and a request in a drafting pause drafts for its next
        step. The read that follows needs none of it, so none of it waits between two forwards."""
        for request in self.running:
            _or_fail(request, run_queued, request.late)
        run_queued(self.behind)
        for m in members:
            request = m.request
            if m.drafts_behind and not request.ending:
                _or_fail(request, self.engine.drafter.draft_behind, request)
            drafts_later = request.spec.max_new_tokens > 1  # (one token comes from the prompt step alone)
            if m.kind == "chunk" and not request.prefilling and not request.ending and drafts_later \
                    and self.engine.drafter.sources:
                _or_fail(request, self.engine.drafter.begin, request)

    # -- 5. read back ---------------------------------------------------------------------------

    def read_back(self, members: Sequence[Member], output: ForwardOutput) -> list[int]:
        plan = ReadPlan()
        for index, m in enumerate(members):
            step = m.request.step
            if step is None:  # a prompt chunk that does not end the prompt
                continue
            step.slots = self._slots(m.request, step, output.logits[output.logit_spans[index]], plan)
        return plan.read()

    def _slots(self, request: LiveRequest, step: PendingStep, logits: torch.Tensor, plan: ReadPlan) -> ReadSlots:
        """What ``request`` reads of its rows: each row's choice (batched rows), each side
        block's argmax, every tree row's top-k."""
        n = len(step.tree)
        rows = logits[:n]
        choices = None
        if request.batched:
            scorer = request.scorer
            scores = rows if scorer.is_identity else scorer.process_rows(rows.to(torch.float32),
                                                                         _node_masks(step, request, n))
            if request.spec.settings.do_sample:  # the root row samples sequence index len(committed), depth d the d-th next
                probs = torch.softmax(scores.to(torch.float32), dim=-1)
                choices = plan.add(request.row_draws.choose(probs, step.tree.depth[:n], len(request.committed)))
            else:
                choices = plan.add(scores.argmax(dim=-1))
        sides = tuple(plan.add(logits[s].argmax(dim=-1)) if s is not None else None for s in step.side_slices)
        k = min(self.engine.drafter.top_k, logits.shape[-1])
        top = plan.add(top_k_ids(rows, k)) if k else None
        return ReadSlots(choices, sides, top, k, tuple(step.tree.tokens))

    # -- 6. settle ------------------------------------------------------------------------------

    def settle(self, members: Sequence[Member], output: ForwardOutput, fetched: list[int]) -> list[Emitted]:
        emitted = []
        for index, m in enumerate(members):
            request = m.request
            step = request.step
            if step is None or step.slots is None or request.ending:
                continue
            logits = output.logits[output.logit_spans[index]]
            tokens = settle(self.engine, request, logits, step.slots.take(fetched))
            if tokens:
                emitted.append((request.index, tokens))
        return emitted

    def account(self, members: Sequence[Member], emitted: list[Emitted], started: float) -> StepReport:
        """The step's cost, for the budget when it was a pure decoding step, and its report."""
        width = sum(len(m.segment.tokens) for m in members)
        trees = [m.request.step.tree for m in members if m.kind == "tree"]
        if trees and all(m.kind == "tree" for m in members):
            padding = self.engine.padding
            ran = padding.rows_for(width) if padding is not None else width
            self.engine.budget.observe_step(ran, self.engine.clock() - started, sum(len(t) for _, t in emitted))
        return StepReport(emitted, width, [len(t) - 1 for t in trees])


def _or_fail(request: LiveRequest, job: Callable[..., None], *args: object) -> None:
    """Run ``job(*args)``, host work of ``request``'s sources: one that raises ends the request alone."""
    try:
        job(*args)
    except Exception as exc:  # noqa: BLE001 - a source that raises ends its request alone
        request.fail(exc)


def _node_masks(step: PendingStep, request: LiveRequest, n: int) -> torch.Tensor | None:
    """Each tree row's seen-token mask for a repetition penalty: the committed tokens plus the
    tokens on the node's own path (uploaded with the step's input)."""
    penalty = request.penalty
    if penalty is None:
        return None
    masks = penalty.seen.expand(n, -1)
    if step.path_tokens is None:
        return masks
    return masks.clone().scatter_(1, step.path_tokens, True)

