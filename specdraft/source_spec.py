"""Draft sources named on a command line, with their settings: ``jacobi[window=3,ngram=4]``.

Why a tiny grammar of its own: a benchmark of a source's settings (the Jacobi (W, N, G) grid, the
trie's capacity) should be one ``specdraft bench --methods ...`` command that anyone can rerun,
not a script that builds sources by hand. So a source is written ``name`` or
``name[key=value,key=value]``, where ``key`` is a keyword argument of the source's constructor and
``value`` is read as an int, a float, ``true``/``false``, ``none``, or else a string. The commas
inside brackets belong to the source, so lists of specs are split with :func:`split_top_level`.

Every spec is checked by building the source once (cheap for every source here), so a typo in a
key or an out-of-range value is reported before a model is loaded, with the constructor's own
message (which names the bad value and what is allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["SourceSpec", "SourceSpecError", "parse_source_spec", "split_top_level"]


class SourceSpecError(ValueError):
    """A source spec that names no registered source, is malformed, or that the source refuses."""


@dataclass(frozen=True)
class SourceSpec:
    """One parsed spec: the registry name, the constructor keyword arguments, and a canonical text
    (no spaces, the keys in the order written) used in method names and file names."""

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""

    def build(self, registry: Mapping[str, Callable[..., Any]]) -> Any:
        """A new source instance (constructor errors become :class:`SourceSpecError`)."""
        try:
            return registry[self.name](**dict(self.kwargs))
        except (TypeError, ValueError) as exc:  # an unknown keyword, or a value the source refuses
            raise SourceSpecError(f"draft source {self.text!r}: {exc}") from None


def split_top_level(text: str, separator: str = ",") -> list[str]:
    """Split ``text`` at ``separator`` outside brackets; blank parts are dropped.

    ``"prompt,jacobi[window=3,ngram=4]"`` -> ``["prompt", "jacobi[window=3,ngram=4]"]``.
    """
    parts: list[str] = []
    depth = start = 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SourceSpecError(f"unbalanced ']' in {text!r}")
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise SourceSpecError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


#: Values written as words (in any case); every other value is an int, a float or else a string.
_WORDS = {"true": True, "false": False, "none": None}


def _value(text: str) -> Any:
    if text.lower() in _WORDS:
        return _WORDS[text.lower()]
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_source_spec(spec: str, registry: Mapping[str, Callable[..., Any]], check: bool = True) -> SourceSpec:
    """Parse one spec against ``registry`` (name -> factory taking keyword arguments); with
    ``check``, also build the source once so that the constructor judges the values now."""
    text = "".join(spec.split())
    name, bracket, rest = text.partition("[")
    if name not in registry:
        raise SourceSpecError(f"unknown draft source {name!r}; allowed: {', '.join(registry)}")
    kwargs: dict[str, Any] = {}
    if bracket:
        if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
            raise SourceSpecError(f"draft source {spec!r}: expected {name}[key=value,...]")
        for item in split_top_level(rest[:-1]):
            key, equals, value = item.partition("=")
            if not equals or not key.isidentifier() or not value:
                raise SourceSpecError(f"draft source {spec!r}: {item!r} is not key=value")
            if key in kwargs:
                raise SourceSpecError(f"draft source {spec!r}: {key!r} is given twice")
            kwargs[key] = _value(value)
        if not kwargs:
            text = name
    parsed = SourceSpec(name=name, kwargs=kwargs, text=text)
    if check:
        parsed.build(registry)  # before anything slow happens
    return parsed
