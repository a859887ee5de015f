"""Is a checkpoint on disk whole? Completion markers and damaged-file detection.

A checkpoint specdraft writes into its cache ends with a marker file, ``specdraft-source.json``:
where the weights came from plus the size and sha256 of every other file in the directory. It is
written last, inside a temporary directory that is renamed into place only afterwards, so:

* a directory without a readable marker was never finished (or is not ours);
* a recorded file that is missing or has another size was damaged after the fact (a disk filling
  up, a partial copy or restore): :func:`check_marker` finds that with ``stat`` alone, cheaply
  enough to run on every resolution;
* :func:`verify_marker` also re-hashes the files: too slow for every load of a 2 GB checkpoint,
  so it runs only to explain a load that failed.

For any checkpoint, ours or the user's, :func:`damaged_safetensors` names ``.safetensors`` files
whose header does not parse or whose data is cut short: what a truncated download or copy looks
like, and what safetensors otherwise reports without saying which file it was reading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

#: The marker file of a finished cache checkpoint (provenance and the record of its files).
MARKER = "specdraft-source.json"

#: Marker format written now. Format 1 (no ``files`` record) came from earlier releases, which
#: also renamed finished directories into place, so such a directory is complete when written.
MARKER_FORMAT = 2


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (model files do not fit comfortably in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file or directory to disk, so a rename that follows cannot outlive the data it
    names after a power loss (a killed process loses nothing the kernel already has)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    with contextlib.suppress(OSError):  # e.g. directories cannot be opened on Windows: best effort
        fd = os.open(path, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: it lives under a temporary ``.*.partial`` name
    next to ``path`` and becomes ``path`` (flushed to disk first) only when the block ends without
    an error; otherwise it is deleted. So ``path`` is never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_file`: never half a file."""
    with atomic_file(path) as fh:
        fh.write(text.encode("utf-8"))


def write_marker(directory: Path, provenance: dict[str, Any]) -> None:
    """Record every file of ``directory`` (size and sha256) with ``provenance`` in the marker.

    Call it last, when nothing else will be written into ``directory``; the files are flushed to
    disk before the marker that vouches for them exists.
    """
    files: dict[str, dict[str, Any]] = {}
    for item in sorted(directory.iterdir()):
        if item.is_file() and item.name != MARKER:
            fsync_path(item)
            files[item.name] = {"size": item.stat().st_size, "sha256": sha256_file(item)}
    record = {**provenance, "format": MARKER_FORMAT, "files": files}
    write_text_atomic(directory / MARKER, json.dumps(record, indent=2) + "\n")


def check_marker(directory: Path) -> str | None:
    """``None`` if ``directory`` is a finished checkpoint whose recorded files all still have
    their recorded size; otherwise what is wrong, naming the file. Uses ``stat`` only."""
    if not directory.is_dir():
        return f"{directory} does not exist"
    try:
        record = json.loads((directory / MARKER).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{MARKER} is missing, so the directory was never finished"
    except (OSError, ValueError) as exc:
        return f"{MARKER} is unreadable ({exc})"
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict) or not (files is None or isinstance(files, dict)):
        return f"{MARKER} is not a specdraft marker"
    if files is None:  # format 1, from before files were recorded
        return None if (directory / "config.json").is_file() else "config.json is missing"
    for name, entry in files.items():
        try:
            size = (directory / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} cannot be read ({exc})"
        want = entry.get("size") if isinstance(entry, dict) else None
        if size != want:
            return f"{name} is {size} bytes, {MARKER} recorded {want}"
    return None


def verify_marker(directory: Path) -> list[str]:
    """Every problem :func:`check_marker` would report, plus recorded files whose sha256 changed."""
    problem = check_marker(directory)
    if problem is not None:
        return [problem]
    files = json.loads((directory / MARKER).read_text(encoding="utf-8")).get("files") or {}
    return [f"{name} does not have the sha256 recorded in {MARKER}"
            for name, entry in files.items() if sha256_file(directory / name) != entry.get("sha256")]


def damaged_safetensors(directory: Path) -> list[str]:
    """``.safetensors`` files of ``directory`` (and shards its index names) that are missing,
    cut short or have an unreadable header, each as ``"<file>: <why>"``."""
    wanted = {p.name for p in directory.glob("*.safetensors")}
    for index in directory.glob("*.safetensors.index.json"):
        try:
            wanted |= set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError) as exc:
            return [f"{index.name}: unreadable ({exc})"]
    problems = ((name, _safetensors_problem(directory / name)) for name in sorted(wanted))
    return [f"{name}: {why}" for name, why in problems if why]


def _safetensors_problem(path: Path) -> str:
    """Why ``path`` is not a whole safetensors file, or ``""``. Reads the header only (the
    library checks that the tensors it lists exactly cover the rest of the file)."""
    if not path.is_file():
        return "missing"
    from safetensors import safe_open  # a dependency of transformers

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # SafetensorError is not importable under one stable name
        return f"{exc} ({path.stat().st_size} bytes; the file is probably cut short)"
    return ""
