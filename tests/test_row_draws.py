"""The positional draws of the device path (:mod:`specdraft.engine.row_draws`): each row's choice has
its row's law, rows sampling one position share noise, and the seed alone fixes the noise."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats as scipy_stats

from specdraft.engine.row_draws import RowDraws, position_seed

PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])


def test_a_row_choice_follows_its_rows_law() -> None:
    """Over many positions, the exponential race picks each token with its probability and never
    a zero-probability one (chi-square, fixed seed: deterministic)."""
    draws = RowDraws(torch.device("cpu"), seed=7)
    n = 20_000
    picks = [int(draws.choose(PROBS[None], [0], position)[0]) for position in range(n)]
    counts = np.bincount(picks, minlength=len(PROBS))
    assert counts[-1] == 0
    pvalue = scipy_stats.chisquare(counts[:-1], n * PROBS[:-1].numpy().astype(float) / float(PROBS.sum())).pvalue
    assert pvalue > 1e-4, (counts, pvalue)


def test_rows_of_one_depth_share_noise_and_depths_do_not() -> None:
    draws = RowDraws(torch.device("cpu"), seed=3)
    flat = torch.full((1, 1000), 1e-3)
    same = draws.choose(flat.expand(4, -1), [2, 2, 2, 2], 10)
    assert len(set(same.tolist())) == 1  # one position, one noise: equal rows choose alike
    spread = draws.choose(flat.expand(8, -1), list(range(8)), 10)
    assert len(set(spread.tolist())) > 1
    # the row at depth d samples position position0 + d, whatever step it is drawn in
    assert int(draws.choose(flat, [3], 10)[0]) == int(draws.choose(flat, [0], 13)[0])


def test_the_seed_alone_fixes_the_noise() -> None:
    a, b = RowDraws(torch.device("cpu"), 11), RowDraws(torch.device("cpu"), 11)
    assert torch.equal(a.noise(5, 100), b.noise(5, 100))
    assert not torch.equal(a.noise(5, 100), RowDraws(torch.device("cpu"), 12).noise(5, 100))
    assert len({position_seed(11, t) for t in range(1000)}) == 1000
    assert all(0 <= position_seed(s, t) < 2**63 for s in (0, 2**62, 2**64 - 1) for t in (0, 10**9))


def test_without_a_seed_the_global_stream_decides() -> None:
    torch.manual_seed(5)
    first = RowDraws(torch.device("cpu"), None).base
    torch.manual_seed(5)
    assert RowDraws(torch.device("cpu"), None).base == first
