"""Alternative sampling verifiers used as references and as mutants by the exactness tests.

Each has the signature of :func:`specdraft.verify.verify_sampling` --
``(tree, logits, scorer, prefix, draw) -> Verdict`` -- so it can be enumerated exactly by
``test_verify_exact.py`` and injected into the decoder by ``test_sampling_stats.py``
(``monkeypatch.setattr(specdraft.engine.settle, "verify_sampling", ...)``).

* :func:`specinfer_verify` -- SpecInfer's multi-round rejection with point-mass (one-hot) drafts,
  written the way the papers state it: at each node, for each child ``c`` in order, accept with
  probability ``r[c]`` (``r`` the current residual, normalised); on reject set ``r[c] = 0`` and
  renormalise; if every child is rejected, draw the bonus token from the final residual. CORRECT:
  it must have exactly the law of plain sampling (that is the equivalence verify.py claims).
* :func:`bonus_from_p_verify` -- MUTANT: the same, but the bonus token after all children were
  rejected is drawn from the *unreduced* ``p`` instead of the residual (a classic bug: a
  rejected child can then come back as the bonus, inflating its probability).
* :func:`committed_context_verify` -- MUTANT: the "draw, then look for a matching child" rule of
  verify.py, but every node is warped with only the *committed* prefix, not the node's own path
  (a classic bug that only shows with a prefix-dependent processor such as repetition penalty).

Accept/reject coin flips go through the same ``draw`` callback as token draws (a probability
vector ``[1 - q, q]``; index 1 = accept), so the exact enumerator sees every random choice and
``torch.multinomial`` in production draws them like any other.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdraft.tree import TokenTree
from specdraft.verify import Verdict


def _probs(scorer, row: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """Processed distribution of one node, as plain sampling computes it (float32 softmax), then
    promoted to float64 for the rejection arithmetic."""
    return torch.softmax(scorer(row, list(ids)), dim=-1).to(torch.float64)


def _coin(draw, q: float) -> bool:
    """Accept with probability ``q`` using the shared ``draw`` callback."""
    if q <= 0.0:
        return False
    if q >= 1.0:
        return True
    return int(draw(torch.tensor([1.0 - q, q], dtype=torch.float64))) == 1


def _committed(prefix) -> list[int]:
    """The committed tokens as a list: ``prefix`` itself, or the token list of the decoder's
    :class:`~specdraft.sampling.PenaltyPrefix` (which holds them as a mask on the device)."""
    return list(getattr(prefix, "tokens", prefix))


def _multi_round(tree: TokenTree, logits: torch.Tensor, scorer, prefix: Sequence[int], draw,
                 bonus_from_residual: bool) -> Verdict:
    prefix = _committed(prefix)
    node, path, tokens = 0, [], []
    while True:
        p = _probs(scorer, logits[node], prefix + tokens)
        p = p / p.sum()
        residual = p.clone()
        moved = False
        for child in tree.children(node):
            token = tree.tokens[child]
            q = float(residual[token] / residual.sum())
            if _coin(draw, q):
                tokens.append(token)
                path.append(child)
                node = child
                moved = True
                break
            residual[token] = 0.0
        if moved:
            continue
        final = residual if bonus_from_residual else p
        tokens.append(int(draw(final / final.sum())))
        return Verdict(path=path, tokens=tokens)


def specinfer_verify(tree: TokenTree, logits: torch.Tensor, scorer, prefix: Sequence[int], draw) -> Verdict:
    """Correct SpecInfer-style multi-round rejection (bonus from the residual)."""
    return _multi_round(tree, logits, scorer, prefix, draw, bonus_from_residual=True)


def bonus_from_p_verify(tree: TokenTree, logits: torch.Tensor, scorer, prefix: Sequence[int], draw) -> Verdict:
    """MUTANT: multi-round rejection whose bonus token is drawn from the unreduced ``p``."""
    return _multi_round(tree, logits, scorer, prefix, draw, bonus_from_residual=False)


def committed_context_verify(tree: TokenTree, logits: torch.Tensor, scorer, prefix: Sequence[int], draw) -> Verdict:
    """MUTANT: draw-then-match, but every node is warped with the committed prefix only."""
    prefix = _committed(prefix)
    node, path, tokens = 0, [], []
    while True:
        probs = torch.softmax(scorer(logits[node], prefix), dim=-1)  # BUG: should be prefix + tokens
        token = int(draw(probs))
        tokens.append(token)
        child = tree.child(node, token)
        if child is None:
            return Verdict(path=path, tokens=tokens)
        path.append(child)
        node = child
