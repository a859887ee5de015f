"""The first screen: the renderer's setting-by-setting table, and the pages that quote the defaults.

- ``scripts/render_tables.py``'s ``first-screen`` table renders measured rows from ``specdraft
  bench`` outputs (single and ``--concurrency``) and "not measured" rows where a setting has no
  run, and refuses a run that does not match its row (dtype, device, today's default sources).
- The default sources, the CLI table of the first-generation tutorial and its sample output
  follow the code: ``DEFAULT_SOURCES``, the parser's flags and defaults, and the sources the
  recorded run used.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

if "render_tables" in sys.modules:
    render_tables = sys.modules["render_tables"]
else:
    _spec = importlib.util.spec_from_file_location("render_tables", ROOT / "scripts" / "render_tables.py")
    render_tables = importlib.util.module_from_spec(_spec)
    sys.modules["render_tables"] = render_tables
    _spec.loader.exec_module(render_tables)

CPU = {"model": "AMD EPYC", "cpus": 2, "family": "26", "flags": ["avx2", "avx512f", "avx512_bf16"]}
DEFAULT = "specdraft Decoder with sources prompt+trie+ngram+suffix, cpu_kernels='auto'"


def _bench(dtype: str, device: str, datasets: list[str], *, default: str = DEFAULT) -> dict:
    """A ``summary.json`` as ``specdraft bench`` writes it, for four prompts per dataset."""
    speed = {"baseline": [1.0] * 4, "plain": [1.5, 1.6, 1.4, 1.7], "hf-prompt-lookup": [1.1, 1.2, 0.9, 1.0],
             "default": [2.0, 2.4, 1.8, 2.2]}
    out = {"config": {"dtype": dtype, "threads": 1, "platform": "test-platform", "cpu": CPU,
                      "argv": ["bench", "--device", device], "started": "2026-12-01T00:00:00+0000"},
           "datasets": {}}
    for d in datasets:
        methods = {name: {"mean_accepted": 1.9 if name == "default" else 1.0, "identical": 3, "compared": 4,
                          "description": default if name == "default" else name} for name in speed}
        methods["default"]["identical_to_plain"] = 4
        per_prompt = [{"methods": {name: {"speedup": v[i]} for name, v in speed.items()}} for i in range(4)]
        out["datasets"][d] = {"prompts": 4, "max_new_tokens": 128, "methods": methods, "per_prompt": per_prompt}
    return out


def _concurrency() -> dict:
    rows = []
    for n, seq in ((1, 10.0), (8, 12.0)):
        rows += [{"concurrency": n, "method": "generate", "tokens": 100, "seconds": 100 / seq, "tokens_per_s": seq,
                  "identical": 4, "requests": 4},
                 {"concurrency": n, "method": "hf-batched", "tokens": 100, "seconds": 2.5, "tokens_per_s": 40.0,
                  "identical": 3, "requests": 4},
                 {"concurrency": n, "method": "default-batched", "tokens": 100, "seconds": 1.0,
                  "tokens_per_s": 100.0, "identical": 4, "requests": 4,
                  "tree_sizes": [[4, [3, 3, 3, 3]]] * 10 + [[2, [1, 1]]] * 5}]
    return {"rows": rows, "prompts": 4, "max_new_tokens": 64, "kernels": "auto"}


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A results folder with one run per setting kind; the renderer reads it instead of the real one."""
    def write(run: str, data: dict, name: str = "summary.json") -> None:
        path = tmp_path / run / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))

    write("cpu-fp32-abc1234", _bench("float32", "cpu", ["humaneval", "mtbench"]))
    write("cpu-bf16-abc1234", _bench("bfloat16", "cpu", ["humaneval", "mtbench"]))
    write("gpu-h200-2026-12-01-def5678/bench", _bench("bfloat16", "cuda", ["humaneval", "mtbench"]))
    write("old-default-abc1234", _bench("float32", "cpu", ["humaneval"],
                                        default="specdraft Decoder with sources prompt+trie+ngram, ..."))
    write("cpu-conc-abc1234", {"config": {"dtype": "bfloat16", "threads": 1, "platform": "test-platform",
                                          "cpu": CPU, "argv": ["bench"], "started": "2026-12-01"},
                               "concurrency": {"humaneval": "humaneval/concurrency.json"}})
    write("cpu-conc-abc1234", _concurrency(), "humaneval/concurrency.json")
    write("", {"machines": {}}, "machines.json")
    for fn in (render_tables.summary, render_tables.machines, render_tables.curve, render_tables.host):
        fn.cache_clear()
    monkeypatch.setattr(render_tables, "RESULTS", tmp_path)
    monkeypatch.setattr(render_tables, "FIRST_SCREEN_CODE", "abc1234")
    yield tmp_path
    for fn in (render_tables.summary, render_tables.machines, render_tables.curve, render_tables.host):
        fn.cache_clear()


def _rows(table: str) -> dict[str, list[str]]:
    out = {}
    for line in table.splitlines():
        if line.startswith("| **"):
            cells = [c.strip().replace("\u00a0", " ") for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_first_screen_renders_measured_and_missing_rows(results, monkeypatch):
    S = render_tables.Setting
    monkeypatch.setattr(render_tables, "FIRST_SCREEN", [
        S("CPU", "float32", "code", "cpu-fp32-abc1234"),
        S("CPU", "bfloat16", "chat", "cpu-bf16-abc1234"),
        S("GPU", "bfloat16", "code", "gpu-h200-2026-12-01-def5678/bench"),
        S("GPU", "bfloat16", "chat", None),
        S("CPU", "bfloat16", "code", "cpu-conc-abc1234", batch=8),
    ])
    table = render_tables.first_screen_table("README.md")
    rows = _rows(table)
    # medians of the per-prompt ratios, worst prompt in parentheses
    assert rows["**CPU float32** · code"] == ["2.10x (1.80x)", "2.00x (1.82x)", "1.90", "3/4"]
    # not float32: identity to our plain decoding is shown too (what exact mode promises)
    assert rows["**CPU bfloat16** · chat"][3] == "3/4 (4/4 to our plain)"
    # a run of another commit than the one the screen describes says so
    assert rows["**GPU bfloat16** · code"][0] == "2.10x (1.80x)"
    assert "Measured at `def5678`, not `abc1234`: GPU bfloat16 code." in table
    assert rows["**GPU bfloat16** · chat"][0].startswith("not measured at `abc1234`")
    # batched: tokens/s against transformers' batched generate at the same level; tokens per request-step
    assert rows["**CPU bfloat16 ×8** · code"][:3] == [
        "2.50x", "one request at a time only", f"{100 / 50:.2f}"]
    assert "GPU: NVIDIA H200" in table and "CPU: AMD EPYC" in table
    # the batched run decoded 64 tokens, the others 128
    assert "128 new tokens (64 in CPU bfloat16 ×8 code)" in table
    # kernels x drafts: plain vs generate (1.55x), default vs plain
    assert "CPU float32: code 1.55x × 1.31x" in table
    assert "GPU bfloat16: code 1.55x × 1.31x" in table


def test_first_screen_refuses_a_run_that_does_not_match_its_row(results, monkeypatch):
    S = render_tables.Setting
    for setting, message in [(S("CPU", "bfloat16", "code", "cpu-fp32-abc1234"), "ran float32"),
                             (S("CPU", "bfloat16", "code", "gpu-h200-2026-12-01-def5678/bench"), "CPU row"),
                             (S("CPU", "float32", "code", "old-default-abc1234"), "not today's default")]:
        monkeypatch.setattr(render_tables, "FIRST_SCREEN", [setting])
        with pytest.raises(ValueError, match=message):
            render_tables.first_screen_table("README.md")


def test_first_screen_has_every_setting():
    """CPU float32, CPU bfloat16 and GPU bfloat16 on code and chat, and 8 requests per device."""
    kinds = {(s.device, s.dtype, s.workload, s.batch) for s in render_tables.FIRST_SCREEN}
    for device, dtype in (("CPU", "float32"), ("CPU", "bfloat16"), ("GPU", "bfloat16")):
        assert {(device, dtype, "code", 1), (device, dtype, "chat", 1)} <= kinds
    assert {s.device for s in render_tables.FIRST_SCREEN if s.batch == 8} == {"CPU", "GPU"}


def test_first_screen_ends_the_first_screen():
    """README and home page: the table comes before the first second-level heading but one."""
    for page in ("README.md", "docs/index.md"):
        text = (ROOT / page).read_text()
        assert "<!-- table:first-screen -->" in text, page
        before = text.split("<!-- table:first-screen -->")[0]
        assert before.count("\n## ") <= 1, f"{page}: the first-screen table must open the page"
        assert "<!-- table:expect -->" not in text


# -- the defaults, the CLI table and the sample output follow the code ---------------------------------


def _parser() -> argparse.ArgumentParser:
    from specdraft.cli import build_parser

    return build_parser()


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = _parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


#: Ways a page says "the default is X": X must be today's default sources.
_DEFAULT_IS = [
    re.compile(r"(?<!earlier )(?<!then )\bdefault\W{0,3}(?:is|=|:|\()\W{0,3}((?:\w+ ?[+,] ?)+\w+)", re.I),  # default (a+b), default: a+b
    re.compile(r"((?:\w+ ?[+,] ?)+\w+)`?,? \((?:the |today's )?default\)", re.I),  # a+b (the default)
    re.compile(r"\bdefault\b[^.]{0,40}--sources ((?:\w+,)+\w+)", re.I),  # the default ... --sources a,b
    re.compile(r"--sources ((?:\w+,)+\w+)`? is the\b[^.]{0,30}\bdefault", re.I),
]


def test_default_sources_are_quoted_as_in_the_code():
    from specdraft.sources.registry import DEFAULT_SOURCES

    assert render_tables.default_sources() == "+".join(DEFAULT_SOURCES)
    today = list(DEFAULT_SOURCES)
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in _DEFAULT_IS:
                for m in pattern.finditer(line):
                    names = re.split(r" ?[+,] ?", m.group(1))
                    if set(names) <= set(render_tables.DATASETS) | {"prompt", "trie", "ngram", "suffix", "recycle",
                                                                   "jacobi"} and names != today:
                        wrong.append(f"{page.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not wrong, f"a page names another default than {'+'.join(today)}:\n" + "\n".join(wrong)


def _cli_table() -> dict[str, str]:
    """The flag table of docs/tutorials/first-generation.md: first flag of a row -> its meaning cell."""
    text = (ROOT / "docs" / "tutorials" / "first-generation.md").read_text()
    section = text.split("## From the command line", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `-"):
            flags_cell, meaning = [c.strip() for c in line.strip("|").split("|", 1)]
            for flag in re.findall(r"`(--?[\w-]+)", flags_cell):
                rows[flag] = meaning
    return rows


def test_cli_table_lists_every_generate_flag_with_its_default():
    rows = _cli_table()
    generate = _subparser("generate")
    for action in generate._actions:
        if not action.option_strings or action.dest == "help":
            continue
        long = [o for o in action.option_strings if o.startswith("--")][0]
        assert any(o in rows for o in action.option_strings), f"--{action.dest}: not in the tutorial's CLI table"
        meaning = rows.get(long) or next(rows[o] for o in action.option_strings if o in rows)
        default = action.default
        if isinstance(default, (int, str)) and not isinstance(default, bool) and default not in ("", None):
            assert f"(`{default}`)" in meaning or f"({default})" in meaning, (
                f"{long}: the table's default is not the parser's ({default!r}): {meaning}")
        for choice in action.choices or ():
            assert f"`{choice}`" in meaning, f"{long}: the table does not list the choice {choice!r}: {meaning}"
    known = {o for a in generate._actions for o in a.option_strings}
    assert not set(rows) - known, f"the CLI table lists flags generate does not have: {set(rows) - known}"


def test_sample_output_used_the_default_sources():
    """The recorded `specdraft generate --compare` run the tutorial includes used today's default."""
    from specdraft.sources.registry import DEFAULT_SOURCES

    page = (ROOT / "docs" / "tutorials" / "first-generation.md").read_text()
    included = set(re.findall(r'--8<-- "benchmarks/results/([^/"]+)/stderr.txt"', page))
    assert len(included) == 1, f"the tutorial should include one recorded run's stderr, found {included}"
    run = ROOT / "benchmarks" / "results" / included.pop()
    assert f"`{run.name}`" in page, "the tutorial should name the run it shows"
    argv = json.loads((run / "run.json").read_text())["config"]["argv"]
    assert "--sources" not in argv, "the sample ran other sources than the default"
    summary_line = (run / "stderr.txt").read_text().splitlines()[0]
    shown = re.findall(r"(\w+) \d+/\d+ accepted", summary_line)
    assert shown == list(DEFAULT_SOURCES), (
        f"the sample output shows the sources {shown}, the default is {list(DEFAULT_SOURCES)}: record it again "
        "(the command is in docs/tutorials/first-generation.md)")
    # the command the tutorial shows is the one that was recorded (apart from --threads)
    shown_cmd = re.search(r"```bash\n(specdraft generate [^`]*?)```", page.split("## From the command line")[1])
    words = shown_cmd.group(1).replace("\\\n", " ").split()[1:]
    recorded = [a for i, a in enumerate(argv) if a != "--threads" and (i == 0 or argv[i - 1] != "--threads")]
    assert sorted(words) == sorted(recorded), (words, argv)


# -- the docs build needs no torch -------------------------------------------------------------------


def test_docs_build_imports_nothing_from_the_package():
    """The `docs` extra holds no torch, the build script installs it without the package, and the
    site's hooks import neither specdraft nor torch (mkdocstrings' griffe reads the source)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs_extra = re.search(r'^docs\s*=\s*\[(.*?)\]\s*$', pyproject, re.M | re.S).group(1)
    assert not re.search(r"torch|transformers|specdraft", docs_extra), docs_extra
    script = (ROOT / "scripts" / "build_docs.sh").read_text()
    assert "pip install" in script and " -e " not in script and "[docs]" not in script
    for hook in (ROOT / "docs" / "_ext").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", hook.read_text(), re.M)
        assert not {i.split(".")[0] for i in imports} & {"torch", "specdraft", "transformers", "numpy"}, hook
