"""SuffixDecoding (specdraft.sources.suffix_tree): counts, matching, scoring, budget, eviction.

The trie's counts are checked against a brute-force recount of every substring (up to
``max_depth``) of the live sequences, its matches against a brute-force longest-suffix search and
its drafts against a brute-force best-first expansion over those recounted counts, by unit tests
and by a hypothesis state machine that drives the source as a decoder would (requests begin, grow,
end, and push old responses out of the global cache).
"""

from __future__ import annotations

import heapq
import math
import pickle
import threading
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specdraft.sources import Context, Feedback
from specdraft.sources.registry import SOURCES, make_sources
from specdraft.sources.suffix_tree import SuffixTree, SuffixTrie
from specdraft.tree import TokenTree

from _suffix_checks import (check_source, check_trie, count, global_counts, running_sequences, trie_counts,
                            walk)
from conftest import FAST

def longest_match(trie: SuffixTrie, context) -> int:
    """The length of the longest suffix of ``context`` (at most ``max_depth`` tokens) that occurs in
    the trie's sequences."""
    ctx = [int(t) for t in context[-trie.max_depth :]]
    return next((m - 1 for m in range(1, len(ctx) + 1) if trie._locate(ctx, len(ctx) - m) is None), len(ctx))


def num_nodes(trie: SuffixTrie) -> tuple[int, int]:
    """(explicit nodes, leaves) in the trie."""
    refs = [ref for _, ref, _ in walk(trie)]
    return sum(ref > 0 for ref in refs), sum(ref < 0 for ref in refs)


# -- brute force -----------------------------------------------------------------------------------


def brute_counts(seqs, depth: int) -> dict[tuple[int, ...], int]:
    """C(s) for every substring s of at most ``depth`` tokens of the sequences."""
    counts: Counter = Counter()
    for seq in seqs:
        for i in range(len(seq)):
            for length in range(1, min(depth, len(seq) - i) + 1):
                counts[tuple(seq[i : i + length])] += 1
    return dict(counts)


def brute_longest(counts, context, depth: int) -> int:
    best = 0
    for m in range(1, min(depth, len(context)) + 1):
        if tuple(context[-m:]) not in counts:
            break
        best = m
    return best


def brute_speculate(counts, context, depth, cap, factor=1.0, offset=0.0, min_prob=0.1):
    """(score, match length, sorted probs) of the best draft, from the recounted counts alone."""
    ctx = list(context[-(depth - 1) :])
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for key in counts:
        children.setdefault(key[:-1], []).append(key)
    best = (0.0, 0, [])
    for m in range(1, len(ctx) + 1):
        start = tuple(ctx[-m:])
        if start not in counts:
            break
        limit = min(cap, int(m * factor + offset + 1e-6))
        heap = [(-counts[c] / counts[start], c) for c in children.get(start, []) if counts[c] / counts[start] >= min_prob]
        heapq.heapify(heap)
        probs = []
        while heap and len(probs) < limit:
            neg, key = heapq.heappop(heap)
            probs.append(-neg)
            for c in children.get(key, []):
                p = -neg * counts[c] / counts[key]
                if p >= min_prob:
                    heapq.heappush(heap, (-p, c))
        score = math.fsum(probs)
        if score >= best[0] and limit > 0:  # ties go to the longer match
            best = (score, m, sorted(probs))
    return best


def check_draft(draft, expected) -> None:
    score, match_length, probs = expected
    assert math.isclose(draft.score, score, rel_tol=1e-9, abs_tol=1e-12)
    if score > 0:
        assert draft.match_length == match_length
        assert sorted(draft.probs) == pytest.approx(probs)
    for i, (p, parent) in enumerate(zip(draft.probs, draft.parents)):
        assert parent < i and (parent < 0 or draft.probs[parent] >= p)  # parents first, D shrinks
    assert draft.probs == sorted(draft.probs, reverse=True)  # chosen best first


def ctx(tokens, prompt_length, rid):
    return Context(tuple(tokens), prompt_length, rid)


# -- the trie ----------------------------------------------------------------------------------------


def test_counts_are_substring_occurrences() -> None:
    trie = SuffixTrie(3)
    trie.add(0, [1, 2, 1, 2, 3])
    trie.add(1, [2, 3])
    assert trie_counts(trie) == brute_counts([[1, 2, 1, 2, 3], [2, 3]], 3)
    assert count(trie, [1, 2]) == 2 and count(trie, [2, 3]) == 2 and count(trie, [1, 2, 3]) == 1
    assert count(trie, [1, 2, 1, 2]) == 0  # longer than max_depth
    trie.extend(1, [1, 2])
    assert trie_counts(trie) == brute_counts([[1, 2, 1, 2, 3], [2, 3, 1, 2]], 3)
    trie.remove(0)
    assert trie_counts(trie) == brute_counts([[2, 3, 1, 2]], 3)
    check_trie(trie)


def test_single_occurrence_tails_are_leaves() -> None:
    """Memory: a string seen once costs no node of its own."""
    trie = SuffixTrie(24)
    trie.add(0, list(range(100)))
    assert num_nodes(trie) == (0, 100)
    trie.add(1, list(range(10)))  # repeats the first ten tokens: their substrings become nodes
    assert trie_counts(trie) == brute_counts([list(range(100)), list(range(10))], 24)
    check_trie(trie)


def test_longest_match() -> None:
    trie = SuffixTrie(4)
    trie.add(0, [5, 6, 7, 8, 9])
    assert longest_match(trie, [1, 6, 7]) == 2
    assert longest_match(trie, [5, 6, 7, 8]) == 4
    assert longest_match(trie, [4, 5, 6, 7, 8]) == 4  # capped at max_depth
    assert longest_match(trie, [9, 9]) == 1
    assert longest_match(trie, [3]) == 0
    assert longest_match(trie, []) == 0


def test_scoring_is_the_product_of_count_ratios() -> None:
    """Sec. 3: D(child) = D(parent) * C(child) / C(parent), best first, none below τ."""
    trie = SuffixTrie(8)
    for i, tail in enumerate([[3, 4], [3, 4], [3, 5], [6, 7]]):
        trie.add(i, [1, 2] + tail)
    draft = trie.speculate([9, 1, 2], max_spec_tokens=8, max_spec_factor=4.0, min_token_prob=0.1)
    assert draft.match_length == 2
    assert draft.tokens == [3, 4, 6, 5, 7]  # ties: the candidate found first (6, a root child) first
    assert draft.parents == [-1, 0, -1, 0, 2]
    assert draft.probs == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25])
    assert draft.score == pytest.approx(2.0)
    assert draft.branches() == [[3], [3, 4], [6], [3, 5], [6, 7]]
    strict = trie.speculate([9, 1, 2], max_spec_tokens=8, max_spec_factor=4.0, min_token_prob=0.3)
    assert strict.tokens == [3, 4] and strict.probs == pytest.approx([0.75, 0.5])
    path = trie.speculate([9, 1, 2], max_spec_tokens=8, max_spec_factor=4.0, tree=False)
    assert path.tokens == [3, 4] and path.parents == [-1, 0]


def test_draft_length_grows_with_the_match() -> None:
    """MAX_SPEC = α·p: a one-token match may propose one token, a three-token match three."""
    trie = SuffixTrie(24)
    trie.add(0, list(range(20)))
    assert trie.speculate([0], 24).tokens == [1]
    assert trie.speculate([0, 1, 2], 24).tokens == [3, 4, 5]
    assert trie.speculate([0, 1, 2], 24, max_spec_factor=2.0).tokens == [3, 4, 5, 6, 7, 8]
    assert trie.speculate([0, 1, 2], 24, max_spec_offset=1.0).tokens == [3, 4, 5, 6]
    assert trie.speculate(list(range(10)), 4).tokens == [10, 11, 12, 13]  # max_spec_tokens caps it


def test_depth_limits_match_plus_draft() -> None:
    """A match of p tokens leaves max_depth - p to draft, so a shorter match may win."""
    trie = SuffixTrie(6)
    trie.add(0, list(range(20)))
    draft = trie.speculate(list(range(5)), 24)
    assert draft.match_length == 3 and draft.tokens == [5, 6, 7]  # p=3: room for 3, score 3
    check_draft(draft, brute_speculate(trie_counts(trie), list(range(5)), 6, 24))


def test_speculate_matches_brute_force_on_random_sequences() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        depth = rng.randint(2, 7)
        trie = SuffixTrie(depth)
        seqs = [[rng.randrange(3) for _ in range(rng.randint(0, 15))] for _ in range(rng.randint(1, 4))]
        for i, s in enumerate(seqs):
            trie.add(i, s)
        context = [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        cap = rng.randint(1, 10)
        factor = rng.choice([0.5, 1.0, 2.0])
        draft = trie.speculate(context, cap, max_spec_factor=factor)
        check_draft(draft, brute_speculate(brute_counts(seqs, depth), context, depth, cap, factor=factor))


def test_closed_sequence_cannot_grow() -> None:
    trie = SuffixTrie(3)
    trie.add(0, [1])
    trie.close(0)
    with pytest.raises(ValueError, match="closed"):
        trie.extend(0, [2])
    with pytest.raises(ValueError, match="already"):
        trie.add(0, [])
    with pytest.raises(KeyError):
        trie.extend(5, [1])


# -- the source ----------------------------------------------------------------------------------------


def run_request(src: SuffixTree, rid: int, prompt, output, budget: int = 16):
    """Drive one request as the decoder does (first output token from the prefill, unobserved)."""
    src.begin(ctx(prompt, len(prompt), rid))
    tokens = list(prompt) + list(output[:1])
    drafts = []
    for token in output[1:]:
        drafts.append(src.propose(ctx(tokens, len(prompt), rid), budget))
        tokens.append(token)
        src.observe(Feedback([token], ctx(tokens, len(prompt), rid)))
    src.end(ctx(tokens, len(prompt), rid))
    return drafts


def test_registered_and_built_by_name() -> None:
    assert "suffix" in SOURCES
    (src,) = make_sources(["suffix"])
    assert isinstance(src, SuffixTree) and src.name == "suffix"


def test_global_tree_carries_responses_across_requests() -> None:
    src = SuffixTree(max_cached_requests=4)
    answer = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
    run_request(src, 1, [1, 2, 3], answer)
    assert src.cached_sequences() == [answer]
    drafts = run_request(src, 2, [7, 8, 9], answer)  # another prompt, the same answer
    assert drafts[2].branches[:3] == [[43], [43, 44], [43, 44, 45]]  # after 40 41 42: three tokens
    assert src.active_requests == 0


def test_per_request_tree_reads_the_prompt() -> None:
    src = SuffixTree(max_cached_requests=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    src.begin(ctx(prompt, len(prompt), 1))
    draft = src.propose(ctx(prompt + [1, 2, 3], len(prompt), 1), 16)
    assert draft.branches[0] == [4]
    assert [b[-1] for b in draft.branches] == [4, 5, 6]
    assert src.cached_requests == 0


def test_budget_keeps_the_most_likely_nodes() -> None:
    src = SuffixTree(max_cached_requests=8, min_token_prob=0.0)
    for rid, tail in enumerate([[3, 4, 5], [3, 4, 5], [3, 4, 6], [3, 7, 8], [9, 9, 9]]):
        run_request(src, rid, [50 + rid], [1, 2] + tail)
    src.begin(ctx([60], 1, 99))
    context = ctx([60, 1, 2], 1, 99)
    full = src.propose(context, 64)
    for budget in range(0, len(full.branches) + 2):
        draft = src.propose(context, budget)
        assert len(draft.branches) <= budget
        assert draft.branches == full.branches[: len(draft.branches)]
        # one path per node, each adding exactly one new node, parents first
        tree = TokenTree.from_drafts(2, [draft.branches], max_nodes=budget)
        assert tree.num_draft_nodes == len(draft.branches)
    # the decoder's cut keeps the first N created nodes: the N most likely
    tree = TokenTree.from_drafts(2, [full.branches], max_nodes=2)
    assert tree.branches() == [[3, 4]]
    assert src.propose(context, 0).branches == []


def test_eviction_takes_back_exactly_the_oldest_response() -> None:
    src = SuffixTree(max_depth=5, max_cached_requests=2)
    outputs = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 1, 2, 3]]
    for rid, out in enumerate(outputs):
        run_request(src, rid, [9, 9], out)
        kept = outputs[max(0, rid - 1) : rid + 1]
        assert src.cached_sequences() == kept
        assert global_counts(src) == brute_counts(kept, 5)
        check_source(src)


def test_a_response_joins_the_cache_when_its_request_ends() -> None:
    src = SuffixTree(max_depth=4, max_cached_requests=1)
    src.begin(ctx([1, 2], 2, 1))
    src.observe(Feedback([3], ctx([1, 2, 3], 2, 1)))
    src.begin(ctx([5], 1, 2))
    src.observe(Feedback([4], ctx([1, 2, 3, 4], 2, 1)))
    assert src.cached_sequences() == []  # nothing has ended yet
    assert running_sequences(src) == [[3, 4], []]  # but the running responses are read already
    assert trie_counts(src.request_state(ctx([1, 2, 3, 4], 2, 1)).local) == brute_counts([[1, 2, 3, 4]], 4)
    src.end(ctx([1, 2, 3, 4], 2, 1))
    assert src.cached_sequences() == [[3, 4]]
    src.end(ctx([5, 6], 1, 2))  # pushes request 1's response out (a cache of one)
    assert src.cached_sequences() == [[6]]
    check_source(src)


def test_shared_between_threads() -> None:
    src = SuffixTree(max_depth=6, max_cached_requests=64)
    outputs = {rid: [(rid * 7 + i) % 11 for i in range(30)] for rid in range(16)}

    def worker(rids):
        for rid in rids:
            run_request(src, rid, [rid % 3, 1, 2], outputs[rid])

    threads = [threading.Thread(target=worker, args=(range(k, 16, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_source(src)
    assert sorted(map(tuple, src.cached_sequences())) == sorted(tuple(o) for o in outputs.values())
    assert global_counts(src) == brute_counts(outputs.values(), 6)


def test_pickles() -> None:
    src = SuffixTree(max_depth=4)
    run_request(src, 1, [1, 2], [3, 4, 5])
    copy = pickle.loads(pickle.dumps(src))
    assert global_counts(copy) == global_counts(src)
    run_request(copy, 2, [1, 2], [3, 4, 5])


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_depth=1), "max_depth"), (dict(max_depth=2.5), "max_depth"), (dict(max_spec_factor=0), "max_spec_factor"),
    (dict(max_spec_factor=float("nan")), "max_spec_factor"), (dict(min_token_prob=1.5), "min_token_prob"),
    (dict(max_spec_tokens=0), "max_spec_tokens"), (dict(max_cached_requests=-1), "max_cached_requests"),
    (dict(max_spec_offset=float("inf")), "max_spec_offset"), (dict(tree="yes"), "tree"),
])
def test_bad_settings_are_named(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SuffixTree(**kwargs)


# -- the state machine ---------------------------------------------------------------------------------

TOKENS = st.integers(0, 3)  # a tiny alphabet, so strings repeat and nodes split and merge


class SuffixMachine(RuleBasedStateMachine):
    """Requests begin, grow, end (their response joining the cache, maybe evicting the oldest) or
    fail (leaving nothing); after every step the trees hold exactly the recounted suffixes of the
    live sequences (the global tree: the cached responses and the running ones so far), and
    matches and drafts agree with brute force."""

    @initialize(depth=st.integers(2, 6), cap=st.integers(0, 3))
    def setup(self, depth, cap) -> None:
        self.depth, self.cap = depth, cap
        self.src = SuffixTree(max_depth=depth, max_cached_requests=cap, min_token_prob=0.1)
        self.next_rid = 0
        self.running: dict[int, list] = {}  # rid -> [prompt_length, tokens]
        self.cache: list[list] = []  # [rid, output] oldest first (the model of the global tree)

    @rule(prompt=st.lists(TOKENS, max_size=8))
    def begin(self, prompt) -> None:
        rid = self.next_rid
        self.next_rid += 1
        self.src.begin(ctx(prompt, len(prompt), rid))
        self.running[rid] = [len(prompt), list(prompt)]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new=st.lists(TOKENS, min_size=1, max_size=4))
    def extend(self, data, new) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        prompt_length, tokens = self.running[rid]
        tokens += new
        self.src.observe(Feedback(list(new), ctx(tokens, prompt_length, rid)))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), fail=st.booleans())
    def end(self, data, fail) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        prompt_length, tokens = self.running.pop(rid)
        if fail:
            self.src.abort(ctx(tokens, prompt_length, rid))
            return
        self.src.end(ctx(tokens, prompt_length, rid))
        if self.cap:
            self.cache.append([rid, tokens[prompt_length:]])
            del self.cache[: max(0, len(self.cache) - self.cap)]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), budget=st.integers(0, 12))
    def propose(self, data, budget) -> None:
        """The source's draft is the better of its two trees' brute-force drafts."""
        rid = data.draw(st.sampled_from(sorted(self.running)))
        prompt_length, tokens = self.running[rid]
        if not tokens:
            return
        draft = self.src.propose(ctx(tokens, prompt_length, rid), budget)
        assert len(draft.branches) <= budget
        cap = min(budget, self.depth)
        local = brute_speculate(brute_counts([tokens], self.depth), tokens, self.depth, cap)
        best = local
        if self.cap:
            other = brute_speculate(brute_counts(self.global_sequences(), self.depth), tokens, self.depth, cap)
            if other[0] > local[0]:
                best = other
        assert len(draft.branches) == len(best[2])

    def global_sequences(self) -> list[list]:
        """What the global tree holds: the cached responses and the running requests' so far."""
        if not self.cap:
            return []
        return [o for _, o in self.cache] + [tokens[p:] for p, tokens in self.running.values()]

    @rule(context=st.lists(TOKENS, max_size=8))
    def match(self, context) -> None:
        cached = brute_counts(self.global_sequences(), self.depth)
        assert longest_match(self.src._global, context) == brute_longest(cached, context, self.depth)
        draft = self.src._global.speculate(context, self.depth)
        check_draft(draft, brute_speculate(cached, context, self.depth, self.depth))

    @invariant()
    def trees_hold_exactly_the_live_suffixes(self) -> None:
        if not hasattr(self, "src"):
            return
        check_source(self.src)
        assert self.src.cached_requests == len(self.cache) <= self.cap
        assert self.src.cached_sequences() == [o for _, o in self.cache]
        assert global_counts(self.src) == brute_counts(self.global_sequences(), self.depth)
        running = [t[p:] for _, (p, t) in sorted(self.running.items())] if self.cap else []
        assert running_sequences(self.src) == running
        for rid, (prompt_length, tokens) in self.running.items():
            local = self.src.request_state(ctx(tokens, prompt_length, rid)).local
            check_trie(local)
            assert trie_counts(local) == brute_counts([tokens], self.depth)
        assert self.src.active_requests == len(self.running)


SuffixMachine.TestCase.settings = settings(FAST, max_examples=60, stateful_step_count=25)
test_suffix_machine = SuffixMachine.TestCase


# -- the workload it is meant for: the BFCL function-calling prompts -------------------------------------


def _bfcl_files(root, n: int = 2) -> None:
    import json

    data = root / "data"
    data.mkdir(parents=True)
    from specdraft.bench.datasets import BFCL_CATEGORIES

    for category in BFCL_CATEGORIES:
        with open(data / f"BFCL_v4_{category}.json", "w") as fh:
            for i in range(n):
                fn = {"name": f"f{i}", "description": "d", "parameters": {"type": "dict", "properties": {}}}
                fh.write(json.dumps({"id": f"{category}_{i}", "question": [[{"role": "user", "content": f"q{i}"}]],
                                     "function": [fn]}) + "\n")


def test_bfcl_reader_on_files_shaped_like_the_package(tmp_path, monkeypatch) -> None:
    from specdraft.bench import datasets as ds

    _bfcl_files(tmp_path / "bfcl_eval")
    monkeypatch.setattr(ds, "_package_dir", lambda package: tmp_path / package if package == "bfcl_eval" else None)
    spec = ds.resolve_dataset("bfcl")
    raws = ds.read_prompts(spec)
    assert [r.id for r in raws[:3]] == ["simple_python_0", "simple_python_1", "multiple_0"]
    assert [r.category for r in raws][::2] == list(ds.BFCL_CATEGORIES)
    assert '"name": "f0"' in raws[0].text and "Request: q0" in raws[0].text and "JSON list" in raws[0].text
    (tmp_path / "bfcl_eval" / "data" / "BFCL_v4_parallel.json").unlink()
    with pytest.raises(ds.DatasetError, match="BFCL_v4_parallel.json"):
        ds.read_prompts(spec)


def test_bfcl_dataset_loads_from_the_installed_package() -> None:
    from specdraft.bench import datasets as ds

    if ds._package_dir("bfcl_eval") is None:
        pytest.skip(f"the 'bfcl' prompts come from the bfcl-eval package, not installed: {ds.BUILTIN['bfcl'].install}")

    class WordTokenizer:  # load_prompts only needs __call__ and chat_template
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [hash(w) % 1000 for w in text.split()]}

    records = ds.load_prompts("bfcl", None, WordTokenizer())
    assert len(records) == 1000
    assert [sum(r.category == c for r in records) for c in ds.BFCL_CATEGORIES] == [400, 200, 200, 200]
    assert records[0].id == "simple_python_0" and "calculate_triangle_area" in records[0].text


def test_same_drafts_as_arctic_inference_when_it_is_installed() -> None:
    """The official implementation as a peer: the same best score and match length on random
    sequences (it is optional: see docs/sources/suffix-tree.md for building it)."""
    arctic = pytest.importorskip("arctic_inference.suffix_decoding",
                                 reason="arctic_inference is not installed (a benchmark-only peer; "
                                        "docs/sources/suffix-tree.md says how to build it)")
    import random

    import numpy as np

    rng = random.Random(3)
    for trial in range(100):
        depth = rng.randint(3, 8)
        ours = SuffixTrie(depth)
        theirs = arctic.SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=-1)
        for i in range(rng.randint(1, 4)):
            seq = [rng.randrange(4) for _ in range(rng.randint(1, 20))]
            ours.add(i, seq)
            theirs.start_request(i, np.zeros(0, dtype=np.int32))
            theirs.add_active_response(i, np.asarray(seq, dtype=np.int32))
            theirs.stop_request(i)
        theirs.start_request("q", np.zeros(0, dtype=np.int32))
        context = [rng.randrange(4) for _ in range(depth)]
        mine = ours.speculate(context, depth, min_token_prob=0.13)  # away from float32 ties at τ
        other = theirs.speculate("q", np.asarray(context, dtype=np.int32), max_spec_tokens=depth,
                                 min_token_prob=0.13, use_tree_spec=True)
        assert mine.score == pytest.approx(other.score, rel=1e-5), trial
        assert sorted(mine.probs) == pytest.approx(sorted(other.probs), rel=1e-5), trial


@pytest.mark.parametrize("seed", range(40))
def test_speculate_from_a_sequences_open_states_equals_locating_from_the_root(seed) -> None:
    # SuffixTree drafts with ``seq_id`` (the context's suffixes read from where its own sequence
    # ends); the draft must be the one that locating every suffix from the root gives, with other
    # sequences growing, closing and being removed around it
    import random

    from specdraft.sources.suffix_trie import SuffixTrie

    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 6])
    trie = SuffixTrie(rng.choice([2, 4, 8, 24]))
    seqs: dict[int, list[int]] = {}
    for step in range(300):
        action = rng.random()
        if action < 0.1 or not seqs:
            seqs[step] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
            trie.add(step, seqs[step])
        elif action < 0.15 and len(seqs) > 1:
            gone = rng.choice(list(seqs))
            (trie.remove if rng.random() < 0.5 else trie.close)(gone)
            del seqs[gone]
        else:
            sid = rng.choice(list(seqs))
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 3))]
            seqs[sid] += new
            trie.extend(sid, new)
            prefix = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
            context = prefix + seqs[sid]
            for args in ((8, 1.0, 0.0, 0.1, True), (3, 2.0, 1.0, 0.0, False), (24, 1.0, 0.0, 0.0, True)):
                a = trie.speculate(context, *args)
                b = trie.speculate(context, *args, seq_id=sid)
                assert (a.tokens, a.parents, a.probs, a.score, a.match_length) == \
                    (b.tokens, b.parents, b.probs, b.score, b.match_length)
