"""Where two sequences part ways: one definition for the runner (method output against the
baseline's) and the checkpoint (a saved prompt list against the one asked for now).

It lives in its own module because the runner imports the checkpoint: defined in the runner, the
checkpoint could not use it without an import cycle, and it was written twice.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["first_difference"]


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
