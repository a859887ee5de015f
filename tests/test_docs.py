"""Executed documentation: every ```python block of README.md and docs/ runs, so the docs cannot drift.

How a page's blocks run
-----------------------
The blocks of one page run in order in one shared namespace, so a block may continue an earlier
one (``dec`` made in one block, used in the next). The namespace starts with what the prose
assumes the reader already has, built on a tiny random Llama checkpoint with a word-level
tokenizer (``tests/_tiny_checkpoint.py``; no download):

``model``, ``tokenizer``
    the tiny checkpoint, loaded with transformers in float32;
``path``
    its directory; the placeholder strings ``"/path/to/checkpoint"`` and ``"path/to/checkpoint"``
    in a block are replaced by it (they stand for "your checkpoint");
``dec``
    ``Decoder(model, tokenizer)``;
``prompt``
    a short string prompt.

A block whose top-level statement is an expression with a trailing comment that is a Python
literal (``tree.tokens  # [0, 1, 2]``) must evaluate to that literal: the comment is the
documented output. A block that is one call with keyword arguments only
(``PromptLookup(max_ngram=3, ...)``, a documented signature) must name the callable's real
defaults.

Markers: an HTML comment on the line(s) just before the fence, invisible on the site.

``<!-- needs: real-model -->``
    the block only makes sense on a real checkpoint (a hub id, a GGUF file, real speed); it is
    skipped here and runs in the slow suite (``pytest -m slow``) on the default model, in its own
    namespace built the same way (the placeholders name the default model; ``"/path/to/model.gguf"``
    names ``$SPECDRAFT_TEST_GGUF``, and the block is skipped without it).
``<!-- skip: reason -->``
    never run (a sketch with free names, a shell transcript): the reason is shown in the report.

A block made only of ``--8<--`` includes of an ``examples/*.py`` section is not run on its own:
the test checks that the section exists, and ``test_example_scripts`` runs the whole script.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(\s*)```(\w*)(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*(needs|skip)\s*:\s*(.*?)\s*-->\s*$")
_SNIPPET = re.compile(r'^\s*--8<--\s+"([^":]+)(?::([\w-]+))?"\s*$')

#: Placeholder strings in the docs that mean "your checkpoint", and what they become here.
PLACEHOLDERS = ("/path/to/checkpoint", "path/to/checkpoint")
GGUF_PLACEHOLDER = "/path/to/model.gguf"


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    marker: tuple[str, str] | None  # ("needs", "real-model") / ("skip", reason)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def snippets(self) -> list[tuple[str, str | None]] | None:
        """The ``--8<--`` includes, when the block is made only of them."""
        lines = [ln for ln in self.code.splitlines() if ln.strip()]
        found = [_SNIPPET.match(ln) for ln in lines]
        if not lines or not all(found):
            return None
        return [(m.group(1), m.group(2)) for m in found if m]


def python_blocks(page: Path) -> list[Block]:
    """The fenced ```python blocks of a page, with the marker comment just above each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        if lang not in ("python", "py"):
            continue
        marker = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and (mm := _MARKER.match(lines[j])):
            marker = (mm.group(1), mm.group(2))
        blocks.append(Block(page, start + 1, "\n".join(body) + "\n", marker))
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in python_blocks(page)]


# -- namespaces ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, with room for the docs' longest ``max_new_tokens`` (256)."""
    from _tiny_checkpoint import save_tiny_checkpoint

    directory = save_tiny_checkpoint(tmp_path_factory.mktemp("docs") / "tiny-llama")
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tiny_loaded(tiny_checkpoint: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_checkpoint)


def _namespace(model: Any, tokenizer: Any, path: str) -> dict[str, Any]:
    import specdraft
    from specdraft import Decoder

    ns: dict[str, Any] = {"__name__": "__docs__"}
    # the public names, as if the page's earlier prose had imported them (blocks import what they use)
    ns.update({name: getattr(specdraft, name) for name in specdraft.__all__})
    ns.update(model=model, tokenizer=tokenizer, path=path, dec=Decoder(model, tokenizer),
              prompt="a b c d a b c d a b c")
    return ns


def _prepare(code: str, path: str, gguf: str | None = None) -> str:
    for placeholder in PLACEHOLDERS:  # longest first: "/path/to/..." contains "path/to/..."
        code = code.replace(f'"{placeholder}"', repr(path))
    if gguf is not None:
        code = code.replace(f'"{GGUF_PLACEHOLDER}"', repr(gguf))
    return code


def _documented_value(comment: str) -> tuple[bool, Any]:
    """The literal a ``# ...`` comment documents, if it is one (``# [1, 2]``, ``# 3  (why)``)."""
    text = comment.lstrip("#").strip()
    for candidate in (text, re.split(r"\s{2,}", text)[0]):
        try:
            value = ast.literal_eval(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if not isinstance(value, str):
            return True, value
    return False, None


def _comments(code: str) -> dict[int, str]:
    import io
    import tokenize

    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def _check_signature(tree: ast.Module, ns: dict[str, Any], block: Block) -> None:
    """A block that is one keyword-only call documents the callable's defaults: they must match."""
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return
    call = tree.body[0].value
    if not isinstance(call, ast.Call) or call.args or not call.keywords:
        return
    target = eval(compile(ast.Expression(call.func), block.id, "eval"), ns)  # noqa: S307 - our own docs
    params = inspect.signature(target).parameters
    for kw in call.keywords:
        assert kw.arg in params, f"{block.id}: {kw.arg!r} is not a parameter of {ast.unparse(call.func)}"
        documented = ast.literal_eval(kw.value)
        actual = params[kw.arg].default
        assert documented == actual, (f"{block.id}: the docs give {ast.unparse(call.func)}({kw.arg}={documented!r}) "
                                      f"but the default is {actual!r}")
    missing = [n for n, p in params.items()
               if p.default is not inspect.Parameter.empty and n not in {k.arg for k in call.keywords}
               and p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert not missing, f"{block.id}: the documented signature of {ast.unparse(call.func)} lacks {missing}"


def run_block(block: Block, ns: dict[str, Any], code: str) -> None:
    """Run ``code`` statement by statement in ``ns``; check documented values and signatures."""
    tree = ast.parse(code, filename=block.id)
    _check_signature(tree, ns, block)
    comments = _comments(code)
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), block.id, "eval"), ns)  # noqa: S307
            is_print = (isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                        and stmt.value.func.id == "print")
            comment = comments.get(stmt.end_lineno or stmt.lineno)
            if comment and not is_print and not comment.lstrip("# ").startswith("e.g."):
                known, documented = _documented_value(comment)
                if known:
                    assert value == documented, (f"{block.id}: line {stmt.lineno} `{ast.unparse(stmt)}` "
                                                 f"documents {documented!r}, got {value!r}")
        else:
            exec(compile(ast.Module([stmt], type_ignores=[]), block.id, "exec"), ns)  # noqa: S102


# -- the tests -----------------------------------------------------------------------------------


def _pages_with_code() -> list[Path]:
    return sorted({b.page for b in ALL_BLOCKS})


@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs(page: Path, tiny_loaded, tiny_checkpoint, capsys) -> None:
    """Every unmarked block of the page runs, in order, in the page's namespace."""
    torch.set_num_threads(1)
    model, tokenizer = tiny_loaded
    ns = _namespace(model, tokenizer, str(tiny_checkpoint))
    ran, skipped = 0, []
    for block in python_blocks(page):
        if block.marker is not None:
            skipped.append(f"{block.id} ({block.marker[0]}: {block.marker[1]})")
            continue
        if (snippets := block.snippets) is not None:
            for file, section in snippets:
                text = (ROOT / file).read_text()
                assert section is None or f"[start:{section}]" in text, f"{block.id}: no section {section!r} in {file}"
            skipped.append(f"{block.id} (included from {', '.join(f for f, _ in snippets)}, run as a script)")
            continue
        torch.manual_seed(0)
        run_block(block, ns, _prepare(block.code, str(tiny_checkpoint)))
        ran += 1
    with capsys.disabled():
        if os.environ.get("SPECDRAFT_DOCS_REPORT"):
            print(f"\n{page.relative_to(ROOT)}: ran {ran}" + "".join(f"\n  skipped {s}" for s in skipped))


def test_markers_are_known() -> None:
    """A typo in a marker would silently run (or skip) a block: only the documented ones exist."""
    for block in ALL_BLOCKS:
        if block.marker is not None:
            kind, value = block.marker
            assert kind == "skip" and value or (kind, value) == ("needs", "real-model"), f"{block.id}: {block.marker}"


def test_every_source_module_is_in_the_reference() -> None:
    """A new module under specdraft/sources/ appears in the generated API reference."""
    reference = (ROOT / "docs" / "reference" / "sources.md").read_text()
    for module in sorted((ROOT / "specdraft" / "sources").glob("*.py")):
        if module.stem.startswith("_"):
            continue
        assert f"::: specdraft.sources.{module.stem}" in reference, (
            f"specdraft/sources/{module.name} is not in docs/reference/sources.md; add a '::: specdraft.sources."
            f"{module.stem}' entry")


EXAMPLE_ARGS = {
    # quickstart takes any checkpoint: the tiny one, in float64 so the identity check is exact
    "quickstart.py": ["{checkpoint}", "--max-new-tokens", "24", "--threads", "1", "--dtype", "float64"],
    "custom_source.py": [],  # builds its own tiny model
}


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_example_scripts(script: str, tiny_checkpoint: Path) -> None:
    """Each example runs to the end on a tiny model and reports identical output."""
    assert script in EXAMPLE_ARGS, f"examples/{script} has no entry in EXAMPLE_ARGS (how to run it on a tiny model)"
    args = [a.format(checkpoint=tiny_checkpoint) for a in EXAMPLE_ARGS[script]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "identical" in proc.stdout and "NO" not in proc.stdout.split("identical", 1)[1], proc.stdout[-2000:]


# -- the slow suite: blocks that need the real model -------------------------------------------


REAL_BLOCKS = [b for b in ALL_BLOCKS if b.marker == ("needs", "real-model")]


@pytest.fixture(scope="module")
def real_loaded():
    from specdraft.models import DEFAULT_MODEL, load_model

    torch.set_num_threads(1)
    model, tokenizer = load_model(DEFAULT_MODEL, dtype="float32")
    return DEFAULT_MODEL, model, tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("block", REAL_BLOCKS, ids=lambda b: b.id)
def test_real_model_block(block: Block, real_loaded) -> None:
    """A ``needs: real-model`` block, on the default model, in a fresh namespace."""
    name, model, tokenizer = real_loaded
    gguf = os.environ.get("SPECDRAFT_TEST_GGUF")
    if GGUF_PLACEHOLDER in block.code and not gguf:
        pytest.skip(f"names a GGUF file; set SPECDRAFT_TEST_GGUF to run it")
    ns = _namespace(model, tokenizer, name)
    run_block(block, ns, _prepare(block.code, name, gguf))
