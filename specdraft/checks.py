"""Checks of arguments shared across the package, so that every refusal says the same thing."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int, meaning: str = "") -> None:
    """Refuse ``value`` unless it is an int of at least ``minimum``; a bool is refused too, since
    ``True`` passing as 1 hides a misplaced argument. ``meaning`` follows the bound in the message
    (``" (0: no global tree)"``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{meaning}, got {value!r}")
