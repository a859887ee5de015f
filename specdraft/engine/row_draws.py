"""Sampled choices for every tree row at once, keyed by the position each row samples.

On an accelerator a sampling step draws a token for *every* row of the tree on the device and reads
them all back at once (one read per step; the verifier then walks the tree over those draws).
Drawn from one random stream in row order, the draw a committed token gets would depend on how
many rows the drafts put before it, so a seed would give another sample whenever the sources had
learned something.

Here the noise for the token at absolute position ``t`` is a function of ``(seed, t)`` alone, and
a row's choice is the exponential race ``argmax_j p_j / E_j`` with ``E_j ~ Exp(1)`` i.i.d., which
picks ``j`` with probability ``p_j``. Rows that sample the same position share its noise; only one
of them lies on the accepted path, and which one is decided by the noise of earlier positions. So
each committed token is drawn from its own distribution with fresh noise (the plain-sampling law),
and a seed gives the same output whatever the drafts were. The CPU path walks the tree with one
``torch.multinomial`` per committed token instead (see :mod:`specdraft.verify`), which is also
independent of the drafts and follows ``model.generate``'s stream; the two paths give different
samples for one seed, each with the same law.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..verify import Draw, multinomial_draw

__all__ = ["RowDraws", "position_seed", "request_draws"]

_MASK64 = (1 << 64) - 1


def position_seed(base: int, position: int) -> int:
    """A 63-bit seed for ``position`` under ``base`` (SplitMix64 of the pair): neighbouring
    positions and neighbouring seeds get unrelated streams."""
    z = (base * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class RowDraws:
    """One request's positional noise (see the module docstring).

    ``seed=None`` takes the base from torch's global (CPU) random stream, once per request, as an
    unseeded ``model.generate`` takes its draws from the global stream."""

    def __init__(self, device: torch.device, seed: int | None) -> None:
        self.base = int(seed) if seed is not None else int(torch.randint(0, 1 << 62, (1,)).item())
        self.device = device
        self._generator = torch.Generator(device=device)

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        """``Exp(1)`` noise over the vocabulary for the token at ``position``, on the device (no
        read, no upload: seeding a generator is host state)."""
        self._generator.manual_seed(position_seed(self.base, position))
        out = torch.empty(vocab, device=self.device, dtype=torch.float32).exponential_(generator=self._generator)
        # an exact zero would make p / E infinite for any p, even p = 0
        return out.clamp_min_(torch.finfo(torch.float32).tiny)

    def choose(self, probs: torch.Tensor, depths: Sequence[int], position0: int) -> torch.Tensor:
        """Each row's token: row ``i`` samples position ``position0 + depths[i]`` from ``probs[i]``."""
        vocab = probs.shape[-1]
        by_depth = {d: self.noise(position0 + d, vocab) for d in sorted(set(depths))}
        noise = torch.stack([by_depth[d] for d in depths])
        return (probs.to(torch.float32) / noise).argmax(dim=-1)


def request_draws(device: torch.device, seed: int | None, batched: bool,
                  do_sample: bool) -> tuple[Draw, RowDraws | None]:
    """A request's random draws, made where its logits live (CUDA refuses a CPU generator): the
    node-by-node walk's draw (one ``torch.multinomial`` per committed token from a generator
    seeded with ``seed``; ``None``: torch's global stream) and, when every row is chosen at once
    and the request samples, its :class:`RowDraws`. Batched rows never call the walk's draw, so
    no generator is made for them."""
    if batched:
        return multinomial_draw(None), (RowDraws(device, seed) if do_sample else None)
    generator = torch.Generator(device=device).manual_seed(int(seed)) if seed is not None else None
    return multinomial_draw(generator), None
