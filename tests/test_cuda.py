"""The decoder on a real CUDA GPU (``pytest -m cuda``; skipped, with the reason, where there is none).

What the simulated device of ``test_simulated_device.py`` checks on every machine (no tensor on
the wrong device, one read and one upload per step), this suite checks on the real thing, plus
what only a GPU can show: greedy identity with ``model.generate`` in float32 on GPU kernels, the
sampling law drawn by a CUDA generator, seeded reproducibility, the repetition penalty, every
source, the ``flash`` backend against ``sdpa``, and ``specdraft bench`` on a CUDA model.

    python3 -m pip install -e ".[test]" && python3 -m pytest -m cuda -q

The real-model test also needs the default model (``qwen2.5-coder-0.5b``) in the cache, or a
checkpoint named by ``$SPECDRAFT_TEST_MODEL``.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path

import pytest
import torch

from conftest import repetitive_prompt, tiny_model, wide_llama
from specdraft import Decoder
from specdraft.sources.registry import DEFAULT_SOURCES, GPU_DEFAULT_SOURCES, SOURCES, make_sources

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")]

PROMPT = [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 7]
NEW = 24
MIXES = {name: [name] for name in SOURCES} | {"default": list(DEFAULT_SOURCES)}


@functools.lru_cache(maxsize=None)
def cuda_model(arch: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A private CUDA copy of the shared tiny model (float32: what GPU kernels are exact in here)."""
    return copy.deepcopy(tiny_model(arch, attn)).to(device="cuda", dtype=dtype)


@torch.inference_mode()
def generate_greedy(model, prompt: list[int], n: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3", "gpt2"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_greedy_on_cuda_equals_generate(arch: str, mix: str) -> None:
    model = cuda_model(arch)
    dec = Decoder(model, None, sources=make_sources(MIXES[mix]), max_tree_nodes=16, adaptive_budget=False)
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == generate_greedy(model, PROMPT, NEW)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_batched_greedy_on_cuda_equals_generate(arch: str) -> None:
    """``generate_batch`` on the GPU: every request's output equals its own ``generate`` output."""
    model = cuda_model(arch)
    prompts = [PROMPT, PROMPT[:5], [3, 4, 3, 4, 3, 4, 3], PROMPT[4:], [9] * 12]
    dec = Decoder(model, None, max_tree_nodes=16)
    result = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in result] == [generate_greedy(model, p, NEW) for p in prompts]


def test_decode_forwards_replay_cuda_graphs() -> None:
    """Every decode forward runs at a bucket width from static buffers, captured once per width as
    a CUDA graph and replayed; greedy output stays generate's, alone and batched."""
    model = cuda_model("llama")
    dec = Decoder(model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=16)
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == generate_greedy(model, PROMPT, NEW)
    static = dec.runner.static
    assert static is not None and static.capture and static.captured, static.note if static else "no static path"
    prompts = [PROMPT, PROMPT[:8], PROMPT[3:]]
    result = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in result] == [generate_greedy(model, p, NEW) for p in prompts]


@functools.lru_cache(maxsize=None)
def wide_cuda_model(dtype: torch.dtype) -> torch.nn.Module:
    """Issue 43's 896-wide random Llama on the GPU, run to its token limit."""
    model = wide_llama(dtype).to("cuda")
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_exact_mode_on_cuda_equals_exact_plain_decoding(dtype: torch.dtype) -> None:
    """Exact mode on the GPU: every decode forward at a bucket width where the probed rule holds,
    on the exact attention at fixed shapes, captured as CUDA graphs; speculation gives exact plain
    decoding's tokens, alone, batched (a request's output does not depend on the others) and
    sampled with a seed."""
    model = wide_cuda_model(dtype)
    plain = Decoder(model, None, sources=[], max_tree_nodes=0, exact=True)
    # the GPU's default sources (Token Recycling's wide trees fill the widest buckets)
    dec = Decoder(model, None, sources=make_sources(list(GPU_DEFAULT_SOURCES)), max_tree_nodes=32, exact=True)
    assert dec.runner.static is not None and dec.engine.padding.widths == dec.runner.static.widths
    prompts = [repetitive_prompt(s) for s in range(10)]
    expected = [plain.generate(p, max_new_tokens=48).token_ids for p in prompts]
    outs = [dec.generate(p, max_new_tokens=48) for p in prompts]
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats.steps for o in outs) < 48 * len(prompts)  # trees were really checked
    for decoder in (plain, dec):  # the exact attention did not keep a forward from its graph
        assert decoder.runner.static.captured and decoder.runner.static.note == "", decoder.runner.static.note
    import specdraft.model.exact_attention as exact

    assert exact.TRITON_NOTE == {}  # and ran as the Triton kernel
    result = dec.generate_batch(prompts, max_new_tokens=48, concurrency=4)
    assert [o.token_ids for o in result] == expected
    options = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=11)
    for p in prompts[:3]:
        assert dec.generate(p, max_new_tokens=48, **options).token_ids == \
            plain.generate(p, max_new_tokens=48, **options).token_ids


def test_whole_decode_forward_gives_a_row_the_same_bits_at_every_bucket_width_on_cuda() -> None:
    """Exact mode's premise end to end: in exact mode's own forwards (captured, static run eagerly,
    dynamic), a row's logits are the same at every bucket width. The per-layer probe found this of
    every layer on an H200, yet exact speculation parted from exact plain decoding there; on
    failure the message names the first module where a row parts (``benchmarks/forward_rows.py``)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import forward_rows

    from specdraft.model.exact_attention import EXACT_NAME

    result = forward_rows.check(wide_cuda_model(torch.bfloat16), exact=True)
    report = forward_rows.markdown(result)
    print(report)
    assert set(result["ways"]) == set(forward_rows.WAYS)
    for way in result["ways"].values():
        assert way["attention"] == EXACT_NAME, report
        assert way["repeatable"], report
        assert all(r["agree"] == r["rows"] for w, r in way["rows"].items() if r["runs_at"] == w), report


def test_rms_norm_width_classes_on_cuda_bound_the_rule() -> None:
    """The probe runs the model's norms as well as its linear layers: the rule's bucket widths lie
    in the RMSNorm's class of 64 rows. (torch's CUDA reduction gives a row of 896 values other
    thread counts at different row counts, which could order its sum otherwise below 16 rows; on
    an H200 the probe found the norm agreeing at every width from 1 to 64. The classes are printed
    for the record.)"""
    from specdraft.kernels import exact_rows

    model = wide_cuda_model(torch.bfloat16)
    norm = exact_rows.norm_layers(model)[0]
    classes = exact_rows.width_classes(norm, 896, torch.bfloat16, widths=(1, 8, 16, 32, 64), rows_per_width=256)
    print("RMSNorm width classes on", torch.cuda.get_device_name(), classes)
    rule = exact_rows.probe_rule(exact_rows.row_layers(model), torch.bfloat16)
    widest = next(c for c in classes if 64 in c)
    assert set(rule.widths) & {1, 8, 16, 32, 64} <= set(widest)


def test_exact_attention_rows_on_cuda_equal_their_one_row_results() -> None:
    """The exact attention's Triton kernels on the GPU: at every bucket width, every row of a tree
    over a cache equals the one-row call over its visible keys alone, bit for bit (bfloat16). (Its
    torch layout is not row-invariant on cuBLAS, measured on an H100 at 32 rows, so CUDA runs the
    kernels or refuses exact mode: see the next test.)"""
    import numpy as np

    import specdraft.model.exact_attention as exact
    from conftest import ancestor_block, exact_attend, random_tree

    assert exact.triton_runs_on(torch.device("cuda")), exact.TRITON_NOTE
    gen = torch.Generator().manual_seed(9)
    n, cache_len = 64, 300
    k = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, n, 14, 64, generator=gen).to(device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    allowed = np.concatenate([np.ones((n, cache_len), dtype=bool), ancestor_block(random_tree(n, seed=9))], axis=1)
    alone = [exact_attend(q[:, :, r : r + 1], k[:, :, np.flatnonzero(allowed[r])],
                          v[:, :, np.flatnonzero(allowed[r])], None)[0] for r in range(n)]
    for width in (1, 8, 16, 32, 64):
        out = exact_attend(q[:, :, :width], k[:, :, : cache_len + width], v[:, :, : cache_len + width],
                           allowed[:width, : cache_len + width])
        bad = [r for r in range(width) if not torch.equal(out[r], alone[r])]
        assert not bad, f"width {width}: rows {bad} differ from their one-row results"
    assert exact.TRITON_NOTE == {}


def test_exact_mode_is_the_bfloat16_default_on_cuda_and_refused_without_its_kernels(monkeypatch) -> None:
    """Where the Triton kernels run, a bfloat16 model decodes in exact mode by default (its price
    on an H100 was nothing measurable); float32 does not; without the kernels exact mode is refused
    before the first forward, with the reason."""
    import specdraft.model.exact_attention as exact

    assert Decoder(wide_cuda_model(torch.bfloat16), None).exact
    assert not Decoder(cuda_model("llama"), None).exact
    monkeypatch.setattr(exact, "_TRITON_RUNS", {"cuda:0": False})
    monkeypatch.setattr(exact, "TRITON_NOTE", {"cuda:0": "RuntimeError: test"})
    assert not Decoder(wide_cuda_model(torch.bfloat16), None).exact
    with pytest.raises(exact.ExactAttentionError, match="not row-invariant"):
        Decoder(wide_cuda_model(torch.bfloat16), None, exact=True)


def test_repetition_penalty_on_cuda_equals_generate() -> None:
    model = cuda_model("llama")
    dec = Decoder(model, None, max_tree_nodes=16, adaptive_budget=False)
    out = dec.generate(PROMPT, max_new_tokens=NEW, repetition_penalty=1.3)
    assert out.token_ids == generate_greedy(model, PROMPT, NEW, repetition_penalty=1.3)


def test_seeded_sampling_on_cuda_is_reproducible() -> None:
    model = cuda_model("llama")
    options = dict(do_sample=True, seed=11, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    dec = Decoder(model, None, max_tree_nodes=16, adaptive_budget=False)
    first = dec.generate(PROMPT, max_new_tokens=NEW, **options).token_ids
    # the reused decoder's sources have learned from the first request: other trees, same output
    assert dec.generate(PROMPT, max_new_tokens=NEW, **options).token_ids == first
    plain = Decoder(model, None, sources=[], max_tree_nodes=0)
    assert plain.generate(PROMPT, max_new_tokens=NEW, **options).token_ids == first


def test_sampling_law_on_cuda_chi_square() -> None:
    """The chi-square of ``test_sampling_stats.py`` with the model, the law's reference generate
    and every draw on the GPU (the batched row choices and a CUDA generator)."""
    import test_sampling_stats as law_test

    model = law_test.law_model("cuda")
    law = law_test.ExactLaw(model, law_test.SETTING_A)
    decoder = law_test.make_decoder(model, law)
    counts, mean_accepted = law_test.sample(decoder, law_test.N_CORRECT, law_test.SETTING_A, seed0=0)
    pvalue, dof, impossible = law_test.chi_square(counts, law)
    assert mean_accepted > 1.3
    assert impossible == 0 and pvalue > law_test.P_THRESHOLD


def assert_greedy_up_to_near_ties(reference: torch.nn.Module, prompt: list[int], tokens: list[int],
                                  ulps: int = 4) -> None:
    """Every one of ``tokens`` (a decoder's greedy output for ``prompt``) is the reference model's
    top token after the tokens before it, or within ``ulps`` bfloat16 steps of the top logit (a
    near-tie, which another kernel's rounding may tip): how two attention kernels in bfloat16 may
    part, where a wrong kernel parts by whole logits."""
    ids = torch.tensor([prompt + tokens], device=reference.device)
    with torch.inference_mode():
        logits = reference(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].float()
    top = logits.max(dim=-1).values
    chosen = logits[torch.arange(len(tokens), device=logits.device), torch.tensor(tokens, device=logits.device)]
    step = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)  # bfloat16's spacing at the largest logit
    gaps = (top - chosen) / step
    assert gaps.max().item() <= ulps, [(i, round(g, 1)) for i, g in enumerate(gaps.tolist()) if g > ulps]


def test_flash_backend_matches_sdpa_on_cuda() -> None:
    from specdraft.model.flash_kernels import fa2_available, fa4_available

    if not (fa2_available() or fa4_available()):
        pytest.skip("the flash backend on CUDA needs flash-attn 2 or 4 (pip install -e '.[flash]' or '.[flash4]')")
    sdpa = cuda_model("llama", "sdpa", torch.bfloat16)
    flash = copy.deepcopy(sdpa)
    out = Decoder(flash, None, max_tree_nodes=16, adaptive_budget=False, attention="flash").generate(
        PROMPT, max_new_tokens=NEW)
    # bfloat16 (flash-attn has no float32 kernel): the two backends may part at a near-tie
    assert_greedy_up_to_near_ties(sdpa, PROMPT, out.token_ids)


def _needs_flash4() -> None:
    from specdraft.model.flash_kernels import fa4_available

    if not fa4_available():
        pytest.skip("needs FlashAttention 4 (pip install -e '.[flash4]')")


def _flash_layout_case(dtype: torch.dtype, seed: int):
    """``test_flash_layout``'s layout (regions out of row order, a segment with nothing committed)
    on the GPU, with random queries of 14 heads and keys and values of 2 heads of 64 over 40
    store columns: ``(layout, q, k, v)``."""
    import specdraft.model.flash_kernels as fk
    from test_flash_layout import _layout

    _, layout, _ = _layout()
    layout = fk.FlashLayout(*(t.cuda() for t in (layout.region_start, layout.region_length, layout.segment,
                                                  layout.write_columns, layout.new_allowed)), None)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, heads, rows, 64, generator=gen, device="cuda").to(dtype)
               for heads, rows in ((14, 6), (2, 40), (2, 40)))
    return layout, q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flash4_prefix_matches_the_dense_product_on_cuda(dtype: torch.dtype) -> None:
    """FlashAttention 4's variable-length call reads each segment's committed columns in place
    (regions out of row order, a segment with nothing committed, 14 heads on 2): within rounding
    of the dense product over the same columns, and an empty prefix is an empty side."""
    _needs_flash4()
    import specdraft.model.flash_kernels as fk

    layout, q, k, v = _flash_layout_case(dtype, seed=0)
    assert fk.fa4_runs(q)
    out, lse = fk._prefix_fa4(q, k, v, layout, 0.125)
    ref_out, ref_lse = fk._prefix_dense(q, k, v, layout, 0.125)  # (float32)
    seen = torch.isfinite(ref_lse)  # a row with nothing committed: FlashAttention's value there is not read
    rows_seen = seen[0, 0]
    out, ref_out = out.float()[:, :, rows_seen], ref_out[:, :, rows_seen]
    assert torch.allclose(out, ref_out, atol=2e-2), (out - ref_out).abs().max()
    assert torch.allclose(lse[seen].float(), ref_lse[seen], atol=1e-2), (lse[seen] - ref_lse[seen]).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_flash_split_fused_merge_matches_the_torch_operations_on_cuda(dtype: torch.dtype, monkeypatch) -> None:
    """Part (b) and the merge as one Triton kernel against the torch operations, on the GPU (any
    prefix kernel: where FlashAttention 4 is missing, the dense product)."""
    pytest.importorskip("triton", reason="the fused merge needs Triton")
    import specdraft.model.attention as attention

    layout, q, k, v = _flash_layout_case(dtype, seed=1)
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(attention, "TRITON_MERGE", fused)
        outs.append(attention.tree_flash_attention(torch.nn.Module(), q, k, v, None, scaling=0.125,
                                                   specdraft_flash_layout=layout)[0].float())
    assert torch.allclose(outs[0], outs[1], atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_flash4_decoding_in_cuda_graphs_matches_sdpa(monkeypatch) -> None:
    """The flash backend on FlashAttention 4: decode forwards captured as CUDA graphs with the
    variable-length call inside, alone and batched; greedy tokens as sdpa's up to near-ties
    (:func:`assert_greedy_up_to_near_ties`)."""
    _needs_flash4()
    import specdraft.model.flash_kernels as fk

    calls: list[int] = []
    varlen = fk._fa4_varlen()
    monkeypatch.setattr(fk, "_fa4_varlen", lambda: lambda *a, **k: (calls.append(1), varlen(*a, **k))[1])
    sdpa = wide_cuda_model(torch.bfloat16)
    flash = copy.deepcopy(sdpa)
    dec = Decoder(flash, None, max_tree_nodes=16, adaptive_budget=False, attention="flash")
    prompts = [PROMPT, PROMPT[:8], PROMPT[3:]]
    outs = [dec.generate(PROMPT, max_new_tokens=NEW), *dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)]
    static = dec.runner.static
    assert static is not None and static.captured, static.note if static else "no static path"
    assert calls
    for prompt, out in zip([PROMPT, *prompts], outs):
        assert_greedy_up_to_near_ties(sdpa, prompt, out.token_ids)


def test_real_model_greedy_identity_on_cuda() -> None:
    from specdraft.models import load_model

    name = os.environ.get("SPECDRAFT_TEST_MODEL", "qwen2.5-coder-0.5b")
    try:
        model, tokenizer = load_model(name, dtype="float32", device="cuda", progress=False)
    except Exception as exc:  # noqa: BLE001 - no network on a GPU machine: say what is missing
        pytest.skip(f"the real model {name!r} is not available here ({type(exc).__name__}: {exc})")
    prompt = tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    out = Decoder(model, tokenizer).generate(prompt, max_new_tokens=96)
    assert out.token_ids == generate_greedy(model, prompt, 96)


def test_bench_runs_on_a_cuda_model(tmp_path: Path) -> None:
    from test_bench import run_bench_on_device

    summary = run_bench_on_device(tmp_path, "cuda")
    assert summary["config"]["methods"] == ["baseline", "specdraft:prompt"]


def test_drafting_pauses_on_cuda_stay_exact() -> None:
    from test_draft_pause import PROMPTS, DearGuess, SimulatedClock

    class StepCharged(DearGuess):
        """Charges the clock per step too: a captured forward runs no hook that could."""

        def observe(self, feedback) -> None:
            self.clock.now += 0.004
            super().observe(feedback)

    model = cuda_model("llama")
    clock = SimulatedClock()
    dec = Decoder(model, None, sources=[StepCharged(clock, 0.002)], max_tree_nodes=16)
    dec.clock = clock
    out = dec.generate(PROMPTS[0], max_new_tokens=48)
    assert out.token_ids == generate_greedy(model, PROMPTS[0], 48)
    assert out.stats.skipped_drafts > 0


# the compiled forwards last: each compile takes tens of seconds, so a time limit cuts these first
def test_compiled_decode_forwards_on_cuda_equal_generate() -> None:
    """``compile=True``: the decode forwards run through ``torch.compile`` (inductor's kernels)
    and are captured per width; greedy output in float32 stays ``model.generate``'s, alone and
    batched, and nothing fell back (the compile ran, every width replays a graph)."""
    from specdraft.model.static import CompiledPass

    model = cuda_model("qwen2")
    dec = Decoder(model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=16, compile=True)
    assert dec.generate(PROMPT, max_new_tokens=NEW).token_ids == generate_greedy(model, PROMPT, NEW)
    prompts = [PROMPT, PROMPT[:8], PROMPT[3:]]
    result = dec.generate_batch(prompts, max_new_tokens=NEW, concurrency=3)
    assert [o.token_ids for o in result] == [generate_greedy(model, p, NEW) for p in prompts]
    static = dec.runner.static
    assert isinstance(static.model_pass, CompiledPass) and static.captured and static.note == "", static.note


def test_compiled_bfloat16_decoding_on_cuda_runs_without_exact_mode_and_agrees_with_uncompiled() -> None:
    """bfloat16 with ``compile=True``: exact mode is off by default (it would be on without
    compile), the forwards compile and replay, and greedy tokens agree with the uncompiled
    decoder's except where rounding parts them at a near-tie (checked on the margins)."""
    model = wide_cuda_model(torch.bfloat16)
    compiled = Decoder(model, None, sources=make_sources(list(DEFAULT_SOURCES)), max_tree_nodes=24, compile=True)
    assert not compiled.exact
    plain = Decoder(model, None, sources=[], max_tree_nodes=0, exact=False)
    prompt = repetitive_prompt(0)
    out = compiled.generate(prompt, max_new_tokens=48).token_ids
    ref = plain.generate(prompt, max_new_tokens=48).token_ids
    static = compiled.runner.static
    assert static.captured and static.note == "", static.note
    parted = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if parted is not None:  # a near-tie at the first difference, read from the uncompiled model
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ref[:parted]], device="cuda")).logits[0, -1].float()
        top = logits.topk(2).values
        assert float(top[0] - top[1]) <= 0.125, (parted, out, ref)
