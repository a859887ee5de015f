"""Drafting pauses: where the budget declines a request's drafts, stop paying for them for a while.

Drafting is host work: every source searches its tables and the merge builds the full tree, about
a millisecond for the default sources. On a CPU a step of a 0.5B model costs tens of
milliseconds and that millisecond hides in it. On a GPU a plain step replays a captured graph in
about 4 ms, and the host work is a quarter of it. On chat the budget checks almost no draft
(the trees would not pay), yet every step still drafted them: on an H100 the default ran at
0.85x our plain decoding on MT-Bench with 1.02 tokens per step.

The rule, per request: a draft is *idle* when the tree the budget checks of it is expected to
save less time than the draft took, that is when its expected extra tokens (the request's
acceptance by rank, summed over the checked nodes; none when the budget declined them all) times
a plain step's time fall short of the drafting time. After an idle draft the request skips
drafting for its next steps, which run as plain steps. The pause doubles with each idle draft in
a row (1, 2, 4, ... steps), up to the longest at which the drafting still done costs at most
:data:`HOST_SHARE` of a plain step's time; a draft that pays ends it. So where drafting is cheap
next to a step (a CPU) the longest pause is 0 and nothing changes, and where it is dear (a GPU) a
request that stops finding drafts still looks every few steps, and a match found then starts
speculation again at once.

A skipped step is a plain step, so the output is exactly the same either way; the sources still
hear every committed token (they keep their contexts), and the budget learns from every tree
drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The most of a plain step's time that idle drafts may cost, on average.
HOST_SHARE = 0.05
#: The longest pause in steps, whatever drafting costs: a request that begins to repeat text
#: waits at most this long for its next look.
MAX_PAUSE = 16
#: Weight of the newest drafting time in its moving average.
SMOOTHING = 0.3


@dataclass
class DraftPause:
    """One request's drafting time and pause (see the module docstring)."""

    #: seconds one draft takes (moving average; ``None`` before the first)
    seconds: float | None = None
    #: idle drafts in a row
    idle: int = 0
    #: steps still to run without drafting
    left: int = 0

    def skip(self) -> bool:
        """Whether this step runs without drafting."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def drafted(self, seconds: float) -> None:
        """A draft took ``seconds``."""
        if not (math.isfinite(seconds) and seconds >= 0.0):
            return
        self.seconds = seconds if self.seconds is None else (1 - SMOOTHING) * self.seconds + SMOOTHING * seconds

    def checked(self, expected_tokens: float, plain_step_seconds: float | None) -> None:
        """The budget checks nodes of this step's draft that are expected to add
        ``expected_tokens`` (0: it declined them all); a plain step now costs
        ``plain_step_seconds`` (``None``: unknown, or the budget does not choose: no pause)."""
        if self.seconds is None or not plain_step_seconds or expected_tokens * plain_step_seconds >= self.seconds:
            self.idle = 0
            return
        self.idle += 1
        self.left = min(2 ** min(self.idle - 1, 30), self.longest(plain_step_seconds))

    def longest(self, plain_step_seconds: float | None) -> int:
        """The longest pause at which drafting every ``pause + 1`` steps costs at most
        :data:`HOST_SHARE` of a plain step."""
        if self.seconds is None or not plain_step_seconds or plain_step_seconds <= 0:
            return 0
        steps = math.ceil(self.seconds / (HOST_SHARE * plain_step_seconds) - 1e-9)
        return max(0, min(MAX_PAUSE, steps - 1))
