"""Keeping Python's cyclic garbage collector off the sources' hot path.

Two tools. :func:`collector_paused` pauses the collector while a source indexes a long prompt.
:func:`settle_long_lived` moves everything alive at a quiet moment out of the collector's reach.

Pausing.
Indexing a prompt makes many small objects at once (a frequency trie makes about 13 nodes per
prompt token). Every 700 new container objects Python runs a young-generation collection, and
every so often a full one over everything alive, so the cost of each new node grows with the
size of the heap: a 16k-token prompt took the trie about 1.1 s to index with the collector on
and 0.15 s with it paused. Nothing an index makes is garbage while it is being made, so the
collector has nothing to find there; it runs again (and catches up) when the pause ends.

The pause is process-wide but counted: nested or concurrent pauses (sources indexing in several
threads) re-enable the collector only when the last one ends, and only if it was enabled before
the first began.

Settling. A full collection scans every tracked object alive, and fires on its own once the
objects that survived younger collections since the last one number a quarter of those that
survived it. A server process holds several hundred thousand tracked objects that never die
(torch and transformers alone make ~300 000 on import, the model's modules more), so on a busy
CPU core every full collection costs a few hundred milliseconds, in the middle of a step.
``gc.freeze()`` moves every tracked object to a permanent generation that no collection scans;
called at a moment when nothing short-lived is alive (no request in flight), it leaves the
collector only what is made afterwards: the running requests' state and its garbage. The
sources keep their long-lived state in untracked containers and flat lists (see each source), so
what a request makes stays small and a full collection stays short.

A frozen object is freed as usual when its reference count drops to zero; only a frozen object
in a reference cycle would outlive its last user, which is why the sources' long-lived state holds
no cycles, and why the freeze follows a collection (so no garbage is frozen).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["collector_paused", "settle_long_lived"]

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the cyclic garbage collector disabled (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def settle_long_lived() -> None:
    """Collect garbage, then freeze every object alive now out of the collector's scans (see the
    module docstring). Call it where no request is in flight: once the model and the sources are
    set up, and then whenever the last running request has ended. The first call costs one full
    collection of the process; later ones only scan what was made since the previous call."""
    with _lock:
        if _depth:  # a source is indexing a prompt: its half-built index is not long-lived yet
            return
    gc.collect()
    gc.freeze()
