"""Exact mode: in bfloat16 and float16, speculation gives the very tokens of plain decoding.

The model is issue 43's random 896-wide Llama (two layers, MLP 4864, 14 heads on 2 key/value
heads, vocabulary 512): wide enough that a forward of several rows computes a row's logits in
other last bits than a one-row forward, so that without exact mode speculation parts from plain
decoding at near-ties on most prompts. With ``exact=True`` (the default for these dtypes on a
CPU where it costs little) every decode forward is padded to a width at which the linear and normalization layers compute
every row alike
and the attention is :mod:`specdraft.model.exact_attention`: speculation, alone or batched, greedy
or sampled, equals exact plain decoding token for token, whatever the sources proposed.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdraft import BatchRequest, Decoder
from specdraft.kernels import exact_rows
from specdraft.kernels.exact_rows import RowRule
from specdraft.sources.registry import SOURCES, make_sources

from conftest import FAST, repetitive_prompt, wide_llama

NEW = 32


@functools.lru_cache(maxsize=None)
def wide_model(dtype: torch.dtype):
    model = wide_llama(dtype)
    model.generation_config.eos_token_id = None  # run every prompt to its token limit
    return model


@functools.lru_cache(maxsize=None)
def plain_exact(dtype: torch.dtype, seed: int, new: int = NEW) -> tuple[int, ...]:
    """Exact plain decoding (no sources, no tree) of prompt ``seed``."""
    dec = Decoder(wide_model(dtype), sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock")
    return tuple(dec.generate(repetitive_prompt(seed), max_new_tokens=new).token_ids)


def speculative(dtype: torch.dtype, names: list[str], exact: bool, **options) -> Decoder:
    return Decoder(wide_model(dtype), sources=make_sources(names), max_tree_nodes=24, exact=exact,
                   cpu_kernels="stock", **options)


def test_exact_mode_by_default_says_why_and_refuses_what_it_cannot_run() -> None:
    """By default on a CPU exact mode is on where this machine's price is low
    (``tests/test_exact_kernels.py``): either way the decoder says which and why (on the stock
    kernels, whose rules the tests here probe anyway: one path to measure, none to choose)."""
    for dtype in (torch.bfloat16, torch.float16):
        dec = Decoder(wide_model(dtype), sources=[], max_tree_nodes=0, cpu_kernels="stock")
        assert dec.exact_note.startswith("exact mode on:" if dec.exact else "exact mode off")
        assert "at most 5%" in dec.exact_note or "no kernel path gives every row alike" in dec.exact_note
    from conftest import tiny_model

    assert not Decoder(tiny_model("llama"), max_tree_nodes=4).exact  # float64: exact against generate already
    with pytest.raises(ValueError, match="attention='sdpa'"):
        Decoder(wide_model(torch.bfloat16), sources=[], exact=True, attention="sdpa")
    with pytest.raises(ValueError, match="exact must be"):
        Decoder(wide_model(torch.bfloat16), sources=[], exact="yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_without_exact_mode_speculation_parts_from_plain_decoding(dtype: torch.dtype) -> None:
    """Teeth: the effect exact mode removes is there on this model (so the tests below can fail)."""
    inexact_plain = Decoder(wide_model(dtype), sources=[], max_tree_nodes=0, exact=False, cpu_kernels="stock")
    dec = speculative(dtype, ["prompt", "trie", "ngram", "suffix"], exact=False, adaptive_budget=False)
    # float16's near-ties are rarer: prompt 11 parts on an AVX2 EPYC; the kernels' orders differ
    # between CPUs, and where none of these prompts parts, this dtype's tests have no teeth here
    seeds = range(6) if dtype == torch.bfloat16 else (11, *range(11))
    # (any() stops at the first prompt that parts: the rest would cost time and prove nothing more)
    parts = any(dec.generate(repetitive_prompt(s), max_new_tokens=64).token_ids
                != inexact_plain.generate(repetitive_prompt(s), max_new_tokens=64).token_ids for s in seeds)
    if not parts and dtype == torch.float16:
        pytest.skip("float16 speculation gave plain decoding's tokens on every prompt with this CPU's kernels")
    assert parts


@settings(FAST, max_examples=5)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), seed=st.integers(0, 30),
       names=st.lists(st.sampled_from(sorted(SOURCES)), min_size=1, max_size=3, unique=True),
       adaptive=st.booleans())
def test_exact_speculation_equals_exact_plain_decoding(dtype, seed, names, adaptive) -> None:
    dec = speculative(dtype, names, exact=True, adaptive_budget=adaptive)
    out = dec.generate(repetitive_prompt(seed), max_new_tokens=NEW)
    assert tuple(out.token_ids) == plain_exact(dtype, seed)
    if not adaptive:  # trees were really checked (an adaptive budget may judge them dear on a
        assert out.stats.steps < NEW  # machine, and a source that must warm up never drafts then)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_batched_request_does_not_depend_on_what_else_is_in_the_batch(dtype) -> None:
    seeds = [3, 4, 5, 6]
    dec = speculative(dtype, ["prompt", "trie", "ngram", "suffix"], exact=True)
    requests = [BatchRequest(repetitive_prompt(s), max_new_tokens=NEW - 4 * i) for i, s in enumerate(seeds)]
    result = dec.generate_batch(requests, concurrency=3)
    for i, (s, out) in enumerate(zip(seeds, result)):
        assert out.error is None
        assert tuple(out.token_ids) == plain_exact(dtype, s, NEW - 4 * i), s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_exact_sampling_with_a_seed_gives_the_tokens_of_exact_plain_sampling(dtype) -> None:
    options = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=11)
    plain = Decoder(wide_model(dtype), sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock")
    dec = speculative(dtype, ["prompt", "ngram", "suffix"], exact=True)
    for s in (0, 1):
        expected = plain.generate(repetitive_prompt(s), max_new_tokens=NEW, **options).token_ids
        assert dec.generate(repetitive_prompt(s), max_new_tokens=NEW, **options).token_ids == expected
    # and batched, on the rows chosen all at once (the device path) against plain decoding on it too
    plain.row_choices = dec.row_choices = "batched"
    expected = [plain.generate(repetitive_prompt(s), max_new_tokens=NEW, **options).token_ids for s in (0, 1, 2)]
    got = dec.generate_batch([repetitive_prompt(s) for s in (0, 1, 2)], max_new_tokens=NEW, concurrency=3, **options)
    assert [o.token_ids for o in got] == expected


def test_the_model_keeps_its_own_attention_outside_a_call() -> None:
    """The exact attention is the decoder's for its calls only: afterwards ``model.generate`` and a
    decoder without exact mode over the same model run the model's own ``sdpa`` (their outputs
    are what they are on a model no exact decoder ever touched)."""
    model = wide_model(torch.bfloat16)
    untouched = Decoder(wide_llama(torch.bfloat16), sources=[], max_tree_nodes=0, exact=False, cpu_kernels="stock")
    expected = untouched.generate(repetitive_prompt(1), max_new_tokens=12).token_ids
    exact = speculative(torch.bfloat16, ["prompt"], exact=True)
    assert model.config._attn_implementation == "sdpa"
    exact.generate(repetitive_prompt(1), max_new_tokens=12)
    assert model.config._attn_implementation == "sdpa"
    list(exact.stream(repetitive_prompt(2), max_new_tokens=6))
    exact.generate_batch([repetitive_prompt(1), repetitive_prompt(2)], max_new_tokens=6, concurrency=2)
    assert model.config._attn_implementation == "sdpa"
    inexact = Decoder(model, sources=[], max_tree_nodes=0, exact=False, cpu_kernels="stock")
    assert inexact.generate(repetitive_prompt(1), max_new_tokens=12).token_ids == expected


class WideRowsDiffer(torch.nn.Linear):
    """A linear layer whose kernel computes a forward of more than 64 rows in other bits than a
    narrower one, as a GPU library does where it picks another kernel for a taller matrix: the
    probe then finds wide forwards disagreeing (the rule is not ``wider``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * (1 + 2**-6) if x.numel() // x.shape[-1] > 64 else out


@functools.lru_cache(maxsize=None)
def wide_rows_differ_model(dtype: torch.dtype):
    import copy

    model = copy.deepcopy(wide_model(dtype))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                swapped = WideRowsDiffer(child.in_features, child.out_features, child.bias is not None,
                                         dtype=child.weight.dtype)
                swapped.load_state_dict(child.state_dict())
                setattr(module, name, swapped)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_prompts_run_alone_where_wide_forwards_differ(dtype) -> None:
    """Where forwards wider than 64 rows compute rows in other bits, requests admitted together
    must not prefill their prompts in one wide forward (nor next to other requests' trees): each
    prompt runs whole and alone, as when its request runs by itself, and every decode step stays
    within 64 rows. Then a batched request's exact output is still its exact plain output."""
    model = wide_rows_differ_model(dtype)
    plain = Decoder(model, sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock")
    assert plain.engine.padding is not None and not plain.engine.padding.mixes_prompts
    assert plain.engine.padding.widest == 64
    seeds = [3, 4, 5, 6, 7]
    expected = [plain.generate(repetitive_prompt(s), max_new_tokens=NEW).token_ids for s in seeds]
    dec = Decoder(model, sources=make_sources(["prompt", "trie", "ngram", "suffix"]), max_tree_nodes=24,
                  exact=True, cpu_kernels="stock")
    result = dec.generate_batch([repetitive_prompt(s) for s in seeds], max_new_tokens=NEW, concurrency=4)
    assert [out.token_ids for out in result] == expected


def _reordered_rms_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's forward, with the variance a little otherwise below ``self.cut`` rows: what
    torch's CUDA reduction does to a row's mean when fewer rows share a launch."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    if hidden.numel() // hidden.shape[-1] < self.cut:
        variance = variance * (1 + 2.0 ** -12)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def test_exact_mode_pads_past_the_widths_where_a_norm_rounds_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose RMSNorms round otherwise below ``cut`` rows (as on CUDA below 16): exact mode
    pads every forward to ``cut`` rows and more, and speculation gives exact plain decoding's tokens;
    with the rule the linear layers alone give (pad to 2 rows and more) it does not (the test has
    teeth). ``cut`` is 16, or past the linear layers' own narrowest width where this CPU's kernels
    already pad further (so that the norms decide it)."""
    linear_rule = exact_rows.probe_rule(exact_rows.linear_layers(wide_llama(torch.bfloat16)), torch.bfloat16)
    cut = 16 if linear_rule.min_rows < 16 else next(w for w in linear_rule.widths if w > linear_rule.min_rows)

    def reordered_model(cut: int) -> torch.nn.Module:
        model = wide_llama(torch.bfloat16)
        model.generation_config.eos_token_id = None
        for norm in exact_rows.norm_layers(model):
            norm.__class__ = type(f"Reordered{type(norm).__name__}", (type(norm),),
                                  {"forward": _reordered_rms_norm, "cut": cut})
        return model

    def outputs(model: torch.nn.Module) -> tuple[list[list[int]], list[list[int]], int]:
        plain = Decoder(model, sources=[], max_tree_nodes=0, exact=True, cpu_kernels="stock")
        dec = Decoder(model, sources=make_sources(["prompt", "ngram", "suffix"]), max_tree_nodes=24, exact=True,
                      cpu_kernels="stock", adaptive_budget=False)
        seeds = (1, 2)  # two prompts that part under the linear layers' rule alone
        return ([plain.generate(repetitive_prompt(s), max_new_tokens=NEW).token_ids for s in seeds],
                [dec.generate(repetitive_prompt(s), max_new_tokens=NEW).token_ids for s in seeds],
                plain.engine.padding.rule.min_rows)

    expected, speculated, narrowest = outputs(reordered_model(cut))
    assert narrowest == cut
    assert speculated == expected
    # a rule of the linear layers alone that pads to 2+ (the stock bfloat16 kernel's on an AVX2 EPYC);
    # the norms cut at 16 here, so that the trees (up to 25 rows) cross it
    from specdraft.kernels import exact_kernels

    monkeypatch.setattr(exact_kernels, "load_or_probe", lambda model, packed=None: RowRule(tuple(range(2, 65)), wider=True))
    expected, speculated, narrowest = outputs(reordered_model(16))
    assert narrowest == 2 and speculated != expected
