"""Hugging Face hub ids: the local HF cache first, the hub itself only when asked to go online.

Both lookups go through ``huggingface_hub.snapshot_download`` (with ``local_files_only=True`` for
the cache), so the cache layout, revisions and environment settings (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_TOKEN``) are huggingface_hub's, not a copy of them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ._progress import say

#: Seconds to wait for the hub to answer a metadata request before giving up on it.
HUB_PROBE_TIMEOUT = float(os.environ.get("SPECDRAFT_HUB_TIMEOUT", "5"))

#: File patterns worth downloading from a hub repo (no ONNX/GGUF/TF/Flax duplicates, no code).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def looks_like_repo_id(name: str) -> bool:
    """True for ``name`` or ``org/name`` spelled the way the hub allows."""
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and ".." not in name


def is_checkpoint_dir(path: Path) -> bool:
    """A directory ``from_pretrained`` can load: it has a ``config.json``."""
    return path.is_dir() and (path / "config.json").is_file()


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.safetensors.index.json"))


def hub_local(repo_id: str) -> Path | None:
    """The snapshot of ``repo_id`` if it is complete in the local HF cache (no network)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=HUB_PATTERNS))
    except Exception:  # not cached, invalid id, hub library missing: simply not found here
        return None
    return path if is_checkpoint_dir(path) and _has_weights(path) else None


def _offline() -> bool:
    """``HF_HUB_OFFLINE``, read now: huggingface_hub reads it once at import, which would miss a
    setting made later in the process (tests and notebooks do that)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_online(repo_id: str, progress: bool) -> tuple[Path | None, str]:
    """Download ``repo_id`` from the hub; ``(None, reason)`` on any failure.

    A metadata request with a short timeout comes first, so an unreachable or blocked hub costs
    seconds rather than the minutes ``snapshot_download`` would spend retrying.
    """
    if _offline():
        return None, "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi, snapshot_download

        info = HfApi().model_info(repo_id, timeout=HUB_PROBE_TIMEOUT)
        files = [s.rfilename for s in (info.siblings or [])]
        patterns = list(HUB_PATTERNS)
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")  # old repos ship only pytorch_model.bin
        say(progress, f"downloading {repo_id} from the Hugging Face hub")
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=HUB_PROBE_TIMEOUT))
    except Exception as exc:  # offline, DNS, 401/404, timeouts, disk: all mean "not from the hub"
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
    if not is_checkpoint_dir(path):
        return None, "the hub repo has no config.json"
    return path, ""
