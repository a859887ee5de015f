"""``benchmarks/recycling_replay.py``: Token Recycling replayed from recorded top-k.

Its figures stand in for slow fixed-budget runs, so its one approximation must be the only one:
every row it hands a source is a row the real decoder computes in that step (same input token,
same top-k), on the accepted path, and it hands exactly those rows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from specdraft import Decoder
from specdraft.sources import Context, Draft, Feedback, TokenRecycling
from specdraft.sources.base import SourceBase

from conftest import generation_config_override, reference_greedy, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import recycling_replay as rr  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 9, 10, 11]]
NEW = 14
K = 8


class RowSpy(SourceBase[None]):
    """Drafts nothing, asks for top-k and keeps every step's (row token, top-k) rows."""

    name = "spy"
    top_k = K

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[list[int], list[tuple[int, tuple[int, ...]]]]] = []

    def new_state(self, context: Context) -> None:
        return None

    def propose(self, context: Context, budget: int) -> Draft:
        return Draft()

    def observe(self, feedback: Feedback) -> None:
        rows = [(int(t), tuple(int(x) for x in top[:K])) for t, top in zip(feedback.row_tokens, feedback.top_ids)]
        self.steps.append((list(feedback.committed), rows))


class Oracle(SourceBase[None]):
    """Knows the greedy output: drafts its next two tokens and a wrong third, plus a wrong sibling
    branch, so every step accepts two nodes and computes rows the replay must not hand on."""

    name = "oracle"

    def __init__(self, full: list[int], vocab: int) -> None:
        super().__init__()
        self.full, self.vocab = full, vocab

    def new_state(self, context: Context) -> None:
        return None

    def propose(self, context: Context, budget: int) -> Draft:
        n = len(context.tokens)
        right = self.full[n: n + 2]
        if not right:
            return Draft()
        wrong = lambda t: (t + 1) % self.vocab
        return Draft([right + [wrong(self.full[n + 2])] if n + 2 < len(self.full) else right, [wrong(right[0])]])

    def observe(self, feedback: Feedback) -> None:
        return None


@pytest.fixture()
def model() -> Iterator[Any]:
    """The tiny float64 Llama, with no end-of-sequence token so every output has ``NEW`` tokens."""
    tiny = tiny_model("llama")
    with generation_config_override(tiny, eos_token_id=None):
        yield tiny


def recorded(model: Any, prompt: list[int], prompt_rows: bool = False) -> tuple[list[int], np.ndarray]:
    """The greedy reference of ``prompt`` and its recorded top-k."""
    reference = reference_greedy(model, prompt, NEW)
    return reference, rr.recorded_top_k(model, prompt, reference, K, prompt_rows)


def test_recorded_top_k_is_aligned_with_the_greedy_output(model: Any) -> None:
    for prompt in PROMPTS:
        reference, top = recorded(model, prompt)
        assert top.shape == (NEW, K)
        assert top[:, 0].tolist() == reference  # row j's best next token is the greedy token j


def test_replay_hands_sources_exactly_the_accepted_path_rows_of_the_real_step(model: Any) -> None:
    """An oracle drafts the same in both (it ignores top-k), so the steps coincide; a spy compares
    the rows the replay hands on with the rows the real decoder computed."""
    for i, prompt in enumerate(PROMPTS):
        reference, top = recorded(model, prompt)
        real_spy, replay_spy = RowSpy(), RowSpy()
        real = Decoder(model, sources=[Oracle(prompt + reference, 80), real_spy], max_tree_nodes=8, adaptive_budget=False)
        out = real.generate(prompt, max_new_tokens=NEW)
        assert out.token_ids == reference
        lengths = rr.replay(prompt, reference, top, [Oracle(prompt + reference, 80), replay_spy], 8, request_id=i)
        assert sum(lengths) == NEW and lengths[0] == 1  # step 0 is the prefill's token
        assert lengths == out.stats.accept_lengths  # the same steps, committing the same tokens
        assert [c for c, _ in replay_spy.steps] == [c for c, _ in real_spy.steps]
        assert any(len(c) > 1 for c, _ in replay_spy.steps)  # some drafts were accepted
        committed = list(prompt)
        committed.append(reference[0])  # the prefill's token: observed by nobody
        for n, ((step, replayed), (_, computed)) in enumerate(zip(replay_spy.steps, real_spy.steps)):
            prefill_row = [prompt[-1]] if n == 0 else []  # delivered with the first tree step
            assert [t for t, _ in replayed] == prefill_row + [committed[-1]] + step[:-1]  # root, accepted nodes
            for row in replayed:
                assert row in computed  # the real step computed this row, with this top-k
            if len(step) > 1:  # the tree had its wrong branches too: their rows stay out
                assert len(computed) > len(replayed)
            committed += step


def test_token_recycling_learns_from_the_replay_and_drafts_the_recorded_candidates(model: Any) -> None:
    prompt = PROMPTS[0]
    reference, top = recorded(model, prompt)
    source = TokenRecycling(k=K, template="tr8")
    rr.replay(prompt, reference, top, [source], 8, request_id=0)
    full = prompt + reference
    last_row = {}  # the last recorded top-k of every input token (later rows win)
    for j in range(len(prompt) - 1, len(full) - 1):
        last_row[full[j]] = top[j - (len(prompt) - 1)]
    for token, row in last_row.items():
        assert source.matrix[token].tolist() == row.tolist()


def test_cost_ratio_interpolates_the_measured_curve_and_never_extrapolates(tmp_path: Path) -> None:
    import json

    rows: list[dict[str, Any]] = [{"path": "stock", "k": k, "median_ms": ms} for k, ms in [(1, 100.0), (17, 300.0)]]
    rows.append({"path": "packed", "k": 1, "median_ms": 50.0})
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"rows": rows}))
    assert rr.load_cost_curve(path, "stock") == {1: 100.0, 17: 300.0}
    assert rr.load_cost_curve(path, "packed") == {1: 50.0}
    curve = rr.load_cost_curve(path, "stock")
    assert rr.cost_ratio(curve, 0) == 1.0
    assert np.isclose(rr.cost_ratio(curve, 8), 2.0)  # width 9: halfway between 1 and 17
    assert rr.cost_ratio(curve, 17) is None  # width 18 was never measured: no guess


def test_recorded_top_k_is_cached_per_prompt_and_sequence(model: Any, tmp_path: Path) -> None:
    prompts = [{"id": str(i), "ids": p} for i, p in enumerate(PROMPTS)]
    refs = {p["id"]: reference_greedy(model, p["ids"], NEW) for p in prompts}
    cache = tmp_path / "top-k.npz"
    first = rr.recorded_top_k_cached(model, prompts, refs, K, cache)

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a cached prompt ran a forward")

    again = rr.recorded_top_k_cached(no_forward, prompts, refs, K, cache)
    assert all(np.array_equal(first[k], again[k]) for k in first)
    shorter = {k: v[:-1] for k, v in refs.items()}  # another reference: recorded anew
    assert rr.recorded_top_k_cached(model, prompts, shorter, K, cache)["0"].shape == (NEW - 1, K)


def test_main_replays_a_bench_checkpoint_end_to_end(tiny_dir: Path, tmp_path: Path) -> None:
    """The command line on a saved checkpoint and a bench checkpoint of its greedy outputs: the
    dataset's name comes from the checkpoint, every template runs three ways, the speed estimate
    appears where the cost curve reaches, and a second run takes the top-k from the cache."""
    import json
    import pickle

    from specdraft.bench.checkpoint import Checkpoint
    from specdraft.bench.methods import MethodResult
    from specdraft.bench.runner import PromptRun
    from specdraft.models import load_model

    model, _ = load_model(str(tiny_dir), progress=False)
    prompts = [("p0", [5, 6, 7, 8, 5, 6, 7]), ("p1", [9, 10, 11, 9, 10])]
    with generation_config_override(model, eos_token_id=None):
        outputs = [reference_greedy(model, ids, 10) for _, ids in prompts]
    runs = [PromptRun(MethodResult(out, 1.0, [1] * len(out), len(out)), [1.0]) for out in outputs]
    bench = tmp_path / "checkpoint.pkl"
    bench.write_bytes(pickle.dumps(Checkpoint({"dataset": "toy", "prompts": prompts}, runs={"baseline": runs})))
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"rows": [{"path": "stock", "k": k, "median_ms": 10.0 * k} for k in (1, 9)]}))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_dir), "--references", str(bench), "--templates", "tr8,tr16",
            "--cost-curve", str(curve), "--out", str(out)]
    assert rr.main(argv) == 0
    report = json.loads((out / "recycling-replay-toy-float32.json").read_text())
    assert report["dataset"] == "toy"
    assert [(r["config"], r["nodes"]) for r in report["results"]] == [
        ("recycle[tr8]", 8), ("prompt+trie+ngram+recycle[tr8]", 8), ("prompt+trie+ngram", 8),
        ("recycle[tr16]", 16), ("prompt+trie+ngram+recycle[tr16]", 16), ("prompt+trie+ngram", 16)]
    assert all(r["mean_accepted"] >= 1.0 and len(r["per_prompt_mean_accepted"]) == 2 for r in report["results"])
    assert report["results"][0]["cost_ratio"] == 9.0  # width 9 costs 90 ms against 10
    assert report["results"][3]["estimated_speedup"] is None  # width 17 is past the curve
    assert (out / "top-k-toy-float32-k8.npz").exists()
    assert rr.main(argv) == 0  # from the cache


def test_prompt_rows_hand_every_prompt_row_at_the_first_step_and_change_nothing_after(model: Any) -> None:
    prompt = PROMPTS[1]
    reference, top = recorded(model, prompt)
    _, full_top = recorded(model, prompt, prompt_rows=True)
    assert full_top.shape == (len(prompt) - 1 + NEW, K)
    assert np.array_equal(full_top[len(prompt) - 1:], top)  # the same forward, more rows kept
    plain_spy, prompt_spy = RowSpy(), RowSpy()
    rr.replay(prompt, reference, top, [Oracle(prompt + reference, 80), plain_spy], 8, request_id=0)
    rr.replay(prompt, reference, full_top, [Oracle(prompt + reference, 80), prompt_spy], 8, request_id=1,
              prompt_rows=True)
    (_, plain_first), (_, prompt_first) = plain_spy.steps[0], prompt_spy.steps[0]
    assert [t for t, _ in prompt_first] == prompt[:-1] + [t for t, _ in plain_first]
    assert prompt_first[len(prompt) - 1:] == plain_first
    assert prompt_spy.steps[1:] == plain_spy.steps[1:]
