"""Exact attention at fixed shapes (what a GPU runs, so that a CUDA graph can capture it), on a CPU.

Off the CPU the exact attention lays out its rows on the device at shapes fixed by the forward's
row and column counts, with no host read (``exact_attention.FIXED_SHAPES`` forces that layout here).
What a CPU can check is checked: every row equals a one-row call over its visible keys alone, at
any row count, among masked keys, with the region moved by whole chunks or the store grown; the
values equal ``sdpa``'s to rounding; the layout runs on shapeless ``meta`` tensors (no host read,
no shape that depends on the mask); KV-store regions start at chunk boundaries in exact mode; and
a decoder set up as on a GPU (fixed-width buckets, forwards "captured" and replayed) gives exact
plain decoding's tokens in bfloat16, alone and batched. On CUDA the same layout runs as Triton
kernels (``specdraft.model.exact_triton``): here they run in Triton's interpreter, in a fresh
process, through the same checks, and they are compiled to H100 and A100 code to show that they
build there.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import specdraft.model.exact_attention as exact
from specdraft import BatchRequest, Decoder
from specdraft.engine.widths import exact_buckets
from specdraft.kernels.exact_rows import load_or_probe
from specdraft.model.exact_attention import CHUNK, exact_attention
from specdraft.model.kv_store import KVStore
from specdraft.model.static import Buckets
from specdraft.simulated_device import SimulatedDevice
from specdraft.sources.registry import make_sources

from conftest import (AttentionModule, RerunGraph, ancestor_block, check_exact_attention_matches_sdpa, exact_attend,
                      in_triton_interpreter, random_tree, repetitive_prompt, tiny_model, wide_llama)

NEW = 40


@pytest.fixture(autouse=True)
def fixed_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact, "FIXED_SHAPES", True)
    monkeypatch.setattr(exact, "TRITON", False)


def _in_triton_interpreter(check: str, sanitize_overflow: bool = True) -> None:
    """``check`` on the fixed shapes as Triton kernels, in Triton's interpreter."""
    in_triton_interpreter("test_exact_fixed", "t.exact.FIXED_SHAPES = True; t.exact.TRITON = True", check,
                          sanitize_overflow)


def _with_columns_before(x: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([torch.randn(*x.shape[:2], count, x.shape[3], generator=gen).to(x.dtype), x], dim=2)


@pytest.mark.parametrize("heads,kv_heads,dim,cache_len", [(14, 2, 64, 130), (4, 4, 8, 5), (6, 1, 16, 200),
                                                           (14, 2, 64, 5 * CHUNK + 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_fixed_rows_depend_only_on_their_visible_keys(heads: int, kv_heads: int, dim: int, cache_len: int,
                                                      threads: int) -> None:
    """Against single-row calls over the row's keys alone: any number of rows, interleaved masked
    keys (a tree), the region moved by whole chunks, more store columns after it; in float32,
    bfloat16 and float16, on 1 and 2 threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            gen = torch.Generator().manual_seed(heads * dim + cache_len)
            n = 24
            k = torch.randn(1, kv_heads, cache_len + n, dim, generator=gen).to(dtype)
            v = torch.randn(1, kv_heads, cache_len + n, dim, generator=gen).to(dtype)
            q = torch.randn(1, n, heads, dim, generator=gen).to(dtype).transpose(1, 2)
            allowed = np.concatenate([np.ones((n, cache_len), dtype=bool), ancestor_block(random_tree(n, dim))], axis=1)
            alone = []
            for r in range(n):
                cols = np.flatnonzero(allowed[r])
                alone.append(exact_attend(q[:, :, r : r + 1], k[:, :, cols], v[:, :, cols], None)[0])
            for m in (1, 2, 3, 5, 24):
                out = exact_attend(q[:, :, :m], k[:, :, : cache_len + m], v[:, :, : cache_len + m],
                              allowed[:m, : cache_len + m])
                bad = [r for r in range(m) if not torch.equal(out[r], alone[r])]
                assert not bad, f"{dtype}, {m} rows: rows {bad} differ from their single-row results"
            for before, after in ((CHUNK, 0), (2 * CHUNK, 100), (0, 7 * CHUNK + 1)):
                moved_k = _with_columns_before(torch.cat([k, torch.randn(1, kv_heads, after, dim).to(dtype)], 2),
                                               before, gen)
                moved_v = _with_columns_before(torch.cat([v, torch.randn(1, kv_heads, after, dim).to(dtype)], 2),
                                               before, gen)
                mask = np.concatenate([np.zeros((n, before), dtype=bool), allowed, np.zeros((n, after), dtype=bool)],
                                      axis=1)
                out = exact_attend(q, moved_k, moved_v, mask)
                bad = [r for r in range(n) if not torch.equal(out[r], alone[r])]
                assert not bad, f"{dtype}: {before} columns before, {after} after: rows {bad} differ"
    finally:
        torch.set_num_threads(saved)


def test_a_region_off_a_chunk_boundary_rounds_otherwise() -> None:
    """Teeth for the store's alignment: the same keys 7 columns later give the same values to
    rounding but other bits in some row (so regions must start at chunk boundaries)."""
    gen = torch.Generator().manual_seed(14 * 64 + 130)
    n, cache_len = 24, 130
    k = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, n, 14, 64, generator=gen).to(torch.bfloat16).transpose(1, 2)
    allowed = np.concatenate([np.ones((n, cache_len), dtype=bool), ancestor_block(random_tree(n, 64))], axis=1)
    out = exact_attend(q, k, v, allowed)
    mask = np.concatenate([np.zeros((n, 7), dtype=bool), allowed], axis=1)
    moved = exact_attend(q, _with_columns_before(k, 7, gen), _with_columns_before(v, 7, gen), mask)
    assert torch.allclose(out.float(), moved.float(), atol=1e-2)
    assert not torch.equal(out, moved)


def test_fixed_attention_matches_sdpa_to_rounding() -> None:
    """The same attention as ``sdpa`` up to float32 rounding, for any mask and without one
    (causal); a row that sees nothing gets zeros."""
    check_exact_attention_matches_sdpa()


def test_fixed_layout_reads_nothing_back_from_the_device() -> None:
    """On ``meta`` tensors (shapes without values) the fixed layout runs through: nothing in it
    reads a value on the host or makes a shape from one, which a CUDA graph could not capture. The
    host layout cannot (teeth)."""
    meta = torch.device("meta")
    q = torch.empty(1, 14, 8, 64, device=meta, dtype=torch.bfloat16)
    k = torch.empty(1, 2, 300, 64, device=meta, dtype=torch.bfloat16)
    mask = torch.empty(1, 1, 8, 300, device=meta, dtype=torch.bool)
    out, _ = exact_attention(AttentionModule(7), q, k, k, mask)
    assert out.shape == (1, 8, 14, 64) and out.device == meta
    exact.FIXED_SHAPES = False
    with pytest.raises(NotImplementedError):
        exact_attention(AttentionModule(7), q, k, k, mask)


def test_the_layout_is_laid_out_once_per_mask() -> None:
    """Every layer of a forward gets the same mask object and reuses its layout; a new mask (even
    one with the same values) is laid out anew."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, 8, generator=gen)
    k = torch.randn(1, 2, 70, 8, generator=gen)
    mask = torch.ones(1, 1, 3, 70, dtype=torch.bool)
    first = exact_attend(q, k, k, mask[0, 0])
    made = []
    layouts = exact._PerMask()
    key = (1, 3, 70)
    kept = layouts.get(mask, key, lambda: made.append(1) or object())
    assert layouts.get(mask, key, lambda: made.append(1) or object()) is kept and len(made) == 1
    assert layouts.get(mask.clone(), key, lambda: made.append(1) or object()) is not kept and len(made) == 2
    other = mask.clone()
    other[0, 0, 1, 5:] = False
    changed = exact_attend(q, k, k, other[0, 0])
    assert torch.equal(changed[0], first[0]) and not torch.equal(changed[1], first[1])


def test_store_regions_start_at_chunk_boundaries_when_aligned() -> None:
    store = KVStore()
    store.align = CHUNK
    regions = [store.allocate(n) for n in (10, 70, 1, 64)]
    assert [r.start for r in regions] == [0, CHUNK, 3 * CHUNK, 4 * CHUNK]
    store.release(regions[1])
    assert store.allocate(20).start == CHUNK  # first fit, at a boundary
    plain = KVStore()
    assert [plain.allocate(n).start for n in (10, 70)] == [0, 10]


@functools.lru_cache(maxsize=None)
def _model(layers: int = 2):
    model = wide_llama(torch.bfloat16, layers=layers)
    model.generation_config.eos_token_id = None
    return model


def _as_on_a_gpu(dec: Decoder, widths: tuple[int, ...] | None = None) -> Decoder:
    """What the decoder does on a GPU in exact mode: every decode forward at a bucket width where
    the rule holds (the GPU's buckets, or those of ``widths``), from static buffers, each width
    "captured" (:class:`RerunGraph`)."""
    rule = load_or_probe(dec.model, dec.packed_weights)
    held = exact_buckets(rule) if widths is None else tuple(w for w in widths if w in rule.widths)
    buckets = Buckets(held, mixes_prompts=rule.wider)
    dec.runner.use_static(buckets.widths, capture=True, graph_kind=RerunGraph)
    dec.engine.padding = buckets
    return dec


def test_exact_mode_at_fixed_shapes_equals_exact_plain_decoding() -> None:
    """bfloat16, the 896-wide model: speculation through captured fixed-width forwards gives the
    tokens of exact plain decoding through them, alone and batched (regions side by side)."""
    plain = _as_on_a_gpu(Decoder(_model(), sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock"))
    # a fixed budget: every step checks a tree, whatever this machine's measured step costs say
    dec = _as_on_a_gpu(Decoder(_model(), sources=make_sources(["prompt", "trie", "ngram", "suffix"]),
                               max_tree_nodes=24, exact=True, cpu_kernels="stock", adaptive_budget=False))
    expected = {s: plain.generate(repetitive_prompt(s), max_new_tokens=NEW).token_ids for s in range(6)}
    for s in range(3):
        out = dec.generate(repetitive_prompt(s), max_new_tokens=NEW)
        assert out.token_ids == expected[s], s
        assert out.stats.steps < NEW  # trees were checked
    result = dec.generate_batch([BatchRequest(repetitive_prompt(s), max_new_tokens=NEW) for s in range(2, 6)],
                                concurrency=3)
    assert [o.token_ids for o in result] == [expected[s] for s in range(2, 6)]
    static = dec.runner.static
    assert static.captured and static.note == ""
    assert dec.runner.store.align == CHUNK



def test_exact_mode_on_a_simulated_gpu_reads_once_per_step() -> None:
    """The decoder on a simulated CUDA device in exact mode (its GPU set-up: buckets where the rule
    holds, static buffers, aligned regions, the fixed layout): one read and one upload per step, as
    outside exact mode, and exact plain decoding's tokens."""
    from specdraft.simulated_device import SimulatedDevice

    model = wide_llama(torch.bfloat16)
    model.generation_config.eos_token_id = None
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim:
        plain = Decoder(model, None, sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock")
        dec = Decoder(model, None, sources=make_sources(["prompt", "ngram", "suffix"]), max_tree_nodes=16,
                      adaptive_budget=False, exact=True, cpu_kernels="stock")
        assert dec.runner.static is not None and dec.runner.store.align == CHUNK
        expected = plain.generate(repetitive_prompt(0), max_new_tokens=24).token_ids
        sim.reset_counts()
        out = dec.generate(repetitive_prompt(0), max_new_tokens=24)
        assert out.token_ids == expected and out.stats.steps < 24
        assert sim.counts.syncs == out.stats.steps, sim.counts.log
        assert sim.counts.uploads <= out.stats.steps, sim.counts.log


def test_triton_that_cannot_run_is_found_once_and_exact_mode_on_cuda_refuses_without_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the Triton kernels run on a device is asked once (one small call) and the reason
    kept; on CUDA without them exact attention refuses, naming why, since its torch layout is not
    row-invariant on cuBLAS (measured on an H100); ``TRITON = False`` runs that layout on purpose;
    a kernel that fails mid-run raises rather than switching layouts."""
    import specdraft.model.exact_triton as kernel

    monkeypatch.setattr(exact, "TRITON", None)
    monkeypatch.setattr(exact, "TRITON_NOTE", {})
    monkeypatch.setattr(exact, "_TRITON_RUNS", {})
    monkeypatch.setattr(kernel, "available", lambda: True)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(kernel, "attend", broken)
    assert not exact.triton_runs_on(torch.device("cpu")) and not calls  # no CUDA device: nothing to try
    cuda = torch.device("cuda", 0)
    assert not exact.triton_runs_on(cuda) and not exact.triton_runs_on(cuda)
    assert list(exact.TRITON_NOTE) == ["cuda:0"] and exact.TRITON_NOTE["cuda:0"]  # asked once, and why
    with pytest.raises(exact.ExactAttentionError, match="not row-invariant.*cannot run here"):
        exact.check_exact_runs_on(cuda)
    exact.check_exact_runs_on(torch.device("cpu"))
    exact.TRITON = False
    exact.check_exact_runs_on(cuda)
    exact.TRITON = True
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, 3, 8, generator=gen), torch.randn(1, 2, 70, 8, generator=gen)
    with pytest.raises(exact.ExactAttentionError, match="Triton kernels of exact attention failed.*no kernel here"):
        exact_attend(q, k, k, None)


def test_exact_mode_is_the_default_for_bfloat16_on_cuda_where_the_triton_kernels_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The default follows the measured price: bfloat16 and float16 on a CPU; bfloat16 on CUDA
    where the kernels run (free on an H100); never float32; and a decoder asked for exact mode on
    CUDA without the kernels refuses before its first forward."""
    from specdraft.engine.widths import exact_default

    class Placed:
        def __init__(self, device: str, dtype: torch.dtype) -> None:
            self.device, self.dtype = torch.device(device), dtype

    monkeypatch.setattr(exact, "TRITON", None)
    monkeypatch.setattr(exact, "_TRITON_RUNS", {"cuda:0": False})
    monkeypatch.setattr(exact, "TRITON_NOTE", {"cuda:0": "RuntimeError: no driver"})
    model = copy.deepcopy(tiny_model("llama", "sdpa")).to(torch.bfloat16)
    sim = SimulatedDevice()
    sim.adopt(model)
    with sim:
        assert not Decoder(model, None).exact
        with pytest.raises(exact.ExactAttentionError, match="no driver"):
            Decoder(model, None, exact=True)
    monkeypatch.setattr(exact, "_TRITON_RUNS", {"cuda:0": True})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert exact_default(Placed("cpu", torch.bfloat16), "auto") and exact_default(Placed("cpu", torch.float16), "auto")
    assert exact_default(Placed("cuda:0", torch.bfloat16), "auto")
    assert not exact_default(Placed("cuda:0", torch.bfloat16), "sdpa")
    assert not exact_default(Placed("cuda:0", torch.float16), "auto")
    assert not exact_default(Placed("cpu", torch.float32), "auto")
    assert not exact_default(Placed("cuda:0", torch.float32), "auto")
    monkeypatch.setattr(exact, "_TRITON_RUNS", {"cuda:0": False})
    assert not exact_default(Placed("cuda:0", torch.bfloat16), "auto")


# -- the same, in the Triton kernel ----------------------------------------------------------------


def test_triton_rows_depend_only_on_their_visible_keys() -> None:
    _in_triton_interpreter("_triton_rows")


def _triton_kernels() -> str | None:
    """The CPU kernels whose rule holds every one of :data:`TRITON_WIDTHS` (``None``: none):
    stock where it does, as on an AMD EPYC; else FBGEMM's, which give every width alike on an
    Intel Xeon with AMX, where the stock bfloat16 kernel pads to 37 rows."""
    from specdraft.kernels.cpu_kernels import CpuKernelError, check_cpu_kernels, packed_model

    model = _model(1)
    if set(TRITON_WIDTHS) <= set(load_or_probe(model).widths):
        return "stock"
    try:
        check_cpu_kernels(model, "fbgemm")
    except CpuKernelError:
        return None
    return "fbgemm" if set(TRITON_WIDTHS) <= set(load_or_probe(model, packed_model(model, "fbgemm")).widths) else None


def test_triton_exact_mode_equals_exact_plain_decoding() -> None:
    if _triton_kernels() is None:
        pytest.skip(f"neither this CPU's stock bfloat16 linear layers nor FBGEMM's hold the widths "
                    f"{TRITON_WIDTHS} the Triton interpreter runs in time")
    # the interpreter's check of every integer operation for overflow (which a GPU build runs only
    # in debug mode) stays on in the row check above, over the same kernels and index arithmetic
    # with more keys; here it would only slow each of the decoding's forwards
    _in_triton_interpreter("_triton_decoding", sanitize_overflow=False)


def _triton_rows() -> None:
    """The kernel's rows equal one-row calls over their keys alone: any number of rows, a tree's
    masked keys, the keys at any column offset (the kernel reads them through the rank table), a
    walk in several segments, in bfloat16 and float32; and its values equal ``sdpa``'s to rounding."""
    gen = torch.Generator().manual_seed(5)
    n, cache_len = 12, 300  # rows walked in two segments
    for dtype in (torch.bfloat16, torch.float32):
        k = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(dtype)
        v = torch.randn(1, 2, cache_len + n, 64, generator=gen).to(dtype)
        q = torch.randn(1, n, 14, 64, generator=gen).to(dtype).transpose(1, 2)
        allowed = np.concatenate([np.ones((n, cache_len), dtype=bool), ancestor_block(random_tree(n, 7))], axis=1)
        alone = [exact_attend(q[:, :, r : r + 1], k[:, :, np.flatnonzero(allowed[r])],
                              v[:, :, np.flatnonzero(allowed[r])], None)[0] for r in range(n)]
        for m in (1, 5, n):
            out = exact_attend(q[:, :, :m], k[:, :, : cache_len + m], v[:, :, : cache_len + m],
                               allowed[:m, : cache_len + m])
            assert all(torch.equal(out[r], alone[r]) for r in range(m)), (dtype, m)
        mask = np.concatenate([np.zeros((n, 7), dtype=bool), allowed], axis=1)
        out = exact_attend(q, _with_columns_before(k, 7, gen), _with_columns_before(v, 7, gen), mask)
        assert all(torch.equal(out[r], alone[r]) for r in range(n)), dtype
    test_fixed_attention_matches_sdpa_to_rounding()


#: narrower buckets than a GPU's (and one layer): the interpreter's time goes by rows
TRITON_WIDTHS = (2, 4, 8, 16)


def _triton_decoding() -> None:
    """Decoding through "captured" fixed-width forwards on the kernel: speculation gives exact plain
    decoding's tokens, alone and batched."""
    widths, kernels = TRITON_WIDTHS, _triton_kernels()
    # plain decoding steps one row at a time: its narrowest bucket alone is captured (the rule makes
    # a row's bits the same at every width it holds, which is what this checks)
    plain = _as_on_a_gpu(Decoder(_model(1), sources=[], max_tree_nodes=0, exact=True, cpu_kernels=kernels), widths[:1])
    dec = _as_on_a_gpu(Decoder(_model(1), sources=make_sources(["prompt", "ngram", "suffix"]), max_tree_nodes=8,
                               adaptive_budget=False, exact=True, cpu_kernels=kernels), widths)
    assert dec.engine.padding.widths[-1] == 16
    new = 10
    prompts = [repetitive_prompt(s) for s in (0, 1)]
    expected = [plain.generate(p, max_new_tokens=new).token_ids for p in prompts]
    out = dec.generate(prompts[0], max_new_tokens=new)
    assert out.token_ids == expected[0]
    assert out.stats.steps < new  # trees were checked
    result = dec.generate_batch(prompts[::-1], max_new_tokens=new, concurrency=2)
    assert [o.token_ids for o in result] == expected[::-1]
    assert exact.TRITON_NOTE == {}


def test_the_price_script_runs_and_checks_against_sdpa(tmp_path: Path) -> None:
    """``benchmarks/exact_attention_price.py`` on the CPU (its GPU run replays CUDA graphs): every
    mode timed and within bfloat16 rounding of ``sdpa``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import exact_attention_price

    assert exact_attention_price.main(["--device", "cpu", "--widths", "1,8", "--capacities", "256", "--layers", "2",
                                       "--repeats", "1", "--modes", "sdpa,hf-sdpa,hf-eager,torch", "--out",
                                       str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "price.json").read_text())["rows"]
    assert [(r["width"], r["capacity"]) for r in rows] == [(1, 256), (8, 256)]
    assert all(r["torch"]["ms_per_forward"] > 0 and r["torch"]["max_abs_vs_sdpa"] < 1e-2 for r in rows)
    # transformers' sdpa function is the same kernel; its eager one rounds the probabilities to
    # bfloat16 before the product, so it differs by a few bfloat16 steps
    assert all(r["hf-sdpa"]["max_abs_vs_sdpa"] < 1e-2 and r["hf-eager"]["max_abs_vs_sdpa"] < 3e-2 for r in rows)
    assert "| 256 | 8 |" in (tmp_path / "price.md").read_text()


@pytest.mark.parametrize("dtype,dim,groups", [("bf16", 64, 7), ("fp16", 128, 4), ("fp32", 64, 1)])
def test_triton_kernels_compile_for_hopper_and_ampere(dtype: str, dim: int, groups: int) -> None:
    """Without a GPU, Triton still compiles the kernels to GPU code (``sm_90``: H100/H200;
    ``sm_80``: A100): what the interpreter cannot show (types, shapes a real ``tl.dot`` accepts).
    The products are float32 FMAs, no tensor-core MMA (``input_precision="ieee"``: no TF32), and
    nothing spills to local memory."""
    pytest.importorskip("triton", reason="the Triton kernel needs the triton package (pip install triton)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specdraft.model import exact_triton as kernel

    pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "Order": "*i32", "Count": "*i32",
                "Acc": "*fp32", "Top": "*fp32", "Total": "*fp32", "Out": "*fp32", "scale": "fp32"}
    blocks = dict(GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)), D=dim,
                  BLOCK_D=max(16, triton.next_power_of_2(dim)), SEGMENT=kernel.SEGMENT)
    for jit, constants in ((kernel._segment_kernel, {**blocks, "STEP": kernel.CHUNK}), (kernel._combine_kernel, blocks)):
        names = list(jit.arg_names)
        signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
        source = ASTSource(fn=jit, signature=signature, constexprs={(names.index(n),): v for n, v in constants.items()})
        for arch in (90, 80):
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
            ptx = compiled.asm["ptx"]
            assert compiled.asm["cubin"], (jit.__name__, arch)
            assert "mma" not in ptx and ".local" not in ptx, (jit.__name__, arch)
