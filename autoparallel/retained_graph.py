"""A second backward through a graph kept by ``retain_graph=True``.

paddle 3.3 kills the process (SIGSEGV) when a backward pass re-runs a PyLayer's backward that an earlier
pass ran with ``retain_graph=True``, and a distributed graph holds PyLayers: every collective is one
(comm/collectives.py). Such a backward is refused before it runs, naming what to write instead. The
PyLayer nodes of each graph backwarded with ``retain_graph=True`` are remembered while its root tensor is
alive, and those of the last ``_HELD_GRAPHS`` such graphs also after it is gone (the node objects held, so
a node's address cannot be reused meanwhile): the root is often a temporary, ``(w * loss1).backward(
retain_graph=True)``, while the graph lives on in the user's other tensors. Holding the nodes holds their whole
graph (its saved activations), so a held graph is let go after ``_HELD_BACKWARDS`` later backward passes that do
not go through it: the second backward through a retained graph comes next (a second head's loss, a GAN's
generator step). A later backward walks its graph only while some are remembered, and the walk itself costs
memory: paddle 3.3 keeps a graph alive once its root's ``grad_fn`` has been read from Python (measured: a
ZeRO-3 model trained in the two passes after a retained backward was never freed), so the walks stop with the
release, and a loop that once retained a graph keeps only what those passes reached."""
from __future__ import annotations

import collections

from autoparallel.compat import SideData

_KEPT = SideData()                  # root tensor -> frozenset of its graph's PyLayer node addresses
_HELD_GRAPHS = 4
_HELD_BACKWARDS = 2                 # later backward passes not through a held graph before it is let go
_HELD: collections.deque = collections.deque(maxlen=_HELD_GRAPHS)   # [node addresses, the node objects, misses]


def _pylayer_nodes(tensors, objects=None) -> set:
    """The addresses of the PyLayer nodes ``tensors``' graph holds (their node objects into ``objects``)."""
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
            if objects is not None:
                objects.append(n)
        stack.extend(c for c in n.next_functions if c is not None)
    return found


def _kept_nodes() -> set:
    out: set = set()
    for ref, nodes in list(_KEPT._items.values()):
        if ref() is not None:
            out |= nodes
    for nodes, _, _ in _HELD:
        out |= nodes
    return out


def _age_held(nodes: set) -> None:
    """A backward through ``nodes``: the held graphs it does not go through come one pass nearer to release."""
    for entry in list(_HELD):
        if entry[0] & nodes:
            entry[2] = 0
        else:
            entry[2] += 1
            if entry[2] >= _HELD_BACKWARDS:
                _HELD.remove(entry)


def check_backward(tensors, retain_graph: bool) -> None:
    """Call before ``paddle.autograd.backward(tensors, ..., retain_graph)``."""
    tensors = list(tensors)
    kept = _kept_nodes() if (len(_KEPT) or _HELD) else set()
    objects: list = []
    nodes = _pylayer_nodes(tensors, objects) if (kept or retain_graph) else set()
    _age_held(nodes)
    if kept & nodes:
        raise NotImplementedError(
            "backward through a graph already backwarded with retain_graph=True: the graph holds "
            "collectives (paddle PyLayers), and paddle 3.3 crashes the process re-running a PyLayer's "
            "backward; sum the losses and call backward once (or paddle.autograd.backward([l1, l2])), or run "
            "the forward again")
    if retain_graph and nodes:
        for t in tensors:
            _KEPT.set(t, frozenset(nodes))
        _HELD.append([frozenset(nodes), tuple(objects), 0])
