"""``FrequencyTrie.abort``: a failed request leaves the shared trie exactly as it was before it began.

The trie is taught by a request while it runs (prompt windows at ``begin``, output windows at every
``observe``, prunes whenever a tree or the whole trie passes its cap); all of that goes to the
running part of the trie's counts, which every running request drafts from, and only ``end``
changes the shared part. These tests warm small tries (small
``capacity`` and ``max_nodes``, so the request prunes at ``begin`` and ``observe``), run a request
the way the decoder does (``Feedback`` with growing contexts), abort it, and compare everything,
stamps and clock included, and the drafts for a set of contexts, with the state before the
request; and, with other requests running, inserting, pruning and ending at the same time, check
that the trie ends exactly as a twin that never saw the aborted requests.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specdraft.sources.base import Context, Feedback
from specdraft.sources.trie import FrequencyTrie

VOCAB = 6
PROBES = [(t,) for t in range(VOCAB)] + [(a, b) for a in range(VOCAB) for b in range(VOCAB)] + [(0, 1, 2, 3), (5, 4, 3)]
BUDGETS = (1, 3, 8)

tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=12)
params_st = st.fixed_dictionaries(dict(
    branch_length=st.integers(1, 4), decoding_length=st.integers(1, 8), capacity=st.integers(2, 16),
    max_nodes=st.integers(3, 40), prompt_weight=st.sampled_from([1, 10_000]),
    mode=st.sampled_from(["hierarchical", "parallel"]), prune_to=st.sampled_from([0.0, 0.5, 0.9])))
steps_st = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), min_size=0, max_size=6)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def state(trie: FrequencyTrie) -> dict:
    """Everything the trie would carry into later requests, as plain data: every node's counts
    and stamp (the tie-break of pruning and retrieval), the public views, the clock, the counters."""
    with trie.lock:
        nodes = {tuple(key): (node.out, node.prompt, node.stamp) for key, node in trie.trie.iteritems()}
        return dict(nodes=nodes, snapshot=trie.snapshot(), sizes=trie.tree_sizes(), len=len(trie),
                    clock=trie.clock, prunes=(trie.prunes, trie.tree_prunes, trie.global_prunes,
                                                       trie.pruned_nodes))


def drafts(trie: FrequencyTrie) -> list[list[list[int]]]:
    return [trie.retrieve(tokens, budget) for tokens in PROBES for budget in BUDGETS]


def warm(trie: FrequencyTrie, streams: list[list[int]], rid: int = 1000) -> None:
    """Past answers inserted, and finished requests (their output learnt, their prompt gone)."""
    for i, stream in enumerate(streams):
        if i % 2:
            trie.insert(stream)
        else:
            run(trie, rid + i, stream[: len(stream) // 2], [stream[len(stream) // 2:]] if len(stream) > 1 else [])
            trie.end(Context(tuple(stream), len(stream) // 2, rid + i))


def run(trie: FrequencyTrie, rid: int, prompt: list[int], steps: list[list[int]]) -> tuple[int, ...]:
    """``begin`` then one ``observe`` per step, as the decoder calls them; returns the final tokens."""
    trie.begin(Context(tuple(prompt), len(prompt), rid))
    return run_steps(trie, rid, prompt, steps)


def run_steps(trie: FrequencyTrie, rid: int, prompt: list[int], steps: list[list[int]]) -> tuple[int, ...]:
    """One ``observe`` per step, each with the context after its commit (as the decoder builds it)."""
    tokens = list(prompt)
    for committed in steps:
        tokens += committed
        trie.observe(Feedback(committed=list(committed), context=Context(tuple(tokens), len(prompt), rid)))
    return tuple(tokens)


@SETTINGS
@given(params=params_st, streams=st.lists(tokens_st, max_size=5), idle=st.none() | tokens_st, prompt=tokens_st,
       steps=steps_st, after=tokens_st)
def test_abort_leaves_the_trie_exactly_as_before(params, streams, idle, prompt, steps, after) -> None:
    def fresh() -> FrequencyTrie:
        trie = FrequencyTrie(**params)
        warm(trie, streams)
        if idle is not None:  # a request running since before, idle meanwhile: its prompt may be pruned
            trie.begin(Context(tuple(idle), len(idle), 7))
        return trie

    trie = fresh()
    before, before_drafts = state(trie), drafts(trie)
    tokens = run(trie, 1, prompt, steps)
    event(f"the running nodes pruned: {trie.running_prunes > 0}")
    trie.check_invariants()
    trie.abort(Context(tokens, len(prompt), 1))
    trie.check_invariants()
    assert trie.active_requests == (idle is not None)
    assert state(trie) == before
    if idle is None:  # (a request still running drafts from its own counts too: a prune of the running
        # part while the aborted request ran may have taken some of them, until it ends)
        assert drafts(trie) == before_drafts
    # and what comes next goes exactly as in a trie that never saw the request
    twin = fresh()
    for t in (trie, twin):
        done = run(t, 2, after, [after[::-1]] if after else [])
        t.end(Context(done, len(after), 2))
        if idle is not None:
            t.end(Context(tuple(idle) + (1, 2), len(idle), 7))
        t.check_invariants()
    assert state(trie) == state(twin)
    assert drafts(trie) == drafts(twin)


def test_abort_after_prunes_in_begin_and_observe() -> None:
    """A deterministic case where the failed request prunes at ``begin`` and at ``observe``."""
    trie = FrequencyTrie(branch_length=3, capacity=6, max_nodes=24)
    for stream in ([1, 2, 3, 4, 1, 2, 5], [2, 3, 4, 5, 2, 3], [3, 1, 4, 1, 5, 3, 1]):
        trie.insert(stream)
    before, before_drafts = state(trie), drafts(trie)
    prompt = [1, 2, 3, 0, 0, 1, 2, 4]
    trie.begin(Context(tuple(prompt), len(prompt), 1))
    assert trie.running_prunes > 0, "begin did not prune"
    after_begin = trie.running_prunes
    tokens = run_steps(trie, 1, prompt, [[5, 5], [4], [0, 3, 3, 0], [2, 2, 5]])
    assert trie.running_prunes > after_begin, "observe did not prune"
    trie.abort(Context(tokens, len(prompt), 1))
    trie.check_invariants()
    assert state(trie) == before
    assert drafts(trie) == before_drafts
    assert trie.active_requests == 0


def test_abort_of_an_unknown_request_is_a_no_op() -> None:
    trie = FrequencyTrie(branch_length=2, capacity=8, max_nodes=30)
    trie.insert([1, 2, 3, 1, 2, 4])
    tokens = run(trie, 5, [3, 1, 2], [[3, 1]])  # a live request, not the one aborted
    before, before_drafts = state(trie), drafts(trie)
    trie.abort(Context((9, 9, 9), 3, 6))
    assert state(trie) == before and drafts(trie) == before_drafts
    assert trie.active_requests == 1
    trie.end(Context(tokens, 3, 5))
    ended = state(trie)
    trie.abort(Context(tokens, 3, 5))  # already ended: nothing left to undo
    assert state(trie) == ended and trie.active_requests == 0
    trie.check_invariants()


def test_a_finished_request_then_an_aborted_one_leaves_the_first_ones_state() -> None:
    trie = FrequencyTrie(branch_length=3, capacity=7, max_nodes=25)
    trie.insert([0, 1, 2, 3, 4, 0, 1, 2])
    first = run(trie, 1, [1, 2, 3], [[4, 0], [1], [2, 3, 4]])
    trie.end(Context(first, 3, 1))
    after_first, first_drafts = state(trie), drafts(trie)
    assert after_first["snapshot"], "the finished request left nothing to compare"
    second = run(trie, 2, [4, 0, 1, 5, 5], [[2, 3], [5, 0, 0], [4]])
    assert trie.snapshot(running=True) != after_first["snapshot"]  # what the second request drafts from
    assert state(trie) == after_first  # while the shared trie waits for its end
    trie.abort(Context(second, 5, 2))
    trie.check_invariants()
    assert state(trie) == after_first
    assert drafts(trie) == first_drafts


def test_abort_with_eliminate_off_still_takes_the_prompt_back() -> None:
    """``eliminate=False`` (a Table 5 ablation) keeps prompts after ``end``; a failed request's goes."""
    trie = FrequencyTrie(branch_length=2, capacity=10, max_nodes=40, eliminate=False)
    trie.insert([1, 2, 3, 4])
    before = state(trie)
    tokens = run(trie, 1, [2, 3, 5, 1], [[2], [3, 3]])
    trie.abort(Context(tokens, 4, 1))
    assert state(trie) == before


# -- several requests at once ------------------------------------------------------------------------

op_st = st.one_of(
    st.tuples(st.just("begin"), tokens_st),
    st.tuples(st.just("observe"), st.integers(0, 7), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
    st.tuples(st.just("end"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("insert"), tokens_st),
    st.tuples(st.just("prune"),),
)


@SETTINGS
@given(params=params_st, streams=st.lists(tokens_st, max_size=4), ops=st.lists(op_st, min_size=8, max_size=40))
def test_interleaved_requests_end_as_if_the_aborted_ones_never_ran(params, streams, ops) -> None:
    """Requests interleaved at random with inserts and prunes, some of them aborted. After every
    call the invariants hold, and an abort changes nothing shared; at the end the trie is exactly a
    twin that ran the same calls without the aborted requests', and drafts the same; when no
    request is left, no prompt count is."""
    trie, twin = FrequencyTrie(**params), FrequencyTrie(**params)
    warm(trie, streams)
    warm(twin, streams)
    ids = itertools.count(1)
    live: dict[int, dict] = {}  # rid -> tokens, prompt length, calls made so far (replayed on the twin unless aborted)

    def replay(calls: list) -> None:
        for method, context in calls:
            getattr(twin, method)(context)

    for op in ops:
        kind = op[0]
        rids = sorted(live)
        if kind == "begin":
            rid, prompt = next(ids), list(op[1])
            context = Context(tuple(prompt), len(prompt), rid)
            live[rid] = dict(tokens=list(prompt), plen=len(prompt), calls=[("begin", context)])
            trie.begin(context)
        elif kind == "observe" and rids:
            rid = rids[op[1] % len(rids)]
            req = live[rid]
            req["tokens"] += op[2]
            feedback = Feedback(committed=list(op[2]), context=Context(tuple(req["tokens"]), req["plen"], rid))
            trie.observe(feedback)
            req["calls"].append(("observe", feedback))
        elif kind in ("end", "abort") and rids:
            rid = rids[op[1] % len(rids)]
            req = live.pop(rid)
            context = Context(tuple(req["tokens"]), req["plen"], rid)
            if kind == "end":
                trie.end(context)
                replay(req["calls"] + [("end", context)])
            else:
                before = state(trie)
                trie.abort(context)
                assert state(trie) == before
        elif kind == "insert":
            trie.insert(op[1])
            twin.insert(op[1])
        elif kind == "prune":
            trie.prune()
            twin.prune()
        trie.check_invariants()
        assert trie.active_requests == len(live)
    for rid in sorted(live):  # the rest fail
        trie.abort(Context(tuple(live[rid]["tokens"]), live[rid]["plen"], rid))
        trie.check_invariants()
    assert trie.active_requests == 0
    assert state(trie) == state(twin)
    assert drafts(trie) == drafts(twin)
    assert all(prompt == 0 for _, prompt in trie.snapshot().values()), "a prompt count outlived its request"
