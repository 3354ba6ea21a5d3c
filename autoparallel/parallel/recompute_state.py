"""The Python-side state a recomputed region touches, so that its re-run in backward repeats no side effect.

A region's forward may change Python state besides computing its outputs: a KV cache passed in
(``past_key_values.update(k, v)`` appends this step's keys), an attribute a layer sets on itself
(``self.aux_loss = ...``), a list it appends to. The re-run in backward would see the state the forward left
(the cache already holding this step's keys, so the keys come out twice as long) and change it a second time.

The rule: the re-run sees the state the forward saw, and leaves the state as it found it. ``RegionState``
snapshots the region's state roots (its non-tensor arguments and the Python attributes of its layers, followed
through containers and objects) when the forward starts; the re-run runs between ``replay_begin()`` (the state
of that moment saved, the entry snapshot restored) and ``replay_end()`` (the saved state restored). Tensors are held
by reference, which is exact for every out-of-place update. The running mean and variance of paddle's BatchNorm
layers (non-trainable parameters, updated in place by every training forward) are copied and put back, so the
re-run does not update them a second time. Any other tensor of that state changed in place by the forward (a
buffer or a static cache written with ``x[...] = v``) cannot be put back by reference: the forward raises
``NotImplementedError`` naming the region and the tensor.
"""
from __future__ import annotations

import types

import paddle

_DEPTH = 6
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType, types.ModuleType)


def _layer_base_keys() -> frozenset:
    return frozenset(paddle.nn.Layer().__dict__)


_BASE = None


def _batch_norms() -> tuple:
    """paddle's layers whose training forward updates running statistics (non-trainable parameters) in place."""
    nn = paddle.nn
    return (nn.BatchNorm, nn.BatchNorm1D, nn.BatchNorm2D, nn.BatchNorm3D, nn.SyncBatchNorm)


def _is_tensor(x) -> bool:
    from autoparallel.dispatch import is_dist

    return isinstance(x, paddle.Tensor) or is_dist(x)


class _Snapshot:
    """Shallow copies of every mutable container reachable from ``roots`` (tensors by reference), the in-place
    version of every plain tensor held there and (``values``) copies of the running statistics of its batch norms."""

    def __init__(self, roots, values: bool = True):
        global _BASE
        if _BASE is None:
            _BASE = _layer_base_keys()
        self.items, self.versions, self.values, self._seen, self._copy = [], {}, [], set(), values
        for r in roots:
            self._visit(r, 0, "")

    def _visit(self, obj, depth, path):
        if isinstance(obj, _LEAVES) or id(obj) in self._seen or depth > _DEPTH:
            return
        if isinstance(obj, paddle.Tensor):
            if obj._is_initialized():
                self.versions[id(obj)] = (obj, obj._inplace_version(), path)
            return
        if _is_tensor(obj):                               # a distributed tensor held as state: its local shards
            for rank, t in getattr(obj, "locals", {}).items():
                self._visit(t, depth + 1, f"{path}(rank {rank})")
            return
        self._seen.add(id(obj))
        if isinstance(obj, paddle.nn.Layer):
            self._layer(obj, depth, path)
        elif isinstance(obj, dict):
            self.items.append((obj, "dict", dict(obj)))
            for k, v in obj.items():
                self._visit(v, depth + 1, f"{path}[{k!r}]")
        elif isinstance(obj, list):
            self.items.append((obj, "list", list(obj)))
            for i, v in enumerate(obj):
                self._visit(v, depth + 1, f"{path}[{i}]")
        elif isinstance(obj, tuple):
            for i, v in enumerate(obj):
                self._visit(v, depth + 1, f"{path}[{i}]")
        elif hasattr(obj, "__dict__") and not callable(obj):
            self.items.append((obj, "obj", dict(vars(obj))))
            for k, v in vars(obj).items():
                self._visit(v, depth + 1, f"{path}.{k}")

    def _layer(self, layer, depth, path):
        # ``training`` too: a model switched to eval() between the forward and its backward re-runs in train mode
        own = {k: v for k, v in vars(layer).items() if k not in _BASE or k == "training"}
        self.items.append((layer, "layer", own))
        for k, v in own.items():
            self._visit(v, depth + 1, f"{path}.{k}")
        for k, b in layer._buffers.items():
            self._visit(b, depth + 1, f"{path}.{k}")
        if self._copy and layer.training and isinstance(layer, _batch_norms()):
            for p in layer._parameters.values():
                if p is not None and p.stop_gradient:       # the running mean and variance, updated in place
                    self._value(p)
        for k, sub in layer._sub_layers.items():
            if sub is not None:
                self._visit(sub, depth, f"{path}.{k}" if path else k)

    def _value(self, p) -> None:
        """A copy of the value of a non-trainable parameter, put back by ``restore``."""
        from autoparallel.local_mode import local_mode

        tensors = list(p.locals.values()) if _is_tensor(p) and hasattr(p, "locals") else [p]
        with local_mode(), paddle.no_grad():
            self.values.extend((t, t.clone()) for t in tensors if t._is_initialized())

    def restore(self) -> None:
        if self.values:
            from autoparallel.local_mode import local_mode

            with local_mode(), paddle.no_grad():
                for t, saved in self.values:
                    t.set_value(saved)
        for obj, kind, saved in self.items:
            if kind == "dict":
                if obj.keys() != saved.keys() or any(obj[k] is not v for k, v in saved.items()):
                    obj.clear()
                    obj.update(saved)
            elif kind == "list":
                if len(obj) != len(saved) or any(a is not b for a, b in zip(obj, saved)):
                    obj[:] = saved
            else:
                d = vars(obj)
                for k in [k for k in d if k not in saved and (kind == "obj" or k not in _BASE)]:
                    del d[k]
                for k, v in saved.items():
                    if d.get(k, _MISSING) is not v:
                        d[k] = v


_MISSING = object()


class RegionState:
    """Entry snapshot of one recomputed region's state, put back around each re-run (module docstring)."""

    def __init__(self, name: str, roots):
        self.name, self.roots = name, [r for r in roots if not _is_tensor(r)]
        self.entry = self.before = None

    def forward_begin(self) -> None:
        self.entry = _Snapshot(self.roots)

    def forward_end(self) -> None:
        exit_ = _Snapshot(self.roots, values=False)
        changed = [path for key, (t, v, path) in self.entry.versions.items()
                   if key in exit_.versions and t._inplace_version() != v]
        if changed:
            raise NotImplementedError(
                f"recompute of {self.name}: its forward changes {', '.join(changed)} in place; the re-run in "
                f"backward would change it again and see the changed value. Update that state out of place "
                f"(x = x + v, a new tensor) or leave {self.name} out of recompute")

    def replay_begin(self) -> None:
        self.before = _Snapshot(self.roots)       # what the forward, and everything after it, left
        self.entry.restore()

    def replay_end(self) -> None:
        self.before.restore()
        self.before = None


_RUNNING = [0]          # recompute regions whose forward or re-run is on the stack


def running() -> bool:
    """True inside a recompute region (its forward or its re-run in backward): a region nested in it (the model's
    own recompute under ``Strategy.recompute``) runs plainly, since paddle allows one pair of saved-tensor hooks
    at a time and the outer region already recomputes it."""
    return _RUNNING[0] > 0


def marked(fn):
    """``fn`` whose calls count as a running region (``running()``), with no state guard: a plain-tensor recompute
    call of paddle's, so that a region nested in it runs plainly."""
    def wrapper(*args, **kwargs):
        _RUNNING[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _RUNNING[0] -= 1

    wrapper.__wrapped__ = fn
    return wrapper


def guarded(fn, name: str, roots):
    """``fn`` as a region whose later calls (the re-runs in backward) repeat none of its first call's effects
    on ``roots``."""
    from autoparallel.context import state as ctx

    state = RegionState(name, roots)
    calls = []

    def wrapper(*args, **kwargs):
        _RUNNING[0] += 1
        try:
            return call(*args, **kwargs)
        finally:
            _RUNNING[0] -= 1

    def call(*args, **kwargs):
        if not calls:
            calls.append(ctx.local_depth)
            state.forward_begin()
            out = fn(*args, **kwargs)
            state.forward_end()
            return out
        from autoparallel.parallel.zero_params import hold

        state.replay_begin()
        end = hold(replay=True)     # ZeRO-3: the re-run's parameters stay whole for its backward (released after it)
        # the re-run routes its ops as the forward did: paddle.grad over distributed tensors runs the graph in
        # local mode, which would hand the region's DistTensors to paddle's kernels unrouted
        depth, ctx.local_depth = ctx.local_depth, calls[0]
        try:
            return fn(*args, **kwargs)
        finally:
            ctx.local_depth = depth
            end()
            state.replay_end()

    wrapper.__wrapped__ = fn
    return wrapper


def roots_of(fn, args, kwargs) -> list:
    """State roots of ``fn(*args, **kwargs)``: its non-tensor arguments and the layers its closure holds."""
    out = [a for a in list(args) + list(kwargs.values()) if not _is_tensor(a)]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, paddle.nn.Layer):
            out.append(v)
    self_ = getattr(fn, "__self__", None)
    if isinstance(self_, paddle.nn.Layer):
        out.append(self_)
    return out
