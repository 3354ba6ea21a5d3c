"""A second backward through a graph kept by ``retain_graph=True``.

paddle 3.3 kills the process (SIGSEGV) when a backward pass re-runs a PyLayer's backward that an earlier
pass ran with ``retain_graph=True``, and a distributed graph holds PyLayers: every collective is one
(comm/collectives.py). Such a backward is refused before it runs, naming what to write instead. The
PyLayer nodes of each graph backwarded with ``retain_graph=True`` are remembered while its root tensor is
alive (so a node's address cannot be reused meanwhile); a later backward walks its graph only while some
are remembered."""
from __future__ import annotations

from autoparallel.compat import SideData

_KEPT = SideData()                  # root tensor -> frozenset of its graph's PyLayer node addresses


def _pylayer_nodes(tensors) -> set:
    seen, found = set(), set()
    stack = [t.grad_fn for t in tensors if getattr(t, "grad_fn", None) is not None]
    while stack:
        n = stack.pop()
        key = n.node_ptr()
        if key in seen:
            continue
        seen.add(key)
        if n.name().startswith("GradNodePyLayer"):
            found.add(key)
        stack.extend(c for c in n.next_functions if c is not None)
    return found


def _kept_nodes() -> set:
    out: set = set()
    for ref, nodes in list(_KEPT._items.values()):
        if ref() is not None:
            out |= nodes
    return out


def check_backward(tensors, retain_graph: bool) -> None:
    """Call before ``paddle.autograd.backward(tensors, ..., retain_graph)``."""
    tensors = list(tensors)
    kept = _kept_nodes() if len(_KEPT) else set()
    nodes = _pylayer_nodes(tensors) if (kept or retain_graph) else set()
    if kept & nodes:
        raise NotImplementedError(
            "backward through a graph already backwarded with retain_graph=True: the graph holds "
            "collectives (paddle PyLayers), and paddle 3.3 crashes the process re-running a PyLayer's "
            "backward; sum the losses and call backward once (or paddle.autograd.backward([l1, l2])), or run "
            "the forward again")
    if retain_graph and nodes:
        for t in tensors:
            _KEPT.set(t, frozenset(nodes))
