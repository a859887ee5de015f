"""The import graph of the package points one way: no cycles, and the parts the decoder uses
(sources, verifier, runner, budget, tree) never import the decoder, the CLI or the bench.

Read from the source (every ``import`` statement, also those inside functions, which is where the
old ``cli -> bench -> cli`` cycle hid), so it costs no imports and fails with the cycle's path.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specdraft"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package import counts as its __init__)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in files and target != module:
                    graph[module].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _without_package_faces(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drop the edges *out of* ``__init__`` modules: a package's face re-exports its modules, and
    importing ``specdraft.sources.base`` runs ``specdraft/sources/__init__.py`` first, but that is
    Python's package loading, not a dependency of ``base`` on its siblings."""
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    return {m: (set() if m in packages else deps - packages) for m, deps in graph.items()}


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "specdraft.tree" in graph["specdraft.decoder"]
    assert "specdraft.sources.registry" in graph["specdraft.decoder"]


def test_no_import_cycle() -> None:
    cycle = _find_cycle(_without_package_faces(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_decoder_knows_its_parts_and_they_do_not_know_it() -> None:
    graph = _without_package_faces(import_graph())
    front = {"specdraft.decoder", "specdraft.cli", "specdraft.bench.command", "specdraft.bench.methods",
             "specdraft.bench.runner"}
    parts = [m for m in graph if m.startswith("specdraft.sources.") or m in (
        "specdraft.verify", "specdraft.runner", "specdraft.budget", "specdraft.tree", "specdraft.sampling")]
    for module in parts:
        assert not _reaches(graph, module) & front, f"{module} imports {sorted(_reaches(graph, module) & front)}"
    # and the bench never imports the CLI
    for module in (m for m in graph if m.startswith("specdraft.bench")):
        assert "specdraft.cli" not in _reaches(graph, module), module
