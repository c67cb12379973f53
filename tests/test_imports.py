"""The house has one direction of dependencies: a walk over kvcodec's imports (ast, imports inside
functions included; ``if TYPE_CHECKING:`` blocks excluded, they never run) finds no cycle, and the
rooms below never import the rooms above (ARCHITECTURE.md: commands -> api -> codecs -> (quant,
entropy, native, gpu) -> format -> cache)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "kvcodec"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, in functions too, outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the kvcodec modules it imports. ``from .x import name`` points at ``x.name`` when
    that is a module, else at ``x``; a submodule's implicit import of its parent package is not an
    edge (Python runs a package's __init__ first whatever imports it)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (iterative DFS)."""
    state: dict[str, int] = {}
    for root in sorted(graph):
        if state.get(root):
            continue
        path, iters = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_the_walk_sees_function_level_imports_and_finds_a_planted_cycle():
    g = import_graph()
    assert "kvcodec.gpu" in g["kvcodec.decoding"]  # imported inside a method only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kvcodec_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# room -> rooms it must never import (directly; the cycle test covers the rest)
FORBIDDEN = {
    "kvcodec.format": ("kvcodec.codec", "kvcodec.codecs", "kvcodec.gpu", "kvcodec.decoding", "kvcodec.api",
                       "kvcodec.harness", "kvcodec.integrations", "kvcodec.commands", "kvcodec.native"),
    "kvcodec.codecs": ("kvcodec.harness", "kvcodec.integrations", "kvcodec.commands", "kvcodec.api",
                       "kvcodec.gpu"),
    "kvcodec.gpu": ("kvcodec.codec", "kvcodec.codecs", "kvcodec.api", "kvcodec.decoding", "kvcodec.harness",
                    "kvcodec.commands"),
    "kvcodec.quant": ("kvcodec.codec", "kvcodec.codecs", "kvcodec.format", "kvcodec.harness"),
    "kvcodec.entropy": ("kvcodec.codec", "kvcodec.codecs", "kvcodec.format", "kvcodec.harness"),
    "kvcodec.native": ("kvcodec.quant", "kvcodec.codec", "kvcodec.codecs", "kvcodec.harness"),
    "kvcodec.cache": ("kvcodec.codec", "kvcodec.format.container", "kvcodec.format.manifest"),
    "kvcodec.planes": ("kvcodec.",),
}


def test_rooms_below_never_import_rooms_above():
    bad = []
    for m, deps in import_graph().items():
        for room, banned in FORBIDDEN.items():
            if m == room or m.startswith(room + "."):
                bad += [f"{m} -> {d}" for d in deps if any(d == b or d.startswith(b) for b in banned)]
    assert not bad, bad
