"""Which of a layer's sublayers feed which, read from the source of its ``forward`` (no run, no trace).

    feeds = call_inputs(layer)     # {child name: {child names its input is computed from}}, or None

Straight-line data flow over the forward's statements: a name assigned from an expression depends on every
``self.<child>(...)`` call and every name in it; a later assignment replaces it, one inside ``if`` / ``for`` /
``while`` / ``with`` adds to it (either branch may run); ``xs.append(e)`` and the like add ``e``'s sources to
``xs``. ``self.<child>(args)`` records the sources of ``args`` as the child's input. Calls into helper functions
pass their arguments' sources through. None when the source cannot be read (a built-in layer, a lambda).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap


def _forward_tree(layer):
    return _class_forward_tree(type(layer))


@functools.lru_cache(maxsize=512)
def _class_forward_tree(cls):
    """The parsed ``forward`` of a layer class (classes are few and their source does not change)."""
    fn = getattr(cls, "forward", None)
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _self_child(call, children):
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" and f.attr in children:
        return f.attr
    return None


class _Flow:
    def __init__(self, children):
        self.children, self.env, self.inputs = children, {}, {}

    def sources(self, expr) -> set:
        """Children whose outputs ``expr`` is computed from; records the inputs of the child calls inside."""
        out = set()
        for node in ast.walk(expr):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                out |= self.env.get(node.id, set())
            elif isinstance(node, ast.Call):
                child = _self_child(node, self.children)
                if child is not None:
                    args = set()
                    for a in list(node.args) + [k.value for k in node.keywords]:
                        args |= self.sources(a)
                    self.inputs.setdefault(child, set()).update(args)
                    out.add(child)
        return out

    def assign(self, target, src: set, merge: bool):
        if isinstance(target, ast.Name):
            self.env[target.id] = (self.env.get(target.id, set()) | src) if merge else set(src)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self.assign(t, src, merge)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, src, merge)

    def run(self, stmts, merge=False):
        for st in stmts:
            self.statement(st, merge)

    def statement(self, st, merge):
        if isinstance(st, ast.Assign):
            self._assign_values(st.targets, st.value, merge)
        elif isinstance(st, (ast.AugAssign, ast.AnnAssign)) and st.value is not None:
            self.assign(st.target, self.sources(st.value), merge or isinstance(st, ast.AugAssign))
        elif isinstance(st, ast.Expr):
            src = self.sources(st.value)
            f = getattr(st.value, "func", None)
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):     # xs.append(e): xs gains e
                self.assign(f.value, src, True)
        elif isinstance(st, ast.Return) and st.value is not None:
            self.sources(st.value)
        elif isinstance(st, (ast.For, ast.AsyncFor)):
            self.assign(st.target, self.sources(st.iter), True)
            self.run(st.body * 2 + st.orelse, True)                  # twice: a value carried across iterations
        elif isinstance(st, (ast.If, ast.While)):
            self.sources(st.test)
            self.run(st.body + st.orelse, True)
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            self.run(st.body, merge)
        elif isinstance(st, ast.Try):
            self.run(st.body + [h for x in st.handlers for h in x.body] + st.orelse + st.finalbody, True)

    def _assign_values(self, targets, value, merge):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                    and len(t.elts) == len(value.elts):
                for te, ve in zip(t.elts, value.elts):
                    self.assign(te, self.sources(ve), merge)
            else:
                self.assign(t, self.sources(value), merge)


def call_inputs(layer):
    """{child name: set of child names its input flows from} of ``layer.forward`` (module docstring)."""
    fn = _forward_tree(layer)
    if fn is None:
        return None
    flow = _Flow({n for n, _ in layer.named_children()})
    flow.run(fn.body)
    return flow.inputs


def flows_into(inputs, src: str, dst: str) -> bool:
    """Does ``src``'s output reach ``dst``'s input (directly or through other children)?"""
    seen, todo = set(), [dst]
    while todo:
        n = todo.pop()
        for s in inputs.get(n, ()):
            if s == src:
                return True
            if s not in seen:
                seen.add(s)
                todo.append(s)
    return False


__all__ = ["call_inputs", "flows_into"]
