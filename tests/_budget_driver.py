"""Driving a :class:`~specdraft.budget.Budget` for one request at a time, as the engine does."""

from __future__ import annotations

from typing import Sequence

from specdraft.budget import AcceptanceTracker, Ask, Budget, Grant, RequestAcceptance
from specdraft.tree import TokenTree


def observe(tracker: AcceptanceTracker, request: RequestAcceptance, full: TokenTree, committed: Sequence[int],
            start: int) -> None:
    """A step of ``request`` drafted ``full`` (its full tree) and committed ``committed[start:]``
    after its root (``committed`` is the request's whole sequence), taken in as the engine does:
    the step counted, then its tree walked."""
    tracker.count_step(request, full, start)
    tracker.walk(request, committed)


class OneRequest:
    """One request's view of a budget: ask for a grant, report what the step committed."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.request = budget.acceptance.start()

    def start_request(self) -> None:
        """A new request: its averages start from the long-run ones."""
        self.request = self.budget.acceptance.start()

    @property
    def rates(self) -> list[float | None]:
        return self.request.rank_rates

    def choose(self, offered: int, side: int = 0, context: int = 0) -> Grant:
        ask = Ask(self.request.rank_rates, offered, side, 1, context=context, opening=self.request.tree_steps == 0)
        return self.budget.allocate([ask])[0]

    def observe(self, full: TokenTree, committed: Sequence[int], start: int) -> None:
        observe(self.budget.acceptance, self.request, full, committed, start)

    def observe_chain(self, offered: int, right: int) -> None:
        """The sources offered a chain of ``offered`` nodes, the first ``right`` of them right."""
        chain = list(range(1, offered + 1))
        full = TokenTree.from_drafts(0, [[chain]] if chain else [], self.budget.max_nodes)
        self.observe(full, [0] + chain[:right] + [-1], 1)
