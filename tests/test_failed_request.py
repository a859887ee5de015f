"""A request that fails after it started leaves every shared source exactly as it was.

Sources that learn across requests (the frequency trie, a shared n-gram table, the Token
Recycling matrix, the suffix tree's global cache) are taught by a request while it runs. When the
request fails -- a source raising, the model's forward raising, Ctrl-C -- the decoder calls each
begun source's ``abort`` instead of ``end``, and the source takes back what the request taught
it. A stream the caller closes early is not a failure: its tokens were verified, so they are kept.

Every case below warms the sources with real requests first (so there is learnt state to lose,
and small caps make the failed request prune and evict), then fails a request mid-way and compares
a deep snapshot of every source with the one taken before it.
"""

from __future__ import annotations

from typing import Any

import pytest

from specdraft import Decoder
from specdraft.sources import Context, Draft, Feedback
from specdraft.sources.base import SourceBase
from specdraft.sources.jacobi import JacobiLookahead
from specdraft.sources.ngram import MultiLevelNGram
from specdraft.sources.prompt_lookup import PromptLookup
from specdraft.sources.suffix_tree import SuffixTree
from specdraft.sources.token_recycling import TokenRecycling
from specdraft.sources.trie import FrequencyTrie

from _suffix_checks import check_source, global_counts
from conftest import reference_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [7, 8, 9, 7, 8, 9, 7, 8], [10, 11, 3, 4, 12, 10, 11], [5, 6, 7, 5, 6, 7, 5]]
FAILING_PROMPT = [3, 4, 9, 9, 10, 11, 3, 4, 9]


class Saboteur(SourceBase[None]):
    """A source that raises ``error`` in its ``propose`` (or ``observe``) of step ``at``."""

    name = "saboteur"

    def __init__(self, at: int, error: BaseException, where: str = "propose") -> None:
        super().__init__()
        self.at, self.error, self.where = at, error, where
        self.calls = {"propose": 0, "observe": 0}
        self.armed = False

    def _tick(self, where: str) -> None:
        if not self.armed or where != self.where:
            return
        self.calls[where] += 1
        if self.calls[where] == self.at:
            raise self.error

    def propose(self, context: Context, budget: int) -> Draft:
        self._tick("propose")
        return Draft()

    def observe(self, feedback: Feedback) -> None:
        self._tick("observe")


def shared_sources() -> dict[str, Any]:
    """One of each source, small caps so a request prunes and evicts."""
    return dict(prompt=PromptLookup(), trie=FrequencyTrie(capacity=12, max_nodes=60),
                ngram=MultiLevelNGram(), shared=MultiLevelNGram(shared=True, max_contexts=40, name="ngram-shared"),
                jacobi=JacobiLookahead(), recycle=TokenRecycling(k=4, template="tr8"),
                suffix=SuffixTree(max_cached_requests=3))


def snapshot(sources: dict[str, Any]) -> dict[str, Any]:
    """Everything a request could leave behind in the sources, as plain comparable data."""
    trie, shared, recycle, suffix = sources["trie"], sources["shared"], sources["recycle"], sources["suffix"]
    model = shared.shared_model
    return dict(
        trie=(trie.snapshot(), trie.tree_sizes(), trie.prunes, trie.pruned_nodes, len(trie)),
        shared=({n: model.counts(n) for n in range(2, shared.max_ngram + 1)}, list(model._table)),
        recycle=recycle._matrix.tolist(),
        suffix=(global_counts(suffix), suffix.cached_sequences()),
        live={name: _live(source) for name, source in sources.items()},
    )


def _live(source: Any) -> int:
    value = source.active_requests
    return value if isinstance(value, int) else len(value)


def drafts(sources: dict[str, Any], request_id: int = -99) -> dict[str, list[list[int]]]:
    """What each cross-request source would draft for a few fresh contexts (no request state)."""
    out = {}
    for name in ("trie", "recycle"):
        source = sources[name]
        out[name] = [source.propose(Context(tuple(p), len(p), request_id), 8).branches for p in PROMPTS]
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def warmed(model, saboteur: Saboteur) -> tuple[Decoder, dict[str, Any]]:
    sources = shared_sources()
    dec = Decoder(model, sources=[*sources.values(), saboteur], max_tree_nodes=12, adaptive_budget=False)
    for prompt in PROMPTS:
        assert dec.generate(prompt, max_new_tokens=16).token_ids == reference_greedy(model, prompt, 16)
    return dec, sources


@pytest.mark.parametrize("error, where, at", [
    (RuntimeError("a source broke"), "propose", 4),
    (RuntimeError("a source broke"), "observe", 3),
    (KeyboardInterrupt(), "propose", 5),
    (ValueError("first step"), "propose", 1),
], ids=["propose-raises", "observe-raises", "ctrl-c", "first-propose"])
def test_a_failed_request_leaves_every_source_exactly_as_it_was(model, error, where, at) -> None:
    saboteur = Saboteur(at, error, where)
    dec, sources = warmed(model, saboteur)
    before, before_drafts = snapshot(sources), drafts(sources)
    saboteur.armed = True
    with pytest.raises(type(error)):
        dec.generate(FAILING_PROMPT, max_new_tokens=16)
    assert snapshot(sources) == before
    assert drafts(sources) == before_drafts
    sources["trie"].check_invariants()
    check_source(sources["suffix"])
    # and everything still works, exactly
    saboteur.armed = False
    assert dec.generate(FAILING_PROMPT, max_new_tokens=16).token_ids == reference_greedy(model, FAILING_PROMPT, 16)


def test_the_model_failing_mid_way_is_undone_too(model) -> None:
    dec, sources = warmed(model, Saboteur(0, RuntimeError()))
    before = snapshot(sources)
    forward, calls = dec.runner.forward, [0]

    def failing_forward(*args: Any, **kwargs: Any):
        calls[0] += 1
        if calls[0] == 4:
            raise MemoryError("out of memory in the forward")
        return forward(*args, **kwargs)

    dec.runner.forward = failing_forward  # type: ignore[method-assign]
    with pytest.raises(MemoryError):
        dec.generate(FAILING_PROMPT, max_new_tokens=16)
    assert calls[0] == 4
    assert snapshot(sources) == before


def test_a_stream_closed_early_is_kept_not_undone(model) -> None:
    """Closing a stream is a normal early stop: what was committed was verified and is learnt."""
    dec, sources = warmed(model, Saboteur(0, RuntimeError()))
    before = snapshot(sources)
    stream = dec.stream(FAILING_PROMPT, max_new_tokens=16)
    for _ in range(3):
        next(stream)
    stream.close()
    after = snapshot(sources)
    assert after["live"] == before["live"]  # every request state dropped
    assert after["trie"] != before["trie"] and after["suffix"] != before["suffix"]  # the output was learnt


class BrokenEnd(SourceBase[None]):
    name = "broken-end"

    def propose(self, context: Context, budget: int) -> Draft:
        return Draft()

    def end(self, context: Context) -> None:
        raise RuntimeError("end failed")


def test_one_source_failing_to_end_does_not_leave_the_others_running(model) -> None:
    sources = shared_sources()
    dec = Decoder(model, sources=[BrokenEnd(), *sources.values()], max_tree_nodes=12, adaptive_budget=False)
    with pytest.raises(RuntimeError, match="end failed"):
        dec.generate(PROMPTS[0], max_new_tokens=8)
    assert all(_live(s) == 0 for s in sources.values())
    with pytest.raises(RuntimeError, match="end failed"):  # the decoder was released: it runs again
        dec.generate(PROMPTS[0], max_new_tokens=8)
    healthy = Decoder(model, sources=list(sources.values()), max_tree_nodes=12, adaptive_budget=False)
    assert healthy.generate(PROMPTS[0], max_new_tokens=8).token_ids == reference_greedy(model, PROMPTS[0], 8)


def test_a_source_without_abort_gets_end(model) -> None:
    """``abort`` is optional: a plain protocol object (no SourceBase) is ended as before."""

    class Plain:
        name = "plain"

        def __init__(self) -> None:
            self.ended: list[int] = []

        def begin(self, context: Context) -> None: ...

        def propose(self, context: Context, budget: int) -> Draft:
            raise RuntimeError("no draft today")

        def observe(self, feedback: Feedback) -> None: ...

        def end(self, context: Context) -> None:
            self.ended.append(context.request_id)

    plain = Plain()
    dec = Decoder(model, sources=[plain], max_tree_nodes=4, adaptive_budget=False)
    with pytest.raises(RuntimeError, match="no draft today"):
        dec.generate(PROMPTS[0], max_new_tokens=4)
    assert len(plain.ended) == 1
