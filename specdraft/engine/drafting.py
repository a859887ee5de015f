"""Draft: every source guesses for a request, and the guesses merge into its full tree.

The sources never see the model or each other: each gets the request's context and a node budget
and returns a :class:`~specdraft.sources.base.Draft`; the merge ranks every node by its expected
value (the request's learned source rates, :mod:`specdraft.budget.acceptance`) and keeps the best
``max_tree_nodes``. That full tree is what the budget sizes (it checks a prefix of it) and what
the acceptance tracker learns from. After the step, each source hears what was committed
(:meth:`Drafter.feed_back`).

A source's own draft is never edited: branches are cut on a copy so a step never commits past
the token limit, and token ids outside the model's vocabulary raise, naming the source.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch

from ..sources.base import Draft, DraftSource, Feedback, SideBlock, observes_late, source_option
from ..tree import TokenTree
from .readback import Readback, TopRows
from .request import LaggedDrafts, LiveRequest, PendingStep


@dataclass(frozen=True)
class Proposal:
    """A request's drafts for one step: the side blocks that fit, and every source's draft merged
    into the full tree."""

    sides: list[SideBlock | None]
    full: TokenTree
    #: the sources drafted (``False``: asked with a budget of 0, a step of a drafting pause)
    drafted: bool = True
    #: the drafts were made behind the last forward (:meth:`Drafter.propose_lagged`)
    lagged: bool = False

    @property
    def side_rows(self) -> int:
        return sum(len(s.tokens) for s in self.sides if s is not None)


class Drafter:
    """The sources of a decoder, and what the engine asks of them. ``sources`` is the decoder's own
    list: a source added or removed there takes part from the next request on."""

    def __init__(self, sources: list[DraftSource], max_tree_nodes: int, vocab_size: int,
                 max_positions: int | None) -> None:
        self.sources = sources
        self.max_tree_nodes = max_tree_nodes
        self.vocab_size = vocab_size
        self.max_positions = max_positions

    @property
    def names(self) -> list[str]:
        """Each source's name, made unique (``name#2`` for a second source of one name)."""
        return _unique_names([s.name for s in self.sources])

    @property
    def wants_top(self) -> list[bool]:
        """Which sources read the model's top-k at every row (Token Recycling)."""
        return [source_option(s, "top_k") > 0 for s in self.sources]

    @property
    def top_k(self) -> int:
        """The largest k a source asks for (0: no top-k is read)."""
        return max([source_option(s, "top_k") for s in self.sources], default=0)

    @property
    def warmup_steps(self) -> int:
        """Steps the slowest source needs before its drafts mean anything (Jacobi fills its window)."""
        return max([0] + [source_option(s, "warmup_steps") for s in self.sources])

    def begin(self, request: LiveRequest) -> None:
        """The sources read the request's prompt: on a CPU at its first draft, after its first
        token is out (the first token never waits for them); on an accelerator while the forward
        that ends its prompt runs (:meth:`~specdraft.engine.step.Step.behind_forward`)."""
        prompt = request.context(request.prompt_length)
        for source in self.sources:
            source.begin(prompt)
            request.begun.append(source)

    def propose(self, request: LiveRequest, drafting: bool = True) -> Proposal:
        """Every source's draft for ``request`` and their merge into its full tree.
        ``drafting=False`` asks every source with a budget of 0 (a step of the request's drafting
        pause, :mod:`specdraft.engine.pause`): each source still gets its ``propose`` before the
        step's ``observe``, and returns at once."""
        if not request.begun and self.sources:
            self.begin(request)
        request.lagged = None  # (drafts made behind an earlier forward: these are newer)
        budget = self.max_tree_nodes if drafting else 0
        drafts = self._drafts(request, budget)
        return Proposal(self._fitting_sides(drafts, request.region.length), _merge(request, drafts, budget), drafting)

    def draft_behind(self, request: LiveRequest) -> None:
        """On an accelerator, in a step of the request's drafting pause: every source drafts behind
        the forward, from the context before the step's tokens, for the next step
        (:meth:`propose_lagged`). The device computes meanwhile, so these drafts cost the step
        nothing, where drafting between two forwards would make the device wait."""
        request.lagged = LaggedDrafts(len(request.committed), self._drafts(request, self.max_tree_nodes))

    def propose_lagged(self, request: LiveRequest) -> Proposal:
        """A step of the request's drafting pause on an accelerator: the drafts made behind the last
        forward (:meth:`draft_behind`), each branch that begins with the tokens committed since,
        cut after them, merged into the full tree as usual (no source is asked now; each drafts
        behind this step's forward instead). Side blocks stay out: their positions were those of
        the older context. Without such drafts (the pause's first step), the tree is the root."""
        lagged, request.lagged = request.lagged, None
        depth_limit = _depth_limit(request)
        drafts = [Draft() for _ in self.sources]
        if lagged is not None and depth_limit >= 1:
            since = request.committed[lagged.at:]
            n = len(since)
            drafts = [Draft(branches=[list(b[n : n + depth_limit]) for b in d.branches
                                      if len(b) > n and list(b[:n]) == since]) for d in lagged.drafts]
        return Proposal([None] * len(drafts), _merge(request, drafts, self.max_tree_nodes),
                        drafted=lagged is not None, lagged=True)

    def _drafts(self, request: LiveRequest, budget: int) -> list[Draft]:
        """Every source's draft of up to ``budget`` nodes from the request's context, its branches
        cut to the tokens the request may still add."""
        context = request.context()
        depth_limit = _depth_limit(request)
        return [self._propose(source, context, budget, depth_limit) for source in self.sources]

    def _propose(self, source: DraftSource, context, budget: int, depth_limit: int) -> Draft:
        draft = source.propose(context, budget)
        side = draft.side_block
        for tokens in [*draft.branches, side.tokens if side is not None else []]:
            if not _in_vocabulary(tokens, self.vocab_size):
                bad = [t for t in tokens if not 0 <= int(t) < self.vocab_size]
                raise ValueError(f"draft source {source.name!r} proposed token ids {bad[:5]} outside the "
                                 f"model's vocabulary [0, {self.vocab_size})")
        if budget == 0 or depth_limit < 1:
            return Draft(side_block=side)
        return Draft(branches=[list(b[:depth_limit]) for b in draft.branches if len(b)], side_block=side)

    def _fitting_sides(self, drafts: Sequence[Draft], cache_len: int) -> list[SideBlock | None]:
        """The side blocks that fit after ``cache_len`` cached positions: one reaching past the
        model's context is left out, and its source gets ``side_logits=None`` for the step."""
        sides: list[SideBlock | None] = []
        for draft in drafts:
            side = draft.side_block
            if side is not None and side.tokens and self.max_positions is not None \
                    and cache_len + max(side.positions) >= self.max_positions:
                side = None
            sides.append(side)
        return sides

    def feed_back(self, request: LiveRequest, step: PendingStep, tokens: list[int], logits: torch.Tensor,
                  readback: Readback, top: TopRows | None, late: bool = False) -> None:
        """Tell every source what the step committed, with its side block's logits and argmax and,
        for sources that asked (``top_k``), the top-k of every row. With ``late``, the sources that
        observe late (``observes_late``, no side block this step) are not told now: their
        feedback waits in ``request.late`` for the next forward's launch."""
        after = request.context()
        for source, side, argmax, wants_top in zip(self.sources, step.side_slices, readback.side_argmax,
                                                   self.wants_top):
            side_logits = logits[side].to(torch.float32) if side is not None else None
            mine = top if wants_top else None
            feedback = Feedback(committed=list(tokens), context=after, side_logits=side_logits,
                                top_ids=mine.ids if mine is not None else None,
                                row_tokens=mine.row_tokens if mine is not None else None, side_argmax=argmax)
            if late and side is None and observes_late(source):
                request.late.append(partial(source.observe, feedback))
            else:
                source.observe(feedback)

    def finish(self, request: LiveRequest, failed: bool) -> None:
        """End every begun source, or, when the request failed, ``abort`` those that can undo what it
        taught them (see :class:`~specdraft.sources.base.DraftSource`). Every source is finished even
        if one raises; the first such error is raised afterwards (unless the request already failed,
        whose own error then stands)."""
        context = request.context()
        error: BaseException | None = None
        for source in request.begun:
            finish = getattr(source, "abort", None) if failed else None
            try:
                (finish or source.end)(context)
            except Exception as exc:  # noqa: BLE001 - finish the others first
                error = error or exc
        request.begun = []
        if error is not None and not failed:
            raise error


def _depth_limit(request: LiveRequest) -> int:
    """The deepest draft node a step of ``request`` may check: the step's bonus token takes the
    last slot of its token limit."""
    return request.spec.max_new_tokens - len(request.output) - 1


def _merge(request: LiveRequest, drafts: Sequence[Draft], budget: int) -> TokenTree:
    """The full tree of ``drafts``: their best ``budget`` nodes by value (the request's source rates)."""
    return TokenTree.from_drafts(request.root, [d.branches for d in drafts], budget, request.acceptance.source_rates)


def _in_vocabulary(tokens, vocab_size: int) -> bool:
    """Whether every id of ``tokens`` is in ``[0, vocab_size)``, read through ``int`` as the token
    by token check reads them (so the same ids raise), by builtins rather than a Python loop: it
    runs for every branch of every step."""
    ids = list(map(int, tokens))
    return not ids or (0 <= min(ids) and max(ids) < vocab_size)


def _unique_names(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out
