"""The flash split + merge backend: exact against full masked attention and against sdpa models."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

import specdraft.model.attention as attention
from specdraft import Decoder, PromptLookup
from specdraft.model.attention import (AttentionBackendError, merge_partial_attention, select_attention,
                                 tree_flash_attention)
from specdraft.tree import TokenTree
from conftest import OneSequence

V = 64
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=7),
    "gemma3-hybrid": lambda: Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=5,
                                              layer_types=["sliding_attention", "full_attention"]),
}


def _model(arch: str, dtype=torch.float64, attn="sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=dtype, attn_implementation=attn).eval()


def _dense_reference(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_equals_attention_over_all_keys(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 8, generator=gen, dtype=dtype)
    k = torch.randn(2, 3, 11, 8, generator=gen, dtype=dtype)
    v = torch.randn(2, 3, 11, 8, generator=gen, dtype=dtype)
    allowed = torch.rand(2, 3, 5, 11, generator=gen) < 0.7
    allowed[..., 0] = True
    scale = 8 ** -0.5
    full = _dense_reference(q, k, v, allowed, scale)
    a = attention.dense_with_lse(q, k[..., :6, :], v[..., :6, :], scale, allowed[..., :6])
    b = attention.dense_with_lse(q, k[..., 6:, :], v[..., 6:, :], scale, allowed[..., 6:])
    merged = merge_partial_attention(a[0], a[1], b[0], b[1])
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert torch.allclose(merged.to(dtype), full, atol=tol)


def test_merge_with_an_empty_side_contributes_nothing():
    out = torch.randn(1, 1, 2, 4)
    lse = torch.randn(1, 1, 2)
    empty_lse = torch.full((1, 1, 2), float("-inf"))
    merged = merge_partial_attention(out, lse, torch.zeros_like(out), empty_lse)
    assert torch.allclose(merged, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_tree_flash_attention_matches_masked_attention(dtype, kv_heads):
    """The CPU flash kernel for the prefix + dense tree part == one masked softmax over everything."""
    gen = torch.Generator().manual_seed(1)
    heads, prefix, q_len, dim = 4, 9, 6, 8
    q = torch.randn(1, heads, q_len, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, kv_heads, prefix + q_len, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, kv_heads, prefix + q_len, dim, generator=gen, dtype=dtype)
    tree = TokenTree.from_drafts(0, [[[1, 2, 3], [1, 4], [5]]], 16)
    assert len(tree) == q_len
    block = torch.as_tensor(tree.ancestor_mask())
    allowed = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool), block], dim=1)[None, None]
    out, _ = tree_flash_attention(torch.nn.Module(), q, k, v, allowed, scaling=dim ** -0.5)
    groups = heads // kv_heads
    ref = _dense_reference(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                           allowed.expand(1, heads, q_len, prefix + q_len), dim ** -0.5)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert torch.allclose(out.transpose(1, 2), ref, atol=tol)
    # an additive mask means the same thing
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    out2, _ = tree_flash_attention(torch.nn.Module(), q, k, v, additive, scaling=dim ** -0.5)
    assert torch.allclose(out, out2, atol=tol)


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_logits_match_sdpa_through_the_registry(arch, dtype):
    """Whole models, unpatched: tree logits with the flash backend == tree logits with sdpa."""
    model = _model(arch, dtype)
    tree = TokenTree.from_drafts(7, [[[1, 2, 3, 4], [1, 5], [9, 8, 7, 6, 5, 4]], [[2, 3]]], 16)

    def tree_logits():
        runner = OneSequence(model)
        runner.prefill(list(range(3, 23)))  # 20 cached tokens: longer than the sliding windows
        return runner.forward(tree.tokens, tree.position_offsets(), tree.ancestor_mask())

    reference = tree_logits()
    assert select_attention(model, "flash") == attention.FLASH_NAME
    assert model.config._attn_implementation == attention.FLASH_NAME
    got = tree_logits()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got, reference, atol=tol), (got - reference).abs().max()


@pytest.mark.parametrize("arch", ["llama", "mistral-sliding", "gemma3-hybrid"])
def test_greedy_identity_with_flash_backend(arch):
    model = _model(arch)
    rng = random.Random(3)
    prompts = []
    for _ in range(4):
        base = [rng.randrange(V) for _ in range(rng.randrange(2, 12))]
        prompts.append(base + base[: rng.randrange(len(base) + 1)])
    refs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=32, do_sample=False)[0, len(p):].tolist() for p in prompts]
    dec = Decoder(model, sources=[PromptLookup()], max_tree_nodes=16, adaptive_budget=False, attention="flash")
    assert dec.attention == attention.FLASH_NAME
    for p, ref in zip(prompts, refs):
        assert dec.generate(p, max_new_tokens=32).token_ids == ref


def test_auto_keeps_sdpa_on_cpu_and_eager_stays_eager():
    model = _model("llama")
    assert select_attention(model, "auto") == "sdpa"
    eager = _model("llama", attn="eager")
    assert Decoder(eager, sources=[]).attention == "eager"
    assert select_attention(eager, "sdpa") == "sdpa"


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="attention must be one of"):
        Decoder(_model("llama"), attention="flashy")


def test_flash_without_a_kernel_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(attention, "cpu_flash_available", lambda: False)
    with pytest.raises(AttentionBackendError, match="_scaled_dot_product_flash_attention_for_cpu"):
        select_attention(_model("llama"), "flash")


def test_softcapping_is_refused_not_ignored():
    module = torch.nn.Module()
    module.attn_logit_softcapping = 50.0
    q = torch.randn(1, 2, 2, 4)
    with pytest.raises(AttentionBackendError, match="soft-capping"):
        tree_flash_attention(module, q, q, q, None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.skipif(not attention.fa2_available(), reason="needs the flash-attn package (pip install 'specdraft[flash]')")
def test_flash_attn_kernel_path_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, prefix, q_len, dim = 4, 33, 6, 64
    q = torch.randn(1, heads, q_len, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, prefix + q_len, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, prefix + q_len, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    tree = TokenTree.from_drafts(0, [[[1, 2, 3], [1, 4], [5]]], 16)
    block = torch.as_tensor(np.asarray(tree.ancestor_mask()), device="cuda")
    allowed = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device="cuda"), block], dim=1)[None, None]
    out, _ = tree_flash_attention(torch.nn.Module(), q, k, v, allowed, scaling=dim ** -0.5)
    ref = _dense_reference(q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1),
                           allowed.expand(1, heads, q_len, prefix + q_len), dim ** -0.5)
    assert torch.allclose(out.transpose(1, 2).float(), ref, atol=2e-2)
