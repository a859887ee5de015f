"""What a caller hands in and reads out around the engine: per-request settings, and text as it
commits (held back while a character is incomplete)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .engine.loop import Batch
from .engine.outputs import BatchOutput, BatchResult, BatchStats


@dataclass
class BatchRequest:
    """One request of a batch with its own settings. Fields left ``None`` take the values given to
    :meth:`~specdraft.decoder.Decoder.generate_batch` (and from there the model's generation
    config, as in :meth:`~specdraft.decoder.Decoder.generate`)."""

    prompt: Any
    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] | str | None = None


class BatchStream:
    """What :meth:`~specdraft.decoder.Decoder.stream_batch` returns: iterate it for ``(request
    index, new text)`` pairs as tokens commit (``(index, token ids)`` without a tokenizer; text is
    held back while a character is incomplete). :meth:`cancel` ends one request, the others go
    on; after the iteration, :attr:`outputs` and :attr:`stats` hold the results."""

    def __init__(self, batch: Batch, tokenizer: Any) -> None:
        self._batch = batch
        self._tokenizer = tokenizer
        self._iterator: Iterator | None = None

    def cancel(self, index: int) -> None:
        self._batch.cancel(index)

    @property
    def outputs(self) -> list[BatchOutput | None]:
        return self._batch.outputs

    @property
    def stats(self) -> BatchStats:
        return self._batch.stats

    def result(self) -> BatchResult:
        """Run what is left and return every request's output (the same as ``generate_batch``)."""
        for _ in self:
            pass
        return BatchResult([o for o in self._batch.outputs if o is not None], self._batch.stats)

    def __iter__(self):
        if self._iterator is None:
            self._iterator = stream_pieces(self._batch, self._tokenizer)
        return self._iterator

    def __next__(self):
        return next(iter(self))

    def close(self) -> None:
        """Stop now: every running request ends as cancelled (its sources finish normally)."""
        if self._iterator is not None:
            self._iterator.close()


def stream_pieces(batch: Batch, tokenizer: Any) -> Iterator[tuple[int, str | list[int]]]:
    """``(index, new text)`` as a batch's requests commit, or ``(index, token ids)`` without a
    tokenizer. A request's text is held back while it ends in an incomplete character (a
    multi-byte character split across tokens), unless the request is over; whatever is left is
    given at the end.

    A function of the batch, not a method of :class:`BatchStream`: the generator must not hold the
    stream that holds it, or a stream the caller drops (a loop left by ``break``) would keep the
    decoder busy until the cyclic garbage collector runs."""
    if tokenizer is None:
        yield from batch
        return
    outputs = batch.outputs
    tokens: dict[int, list[int]] = {}
    shown: dict[int, int] = {}

    def new_text(index: int, hold_back: bool) -> Iterator[tuple[int, str]]:
        text = tokenizer.decode(tokens[index], skip_special_tokens=True)
        if len(text) > shown.get(index, 0) and not (hold_back and text.endswith("\ufffd")):
            yield index, text[shown.get(index, 0):]
            shown[index] = len(text)

    for index, chunk in batch:
        tokens.setdefault(index, []).extend(chunk)
        yield from new_text(index, hold_back=outputs[index] is None)
    for index in tokens:
        yield from new_text(index, hold_back=False)
