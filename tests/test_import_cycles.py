"""The package's import graph, function-level imports included, has no cycle except the edges
docs/design.md allows (section "Import cycles"), each with a reason."""
import ast
import functools
import pathlib
import re

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("autoparallel", "spmd_rules", "reshard")


def _modules() -> dict:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _targets(node, module: str, is_pkg: bool, mods: dict) -> list:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph() -> nx.DiGraph:
    """A fresh copy of the graph (the tree is parsed once per session)."""
    return _parsed_graph().copy()


@functools.lru_cache(maxsize=1)
def _parsed_graph() -> nx.DiGraph:
    mods, g = _modules(), nx.DiGraph()
    for module, path in mods.items():
        g.add_node(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for t in _targets(node, module, path.name == "__init__.py", mods):
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != module and mods[t].name != "__init__.py":     # package roots export lazily
                    g.add_edge(module, t)
    return g


def allowed_edges() -> dict:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### Import cycles", 1)[1]
    rows = re.findall(r"^\| `([\w.]+) -> ([\w.]+)` \| (.+?) \|$", section, flags=re.M)
    return {(a, b): reason.strip() for a, b, reason in rows}


def test_no_import_cycle_beyond_the_allowed_edges():
    g, allowed = import_graph(), allowed_edges()
    assert len(allowed) >= 5 and all(len(r) > 20 for r in allowed.values())
    stale = [e for e in allowed if not g.has_edge(*e)]
    assert stale == [], f"allowed edges that no longer exist (remove them from docs/design.md): {stale}"
    g.remove_edges_from(allowed)
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert cycles == [], f"import cycles: {cycles}"


def test_the_checker_sees_function_level_imports():
    """Negative control: the dispatch layer's one allowed back edge is a function-level import, and putting it
    back into the graph closes a cycle."""
    g = import_graph()
    edge = ("autoparallel.dispatch_handle", "autoparallel.dispatch_install")
    assert g.has_edge(*edge)
    rest = g.copy()
    rest.remove_edges_from(set(allowed_edges()) - {edge})
    assert any(edge[0] in c and len(c) > 1 for c in nx.strongly_connected_components(rest))


def test_the_dispatch_layer_imports_no_dispatcher_from_below():
    """Apart from the allowed edges, the tensor type and the modes below it never reach the dispatcher."""
    g = import_graph()
    g.remove_edges_from(allowed_edges())
    for low in ("autoparallel.dist_tensor", "autoparallel.dist_tensor_ops", "autoparallel.context",
                "autoparallel.patches", "autoparallel.compat", "autoparallel.local_mode", "autoparallel.shadows",
                "autoparallel.dispatch_handle"):
        for high in ("autoparallel.dispatch", "autoparallel.dispatch_install", "autoparallel.tensor_forms"):
            assert not nx.has_path(g, low, high), (low, high)
