"""Draft sources: each guesses continuations; the decoder merges their guesses into one tree."""

from .base import Context, Draft, DraftSource, Feedback, SideBlock
from .prompt_lookup import PromptLookup

__all__ = ["Context", "Draft", "DraftSource", "Feedback", "SideBlock", "PromptLookup"]
