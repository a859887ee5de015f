"""Exact mode's building blocks, on models run by hand (no decoder): every row of a padded forward
over the exact attention is bit for bit the row a padded plain one-token step gives.

The models are random Llamas wide enough to show the effect the blocks remove (hidden 896, MLP
4864: on an AVX-512 CPU a bfloat16 one-row forward sums the 4864-long products in another order
than a wider one), with Qwen2.5-0.5B's head layout (14 query heads sharing 2 key/value heads of
64), two layers and a 512-token vocabulary.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import pytest
import torch
from torch import nn
from transformers import DynamicCache

from conftest import AttentionModule, ancestor_block, check_exact_attention_matches_sdpa, exact_attend, random_tree, wide_llama
from specdraft.model.compat import cache_keyword
from specdraft.model.exact_attention import (CHUNK, EXACT_NAME, ExactAttentionError, exact_attention,
                                       register_exact_backend)
from specdraft.kernels.exact_rows import (ExactRowsError, RowRule, agreeing_widths, invariant_from, linear_layers,
                                          norm_layers, pad_block, probe_rule, row_layers, width_classes)

PROMPT = 70  # cache length before a tree: more than one attention chunk
WIDEST = 64


@functools.lru_cache(maxsize=None)
def wide_model(dtype: torch.dtype):
    """The random 896-wide Llama of issue 43, in ``dtype``, on the exact attention."""
    return wide_llama(dtype, register_exact_backend())


def _depths(parents: Sequence[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


@torch.inference_mode()
def _forward(model, cache: DynamicCache, tokens: Sequence[int], positions: Sequence[int],
             allowed: np.ndarray) -> torch.Tensor:
    """One forward of ``tokens`` over ``cache`` with the ``[q, cache + q]`` bool mask ``allowed``;
    the new rows' keys and values are appended to the cache. Returns float32 logits ``[q, vocab]``."""
    q = len(tokens)
    out = model(input_ids=torch.tensor([list(tokens)]), position_ids=torch.tensor([list(positions)]),
                attention_mask=torch.from_numpy(allowed)[None, None], use_cache=True,
                **{cache_keyword(model): cache})
    assert out.logits.shape[1] == q
    return out.logits[0].float()


def _step(model, cache: DynamicCache, tokens: Sequence[int], offsets: Sequence[int], block: np.ndarray,
          rule: RowRule) -> torch.Tensor:
    """A decode forward as exact mode runs it: ``len(tokens)`` rows padded by ``rule``; every row
    sees the whole cache and its part of ``block``. Leaves the real rows' keys in the cache, then
    the pad rows'. Returns the real rows' logits."""
    k = len(tokens)
    length = cache.get_seq_length()
    tokens, offsets, padded = pad_block(tokens, np.asarray(offsets), block, rule.rows_for(k))
    rows = len(tokens)
    allowed = np.concatenate([np.ones((rows, length), dtype=bool), padded], axis=1)
    return _forward(model, cache, tokens, [length + int(o) for o in offsets], allowed)[:k]


def _truncate(cache: DynamicCache, length: int) -> None:
    """Drop the cache's entries past ``length``."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _prefilled(model, prompt: Sequence[int]) -> DynamicCache:
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([list(prompt)]), use_cache=True, **{cache_keyword(model): cache})
    return cache


def _plain_walks(model, prompt: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
                 rule: RowRule) -> list[torch.Tensor]:
    """Per tree node, the logits of a plain one-token step (padded by ``rule``) at the end of the
    node's path: a depth-first walk that feeds each node once on top of its parent's path."""
    cache = _prefilled(model, prompt)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    logits: dict[int, torch.Tensor] = {}

    def visit(node: int) -> None:
        length = cache.get_seq_length()
        logits[node] = _step(model, cache, [tokens[node]], [0], np.ones((1, 1), dtype=bool), rule)[0]
        _truncate(cache, length + 1)  # keep the real row, drop the pad rows
        for child in children.get(node, []):
            visit(child)
        _truncate(cache, length)

    visit(0)
    return [logits[i] for i in range(len(tokens))]


def _rule(model) -> RowRule:
    return probe_rule(linear_layers(model), next(model.parameters()).dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_tree_width_gives_the_plain_step_rows(dtype: torch.dtype) -> None:
    """The row test: for trees of 1..64 nodes over a cache, every node's logits equal those of a
    plain one-token step at the end of its path, bit for bit (both padded by the probed rule)."""
    model = wide_model(dtype)
    rule = _rule(model)
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 512, PROMPT).tolist()
    parents = random_tree(WIDEST, seed=11)
    tokens = rng.integers(3, 512, WIDEST).tolist()
    reference = _plain_walks(model, prompt, tokens, parents, rule)
    depth = _depths(parents)
    cache = _prefilled(model, prompt)
    bad = []
    for k in range(1, WIDEST + 1):
        logits = _step(model, cache, tokens[:k], depth[:k], ancestor_block(parents[:k]), rule)
        _truncate(cache, PROMPT)
        bad += [(k, i) for i in range(k) if not torch.equal(logits[i], reference[i])]
    assert not bad, f"(width, row) pairs whose logits differ from the plain step's: {bad[:10]} ({len(bad)} in all)"


def test_rows_do_not_depend_on_other_requests_in_a_packed_forward() -> None:
    """Two requests' trees in one forward over one cache buffer (request B's region after a gap
    behind request A's, as in a packed batch): each row equals the plain step of its own request."""
    model = wide_model(torch.bfloat16)
    rule = _rule(model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, n).tolist() for n in (PROMPT, 45)]
    trees = [random_tree(n, seed) for n, seed in ((9, 5), (6, 8))]
    tokens = [rng.integers(3, 512, len(t)).tolist() for t in trees]
    reference = [_plain_walks(model, p, t, parents, rule) for p, t, parents in zip(prompts, tokens, trees)]

    caches = [_prefilled(model, p) for p in prompts]
    gap = 13  # free rows of request A's region
    buffer = DynamicCache()
    with torch.inference_mode():
        for layer in range(len(caches[0].layers)):
            a, b = caches[0].layers[layer], caches[1].layers[layer]
            junk_k = torch.randn(1, a.keys.shape[1], gap, a.keys.shape[3]).to(a.keys.dtype)
            buffer.update(torch.cat([a.keys, junk_k, b.keys], dim=2), torch.cat([a.values, junk_k, b.values], dim=2),
                          layer)
    starts = [0, len(prompts[0]) + gap]
    length = buffer.get_seq_length()
    rows = sum(len(t) for t in trees)
    width = rule.rows_for(rows)
    allowed = np.zeros((width, length + width), dtype=bool)
    ids, positions = [], []
    at = 0
    for r, (prompt, parents, toks) in enumerate(zip(prompts, trees, tokens)):
        n = len(parents)
        allowed[at : at + n, starts[r] : starts[r] + len(prompt)] = True
        allowed[at : at + n, length + at : length + at + n] = ancestor_block(parents)
        ids += toks
        positions += [len(prompt) + d for d in _depths(parents)]
        at += n
    for pad in range(rows, width):  # pad rows see only themselves
        allowed[pad, length + pad] = True
        ids.append(ids[-1])
        positions.append(positions[-1])
    logits = _forward(model, buffer, ids, positions, allowed)
    got = [logits[: len(trees[0])], logits[len(trees[0]) : rows]]
    for r in range(2):
        bad = [i for i in range(len(trees[r])) if not torch.equal(got[r][i], reference[r][i])]
        assert not bad, f"request {r}: rows {bad} differ from their plain steps"


def test_prefill_in_chunks_gives_the_same_cache() -> None:
    """A prompt prefilled in chunks of widths the rule covers, cut in two different ways (whole,
    where the rule covers its width), leaves the same keys and values, so exact mode does not
    depend on how a prompt was split. Which widths the rule covers depends on the CPU's kernels."""
    model = wide_model(torch.bfloat16)
    rule = _rule(model)

    def covered(width: int) -> bool:
        return rule.wider if width > rule.max_rows else rule.rows_for(width) == width

    sizes = [w for w in (30, 17, 2, 41) if covered(w)]
    while len(sizes) < 2:
        sizes.append(rule.max_rows)
    total = sum(sizes)
    other = [total] if covered(total) else sizes[::-1]
    prompt = np.random.default_rng(5).integers(3, 512, total).tolist()
    caches = []
    with torch.inference_mode():
        for chunks in (other, sizes):
            cache, at = DynamicCache(), 0
            for size in chunks:
                stop = at + size
                _forward(model, cache, prompt[at:stop], list(range(at, stop)),
                         np.tril(np.ones((size, stop), dtype=bool), k=at))
                at = stop
            caches.append(cache)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# -- the attention alone -----------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,dim,cache_len", [(14, 2, 64, 130), (4, 4, 8, 5), (6, 1, 16, 200)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_row_depends_only_on_its_visible_keys(heads: int, kv_heads: int, dim: int, cache_len: int,
                                                       threads: int) -> None:
    """Against single-row calls over the row's keys alone: any number of rows, interleaved masked
    keys, keys at another column offset, in float32, bfloat16 and float16, on 1 and 2 threads
    (grouped, multi-query and multi-head layouts, head sizes below the kernels' small-shape cut)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(heads * dim + cache_len)
            n = 24
            k = torch.randn(1, kv_heads, cache_len + n, dim, generator=gen).to(dtype)
            v = torch.randn(1, kv_heads, cache_len + n, dim, generator=gen).to(dtype)
            q = torch.randn(1, n, heads, dim, generator=gen).to(dtype).transpose(1, 2)
            block = ancestor_block(random_tree(n, seed=dim))
            allowed = np.concatenate([np.ones((n, cache_len), dtype=bool), block], axis=1)
            alone = []
            for r in range(n):
                cols = np.flatnonzero(allowed[r])
                alone.append(exact_attend(q[:, :, r : r + 1], k[:, :, cols], v[:, :, cols], None)[0])
            for m in (1, 2, 3, 5, 24):
                out = exact_attend(q[:, :, :m], k[:, :, : cache_len + m], v[:, :, : cache_len + m], allowed[:m, : cache_len + m])
                bad = [r for r in range(m) if not torch.equal(out[r], alone[r])]
                assert not bad, f"{dtype}, {m} rows: rows {bad} differ from their single-row results"
            shifted = torch.cat([torch.randn(1, kv_heads, 7, dim, generator=gen).to(dtype), k], dim=2)
            shifted_v = torch.cat([torch.randn(1, kv_heads, 7, dim, generator=gen).to(dtype), v], dim=2)
            mask = np.concatenate([np.zeros((n, 7), dtype=bool), allowed], axis=1)
            out = exact_attend(q, shifted, shifted_v, mask)
            assert all(torch.equal(out[r], alone[r]) for r in range(n)), f"{dtype}: a column offset changed rows"
    finally:
        torch.set_num_threads(saved)


def test_attention_matches_sdpa_to_rounding() -> None:
    """Same attention as transformers' sdpa up to float32 rounding (the order of additions differs)."""
    check_exact_attention_matches_sdpa()


def test_attention_edge_cases() -> None:
    """A row that sees nothing gets zeros; a row that sees more than a chunk past a gap is fine;
    unsupported features are refused by name."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k = torch.randn(1, 2, 2 * CHUNK + 5, 8, generator=gen)
    allowed = torch.ones(3, 2 * CHUNK + 5, dtype=torch.bool)
    allowed[0] = False
    allowed[2, 3:CHUNK] = False
    out = exact_attend(q, k, k, allowed)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    cols = allowed[2].nonzero()[:, 0]
    assert torch.equal(out[2], exact_attend(q[:, :, 2:3], k[:, :, cols], k[:, :, cols], None)[0])
    module = AttentionModule(2)
    with pytest.raises(ExactAttentionError, match="soft-capping"):
        exact_attention(module, q, k, k, None, softcap=30.0)
    with pytest.raises(ExactAttentionError, match="sinks"):
        exact_attention(module, q, k, k, None, s_aux=torch.zeros(4))
    with pytest.raises(ExactAttentionError, match="evenly"):
        exact_attention(module, torch.randn(1, 3, 1, 8), k, k, None)
    with pytest.raises(ExactAttentionError, match=r"\[batch, 1, q, kv\]"):
        exact_attention(module, q, k, k, torch.ones(1, 4, 3, k.shape[2], dtype=torch.bool))
    assert register_exact_backend() == EXACT_NAME


# -- the padding rule ----------------------------------------------------------------------------------


class _OrderByRows(nn.Module):
    """A stand-in for a kernel that changes its order of additions with the row count: an exact
    row-wise map (a copy of the first inputs) that comes out a little different below ``cut`` rows
    (and, with ``widest_alone``, at 8 rows)."""

    def __init__(self, in_features: int, out_features: int, cut: int, widest_alone: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.cut = in_features, out_features, cut
        self.widest_alone = widest_alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        out = x[..., : self.out_features] * 2.0
        if rows < self.cut or (self.widest_alone and rows == 8):
            out = out * (1 + 2.0 ** -20)
        return out


def test_width_classes_and_rule() -> None:
    layer = _OrderByRows(512, 64, cut=3)
    classes = width_classes(layer, 512, torch.float32, widths=range(1, 9), rows_per_width=16)
    assert classes[-1] == [3, 4, 5, 6, 7, 8] and sorted(w for c in classes for w in c) == list(range(1, 9))
    assert invariant_from(classes) == 3
    rule = probe_rule([layer, _OrderByRows(32, 16, cut=2)], torch.float32, max_rows=8, rows_per_width=16,
                      wide=(12, 20))
    assert rule.wider and rule.rows_for(100) == 100
    assert rule.min_rows == 3 and rule.widths == (3, 4, 5, 6, 7, 8)
    assert dict(rule.per_shape) == {(32, 16): tuple(range(2, 9)), (512, 64): tuple(range(3, 9))}
    assert [rule.rows_for(k) for k in (1, 2, 3, 8)] == [3, 3, 3, 8] and rule.rows_for(1) - 1 == 2
    with pytest.raises(ValueError, match="wider than the 14 rows"):
        RowRule((4, 8, 12, 13, 14)).rows_for(15)
    with pytest.raises(ValueError, match="at least one row"):
        rule.rows_for(0)
    for bad in ((), (0, 1), (2, 1), (3, 3)):
        with pytest.raises(ValueError, match="widths must be"):
            RowRule(bad)
    buckets = RowRule((4, 8, 12, 13, 14))  # MKL's float32 kernel on two threads agrees at 4, 8 and 12 up
    assert [buckets.rows_for(k) for k in (1, 4, 5, 9, 13)] == [4, 4, 8, 12, 13]
    assert buckets.describe() == "pad to 4, 8, 12+ rows (up to 14)"
    assert rule.describe() == "pad to 3+ rows (up to 8; wider as they are)" and RowRule((4,)).describe() == "pad to 4 rows (up to 4)"
    assert agreeing_widths([[1], [2, 3], [4, 8, 12], [5, 6, 7]]) == (4, 8, 12)
    with pytest.raises(ExactRowsError, match="no padding width"):
        probe_rule([_OrderByRows(512, 64, cut=1, widest_alone=True)], torch.float32, max_rows=8, rows_per_width=16)
    narrow = probe_rule([_OrderByRows(64, 8, cut=1, widest_alone=True)], torch.float32, max_rows=6, rows_per_width=16,
                        wide=(8, 9))
    assert narrow.widths == tuple(range(1, 7)) and not narrow.wider  # 8 rows sum otherwise: wide forwards not covered
    assert invariant_from([[1], [2, 3]]) == 2 and invariant_from([[1, 2, 3]]) == 1 and invariant_from([[1, 3], [2]]) is None


class _NormByRowsRMSNorm(nn.Module):
    """A stand-in for an RMSNorm on CUDA, whose reduction takes a row's mean in another order
    below ``cut`` rows (torch's reduction gives a row fewer threads as rows grow): the variance
    comes out a little different there."""

    def __init__(self, features: int, cut: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        variance = x.float().pow(2).mean(-1, keepdim=True)
        if rows < self.cut:
            variance = variance * (1 + 2.0 ** -12)
        return self.weight * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def test_norm_layers_are_probed_beside_the_linear_layers() -> None:
    """The probe covers the model's RMSNorm / LayerNorm modules: a norm whose rows come out
    otherwise below 16 rows keeps exact mode at 16 rows and up, where the linear layers alone
    would allow every width."""
    from conftest import tiny_model

    llama, gpt2 = tiny_model("llama"), tiny_model("gpt2")
    assert {type(m).__name__ for m in norm_layers(llama)} == {"LlamaRMSNorm"}
    assert {type(m).__name__ for m in norm_layers(gpt2)} == {"LayerNorm"}
    assert len(row_layers(llama)) == len(linear_layers(llama)) + len(norm_layers(llama))

    class ConditionedLayerNorm(nn.LayerNorm):  # needs more than the rows: left out
        def forward(self, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * condition

    holder = nn.Module()
    holder.plain, holder.conditioned = nn.LayerNorm(8), ConditionedLayerNorm(8)
    assert norm_layers(holder) == [holder.plain]
    layer = _OrderByRows(64, 64, cut=1)
    norm = _NormByRowsRMSNorm(64, cut=16)
    assert probe_rule([layer], torch.bfloat16, max_rows=32, rows_per_width=64).widths == tuple(range(1, 33))
    rule = probe_rule([layer, norm], torch.bfloat16, max_rows=32, rows_per_width=64, wide=(48,))
    assert rule.widths == tuple(range(16, 33)) and rule.wider
    assert sorted(rule.per_shape) == [((64, 64), tuple(range(1, 33))), ((64, 64), tuple(range(16, 33)))]
    with pytest.raises(ValueError, match="neither linear nor a normalization layer"):
        probe_rule([nn.ReLU()], torch.float32)


def test_rule_is_kept_per_machine_and_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs once per machine and model; the next call reads the file it wrote."""
    from conftest import tiny_model

    from specdraft.kernels import exact_rows

    model = tiny_model("llama")
    first = exact_rows.load_or_probe(model)
    path = exact_rows.rule_cache_path(exact_rows.rule_cache_key(model, exact_rows.row_layers(model)))
    assert path.exists()

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(exact_rows, "probe_rule", no_probe)
    assert exact_rows.load_or_probe(model) == first
    # a rule is per kind of layer: the same model one layer deeper reads the same file
    assert exact_rows.load_or_probe(tiny_model("llama", num_hidden_layers=3)) == first


def test_a_biased_and_an_unbiased_layer_of_one_shape_are_probed_apart() -> None:
    """They call different kernel entries (``addmm`` and ``mm``), which may sum in another order,
    so each kind is probed (Qwen2's query and output projections share a shape and differ so)."""
    def kinds(probed: list[nn.Module]) -> int:
        return len(probe_rule(probed, torch.float32, max_rows=8, rows_per_width=16, wide=()).per_shape)

    biased = nn.Linear(64, 64, bias=True)
    assert kinds([biased, nn.Linear(64, 64, bias=False)]) == 2
    assert kinds([biased, nn.Linear(64, 64, bias=True)]) == 1


def test_pad_block_layout() -> None:
    tokens, offsets, block = pad_block([5, 6, 7], np.array([0, 1, 1]), ancestor_block([-1, 0, 0]), 5)
    assert tokens == [5, 6, 7, 7, 7] and offsets.tolist() == [0, 1, 1, 1, 1]
    assert block[:3, :3].tolist() == ancestor_block([-1, 0, 0]).tolist()
    assert not block[:3, 3:].any() and not block[3:, :3].any() and block[3:, 3:].tolist() == np.eye(2, dtype=bool).tolist()
    same = pad_block([5], np.array([0]), np.ones((1, 1), dtype=bool), 1)
    assert same[0] == [5] and same[2].shape == (1, 1)
    with pytest.raises(ValueError, match="cannot pad a forward of 3 rows to 2"):
        pad_block([5, 6, 7], np.array([0, 1, 1]), ancestor_block([-1, 0, 0]), 2)
    with pytest.raises(ValueError, match="block must be"):
        pad_block([5, 6], np.array([0, 1]), np.ones((3, 3), dtype=bool), 4)
