"""Per-generation statistics, in the terms users and Spec-Bench expect."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SourceStats:
    """Draft tokens one source put in the tree, and how many of them the model accepted."""

    proposed: int = 0
    accepted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"proposed": self.proposed, "accepted": self.accepted}


@dataclass
class GenerationStats:
    """What one generation cost.

    ``steps`` counts the forward passes that committed tokens: the prefill (it gives the first new
    token, as in ``model.generate``) and every tree step after it, so plain decoding takes one
    per token. ``mean_accepted`` is new tokens per step (the compression ratio S of the papers:
    1.0 is plain decoding). ``accept_lengths`` has the
    tokens committed by each step (Spec-Bench's field). A node proposed by two sources counts for
    both in ``per_source``.
    """

    steps: int = 0
    new_tokens: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    #: steps that ran without drafting: the drafts before them did not pay for their host time
    #: (:mod:`specdraft.engine.pause`)
    skipped_drafts: int = 0

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "mean_accepted": self.mean_accepted,
            "wall_time": self.wall_time,
            "prefill_time": self.prefill_time,
            "tokens_per_s": self.tokens_per_s,
            "accept_lengths": list(self.accept_lengths),
            "per_source": {k: v.as_dict() for k, v in self.per_source.items()},
            "skipped_drafts": self.skipped_drafts,
        }

    def summary(self) -> str:
        """One line: tokens, steps, mean accepted, tokens/s."""
        return (f"{self.new_tokens} tokens in {self.steps} steps, mean accepted {self.mean_accepted:.2f}, "
                f"{self.tokens_per_s:.1f} tokens/s ({self.wall_time:.2f} s)")
