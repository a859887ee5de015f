"""FrequencyTrie (Ant's Lookahead trie): data-structure invariants, retrieval, threads, greedy identity.

The invariants are checked against a model of the ideal, unpruned trie. The shared trie holds the
output windows of finished requests and what was inserted; every running request drafts from the
shared trie and what all running requests taught so far (their prompt windows and the output
windows they completed) read as one. Without pruning both views must equal the model exactly; with
pruning, every surviving count is at most the model's (a pruned node made anew has counted only
what came after), never negative, the shared trie never holds a prompt count, the key sets are
prefix-closed, every first-token tree within ``capacity`` and each part within ``max_nodes`` after
every call. Ending
a request must add exactly its output windows to the shared trie, whatever was pruned before.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specdraft import Decoder, PromptLookup
from specdraft.sources import Context, DraftSource, Feedback
from specdraft.sources.trie import FrequencyTrie

from conftest import FAST, VOCAB, generation_config_override, reference_greedy, tiny_model

# -- the model of the ideal trie ----------------------------------------------------------------------


def window_keys(tokens, start, stop):
    return [tuple(tokens[start : i + 1]) for i in range(start, stop)]


def prompt_windows(prompt, branch_length):
    for start in range(len(prompt) - 1):
        yield start, min(start + branch_length + 1, len(prompt))


def output_windows(tokens, prompt_length, branch_length, final):
    """The output windows the trie has inserted for a request whose committed tokens are ``tokens``:
    complete windows containing a generated token, plus (``final``) the shortened tail windows."""
    width = branch_length + 1
    start = max(0, prompt_length - branch_length)
    while start + width <= len(tokens):
        yield start, start + width
        start += 1
    if final and len(tokens) > prompt_length:
        for s in range(start, len(tokens) - 1):
            yield s, len(tokens)


class Model:
    """Expected ``(out, prompt)`` counts of an unpruned trie: the shared one, and what the running
    requests draft from (the shared counts plus what every running request taught so far)."""

    def __init__(self, branch_length):
        self.L = branch_length
        self.out = Counter()
        self.active = {}  # request id -> [prompt tuple, committed list]

    def begin(self, rid, prompt):
        self.active[rid] = [tuple(prompt), list(prompt)]

    def commit(self, rid, tokens):
        self.active[rid][1].extend(tokens)

    def end(self, rid):
        prompt, tokens = self.active.pop(rid)
        for s, e in output_windows(tokens, len(prompt), self.L, final=True):
            self.out.update(window_keys(tokens, s, e))

    def insert(self, tokens):
        for s, e in prompt_windows(tokens, self.L):
            self.out.update(window_keys(tokens, s, e))

    def expected(self, running=False):
        """The shared counts, or with ``running`` what the running requests draft from."""
        out = Counter(self.out)
        prompt = Counter()
        for p, tokens in self.active.values() if running else ():
            for s, e in output_windows(tokens, len(p), self.L, final=False):
                out.update(window_keys(tokens, s, e))
            for s, e in prompt_windows(p, self.L):
                prompt.update(window_keys(p, s, e))
        keys = set(out) | set(prompt)
        return {k: (out[k], prompt[k]) for k in keys}


def check_bounds(trie: FrequencyTrie) -> None:
    """The pruning bounds, from the public view alone: per first-token tree and in total."""
    snap = trie.snapshot()
    per_tree = Counter(key[0] for key in snap)
    assert per_tree == Counter(trie.tree_sizes())
    assert all(n <= trie.capacity for n in per_tree.values()), (per_tree, trie.capacity)
    assert len(snap) == len(trie) <= trie.max_nodes, (len(snap), trie.max_nodes)
    assert all(key[:-1] in snap for key in snap if len(key) > 1), "not prefix-closed"
    assert all(out >= 0 and prompt == 0 for out, prompt in snap.values()), "a negative or prompt count shared"


def check_view(snap, expected, exact: bool) -> None:
    if exact:
        assert snap == expected
    else:
        for key, (out, prompt) in snap.items():
            assert key in expected, f"{key} was never inserted"
            e_out, e_prompt = expected[key]
            assert 0 <= out <= e_out and 0 <= prompt <= e_prompt, (key, (out, prompt), expected[key])


def check_against_model(trie: FrequencyTrie, model: Model) -> None:
    trie.check_invariants()
    check_bounds(trie)
    check_view(trie.snapshot(), model.expected(), trie.prunes == 0)
    exact = trie.prunes == 0 and trie.running_prunes == 0
    check_view(trie.snapshot(running=True), model.expected(running=True), exact)


# -- stateful property test ----------------------------------------------------------------------------

SMALL_VOCAB = st.integers(0, 4)
token_lists = st.lists(SMALL_VOCAB, min_size=0, max_size=12)


class TrieMachine(RuleBasedStateMachine):
    """Random interleavings of begin / commit (observe) / end / insert / prune / query over several
    requests on one trie, with the model alongside."""

    @initialize(branch_length=st.integers(1, 4), capacity=st.sampled_from([1, 3, 8, 20, 60, 10**9]),
                max_nodes=st.sampled_from([1, 10, 40, 150, 10**9]),
                mode=st.sampled_from(["hierarchical", "parallel"]), prompt_weight=st.sampled_from([1, 3, 10_000]),
                prune_to=st.sampled_from([0.0, 0.5, 0.9, 1.0]), min_nodes=st.integers(1, 6))
    def setup(self, branch_length, capacity, max_nodes, mode, prompt_weight, prune_to, min_nodes):
        self.trie = FrequencyTrie(decoding_length=8, branch_length=branch_length, capacity=capacity, mode=mode,
                                  prompt_weight=prompt_weight, prune_to=prune_to, min_nodes=min_nodes,
                                  max_nodes=max_nodes)
        self.model = Model(branch_length)
        self.next_id = 1
        self.contexts: dict[int, Context] = {}

    @rule(prompt=st.lists(SMALL_VOCAB, min_size=1, max_size=14))
    def begin(self, prompt):
        rid = self.next_id
        self.next_id += 1
        ctx = Context(tuple(prompt), len(prompt), rid)
        self.trie.begin(ctx)
        self.model.begin(rid, prompt)
        self.contexts[rid] = ctx

    @precondition(lambda self: self.contexts)
    @rule(data=st.data(), tokens=st.lists(SMALL_VOCAB, min_size=0, max_size=5))
    def commit(self, data, tokens):
        rid = data.draw(st.sampled_from(sorted(self.contexts)))
        old = self.contexts[rid]
        ctx = Context(tuple(old.tokens) + tuple(tokens), old.prompt_length, rid)
        self.trie.observe(Feedback(committed=list(tokens), context=ctx))
        self.model.commit(rid, tokens)
        self.contexts[rid] = ctx

    @precondition(lambda self: self.contexts)
    @rule(data=st.data())
    def end(self, data):
        """``end`` adds exactly the request's output windows to the shared trie (its last, shortened
        ones included) and nothing of its prompt; a prune at the end only removes nodes."""
        rid = data.draw(st.sampled_from(sorted(self.contexts)))
        trie = self.trie
        prompt, tokens = self.model.active[rid]
        tail = Counter()
        for s, e in output_windows(tokens, len(prompt), trie.branch_length, final=True):
            tail.update(window_keys(tokens, s, e))
        before, prunes = trie.snapshot(), trie.prunes
        trie.end(self.contexts.pop(rid))
        self.model.end(rid)
        after = trie.snapshot()
        expected = {}
        for key in set(before) | set(tail):
            out, p = before.get(key, (0, 0))
            expected[key] = (out + tail[key], p)
        for key, counts in after.items():
            assert counts == expected.get(key), (key, counts, expected.get(key))
        if trie.prunes == prunes:
            assert set(after) == set(expected)

    @precondition(lambda self: self.contexts)
    @rule(data=st.data())
    def abort(self, data):
        """``abort`` leaves the shared trie exactly as it was."""
        rid = data.draw(st.sampled_from(sorted(self.contexts)))
        before, prunes = self.trie.snapshot(), self.trie.prunes
        self.trie.abort(self.contexts.pop(rid))
        self.model.active.pop(rid)
        assert self.trie.snapshot() == before and self.trie.prunes == prunes

    @rule(tokens=token_lists)
    def insert(self, tokens):
        self.trie.insert(tokens)
        self.model.insert(tokens)

    @rule(down_to=st.integers(0, 30))
    def prune(self, down_to):
        before = len(self.trie)
        removed = self.trie.prune(down_to)
        assert removed == max(0, before - down_to)
        assert len(self.trie) == min(before, down_to)

    @rule(down_to=st.integers(0, 10), first=SMALL_VOCAB)
    def prune_tree(self, down_to, first):
        """A per-tree prune leaves every other tree exactly as it was."""
        before = self.trie.snapshot()
        size = self.trie.tree_size(first)
        removed = self.trie.prune(down_to, first_token=first)
        after = self.trie.snapshot()
        assert removed == max(0, size - down_to) and self.trie.tree_size(first) == min(size, down_to)
        assert {k: v for k, v in after.items() if k[0] != first} == {k: v for k, v in before.items() if k[0] != first}

    @rule(context=st.lists(SMALL_VOCAB, min_size=1, max_size=8), budget=st.integers(0, 12))
    def query(self, context, budget):
        """What the running requests draft (the shared trie alone when none runs)."""
        trie = self.trie
        branches = trie.retrieve(context, budget)
        k = min(budget, trie.decoding_length)
        snap = trie.snapshot(running=True)
        w = trie.prompt_weight
        score = {key: out + w * prompt for key, (out, prompt) in snap.items()}
        matches = [m for m in range(1, min(trie.branch_length, len(context)) + 1)
                   if any(key[:m] == tuple(context[-m:]) and len(key) > m for key in snap)]
        if not branches:
            assert k <= 0 or not matches, f"no draft although suffixes {matches} match"
            return
        assert all(branches), "empty branch"
        if trie.mode == "parallel":
            assert sum(len(b) for b in branches) <= k
        else:
            nodes = {tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
            assert len(nodes) <= k
            paths = [tuple(b) for b in branches]
            assert len(set(paths)) == len(paths), "duplicate branch"
            assert not any(p != q and q[: len(p)] == p for p in paths for q in paths), "a branch is a prefix of another"
        # Some matched suffix explains every branch, and (hierarchical) the selection is a top-k.
        ok = False
        for m in matches:
            suffix = tuple(context[-m:])
            if not all(suffix + tuple(b) in snap for b in branches):
                continue
            if trie.mode == "parallel":
                ok = True
                break
            chosen = {suffix + tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)}
            rest = [score[key] for key in snap if key[:m] == suffix and len(key) > m and key not in chosen]
            if not rest or max(rest) <= min(score[key] for key in chosen):
                ok = True
                break
        assert ok, f"branches {branches} are not a top-{k} subtree of any matched suffix {matches}"

    @invariant()
    def consistent(self):
        if hasattr(self, "trie"):
            check_against_model(self.trie, self.model)


TrieMachine.TestCase.settings = settings(FAST, max_examples=120, stateful_step_count=30)
test_trie_state_machine = TrieMachine.TestCase


# -- unit tests -------------------------------------------------------------------------------------------


def ctx(tokens, prompt_length=None, rid=1):
    tokens = tuple(tokens)
    return Context(tokens, len(tokens) if prompt_length is None else prompt_length, rid)


def test_is_a_draft_source_and_validates_arguments():
    trie = FrequencyTrie()
    assert isinstance(trie, DraftSource)
    assert trie.name == "trie"
    assert (trie.decoding_length, trie.branch_length, trie.capacity, trie.max_nodes) == (64, 12, 16 * 64, 131_072)
    assert FrequencyTrie(decoding_length=10).capacity == 160
    for bad in [dict(decoding_length=0), dict(branch_length=0), dict(capacity=0), dict(mode="flat"),
                dict(prompt_weight=0.5), dict(prune_to=1.5), dict(min_nodes=0), dict(capacity=2.5),
                dict(max_nodes=0), dict(max_nodes=2.5), dict(max_nodes=None), dict(decoding_length=True),
                dict(branch_length=True), dict(capacity=False), dict(min_nodes=True)]:
        with pytest.raises(ValueError):
            FrequencyTrie(**bad)


def test_prompt_windows_are_counted_while_running_and_eliminated_exactly():
    trie = FrequencyTrie(branch_length=2)
    trie.insert([7, 8, 9])  # some output knowledge first
    before = trie.snapshot()
    c = ctx([1, 2, 3, 1, 2, 4])
    trie.begin(c)
    assert trie.counts([1], running=True) == (0, 2) and trie.counts([1, 2], running=True) == (0, 2)
    assert trie.counts([1, 2, 3], running=True) == (0, 1) and trie.counts([1, 2, 4], running=True) == (0, 1)
    assert trie.counts([2, 4], running=True) == (0, 1) and trie.counts([4], running=True) is None  # a window needs a successor
    assert trie.counts([1, 2, 3, 1], running=True) is None  # windows are branch_length + 1 tokens
    assert trie.counts([7, 8], running=True) == (1, 0)  # the request reads the shared counts too
    assert trie.snapshot() == before  # which its prompt never touches
    trie.end(c)  # no output: the trie is back where it was
    assert trie.snapshot() == before
    trie.check_invariants()


def test_output_windows_are_inserted_once_whatever_the_step_sizes():
    prompt = [5, 6, 7, 5]
    output = [6, 7, 8, 5, 6, 7, 9, 9, 5, 6]
    snapshots = []
    for sizes in ([len(output)], [1] * len(output), [3, 1, 4, 2]):
        trie = FrequencyTrie(branch_length=3)
        trie.begin(ctx(prompt))
        tokens = list(prompt)
        at = 0
        for size in sizes:
            tokens += output[at : at + size]
            at += size
            trie.observe(Feedback(committed=output[at - size : at], context=ctx(tokens, len(prompt))))
        trie.end(ctx(tokens, len(prompt)))
        snapshots.append(trie.snapshot())
        assert all(p == 0 for _, p in snapshots[-1].values())
    assert snapshots[0] == snapshots[1] == snapshots[2]
    # The windows that reach into the output, including the prompt's last branch_length tokens.
    model = Model(3)
    model.begin(1, prompt)
    model.commit(1, output)
    model.end(1)
    assert snapshots[0] == {k: (v, 0) for k, v in model.out.items()}
    assert (5, 6, 7, 5) not in snapshots[0]  # lies inside the prompt: gone with the prompt
    assert snapshots[0][(7, 5, 6, 7)] == (1, 0)  # starts in the prompt, ends in the output: kept


def test_output_branches_survive_the_request_and_are_proposed_next_time():
    trie = FrequencyTrie(branch_length=4)
    prompt = [1, 2, 3]
    out = [10, 11, 12, 13, 14, 15]
    trie.begin(ctx(prompt, rid=1))
    trie.observe(Feedback(out, ctx(prompt + out, 3, rid=1)))
    trie.end(ctx(prompt + out, 3, rid=1))
    # A new request with the same prompt end gets the old answer as its first branch.
    # Suffix (2, 3) offers 3 nodes (window 2 3 10 11 12), fewer than min_nodes = branch_length = 4, so
    # the stage for (3,) wins with 4.
    assert trie.retrieve([9, 2, 3], budget=8) == [[10, 11, 12, 13]]
    trie.min_nodes = 1
    assert trie.retrieve([9, 2, 3], budget=8) == [[10, 11, 12]]


def test_prompt_branches_win_over_more_frequent_output_branches():
    trie = FrequencyTrie(branch_length=2, min_nodes=1)
    for _ in range(50):
        trie.insert([1, 2, 3])  # output: 1 -> 2 -> 3, fifty times
    trie.begin(ctx([1, 4, 5], rid=7))  # prompt: 1 -> 4 -> 5, once
    assert trie.retrieve([1], budget=2) == [[4, 5]]
    assert trie.retrieve([1], budget=4) == [[4, 5], [2, 3]]
    assert trie.propose(ctx([1], rid=7), 2).branches == [[4, 5]]
    assert trie.propose(ctx([1], rid=8), 2).branches == [[4, 5]]  # the other running requests read it too
    assert trie.counts([1, 4]) is None  # but the shared trie never holds it
    trie.end(ctx([1, 4, 5], rid=7))
    assert trie.retrieve([1], budget=2) == [[2, 3]]
    weak = FrequencyTrie(branch_length=2, min_nodes=1, prompt_weight=1)  # no amplification
    for _ in range(50):
        weak.insert([1, 2, 3])
    weak.begin(ctx([1, 4, 5], rid=7))
    assert weak.retrieve([1], budget=2) == [[2, 3]]


def test_multi_stage_retrieval_prefers_the_longest_suffix_with_enough_nodes():
    trie = FrequencyTrie(branch_length=4, min_nodes=3)
    trie.insert([1, 2, 3, 20, 21, 22])  # after (1, 2, 3): 20 21
    for _ in range(5):
        trie.insert([3, 30, 31, 32, 33])  # after (3,): 30 31 32 33, more often
    # Suffix (1, 2, 3) offers 20, 21 (2 nodes < 3): the stage falls back to (2, 3) -> 20 21 22 (3 nodes).
    assert trie.retrieve([1, 2, 3], budget=8)[0] == [20, 21, 22]
    # With min_nodes 2 the longest suffix is enough.
    trie.min_nodes = 2
    assert trie.retrieve([1, 2, 3], budget=8) == [[20, 21]]
    # A suffix the trie has never seen followed by anything: the shortest match, most frequent first.
    trie.min_nodes = 3
    assert trie.retrieve([9, 9, 3], budget=8)[0] == [30, 31, 32, 33]
    assert trie.retrieve([9, 9, 99], budget=8) == []
    assert trie.retrieve([1, 2, 3], budget=0) == []


def test_hierarchical_draft_fits_more_branches_than_parallel():
    """Sec. 4.2: merging shared prefixes fits more branches in the same decoding length."""
    words = [[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7]]
    hier = FrequencyTrie(branch_length=3, min_nodes=1)
    par = FrequencyTrie(branch_length=3, min_nodes=1, mode="parallel")
    for trie in (hier, par):
        for i, w in enumerate(words):
            for _ in range(4 - i):
                trie.insert([0] + w)
    h = hier.retrieve([0], budget=6)
    p = par.retrieve([0], budget=6)
    assert h == [[1, 2, 3], [1, 2, 4], [1, 5, 6]]  # 6 distinct nodes, three branches
    assert p == [[1, 2, 3], [1, 2, 4]]  # 6 tokens with the shared prefix repeated: two branches
    assert len({tuple(b[:i]) for b in h for i in range(1, 4)}) == 6


def test_capacity_is_per_first_token_tree_and_keeps_the_frequent_nodes():
    rng = random.Random(0)
    trie = FrequencyTrie(decoding_length=4, branch_length=3)  # capacity 64 nodes per first-token tree
    assert trie.capacity == 64
    for _ in range(200):
        trie.insert([1, 2, 3, 4])  # frequent
        trie.insert([1] + [rng.randrange(5, VOCAB) for _ in range(5)])  # noise, much of it in tree 1
        assert trie.tree_size(1) <= 64
        check_bounds(trie)
    trie.check_invariants()
    assert trie.tree_prunes > 0 and trie.global_prunes == 0
    assert len(trie) > 64  # the other trees hold their own 64 nodes each
    assert trie.retrieve([1], budget=3) == [[2, 3, 4]]
    # A prompt whose own tree passes the capacity: that tree's running nodes are pruned (the
    # invariants check both parts of every tree), and ending it leaves no prompt count.
    prompt = [rng.choice([7, rng.randrange(VOCAB)]) for _ in range(200)]
    trie.begin(ctx(prompt, rid=3))
    assert trie.running_prunes > 0
    trie.check_invariants()
    trie.end(ctx(prompt, rid=3))
    trie.check_invariants()
    assert all(p == 0 for _, p in trie.snapshot().values())


def test_a_big_prompt_does_not_wipe_what_other_trees_learned():
    """The regression behind per-tree capacity: with one capacity for the whole trie, a raw prompt's
    branches (a 200-token prompt makes ~800 nodes here) pushed out every output branch learned before."""
    rng = random.Random(1)
    trie = FrequencyTrie(decoding_length=4, branch_length=3)  # capacity 64 per tree
    for _ in range(3):
        trie.insert([1, 2, 3, 4, 5])
    learned = {k: v for k, v in trie.snapshot().items() if k[0] in (1, 2)}
    prompt = [rng.randrange(10, VOCAB) for _ in range(200)]
    trie.begin(ctx(prompt, rid=1))
    assert len(trie.snapshot(running=True)) > 16 * trie.decoding_length
    assert {k: v for k, v in trie.snapshot(running=True).items() if k[0] in (1, 2)} == learned
    assert trie.retrieve([9, 1], budget=4) == [[2, 3, 4]]
    trie.end(ctx(prompt, rid=1))
    assert {k: v for k, v in trie.snapshot().items() if k[0] in (1, 2)} == learned
    trie.check_invariants()


def test_max_nodes_bounds_the_whole_trie_least_frequent_first():
    rng = random.Random(2)
    trie = FrequencyTrie(decoding_length=4, branch_length=3, max_nodes=100)  # capacity 64 per tree
    for i in range(300):
        trie.insert([1, 2, 3, 4])  # frequent
        trie.insert([rng.randrange(5, VOCAB) for _ in range(6)])  # noise over many trees
        assert len(trie) <= 100
        if i % 50 == 0:
            trie.check_invariants()
    assert trie.global_prunes > 0
    assert trie.retrieve([1], budget=3) == [[2, 3, 4]]
    # What the running requests taught is bounded the same way (the invariants check it).
    prompt = [rng.randrange(VOCAB) for _ in range(100)]
    trie.begin(ctx(prompt, rid=3))
    assert len(trie) <= 100 and len(trie.snapshot(running=True)) <= 200 and trie.running_prunes > 0
    trie.check_invariants()
    trie.end(ctx(prompt, rid=3))
    trie.check_invariants()
    assert all(p == 0 for _, p in trie.snapshot().values())
    # Explicit prunes: a whole-trie target, one tree's target, the automatic watermarks.
    trie.insert(list(range(5, 40)))
    n = len(trie)
    assert trie.prune(n - 5) == 5 and len(trie) == n - 5
    sizes = trie.tree_sizes()
    first = max(sizes, key=sizes.get)
    assert trie.prune(1, first_token=first) == sizes[first] - 1 and trie.tree_size(first) == 1
    assert trie.tree_sizes() == {**sizes, first: 1}
    assert trie.prune(0, first_token=999) == 0
    trie.prune()
    assert len(trie) <= 90 and all(size <= int(64 * 0.9) for size in trie.tree_sizes().values())
    trie.check_invariants()


def test_pruning_the_shared_trie_never_touches_a_running_requests_prompt():
    """A request's prompt lives in the running part: pruning the shared trie away to nothing, or other
    requests with the same prompt ending, leaves its prompt counts whole, and nothing of it behind."""
    trie = FrequencyTrie(branch_length=1, prompt_weight=1)
    trie.begin(ctx([1, 2], rid=1))  # A: (1,) and (1, 2), prompt count 1 each
    for _ in range(5):
        trie.insert([3, 4])
    trie.prune(0)
    assert len(trie) == 0 and trie.counts([1], running=True) == (0, 1) and trie.counts([1, 2], running=True) == (0, 1)
    trie.begin(ctx([1, 2], rid=2))  # B, the same prompt
    trie.end(ctx([1, 2], rid=2))
    assert trie.counts([1]) is None and trie.counts([1], running=True) == (0, 1)
    trie.end(ctx([1, 2], rid=1))
    assert trie.counts([1]) is None and trie.active_requests == 0
    trie.check_invariants()


def test_ablation_switches():
    prompt, out = [1, 2, 3, 4], [5, 6, 7]
    for kw, expect_prompt, expect_out in [(dict(insert_prompt=False), False, True),
                                          (dict(insert_output=False), True, False)]:
        trie = FrequencyTrie(branch_length=2, **kw)
        trie.begin(ctx(prompt))
        assert (trie.counts([1, 2], running=True) is not None) == expect_prompt
        trie.observe(Feedback(out, ctx(prompt + out, 4)))
        trie.end(ctx(prompt + out, 4))
        assert (trie.counts([5, 6]) is not None) == expect_out
    keep = FrequencyTrie(branch_length=2, eliminate=False)
    keep.begin(ctx(prompt))
    keep.end(ctx(prompt))
    assert keep.counts([1, 2]) == (0, 1)  # "W/o eliminating": the prompt's branches stay


def test_reused_request_id_and_unknown_requests():
    trie = FrequencyTrie(branch_length=2)
    trie.end(ctx([1, 2, 3], rid=5))  # never begun: ignored
    trie.begin(ctx([1, 2, 3], rid=5))
    trie.begin(ctx([4, 5, 6], rid=5))  # same id again: the first one's counts are taken back
    assert trie.counts([1, 2], running=True) is None and trie.counts([4, 5], running=True) == (0, 1)
    trie.observe(Feedback([9, 9], ctx([7, 8, 9, 9], 2, rid=6)))  # observe without begin
    trie.end(ctx([7, 8, 9, 9], 2, rid=6))
    trie.end(ctx([4, 5, 6], rid=5))
    trie.check_invariants()
    assert trie.active_requests == 0
    assert trie.counts([8, 9, 9]) == (1, 0) and trie.counts([7, 8, 9]) == (1, 0)  # no prompt part


# -- threads ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity, max_nodes", [(10**9, 10**9), (40, 10**9), (10**9, 150)])
def test_concurrent_requests_from_threads(capacity, max_nodes):
    """Several threads run requests (begin / propose / observe / end) and one inserts, all on one trie.
    Counts commute, so without pruning the result must equal the model whatever the interleaving."""
    trie = FrequencyTrie(decoding_length=8, branch_length=3, capacity=capacity, max_nodes=max_nodes)
    model = Model(3)
    model_lock = threading.Lock()
    errors = []
    barrier = threading.Barrier(5)

    def requester(seed):
        rng = random.Random(seed)
        try:
            barrier.wait()
            for r in range(25):
                rid = seed * 1000 + r
                prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 15))]
                tokens = list(prompt)
                trie.begin(Context(tuple(tokens), len(prompt), rid))
                for _ in range(rng.randrange(0, 6)):
                    trie.propose(Context(tuple(tokens), len(prompt), rid), 8)
                    step = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
                    tokens += step
                    trie.observe(Feedback(step, Context(tuple(tokens), len(prompt), rid)))
                trie.end(Context(tuple(tokens), len(prompt), rid))
                with model_lock:
                    model.begin(rid, prompt)
                    model.commit(rid, tokens[len(prompt):])
                    model.end(rid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def inserter():
        rng = random.Random(99)
        try:
            barrier.wait()
            for _ in range(60):
                seq = [rng.randrange(6) for _ in range(rng.randrange(2, 8))]
                trie.insert(seq)
                trie.retrieve(seq[:2], 5)
                with model_lock:
                    model.insert(seq)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=requester, args=(s,)) for s in range(1, 5)] + [threading.Thread(target=inserter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert trie.active_requests == 0
    check_against_model(trie, model)
    if capacity < 10**9:
        assert trie.tree_prunes > 0
    if max_nodes < 10**9:
        assert trie.global_prunes > 0


# -- with the decoder: greedy identity ------------------------------------------------------------------------

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9, 14, 3, 9, 22, 3, 9, 14, 3, 9],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [40, 41, 40, 41, 40, 41, 42, 43, 44],
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi", "gpt2", "gemma3"])
def test_greedy_identity_alone_and_mixed(arch):
    model = tiny_model(arch)
    trie = FrequencyTrie(decoding_length=16, branch_length=6)
    for i, prompt in enumerate(PROMPTS[:2] + PROMPTS[:1]):  # the last one again, on a warm trie
        n = 16
        ref = reference_greedy(model, prompt, n)
        sources = [trie] if i % 2 == 0 else [PromptLookup(), trie]
        out = Decoder(model, sources=sources, max_tree_nodes=12).generate(prompt, max_new_tokens=n)
        assert out.token_ids == ref, (arch, i)
    trie.check_invariants()
    assert trie.active_requests == 0
    assert all(p == 0 for _, p in trie.snapshot().values())


@settings(FAST, max_examples=8)
@given(prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20), n=st.integers(0, 24),
       max_tree_nodes=st.integers(0, 20), mode=st.sampled_from(["hierarchical", "parallel"]),
       capacity=st.sampled_from([8, 64, 100_000]), max_nodes=st.sampled_from([16, 131_072]), mixed=st.booleans())
def test_greedy_identity_property(prompt, n, max_tree_nodes, mode, capacity, max_nodes, mixed):
    model = tiny_model("qwen2")
    trie = FrequencyTrie(decoding_length=16, branch_length=4, capacity=capacity, mode=mode, max_nodes=max_nodes)
    trie.insert(prompt + prompt)  # a warm trie with something relevant
    sources = [PromptLookup(), trie] if mixed else [trie]
    out = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes).generate(prompt, max_new_tokens=n)
    assert out.token_ids == reference_greedy(model, prompt, n)
    trie.check_invariants()


def test_warm_trie_shared_by_two_decoders_accelerates_and_stays_exact():
    """One trie across requests and two Decoder instances: the second time a prompt comes, the trie
    knows the answer (its output branches), so steps drop, and the output is still exact."""
    model = tiny_model("llama")
    # Default capacity: 16 x decoding_length = 256 nodes per first-token tree. (Read as one capacity
    # for the whole trie, it made the three answers, about 24 windows of 9 nodes each, push each
    # other out.)
    trie = FrequencyTrie(decoding_length=16, branch_length=8)
    first = Decoder(model, sources=[trie], max_tree_nodes=16, adaptive_budget=False)
    second = Decoder(model, sources=[trie], max_tree_nodes=16, adaptive_budget=False)
    with generation_config_override(model, eos_token_id=None):
        results = []
        for prompt in PROMPTS[:3]:
            ref = reference_greedy(model, prompt, 24)
            cold = first.generate(prompt, max_new_tokens=24)
            warm = second.generate(prompt, max_new_tokens=24)
            assert cold.token_ids == ref and warm.token_ids == ref
            results.append((cold.stats, warm.stats))
        assert sum(w.steps for _, w in results) < 0.6 * sum(c.steps for c, _ in results)
        assert all(w.per_source["trie"].accepted > 0 for _, w in results)
    trie.check_invariants()
    assert trie.active_requests == 0


def test_decoders_in_threads_share_one_trie():
    model = tiny_model("qwen2")
    trie = FrequencyTrie(decoding_length=16, branch_length=6, capacity=200)
    refs = {i: reference_greedy(model, p, 16) for i, p in enumerate(PROMPTS[:3])}
    outs, errors = {}, []

    def run(i):
        try:
            dec = Decoder(model, sources=[trie, PromptLookup()], max_tree_nodes=10)
            for _ in range(2):
                outs.setdefault(i, []).append(dec.generate(PROMPTS[i], max_new_tokens=16).token_ids)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, runs in outs.items():
        assert runs == [refs[i], refs[i]]
    trie.check_invariants()
    assert trie.active_requests == 0


def test_cli_registry_builds_the_trie():
    from specdraft.cli import make_sources, parse_source_names

    (source,) = make_sources(parse_source_names("trie"))
    assert isinstance(source, FrequencyTrie)


def _select_by_heap(store, start: int, k: int):
    """The selection as a plain best-first search: every child pushed, the best popped."""
    import heapq

    w = store.prompt_weight
    key = lambda c: (-(store.out[c] + w * store.prompt[c]), -store.stamp[c], c)  # noqa: E731
    heap = [key(c) + (-1,) for c in store.children[start].values()]
    heapq.heapify(heap)
    selected = []
    while heap and len(selected) < k:
        f, _, c, parent = heapq.heappop(heap)
        selected.append((store.token[c], -f, store.depth[c], parent))
        for d in (store.children[c] or {}).values():
            heapq.heappush(heap, key(d) + (len(selected) - 1,))
    return selected


@pytest.mark.parametrize("seed", range(200))
def test_selection_takes_an_only_child_at_once_as_the_plain_search_would(seed) -> None:
    # select takes a node's only child without the heap when it beats the frontier: the selection
    # must be the plain best-first one, ties (equal counts and stamps) included
    from types import SimpleNamespace

    from specdraft.sources.trie_select import select

    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    store = SimpleNamespace(prompt_weight=rng.choice([0.0, 0.5, 2.0]), out=[], prompt=[], stamp=[], token=[],
                            depth=[], children=[])
    for i in range(n):
        store.out.append(rng.choice([0, 1, 2, rng.randrange(10)]))
        store.prompt.append(rng.choice([0, 1]))
        store.stamp.append(rng.choice([0, 1, rng.randrange(50)]))
        store.token.append(rng.randrange(20))
        store.depth.append(0)
        store.children.append(None)
        if i:
            parent = rng.randrange(max(0, i - 3), i) if rng.random() < 0.8 else rng.randrange(i)
            store.children[parent] = store.children[parent] or {}
            store.children[parent][rng.randrange(10**6)] = i
            store.depth[i] = store.depth[parent] + 1
    store.children[0] = store.children[0] or {}
    for k in (1, 2, 8, 32, 100):
        assert select(store, 0, k) == _select_by_heap(store, 0, k)
