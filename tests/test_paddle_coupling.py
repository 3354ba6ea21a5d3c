"""Paddle coupling stays in one place: outside ``autoparallel/compat.py`` no module of the packages reaches a
private paddle namespace (``paddle.base``, ``paddle.fluid``, ``_C_ops``/``_pir_ops``/``_legacy_C_ops``,
``core``, any ``paddle.x._name``), neither by import nor by attribute chain from ``paddle``; and no side data is
written onto paddle objects as ``_ap_*`` attributes except on the package's own classes and functions."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("autoparallel", "spmd_rules", "reshard")
COMPAT = ROOT / "autoparallel" / "compat.py"
PRIVATE_MODULES = {"base", "fluid", "libpaddle", "core"}

# (file relative to the root, offending dotted text) -> why it cannot move into compat.py
ALLOWED: dict = {
    ("autoparallel/parallel/amp_scaler.py", "paddle.amp.grad_scaler.AmpScaler._unscale"):
        "the loss scaler's unscale step is the method the scaler patch replaces (through the patch ledger); "
        "its name and the original are read next to the replacement",
    ("autoparallel/parallel/amp_scaler.py", "paddle.amp.grad_scaler._refresh_optimizer_state"):
        "the scaler patch resets the per-optimizer state with paddle's own factory, as AmpScaler.update does",
}


def _private(part: str) -> bool:
    return part in PRIVATE_MODULES or (part.startswith("_") and not part.startswith("__"))


def _chain(node):
    """``a.b.c`` of an attribute chain rooted at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _aliases(tree) -> dict:
    """name -> dotted paddle path it is bound to by an import (``import paddle.distributed as dist``,
    ``from paddle.distributed import collective``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "paddle" and a.asname:
                    names[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paddle":
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def private_accesses(source: str) -> list:
    """The dotted texts in ``source`` that reach a private paddle namespace (aliases expanded)."""
    tree = ast.parse(source)
    _mark_parents(tree)
    alias = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] == "paddle" and any(map(_private, a.name.split(".")[1:]))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paddle":
            mod = node.module.split(".")[1:]
            found += [f"{node.module}.{a.name}" for a in node.names if any(map(_private, mod + [a.name]))]
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "_parent", None), ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in alias:
                chain = alias[chain[0]].split(".") + chain[1:]
            if chain and chain[0] == "paddle" and any(map(_private, chain[1:])):
                found.append(".".join(chain))
    return sorted(set(found))


def _mark_parents(tree):
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._parent = parent


def _files():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _violations() -> dict:
    out = {}
    for path in _files():
        if path == COMPAT:
            continue
        rel = str(path.relative_to(ROOT))
        hits = [h for h in private_accesses(path.read_text()) if (rel, h) not in ALLOWED]
        if hits:
            out[rel] = hits
    return out


def test_only_compat_reaches_private_paddle_namespaces():
    assert _violations() == {}


def test_the_checker_finds_each_form_and_leaves_public_names():
    src = ("import paddle\nimport paddle.base.core\nfrom paddle.base import core\nfrom paddle.framework import "
           "_current_expected_place\nx = paddle._C_ops.add\ny = paddle.pir.core._convert_into_value\n"
           "z = paddle.nn.functional.relu\nw = paddle.Tensor.__add__\n")
    src += "import paddle.distributed.collective as coll\nv = coll._default_store\nu = coll.new_group\n"
    assert private_accesses(src) == ["paddle._C_ops.add", "paddle.base.core",
                                     "paddle.distributed.collective._default_store",
                                     "paddle.framework._current_expected_place",
                                     "paddle.pir.core._convert_into_value"]


def test_every_allow_list_entry_still_exists():
    for (rel, hit), reason in ALLOWED.items():
        assert reason and hit in private_accesses((ROOT / rel).read_text()), (rel, hit)


def test_compat_itself_names_what_it_wraps():
    """The negative control of the first test: compat.py does reach them (the checker reads real files)."""
    assert private_accesses(COMPAT.read_text())


def _ap_attribute_writes(source: str) -> list:
    """``x._ap_name = ...`` targets in ``source`` whose object is not ``self`` (a class's own fields)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(el, ast.Attribute) and el.attr.startswith("_ap_"):
                    out.append(ast.unparse(el))
    return out


# objects that are the package's own (a DistParameter's fields, marks on wrapper functions defined here)
OWN_AP_FIELDS = {"_ap_locals", "_ap_spec", "_ap_lazy", "_ap_partial_dims", "_ap_complete_dims", "_ap_routed",
                 "_ap_path", "_ap_wrapper", "_ap_guard", "_ap_inplace", "_ap_cast", "_ap_op", "_ap_comm_timed",
                 "_ap_wrapped", "_ap_stamps", "_ap_block_aware", "_ap_composite", "_ap_implicit"}


def test_no_side_data_is_written_onto_paddle_objects():
    writes = {}
    for path in _files():
        hits = [w for w in _ap_attribute_writes(path.read_text()) if w.rsplit(".", 1)[1] not in OWN_AP_FIELDS]
        if hits:
            writes[str(path.relative_to(ROOT))] = hits
    assert writes == {}
    assert _ap_attribute_writes("model._ap_mesh = mesh\na, b._ap_x = 1, 2\n") == ["model._ap_mesh", "b._ap_x"]
