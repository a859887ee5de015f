"""What a call gives back: each request's output, and what the whole call cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..stats import GenerationStats


@dataclass
class BatchStats:
    """What a whole call cost: every forward counted once, whatever it carried."""

    forwards: int = 0
    new_tokens: int = 0
    wall_time: float = 0.0
    rows: int = 0  # rows of every forward, summed
    #: (running requests, tree nodes of each decoding request) per forward
    tree_sizes: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_rows(self) -> float:
        """Rows per forward: the width the batch ran at."""
        return self.rows / self.forwards if self.forwards else 0.0

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.forwards} forwards ({self.mean_rows:.1f} rows each), "
                f"{self.tokens_per_s:.1f} tokens/s ({self.wall_time:.2f} s)")


@dataclass
class BatchOutput:
    """One request's result: its new tokens, text and statistics, and the error that ended it
    (``None`` when it ran to a stop rule; a cancelled request has ``cancelled`` set)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    error: BaseException | None = None
    cancelled: bool = False


class BatchResult(Sequence[BatchOutput]):
    """The outputs of :meth:`~specdraft.decoder.Decoder.generate_batch` in prompt order (a
    sequence of :class:`BatchOutput`), with the call's totals in :attr:`stats`."""

    def __init__(self, outputs: list[BatchOutput], stats: BatchStats) -> None:
        self.outputs = outputs
        self.stats = stats

    def __getitem__(self, index):  # type: ignore[override]
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)
