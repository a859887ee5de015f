"""Batched decoding (``Decoder.generate_batch`` / ``stream_batch``): each request as exact as alone.

Greedy: every request's output equals its own ``model.generate`` output, property-tested over
random arrival orders, prompt lengths, ``max_new_tokens`` (0 and 1 included: requests that end
before or in their first step), concurrency, tree budgets and source mixes (oracles that know
each request's answer, random guesses, side blocks, every library source), on tiny float64 models
of several families (sliding-window, hybrid and GPT-2 eager included). Sampling: a seeded request
gets the very draws the one-request decoder makes with that seed, and the plain-sampling law holds
inside a batch (chi-square on the enumerated law). A request whose source raises, or that is
cancelled, ends alone; continuous batching admits the next request as soon as one ends; the
shared budget widens trees for few requests and shrinks them for many.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft import Decoder, PromptLookup
from specdraft import BatchRequest
from specdraft.budget import Ask, Budget
from specdraft.sources import FrequencyTrie, JacobiLookahead, MultiLevelNGram, SuffixTree, TokenRecycling
from specdraft.sources.base import Context, Draft, Feedback

from conftest import (FAST, Oracles, RandomGuess, SideBlockToy, generation_config_override, reference_greedy,
                      tiny_model)
from test_greedy_identity import prompts

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = [("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "eager"), ("mistral", "eager")]


def _sources(kind: str, oracle_sequences):
    if kind == "default":
        return None
    if kind == "oracle":
        return [RandomGuess(seed=3, name="random"), Oracles(oracle_sequences)]
    if kind == "side":
        return [SideBlockToy(seed=5, mode="chain", max_side=4, branches=True, name="side"), PromptLookup()]
    return [{"ngram": MultiLevelNGram, "trie": FrequencyTrie, "jacobi": JacobiLookahead, "recycle": TokenRecycling,
             "suffix": SuffixTree, "prompt": PromptLookup}[kind]()]


def _skip_legacy_causal_buffer(model) -> None:
    """Older transformers' GPT-2 eager attention masks by a causal buffer by cache position: the
    batched decoder refuses it (tested below), so the identity property has nothing to test."""
    from specdraft.model.runner import ModelRunner, UnsupportedModelError

    try:
        ModelRunner(model).check_batches()
    except UnsupportedModelError as exc:
        pytest.skip(f"batched decoding refuses this model here: {exc}")


def test_a_legacy_causal_buffer_is_refused_with_the_way_out() -> None:
    import torch

    from specdraft.model.runner import ModelRunner, UnsupportedModelError

    model = tiny_model("gpt2", "eager")
    legacy = [b for _, b in model.named_buffers() if b.dtype == torch.bool and b.dim() == 4]
    if not legacy:
        model = __import__("copy").deepcopy(model)
        model.transformer.h[0].attn.register_buffer("bias", torch.ones(1, 1, 8, 8, dtype=torch.bool).tril())
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        ModelRunner(model).check_batches()
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        Decoder(model, None, sources=[], max_tree_nodes=0).generate_batch([[1, 2], [3, 4]], max_new_tokens=2)
    # one request at a time keeps its rows at the end of the cache, which the buffer assumes
    assert Decoder(model, None, sources=[], max_tree_nodes=0).generate_batch([[1, 2], [3, 4]], max_new_tokens=2,
                                                                            concurrency=1)[1].token_ids


def _answers(model, prompts_, limits):
    with generation_config_override(model, eos_token_id=None):
        return [list(p) + reference_greedy(model, p, n + 8) for p, n in zip(prompts_, limits)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@settings(FAST, max_examples=10)
@given(requests=st.lists(st.tuples(prompts(), st.integers(0, 30)), min_size=1, max_size=6),
       concurrency=st.integers(1, 4), max_tree_nodes=st.integers(0, 24),
       kind=st.sampled_from(["default", "oracle", "side", "ngram", "trie", "jacobi", "recycle", "suffix", "prompt"]),
       adaptive=st.booleans(), order_seed=st.integers(0, 1000))
def test_batched_greedy_equals_each_requests_own_generate(case, requests, concurrency, max_tree_nodes, kind,
                                                          adaptive, order_seed) -> None:
    model = tiny_model(*case)
    _skip_legacy_causal_buffer(model)
    random.Random(order_seed).shuffle(requests)  # arrival order
    batch_prompts = [p for p, _ in requests]
    limits = [n for _, n in requests]
    sources = _sources(kind, _answers(model, batch_prompts, limits) if kind == "oracle" else [])
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive,
                  cpu_kernels="stock")
    result = dec.generate_batch([BatchRequest(p, max_new_tokens=n) for p, n in requests], concurrency=concurrency)
    assert len(result) == len(requests)
    for (prompt, n), out in zip(requests, result):
        assert out.error is None
        assert out.token_ids == reference_greedy(model, prompt, n)
        assert out.stats.new_tokens == len(out.token_ids) == sum(out.stats.accept_lengths)
        assert all(1 <= a for a in out.stats.accept_lengths)
    assert result.stats.new_tokens == sum(len(o.token_ids) for o in result)
    assert dec.runner.store.regions == []  # every region went back


def test_the_oracle_batch_really_speculates_and_shares_forwards() -> None:
    """Not vacuous: drafts are accepted, and four requests take fewer forwards than one at a time."""
    model = tiny_model("llama")
    batch_prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [9, 8, 7, 6, 5, 4], [3, 3, 3, 4]]
    with generation_config_override(model, eos_token_id=None):
        answers = _answers(model, batch_prompts, [30] * 4)
        dec = Decoder(model, sources=[Oracles(answers)], max_tree_nodes=16, adaptive_budget=False)
        result = dec.generate_batch(batch_prompts, max_new_tokens=30, concurrency=4)
        for p, out in zip(batch_prompts, result):
            assert out.token_ids == reference_greedy(model, p, 30)
            assert out.stats.mean_accepted > 3
    assert result.stats.forwards < sum(o.stats.steps for o in result)
    assert result.stats.mean_rows > 4


def test_seeded_sampling_in_a_batch_draws_what_the_request_draws_alone() -> None:
    """Each request keeps its own random stream: its output equals the one-request decoder's with
    the same seed and settings (per-request temperature, top-k/p, repetition penalty)."""
    model = tiny_model("llama")
    settings_ = [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), dict(repetition_penalty=1.4),
                 dict(top_k=0, temperature=1.0), dict(temperature=0.9, top_p=0.9, repetition_penalty=1.2)]
    batch_prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5, 4], [7, 8, 9], [2, 2, 2, 2, 2, 2], [6, 1, 6, 1, 6]]
    with generation_config_override(model, eos_token_id=None):
        requests = [BatchRequest(p, max_new_tokens=20, do_sample=True, seed=100 + i, **s)
                    for i, (p, s) in enumerate(zip(batch_prompts, settings_))]
        dec = Decoder(model, max_tree_nodes=12, cpu_kernels="stock")
        result = dec.generate_batch(requests, concurrency=3)
        alone = Decoder(model, max_tree_nodes=12, cpu_kernels="stock")
        for request, out in zip(requests, result):
            one = alone.generate(request.prompt, max_new_tokens=20, do_sample=True, seed=request.seed,
                                 **{k: v for k, v in vars(request).items()
                                    if k in ("temperature", "top_k", "top_p", "repetition_penalty") and v is not None})
            assert out.token_ids == one.token_ids


def test_the_plain_sampling_law_holds_inside_a_batch() -> None:
    """Chi-square against the enumerated law of the first four tokens (the sampling suite's
    harness), every sample drawn inside a batch of eight with a tree of drafts."""
    from test_sampling_stats import NEW, PROMPT, SETTING_A, ExactLaw, TableSource, chi_square, law_model

    model = law_model()
    law = ExactLaw(model, SETTING_A)
    dec = Decoder(model, sources=[TableSource(law), PromptLookup(max_ngram=3, min_ngram=1, num_tokens=3)],
                  max_tree_nodes=12, adaptive_budget=False)
    counts: Counter = Counter()
    steps = tokens = 0
    for start in range(0, 1200, 40):
        requests = [BatchRequest(PROMPT, max_new_tokens=NEW, do_sample=True, seed=start + i, **SETTING_A)
                    for i in range(40)]
        for out in dec.generate_batch(requests, concurrency=8):
            counts[tuple(out.token_ids)] += 1
            steps += out.stats.steps
            tokens += out.stats.new_tokens
    pvalue, _, impossible = chi_square(counts, law)
    assert tokens / steps > 1.3, "the drafts are not being accepted: the tree path is not exercised"
    assert impossible == 0
    assert pvalue > 1e-4


class RaisesFor:
    """A source that raises in ``propose`` for requests whose prompt starts with ``token``."""

    name = "raises"

    def __init__(self, token: int) -> None:
        self.token = token
        self.ended: list[int] = []
        self.aborted: list[int] = []

    def begin(self, context: Context) -> None:
        pass

    def end(self, context: Context) -> None:
        self.ended.append(context.request_id)

    def abort(self, context: Context) -> None:
        self.aborted.append(context.request_id)

    def observe(self, feedback: Feedback) -> None:
        pass

    def propose(self, context: Context, budget: int) -> Draft:
        if context.tokens[0] == self.token:
            raise RuntimeError("this source fails on purpose")
        return Draft()


def test_a_request_whose_source_raises_ends_alone() -> None:
    model = tiny_model("llama")
    bad = RaisesFor(token=9)
    dec = Decoder(model, sources=[bad, PromptLookup()], max_tree_nodes=8, cpu_kernels="stock")
    batch_prompts = [[1, 2, 3, 1, 2], [9, 1, 2], [4, 5, 6, 4, 5], [9, 9]]
    result = dec.generate_batch(batch_prompts, max_new_tokens=16, concurrency=2)
    for prompt, out in zip(batch_prompts, result):
        if prompt[0] == 9:
            assert isinstance(out.error, RuntimeError) and "on purpose" in str(out.error)
            assert out.token_ids == reference_greedy(model, prompt, 16)[: len(out.token_ids)]
        else:
            assert out.error is None and out.token_ids == reference_greedy(model, prompt, 16)
    assert len(bad.aborted) == 2 and len(bad.ended) == 2


def test_cancel_ends_one_request_and_the_others_go_on() -> None:
    model = tiny_model("llama")
    batch_prompts = [[1, 2, 3, 1, 2], [5, 6, 7], [4, 5, 6, 4, 5]]
    with generation_config_override(model, eos_token_id=None):
        dec = Decoder(model, max_tree_nodes=8, cpu_kernels="stock")
        stream = dec.stream_batch(batch_prompts, max_new_tokens=24, concurrency=3)
        seen: Counter = Counter()
        for index, piece in stream:
            seen[index] += len(piece)
            if index == 1 and seen[1] >= 2:
                stream.cancel(1)
        outputs = stream.outputs
        assert outputs[1].cancelled and len(outputs[1].token_ids) < 24
        for i in (0, 2):
            assert not outputs[i].cancelled
            assert outputs[i].token_ids == reference_greedy(model, batch_prompts[i], 24)
        assert outputs[1].token_ids == reference_greedy(model, batch_prompts[1], 24)[: len(outputs[1].token_ids)]


def test_continuous_batching_admits_the_next_request_when_one_ends() -> None:
    """With two slots, a short request's slot goes to the third request while the long one runs."""
    model = tiny_model("llama")
    with generation_config_override(model, eos_token_id=None):
        dec = Decoder(model, max_tree_nodes=0, cpu_kernels="stock")
        requests = [BatchRequest([1, 2, 3], max_new_tokens=40), BatchRequest([4, 5], max_new_tokens=3),
                    BatchRequest([6, 7, 8], max_new_tokens=3)]
        order = [index for index, _ in dec.stream_batch(requests, concurrency=2)]
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # request 2 ran before request 0 ended
    assert max(i for i, x in enumerate(order) if x == 2) < max(i for i, x in enumerate(order) if x == 0)


def test_requests_that_end_at_once_and_bad_input() -> None:
    model = tiny_model("llama")
    dec = Decoder(model, max_tree_nodes=8, cpu_kernels="stock")
    result = dec.generate_batch([BatchRequest([1, 2], max_new_tokens=0), BatchRequest([3], max_new_tokens=1)])
    assert result[0].token_ids == [] and result[1].token_ids == reference_greedy(model, [3], 1)
    with pytest.raises(ValueError, match="request 1: max_new_tokens"):
        dec.generate_batch([[1], BatchRequest([2], max_new_tokens=-1)])
    with pytest.raises(ValueError, match="concurrency"):
        dec.generate_batch([[1]], concurrency=0)
    with pytest.raises(TypeError, match="list of prompts"):
        dec.generate_batch("one prompt")
    with pytest.raises(ValueError, match="request 0: .*not supported"):
        dec.generate_batch([[1]], num_beams=2)


def priced_budget(max_nodes: int, curve: list[float], **options) -> Budget:
    """A budget past its warm-up, whose prices come from ``curve``."""
    budget = Budget(max_nodes, warmup=0, cost_curve=curve, **options)
    budget.observe_step(1, curve[0])
    return budget


def nodes(budget: Budget, asks: list[Ask]) -> list[int]:
    return [grant.nodes for grant in budget.allocate(asks)]


def test_the_budget_widens_trees_for_few_requests_and_shrinks_them_for_many() -> None:
    """On a curve where 1-8 rows cost about one row and every row past that its own price, one
    request gets a wide tree, sixteen get none: batched speculation never pays more per token than
    batched plain decoding is expected to."""
    curve = [1.0] * 8 + [1.0 + 0.9 * (w - 8) for w in range(9, 129)]
    budget = priced_budget(16, curve)
    rates = [0.6] * 16
    assert nodes(budget, [Ask(rates, 16, 0, 1)]) == [7]  # 8 rows, all at the price of one
    many = nodes(budget, [Ask(rates, 16, 0, 1) for _ in range(16)])
    assert many == [0] * 16
    few = nodes(budget, [Ask(rates, 16, 0, 1) for _ in range(4)])
    assert sum(few) == 4 and max(few) - min(few) <= 1
    assert nodes(budget, [Ask([0.0] * 16, 16, 0, 1)]) == [0]  # drafts that never hit: plain decoding
    assert nodes(budget, [Ask(rates, 16, 0, 0, decoding=False), Ask(rates, 3, 0, 1)]) == [0, 3]


def test_batch_on_a_simulated_device_matches_the_cpu() -> None:
    """Device-correct by construction: the batched path runs on a simulated CUDA device (every
    tensor where the model is, every generator on the logits' device) with the CPU's outputs."""
    import copy

    from specdraft.simulated_device import SimulatedDevice

    model = copy.deepcopy(tiny_model("llama"))
    batch_prompts = [[1, 2, 3, 1, 2, 3], [5, 6, 7], [4, 4, 4, 4]]
    cpu = Decoder(tiny_model("llama"), max_tree_nodes=8, cpu_kernels="stock")
    expected_greedy = [o.token_ids for o in cpu.generate_batch(batch_prompts, max_new_tokens=12)]
    sampled = [BatchRequest(p, max_new_tokens=12, do_sample=True, seed=i, repetition_penalty=1.3, temperature=0.8)
               for i, p in enumerate(batch_prompts)]
    expected_sampled = [o.token_ids for o in cpu.generate_batch(sampled)]
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim, sim.patched_generator():
        dec = Decoder(model, max_tree_nodes=8, cpu_kernels="stock")
        dec.row_choices = "walk"  # the CPU's choices, to compare draw for draw
        greedy = [o.token_ids for o in dec.generate_batch(batch_prompts, max_new_tokens=12)]
        drawn = [o.token_ids for o in dec.generate_batch(sampled)]
        dec.row_choices = "auto"
        sim.reset_counts()
        batched_rows = dec.generate_batch(batch_prompts, max_new_tokens=12)
        reads, uploads = sim.counts.syncs, sim.counts.uploads
        sampled_rows = dec.generate_batch(sampled)
    forwards = batched_rows.stats.forwards
    assert reads <= forwards, (reads, forwards)  # one read per step for every request together
    assert uploads <= forwards, (uploads, forwards)  # and one upload
    assert all(len(o.token_ids) == 12 for o in sampled_rows)
    assert greedy == expected_greedy
    assert drawn == expected_sampled
    assert [o.token_ids for o in batched_rows] == expected_greedy
    assert [np.asarray(o.token_ids).size for o in batched_rows] == [12, 12, 12]


@pytest.mark.parametrize("arch", ["llama", "qwen2_swa", "gemma3"])
def test_per_request_attention_equals_the_masked_forward(arch: str) -> None:
    """The packed backend (``sdpa`` per request on its own columns) gives the logits of the dense
    masked forward over every region, and the model is back on ``sdpa`` afterwards."""
    import torch

    from specdraft.model.packed_attention import PACKED_NAME, packed_attention_for
    from specdraft.model.runner import ModelRunner, Segment

    model = tiny_model(arch)
    prompts_ = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]

    def logits(packed: bool) -> torch.Tensor:
        runner = ModelRunner(model)
        regions = [runner.store.allocate(24) for _ in prompts_]

        def segments(step: int) -> list[Segment]:
            out = []
            for region, p in zip(regions, prompts_):
                if step == 0:
                    out.append(Segment(region, p, np.arange(len(p)), None, range(len(p))))
                else:  # a root and two siblings, a tree step
                    block = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
                    out.append(Segment(region, [3, 4, 5], region.length + np.array([0, 1, 1]), block, range(3)))
            return out

        with packed_attention_for(model) if packed else nullcontext() as used:
            assert used in (None, packed)
            if packed:
                assert model.config._attn_implementation == PACKED_NAME
            first = runner.forward(segments(0)).logits
            for region in regions:
                runner.store.keep_all(region)
            second = runner.forward(segments(1)).logits
        return torch.cat([first, second])

    from contextlib import nullcontext

    torch.testing.assert_close(logits(True), logits(False), rtol=1e-9, atol=1e-9)
    assert model.config._attn_implementation == "sdpa"


def test_attention_priced_per_row_and_position_shrinks_trees_over_long_contexts() -> None:
    """A row's attention over its request's context is part of what a tree node costs: the same
    acceptance buys a wide tree over a short context and a narrow one over a long context."""
    from specdraft.kernels.attention_cost import attention_seconds

    curve = [0.01] * 16 + [0.01 * (1 + 0.5 * (w - 16)) for w in range(17, 65)]
    budget = priced_budget(16, curve, attention_seconds=1e-6)  # 0.1 one-row forwards per 1k positions
    rates = [0.5] * 16
    short = nodes(budget, [Ask(rates, 16, 0, 1, context=100) for _ in range(2)])
    long = nodes(budget, [Ask(rates, 16, 0, 1, context=20_000) for _ in range(2)])
    assert sum(long) < sum(short)
    assert attention_seconds(tiny_model("llama")) >= 0.0
    with pytest.raises(ValueError, match="attention_seconds"):
        Budget(4, attention_seconds=-1.0)


def test_stop_strings_per_request_match_the_one_request_decoder(tiny_dir) -> None:
    """Stop strings cut each request where the one-request decoder cuts it (the tiny checkpoint's
    word-level tokenizer decodes the text the rules search)."""
    from specdraft.models import load_model

    model, tokenizer = load_model(str(tiny_dir), dtype="float64", progress=False)
    alone = Decoder(model, tokenizer, max_tree_nodes=8, cpu_kernels="stock")
    prompts_ = ["the cat sat on the mat", "a b c a b c a b", "one two three"]
    free = [alone.generate(p, max_new_tokens=20).text for p in prompts_]
    stops = [[free[0].split()[2]] if len(free[0].split()) > 2 else None, None,
             [free[2].split()[1]] if len(free[2].split()) > 1 else None]
    requests = [BatchRequest(p, max_new_tokens=20, stop=s) for p, s in zip(prompts_, stops)]
    batch = Decoder(model, tokenizer, max_tree_nodes=8, cpu_kernels="stock").generate_batch(requests, concurrency=2)
    for request, out in zip(requests, batch):
        one = alone.generate(request.prompt, max_new_tokens=20, stop=request.stop)
        assert out.token_ids == one.token_ids and out.text == one.text
    cut = [len(out.text) < len(text) for out, text in zip(batch, free)]
    assert any(cut), (free, [o.text for o in batch])  # a stop string really ended a request early


def test_batch_statistics_describe_that_batch_alone() -> None:
    """A decoder's second batch reports its own forwards' tree sizes, not the first batch's too."""
    model = tiny_model("llama")
    dec = Decoder(model, max_tree_nodes=8, cpu_kernels="stock")
    first = dec.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=6, concurrency=2)
    second = dec.generate_batch([[6, 7, 8]], max_new_tokens=5, concurrency=1)
    assert len(first.stats.tree_sizes) == first.stats.forwards
    assert len(second.stats.tree_sizes) == second.stats.forwards
    assert all(active == 1 for active, _ in second.stats.tree_sizes)
