"""The model side: tree logits, cache compaction, side blocks, masks, refused attention backends.

The oracle everywhere is a fresh, cache-free forward of the plain token sequence through the stock
model, with the model's own masks (including its own sliding windows).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache

from specdraft import Decoder, Draft, PromptLookup, SideBlock
from specdraft.model.compat import cache_keyword
from specdraft.model.runner import ModelRunner, UnsupportedModelError
from specdraft.tree import TokenTree

from conftest import (FAST, SLIDING_WINDOW, VOCAB, AlternatingBudget, OneSequence, OracleSource, RandomGuess,
                      SideBlockToy, _config, assert_float32_logits_match, check_side_records, full_logits, generation_config_override,
                      reference_greedy, tiny_model)

pytestmark = pytest.mark.usefixtures("single_thread")

RUNNER_CASES = [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2_swa", "sdpa"), ("mistral", "sdpa"), ("phi", "sdpa"),
                ("gpt2", "sdpa"), ("gemma3", "sdpa"), ("llama", "eager"), ("mistral", "eager"),
                ("gemma3", "eager"), ("gpt2", "eager")]


def _ids(case):
    return f"{case[0]}-{case[1]}"


@torch.inference_mode()
def fresh_cache(model, tokens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = DynamicCache()
    model(input_ids=torch.tensor([list(tokens)]), use_cache=True, **{cache_keyword(model): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


def assert_cache_matches(model, runner: OneSequence, tokens) -> None:
    """The runner's cache holds exactly the keys/values of a fresh forward of ``tokens`` (float64)."""
    eager = model.config._attn_implementation == "eager"
    tol = dict(rtol=1e-5, atol=1e-6) if eager else dict(rtol=1e-10, atol=1e-10)
    assert runner.cache_len == len(tokens)
    expected = fresh_cache(model, tokens)
    got = runner.cache
    assert len(got) == len(expected)
    for (k, v), (ek, ev) in zip(got, expected):
        assert k.shape == ek.shape and v.shape == ev.shape
        assert k.dtype == torch.float64
        torch.testing.assert_close(k, ek, **tol)
        torch.testing.assert_close(v, ev, **tol)


def random_tree(rng: np.random.Generator, root: int, n_branches: int, max_depth: int, max_nodes: int) -> TokenTree:
    trunk = rng.integers(0, VOCAB, size=max_depth).tolist()
    branches = []
    for _ in range(n_branches):
        share = int(rng.integers(0, max_depth))
        tail = rng.integers(0, VOCAB, size=int(rng.integers(1, max_depth + 1))).tolist()
        branches.append((trunk[:share] + tail)[:max_depth])
    return TokenTree.from_drafts(root, [branches], max_nodes)


def check_tree_logits(model, prefix: list[int], tree: TokenTree, logits: torch.Tensor) -> None:
    """Row i of ``logits`` must be the model's prediction after prefix + path to node i."""
    assert logits.dtype == torch.float32 and logits.shape[0] >= len(tree)
    done: set[int] = set()
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    for leaf in leaves:
        path = tree.path_to(leaf)
        ref = full_logits(model, prefix + [tree.tokens[j] for j in path])
        for d, node in enumerate([0] + path):
            if node in done:
                continue
            assert_float32_logits_match(logits[node], ref[len(prefix) - 1 + d], model)
            done.add(node)
    assert done == set(range(len(tree)))


# -- tree logits & compaction ---------------------------------------------------------------------


@pytest.mark.parametrize("case", RUNNER_CASES, ids=_ids)
def test_tree_logits_equal_per_branch_logits(case) -> None:
    model = tiny_model(*case)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB, size=14).tolist()  # longer than every sliding window
    runner = OneSequence(model)
    runner.prefill(prompt[:-1])
    assert runner.cache_len == len(prompt) - 1
    tree = random_tree(rng, prompt[-1], n_branches=5, max_depth=6, max_nodes=20)
    assert len(tree.branches()) >= 3
    logits = runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask())
    assert runner.cache_len == len(prompt) - 1 + len(tree)
    check_tree_logits(model, prompt, tree, logits)


@pytest.mark.parametrize("case", RUNNER_CASES, ids=_ids)
def test_compaction_invariant_over_several_steps(case) -> None:
    """Prefill, then steps of tree forward + compact(root + a path); each time the cache must equal a
    fresh forward of the accepted sequence and the next logits a fresh forward's logits. Kept paths
    are non-contiguous (a later branch), contiguous (the first branch), empty and partial."""
    model = tiny_model(*case)
    rng = np.random.default_rng(5)
    seq = rng.integers(0, VOCAB, size=9).tolist()
    runner = OneSequence(model)
    runner.prefill(seq[:-1])
    for step, choose in enumerate(["last_leaf", "first_branch", "root_only", "middle", "last_leaf", "last_leaf"]):
        tree = random_tree(rng, seq[-1], n_branches=4, max_depth=5, max_nodes=14)
        logits = runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask())
        check_tree_logits(model, seq, tree, logits)
        if choose == "last_leaf":
            path = tree.path_to(len(tree) - 1)
        elif choose == "first_branch":
            path = tree.path_to(tree.children(0)[0])
            while tree.children(path[-1]):
                path.append(tree.children(path[-1])[0])
        elif choose == "root_only":
            path = []
        else:
            node = int(rng.integers(1, len(tree)))
            path = tree.path_to(node)[:-1] or tree.path_to(node)
        if choose == "last_leaf" and len(tree.branches()) > 1:
            assert path != list(range(1, len(path) + 1)), "expected a non-contiguous keep"
        runner.compact([0] + path)
        seq = seq + [tree.tokens[j] for j in path]
        assert_cache_matches(model, runner, seq)
        seq.append(int(rng.integers(0, VOCAB)))  # the next root (the bonus token)
    # a lone root over the compacted cache (the maskless path for full-attention models)
    logits = runner.forward([seq[-1]], np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool))
    assert_float32_logits_match(logits[0], full_logits(model, seq)[-1], model)
    assert len(seq) > 3 * max(SLIDING_WINDOW.values())


@settings(FAST, max_examples=30)
@given(data=st.data(), case=st.sampled_from(RUNNER_CASES), prompt_len=st.integers(1, 20),
       steps=st.integers(1, 4))
def test_compaction_property(data, case, prompt_len, steps) -> None:
    model = tiny_model(*case)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    seq = rng.integers(0, VOCAB, size=prompt_len).tolist()
    runner = OneSequence(model)
    runner.prefill(seq[:-1])
    for _ in range(steps):
        tree = random_tree(rng, seq[-1], n_branches=int(rng.integers(0, 5)), max_depth=int(rng.integers(1, 7)),
                           max_nodes=data.draw(st.integers(0, 16), label="budget"))
        logits = runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask())
        check_tree_logits(model, seq, tree, logits)
        node = data.draw(st.integers(0, len(tree) - 1), label="keep node")
        path = tree.path_to(node)
        runner.compact([0] + path)
        seq = seq + [tree.tokens[j] for j in path] + [int(rng.integers(0, VOCAB))]
    assert_cache_matches(model, runner, seq[:-1])
    logits = runner.forward([seq[-1]], np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool))
    assert_float32_logits_match(logits[0], full_logits(model, seq)[-1], model)


def test_prefill_of_nothing_then_forward() -> None:
    for arch in ("llama", "gemma3"):
        model = tiny_model(arch)
        runner = OneSequence(model)
        runner.prefill([])
        assert runner.cache_len == 0
        tree = TokenTree.from_drafts(7, [[[3, 4], [5]]], 10)
        logits = runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask())
        check_tree_logits(model, [7], tree, logits)


def test_compact_rejects_bad_keep() -> None:
    runner = OneSequence(tiny_model("llama"))
    runner.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="keep"):
        runner.compact([0])  # a prompt is committed whole by its prefill: no row of it is pending
    assert runner.cache_len == 3
    runner.forward([4, 5], np.array([0, 1]), np.tril(np.ones((2, 2), dtype=bool)))
    with pytest.raises(ValueError, match="keep"):
        runner.compact([0, 2])
    with pytest.raises(ValueError, match="keep"):
        runner.compact([-1])
    runner.compact([0, 1])
    assert runner.cache_len == 5


def test_forward_past_the_context_raises() -> None:
    model = tiny_model("llama", max_position_embeddings=16)
    runner = OneSequence(model)
    runner.prefill(list(range(3, 17)))  # 14 tokens: positions 0..13
    runner.forward([1, 2], np.array([0, 1]), np.tril(np.ones((2, 2), dtype=bool)))  # positions 14, 15
    runner.compact([0, 1])
    with pytest.raises(ValueError, match="16"):
        runner.forward([1], np.array([0]), np.ones((1, 1), dtype=bool))


# -- side blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", RUNNER_CASES, ids=_ids)
@pytest.mark.parametrize("mode", ["chain", "forest"])
def test_side_block_logits(case, mode) -> None:
    """Side token j's logits equal a fresh forward of committed + (path to j), and the side block
    changes nothing about the output, alone or next to tree drafts."""
    model = tiny_model(*case)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, VOCAB, size=12).tolist()
    prompt = prompt + prompt[:5]
    ref = reference_greedy(model, prompt, 14)
    side = SideBlockToy(seed=4, mode=mode, max_side=5, branches=True)
    dec = Decoder(model, sources=[PromptLookup(), side, RandomGuess(2)], max_tree_nodes=10, adaptive_budget=False)
    out = dec.generate(prompt, max_new_tokens=14)
    assert out.token_ids == ref
    tree_steps = out.stats.steps - 1  # the prefill commits the first token, with no tree and no side block
    assert len(side.records) == tree_steps and side.dropped == 0  # a fixed budget runs the block every tree step
    checked = check_side_records(model, side.records)
    assert checked >= tree_steps
    # with the adaptive budget a plain step (0 nodes) leaves the side block out: its source gets
    # side_logits=None; the other steps' side logits are still right
    side_a = SideBlockToy(seed=5, mode=mode, max_side=5, branches=True)
    dec_a = Decoder(model, sources=[PromptLookup(), side_a, RandomGuess(2)], max_tree_nodes=10)
    dec_a.budget = AlternatingBudget(10, warmup=0)
    out_a = dec_a.generate(prompt, max_new_tokens=14)
    assert out_a.token_ids == ref
    tree_steps_a = out_a.stats.steps - 1
    assert side_a.dropped == tree_steps_a // 2 and len(side_a.records) == tree_steps_a - side_a.dropped
    check_side_records(model, side_a.records)
    # a side block in a decoder without any tree (max_tree_nodes=0) still works
    side0 = SideBlockToy(seed=9, mode=mode, max_side=3)
    out0 = Decoder(model, sources=[side0], max_tree_nodes=0).generate(prompt, max_new_tokens=5)
    assert out0.token_ids == ref[:5]
    check_side_records(model, side0.records)


@pytest.mark.parametrize("case", [("llama", "sdpa"), ("mistral", "sdpa"), ("gemma3", "eager")], ids=_ids)
def test_wild_side_blocks_do_not_disturb_the_tree(case) -> None:
    model = tiny_model(*case)
    prompt = [4, 5, 6, 7, 4, 5, 6, 8, 9, 4, 5]
    with generation_config_override(model, eos_token_id=None):
        ref = reference_greedy(model, prompt, 20)
        sources = [SideBlockToy(seed=s, mode="wild", name=f"w{s}") for s in range(3)]
        sources += [OracleSource(prompt + ref, decoy=True), PromptLookup()]
        assert Decoder(model, sources=sources, max_tree_nodes=6).generate(prompt, max_new_tokens=20).token_ids == ref


class BlindSide:
    """A legal side block whose only token attends to nothing in the block and not to the root."""

    name = "blind"

    def __init__(self, position: int = 1) -> None:
        self.position = position

    def begin(self, context) -> None:
        pass

    def end(self, context) -> None:
        pass

    def observe(self, feedback) -> None:
        pass

    def propose(self, context, budget):
        return Draft(side_block=SideBlock(tokens=[3], positions=[self.position], mask=np.zeros((1, 1), dtype=bool),
                                          sees_root=False))


@pytest.mark.parametrize("arch, prompt, position", [("llama", [5], 1), ("mistral", list(range(3, 23)), 30)])
def test_side_token_that_sees_nothing_does_not_corrupt_the_tree(arch, prompt, position) -> None:
    model = tiny_model(arch, "eager")
    ref = reference_greedy(model, prompt, 6)
    out = Decoder(model, sources=[BlindSide(position), PromptLookup()]).generate(prompt, max_new_tokens=6)
    assert out.token_ids == ref


@pytest.mark.parametrize("arch, prompt, position", [("llama", [5], 1), ("mistral", list(range(3, 23)), 30)])
def test_side_token_that_sees_nothing_is_harmless_under_sdpa(arch, prompt, position) -> None:
    model = tiny_model(arch, "sdpa")
    ref = reference_greedy(model, prompt, 6)
    assert Decoder(model, sources=[BlindSide(position), PromptLookup()]).generate(prompt, max_new_tokens=6).token_ids == ref


def test_side_block_near_the_end_of_the_context() -> None:
    model = tiny_model("llama", max_position_embeddings=32)
    prompt = list(range(3, 23))
    ref = reference_greedy(model, prompt, 12)
    toy = SideBlockToy(seed=0, mode="chain", max_side=4)
    out = Decoder(model, sources=[toy]).generate(prompt, max_new_tokens=12)
    assert out.token_ids == ref
    assert toy.dropped > 0  # the side blocks that would pass position 31 were dropped, not run
    assert toy.records  # the others were answered


# -- masks handed to the model -------------------------------------------------------------------------


def capture_masks(model, fn):
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        fn()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen2_swa", "gpt2"])
@pytest.mark.parametrize("attn, kind", [("sdpa", "bool"), ("eager", "additive")])
def test_mask_kind(arch, attn, kind) -> None:
    model = tiny_model(arch, attn)
    runner = OneSequence(model)
    assert runner.mask_kind == kind
    runner.prefill(list(range(3, 15)))
    tree = TokenTree.from_drafts(4, [[[5, 6, 7], [8]]], 10)
    masks = capture_masks(model, lambda: runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask()))
    assert len(masks) == 1
    mask = masks[0]
    text = model.config
    if getattr(text, "layer_types", None):
        assert isinstance(mask, dict) and set(mask) == set(text.layer_types)
        parts = mask
    else:
        assert isinstance(mask, torch.Tensor)
        parts = {"": mask}
    P, q = 12, len(tree)
    allowed = np.concatenate([np.ones((q, P), dtype=bool), tree.ancestor_mask()], axis=1)
    q_pos = P + tree.position_offsets()
    k_pos = np.concatenate([np.arange(P), q_pos])
    for layer_type, m in parts.items():
        assert m.shape == (1, 1, q, P + q)
        if kind == "bool":
            assert m.dtype == torch.bool
            visible = m[0, 0].numpy()
        else:
            assert m.dtype == model.dtype
            values = set(torch.unique(m).tolist())
            assert values <= {0.0, torch.finfo(model.dtype).min}
            visible = (m[0, 0] == 0).numpy()
        window = SLIDING_WINDOW.get(arch) if layer_type in ("", "sliding_attention") else None
        expected = allowed & ((q_pos[:, None] - k_pos[None, :]) < window) if window else allowed
        np.testing.assert_array_equal(visible, expected)
        if window:
            assert not expected.all()  # the window actually cuts something here


def test_lone_root_without_window_uses_the_models_own_mask() -> None:
    model = tiny_model("llama")
    runner = OneSequence(model)
    runner.prefill([3, 4, 5])
    masks = capture_masks(model, lambda: runner.forward([6], np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=bool)))
    assert masks == [None]


# -- refused attention implementations --------------------------------------------------------------------


def _fresh_llama(attn: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(_config("llama", {}), attn_implementation=attn,
                                                dtype=torch.float64).eval()


def test_flex_attention_is_refused_by_the_runner_and_switched_by_the_decoder() -> None:
    try:
        model = _fresh_llama("flex_attention")
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention model cannot be built here: {exc}")
    with pytest.raises(UnsupportedModelError, match="flex_attention") as info:
        ModelRunner(model)
    assert "sdpa" in str(info.value) and "eager" in str(info.value)
    # Decoder(attention="auto") runs such a model on sdpa for its calls (public set_attn_implementation)
    # and is exact; outside them the model keeps its own implementation
    dec = Decoder(model, sources=[PromptLookup()])
    assert dec.attention == "sdpa" and model.config._attn_implementation == "flex_attention"
    prompt = [4, 5, 6, 4, 5]
    out = dec.generate(prompt, max_new_tokens=10).token_ids
    assert model.config._attn_implementation == "flex_attention"
    model.set_attn_implementation("sdpa")
    assert out == reference_greedy(model, prompt, 10)


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "paged_attention", "something_else"])
def test_other_attention_implementations_are_refused(impl) -> None:
    model = _fresh_llama("sdpa")
    model.config._attn_implementation = impl
    assert model.config._attn_implementation == impl
    with pytest.raises(UnsupportedModelError, match=impl) as info:
        ModelRunner(model)
    assert "attn_implementation" in str(info.value)


def test_unknown_attention_choice() -> None:
    with pytest.raises(ValueError, match="attention must be one of") as info:
        Decoder(tiny_model("llama"), attention="flash_attention_2")
    assert "flash_attention_2" in str(info.value)
