"""Promise 1, greedy half: ``Decoder`` output == ``model.generate(do_sample=False)``, token for token.

Property-tested with hypothesis on tiny random float64 models of every supported family (sliding
window and hybrid ones included), for random prompts (often repetitive, so prompt lookup fires),
tree budgets, token limits, fixed or adaptive budgets and mixes of draft sources -- good ones (an
oracle that knows the answer and drafts straight past EOS and the token limit), bad ones (random
guesses), side-block users, and the library's own sources with their defaults. Then repetition
penalty, streaming, EOS handling, and one decoder serving several requests.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from specdraft import Decoder, GenerationStats, PromptLookup
from specdraft.sources import FrequencyTrie, JacobiLookahead, MultiLevelNGram, TokenRecycling
from specdraft.sources import SuffixTree

from _suffix_checks import check_source
from conftest import (FAST, VOCAB, OracleSource, RandomGuess, SideBlockToy, check_side_records,
                      generation_config_override, reference_greedy, tiny_model)

pytestmark = pytest.mark.usefixtures("single_thread")

IDENTITY_CASES = [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2_swa", "sdpa"), ("mistral", "sdpa"), ("phi", "sdpa"),
                  ("gpt2", "sdpa"), ("gemma3", "sdpa"), ("mistral", "eager"), ("gemma3", "eager"), ("gpt2", "eager")]
EOS = 2  # every tiny model's generation_config.eos_token_id


def _ids(case):
    return f"{case[0]}-{case[1]}"


# -- strategies --------------------------------------------------------------------------------------


@st.composite
def prompts(draw, max_len: int = 40):
    length = draw(st.integers(1, max_len))
    kind = draw(st.sampled_from(["random", "repeat", "repeat", "small_alphabet"]))
    if kind == "random":
        return draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
    if kind == "small_alphabet":
        alphabet = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4, unique=True))
        return draw(st.lists(st.sampled_from(alphabet), min_size=length, max_size=length))
    pattern = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8))
    seq = (pattern * (length // len(pattern) + 1))[:length]
    for pos, tok in draw(st.lists(st.tuples(st.integers(0, length - 1), st.integers(0, VOCAB - 1)), max_size=3)):
        seq[pos] = tok
    return seq


_prompt_lookup = st.builds(
    lambda lo, extra, num_tokens, max_branches: ("prompt", lo, lo + extra, num_tokens, max_branches),
    st.integers(1, 3), st.integers(0, 2), st.integers(1, 12), st.integers(1, 4))
_source_spec = st.one_of(
    _prompt_lookup,
    st.tuples(st.just("random"), st.integers(0, 10_000)),
    st.tuples(st.just("oracle"), st.booleans()),
    st.tuples(st.just("side"), st.integers(0, 10_000), st.sampled_from(["chain", "forest", "wild"])),
    st.tuples(st.just("library"), st.sampled_from(["ngram", "trie", "jacobi", "recycle", "suffix"])),  # with their defaults
)
_LIBRARY_SOURCES = {"ngram": MultiLevelNGram, "trie": FrequencyTrie, "jacobi": JacobiLookahead,
                    "recycle": TokenRecycling, "suffix": SuffixTree}
source_specs = st.lists(_source_spec, min_size=0, max_size=4)


def build_sources(specs, oracle_sequence):
    sources = []
    for i, spec in enumerate(specs):
        kind = spec[0]
        if kind == "prompt":
            _, lo, hi, num_tokens, max_branches = spec
            sources.append(PromptLookup(max_ngram=hi, min_ngram=lo, num_tokens=num_tokens, max_branches=max_branches))
        elif kind == "random":
            sources.append(RandomGuess(seed=spec[1], name=f"random{i}"))
        elif kind == "oracle":
            sources.append(OracleSource(oracle_sequence, decoy=spec[1], name=f"oracle{i}"))
        elif kind == "library":
            sources.append(_LIBRARY_SOURCES[spec[1]]())
        else:
            sources.append(SideBlockToy(seed=spec[1], mode=spec[2], max_side=4, branches=bool(spec[1] % 2),
                                        name=f"side{i}"))
    return sources


def check_stats(out, n: int, max_tree_nodes: int, sources) -> None:
    s = out.stats
    assert s.new_tokens == len(out.token_ids) <= n
    assert s.steps == len(s.accept_lengths) == len(s.tree_sizes)
    assert sum(s.accept_lengths) == len(out.token_ids)
    assert all(a >= 1 for a in s.accept_lengths)  # never worse than one token per forward
    assert all(1 <= t <= max_tree_nodes + 1 for t in s.tree_sizes)
    assert len(s.per_source) == len(sources)
    for stat in s.per_source.values():
        assert 0 <= stat.accepted <= stat.proposed


def oracle_sequence(model, prompt, n, specs):
    """prompt + the greedy continuation without EOS, 10 tokens longer than needed (so the oracle drafts
    past EOS and past max_new_tokens)."""
    if not any(spec[0] == "oracle" for spec in specs):
        return list(prompt)
    with generation_config_override(model, eos_token_id=None):
        return list(prompt) + reference_greedy(model, prompt, n + 10)


# -- the property ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", IDENTITY_CASES, ids=_ids)
@settings(FAST, max_examples=25)
@given(prompt=prompts(), n=st.integers(0, 48), max_tree_nodes=st.integers(0, 40), specs=source_specs,
       adaptive=st.booleans())
def test_greedy_identity(case, prompt, n, max_tree_nodes, specs, adaptive) -> None:
    model = tiny_model(*case)
    ref = reference_greedy(model, prompt, n)
    sources = build_sources(specs, oracle_sequence(model, prompt, n, specs))
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive)
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == ref
    check_stats(out, n, max_tree_nodes, sources)
    longest = max(out.stats.accept_lengths, default=0)  # (hypothesis --hypothesis-show-statistics)
    event(f"longest step: {'5+' if longest >= 5 else longest}")
    event("stopped at EOS" if ref and ref[-1] == EOS else "no EOS")
    for source in sources:
        if isinstance(source, SideBlockToy) and source.mode != "wild" and source.records:
            check_side_records(model, source.records[:2])


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "eager")],
                         ids=_ids)
@settings(FAST, max_examples=8)
@given(requests=st.lists(prompts(), min_size=2, max_size=3), n=st.integers(1, 40), max_tree_nodes=st.integers(0, 40),
       template=st.sampled_from(["tr8", "tr16", "tr32", "tr80"]), k=st.sampled_from([8, 12]), alone=st.booleans(),
       adaptive=st.booleans())
def test_greedy_identity_token_recycling_hot_start(case, requests, n, max_tree_nodes, template, k, alone,
                                                   adaptive) -> None:
    """Token Recycling, alone or with the default sources, one matrix over several requests (its hot
    start), so later requests draft from what the earlier ones left in it."""
    model = tiny_model(*case)
    recycle = TokenRecycling(k=k, template=template)
    sources = [recycle] if alone else [PromptLookup(), recycle, FrequencyTrie(), MultiLevelNGram()]
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive)
    for prompt in requests:
        out = dec.generate(prompt, max_new_tokens=n)
        assert out.token_ids == reference_greedy(model, prompt, n)
        check_stats(out, n, max_tree_nodes, sources)


def test_token_recycling_drafts_get_accepted() -> None:
    """Not vacuous: the decoder feeds the source the model's top-k, and its drafts are accepted (a
    tiny random model's greedy output loops, which the matrix learns within a request)."""
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9]
    recycle = TokenRecycling(k=8, template="tr16")
    dec = Decoder(model, sources=[recycle], max_tree_nodes=16, adaptive_budget=False)
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 40)
        first = dec.generate(prompt, max_new_tokens=40)
        second = dec.generate(prompt, max_new_tokens=40)  # hot start: drafts from the first step on
    assert first.token_ids == second.token_ids == ref
    assert (recycle.matrix >= 0).any()
    stats = second.stats.per_source[recycle.name]
    assert stats.proposed > 0 and stats.accepted > 0
    assert second.stats.steps < 40


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "eager")],
                         ids=_ids)
@settings(FAST, max_examples=8)
@given(requests=st.lists(prompts(), min_size=2, max_size=3), n=st.integers(1, 40), max_tree_nodes=st.integers(0, 40),
       depth=st.sampled_from([3, 24]), cap=st.sampled_from([0, 1, 1000]), tree=st.booleans(), alone=st.booleans(),
       adaptive=st.booleans())
def test_greedy_identity_suffix_tree_across_requests(case, requests, n, max_tree_nodes, depth, cap, tree, alone,
                                                     adaptive) -> None:
    """SuffixDecoding, alone or with the default sources, over several requests (its global tree
    drafts the later requests from the earlier responses, and evicts them past ``cap``)."""
    model = tiny_model(*case)
    suffix = SuffixTree(max_depth=depth, max_cached_requests=cap, tree=tree)
    sources = [suffix] if alone else [PromptLookup(), suffix, FrequencyTrie(), MultiLevelNGram()]
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive)
    for prompt in requests + requests[:1]:
        out = dec.generate(prompt, max_new_tokens=n)
        assert out.token_ids == reference_greedy(model, prompt, n)
        check_stats(out, n, max_tree_nodes, sources)
    check_source(suffix)
    assert suffix.active_requests == 0


def test_suffix_tree_drafts_get_accepted() -> None:
    """Not vacuous: a repeated request is drafted from the cached response and mostly accepted."""
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9]
    suffix = SuffixTree()
    dec = Decoder(model, sources=[suffix], max_tree_nodes=16, adaptive_budget=False)
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 40)
        first = dec.generate(prompt, max_new_tokens=40)
        second = dec.generate(prompt, max_new_tokens=40)
    assert first.token_ids == second.token_ids == ref
    stats = second.stats.per_source[suffix.name]
    assert stats.proposed > 0 and stats.accepted > 0
    assert second.stats.steps < first.stats.steps


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("mistral", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "eager")],
                         ids=_ids)
@settings(FAST, max_examples=8)
@given(prompt=prompts(max_len=30), n=st.integers(1, 30), max_tree_nodes=st.integers(0, 24), specs=source_specs,
       penalty=st.sampled_from([1.3, 0.7, 2.5]), adaptive=st.booleans())
def test_greedy_identity_with_repetition_penalty(case, prompt, n, max_tree_nodes, specs, penalty, adaptive) -> None:
    model = tiny_model(*case)
    ref = reference_greedy(model, prompt, n, repetition_penalty=penalty)
    with generation_config_override(model, eos_token_id=None):
        seq = list(prompt) + reference_greedy(model, prompt, n + 5, repetition_penalty=penalty)
    sources = build_sources(specs, seq)
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive)
    out = dec.generate(prompt, max_new_tokens=n, repetition_penalty=penalty)
    assert out.token_ids == ref
    check_stats(out, n, max_tree_nodes, sources)


@pytest.mark.parametrize("arch", ["llama", "qwen2_swa"])
def test_repetition_penalty_changes_output_and_still_matches(arch) -> None:
    """Guard against a vacuous penalty test: the penalty must actually change the output here."""
    model = tiny_model(arch)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    with generation_config_override(model, eos_token_id=None):
        plain = reference_greedy(model, prompt, 30)
        ref = reference_greedy(model, prompt, 30, repetition_penalty=1.3)
        assert plain != ref
        sources = [OracleSource(prompt + plain), OracleSource(prompt + ref, decoy=True), PromptLookup()]
        out = Decoder(model, sources=sources, max_tree_nodes=32).generate(prompt, max_new_tokens=30,
                                                                         repetition_penalty=1.3)
        assert out.token_ids == ref
        assert out.stats.steps < 30


# -- streaming ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("gemma3", "sdpa")], ids=_ids)
@settings(FAST, max_examples=10)
@given(prompt=prompts(), n=st.integers(0, 40), max_tree_nodes=st.integers(0, 30), specs=source_specs,
       adaptive=st.booleans())
def test_stream_concatenates_to_generate(case, prompt, n, max_tree_nodes, specs, adaptive) -> None:
    model = tiny_model(*case)
    seq = oracle_sequence(model, prompt, n, specs)

    def decoder():
        return Decoder(model, sources=build_sources(specs, seq), max_tree_nodes=max_tree_nodes,
                       adaptive_budget=adaptive)

    out = decoder().generate(prompt, max_new_tokens=n)
    stats = GenerationStats()
    chunks = list(decoder().stream(prompt, max_new_tokens=n, stats=stats))
    assert all(isinstance(c, list) and c and all(isinstance(t, int) for t in c) for c in chunks)
    assert [t for c in chunks for t in c] == out.token_ids == reference_greedy(model, prompt, n)
    # one chunk per forward pass
    assert [len(c) for c in chunks] == stats.accept_lengths and stats.steps == len(chunks)
    assert stats.new_tokens == len(out.token_ids)
    if not adaptive:  # a fixed budget makes the step structure deterministic (the adaptive one is timed)
        assert stats.accept_lengths == out.stats.accept_lengths


def test_stream_is_lazy_and_matches_steps() -> None:
    model = tiny_model("llama")
    prompt = [5, 6, 7, 5, 6, 7, 5]
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 20)
        stats = GenerationStats()
        stream = Decoder(model, sources=[OracleSource(prompt + ref)], max_tree_nodes=4,
                         adaptive_budget=False).stream(prompt, max_new_tokens=20, stats=stats)
        first = next(stream)
        assert stats.steps == 1  # one forward per chunk, nothing computed ahead
        assert first == ref[:1]  # the prefill's own token, as in model.generate
        second = next(stream)
        assert stats.steps == 2
        assert second == ref[1:6]  # root + 4 accepted draft nodes = 5 tokens in the first tree step
        rest = [t for c in stream for t in c]
        assert first + second + rest == ref
        assert stats.accept_lengths == [1, 5, 5, 5, 4]  # the last step is cut at the token limit


def test_the_first_token_comes_from_the_prefill_like_model_generate() -> None:
    """The prefill's last row gives the first new token, as in ``model.generate``: n tokens of plain
    decoding cost n model forwards, the prefill included (not n + 1: a separate forward of the
    prompt's last token is a whole extra step, 7% of a 14-token answer), and the first token is
    computed in the same prefill-shaped forward as transformers computes it."""
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    try:
        with generation_config_override(model, eos_token_id=None):
            for n in (1, 2, 6):
                ref = reference_greedy(model, prompt, n)
                for decoder in (Decoder(model, sources=[], max_tree_nodes=0),
                                Decoder(model, sources=[PromptLookup()], max_tree_nodes=0, adaptive_budget=False)):
                    calls.clear()
                    out = decoder.generate(prompt, max_new_tokens=n)
                    assert out.token_ids == ref
                    assert len(calls) == n == out.stats.steps, (n, len(calls), out.stats.steps)
                    assert out.stats.accept_lengths == [1] * n
    finally:
        handle.remove()


# -- the token limit --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "sdpa")], ids=_ids)
def test_oracle_never_exceeds_max_new_tokens(case) -> None:
    model = tiny_model(*case)
    prompt = [9, 10, 11, 12, 9, 10]
    with generation_config_override(model, eos_token_id=None):
        long = reference_greedy(model, prompt, 60)
        for n in [0, 1, 2, 3, 5, 8, 17, 40]:
            for budget in [0, 1, 2, n - 1, n, n + 1, 40]:
                if budget < 0:
                    continue
                for adaptive in (False, True):
                    oracle = OracleSource(prompt + long)
                    dec = Decoder(model, sources=[oracle, PromptLookup()], max_tree_nodes=budget,
                                  adaptive_budget=adaptive)
                    out = dec.generate(prompt, max_new_tokens=n)
                    assert out.token_ids == long[:n], (n, budget, adaptive)
                    assert max(oracle.proposed_lengths, default=0) <= budget
                    assert out.stats.steps <= n
                    if adaptive:
                        continue
                    # a fixed budget: the prefill commits the first token, then the oracle comes first,
                    # so every tree is full of correct tokens
                    assert out.stats.steps == (0 if n == 0 else 1 + -(-(n - 1) // (budget + 1)))
                    if n >= 2 and budget >= n - 2:
                        # the rest of the answer fits in one tree, and the draft was cut to n - 2 tokens
                        # (the prefill made the first, the model's own bonus token takes the last slot)
                        assert out.stats.steps == 2
                        oracle_stats = out.stats.per_source["oracle"]
                        assert oracle_stats.proposed == oracle_stats.accepted == n - 2


# -- EOS -------------------------------------------------------------------------------------------------------


def _first_occurrences(tokens):
    return [(k, t) for k, t in enumerate(tokens) if tokens.index(t) == k]


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("mistral", "sdpa"), ("phi", "sdpa"), ("gpt2", "sdpa"),
                                  ("gemma3", "sdpa"), ("qwen2_swa", "sdpa"), ("gemma3", "eager")], ids=_ids)
def test_eos_stops_like_generate(case) -> None:
    model = tiny_model(*case)
    rng = np.random.default_rng(17)
    base = rng.integers(3, VOCAB, size=6).tolist()
    prompt = base + base[:4] + rng.integers(3, VOCAB, size=3).tolist() + base[:3]
    with generation_config_override(model, eos_token_id=None):
        long = reference_greedy(model, prompt, 40)
    firsts = _first_occurrences(long)
    assert len(firsts) >= 3, f"tiny {case} model output too repetitive to pick EOS ids: {long}"
    picks = [firsts[0], firsts[len(firsts) // 2], firsts[-1]]
    absent = [t for t in range(VOCAB) if t not in long][:2]
    tried_mid = False
    for k, eos in picks:
        tried_mid |= 0 < k < 39
        eos_sets = [eos, [eos], [absent[0], eos, absent[1]]]
        later = [t for kk, t in firsts if kk > k]
        if later:
            eos_sets.append([later[0], eos])  # a second EOS that would only come later
        for eos_ids in eos_sets:
            with generation_config_override(model, eos_token_id=eos_ids):
                ref = reference_greedy(model, prompt, 40)
                assert ref == long[: k + 1]  # plain generate stops right after the first EOS
                for sources, budget in [([], 8), ([PromptLookup()], 8), ([OracleSource(prompt + long)], 40),
                                        ([OracleSource(prompt + long, decoy=True), RandomGuess(3), PromptLookup()], 12),
                                        ([SideBlockToy(seed=1), OracleSource(prompt + long)], 3)]:
                    out = Decoder(model, sources=sources, max_tree_nodes=budget).generate(prompt, max_new_tokens=40)
                    assert out.token_ids == ref, (eos_ids, [s.name for s in sources], budget)
                    assert out.token_ids[-1] == eos
                    # the oracle drafts past EOS, yet nothing after it is emitted
                    chunks = list(Decoder(model, sources=sources, max_tree_nodes=budget).stream(
                        prompt, max_new_tokens=40))
                    assert [t for c in chunks for t in c] == ref
    assert tried_mid


def test_eos_in_the_prompt_does_not_stop(make_model) -> None:
    model = make_model("llama")
    with generation_config_override(model, eos_token_id=None):
        probe = reference_greedy(model, [EOS, 5, 6, EOS, 5], 20)
    eos = probe[3]
    prompt = [eos, 5, 6, eos, 5]
    with generation_config_override(model, eos_token_id=eos):
        ref = reference_greedy(model, prompt, 20)
        for budget in (0, 6, 20):
            out = Decoder(model, sources=[PromptLookup(), OracleSource(prompt + probe)],
                          max_tree_nodes=budget).generate(prompt, max_new_tokens=20)
            assert out.token_ids == ref


def test_eos_and_limit_on_the_same_token() -> None:
    model = tiny_model("llama")
    prompt = [11, 12, 13, 11, 12]
    with generation_config_override(model, eos_token_id=None):
        long = reference_greedy(model, prompt, 20)
    k, eos = _first_occurrences(long)[3]
    with generation_config_override(model, eos_token_id=eos):
        for n in (k, k + 1, k + 2):
            ref = reference_greedy(model, prompt, n)
            out = Decoder(model, sources=[OracleSource(prompt + long)], max_tree_nodes=30).generate(prompt, max_new_tokens=n)
            assert out.token_ids == ref == long[: min(n, k + 1)]


# -- one decoder, many requests -----------------------------------------------------------------------------


def test_one_decoder_many_requests_in_sequence() -> None:
    model = tiny_model("mistral")
    dec = Decoder(model, sources=[PromptLookup(), RandomGuess(5)], max_tree_nodes=10)
    rng = np.random.default_rng(2)
    for length in (3, 25, 1, 12, 40):
        prompt = rng.integers(0, VOCAB, size=length).tolist()
        prompt = prompt + prompt[: length // 2]
        assert dec.generate(prompt, max_new_tokens=15).token_ids == reference_greedy(model, prompt, 15)


def test_interleaved_requests_are_refused_or_correct() -> None:
    model = tiny_model("llama")
    p1, p2 = [5, 6, 7, 5, 6], [30, 31, 32, 33]
    with generation_config_override(model, eos_token_id=None):
        r1, r2 = reference_greedy(model, p1, 20), reference_greedy(model, p2, 20)
        dec = Decoder(model, sources=[PromptLookup()])
        stream = dec.stream(p1, max_new_tokens=20)
        first = next(stream)
        try:
            second = dec.generate(p2, max_new_tokens=20).token_ids
        except RuntimeError:
            return  # refusing the second request is a fine answer
        assert second == r2
        assert first + [t for c in stream for t in c] == r1
