"""What the step uses of the engine, as a protocol: the step and the settling depend on it, not on
the engine that runs them (which would make the engine and its step import each other)."""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, Sequence

from ..budget import Budget
from ..model.runner import ModelRunner
from .drafting import Drafter
from .widths import Widths


class Parts(Protocol):
    """The model runner, the sources (through the drafter), the budget, the clock, the kernels
    context entered around each forward, the widths forwards are padded to, where rows are
    chosen, whether host work hides behind the forward, how token ids become an output's text,
    and what holds the engine for a call."""

    runner: ModelRunner
    drafter: Drafter
    budget: Budget
    clock: Callable[[], float]
    kernels: Callable[[], ContextManager[Any]]
    padding: Widths | None
    #: the forward runs while the host goes on (an accelerator): work the next read does not
    #: need waits for the launch and runs behind it
    hides_host_work: bool
    #: an output's text from its token ids (``None`` without a tokenizer)
    text: Callable[[Sequence[int]], str | None]

    #: whether each step chooses every tree row's token on the device at once
    batched_rows: bool

    def held(self, concurrency: int) -> ContextManager[None]: ...
