"""The contract between the decoder and a draft source.

A draft source guesses what comes after the committed tokens. It never sees the model: the
decoder hands it a :class:`Context` and a node budget, takes back a :class:`Draft`, and after
the step reports what was committed in a :class:`Feedback`. Because the verifier accepts only
what the model itself would have produced, a source can be wrong as often as it likes; it only
costs speed, never correctness.

A source may also ask for a *side block*: extra tokens that ride along in the same forward pass
(never verified, never kept in the cache) whose logits come back in the feedback. Jacobi
lookahead decoding uses it to run its iteration window for free in the spare width of the pass.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Generic, Iterable, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np
import torch

from .bulk import collector_paused


class TokenView(Sequence[int]):
    """A read-only view of the first ``length`` tokens of a list that only grows (the decoder's
    committed sequence): what :attr:`Context.tokens` holds during decoding.

    Handing sources a view instead of a fresh tuple makes a context O(1) to build, whatever the
    sequence's length. Indexing and ``len`` are O(1); a slice is a new list of just the sliced
    tokens. It compares equal to any sequence with the same tokens.
    """

    __slots__ = ("_tokens", "_length")

    def __init__(self, tokens: list[int], length: int | None = None) -> None:
        self._tokens = tokens
        self._length = len(tokens) if length is None else length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return self._tokens[slice(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"token index out of range for a sequence of {self._length} tokens")
        return self._tokens[index]

    def __iter__(self):
        return itertools.islice(self._tokens, self._length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TokenView, list, tuple)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self._tokens[: self._length], dtype=dtype)

    def __repr__(self) -> str:
        return f"TokenView({self._length} tokens)"


@dataclass(frozen=True)
class Context:
    """What a source may look at when it drafts.

    ``tokens`` is the prompt followed by everything committed so far; its last element is the
    *root*, the newest committed token, whose successors the draft guesses.
    """

    tokens: Sequence[int]
    prompt_length: int
    request_id: int

    @property
    def output(self) -> Sequence[int]:
        """The tokens generated so far in this request (the prompt excluded)."""
        return self.tokens[self.prompt_length :]

    @property
    def root(self) -> int:
        """``tokens[-1]``, the newest committed token: the one whose successors are guessed."""
        return self.tokens[-1]


@dataclass
class SideBlock:
    """Extra tokens a source wants evaluated in the same forward pass.

    ``positions`` are offsets from the root's position (the root sits at offset 0, so its
    first successor is at 1). ``mask[i, j]`` says whether side token ``i`` may attend to side
    token ``j``. Every side token sees the whole KV cache and, if ``sees_root``, the root; it
    never sees the verification tree, and the tree never sees it.
    """

    tokens: list[int]
    positions: list[int]
    mask: np.ndarray
    sees_root: bool = True

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.positions) != n:
            raise ValueError(f"SideBlock has {n} tokens but {len(self.positions)} positions")
        self.mask = np.asarray(self.mask, dtype=bool)
        if self.mask.shape != (n, n):
            raise ValueError(f"SideBlock mask must have shape ({n}, {n}), got {self.mask.shape}")
        if n and min(self.positions) < 1:
            raise ValueError("SideBlock positions are offsets after the root and must be >= 1")


@dataclass
class Draft:
    """A source's guess for one step.

    ``branches`` are candidate continuations of the root, best first. A tree is given as its
    root-to-leaf paths: the decoder merges shared prefixes, so a prefix-closed subtree (such as
    the trie's hierarchical draft) loses nothing by being listed this way.
    """

    branches: list[list[int]] = field(default_factory=list)
    side_block: SideBlock | None = None


@dataclass(frozen=True)
class Feedback:
    """What happened in the step a source drafted for.

    ``committed`` are the tokens appended to the context this step (the accepted path plus the
    model's own next token, cut by the stop rules). ``context`` is the context after the commit.
    ``side_logits`` are the float32 logits ``[len(side_block.tokens), vocab]`` of this source's
    side block; ``None`` when it proposed none, or when the block was dropped because one of its
    positions fell outside the model's context.

    ``side_argmax`` is the argmax of each row of ``side_logits`` (host ints, read with the step's one
    device read, so a source needs no read of its own); ``None`` when ``side_logits`` is.
    ``top_ids`` / ``row_tokens`` are filled only for sources whose ``top_k`` is > 0 (``None`` for
    the rest): ``top_ids[i]`` are the ``k`` most likely next tokens (int64, best first, ``k`` = the
    largest ``top_k`` any of the decoder's sources asked for, at most the vocabulary) of forward
    row ``i``, whose input token was ``row_tokens[i]``. The rows are every position whose logits
    the step computed: the root, then every tree node in tree order, accepted or not (side blocks
    are excluded). In a request's first observed step the prefill's last row (the prompt's last
    token) comes first. The scores are the raw logits, before any sampling warper.
    """

    committed: list[int]
    context: Context
    side_logits: torch.Tensor | None = None
    top_ids: np.ndarray | None = None
    row_tokens: np.ndarray | None = None
    side_argmax: list[int] | None = None


@runtime_checkable
class DraftSource(Protocol):
    """Anything that can guess continuations. Implement these five members.

    One source object may serve many requests (and, for sources that learn across requests,
    many decoders), so per-request state must be keyed by ``Context.request_id``
    (:class:`SourceBase` does that, with a lock).

    One optional method makes a source transactional:

    ``abort(context)``
        called *instead of* ``end`` when the request failed (an exception, ``KeyboardInterrupt``
        included, raised after this source's ``begin``): take back everything the request taught
        state that outlives it (a shared trie, n-gram table or matrix), so the source is exactly
        as it was before the request, then drop the per-request state. A source without it gets
        ``end`` (:class:`SourceBase` provides an ``abort`` that calls ``end``, right for sources
        whose only state is per-request). A caller closing a stream early is not a failure: what
        was committed was verified, so it is kept and ``end`` is called.

    Three optional attributes tune what the decoder does for a source; a source without them gets
    ``0`` or ``False`` (so the runtime ``isinstance`` check only asks for the five members above them):

    ``warmup_steps``
        steps the source needs before its drafts mean anything (Jacobi fills its window first);
        the adaptive budget keeps its full width at least that long before judging acceptance.
    ``top_k``
        ask for the model's top-``k`` next tokens at every row of each step's forward, delivered in
        :attr:`Feedback.top_ids` (Token Recycling drafts from them). The decoder takes one
        ``torch.topk`` per step for the largest ``k`` asked; sources that leave it at 0 cost nothing.
    ``observes_late``
        ``True`` when ``observe`` only learns: the next ``propose`` reads what it needs from its
        context, not from the last feedback. On an accelerator the decoder then hands over a
        step's feedback one step late, once the next forward is launched, so the learning runs
        while the device computes instead of between its forwards. Feedbacks still come in step
        order, each once, all before ``end`` or ``abort``; a step in which the source had a side
        block is observed at once (its logits live in the forward's output buffers).
    """

    name: str

    def begin(self, context: Context) -> None:
        """A request starts with this prompt (``context.tokens`` is the prompt)."""
        ...

    def propose(self, context: Context, budget: int) -> Draft:
        """Guess continuations of ``context.root`` using at most ``budget`` draft tokens.

        A ``budget`` of 0 means no draft is wanted this step (plain decoding, or a pause in which
        the decoder drafts nothing because recent drafts did not pay): return at once, with at
        most a side block, which the decoder leaves out of a step without drafts."""
        ...

    def observe(self, feedback: Feedback) -> None:
        """Learn from what was committed (and from side-block logits, if any were asked for).

        Called once after every ``propose``. The first new token of a request comes from the
        prefill, before any ``propose``, so it is never observed: the next ``context`` has it."""
        ...

    def end(self, context: Context) -> None:
        """The request is over (finished, or stopped by a stop rule, the token limit or a caller
        closing its stream); drop its per-request state."""
        ...


def within_budget(branches: Iterable[Sequence[int]], budget: int) -> list[list[int]]:
    """The ``branches`` in order while their lengths add up to at most ``budget``, the last one cut
    to fit (a prefix shared by two branches counted in each)."""
    kept: list[list[int]] = []
    for branch in branches:
        if budget <= 0:
            break
        kept.append(list(branch[:budget]))
        budget -= len(kept[-1])
    return kept


#: The optional attributes of a draft source, with the value the decoder assumes when absent.
OPTIONAL_ATTRIBUTES: dict[str, int] = {"warmup_steps": 0, "top_k": 0}


def source_option(source: Any, attribute: str) -> int:
    """An optional attribute of ``source`` (see :class:`DraftSource`), checked to be an int >= 0."""
    value = getattr(source, attribute, OPTIONAL_ATTRIBUTES[attribute])
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"draft source {getattr(source, 'name', source)!r} has {attribute}={value!r}; "
                         "it must be an int >= 0")
    return int(value)


def observes_late(source: Any) -> bool:
    """The optional ``observes_late`` flag of ``source`` (see :class:`DraftSource`), checked to be a bool."""
    value = getattr(source, "observes_late", False)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"draft source {getattr(source, 'name', source)!r} has observes_late={value!r}; "
                         "it must be True or False")
    return bool(value)


State = TypeVar("State")


class SourceBase(Generic[State]):
    """An optional base class for draft sources: no-op lifecycle and per-request state.

    Subclasses set ``name``, implement ``propose`` and, if they keep per-request state, implement
    :meth:`new_state` and read it with :meth:`request_state` (or :meth:`peek_state`). States are keyed by ``Context.request_id``
    under one lock, so one source object can serve several decoders in several threads; a state
    is dropped at ``end`` (and made on demand if ``begin`` was not seen, e.g. for a source added
    mid-request in a test). Subclasses that override ``begin``/``end`` call ``super()``.
    """

    name: str = "source"
    warmup_steps: int = 0
    top_k: int = 0

    def __init__(self) -> None:
        self._states: dict[int, State] = {}
        self._states_lock = threading.Lock()

    def new_state(self, context: Context) -> State | None:
        """The per-request state for a request starting with ``context`` (none by default)."""
        return None

    def request_state(self, context: Context) -> State:
        """This request's state, made with :meth:`new_state` if it does not exist yet."""
        with self._states_lock:
            found = self._states.get(context.request_id)
        if found is None:
            made = self.new_state(context)
            with self._states_lock:
                found = self._states.setdefault(context.request_id, made)  # type: ignore[arg-type]
        return found  # type: ignore[return-value]

    def peek_state(self, request_id: int) -> State | None:
        """A request's state if it has one (``None`` outside a request): for inspection."""
        with self._states_lock:
            return self._states.get(request_id)

    def pop_state(self, request_id: int) -> State | None:
        """Take a request's state out (``None`` if it has none): for subclasses that finish a
        request their own way (undoing what it taught shared state) before dropping its state."""
        with self._states_lock:
            return self._states.pop(request_id, None)

    def running_states(self) -> list[State]:
        """The states of the requests begun and not yet ended, in the order they began (a copy):
        for inspection and invariant checks."""
        with self._states_lock:
            return list(self._states.values())

    def begin(self, context: Context) -> None:
        with collector_paused():  # a state indexes the whole prompt: many objects, none garbage
            made = self.new_state(context)
        if made is not None:
            with self._states_lock:
                self._states[context.request_id] = made

    def propose(self, context: Context, budget: int) -> Draft:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, feedback: Feedback) -> None:
        """Nothing to learn by default."""

    def end(self, context: Context) -> None:
        with self._states_lock:
            self._states.pop(context.request_id, None)

    def abort(self, context: Context) -> None:
        """The request failed (see :class:`DraftSource`). A source whose learning outlives its
        requests overrides this to undo it; per-request state alone only needs :meth:`end`."""
        self.end(context)

    @property
    def active_requests(self) -> int:
        """Requests begun and not yet ended (a bounded number: states never outlive their request)."""
        with self._states_lock:
            return len(self._states)

    # Copies (pickle, deepcopy: the bench copies sources for its repeats) get new, unlocked locks:
    # every attribute that holds a lock is left out and made again, so a subclass with locks of its
    # own needs no pickling code for them.

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if not isinstance(v, _LOCK_TYPES)}
        state["_lock_attributes"] = [k for k, v in self.__dict__.items() if isinstance(v, _LOCK_TYPES)]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        made = {name: threading.Lock() for name in state.pop("_lock_attributes", ["_states_lock"])}
        self.__dict__.update(state)
        self.__dict__.update(made)


#: The lock types :class:`SourceBase` recreates on copy (``threading.RLock`` is a factory).
_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))
