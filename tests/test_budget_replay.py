"""``benchmarks/budget_replay.py``: recorded greedy outputs replayed through the real ``Decoder`` on
a simulated clock. The controller's rules are chosen with it, so it must be faithful: the replay
commits exactly the recording, takes the same steps as a real decoder, and prices each forward
from the cost table."""

from __future__ import annotations

import gzip
import pickle
import sys
from pathlib import Path

import pytest

from specdraft import Decoder, PromptLookup
from specdraft.bench.checkpoint import Checkpoint
from specdraft.bench.methods import MethodResult
from specdraft.bench.runner import PromptRun

from conftest import generation_config_override, reference_greedy, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import budget_replay as br  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 9, 10, 11], [20, 21, 22, 23, 24, 25]]
NEW = 12
#: Shaped like fp32 on this CPU: a multi-token forward costs about twice a one-token step.
STEEP = br.CostTable([0.10, 0.20, 0.31, 0.21] + [0.22] * 36)  # 3 rows dearer than 3 steps: no tie
FLAT = br.CostTable([0.10] * 40)


@pytest.fixture(scope="module")
def recorded():
    model = tiny_model("llama")
    with generation_config_override(model, eos_token_id=None):
        yield model, [br.Recording(i, p, reference_greedy(model, p, NEW)) for i, p in enumerate(PROMPTS)]


def test_replay_takes_the_real_decoders_steps_and_prices_them_from_the_table(recorded) -> None:
    model, records = recorded
    rows = br.replay_dataset(model, records, STEEP, ["prompt"], 8, NEW, noise=0.0, seed=0, adaptive=False)
    for record, row in zip(records, rows):
        real = Decoder(model, sources=[PromptLookup()], max_tree_nodes=8, adaptive_budget=False).generate(
            record.prompt_ids, max_new_tokens=NEW)
        assert real.token_ids == record.reference
        assert row["steps"] == real.stats.steps
        # the prompt's forward, then one forward per tree step
        assert row["widths"] == [len(record.prompt_ids)] + real.stats.tree_sizes[1:]
        prefill = STEEP(len(record.prompt_ids))
        assert row["ours_s"] == pytest.approx(sum(STEEP(w) for w in row["widths"]))
        assert row["plain_s"] == pytest.approx(prefill + (NEW - 1) * STEEP(1))
    assert any(w > 1 for row in rows for w in row["widths"][1:])  # drafts were really checked


def test_the_simulated_clock_drives_the_adaptive_budget(recorded) -> None:
    model, records = recorded
    flat = br.replay_dataset(model, records * 3, FLAT, ["prompt"], 8, NEW, noise=0.0, seed=0)
    steep = br.replay_dataset(model, records * 3, STEEP, ["prompt"], 8, NEW, noise=0.0, seed=0)
    wide = lambda rows: sum(w > 1 for row in rows[3:] for w in row["widths"][1:])  # after the warm-up
    assert wide(flat) > wide(steep)  # free width is used more than costly width
    assert all(row["ratio"] >= 1.0 - 1e-9 for row in flat)  # with free width drafting never loses


def test_recordings_are_read_from_a_bench_checkpoint(tmp_path: Path) -> None:
    prompts = [("q0", [1, 2, 3]), ("q1", [4, 5])]
    outputs = [[7, 8], [9]]
    runs = [PromptRun(MethodResult(out, 1.0, [1] * len(out), len(out)), [1.0]) for out in outputs]
    checkpoint = Checkpoint({"dataset": "toy", "model": "m", "max_new_tokens": 2, "prompts": prompts},
                            runs={"baseline": runs})
    plain, packed = tmp_path / "checkpoint.pkl", tmp_path / "checkpoint.pkl.gz"
    plain.write_bytes(pickle.dumps(checkpoint))
    packed.write_bytes(gzip.compress(pickle.dumps(checkpoint)))
    exported = br.export_recordings(packed, tmp_path / "recordings")  # token ids only, no pickle
    assert exported.name == "toy.json.gz"
    for path in (plain, packed, exported):
        dataset, records, fingerprint = br.load_recordings(path)
        assert dataset == "toy" and fingerprint["max_new_tokens"] == 2 and fingerprint["model"] == "m"
        assert [(r.prompt_id, r.prompt_ids, r.reference) for r in records] == [("q0", [1, 2, 3], [7, 8]),
                                                                              ("q1", [4, 5], [9])]


def test_replay_sets_the_budgets_acceptance_smoothing(recorded) -> None:
    model, records = recorded
    seen = []
    original = br.Decoder.generate

    def spy(self, *args, **kwargs):
        seen.append(self.budget.acceptance.fast)
        return original(self, *args, **kwargs)

    br.Decoder.generate = spy
    try:
        br.replay_dataset(model, records, FLAT, ["prompt"], 8, NEW, noise=0.0, seed=0, acceptance_smoothing=0.7)
    finally:
        br.Decoder.generate = original
    assert seen and set(seen) == {0.7}


def test_cost_table_extrapolates_past_its_end() -> None:
    table = br.CostTable([1.0, 2.0, 3.0, 4.0])
    assert table(0) == 0.0 and table(1) == 1.0 and table(4) == 4.0
    assert table(6) == pytest.approx(6.0)  # the slope of the last quarter (at least two points)
