"""Online calibration of each source's acceptance rate, which the tree merge ranks nodes by.

The merge (:meth:`specdraft.tree.TokenTree.from_drafts`) picks nodes best first by the chance the
model accepts them. That chance is learned here from what each source's nodes achieved, per
source, per depth and per sibling rank (a source's first guess at a position is worth more than
its third), as a *conditional* rate: of the nodes whose parent was accepted, the share that were
accepted too. Only such nodes are counted: a node below a rejected parent says nothing about the
source (it was never in the running).

Which nodes would have been accepted is read off the *full* tree (every node the sources offered,
not only the ones the budget checked) by walking it along the tokens committed after its root, as
the budget's shadow trees do. A walk that is still on the tree when a step's tokens run out waits
for the next step's tokens, so deep nodes of a long copy are counted when their outcome is known,
never guessed. Under sampling the walk follows what was drawn, which is an estimate; it only
orders the tree, never changes what is emitted.

Two averages per entry, like the budget's: a slow one over everything this decoder has seen
(the prior a request starts from; early observations weigh ``1 / (n + 2)`` so the prior counts as
about one observation) and a fast one per request (a source that copies well in one prompt may
not in the next). The fast one is what the merge reads.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .tree import RateFn, TokenTree, prior_rate

#: Depths 1 .. DEPTHS - 1 have their own entries; deeper nodes share the last one.
DEPTHS = 8
#: Sibling ranks 0 .. RANKS - 1 have their own entries; later siblings share the last one.
RANKS = 4
#: Requests whose fast averages are kept at once (a batch runs several; older ones are dropped).
MAX_REQUESTS = 64


def _slot(source_index: int, depth: int, rank: int) -> int:
    """Index of an entry in a source-major flat table."""
    return (source_index * DEPTHS + min(max(depth, 1), DEPTHS) - 1) * RANKS + min(rank, RANKS - 1)


def _prior_table(num_sources: int) -> list[float]:
    return [prior_rate(s, d, k) for s in range(num_sources) for d in range(1, DEPTHS + 1) for k in range(RANKS)]


class _Walk:
    """A full tree whose nodes' outcomes are being read off the committed tokens."""

    __slots__ = ("tree", "node")

    def __init__(self, tree: TokenTree) -> None:
        self.tree = tree
        self.node = 0  # where the committed tokens have led so far


class RequestRates:
    """One request's fast averages (started from the decoder's slow ones) and its pending walks.
    Callable as a :data:`~specdraft.tree.RateFn`."""

    __slots__ = ("values", "walks", "sources")

    def __init__(self, values: list[float]) -> None:
        self.values = values
        self.walks: list[_Walk] = []
        self.sources = len(values) // (DEPTHS * RANKS)

    def __call__(self, source_index: int, depth: int, rank: int) -> float:
        # the merge calls this for every node it considers: _slot inlined, no min/max calls
        if source_index >= self.sources:
            return prior_rate(source_index, depth, rank)
        d = depth if depth < DEPTHS else DEPTHS
        k = rank if rank < RANKS else RANKS - 1
        return self.values[(source_index * DEPTHS + d - 1) * RANKS + k]


class AcceptanceCalibration:
    """Per source, depth and sibling rank, how often a node whose parent was accepted is accepted
    itself (see the module docstring).

    Parameters
    ----------
    num_sources:
        Sources whose rates are kept (their index in the decoder's list).
    fast:
        Weight of the newest observation in a request's fast average.
    slow:
        Weight of the newest observation in the long-run average, once it has seen ``1 / slow - 2``
        observations (before that, a plain mean with the prior counted as one observation).
    """

    def __init__(self, num_sources: int, fast: float = 0.3, slow: float = 0.02) -> None:
        if num_sources < 0:
            raise ValueError(f"num_sources must be >= 0, got {num_sources}")
        if not 0.0 < fast <= 1.0:
            raise ValueError(f"fast must be in (0, 1], got {fast}")
        if not 0.0 < slow <= 1.0:
            raise ValueError(f"slow must be in (0, 1], got {slow}")
        self.num_sources = num_sources
        self.fast = fast
        self.slow = slow
        self.long_run: list[float] = _prior_table(num_sources)
        self.counts: list[int] = [0] * len(self.long_run)
        self._requests: OrderedDict[int, RequestRates] = OrderedDict()

    def rates(self, request_id: int | None = None) -> RateFn:
        """The rate function the merge should use for ``request_id`` (its fast averages, started
        from the long-run ones on first use); ``None``: the long-run averages."""
        if request_id is None:
            return RequestRates(self.long_run)
        return self._request(request_id)

    def start_request(self, request_id: int) -> None:
        """A request starts: its fast averages start from the long-run ones."""
        self._requests.pop(request_id, None)
        self._request(request_id)

    def end_request(self, request_id: int) -> None:
        """A request ended: forget its fast averages and pending walks."""
        self._requests.pop(request_id, None)

    def rate(self, source_index: int, depth: int, rank: int = 0, request_id: int | None = None) -> float:
        """One learned rate (for inspection and tests)."""
        if source_index >= self.num_sources:
            raise ValueError(f"source_index must be in [0, {self.num_sources}), got {source_index}")
        table = self._requests.get(request_id) if request_id is not None else None
        return (table.values if table is not None else self.long_run)[_slot(source_index, depth, rank)]

    def observe(self, request_id: int, tree: TokenTree, committed: Sequence[int]) -> None:
        """A step of ``request_id`` checked ``tree`` (or a prefix of it: its :attr:`~TokenTree.full`
        tree is walked) and committed ``committed`` after its root. Earlier trees still waiting
        for tokens walk on first."""
        state = self._request(request_id)
        waiting = []
        for walk in [*state.walks, _Walk(tree.full if tree.full is not None else tree)]:
            if self._advance(state, walk, committed):
                waiting.append(walk)
        state.walks = waiting

    # -- internals ------------------------------------------------------------------------

    def _request(self, request_id: int) -> RequestRates:
        state = self._requests.get(request_id)
        if state is None:
            state = RequestRates(list(self.long_run))
            self._requests[request_id] = state
            while len(self._requests) > MAX_REQUESTS:
                self._requests.popitem(last=False)
        return state

    def _advance(self, state: RequestRates, walk: _Walk, committed: Sequence[int]) -> bool:
        """Walk ``walk`` along ``committed``, recording every child of each node the walk leaves;
        True if it is still on the tree with children whose outcome is not known yet."""
        tree = walk.tree
        for token in committed:
            children = tree.children(walk.node)
            if not children:
                return False
            for child in children:
                self._record(state, tree.proposers[child], tree.depth[child], tree.tokens[child] == token)
            nxt = tree.child(walk.node, token)
            if nxt is None:
                return False
            walk.node = nxt
        return bool(tree.children(walk.node))

    def _record(self, state: RequestRates, proposers: Sequence[tuple[int, int]], depth: int, hit: bool) -> None:
        outcome = 1.0 if hit else 0.0
        fast, slow, counts, values, long_run = self.fast, self.slow, self.counts, state.values, self.long_run
        for source_index, rank in proposers:
            if source_index >= self.num_sources:
                continue
            slot = _slot(source_index, depth, rank)
            values[slot] += fast * (outcome - values[slot])
            counts[slot] += 1
            long_run[slot] += max(slow, 1.0 / (counts[slot] + 1)) * (outcome - long_run[slot])
