"""The benchmark-only ``arctic-suffix`` adapter runs through the real decoder even where the
authors' C++ extension is not built: a stand-in with the same small API (it drafts a copy of the
prompt's continuation, like a suffix match would) takes its place, so a change to the source
protocol or to SourceBase that breaks the adapter fails here, not in a half-hour benchmark."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from conftest import reference_greedy, tiny_model
from specdraft import Decoder


@dataclass
class _Draft:
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)


class FakeSuffixDecodingCache:
    """What the adapter calls, with a naive "longest earlier match" draft over each request."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.active: dict[int, list[int]] = {}
        self.cached: list[int] = []

    @property
    def cached_requests(self) -> set[int]:
        return set(self.cached)

    def start_request(self, rid: int, prompt: np.ndarray) -> None:
        self.active[rid] = [int(t) for t in prompt]

    def add_active_response(self, rid: int, tokens: np.ndarray) -> None:
        self.active[rid].extend(int(t) for t in tokens)

    def stop_request(self, rid: int) -> None:
        self.active.pop(rid)
        self.cached = (self.cached + [rid])[-self.max_cached_requests:] if self.max_cached_requests else []

    def speculate(self, rid: int, tail: np.ndarray, max_spec_tokens: int, **_: object) -> _Draft:
        seq = self.active[rid]
        last = int(tail[-1])
        for start in range(len(seq) - 2, -1, -1):
            if seq[start] == last:
                chain = seq[start + 1 : start + 1 + max_spec_tokens]
                return _Draft(chain, list(range(-1, len(chain) - 1)))
        return _Draft()


@pytest.fixture
def fake_arctic(monkeypatch):
    package = types.ModuleType("arctic_inference")
    module = types.ModuleType("arctic_inference.suffix_decoding")
    module.SuffixDecodingCache = FakeSuffixDecodingCache
    package.suffix_decoding = module
    monkeypatch.setitem(sys.modules, "arctic_inference", package)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", module)


def test_adapter_is_exact_and_its_drafts_are_used(fake_arctic) -> None:
    from specdraft.bench.arctic_suffix import ArcticSuffix

    model = tiny_model("llama")
    source = ArcticSuffix(max_cached_requests=4)
    decoder = Decoder(model, sources=[source], max_tree_nodes=8, adaptive_budget=False)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    for _ in range(2):
        out = decoder.generate(prompt, max_new_tokens=16)
        assert out.token_ids == reference_greedy(model, prompt, 16)
    assert out.stats.per_source["arctic-suffix"].proposed > 0
    assert source.active_requests == 0 and len(source._cache.cached) == 2


def test_bench_method_parses_with_the_extension_present(fake_arctic) -> None:
    from specdraft.bench.methods import parse_methods

    assert parse_methods("arctic-suffix,prompt+arctic-suffix")[1:] == [
        "specdraft:arctic-suffix", "specdraft:prompt+arctic-suffix"]
