"""Verification: accept the longest path of the tree that the model itself would have produced.

Pure functions over a :class:`~specdraft.tree.TokenTree` and its logits; no model, no cache.

Greedy
    From the root, ``t = argmax(scores[node])``; if a child carries ``t`` move there and repeat,
    else stop. The committed tokens are the path walked plus the last ``t``. Every committed token
    is the argmax given its own prefix, which is the definition of greedy decoding.

Sampling
    From the root, draw ``x ~ p(node)`` where ``p`` is the processed distribution given the node's
    own prefix; if a child carries ``x`` move there and repeat, else commit ``x`` and stop.
    Each committed token is drawn from exactly the conditional plain sampling would use at that
    position, with one draw per committed token, so the output sequence has the plain-sampling
    distribution (and, fed the same random stream, the very same draws). This is the multi-round
    rejection rule of SpecInfer / lookahead decoding (Algorithm 4) for one-hot drafts written in
    its equivalent "draw, then look for a matching child" form: accepting child ``c`` with
    probability ``p[c]``, else zeroing it and renormalising, then sampling the residual, gives
    every token ``t`` total probability ``p[t]`` -- the same law as one draw from ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .tree import TokenTree

#: A node scorer: raw logits row + the node's input ids -> processed scores (see sampling.NodeScorer).
Scorer = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
#: Draws one token id from a probability vector.
Draw = Callable[[torch.Tensor], int]


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one tree.

    ``path`` holds the accepted draft nodes (the root excluded) in order; ``tokens`` the tokens to
    commit: those nodes' tokens followed by the model's own next token (the "bonus"), so
    ``len(tokens) == len(path) + 1`` always.
    """

    path: list[int]
    tokens: list[int]


def _walk(tree: TokenTree, choose: Callable[[int, list[int]], int]) -> Verdict:
    node, path, tokens = 0, [], []
    while True:
        token = choose(node, tokens)
        tokens.append(token)
        child = tree.child(node, token)
        if child is None:
            return Verdict(path=path, tokens=tokens)
        path.append(child)
        node = child


def walk_choices(tree: TokenTree, choices: Sequence[int]) -> Verdict:
    """The verdict of a walk whose choice at every node is already known: ``choices[i]`` is the
    token node ``i``'s row yields (its greedy argmax, or its one draw from the node's processed
    distribution). The decoder computes them for every row on the device and fetches them in one
    read, so the walk itself needs no device round trip per node.

    Under sampling this is exact for the same reason the node-by-node walk is: the draws of
    different nodes are independent, each from its own node's distribution, and the walk reads the
    draw of every node it visits exactly once (the draws of nodes it does not visit are never
    used), so each committed token is still one draw from the conditional of its own prefix.
    """
    if len(choices) < len(tree):
        raise ValueError(f"expected a choice for each of the {len(tree)} nodes, got {len(choices)}")
    return _walk(tree, lambda node, _: int(choices[node]))


def _node_prefix(prefix: Sequence[int]):
    """A prefix the verifiers can extend per node with ``prefix + walked``: the decoder's
    :class:`~specdraft.sampling.PenaltyPrefix` as it is (O(1) per node), anything else as a list."""
    return prefix if hasattr(prefix, "seen") else list(prefix)


def verify_greedy(tree: TokenTree, logits: torch.Tensor, scorer: Scorer | None = None,
                  prefix: Sequence[int] = ()) -> Verdict:
    """Greedy verification of ``tree`` given ``logits[len(tree), vocab]`` (row i = node i).

    ``scorer`` (with the committed ``prefix``, root included) applies logits processors such as a
    repetition penalty per node. Each visited row is read as the walk reaches it: right on a CPU;
    on an accelerator, compute every row's choice on the device and use :func:`walk_choices`.
    """
    _check_shapes(tree, logits)
    if scorer is None:
        # only the rows the walk visits (a full argmax over every row costs as much as a small
        # forward on a CPU); on an accelerator the decoder uses :func:`walk_choices` instead
        return _walk(tree, lambda node, _: int(logits[node].argmax()))
    prefix = _node_prefix(prefix)
    return _walk(tree, lambda node, walked: int(torch.argmax(scorer(logits[node], prefix + walked))))


def verify_sampling(tree: TokenTree, logits: torch.Tensor, scorer: Scorer, prefix: Sequence[int],
                    draw: Draw) -> Verdict:
    """Sampling verification (see the module docstring for why it is lossless).

    ``prefix`` is the committed sequence, root included; ``draw`` takes a probability vector and
    returns a token id (``torch.multinomial`` in production, a scripted choice in the exact tests).
    """
    _check_shapes(tree, logits)
    prefix = _node_prefix(prefix)

    def choose(node: int, walked: list[int]) -> int:
        scores = scorer(logits[node], prefix + walked)
        return int(draw(torch.softmax(scores, dim=-1)))

    return _walk(tree, choose)


def multinomial_draw(generator: torch.Generator | None) -> Draw:
    """The production draw: ``torch.multinomial`` on a ``[1, vocab]`` row, as transformers does."""

    def draw(probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs.reshape(1, -1), num_samples=1, generator=generator)[0, 0])

    return draw


def _check_shapes(tree: TokenTree, logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(tree):
        raise ValueError(f"expected logits of shape [{len(tree)}, vocab] for a tree of {len(tree)} nodes, got {tuple(logits.shape)}")
