"""A request as the engine sees it: what was asked (:class:`RequestSpec`) and where it stands
(:class:`LiveRequest`), plus the step in flight for it (:class:`PendingStep`).

Every request, alone or in a batch, goes through the same states: admitted with a region of the
KV store, its prompt prefilled (in one forward, or in chunks beside other requests' steps), its
first token verified on the prompt's last row (the *prompt step*: a root-only tree, as
``model.generate`` takes its first token from the prefill), then tree steps until a stop rule,
a failure or a cancellation ends it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import numpy as np
import torch

from ..budget import RequestAcceptance
from ..model.kv_store import Region
from ..sampling import NodeScorer, PenaltyPrefix, SamplingSettings
from ..sources.base import Context, Draft, DraftSource, TokenView
from ..stats import GenerationStats
from ..stopping import StopRule
from ..tree import TokenTree
from .pause import DraftPause
from .readback import ReadSlots, TopRows
from .row_draws import RowDraws
from ..verify import Draw

#: Request ids, unique in the process: sources shared by several decoders (or by the requests of a
#: batch) keep per-request state under them.
request_ids = itertools.count(1)


def run_queued(jobs: list[Callable[[], None]]) -> None:
    """Run the work queued in ``jobs`` (host work waiting for a forward), in order, and empty the
    list first, so that a job that raises leaves nothing behind to run twice."""
    work = list(jobs)
    jobs.clear()
    for job in work:
        job()


def now_or_later(later: list[Callable[[], None]] | None, job: Callable[[], None]) -> None:
    """Run ``job`` now, or queue it in ``later`` to run behind the next forward."""
    if later is None:
        job()
    else:
        later.append(job)


@dataclass(frozen=True)
class RequestSpec:
    """One request, checked and resolved: prompt ids, sampling settings, stop rule and seed."""

    prompt_ids: Sequence[int]
    settings: SamplingSettings
    stop: StopRule
    seed: int | None

    @property
    def max_new_tokens(self) -> int:
        return self.stop.max_new_tokens


@dataclass
class PendingStep:
    """A request's step between its lay-out and its settling.

    ``kind`` is ``"prompt"`` for the prompt step (the prefill's last row verified on a root-only
    tree: no drafts, nothing to learn) and ``"tree"`` for a drafted step. ``tree`` is the checked
    tree (its ``full``: the full tree it was cut from, what the budget and the merge learn from);
    ``side_slices[s]`` are source ``s``'s side-block rows of the forward's output for this request
    (``None``: none this step); ``slots`` say where this request's answers sit in the step's read.
    """

    kind: Literal["prompt", "tree"]
    tree: TokenTree
    side_slices: list[slice | None]
    slots: ReadSlots | None = None
    #: each node's path tokens on the device, ``[nodes, depth]`` (repetition penalty, batched rows)
    path_tokens: torch.Tensor | None = None
    #: its sources drafted (``False``: a step of the request's drafting pause, :mod:`.pause`)
    drafted: bool = True
    #: its drafts were made behind the last forward (:class:`LaggedDrafts`)
    lagged: bool = False
    #: the budget's whole-tree trial measured its arm that is not leading with this step
    #: (the request's drafting pause does not learn from it)
    exploring: bool = False


@dataclass(frozen=True)
class LaggedDrafts:
    """Every source's draft made behind a forward, from the context of ``at`` committed tokens
    (before that forward's tokens): the next step checks the part of it that follows them
    (:meth:`~specdraft.engine.drafting.Drafter.propose_lagged`)."""

    at: int
    drafts: list[Draft]


@dataclass
class LiveRequest:
    """One admitted request between steps."""

    index: int
    spec: RequestSpec
    committed: list[int]
    prompt_length: int
    request_id: int
    region: Region
    stats: GenerationStats
    acceptance: RequestAcceptance
    scorer: NodeScorer
    admitted: float
    #: prompt tokens in the cache
    prefilled: int = 0
    #: whether every tree row's choice is made on the device at once (see Engine.batched_rows)
    batched: bool = False
    #: the node-by-node walk's sampling draw, and the batched rows' positional noise
    draw: Draw | None = None
    row_draws: RowDraws | None = None
    penalty: PenaltyPrefix | None = None
    #: committed tokens the device's penalty mask does not hold yet (they ride the next upload)
    unmarked: list[int] = field(default_factory=list)
    #: the prompt step's top-k rows, handed to the sources with the first tree step's
    pending_top: TopRows | None = None
    begun: list[DraftSource] = field(default_factory=list)
    #: the learning from its last step (late sources, acceptance walk, statistics), held back to
    #: run behind the next forward
    late: list[Callable[[], None]] = field(default_factory=list)
    #: its drafting time, and how many steps it still runs without drafting
    pause: DraftPause = field(default_factory=DraftPause)
    #: drafts made behind the last forward, during a drafting pause on an accelerator
    lagged: LaggedDrafts | None = None
    step: PendingStep | None = None
    #: its last step is settled, or it failed (``error``): the loop finishes it after the step
    ending: bool = False
    #: its sources are finished and its region released
    finished: bool = False
    error: BaseException | None = None
    cancelled: bool = False

    def fail(self, error: BaseException) -> None:
        """End the request with ``error`` (its sources will abort what it taught them)."""
        self.error = self.error or error
        self.ending = True

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_length

    @property
    def decoding(self) -> bool:
        """Past its prompt step: each step drafts a tree."""
        return self.step is not None

    @property
    def root(self) -> int:
        """The newest committed token: not in the cache yet, the root of the next tree."""
        return self.committed[-1]

    @property
    def output(self) -> list[int]:
        return self.committed[self.prompt_length :]

    def context(self, length: int | None = None) -> Context:
        """The sequence as the sources see it, or its first ``length`` tokens (the prompt, which
        ``begin`` sees, even after tokens were committed): a read-only view, not a copy (O(1) per
        step)."""
        return Context(TokenView(self.committed, length), self.prompt_length, self.request_id)


def path_tokens(tree: TokenTree) -> np.ndarray:
    """``[nodes, depth]``: row ``i`` holds the tokens on node ``i``'s path below the root, padded
    with the root's token (which the committed prefix holds already, so padding changes no mask)."""
    n, depth = len(tree), max(1, max(tree.depth))
    out = np.full((n, depth), tree.tokens[0], dtype=np.int64)
    for i in range(1, n):
        d = tree.depth[i]
        out[i, : d - 1] = out[tree.parents[i], : d - 1]
        out[i, d - 1] = tree.tokens[i]
    return out
