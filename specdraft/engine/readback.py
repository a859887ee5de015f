"""The step's one read of the device, as a typed plan: what each request needs, and where it sits.

After a forward every request needs a few integers from the device: the token each tree row
chooses (when the rows are chosen on the device at once), each side block's argmax (Jacobi), and
the top-k ids of every tree row (Token Recycling). Read one by one, each is a separate wait for
the device. So every request's parts are computed on the device, concatenated, and read with one
``tolist()``; a :class:`ReadSlots` records where each request's parts sit, and
:meth:`ReadSlots.take` turns the flat list back into a :class:`Readback` with named fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TopRows:
    """The top-``k`` ids of forward rows (``ids[i]``, best first) and the token each row read."""

    ids: np.ndarray
    row_tokens: np.ndarray

    def then(self, later: "TopRows") -> "TopRows":
        """These rows followed by ``later``'s."""
        return TopRows(np.concatenate([self.ids, later.ids]), np.concatenate([self.row_tokens, later.row_tokens]))


@dataclass(frozen=True)
class Readback:
    """One request's answers from the step's read: each tree row's choice (``None``: the rows are
    walked on the logits instead), each source's side-block argmax (``None`` where it had no block),
    and the tree rows' top-k (``None`` when no source asked)."""

    choices: list[int] | None
    side_argmax: list[list[int] | None]
    top: TopRows | None


@dataclass(frozen=True)
class ReadSlots:
    """Where one request's parts sit in the step's read: a slice per part (``None``: not read)."""

    choices: slice | None
    sides: tuple[slice | None, ...]
    top: slice | None
    top_k: int
    row_tokens: tuple[int, ...]

    def take(self, fetched: list[int]) -> Readback:
        """This request's :class:`Readback` from the step's whole read."""
        choices = fetched[self.choices] if self.choices is not None else None
        sides = [fetched[s] if s is not None else None for s in self.sides]
        top = None
        if self.top is not None:
            ids = np.asarray(fetched[self.top], dtype=np.int64).reshape(len(self.row_tokens), self.top_k)
            top = TopRows(ids, np.asarray(self.row_tokens, dtype=np.int64))
        return Readback(choices, sides, top)


class ReadPlan:
    """Collects device tensors of int ids for the step's one read."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._size = 0

    def add(self, ids: torch.Tensor) -> slice:
        """Read ``ids`` (any shape, flattened) with the step; returns its slice of the read."""
        flat = ids.reshape(-1).to(torch.int64)
        self._parts.append(flat)
        span = slice(self._size, self._size + flat.numel())
        self._size += flat.numel()
        return span

    def read(self) -> list[int]:
        """The one read: every part added, as host ints (nothing to read: no device access)."""
        if not self._parts:
            return []
        return torch.cat(self._parts).tolist()
