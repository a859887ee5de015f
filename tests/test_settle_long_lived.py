"""``settle_long_lived``: what is alive at a quiet moment leaves the collector's scans; garbage does not."""

from __future__ import annotations

import gc

from specdraft.sources.bulk import collector_paused, settle_long_lived


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_settle_freezes_the_living_and_collects_the_garbage_first() -> None:
    try:
        kept = [Cycle() for _ in range(100)]
        for _ in range(50):
            Cycle()  # garbage in a cycle, waiting for a collection
        settle_long_lived()
        assert gc.get_freeze_count() >= len(kept)
        assert not any(o is kept[0] for o in gc.get_objects())  # frozen: no collection scans it
        assert not any(isinstance(o, Cycle) for o in gc.get_objects())  # the garbage went first
        made = [Cycle() for _ in range(10)]
        assert sum(isinstance(o, Cycle) for o in gc.get_objects()) == len(made)  # what comes later is scanned
        with collector_paused():  # a prompt being indexed: not a quiet moment, nothing is frozen
            frozen = gc.get_freeze_count()
            settle_long_lived()
            assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
