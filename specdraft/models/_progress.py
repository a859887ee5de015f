"""Progress output of model resolution: one-line messages and transformers' own bars.

Everything goes to stderr so that stdout stays clean for generated text and JSON.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


def say(progress: bool, message: str) -> None:
    """Print a ``specdraft: ...`` progress line on stderr when progress output is on."""
    if progress:
        print(f"specdraft: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def transformers_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' loading bars while a caller that asked for no progress output runs."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()
