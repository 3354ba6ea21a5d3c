"""The benchmark tools run rarely and outside the suite: a local variable that shadows a helper imported at module
level (``progress = path`` before ``with progress(...)``) broke two of them unseen. Every function in ``tools/``
is checked for a local assignment to a name its module imports."""
import ast
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"
FILES = sorted(TOOLS.rglob("*.py"))


def _imported(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def shadowed_imports(source):
    """(function, name, line) for each local assignment to a module-level imported name."""
    tree = ast.parse(source)
    imported = _imported(tree)
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in imported:
                    found.append((fn.name, node.id, node.lineno))
    return found


def test_the_check_finds_a_shadowed_helper():
    src = "from m import progress\ndef f():\n    progress = 'x'\n    with progress(): pass\n"
    assert shadowed_imports(src) == [("f", "progress", 3)]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(TOOLS)))
def test_no_tool_function_shadows_an_imported_name(path):
    assert shadowed_imports(path.read_text()) == []
