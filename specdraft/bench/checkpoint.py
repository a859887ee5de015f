"""Checkpoints of a benchmark run, so an interrupted ``specdraft bench`` can go on (``--resume``).

A full run (40 prompts x 7 methods x 128 tokens) takes one and a half hours per dataset on a
2-vCPU machine; a run killed near the end should not have to start again. After every prompt
the runner writes ``<out>/<dataset>/checkpoint.pkl``: the finished prompts' results and the
*state* of every method (the draft sources, which learn across prompts, and the adaptive
budget's measured costs). Resuming restores that state, so the remaining prompts are timed
exactly as if the run had never stopped; the rotation of the method order goes by the prompt's
index, so it continues too.

A checkpoint is only reused for the same experiment: its *fingerprint* (model, dtype, threads,
methods, prompts, token limit, versions, ...) must equal the new run's, else
:class:`CheckpointMismatch` names every setting that differs. The file is a pickle: load only
checkpoints you wrote yourself.

Draft sources that serve threads hold locks, which pickle refuses; :func:`dumps_with_locks`
writes a lock as "a new unlocked lock" (no thread can hold the copy), through a pickler's private
dispatch table, so nothing global is changed.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Checkpoint", "CheckpointMismatch", "dumps_with_locks", "first_difference", "load_checkpoint",
           "save_checkpoint"]

#: Bumped when the layout of :class:`Checkpoint` changes; older files are refused with a clear error.
FORMAT = 1

_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


class CheckpointMismatch(ValueError):
    """A checkpoint belongs to a different experiment than the one being resumed."""


@dataclass
class Checkpoint:
    """What a dataset's run has finished: ``runs[method]`` holds one entry per finished prompt
    (in prompt order), ``states[method]`` the method's cross-prompt state after the last one."""

    fingerprint: dict[str, Any]
    runs: dict[str, list[Any]] = field(default_factory=dict)
    states: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    @property
    def done(self) -> int:
        """Prompts finished by every method."""
        return min((len(r) for r in self.runs.values()), default=0)


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length difference counts), else None: where a
    saved prompt list leaves the one asked for now, and (in the runner, which imports this module)
    where a method's output leaves the baseline's."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _reduce_lock(lock: Any) -> tuple[Any, tuple[()]]:
    return _LOCK_TYPES[type(lock)], ()


def dumps_with_locks(obj: Any) -> bytes:
    """``pickle.dumps`` that writes a (R)Lock as a new unlocked one."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, **dict.fromkeys(_LOCK_TYPES, _reduce_lock)}
    pickler.dump(obj)
    return buffer.getvalue()


def save_checkpoint(path: Path, checkpoint: Checkpoint) -> None:
    """Write atomically (a temporary file renamed over the old one): a run killed while writing
    leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dumps_with_locks(checkpoint)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, fingerprint: dict[str, Any]) -> Checkpoint:
    """Read a checkpoint and check it belongs to the experiment described by ``fingerprint``.

    Everything must be equal but the prompt list, where one list may be a prefix of the other: a
    run may go on with a larger ``--limit`` (the finished prompts and the methods' states after
    them are exactly what a longer run would have had at that point), or be reported on a
    smaller one (its first prompts, without running anything)."""
    with open(path, "rb") as f:
        try:
            checkpoint = pickle.load(f)
        except Exception as exc:
            raise CheckpointMismatch(f"{path} is not a readable checkpoint ({type(exc).__name__}: {exc}); "
                                     "delete it to start this dataset again") from exc
    if not isinstance(checkpoint, Checkpoint) or getattr(checkpoint, "format", None) != FORMAT:
        raise CheckpointMismatch(f"{path} was written by another version of specdraft bench "
                                 f"(format {getattr(checkpoint, 'format', '?')}, this one reads {FORMAT}); "
                                 "delete it to start this dataset again")
    differing = [f"{key}: was {checkpoint.fingerprint.get(key)!r}, now {fingerprint.get(key)!r}"
                 for key in sorted(set(checkpoint.fingerprint) | set(fingerprint))
                 if key != "prompts" and checkpoint.fingerprint.get(key) != fingerprint.get(key)]
    saved, now = checkpoint.fingerprint.get("prompts"), fingerprint.get("prompts")
    if (saved is None) != (now is None) or (saved is not None and now[: len(saved)] != saved[: len(now)]):
        differing.append(f"prompts: the first {first_difference(saved or [], now or []) or 0} agree, then they "
                         "differ (a run may only be resumed on its prompts, or on a prefix or an extension of them)")
    if differing:
        raise CheckpointMismatch(f"{path} belongs to a different run; resuming would mix experiments. "
                                 "Differences: " + "; ".join(differing)
                                 + ". Use the original settings, another --out, or delete the checkpoint.")
    return checkpoint
