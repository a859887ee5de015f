"""Drafting pauses: where a request's drafts stop buying tokens, stop paying for them for a while.

Drafting is host work: every source searches its tables and the merge builds the full tree, a
few tenths of a millisecond to a millisecond for the default sources. On a CPU a step of a 0.5B
model costs tens of milliseconds and that hides in it. On a GPU a plain step replays a captured
graph in about 4 ms, and a tree step's host work added about 0.7 ms to it. On chat the budget checks almost no draft
(the trees would not pay), yet every step still drafted them: on an H100 the default ran at
0.85x our plain decoding on MT-Bench with 1.02 tokens per step.

The rule, per request: the request keeps a moving average of what its drafts bought, the draft
tokens each drafted step committed (beyond the model's own token, so 0 where the budget checked
nothing or nothing was accepted). While that average, times a plain step's time, is below the
time a draft takes, drafting does not pay: after each such draft the request skips drafting for
its next steps, which run as plain steps. The pause doubles with each such draft in a row (1, 2,
4, ... steps), up to the longest at which the drafting still done costs at most the budget's
``drafting_share`` of a plain step's time (5% by default; 0 never pauses); a draft that brings
the average back up ends it. The average starts at one token and moves by :data:`SMOOTHING` per
drafted step, so a request pauses only after a run of drafts that bought nothing, and a hit
after a pause counts at once. A step on which the budget's whole-tree trial measures its arm that
is not leading (:mod:`specdraft.budget.whole_tree`) does not count: there the drafts were checked
by a rule the request does not follow (where the whole tree leads, the choice often checks none),
so it says nothing of what they buy. Where drafting is cheap next to a step (a CPU) the longest
pause is 0 and nothing changes; where it is dear (a GPU) a request that stops finding drafts
still looks every few steps.

On an accelerator a pause's steps still draft, but behind the forward: while the device computes
step t, every source drafts from the context before step t's tokens, and step t + 1 checks the
part of those drafts that follows the tokens step t committed
(:meth:`~specdraft.engine.drafting.Drafter.propose_lagged`). Such drafts are a step late but
cost the device no wait, so there a pause may last :data:`MAX_PAUSE` steps whatever drafting
costs, and lagged drafts that pay end it at once.

A skipped step checks nothing or a lagged tree, so the output is exactly the same either way.
Every source is still asked (on a CPU with a budget of 0; each ``observe`` follows a
``propose``, as the protocol says) and still hears every committed token; the budget learns from
every tree drafted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The longest pause in steps, whatever drafting costs: a request that begins to repeat text
#: waits at most this long for its next look.
MAX_PAUSE = 16
#: Weight of the newest draft in the moving averages of drafting time and of tokens bought.
SMOOTHING = 0.2
#: What a request's drafts are assumed to buy before any was drafted, in tokens per draft.
OPENING_GAIN = 1.0


@dataclass
class DraftPause:
    """One request's drafting time and pause (see the module docstring)."""

    #: seconds one draft takes (moving average; ``None`` before the first)
    seconds: float | None = None
    #: draft tokens committed per drafted step (moving average)
    gain: float = OPENING_GAIN
    #: drafts in a row that did not pay
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

    def settled(self, draft_tokens: int, plain_step_seconds: float | None, share: float,
                hidden: bool = False) -> None:
        """A drafted step committed ``draft_tokens`` draft tokens (its tokens but the model's own);
        a plain step now costs ``plain_step_seconds`` (``None``: unknown, or the budget does not
        choose: no pause); drafts that buy nothing may cost ``share`` of it. ``hidden``: the step's
        drafts were made behind a forward (a pause's step on an accelerator), which costs nothing,
        so the pause may last :data:`MAX_PAUSE` steps; drafts that pay end it at once."""
        self.gain = (1 - SMOOTHING) * self.gain + SMOOTHING * max(0, draft_tokens)
        if self.seconds is None or not plain_step_seconds or self.gain * plain_step_seconds >= self.seconds:
            self.idle = 0
            self.left = 0
            return
        self.idle += 1
        longest = MAX_PAUSE if hidden else self.longest(plain_step_seconds, share)
        self.left = min(2 ** min(self.idle - 1, 30), longest)

    def longest(self, plain_step_seconds: float | None, share: float) -> int:
        """The longest pause at which drafting every ``pause + 1`` steps costs at most ``share``
        of a plain step."""
        if self.seconds is None or not plain_step_seconds or plain_step_seconds <= 0 or share <= 0:
            return 0
        steps = math.ceil(self.seconds / (share * plain_step_seconds) - 1e-9)
        return max(0, min(MAX_PAUSE, steps - 1))
