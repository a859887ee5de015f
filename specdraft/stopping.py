"""When to stop: EOS ids, a token limit and stop strings, applied to a whole step at once.

A step may commit many tokens; the rules here cut that step's tokens at the first point plain
decoding would have stopped, so accepted drafts past a stop are never emitted and the token
limit is never exceeded.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


class StopRule:
    """Decides how many of a step's tokens to keep and whether generation is over."""

    def __init__(self, eos_token_ids: Iterable[int], max_new_tokens: int, stop_strings: Sequence[str] = (),
                 tokenizer: Any = None) -> None:
        if stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output; pass tokenizer= to Decoder")
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_strings = tuple(stop_strings)
        self.tokenizer = tokenizer
        self._longest_stop = max((len(s) for s in self.stop_strings), default=0)

    def cut(self, generated: Sequence[int], step_tokens: Sequence[int]) -> tuple[list[int], bool]:
        """Return (the part of ``step_tokens`` to commit, whether generation ends with them).

        ``generated`` is what was committed before this step (the prompt excluded).
        """
        kept = list(step_tokens[: max(0, self.max_new_tokens - len(generated))])
        done = len(generated) + len(kept) >= self.max_new_tokens
        for i, token in enumerate(kept):
            if token in self.eos:
                kept, done = kept[: i + 1], True
                break
        if self.stop_strings and kept:
            stop_at = self._stop_string_end(generated, kept)
            if stop_at is not None:
                kept, done = kept[:stop_at], True
        return kept, done

    def _stop_string_end(self, generated: Sequence[int], new: list[int]) -> int | None:
        """Smallest k such that the text of ``generated + new[:k]`` contains a stop string that the
        text of ``generated`` alone did not; None if no stop string appears."""
        decode = self.tokenizer.decode
        before = decode(list(generated))
        start = max(0, len(before) - self._longest_stop)

        def hit(k: int) -> bool:
            text = decode(list(generated) + new[:k])
            return any(s in text[start:] for s in self.stop_strings)

        if not hit(len(new)):
            return None
        return next(k for k in range(1, len(new) + 1) if hit(k))  # (at the latest len(new))


def eos_ids(model: Any) -> list[int]:
    """The end-of-sequence ids of ``model``'s generation config (none when it sets none)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
