"""The contract between the decoder and a draft source.

A draft source guesses what comes after the committed tokens. It never sees the model: the
decoder hands it a :class:`Context` and a node budget, takes back a :class:`Draft`, and after
the step reports what was committed in a :class:`Feedback`. Because the verifier accepts only
what the model itself would have produced, a source can be wrong as often as it likes; it only
costs speed, never correctness.

A source may also ask for a *side block*: extra tokens that ride along in the same forward pass
(never verified, never kept in the cache) whose logits come back in the feedback. Jacobi
lookahead decoding uses it to run its iteration window for free in the spare width of the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch


@dataclass(frozen=True)
class Context:
    """What a source may look at when it drafts.

    ``tokens`` is the prompt followed by everything committed so far; its last element is the
    *root*, the newest committed token, whose successors the draft guesses.
    """

    tokens: Sequence[int]
    prompt_length: int
    request_id: int

    @property
    def output(self) -> Sequence[int]:
        """The tokens generated so far in this request (the prompt excluded)."""
        return self.tokens[self.prompt_length :]

    @property
    def root(self) -> int:
        return self.tokens[-1]


@dataclass
class SideBlock:
    """Extra tokens a source wants evaluated in the same forward pass.

    ``positions`` are offsets from the root's position (the root sits at offset 0, so its
    first successor is at 1). ``mask[i, j]`` says whether side token ``i`` may attend to side
    token ``j``. Every side token sees the whole KV cache and, if ``sees_root``, the root; it
    never sees the verification tree, and the tree never sees it.
    """

    tokens: list[int]
    positions: list[int]
    mask: np.ndarray
    sees_root: bool = True

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.positions) != n:
            raise ValueError(f"SideBlock has {n} tokens but {len(self.positions)} positions")
        self.mask = np.asarray(self.mask, dtype=bool)
        if self.mask.shape != (n, n):
            raise ValueError(f"SideBlock mask must have shape ({n}, {n}), got {self.mask.shape}")
        if n and min(self.positions) < 1:
            raise ValueError("SideBlock positions are offsets after the root and must be >= 1")


@dataclass
class Draft:
    """A source's guess for one step.

    ``branches`` are candidate continuations of the root, best first. A tree is given as its
    root-to-leaf paths: the decoder merges shared prefixes, so a prefix-closed subtree (such as
    the trie's hierarchical draft) loses nothing by being listed this way.
    """

    branches: list[list[int]] = field(default_factory=list)
    side_block: SideBlock | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(b) for b in self.branches)


@dataclass(frozen=True)
class Feedback:
    """What happened in the step a source drafted for.

    ``committed`` are the tokens appended to the context this step (the accepted path plus the
    model's own next token). ``context`` is the context after the commit. ``side_logits`` are the
    float32 logits ``[len(side_block.tokens), vocab]`` of this source's side block, or ``None``.
    """

    committed: list[int]
    context: Context
    side_logits: torch.Tensor | None = None


@runtime_checkable
class DraftSource(Protocol):
    """Anything that can guess continuations. Implement these five members.

    One source object may serve many requests (and, for sources that learn across requests,
    many decoders), so per-request state must be keyed by ``Context.request_id``.
    """

    name: str

    def begin(self, context: Context) -> None:
        """A request starts with this prompt (``context.tokens`` is the prompt)."""
        ...

    def propose(self, context: Context, budget: int) -> Draft:
        """Guess continuations of ``context.root`` using at most ``budget`` draft tokens."""
        ...

    def observe(self, feedback: Feedback) -> None:
        """Learn from what was committed (and from side-block logits, if any were asked for).

        Called once after every ``propose``. The first new token of a request comes from the
        prefill, before any ``propose``, so it is never observed: the next ``context`` has it."""
        ...

    def end(self, context: Context) -> None:
        """The request is over (finished, stopped or failed); drop its per-request state."""
        ...
