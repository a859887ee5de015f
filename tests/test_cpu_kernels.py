"""``Decoder(cpu_kernels="packed"|"fbgemm")``: linear layers on weights packed once.

oneDNN has no float64 and FBGEMM accumulates in float32, so these tests run float32 copies of the
tiny models (and bfloat16 for the oneDNN kernel itself); for ``"fbgemm"`` the copies' weights are
rounded to float16 values first, so that float16 holds them exactly as it holds any bfloat16
checkpoint's (the layer itself is tested in ``test_fp16_linear.py``). For both kinds two promises
are checked:

* greedy output equals ``model.generate`` run on the same packed kernels, token for token (the
  decoder's own exactness, unchanged by the kernel choice);
* against stock ``model.generate`` it is equal too, except where the stock logits tie to within
  float32 noise at the first differing token (oneDNN adds in another order; that is the only
  allowed difference, and the tie is checked, not assumed);

and that the user's model is left exactly as it was: same module objects, same parameters.
"""

from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from specdraft import Decoder, PromptLookup
from specdraft.kernels.cpu_kernels import (CpuKernelError, PackedLinear, check_cpu_kernels, packed_dtype_problem,
                                   packed_kernels_available, packed_model)
from specdraft.kernels.fp16_linear import Fp16Linear, fbgemm_problem

from conftest import FAST, full_logits, reference_greedy, tiny_model
from test_greedy_identity import build_sources, oracle_sequence, prompts, source_specs

pytestmark = [pytest.mark.usefixtures("single_thread")]

#: The packed kinds, each skipped (with the reason) where this machine cannot run it.
needs_onednn = pytest.mark.skipif(not packed_kernels_available(), reason="torch built without oneDNN")
needs_fbgemm = pytest.mark.skipif(fbgemm_problem() is not None, reason=f"FBGEMM cannot run here: {fbgemm_problem()}")
KINDS = [pytest.param("packed", marks=needs_onednn), pytest.param("fbgemm", marks=needs_fbgemm)]

CASES = [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen2_swa", "sdpa"), ("gemma3", "sdpa"), ("gpt2", "eager"),
         ("phi", "sdpa")]
#: Top-2 logit gap (relative to the row's largest magnitude) below which two tokens count as tied
#: in float32: a few ulps of the accumulated sums.
TIE = 1e-5


@functools.lru_cache(maxsize=None)
def tiny32(arch: str, attn: str = "sdpa") -> nn.Module:
    """A float32 copy of the shared float64 tiny model (the shared one is left alone)."""
    return copy.deepcopy(tiny_model(arch, attn)).to(torch.float32)


@functools.lru_cache(maxsize=None)
def tiny16(arch: str, attn: str = "sdpa") -> nn.Module:
    """A float32 tiny model whose every parameter is a float16 value (a bfloat16 or float16
    checkpoint loaded in float32 looks like this): what ``"fbgemm"`` holds exactly."""
    model = copy.deepcopy(tiny_model(arch, attn)).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))
    return model


def model_for(kind: str, arch: str, attn: str = "sdpa") -> nn.Module:
    """The shared float32 tiny model a packed kind runs exactly."""
    return tiny16(arch, attn) if kind == "fbgemm" else tiny32(arch, attn)


def _snapshot(model: nn.Module) -> tuple[dict, dict]:
    return ({name: m for name, m in model.named_modules()},
            {name: (p, p.detach().clone()) for name, p in model.named_parameters()})


def _assert_unchanged(model: nn.Module, snapshot: tuple[dict, dict]) -> None:
    modules, params = snapshot
    now = dict(model.named_modules())
    assert now.keys() == modules.keys()
    assert all(now[name] is module for name, module in modules.items())
    assert not any(isinstance(m, (PackedLinear, Fp16Linear)) for m in model.modules())
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1])


def _first_difference_is_a_tie(model, prompt, ours, ref) -> bool:
    at = next(i for i, (a, b) in enumerate(zip(ours + [None], ref + [None])) if a != b)
    row = full_logits(model, list(prompt) + ref[:at])[-1].double()
    top = torch.topk(row, 2).values
    return bool(top[0] - top[1] <= TIE * row.abs().max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@settings(FAST, max_examples=15)
@given(prompt=prompts(), n=st.integers(0, 40), max_tree_nodes=st.integers(0, 40), specs=source_specs,
       adaptive=st.booleans())
def test_greedy_identity_packed(kind, case, prompt, n, max_tree_nodes, specs, adaptive) -> None:
    model = model_for(kind, *case)
    snapshot = _snapshot(model)
    with packed_model(model, kind).swapped():  # model.generate on the very same kernels
        ref_packed = reference_greedy(model, prompt, n)
    ref_stock = reference_greedy(model, prompt, n)
    sources = build_sources(specs, oracle_sequence(model, prompt, n, specs))
    dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive,
                  cpu_kernels=kind)
    out = dec.generate(prompt, max_new_tokens=n)
    _assert_unchanged(model, snapshot)
    assert out.token_ids == ref_packed
    if out.token_ids != ref_stock:
        assert _first_difference_is_a_tie(model, prompt, out.token_ids, ref_stock)
        event("differs from stock at a float32 tie")
    else:
        event("equal to stock")


@needs_onednn
@pytest.mark.parametrize("dtype, tol", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        packed_dtype_problem(torch.bfloat16) is not None,
        reason=f"this CPU cannot pack bfloat16 weights: {packed_dtype_problem(torch.bfloat16)}")),
], ids=["float32", "bfloat16"])
def test_packed_linear_matches_stock(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(48, 40, bias=bias).to(dtype)
        packed = PackedLinear(linear)
        for rows in (1, 3, 16, 33):
            x = torch.randn(1, rows, 48, dtype=dtype)
            with torch.inference_mode():
                want, got = linear(x), packed(x)
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_changed_in_place_are_repacked(kind) -> None:
    model = copy.deepcopy(model_for(kind, "llama"))
    packed = packed_model(model, kind)
    prompt = [5, 6, 7, 8, 9, 5, 6]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5 if kind == "packed" else 2.0)  # "fbgemm": stays exact in float16
    with packed.swapped():
        ours = reference_greedy(model, prompt, 20)
    stock = reference_greedy(model, prompt, 20)
    assert ours == stock


@pytest.mark.parametrize("kind", KINDS)
def test_model_restored_after_an_error_inside_a_forward(kind) -> None:
    model = model_for(kind, "qwen2")
    snapshot = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        with packed_model(model, kind).swapped():
            assert any(isinstance(m, (PackedLinear, Fp16Linear)) for m in model.modules())
            raise RuntimeError("boom")
    _assert_unchanged(model, snapshot)


@pytest.mark.parametrize("kind", KINDS)
def test_decoders_share_one_packed_copy_and_close_drops_it(kind) -> None:
    model = model_for(kind, "llama")
    a = Decoder(model, sources=[PromptLookup()], cpu_kernels=kind)
    b = Decoder(model, sources=[PromptLookup()], cpu_kernels=kind)
    assert a.packed_weights is b.packed_weights and a.packed_weights.nbytes > 0
    a.close()
    assert a.packed_weights is None and a.cpu_kernels == "stock"
    prompt = [3, 4, 5, 3, 4, 5, 3]
    assert a.generate(prompt, max_new_tokens=12).token_ids == reference_greedy(model, prompt, 12)
    b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_threads_share_the_swap(kind) -> None:
    """Decoders in threads over one model: the swap is counted, so the model is restored only
    when the last forward ends, and every thread gets its solo output."""
    model = model_for(kind, "gemma3")
    snapshot = _snapshot(model)
    prompts_ = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 7, 6, 9, 8], [1, 3, 1, 3, 1, 3, 1, 3], [11, 12, 13]]
    with packed_model(model, kind).swapped():
        want = [reference_greedy(model, p, 30) for p in prompts_]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            dec = Decoder(model, sources=[PromptLookup()], max_tree_nodes=8, cpu_kernels=kind)
            for _ in range(3):
                got[i] = dec.generate(prompts_[i], max_new_tokens=30).token_ids
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(len(prompts_))] == want
    _assert_unchanged(model, snapshot)


def test_bad_choices_are_refused() -> None:
    with pytest.raises(ValueError, match=r"cpu_kernels must be one of \['auto', 'stock', 'packed', 'fbgemm'\], got 'fast'"):
        Decoder(tiny32("llama"), cpu_kernels="fast")


@pytest.mark.parametrize("kind", KINDS)
def test_float64_is_refused(kind) -> None:
    with pytest.raises(CpuKernelError, match="float64"):
        Decoder(tiny_model("llama"), cpu_kernels=kind)  # oneDNN has no float64; FBGEMM sums in float32


@needs_onednn
def test_bench_methods_plain_and_packed() -> None:
    """``plain`` is our loop with no drafts; ``@packed`` turns the fast path on for one method."""
    from specdraft.bench.methods import MethodError, build_method, parse_methods, plain_reference

    names = parse_methods("default@packed,plain@packed,plain,prompt@fixed@packed,prompt@fbgemm@fixed")
    assert names == ["baseline", "default@packed", "plain@packed", "plain", "specdraft:prompt@fixed@packed",
                     "specdraft:prompt@fixed@fbgemm"]
    assert plain_reference("specdraft:prompt@fixed@packed") == "plain@packed" and plain_reference("default") == "plain"
    assert plain_reference("specdraft:prompt@fixed@fbgemm") == "plain@fbgemm"
    with pytest.raises(MethodError, match="names two CPU kernels"):
        parse_methods("default@packed@fbgemm")
    with pytest.raises(MethodError, match="@fbgemm applies to our decoder's methods"):
        parse_methods("baseline@fbgemm")
    model = tiny32("llama")
    plain = build_method("plain@packed", model, None, 16)
    assert plain.decoder.max_tree_nodes == 0 and plain.decoder.sources == [] and plain.decoder.cpu_kernels == "packed"
    prompt = [4, 5, 6, 4, 5, 6, 4]
    result = plain.run(prompt, 20)
    assert result.steps == len(result.token_ids) == 20
    assert build_method("default", model, None, 16).decoder.cpu_kernels == "auto"
    assert build_method("default@stock", model, None, 16).decoder.cpu_kernels == "stock"


@pytest.mark.parametrize("kind", KINDS)
def test_a_replaced_layer_is_refused_not_overwritten(kind) -> None:
    model = copy.deepcopy(model_for(kind, "llama"))
    packed = packed_model(model, kind)
    new = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    model.lm_head = new
    with pytest.raises(RuntimeError, match="changed since their weights were packed"):
        with packed.swapped():
            pass
    assert model.lm_head is new


@needs_onednn
def test_a_dtype_this_cpu_cannot_pack_is_refused_by_name() -> None:
    """Whether oneDNN packs bfloat16 depends on the CPU (AVX512 BW/VL/DQ or AVX-NE-CONVERT); where
    it cannot, ``packed`` is refused up front, naming the dtype and the way out, instead of failing
    inside the first forward. Where it can, the check passes."""
    model = copy.deepcopy(tiny32("llama")).to(torch.bfloat16)
    problem = packed_dtype_problem(torch.bfloat16)
    if problem is None:
        check_cpu_kernels(model, "packed")
        return
    with pytest.raises(CpuKernelError) as info:
        Decoder(model, cpu_kernels="packed")
    message = str(info.value)
    assert "bfloat16" in message and "cpu_kernels='stock'" in message and problem in message
