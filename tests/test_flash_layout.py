"""The flash split over the KV store: each row's prefix read in place through its layout.

The prefix half has three kernels (FlashAttention 4's variable-length call, a flash call per
segment on the host's spans, a dense product); they must give one result, and whole decoders on
the flash backend must still equal ``model.generate``, alone, batched and in static forwards. No
GPU here: FlashAttention 4 is stood in for by :func:`fake_flash4_varlen`, a torch implementation of
the documented semantics of ``flash_attn.cute.flash_attn_varlen_func`` that also checks what that
function asserts (int32 contiguous offsets, ``(batch + 1,)`` shapes, a contiguous last dimension),
so the call we make is the call the device gets. ``tests/test_cuda.py`` runs the real one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import specdraft.model.attention as attention
import specdraft.model.flash_kernels as flash_kernels
from specdraft import Decoder, PromptLookup
from specdraft.model.attention import merge_partial_attention, tree_flash_attention
from specdraft.model.flash_kernels import FlashLayout, dense_with_lse, fa4_sequences, prefix_attention
from specdraft.model.masks import RowLayout, allowed_columns, flash_layout

from conftest import in_triton_interpreter, reference_greedy, tiny_model
from test_static_forwards import PROMPT, Spy, static_decoder

CALLS: list[int] = []


def fake_flash4_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, return_lse):
    """``flash_attn.cute.flash_attn_varlen_func`` for varlen q and k with ``seqused_k``: sequence
    ``s`` is q rows ``[cu_q[s], cu_q[s + 1])`` against k rows ``cu_k[s] .. cu_k[s] + used[s]``.
    Returns ``(out [total_q, H, D] in q's dtype, lse [H, total_q] float32)``."""
    CALLS.append(q.shape[0])
    batch = cu_seqlens_q.shape[0] - 1
    for t in (cu_seqlens_q, cu_seqlens_k, seqused_k):
        assert t.dtype == torch.int32 and t.stride(0) == 1
    assert cu_seqlens_k.shape == (batch + 1,) and seqused_k.shape == (batch,)
    assert q.dim() == 3 and k.dim() == 3 and v.shape == k.shape and k.shape[0] == max_seqlen_k
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert not causal and return_lse
    heads, groups = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((heads, q.shape[0]), float("-inf"), dtype=torch.float32)
    for s in range(batch):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        k0, used = int(cu_seqlens_k[s]), int(seqused_k[s])
        assert q1 - q0 <= max_seqlen_q and k0 + used <= max_seqlen_k
        if q1 == q0 or used == 0:
            continue
        keys = k[k0 : k0 + used].transpose(0, 1).repeat_interleave(groups, 0)  # [H, n, D]
        values = v[k0 : k0 + used].transpose(0, 1).repeat_interleave(groups, 0)
        scores = (q[q0:q1].transpose(0, 1).double() @ keys.double().transpose(1, 2)) * softmax_scale
        part = torch.logsumexp(scores, dim=-1)  # [H, rows]
        out[q0:q1] = (torch.softmax(scores, dim=-1) @ values.double()).transpose(0, 1).to(q.dtype)
        lse[:, q0:q1] = part.float()
    return out, lse


@pytest.fixture
def fake_flash4(monkeypatch):
    """FlashAttention 4 "installed": every prefix goes to :func:`fake_flash4_varlen`."""
    monkeypatch.setattr(flash_kernels, "fa4_runs", lambda query: True)
    monkeypatch.setattr(flash_kernels, "_fa4_varlen", lambda: fake_flash4_varlen)
    CALLS.clear()
    return CALLS


def _layout(columns: int = 40):
    """Three segments (a 3-node tree, a 2-row prompt chunk, one pad row with nothing committed)
    whose regions lie out of row order in a store of ``columns`` columns."""
    region_start = torch.tensor([20, 20, 20, 2, 2, 34])
    region_length = torch.tensor([9, 9, 9, 5, 5, 0])
    write = torch.tensor([29, 30, 31, 7, 8, 34])
    positions = torch.tensor([9, 10, 10, 5, 6, 0])
    segment = torch.tensor([0, 0, 0, 1, 1, 2])
    tree_rows = torch.tensor([0, 1, 2, 5])
    tree_block = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    rows = RowLayout(positions, region_start, region_length, segment, write, tree_rows, tree_block)
    spans = [(0, 3, 20, 32), (3, 5, 2, 9), (5, 6, 34, 35)]
    return rows, flash_layout(rows, spans), allowed_columns(rows, columns, None)


def _qkv(rows: int, columns: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, rows, 8, generator=gen, dtype=dtype)
    k = torch.randn(1, 2, columns, 8, generator=gen, dtype=dtype)
    v = torch.randn(1, 2, columns, 8, generator=gen, dtype=dtype)
    return q, k, v


def test_the_sequences_follow_the_segments() -> None:
    rows, layout, _ = _layout()
    cu_q, cu_k, used = fa4_sequences(layout, 6)
    assert cu_q.tolist() == [0, 3, 5, 6, 6, 6, 6]
    assert cu_k.tolist()[:3] == [20, 2, 34] and used.tolist() == [9, 5, 0, 0, 0, 0]
    assert cu_k.tolist()[-1] >= 29


def test_three_prefix_kernels_agree(fake_flash4) -> None:
    _, layout, allowed = _layout()
    q, k, v = _qkv(6, 40)
    scale = 8 ** -0.5
    dense = flash_kernels._prefix_dense(q, k, v, layout, scale)
    spans = flash_kernels._prefix_spans(q, k, v, layout.spans, scale)
    fa4 = prefix_attention(q, k, v, layout, scale)
    assert fake_flash4 == [6]
    for out, lse in (spans, fa4):
        assert torch.allclose(out.double(), dense[0].double(), atol=1e-12)
        assert torch.equal(torch.isinf(lse), torch.isinf(dense[1]))
        assert torch.allclose(lse.double()[~torch.isinf(lse)], dense[1].double()[~torch.isinf(lse)], atol=1e-5)
    assert torch.isinf(dense[1][..., 5]).all() and not dense[0][..., 5, :].any()  # nothing committed


@pytest.mark.parametrize("fa4", [False, True])
def test_the_split_by_layout_equals_one_masked_softmax(fa4, request) -> None:
    if fa4:
        request.getfixturevalue("fake_flash4")
    _, layout, allowed = _layout()
    q, k, v = _qkv(6, 40)
    out, _ = tree_flash_attention(torch.nn.Module(), q, k, v, None, scaling=8 ** -0.5,
                                  specdraft_flash_layout=layout)
    reference, _ = dense_with_lse(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 8 ** -0.5,
                                  allowed[None, None])
    assert torch.allclose(out.transpose(1, 2), reference, atol=1e-12)


def test_an_empty_side_of_the_merge_stays_finite() -> None:
    out = torch.randn(1, 1, 2, 4)
    lse = torch.full((1, 1, 2), float("-inf"))
    assert torch.isfinite(merge_partial_attention(out * 0, lse, out, torch.zeros(1, 1, 2))).all()


def _flash_decoder(arch: str, static: bool, graphs: bool = False, **options) -> Decoder:
    model = copy.deepcopy(tiny_model(arch))
    options.setdefault("sources", [PromptLookup()])
    if static:
        return static_decoder(model, graphs, attention="flash", adaptive_budget=False, **options)
    return Decoder(model, None, max_tree_nodes=12, adaptive_budget=False, attention="flash", **options)


@pytest.mark.parametrize("fa4", [False, True])
@pytest.mark.parametrize("static, graphs", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flash_decoding_equals_generate(arch: str, static: bool, graphs: bool, fa4: bool, request) -> None:
    calls = request.getfixturevalue("fake_flash4") if fa4 else None
    dec = _flash_decoder(arch, static, graphs)
    model = tiny_model(arch)
    assert dec.generate(PROMPT, max_new_tokens=16).token_ids == reference_greedy(model, PROMPT, 16)
    prompts = [PROMPT, PROMPT[:8], PROMPT[3:]]
    result = dec.generate_batch(prompts, max_new_tokens=16, concurrency=3)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, 16) for p in prompts]
    if calls is not None:
        assert calls  # the prefixes did go through the variable-length call


def test_static_flash_forwards_run_at_bucket_widths(fake_flash4) -> None:
    dec = _flash_decoder("llama", static=True, graphs=True)
    spy = Spy(dec.runner.static)
    dec.generate_batch([PROMPT, PROMPT[2:]], max_new_tokens=16, concurrency=2)
    assert spy.widths and set(spy.widths) <= set(fake_flash4)  # the static forwards called it at their widths
    assert dec.runner.static.captured


def test_sliding_windows_keep_reading_the_mask() -> None:
    """A windowed prefix is masked, so a sliding-window model gets no layout and stays exact."""
    dec = _flash_decoder("mistral", static=False)
    assert not dec.runner.flash_layouts
    assert dec.generate(PROMPT, max_new_tokens=16).token_ids == reference_greedy(tiny_model("mistral"), PROMPT, 16)


def test_the_layout_is_a_forward_of_one_sequence() -> None:
    _, layout, _ = _layout()
    q, k, v = _qkv(6, 40)
    with pytest.raises(RuntimeError, match="batch of 2"):
        tree_flash_attention(torch.nn.Module(), q.expand(2, -1, -1, -1), k, v, None, specdraft_flash_layout=layout)


def test_layout_kernels_need_no_host_values_inside_a_graph(fake_flash4) -> None:
    """Without host spans (a captured forward) the prefix goes to FlashAttention 4 or the dense
    product, both driven by device tensors alone."""
    _, layout, _ = _layout()
    inside = FlashLayout(layout.region_start, layout.region_length, layout.segment, layout.write_columns,
                         layout.new_allowed, None)
    q, k, v = _qkv(6, 40)
    prefix_attention(q, k, v, inside, 8 ** -0.5)
    assert fake_flash4 == [6]


def _in_triton_interpreter(check: str) -> None:
    """``check`` with part (b) and the merge as the Triton kernel, in Triton's interpreter."""
    in_triton_interpreter("test_flash_layout", "t.attention.TRITON_MERGE = True", check)


def check_fused_merge_matches_the_torch_operations() -> None:
    """The kernel against the torch path, on the layout with regions out of order and a row with
    nothing committed, in float32 and bfloat16, with each prefix kernel's output (the stand-in of
    FlashAttention 4 hands over bfloat16 views of its own layout)."""
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        _, layout, allowed = _layout()
        q, k, v = _qkv(6, 40, dtype)
        reference, _ = dense_with_lse(q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1),
                                      8 ** -0.5, allowed[None, None])
        for fa4 in (False, True):
            if fa4:
                flash_kernels.fa4_runs, flash_kernels._fa4_varlen = (lambda query: True), (lambda: fake_flash4_varlen)
            for fused in (False, True):
                attention.TRITON_MERGE = fused
                out, _ = tree_flash_attention(torch.nn.Module(), q, k, v, None, scaling=8 ** -0.5,
                                              specdraft_flash_layout=layout)
                assert out.dtype == dtype and out.shape == (1, 6, 4, 8)
                assert torch.allclose(out.double().transpose(1, 2), reference, atol=tol), (fa4, fused, dtype)
    attention.TRITON_MERGE = True


def check_fused_merge_decodes_exactly() -> None:
    """A whole decoder with the kernel (and the stand-in of FlashAttention 4): greedy output equals
    ``model.generate`` for each request of a batch, in static forwards (each interpreted kernel
    call is slow, so no graph's extra runs here: the torch path's tests cover those)."""
    flash_kernels.fa4_runs, flash_kernels._fa4_varlen = (lambda query: True), (lambda: fake_flash4_varlen)
    calls = []
    attend = attention.flash_merge_triton.attend_new_rows
    attention.flash_merge_triton.attend_new_rows = lambda *a, **k: (calls.append(1), attend(*a, **k))[1]
    model = tiny_model("llama")
    dec = _flash_decoder("llama", static=True)
    prompts = [PROMPT, PROMPT[:8]]
    result = dec.generate_batch(prompts, max_new_tokens=10, concurrency=2)
    assert [o.token_ids for o in result] == [reference_greedy(model, p, 10) for p in prompts]
    assert calls


def test_fused_merge_matches_the_torch_operations_in_the_interpreter() -> None:
    _in_triton_interpreter("check_fused_merge_matches_the_torch_operations")


def test_fused_merge_decodes_exactly_in_the_interpreter() -> None:
    _in_triton_interpreter("check_fused_merge_decodes_exactly")
