"""Lookahead decoding (``JacobiLookahead``): the Figure 2b mask, the window logits, the window
bookkeeping of Algorithm 1, the bounded n-gram pool, and greedy/sampled identity with plain
decoding, alone and mixed with other sources.

Greedy exactness never depends on what the window holds (the verifier only checks the tree), so
the identity tests pass whatever the window does; the window itself is tested separately, with
hand-made logits (bookkeeping) and against fresh forwards of each window token's own sequence.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specdraft import Decoder, PromptLookup
from specdraft.engine.layout import tree_rows
from specdraft.sources import Context, DraftSource, Feedback, FrequencyTrie, JacobiLookahead, MultiLevelNGram
from specdraft.sources.jacobi import NGramPool, window_side_block
from specdraft.tree import TokenTree

from conftest import (FAST, VOCAB, AlternatingBudget, add_branch, OracleSource, RandomGuess, SideBlockToy, assert_float32_logits_match,
                      full_logits, generation_config_override, max_bucket, reference_greedy, tiny_model)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run ~25x faster on one thread on a busy 2-vCPU machine; restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Recording(JacobiLookahead):
    """Records, per step: the context, the side block asked for, the side logits given back, the
    window levels after the update, and the pool's size."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict] = []
        self._open: dict | None = None

    def propose(self, context, budget):
        draft = super().propose(context, budget)
        self._open = dict(context=list(context.tokens), side=draft.side_block, branches=draft.branches,
                          levels_before=[list(l) for l in self.peek_state(context.request_id).levels])
        return draft

    def observe(self, feedback):
        super().observe(feedback)
        rec, self._open = self._open, None
        st_ = self.peek_state(feedback.context.request_id)
        rec.update(side_logits=None if feedback.side_logits is None else feedback.side_logits.clone(),
                   committed=list(feedback.committed), levels_after=[list(l) for l in st_.levels],
                   pool=len(st_.pool), max_bucket=max_bucket(st_.pool))
        self.steps.append(rec)


def ctx(tokens, prompt_length=None, request_id=1) -> Context:
    tokens = tuple(int(t) for t in tokens)
    return Context(tokens, len(tokens) if prompt_length is None else prompt_length, request_id)


def logits_with_argmax(tokens) -> torch.Tensor:
    out = torch.zeros(len(tokens), VOCAB)
    out[torch.arange(len(tokens)), torch.as_tensor(tokens)] = 1.0
    return out


# -- Figure 2b ---------------------------------------------------------------------------------------

# W=5, N=4, G=2, in the decoder's layout: root, the verification branch (two 4-grams starting with
# the root: three tokens each), then the lookahead branch level by level: orange (oldest, offsets
# 1-4), green (offsets 1-5), red (offsets 2-6). Copied from the paper's figure, row = query.
FIGURE_2B = """
        r  a1 a2 a3 b1 b2 b3 o1 o2 o3 o4 g1 g2 g3 g4 g5 R2 R3 R4 R5 R6
   r    1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   a1   1  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   a2   1  1  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   a3   1  1  1  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   b1   1  .  .  .  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   b2   1  .  .  .  1  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   b3   1  .  .  .  1  1  1  .  .  .  .  .  .  .  .  .  .  .  .  .  .
   o1   1  .  .  .  .  .  .  1  .  .  .  .  .  .  .  .  .  .  .  .  .
   o2   1  .  .  .  .  .  .  1  1  .  .  .  .  .  .  .  .  .  .  .  .
   o3   1  .  .  .  .  .  .  1  1  1  .  .  .  .  .  .  .  .  .  .  .
   o4   1  .  .  .  .  .  .  1  1  1  1  .  .  .  .  .  .  .  .  .  .
   g1   1  .  .  .  .  .  .  .  .  .  .  1  .  .  .  .  .  .  .  .  .
   g2   1  .  .  .  .  .  .  1  .  .  .  .  1  .  .  .  .  .  .  .  .
   g3   1  .  .  .  .  .  .  1  1  .  .  .  .  1  .  .  .  .  .  .  .
   g4   1  .  .  .  .  .  .  1  1  1  .  .  .  .  1  .  .  .  .  .  .
   g5   1  .  .  .  .  .  .  1  1  1  1  .  .  .  .  1  .  .  .  .  .
   R2   1  .  .  .  .  .  .  .  .  .  .  1  .  .  .  .  1  .  .  .  .
   R3   1  .  .  .  .  .  .  1  .  .  .  .  1  .  .  .  .  1  .  .  .
   R4   1  .  .  .  .  .  .  1  1  .  .  .  .  1  .  .  .  .  1  .  .
   R5   1  .  .  .  .  .  .  1  1  1  .  .  .  .  1  .  .  .  .  1  .
   R6   1  .  .  .  .  .  .  1  1  1  1  .  .  .  .  1  .  .  .  .  1
"""
FIGURE_2B_POSITIONS = [0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6]


def parse_figure(text: str) -> np.ndarray:
    rows = [line.split()[1:] for line in text.strip().splitlines()[1:]]
    return np.array([[c == "1" for c in row] for row in rows], dtype=bool)


def full_window_source(root=7, W=5, N=4, G=2):
    """A JacobiLookahead whose request 1 has a full window and two pool n-grams for ``root``."""
    src = JacobiLookahead(window=W, ngram=N, max_candidates=G, prompt_as_reference=False)
    src.begin(ctx([3, 4, 5, root]))
    st_ = src.peek_state(1)
    st_.levels = [[11 + k for k in range(W - 1)]] + [[20 + 10 * l + i for i in range(W)] for l in range(N - 2)]
    st_.generated = [[True] * len(l) for l in st_.levels]
    st_.pool.add(root, [60, 61, 62][: N - 1])
    st_.pool.add(root, [70, 71, 72][: N - 1])
    return src


def test_step_mask_is_figure_2b() -> None:
    src = full_window_source()
    draft = src.propose(ctx([3, 4, 5, 7]), budget=32)
    assert draft.branches == [[70, 71, 72], [60, 61, 62]]  # most recently generated first
    tree = TokenTree(7)  # the figure lays the branches out one after the other (the merge orders by value)
    for branch in draft.branches:
        add_branch(tree, branch)
    rows = tree_rows(tree, [draft.side_block])
    tokens, offsets, block, slices = rows.tokens, rows.offsets, rows.block, rows.side_slices
    assert tokens == [7, 70, 71, 72, 60, 61, 62, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34]
    assert offsets.tolist() == FIGURE_2B_POSITIONS
    np.testing.assert_array_equal(block, parse_figure(FIGURE_2B))
    assert slices == [slice(7, 21)]  # the side block takes rows 7..20, right after the tree


def test_window_side_block_while_filling() -> None:
    # first step: level 0 alone, W + N - 3 tokens, a causal run at offsets 1..
    b = window_side_block([[5, 6, 7]])
    assert b.positions == [1, 2, 3] and b.sees_root
    np.testing.assert_array_equal(b.mask, np.tril(np.ones((3, 3), dtype=bool)))
    # one level filled: level 1 has one column more than level 0
    b = window_side_block([[5, 6], [8, 9, 10]])
    assert b.positions == [1, 2, 1, 2, 3]
    np.testing.assert_array_equal(b.mask.astype(int), np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]))
    with pytest.raises(ValueError, match="level 1"):
        window_side_block([[5, 6], [8, 9]])


# -- the window's logits -----------------------------------------------------------------------------


def visible_path(side, j: int) -> list[int]:
    """The side tokens side token j sees, in position order; they must sit at offsets 1..p."""
    seen = np.flatnonzero(side.mask[j])
    order = sorted(seen, key=lambda k: side.positions[k])
    assert [side.positions[k] for k in order] == list(range(1, side.positions[j] + 1)), \
        f"side token {j} does not see a contiguous run 1..{side.positions[j]}"
    assert order[-1] == j
    return [side.tokens[k] for k in order]


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("mistral", "sdpa"), ("gpt2", "eager"), ("gemma3", "sdpa")],
                         ids=lambda c: f"{c[0]}-{c[1]}")
def test_window_logits_equal_separate_sequences(case) -> None:
    """Each window token's logits are those of committed + its own trajectory run alone, and the
    window moves by Algorithm 1: the newest level is the argmax of the previous newest level."""
    model = tiny_model(*case)
    prompt = np.random.default_rng(5).integers(3, VOCAB, size=14).tolist()
    src = Recording(window=4, ngram=4, max_candidates=2, prompt_as_reference=False)
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 8)
        out = Decoder(model, sources=[src, PromptLookup()], max_tree_nodes=8, adaptive_budget=False).generate(
            prompt, max_new_tokens=8)
    assert out.token_ids == ref
    assert len(src.steps) == out.stats.steps - 1 >= 4  # every step but the prefill's runs the window
    checked = 0
    for rec in src.steps:
        side, logits = rec["side"], rec["side_logits"]
        assert logits.shape == (len(side.tokens), VOCAB)
        for j in range(len(side.tokens)):
            expected = full_logits(model, rec["context"] + visible_path(side, j))[-1]
            assert_float32_logits_match(logits[j], expected, model)
            checked += 1
        newest = len(rec["levels_before"][-1])
        produced = torch.argmax(logits[-newest:], dim=-1).tolist()
        if len(rec["levels_before"]) == 1:  # first fill step: the new level is every argmax
            assert rec["levels_after"][-1] == produced
        elif len(rec["levels_before"]) < 3:  # filling: one column dropped
            assert rec["levels_after"][-1] == produced[1:]
        else:  # full: advance="one" keeps every column
            assert rec["levels_after"][-1] == produced
    assert checked > 30


# -- bookkeeping (no model) --------------------------------------------------------------------------


def test_initial_fill_and_steady_shift() -> None:
    W, N = 4, 4
    prompt = [3, 4, 5, 6, 7, 8, 9]
    src = JacobiLookahead(window=W, ngram=N, max_candidates=3, prompt_as_reference=False)
    c = ctx(prompt)
    src.begin(c)
    st_ = src.peek_state(1)
    assert len(st_.levels) == 1 and len(st_.levels[0]) == W + N - 3
    assert set(st_.levels[0]) <= set(prompt)  # random tokens of the prompt (Algorithm 1, L4)
    assert len(st_.pool) == 0
    tokens = list(prompt)
    # step 1: level 0 only; the new level is every argmax, level 0 drops its first column
    l0 = list(st_.levels[0])
    d = src.propose(ctx(tokens), 16)
    assert d.branches == [] and d.side_block.tokens == l0
    new = [40, 41, 42, 43, 44]
    tokens.append(50)
    src.observe(Feedback([50], ctx(tokens, len(prompt)), logits_with_argmax(new)))
    assert st_.levels == [l0[1:], new] and len(st_.pool) == 0
    # step 2: levels [4, 5]; the new level drops its first column, so does every other level
    d = src.propose(ctx(tokens), 16)
    assert d.side_block.tokens == l0[1:] + new
    new2 = [60, 61, 62, 63, 64]
    tokens.append(51)
    src.observe(Feedback([51], ctx(tokens, len(prompt)), torch.cat([torch.zeros(4, VOCAB), logits_with_argmax(new2)])))
    assert st_.levels == [l0[2:], new[1:], new2[1:]]
    assert [len(l) for l in st_.levels] == [W - 1, W, W] and len(st_.pool) == 0
    # step 3: full window. Column 0's n-gram starts with the root, column i's with level-0 token i-1
    levels = [list(l) for l in st_.levels]
    root = tokens[-1]
    d = src.propose(ctx(tokens), 16)
    assert len(d.side_block.tokens) == src.side_tokens == (W - 1) + W * (N - 2)
    new3 = [70, 71, 72, 73]
    tokens += [52, 53, 54]  # three tokens committed: advance="one" still moves one step
    src.observe(Feedback([52, 53, 54], ctx(tokens, len(prompt)),
                         torch.cat([torch.zeros(3 + 4, VOCAB), logits_with_argmax(new3)])))
    for i in range(W):
        key = root if i == 0 else levels[0][i - 1]
        assert (levels[1][i], levels[2][i], new3[i]) in st_.pool.get(key)
    assert len(st_.pool) == W
    assert st_.levels == [levels[1][1:], levels[2], new3]  # Algorithm 1: oldest level out, new level in
    # the pool answers with n-grams starting with the root
    st_.pool.add(54, [1, 2, 3])
    assert src.propose(ctx(tokens), 16).branches[0] == [1, 2, 3]
    src.end(ctx(tokens))
    assert src.peek_state(1) is None


def test_advance_committed_drops_columns_and_refills() -> None:
    W, N = 5, 4
    src = full_window_source(root=7, W=W, N=N)
    src.advance = "committed"
    st_ = src.peek_state(1)
    before = [list(l) for l in st_.levels]
    src.propose(ctx([3, 4, 5, 7]), 16)
    new = [45, 46, 47, 48, 49]
    tokens = [3, 4, 5, 7, 9, 9, 9]  # three committed: two columns more than one step
    src.observe(Feedback([9, 9, 9], ctx(tokens, 4), torch.cat([torch.zeros(4 + 5, VOCAB), logits_with_argmax(new)])))
    assert [len(l) for l in st_.levels] == [W - 1, W, W]
    assert st_.levels[0][:2] == before[1][3:]
    assert st_.levels[1][:3] == before[2][2:]
    assert st_.levels[2][:3] == new[2:]
    for level in st_.levels:  # refills come from the context
        assert set(level[-2:]) <= set(tokens)
    assert st_.generated[1] == [True] * 3 + [False] * 2 and st_.generated[2] == [True] * 3 + [False] * 2
    # next step: refilled columns complete no n-gram (their trajectory is not the model's)
    pool_before = len(st_.pool)
    levels = [list(l) for l in st_.levels]
    src.propose(ctx(tokens), 16)
    new = [55, 56, 57, 58, 59]
    tokens.append(8)
    src.observe(Feedback([8], ctx(tokens, 4), torch.cat([torch.zeros(4 + 5, VOCAB), logits_with_argmax(new)])))
    assert len(st_.pool) == pool_before + 3
    assert (levels[1][4], levels[2][4], 59) not in st_.pool.get(levels[0][3])
    assert st_.generated[1] == [True] * 3 + [False] * 2 and st_.generated[2] == [True] * 5


def test_budget_zero_means_no_side_block_and_no_change() -> None:
    src = full_window_source()
    st_ = src.peek_state(1)
    levels = [list(l) for l in st_.levels]
    assert src.propose(ctx([3, 4, 5, 7]), 0).side_block is None
    src.observe(Feedback([8], ctx([3, 4, 5, 7, 8], 4), None))
    assert st_.levels == levels


def test_plain_steps_of_the_adaptive_budget_pause_the_window() -> None:
    """When the adaptive budget chooses a plain step the window is not run (it would cost width for
    nothing) and stays as it was; on the other steps it advances; output is exact throughout."""
    model = tiny_model("llama")
    prompt = np.random.default_rng(5).integers(3, VOCAB, size=16).tolist()
    src = Recording(window=4, ngram=3, max_candidates=2)
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 24)
        dec = Decoder(model, sources=[src], max_tree_nodes=8)
        dec.budget = AlternatingBudget(8, warmup=0)
        out = dec.generate(prompt, max_new_tokens=24)
    assert out.token_ids == ref
    paused = [r for r in src.steps if r["side_logits"] is None]
    ran = [r for r in src.steps if r["side_logits"] is not None]
    tree_steps = out.stats.steps - 1  # the prefill commits the first token, with no window
    assert len(paused) == tree_steps // 2 and len(ran) == tree_steps - len(paused)
    assert all(r["levels_after"] == r["levels_before"] for r in paused)
    assert any(r["levels_after"] != r["levels_before"] for r in ran)


def test_prompt_as_reference_seeds_the_pool() -> None:
    prompt = [3, 4, 5, 6, 3, 4, 9, 9]
    src = JacobiLookahead(window=2, ngram=3, max_candidates=4, prompt_as_reference=True)
    src.begin(ctx(prompt))
    pool = src.peek_state(1).pool
    assert pool.get(3) == [(4, 9), (4, 5)] and pool.get(9) == []
    assert src.propose(ctx(prompt[:-3] + [3]), 16).branches[:2] == [[4, 9], [4, 5]]
    # committed n-grams join the pool as they complete
    size = len(pool)
    src.propose(ctx(prompt), 16)
    src.observe(Feedback([9, 2], ctx(prompt + [9, 2], len(prompt)), None))  # context ... 4 9 9 | 9 2
    assert pool.get(9) == [(9, 2), (9, 9)] and len(pool) == size + 2
    off = JacobiLookahead(window=2, ngram=3, prompt_as_reference=False)
    off.begin(ctx(prompt))
    assert len(off.peek_state(1).pool) == 0


def test_pool_is_bounded_lru() -> None:
    pool = NGramPool(capacity=4, per_key=2)
    pool.add(1, [10, 11])
    pool.add(1, [12, 13])
    pool.add(1, [14, 15])  # per-key bound: (10, 11) goes
    assert pool.get(1) == [(14, 15), (12, 13)] and len(pool) == 2
    pool.add(2, [20, 21])
    pool.add(3, [30, 31])
    pool.add(1, [12, 13])  # re-adding refreshes
    pool.add(4, [40, 41])  # total bound: the least recently added, (1, (14, 15)), goes
    assert len(pool) == 4 and (14, 15) not in pool.get(1) and (12, 13) in pool.get(1)
    pool.add(5, [50, 51])
    assert pool.get(2) == [] and max_bucket(pool) == 1
    assert pool.get(1, limit=0) == []


def test_bad_parameters() -> None:
    for kwargs in (dict(window=0), dict(ngram=2), dict(max_candidates=0), dict(pool_size=0), dict(window=2.5),
                   dict(advance="two")):
        with pytest.raises(ValueError):
            JacobiLookahead(**kwargs)
    assert isinstance(JacobiLookahead(), DraftSource)


def test_pool_stays_bounded_over_a_long_generation() -> None:
    model = tiny_model("qwen2")
    prompt = np.random.default_rng(11).integers(3, VOCAB, size=20).tolist()
    src = Recording(window=5, ngram=3, max_candidates=2, pool_size=25)
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 160)
        dec = Decoder(model, sources=[src], max_tree_nodes=8, adaptive_budget=False)
        out = dec.generate(prompt, max_new_tokens=160)
    assert out.token_ids == ref
    sizes = [r["pool"] for r in src.steps]
    assert max(sizes) == 25 and sizes[-1] == 25  # it filled up and eviction kept it there
    assert max(r["max_bucket"] for r in src.steps) <= 2
    assert src.peek_state(1) is None and src.active_requests == 0  # end() dropped the request


# -- identity with plain decoding --------------------------------------------------------------------


IDENTITY_CASES = [("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("mistral", "eager"), ("phi", "sdpa"), ("gpt2", "sdpa"),
                  ("gemma3", "sdpa")]
CONFIGS = [(5, 4, 2), (1, 3, 2), (3, 3, 1), (4, 5, 3), (7, 3, 5)]


@pytest.mark.parametrize("case", IDENTITY_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_greedy_identity_alone(case) -> None:
    model = tiny_model(*case)
    rng = np.random.default_rng(len(case[0]))
    pattern = rng.integers(3, VOCAB, size=5).tolist()
    prompts = [rng.integers(3, VOCAB, size=9).tolist(), pattern * 3 + [pattern[0]]]
    for i, (W, N, G) in enumerate(CONFIGS):
        prompt = prompts[i % 2]
        ref = reference_greedy(model, prompt, 24)
        src = JacobiLookahead(window=W, ngram=N, max_candidates=G, prompt_as_reference=bool(i % 2),
                              advance="committed" if i == 2 else "one")
        out = Decoder(model, sources=[src], max_tree_nodes=12, adaptive_budget=bool(i % 2)).generate(
            prompt, max_new_tokens=24)
        assert out.token_ids == ref, (W, N, G)
        assert out.stats.per_source["jacobi"].proposed >= 0


@FAST
@given(data=st.data())
def test_greedy_identity_mixed(data) -> None:
    arch = data.draw(st.sampled_from(["llama", "qwen2", "gpt2", "mistral"]))
    model = tiny_model(arch)
    kind = data.draw(st.sampled_from(["random", "repeat"]))
    if kind == "random":
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
    else:
        pattern = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        prompt = pattern * data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 20))
    W, N, G = data.draw(st.integers(1, 6)), data.draw(st.integers(3, 5)), data.draw(st.integers(1, 4))
    jac = JacobiLookahead(window=W, ngram=N, max_candidates=G, prompt_as_reference=data.draw(st.booleans()),
                          advance=data.draw(st.sampled_from(["one", "committed"])))
    ref = reference_greedy(model, prompt, n)
    others = [PromptLookup(), RandomGuess(seed=data.draw(st.integers(0, 99))),
              SideBlockToy(seed=3, mode="forest", branches=True), OracleSource(prompt + ref, decoy=True)]
    others += [FrequencyTrie(), MultiLevelNGram()]
    chosen = data.draw(st.lists(st.sampled_from(range(len(others))), unique=True, max_size=3))
    sources = [jac] + [others[k] for k in chosen]
    order = data.draw(st.permutations(range(len(sources))))
    budget = data.draw(st.sampled_from([0, 1, 3, 8, 24]))
    dec = Decoder(model, sources=[sources[k] for k in order], max_tree_nodes=budget,
                  adaptive_budget=data.draw(st.booleans()))
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == ref


def test_greedy_identity_with_the_other_library_sources() -> None:
    others = [FrequencyTrie(), MultiLevelNGram()]
    model = tiny_model("llama")
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    ref = reference_greedy(model, prompt, 30)
    out = Decoder(model, sources=[JacobiLookahead(), PromptLookup(), *others]).generate(prompt, max_new_tokens=30)
    assert out.token_ids == ref


def test_same_random_stream_gives_the_same_sample_as_model_generate() -> None:
    """Sampling: fed the same random stream, Decoder with lookahead draws exactly model.generate's
    tokens (one draw per committed token, whatever the drafts were)."""
    model = tiny_model("gpt2")
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]
    options = dict(temperature=0.5, top_k=5)
    dec = Decoder(model, sources=[JacobiLookahead(window=4, ngram=3, max_candidates=3)], max_tree_nodes=12,
                  adaptive_budget=False)
    accepted = []
    for s in range(6):
        torch.manual_seed(s)
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=True,
                             **options)[0, len(prompt):].tolist()
        torch.manual_seed(s)
        out = dec.generate(prompt, max_new_tokens=30, do_sample=True, seed=None, **options)
        assert out.token_ids == ref, s
        accepted.append(out.stats.mean_accepted)
    assert np.mean(accepted) > 1.2  # the drafts were really exercised


def test_lookahead_branch_alone_finds_accepted_ngrams() -> None:
    """Without the prompt in the pool, everything accepted came from the Jacobi trajectory."""
    model = tiny_model("gpt2")
    prompt = np.random.default_rng(0).integers(3, VOCAB, size=15).tolist()
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 60)
        src = JacobiLookahead(window=5, ngram=4, max_candidates=2, prompt_as_reference=False)
        out = Decoder(model, sources=[src], max_tree_nodes=16, adaptive_budget=False).generate(
            prompt, max_new_tokens=60)
    assert out.token_ids == ref
    assert out.stats.per_source["jacobi"].accepted > 0 and out.stats.mean_accepted > 1.0


def test_window_near_the_end_of_the_context() -> None:
    """Where the window would reach past the model's context the decoder drops it for the step
    (side_logits=None): the window waits, decoding goes on to the last position."""
    model = tiny_model("llama", max_position_embeddings=32)
    prompt = list(range(3, 23))
    ref = reference_greedy(model, prompt, 12)
    src = Recording(window=5, ngram=4, max_candidates=2)
    out = Decoder(model, sources=[src], adaptive_budget=False).generate(prompt, max_new_tokens=12)
    assert out.token_ids == ref
    dropped = [r for r in src.steps if r["side_logits"] is None]
    assert dropped and all(r["levels_after"] == r["levels_before"] for r in dropped)
