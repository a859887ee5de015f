"""Checks of arguments shared across the package, so that every refusal says the same thing."""

from __future__ import annotations

import numbers
from typing import Any, Callable


def check_int(name: str, value: Any, minimum: int, meaning: str = "", none_ok: bool = False,
              numpy_ok: bool = False) -> None:
    """Refuse ``value`` unless it is an int of at least ``minimum``; a bool is refused too, since
    ``True`` passing as 1 hides a misplaced argument. ``meaning`` follows the bound in the message
    (``" (0: no global tree)"``); ``none_ok`` lets ``None`` through (the message says so);
    ``numpy_ok`` takes any integral number (numpy's ints too, which grids of settings hand over).
    The type is checked before the bound, so a wrong one (a string from the command line, say) is
    named rather than failing a comparison."""
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if numpy_ok else int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if none_ok else ''}{meaning}, got {value!r}")


def check_number(name: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> None:
    """Refuse ``value`` unless it is a real number (numpy's too, not a bool) for which ``ok`` holds;
    ``allowed`` says which in the message (``"a finite number >= 1"``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
