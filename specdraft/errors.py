"""Errors shared by the command-line front ends (``specdraft generate`` and ``specdraft bench``)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A problem with the command line the user can fix; reported without a traceback, exit 2."""
