"""``cpu_kernels="auto"``: kernel paths measured once per machine and model, the cheapest per
forward width, exact.

Timing is never asserted: the per-width choice is tested on cost tables given to it, and the
measurement only for what it records (paths, widths, the cache and its key).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from specdraft import Decoder, PromptLookup
from specdraft.kernels import cpu_kernels as ck
from specdraft.kernels import kernel_costs as kc
from specdraft.kernels.cpu_kernels import CpuKernelError, MixedLinear, packed_model

from conftest import FAST, reference_greedy, tiny_model
from test_cpu_kernels import KINDS, _assert_unchanged, _first_difference_is_a_tie, _snapshot, model_for, needs_onednn
from test_greedy_identity import build_sources, oracle_sequence, prompts, source_specs

pytestmark = [pytest.mark.usefixtures("single_thread")]

ROWS = list(range(1, kc.MAX_ROWS + 1))


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "specdraft" / "kernel-costs"


def fake_costs(model, plan: tuple[bool, ...], kind: str) -> kc.KernelCosts:
    """A cost table under which ``kind`` is cheaper than stock exactly at the widths ``plan`` marks."""
    packed = [0.5 if use else 2.0 for use in plan]
    return kc.KernelCosts(kc.cache_key(model), ROWS, {"stock": [1.0] * len(ROWS), kind: packed})


def with_costs(monkeypatch: pytest.MonkeyPatch, costs_for) -> None:
    monkeypatch.setattr(kc, "load_or_measure", lambda model, paths: costs_for(model))


@needs_onednn
def test_measured_once_then_read_from_the_cache(cache_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_for("packed", "llama")
    first = kc.load_or_measure(model, ["stock", "packed"])
    files = list(cache_home.glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["key"]["dtype"] == "float32" and saved["key"]["torch"] == torch.__version__
    assert saved["key"]["cpu"] == kc.cpu_name() and saved["key"]["threads"] == torch.get_num_threads()
    assert first.widths == list(kc.WIDTHS) and set(first.seconds) == {"stock", "packed"}
    assert all(s > 0 for curve in first.seconds.values() for s in curve)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the cache holds this machine and model")

    monkeypatch.setattr(kc, "measure", no_measuring)
    again = kc.load_or_measure(model, ["stock", "packed"])
    assert again.seconds == first.seconds
    # another shape (or dtype, CPU, torch, threads) is another file
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home.parent.parent))
    kc.load_or_measure(model_for("packed", "qwen2"), ["stock", "packed"])
    assert len(list(cache_home.glob("*.json"))) == 2


def test_measuring_leaves_the_callers_random_stream_alone() -> None:
    """The measurement makes its sample layers and inputs without drawing from torch's global
    generator: a decoder built (and measured) after ``torch.manual_seed`` samples as
    ``model.generate`` would after the same seed."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    kc.measure(model, ["stock"], repeats=1)
    assert torch.equal(torch.rand(4), expected)


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    costs = kc.load_or_measure(model_for("packed", "llama"), ["stock"])
    assert set(costs.seconds) == {"stock"}


def test_the_cheapest_path_per_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stock where one row is cheaper on it, the packed path from two rows up: plain steps never
    run slower than stock, and the budget is priced from the cheaper curve."""
    if not kc.runnable_paths(model_for("packed", "llama")):
        pytest.skip("no packed path runs here")
    model = model_for("packed", "llama")
    kind = kc.runnable_paths(model)[0]
    plan = tuple(w > 1 for w in ROWS)
    with_costs(monkeypatch, lambda m: fake_costs(m, plan, kind))
    dec = Decoder(model, sources=[PromptLookup()])
    choice = dec.kernels
    assert choice.kind == kind and choice.plan == plan
    assert choice.curve == [1.0] + [0.5] * (len(ROWS) - 1)
    assert dec.budget.costs.curve is not None and dec.budget.costs.shape(1) == 1.0
    assert dec.budget.costs.shape(8) == 0.5  # priced from the curve, not learned
    assert f"stock at 1 rows, {kind} at 2-64+ rows" in choice.describe()
    assert "GiB" in choice.describe() and choice.extra_bytes == dec.packed_weights.nbytes > 0
    assert all(isinstance(layer, MixedLinear) for layer in dec.packed_weights.layers.values())


def test_stock_everywhere_when_nothing_is_cheaper(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_for("packed", "llama")
    if not kc.runnable_paths(model):
        pytest.skip("no packed path runs here")
    kind = kc.runnable_paths(model)[0]
    with_costs(monkeypatch, lambda m: fake_costs(m, tuple(False for _ in ROWS), kind))
    dec = Decoder(model, sources=[PromptLookup()])
    assert dec.packed_weights is None and dec.kernels.kind == "stock" and dec.kernels.curve == [1.0] * len(ROWS)
    assert "stock is cheapest" in dec.kernels.describe()


def test_stock_opts_out_and_float64_measures_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_measuring(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(kc, "measure", no_measuring)
    dec = Decoder(model_for("packed", "llama"), sources=[PromptLookup()], cpu_kernels="stock")
    assert dec.packed_weights is None and dec.kernels.curve is None and dec.kernels.describe() == "stock"
    auto64 = Decoder(tiny_model("llama"), sources=[PromptLookup()])  # float64: no packed path takes it
    assert auto64.packed_weights is None and auto64.kernels.curve is None
    assert "no packed path" in auto64.kernels.describe()


@needs_onednn
def test_packing_is_refused_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_for("packed", "phi")  # not packed yet by another test: a new copy is asked for
    need = ck.packing_bytes(model, "packed")
    monkeypatch.setattr(ck, "available_memory", lambda: need // 2)
    with pytest.raises(CpuKernelError, match=r"cpu_kernels='packed' cannot pack this model's weights here: its "
                                             r"packed weights need .* GiB more memory"):
        Decoder(model, cpu_kernels="packed")
    monkeypatch.setattr(kc, "runnable_paths", lambda m: ["packed"])
    with_costs(monkeypatch, lambda m: fake_costs(m, tuple(True for _ in ROWS), "packed"))
    with pytest.warns(RuntimeWarning, match="stays on stock kernels"):
        dec = Decoder(model, sources=[PromptLookup()])
    assert dec.packed_weights is None and "GiB more memory" in dec.kernels.describe()
    prompt = [3, 4, 5, 3, 4, 5, 3]
    assert dec.generate(prompt, max_new_tokens=10).token_ids == reference_greedy(model, prompt, 10)


def test_mixed_linear_follows_its_plan() -> None:
    model = model_for("packed", "llama")
    if ck.packed_kernels_available() is False:
        pytest.skip("torch built without oneDNN")
    linear = model.lm_head
    fast = ck.PackedLinear(linear)
    calls = []
    fast.forward = lambda x: calls.append(x.shape[-2]) or linear(x)  # type: ignore[method-assign]
    mixed = MixedLinear(fast, (False, True, False))
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 9):
            mixed(torch.randn(1, rows, linear.in_features))
    assert calls == [2]  # row counts past the plan's end follow its last entry (stock here)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", [("llama", "sdpa"), ("qwen2_swa", "sdpa"), ("gpt2", "eager")],
                         ids=lambda c: f"{c[0]}-{c[1]}")
@settings(FAST, max_examples=12)
@given(prompt=prompts(), n=st.integers(0, 40), max_tree_nodes=st.integers(0, 40), specs=source_specs,
       adaptive=st.booleans(), plan=st.lists(st.booleans(), min_size=kc.MAX_ROWS, max_size=kc.MAX_ROWS))
def test_greedy_identity_with_a_per_width_mix_of_paths(kind, case, prompt, n, max_tree_nodes, specs, adaptive,
                                                         plan) -> None:
    """Whatever path each width runs on, greedy output equals ``model.generate``: on stock kernels
    token for token, except where stock's own logits tie to within float32 noise at the first
    differing token (the packed paths add in another order; the tie is checked, not assumed)."""
    model = model_for(kind, *case)
    plan_t = tuple(plan)
    snapshot = _snapshot(model)
    ref_stock = reference_greedy(model, prompt, n)
    sources = build_sources(specs, oracle_sequence(model, prompt, n, specs))
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(kc, "runnable_paths", lambda m: [kind])
        mp.setattr(kc, "load_or_measure", lambda m, paths: fake_costs(m, plan_t, kind))
        dec = Decoder(model, sources=sources, max_tree_nodes=max_tree_nodes, adaptive_budget=adaptive)
    finally:
        mp.undo()
    assert dec.kernels.plan == (plan_t if any(plan_t) else None)
    out = dec.generate(prompt, max_new_tokens=n)
    _assert_unchanged(model, snapshot)
    if out.token_ids != ref_stock:
        assert _first_difference_is_a_tie(model, prompt, out.token_ids, ref_stock)
        event("differs from stock at a float32 tie")
    else:
        event("equal to stock")
