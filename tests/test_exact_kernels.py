"""Exact mode on a CPU runs the kernel path whose padded forwards cost least, and is the default
only where that costs at most 5% (:mod:`specdraft.kernels.exact_kernels`).

The choice is tested on made-up cost curves and rules (the real ones belong to the machine), the
exactness of whatever the choice runs on the real kernels of this machine.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specdraft import Decoder
from specdraft.kernels import exact_kernels
from specdraft.kernels.exact_kernels import PRICE_LIMIT, choose_exact_kernels, lowest_price, padded_price
from specdraft.kernels.exact_rows import ExactRowsError, RowRule
from specdraft.kernels.kernel_costs import WIDTHS, KernelCosts
from specdraft.sources.registry import make_sources

from conftest import repetitive_prompt, tiny_model, wide_llama

PAD_37 = RowRule(tuple(range(37, 65)))
PAD_2 = RowRule(tuple(range(2, 65)), wider=True)
NO_PADDING = RowRule(tuple(range(1, 65)), wider=True)


def curve(one_row: float, per_row: float) -> list[float]:
    """Seconds at :data:`WIDTHS`: ``one_row`` for one row, ``per_row`` more for each further row."""
    return [one_row + per_row * (w - 1) for w in WIDTHS]


def costs(**curves: list[float]) -> KernelCosts:
    return KernelCosts({"made": "up"}, list(WIDTHS), dict(curves))


def test_the_price_reads_the_curve_at_the_padded_widths() -> None:
    flat = [1.0] * 64
    rising = [1.0 + 0.1 * (w - 1) for w in range(1, 65)]
    assert padded_price(NO_PADDING, rising, rising) == 0
    assert padded_price(PAD_2, flat, flat) == 0
    # a plain step of 1 row runs 2, the rest as they are: (1.1 / 1 + 7) / 8 - 1
    assert padded_price(PAD_2, rising, rising) == pytest.approx(0.1 / 8)
    # every forward of 1-8 rows runs 37 rows, at 4.6 against 1.0-1.7
    assert padded_price(PAD_37, rising, rising) == pytest.approx(
        sum(4.6 / (1 + 0.1 * (k - 1)) for k in range(1, 9)) / 8 - 1)
    assert padded_price(RowRule((4, 8)), rising, rising, rows=8) > 0
    assert padded_price(RowRule((2, 4)), rising, rising) == float("inf")  # 5-8 rows not covered
    # the bound: padding never narrows a forward, so no rule prices a curve below it
    dips = [2.0, 1.0] + [1.5] * 62
    assert lowest_price(dips, flat) == pytest.approx((2 * 1.0 + 6 * 1.5) / 8 - 1)  # 1 row may run 2
    for rule in (NO_PADDING, PAD_2, PAD_37, RowRule((4, 8, 64))):
        assert padded_price(rule, dips, flat) >= lowest_price(dips, flat)


@pytest.fixture
def made_up(monkeypatch: pytest.MonkeyPatch):
    """A machine of made-up curves and rules per path, recording which paths are probed and
    whether the costs were measured."""
    seen = SimpleNamespace(probed=[], measured=0, curves={}, rules={})

    def measure(model, paths):
        seen.measured += 1
        return costs(**{p: seen.curves[p] for p in paths if p in seen.curves})

    def probe(model, packed=None):
        kind = "stock" if packed is None else packed.kind
        seen.probed.append(kind)
        if isinstance(seen.rules[kind], Exception):
            raise seen.rules[kind]
        return seen.rules[kind]

    monkeypatch.setattr(exact_kernels, "load_or_measure", measure)
    monkeypatch.setattr(exact_kernels, "load_or_probe", probe)
    monkeypatch.setattr(exact_kernels, "runnable_paths", lambda model: ["packed", "fbgemm"])
    monkeypatch.setattr(exact_kernels, "packed_model", lambda model, kind: SimpleNamespace(kind=kind, nbytes=0))
    return seen


def test_exact_mode_takes_the_path_whose_padded_forwards_cost_least(made_up) -> None:
    """As on an Intel Xeon with AMX: oneDNN's bfloat16 kernels (stock and packed) agree only from
    37 rows, FBGEMM's at every width; packed is the cheapest without exact mode, FBGEMM with it."""
    model = object()
    made_up.curves = {"stock": curve(1.2, 0.01), "packed": curve(1.0, 0.01), "fbgemm": curve(1.0, 0.02)}
    made_up.rules = {"stock": PAD_37, "packed": PAD_37, "fbgemm": NO_PADDING}
    chosen = choose_exact_kernels(model, "auto")
    assert chosen.kernels.kind == "fbgemm" and chosen.rule is NO_PADDING
    assert chosen.price == pytest.approx(padded_price(NO_PADDING, costs(**made_up.curves).curve("fbgemm"),
                                                     costs(**made_up.curves).curve("packed")))
    assert 0 < chosen.price <= PRICE_LIMIT and chosen.cheap
    assert chosen.kernels.curve == costs(**made_up.curves).curve("fbgemm")  # what the budget prices
    # packed's padded price lost to FBGEMM's; stock's bound alone did: it was never probed
    assert made_up.probed == ["packed", "fbgemm"] or made_up.probed == ["fbgemm", "packed"]
    assert "not probed" in chosen.paths["stock"] and "pad to 37+" in chosen.paths["packed"]
    assert "fbgemm kernels, no padding" in chosen.describe()

    # FBGEMM dearer per row: exact mode's best is padding oneDNN to 37 rows, over the limit
    made_up.curves["fbgemm"] = curve(1.0, 0.2)
    chosen = choose_exact_kernels(model, "auto")
    assert chosen.kernels.kind == "packed" and chosen.price > PRICE_LIMIT and not chosen.cheap

    # a path whose probe finds no agreeing width is left out, and where none is left: an error
    made_up.rules["packed"] = ExactRowsError("no width agrees")
    assert choose_exact_kernels(model, "auto").kernels.kind in ("stock", "fbgemm")
    made_up.rules = dict.fromkeys(made_up.rules, ExactRowsError("no width agrees"))
    with pytest.raises(ExactRowsError, match="no kernel path gives every row alike"):
        choose_exact_kernels(model, "auto")


def test_a_path_asked_for_is_priced_only_when_the_default_needs_the_price(made_up) -> None:
    made_up.curves = {"stock": curve(1.0, 0.01)}
    made_up.rules = {"stock": PAD_2}
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    chosen = choose_exact_kernels(model, "stock", priced=False)
    assert (chosen.kernels.kind, chosen.rule, chosen.price, made_up.measured) == ("stock", PAD_2, None, 0)
    assert choose_exact_kernels(model, "stock").price == pytest.approx(
        padded_price(PAD_2, costs(**made_up.curves).curve("stock"), costs(**made_up.curves).curve("stock")))
    assert made_up.measured == 1
    assert choose_exact_kernels(model, "stock").kernels.curve is None  # stock asked for: no curve, as without exact


def test_the_cpu_default_follows_the_measured_price(made_up) -> None:
    """bfloat16 on a CPU: exact mode where its padded forwards cost at most 5% more, else off and
    saying why; asked for, on whatever it costs, and without measuring anything; float32 never
    by default (already exact against ``generate``), without probing."""
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    made_up.curves = {"stock": curve(1.0, 0.01)}
    made_up.rules = {"stock": PAD_2}
    cheap = Decoder(model, None, sources=[], cpu_kernels="stock")
    assert cheap.exact and cheap.engine.padding.rule is PAD_2
    assert cheap.exact_note.startswith("exact mode on: the default where it costs at most 5%")

    made_up.rules = {"stock": PAD_37}
    dear = Decoder(model, None, sources=[], cpu_kernels="stock")
    assert not dear.exact and dear.engine.padding is None and dear.attention != "specdraft_exact"
    assert dear.exact_note.startswith("exact mode off (exact=True turns it on)")
    assert "pad to 37+ rows" in dear.exact_note

    measured = made_up.measured
    asked = Decoder(model, None, sources=[], cpu_kernels="stock", exact=True)
    assert asked.exact and asked.engine.padding.rule is PAD_37 and made_up.measured == measured
    assert asked.exact_note.startswith("exact mode on, as asked: stock kernels, pad to 37+")
    assert not Decoder(model, None, sources=[], cpu_kernels="stock", exact=False).exact

    made_up.rules = {"stock": ExactRowsError("no width agrees")}
    assert "no kernel path" in Decoder(model, None, sources=[], cpu_kernels="stock").exact_note
    probed = len(made_up.probed)
    assert not Decoder(tiny_model("llama"), None, sources=[]).exact and len(made_up.probed) == probed


def test_exact_mode_on_the_chosen_kernels_gives_exact_plain_decodings_tokens() -> None:
    """On this machine's real kernels: with ``cpu_kernels="auto"`` exact mode runs the path the
    choice takes here, and speculation on it gives exact plain decoding's tokens (on it too)."""
    model = wide_llama(torch.bfloat16)
    model.generation_config.eos_token_id = None
    plain = Decoder(model, sources=[], max_tree_nodes=0, exact=True)
    fast = Decoder(model, sources=make_sources(["prompt", "trie", "ngram"]), max_tree_nodes=24, exact=True)
    assert plain.kernels.kind == fast.kernels.kind and plain.kernels.plan is None
    assert repr(plain.engine.padding) == repr(fast.engine.padding)
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        assert fast.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
