"""What can go wrong when finding, fetching or loading a model.

Every message is written for the user as is (the CLI prints it without a traceback), so each one
names the model, file or value at fault and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "ModelError",
    "ModelFetchError",
    "ModelNotFoundError",
]


class ModelError(Exception):
    """Base class of every model-resolution problem; its message is meant for the user as is."""


class ModelNotFoundError(ModelError, ValueError):
    """The name given matches nothing we know how to load (a user error: fix the argument)."""


class ModelFetchError(ModelError, RuntimeError):
    """The name was understood but getting the model failed (download, checksum, conversion)."""


class ChecksumMismatchError(ModelFetchError):
    """An assembled file does not have the pinned sha256: the published packages changed."""


class CorruptCheckpointError(ModelFetchError):
    """A checkpoint on disk is damaged (a file cut short or altered); the message names the file
    and says what to delete, because only a new download or a re-save can fix it."""
