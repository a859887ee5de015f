"""Settle: a request verifies its rows, commits, keeps its accepted path, and learns.

Verification walks the tree on the rows' choices read from the device (every row's greedy argmax
or one draw, :mod:`specdraft.engine.readback`), or node by node on the logits, where a read per
node costs nothing (a CPU): both accept the longest path the model agrees with, plus one token of
the model's own (:mod:`specdraft.verify`). The stop rules cut the step's tokens where plain
decoding would have stopped; the cache keeps the root and the accepted path; the sources hear
what was committed; the acceptance tracker learns, through the full tree, what the drafts would
have achieved. On an accelerator the learning that the next draft does not need (the sources
that observe late, the acceptance walk, the statistics) waits in the request's ``late`` list
and runs behind the next forward (:meth:`~specdraft.engine.step.Step.behind_forward`).
"""

from __future__ import annotations

from functools import partial

import torch

from ..stats import GenerationStats
from ..tree import TokenTree
from ..verify import Verdict, verify_greedy, verify_sampling, walk_choices
from .parts import Parts
from .readback import Readback
from .request import LiveRequest, PendingStep, now_or_later


def settle(engine: Parts, request: LiveRequest, logits: torch.Tensor, readback: Readback) -> list[int]:
    """Settle ``request``'s step (its rows' ``logits``, its ``readback``); returns the committed
    tokens. A request that ends here (a stop rule, or its source raised) is left ``ending``."""
    step = request.step
    verdict = _verdict(request, step, logits, readback)
    tokens, done = request.spec.stop.cut(request.output, verdict.tokens)
    later = request.late if engine.hides_host_work else None  # (see Step.behind_forward)
    now_or_later(later, partial(record, request.stats, step.tree, verdict, len(tokens), engine.drafter.names))
    if step.kind == "tree" and not done:
        engine.runner.store.keep(request.region, [0] + verdict.path)
    start = len(request.committed)  # (the index of the step's first token)
    request.committed.extend(tokens)
    if request.penalty is not None:
        if request.batched:
            request.unmarked = list(tokens)  # they ride the next step's upload
        else:
            request.penalty.add(tokens)
    top = readback.top
    if step.kind == "prompt":  # the prompt's token answers no proposal: nobody learns from it
        request.pending_top = top
    else:
        if top is not None and request.pending_top is not None:
            top = request.pending_top.then(top)
        request.pending_top = None
        try:
            engine.drafter.feed_back(request, step, tokens, logits, readback, top, late=later is not None)
        except Exception as exc:  # noqa: BLE001 - a source that raises ends its request alone
            request.stats.new_tokens += len(tokens)
            request.fail(exc)
            return tokens
        acceptance = engine.budget.acceptance
        acceptance.count_step(request.acceptance, step.tree.full, start)
        now_or_later(later, partial(acceptance.walk, request.acceptance, request.committed))
        if step.drafted and not step.exploring:
            budget = engine.budget
            request.pause.settled(len(tokens) - 1, budget.costs.seconds(1) if budget.chooses else None,
                                  budget.drafting_share, hidden=step.lagged)
    request.stats.new_tokens += len(tokens)
    request.stats.wall_time = engine.clock() - request.admitted
    request.ending = request.ending or done
    return tokens


def _verdict(request: LiveRequest, step: PendingStep, logits: torch.Tensor, readback: Readback) -> Verdict:
    tree = step.tree
    if readback.choices is not None:
        return walk_choices(tree, readback.choices)
    rows = logits[: len(tree)]
    settings, scorer = request.spec.settings, request.scorer
    committed = request.penalty if request.penalty is not None else []
    if settings.do_sample:
        return verify_sampling(tree, rows, scorer, committed, request.draw)
    return verify_greedy(tree, rows, None if scorer.is_identity else scorer, committed)


def record(stats: GenerationStats, tree: TokenTree, verdict: Verdict, kept: int, source_names: list[str]) -> None:
    """Count one step in ``stats``: its tokens, its tree, and each source's proposed and accepted nodes."""
    stats.steps += 1
    stats.accept_lengths.append(kept)
    stats.tree_sizes.append(len(tree))
    accepted_nodes = verdict.path[:kept]
    for index, name in enumerate(source_names):
        bit = 1 << index
        per = stats.per_source[name]
        per.proposed += sum(1 for s in tree.sources[1:] if s & bit)
        per.accepted += sum(1 for n in accepted_nodes if tree.sources[n] & bit)
