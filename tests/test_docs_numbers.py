"""The docs and the README say only what the results files back, in the project's own words.

- Every results table between ``<!-- table:NAME -->`` markers is what ``scripts/render_tables.py``
  renders from ``benchmarks/results/`` today (re-rendered in memory and compared).
- Every speed-up a page states (``1.23x``) is in one of that page's rendered tables, or is a
  median, worst or best prompt ratio of a run the page names (its directory under
  ``benchmarks/results/``), or a ratio of a cost curve it names, or printed by a recorded
  command; :data:`ALLOWED_SPEEDUPS` holds the few that are not measurements.
- No page, README or docstring speaks about how the work was done (:data:`INTERNAL_WORDS`).
- Code lines in the docs fit the page: at most 88 characters.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_spec = importlib.util.spec_from_file_location("render_tables", ROOT / "scripts" / "render_tables.py")
render_tables = importlib.util.module_from_spec(_spec)
sys.modules["render_tables"] = render_tables
_spec.loader.exec_module(render_tables)

SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)x\b")

#: Speed-ups a page may state without a results file: not measurements (page, number).
ALLOWED_SPEEDUPS: set[tuple[str, str]] = {
    ("docs/concepts/adaptive-budget.md", "0.95x"),  # the floor the budget aims to keep
    ("docs/results.md", "0.95x"),
    ("README.md", "0.95x"),
    ("docs/index.md", "0.95x"),
    ("docs/sources/suffix-tree.md", "5.3x"),  # the paper's own figure, cited as such
}

#: Words about how the work was done, not about the product.
INTERNAL_WORDS = re.compile(
    r"\bsessions?\b|\bthis turn\b|\bturn's\b|\bissue's\b|\bthe issue\b|\blent\b"
    r"|\b(?:this|the|our|a slower|a later) VM\b|\bthis project's (?:VM|machine)s?\b",
    re.I)

#: Real uses of such words (a line matching one of these is fine).
INTERNAL_WORDS_REAL_USES = [
    re.compile(r"github\.com/[\w.-]+/[\w.-]+/issues/\d+"),  # other projects' issues
    re.compile(r"requests\.Session"),
]

#: Hits in Python files this check found and that are still to be reworded: (path, line text).
#: Empty it when they are fixed.
PENDING_DOCSTRING_FIXES: set[tuple[str, str]] = set()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_rendered_tables_are_fresh():
    # a shallow clone cannot tell which commit added a run: then compare all but those commits
    stale = render_tables.stale_pages(ignore_commits=not render_tables.history_known())
    assert not stale, f"stale tables in {stale}: run python scripts/render_tables.py"


def test_every_table_name_is_used():
    used = set()
    for page in render_tables.PAGES:
        used |= {m.group(1) for m in render_tables.MARKER.finditer((ROOT / page).read_text())}
    assert used == set(render_tables.TABLES), set(render_tables.TABLES) ^ used


def _run_values(run: Path) -> set[str]:
    """The ratios a run's results files hold, as a page would write them."""
    values: set[float] = set()
    for path in run.rglob("*summary.json"):  # a run folder may hold several outputs in subfolders
        for data in json.loads(path.read_text()).get("datasets", {}).values():
            for m in data["methods"].values():
                for key in ("speedup_median", "speedup_geomean", "speedup_min", "speedup_max",
                            "speedup_vs_plain_median"):
                    if key in m:
                        values.add(m[key])
    for path in run.rglob("concurrency.json"):  # specdraft bench --concurrency
        rows = json.loads(path.read_text())["rows"]
        values.update(row["vs_generate"] for row in rows)
        # and against transformers' batched generate at the same level (the first screen's ×N rows)
        batched = {row["concurrency"]: row["tokens_per_s"] for row in rows if row["method"] == "hf-batched"}
        values.update(row["tokens_per_s"] / batched[row["concurrency"]] for row in rows
                      if batched.get(row["concurrency"]))
    for path in run.glob("*.json"):  # benchmarks/exact_identity.py --model: a summary per mode
        summary = json.loads(path.read_text()).get("summary") if path.name != "summary.json" else None
        for key, mode in (summary or {}).items() if isinstance(summary, dict) else ():
            if isinstance(mode, dict):
                values.update(v for k, v in mode.items() if k.startswith(("speedup", "median_speedup")))
            elif "speed" in key and isinstance(mode, float):  # e.g. exact_vs_inexact_speed
                values.add(mode)
    for path in run.glob("curve.json"):
        for row in json.loads(path.read_text())["rows"]:
            values.update(row[k] for k in ("vs_own_k1", "vs_stock_same_k") if k in row)
    out = {f"{v:.2f}" for v in values} | {f"{v:.1f}" for v in values}
    for path in run.glob("*.txt"):
        out |= set(SPEEDUP.findall(path.read_text()))
    return out


def test_every_stated_speedup_is_backed():
    runs = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    unbacked = []
    for page in PAGES:
        rel = _rel(page)
        text = page.read_text()
        backed = {n for m in render_tables.MARKER.finditer(text) for n in SPEEDUP.findall(m.group(2))}
        for run in runs:
            if re.search(rf"(?<![\w-]){re.escape(run.name)}(?![\w-])", text):
                backed |= _run_values(run)
        prose = render_tables.MARKER.sub("", text)
        for number in SPEEDUP.findall(prose):
            if number not in backed and (rel, f"{number}x") not in ALLOWED_SPEEDUPS:
                unbacked.append(f"{rel}: {number}x")
    assert not unbacked, ("speed-ups no results file of a run the page names backs "
                          f"(name the run, or render a table): {unbacked}")


def _word_files() -> list[Path]:
    return [*PAGES, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "specdraft").rglob("*.py")),
            *sorted((ROOT / "examples").rglob("*.py"))]


def test_no_internal_words():
    hits = []
    for path in _word_files():
        for line in path.read_text().splitlines():
            if INTERNAL_WORDS.search(line) and not any(r.search(line) for r in INTERNAL_WORDS_REAL_USES):
                if (_rel(path), line.strip()) not in PENDING_DOCSTRING_FIXES:
                    hits.append(f"{_rel(path)}: {line.strip()}")
    assert not hits, "words about how the work was done, not about the product:\n" + "\n".join(hits)


def test_pending_docstring_fixes_are_still_there():
    """An entry of PENDING_DOCSTRING_FIXES whose line is gone must leave the list."""
    gone = [entry for entry in PENDING_DOCSTRING_FIXES
            if entry[1] not in {ln.strip() for ln in (ROOT / entry[0]).read_text().splitlines()}]
    assert not gone, f"fixed; remove from PENDING_DOCSTRING_FIXES: {gone}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_doc_code_lines_fit(page: Path):
    long, fence = [], None
    for i, line in enumerate(page.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence else stripped
            continue
        if fence and len(line) > 88:
            long.append(f"{_rel(page)}:{i} ({len(line)} characters)")
    assert not long, f"code lines over 88 characters: {long}"
