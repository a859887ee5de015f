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
    assert "specdraft.engine" in graph["specdraft.decoder"]
    assert "specdraft.sources.registry" in graph["specdraft.decoder"]
    assert "specdraft.tree" in graph["specdraft.engine.drafting"]


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


#: The public faces: what a user imports, and the front ends built on them.
FACADE = {"specdraft", "specdraft.decoder", "specdraft.batching", "specdraft.cli", "specdraft.bench.command",
          "specdraft.bench.methods", "specdraft.bench.runner", "specdraft.bench.concurrency"}


def test_the_decoder_knows_its_parts_and_they_do_not_know_it() -> None:
    """The engine, the model side, the budget, the kernels, the sources and the shared vocabulary
    (tree, verifier, sampling) never import the public facade or the front ends: data flows one
    way, from the decoder down."""
    graph = _without_package_faces(import_graph())
    parts = [m for m in graph if m.split(".")[1:2] and m.split(".")[1] in
             ("engine", "model", "budget", "kernels", "sources")
             or m in ("specdraft.verify", "specdraft.tree", "specdraft.sampling", "specdraft.stopping")]
    assert len(parts) > 20
    for module in parts:
        reached = _reaches(graph, module) | graph[module]
        assert not reached & FACADE, f"{module} imports {sorted(reached & FACADE)}"
    # and the bench never imports the CLI
    for module in (m for m in graph if m.startswith("specdraft.bench")):
        assert "specdraft.cli" not in _reaches(graph, module), module


def test_the_engine_does_not_import_the_package_face() -> None:
    """``from specdraft import X`` (or ``from .. import X``) inside the engine would run the public
    face, which imports the decoder, which imports the engine: a circle hidden by Python's caching."""
    graph = import_graph()
    inside = [m for m in graph if m.startswith(("specdraft.engine", "specdraft.model", "specdraft.budget",
                                                 "specdraft.kernels"))]
    for module in inside:
        assert "specdraft" not in graph[module], f"{module} imports the package face"


#: Private attributes of third-party objects the package may touch (torch's module and tensor internals).
_FOREIGN_PRIVATE = {"_version", "_parameters", "_buffers"}


def _own_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assigned attributes and names, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_")}


def test_no_module_reaches_into_another_modules_private_names() -> None:
    """Outside the decoder, a module reads only what another module makes public: no
    ``from .x import _name`` and no ``thing._attribute`` of a name the module does not define."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "specdraft.decoder":
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("specdraft")):
                found += [f"{module}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in own and node.attr not in _FOREIGN_PRIVATE \
                    and not ast.unparse(node).startswith("torch."):
                found.append(f"{module}:{node.lineno} reaches {ast.unparse(node)}")
    assert not found, "\n".join(found)
