"""``specdraft bench --resume``: an interrupted run continues from its checkpoint with the methods'
state restored, gives what an uninterrupted run gives, and refuses a checkpoint of another
experiment with a message naming what differs."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest

from specdraft import cli
from specdraft.bench import datasets as ds
from specdraft.bench.checkpoint import (Checkpoint, CheckpointMismatch, dumps_with_locks, load_checkpoint,
                                        save_checkpoint)
from specdraft.bench.methods import BASELINE, MethodResult, PlainGenerate, SpecdraftMethod
from specdraft.bench.runner import run_benchmark

pytestmark = pytest.mark.usefixtures("offline_cache")

PROMPTS = ["a b c d e f a b c d e", "w1 w2 w3 w4 w1 w2 w3", "x y z x y", "a b c a b c a b"]


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, Any]:
    from specdraft.models import load_model

    return load_model(str(tiny_dir), dtype="float64", progress=False)


@pytest.fixture
def prompts(tiny, tmp_path: Path) -> list[ds.PromptRecord]:
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return ds.load_prompts(str(path), None, tiny[1], chat=False)


class Interrupted(Exception):
    pass


class Counting:
    """A fake method whose state counts the prompts it has learned from; it records each call and
    can be told to fail (like Ctrl-C) on a given prompt."""

    def __init__(self, name: str, model: Any, log: list, fail_on: int | None = None) -> None:
        self.name = name
        self.description = name
        self.plain = PlainGenerate(name, model, {"do_sample": False}, "")
        self.log = log
        self.fail_on = fail_on
        self.learned = 0
        self._lock = threading.Lock()  # like a thread-safe source: the checkpoint must cope

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        if self.fail_on is not None and len(self.log) // 3 == self.fail_on:
            raise Interrupted
        result = self.plain.run(prompt_ids, max_new_tokens)
        self.log.append((tuple(prompt_ids), self.name, self.learned))
        self.learned += learn
        return MethodResult(result.token_ids, 1.0 + self.learned, [1] * len(result.token_ids), len(result.token_ids))

    def get_state(self) -> dict[str, Any]:
        return {"learned": self.learned, "lock": self._lock}

    def set_state(self, state: dict[str, Any]) -> None:
        self.learned = state["learned"]


def methods(model: Any, log: list, fail_on: int | None = None) -> list[Counting]:
    return [Counting(n, model, log, fail_on if n == "m1" else None) for n in (BASELINE, "m1", "m2")]


def test_an_interrupted_run_resumes_where_it_stopped(tiny, prompts, tmp_path: Path) -> None:
    model, _ = tiny
    ckpt = tmp_path / "ckpt.pkl"
    whole_log: list = []
    whole = run_benchmark(model, prompts, methods(model, whole_log), 6, progress=False)

    log: list = []
    with pytest.raises(Interrupted):  # dies during prompt 2 (0-based): prompts 0 and 1 are saved
        run_benchmark(model, prompts, methods(model, log, fail_on=2), 6, progress=False, checkpoint=ckpt)
    log_after: list = []
    resumed = run_benchmark(model, prompts, methods(model, log_after), 6, progress=False, checkpoint=ckpt,
                            resume=True)
    assert resumed.resumed == 2
    # only prompts 2 and 3 ran again, in the rotation of an uninterrupted run, with the state restored
    assert log_after == whole_log[6:]
    assert log[:6] == whole_log[:6]
    for name in (BASELINE, "m1", "m2"):
        assert [r.result.token_ids for r in resumed.runs[name]] == [r.result.token_ids for r in whole.runs[name]]
        assert [r.wall_times for r in resumed.runs[name]] == [r.wall_times for r in whole.runs[name]]
    # resuming a finished run runs nothing and reports the same
    again_log: list = []
    again = run_benchmark(model, prompts, methods(model, again_log), 6, progress=False, checkpoint=ckpt, resume=True)
    assert again.resumed == 4 and again_log == []
    assert [r.result.token_ids for r in again.runs["m2"]] == [r.result.token_ids for r in whole.runs["m2"]]


def test_without_resume_a_run_starts_afresh(tiny, prompts, tmp_path: Path) -> None:
    model, _ = tiny
    ckpt = tmp_path / "ckpt.pkl"
    run_benchmark(model, prompts[:2], methods(model, []), 6, progress=False, checkpoint=ckpt)
    log: list = []
    run = run_benchmark(model, prompts[:2], methods(model, log), 6, progress=False, checkpoint=ckpt)
    assert run.resumed == 0 and len(log) == 6
    # --resume with no checkpoint yet is a fresh start too (one command both starts and continues)
    log2: list = []
    run2 = run_benchmark(model, prompts[:2], methods(model, log2), 6, progress=False,
                         checkpoint=tmp_path / "none.pkl", resume=True)
    assert run2.resumed == 0 and len(log2) == 6 and (tmp_path / "none.pkl").exists()


def test_a_larger_limit_extends_a_run_and_a_smaller_one_reports_its_prefix(tiny, prompts, tmp_path: Path) -> None:
    """The prompt list may grow or shrink by its tail: growing continues with the states after the
    finished prompts (the same as one long run); shrinking reports the finished prefix, running
    nothing, and keeps the checkpoint of the longer run."""
    model, _ = tiny
    whole = run_benchmark(model, prompts, methods(model, []), 6, progress=False)
    ckpt = tmp_path / "ckpt.pkl"
    run_benchmark(model, prompts[:2], methods(model, []), 6, progress=False, checkpoint=ckpt)
    log: list = []
    longer = run_benchmark(model, prompts, methods(model, log), 6, progress=False, checkpoint=ckpt, resume=True)
    assert longer.resumed == 2 and [entry[2] for entry in log] == [2, 2, 2, 3, 3, 3]  # states carried on
    for name in (BASELINE, "m1", "m2"):
        assert [r.wall_times for r in longer.runs[name]] == [r.wall_times for r in whole.runs[name]]
    log = []
    shorter = run_benchmark(model, prompts[:3], methods(model, log), 6, progress=False, checkpoint=ckpt, resume=True)
    assert shorter.resumed == 3 and log == [] and len(shorter.runs["m1"]) == 3
    assert load_checkpoint(ckpt, {"dataset": "", "methods": [BASELINE, "m1", "m2"], "max_new_tokens": 6,
                                  "repeats": 1, "prompts": [(p.id, list(p.token_ids)) for p in prompts]}).done == 4
    # a different prompt in the middle is still another experiment
    with pytest.raises(CheckpointMismatch, match="the first 1 agree"):
        run_benchmark(model, [prompts[0], prompts[2]], methods(model, []), 6, progress=False, checkpoint=ckpt,
                      resume=True)


def test_a_checkpoint_of_another_experiment_is_refused(tiny, prompts, tmp_path: Path) -> None:
    model, _ = tiny
    ckpt = tmp_path / "ckpt.pkl"
    run_benchmark(model, prompts[:2], methods(model, []), 6, progress=False, checkpoint=ckpt,
                  setup={"dtype": "float64"})
    with pytest.raises(CheckpointMismatch, match=r"max_new_tokens: was 6, now 7"):
        run_benchmark(model, prompts[:2], methods(model, []), 7, progress=False, checkpoint=ckpt, resume=True,
                      setup={"dtype": "float64"})
    with pytest.raises(CheckpointMismatch, match=r"dtype: was 'float64', now 'bfloat16'"):
        run_benchmark(model, prompts[:2], methods(model, []), 6, progress=False, checkpoint=ckpt, resume=True,
                      setup={"dtype": "bfloat16"})
    with pytest.raises(CheckpointMismatch, match="prompts"):
        run_benchmark(model, prompts[1:3], methods(model, []), 6, progress=False, checkpoint=ckpt, resume=True,
                      setup={"dtype": "float64"})
    (tmp_path / "junk.pkl").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointMismatch, match="not a readable checkpoint"):
        load_checkpoint(tmp_path / "junk.pkl", {})
    old = Checkpoint(fingerprint={}, format=0)
    save_checkpoint(tmp_path / "old.pkl", old)
    with pytest.raises(CheckpointMismatch, match="another version"):
        load_checkpoint(tmp_path / "old.pkl", {})


def test_learning_sources_continue_with_their_state(tiny, prompts, tmp_path: Path) -> None:
    """The real thing: a frequency trie learns across prompts. Its drafts (hence the accept lengths
    of a fixed budget) on the later prompts depend on what it learned before, so they match an
    uninterrupted run only if the checkpoint carried its state."""
    model, tokenizer = tiny

    def trie_method() -> SpecdraftMethod:
        return SpecdraftMethod("specdraft:trie@fixed", model, tokenizer, ["trie"], max_tree_nodes=8,
                               adaptive_budget=False)

    # the later prompts repeat the earlier ones: a trie that learned those answers drafts them whole
    prompts = prompts[:2] + [dataclasses.replace(p, id=f"{p.id}-again") for p in prompts[:2]]
    whole = run_benchmark(model, prompts, [PlainGenerate(BASELINE, model, {"do_sample": False}, ""), trie_method()],
                          10, progress=False)

    ckpt = tmp_path / "ckpt.pkl"
    with pytest.raises(Interrupted):  # prompt 2 starts with the baseline (rotation), which fails
        run_benchmark(model, prompts, [FailingBaseline(model, fail_on_call=2), trie_method()], 10, progress=False,
                      checkpoint=ckpt)
    resumed = run_benchmark(model, prompts, [PlainGenerate(BASELINE, model, {"do_sample": False}, ""),
                                             trie_method()], 10, progress=False, checkpoint=ckpt, resume=True)
    assert resumed.resumed == 2
    ours = [r.result.accept_lengths for r in resumed.runs["specdraft:trie@fixed"]]
    ref = [r.result.accept_lengths for r in whole.runs["specdraft:trie@fixed"]]
    assert ours == ref
    # a trie that starts empty on prompt 2 drafts differently: the comparison above can fail
    cold = run_benchmark(model, prompts[2:], [PlainGenerate(BASELINE, model, {"do_sample": False}, ""),
                                              trie_method()], 10, progress=False)
    assert [r.result.accept_lengths for r in cold.runs["specdraft:trie@fixed"]] != ref[2:]


class FailingBaseline(PlainGenerate):
    """The baseline, failing on its ``fail_on_call``-th call (0-based)."""

    def __init__(self, model: Any, fail_on_call: int) -> None:
        super().__init__(BASELINE, model, {"do_sample": False}, "")
        self.calls = 0
        self.fail_on_call = fail_on_call

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        if self.calls == self.fail_on_call:
            raise Interrupted
        self.calls += 1
        return super().run(prompt_ids, max_new_tokens, learn)


def test_thread_safe_sources_pickle_with_their_locks() -> None:
    """What ``--repeats`` copies and a checkpoint saves: sources that hold locks."""
    src = cli.make_sources(["trie"])
    copies = pickle.loads(dumps_with_locks(src))
    assert copies[0] is not src[0] and type(copies[0]) is type(src[0])


def test_cli_resume(capsys, tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS[:2])))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_dir), "--dataset", str(path), "--dtype", "float64", "--methods",
            "baseline,specdraft:prompt", "--max-new-tokens", "8", "--out", str(out), "--no-plot"]
    assert cli.main(argv) == 0
    first = json.loads((out / "summary.json").read_text())
    assert (out / "two" / "checkpoint.pkl").exists()
    capsys.readouterr()
    assert cli.main(argv + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "resumed after 2 finished prompt(s)" in err
    second = json.loads((out / "summary.json").read_text())
    assert second["datasets"]["two"]["per_prompt"] == first["datasets"]["two"]["per_prompt"]
    code = cli.main(argv + ["--resume", "--threads", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "threads: was 1, now 2" in err and "Traceback" not in err
