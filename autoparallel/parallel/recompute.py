"""Activation recompute (checkpointing) with paddle's non-reentrant recompute
(``paddle.distributed.fleet.utils.recompute(..., use_reentrant=False)``: saved-tensor hooks drop what
autograd would keep and rerun the forward in backward), which accepts distributed activations.

* ``full``: the transformer blocks (the model's first LayerList) in segments of
  ``checkpoint_every_n_layers`` consecutive blocks, called positionally or by keyword (recompute_segments);
  a segment keeps only its input.
* ``selective``: only the attention core (softmax(q k^T) v, the part whose activations grow with the
  square of the sequence) of every block, a module-level function or the modelling file's attention registry;
  the projections and MLP keep their activations.

A region's re-run in backward repeats none of its forward's effects on Python state (a KV cache, a layer's
attributes): recompute_state. See docs/recompute.md.

Under ``ap.to_static`` a region's re-run in backward replays the pinned layouts of its forward
(``dispatch.replayable``), and the capture marks the region's ops.
"""
from __future__ import annotations

import logging
import sys

import paddle
from paddle.distributed.fleet.utils import recompute
from paddle.distributed.fleet.utils.log_util import logger as _log

from autoparallel import patches
from autoparallel.comm.sizes import nbytes
from autoparallel.config.fields import integral

GRANULARITIES = ("full", "selective")
_COUNTERS: list = []            # active SavedBytes: a recompute region's inputs stay alive until backward
CORE_NAMES = ("causal_attention", "scaled_dot_product_attention", "attention_core")
REGISTRY = "ALL_ATTENTION_FUNCTIONS"   # the attention-function registry of PaddleFormers (and HF) modelling files


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` whose intermediate activations are recomputed in backward."""
    from autoparallel.parallel.recompute_state import roots_of

    where = getattr(fn, "__qualname__", type(fn).__name__)
    return region(fn, where, roots_of(fn, args, kwargs), args, kwargs)


def region(fn, where: str, roots, args, kwargs):
    """``fn(*args, **kwargs)`` as the recompute region ``where``: its activations are recomputed in backward,
    and the re-run repeats none of the forward's effects on the Python state reachable from ``roots``
    (recompute_state)."""
    from autoparallel.parallel.recompute_state import guarded, running

    _nesting()
    if not paddle.is_grad_enabled() or _evaluating(roots) or running():     # running: nested in a region
        return fn(*args, **kwargs)
    from autoparallel import dispatch
    from autoparallel.graph import trace

    fn = dispatch.replayable(guarded(fn, where, roots))   # the re-run reuses the forward's pinned layouts
    if trace.active() is not None:          # capture: the region's ops are recorded (and marked) once
        return fn(*args, **kwargs)
    for counter in _COUNTERS:
        counter.add_kept(list(args) + list(kwargs.values()))
    # paddle's "no input needs grad" warning looks at paddle.Tensor inputs only, not distributed ones
    level = _log.level
    _log.setLevel(logging.ERROR)
    try:
        return recompute(fn, *args, use_reentrant=False, **kwargs)
    finally:
        _log.setLevel(level)


def _evaluating(roots) -> bool:
    """A region whose layers are all in eval mode (``model.eval()``) runs plainly: recompute is a training
    trade of time for activation memory, as paddle's models apply it (``if self.training``)."""
    layers = [r for r in roots if isinstance(r, paddle.nn.Layer)]
    return bool(layers) and not any(layer.training for layer in layers)


def find_blocks(model):
    """The model's repeated blocks: its first ``paddle.nn.LayerList``."""
    for name, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.LayerList) and len(layer):
            return name, list(layer)
    raise ValueError(f"recompute needs the model's transformer blocks in a paddle.nn.LayerList; "
                     f"{type(model).__name__} has none (sublayers: "
                     f"{', '.join(n for n, _ in model.named_sublayers() if '.' not in n) or 'none'})")


def _check_n(n) -> int:
    """``n`` as an int (numpy ints accepted); ValueError for anything but an int >= 1 (bools included)."""
    value = integral(n)
    if value is None or value < 1:
        raise ValueError(f"checkpoint_every_n_layers must be an int >= 1, got {n!r}")
    return value


def apply_ac(model, granularity: str = "full", checkpoint_every_n_layers: int = 1):
    """Recompute in every block of ``model`` (in place); returns the model."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute granularity must be one of {GRANULARITIES}, got {granularity!r}")
    checkpoint_every_n_layers = _check_n(checkpoint_every_n_layers)
    prefix, blocks = find_blocks(model)
    if granularity == "full":
        _segments(blocks, checkpoint_every_n_layers, [f"{prefix}.{i}" for i in range(len(blocks))])
    else:
        for block in blocks:
            _selective(block)
    return model


def recompute_layers(model, segment_func=None, checkpoint_every_n_layers: int = 2):
    """Seed-style: recompute chosen layers in segments of ``checkpoint_every_n_layers``; returns the model.

    ``segment_func`` takes either form:
      * a per-layer predicate (the article's): ``lambda layer: isinstance(layer, TransformerBlock)``; every
        outermost sublayer it accepts is recomputed (a match's own sublayers are not asked);
      * ``segment_func(model) -> list of layers`` (in call order);
      * ``None``: the model's blocks (its first LayerList).
    A segment keeps only its input and reruns its forward in backward. Layers are grouped into one segment
    only when they are adjacent entries of the same LayerList / Sequential (where one's output is the next
    one's input); any other match is a segment of its own.
    """
    checkpoint_every_n_layers = _check_n(checkpoint_every_n_layers)
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"recompute_layers expects a paddle.nn.Layer, got {type(model).__name__}")
    if segment_func is None:
        prefix, blocks = find_blocks(model)
        _segments(blocks, checkpoint_every_n_layers, [f"{prefix}.{i}" for i in range(len(blocks))])
        return model
    if not callable(segment_func):
        raise TypeError(f"segment_func must be a predicate layer -> bool or a function model -> list of layers, "
                        f"got {type(segment_func).__name__}")
    first = segment_func(model)
    if isinstance(first, (list, tuple, paddle.nn.LayerList, paddle.nn.Sequential)):
        layers = list(first)
        if not layers or not all(isinstance(l, paddle.nn.Layer) for l in layers):
            raise ValueError(f"segment_func(model) must return a non-empty list of paddle.nn.Layer, got {layers!r}")
        _segments(layers, checkpoint_every_n_layers)
        return model
    if not _is_bool(first):
        raise TypeError(f"segment_func must return a bool (a per-layer predicate) or a list of layers "
                        f"(segment_func(model)); got {type(first).__name__} for the model")
    groups = _matching_runs(model, segment_func, bool(first))
    if not groups:
        raise ValueError(f"segment_func matched no layer of {type(model).__name__} (sublayer types: "
                         f"{', '.join(sorted({type(l).__name__ for l in model.sublayers()})) or 'none'})")
    for run in groups:
        _segments(run, checkpoint_every_n_layers)
    return model


def _is_bool(v) -> bool:
    import numpy as np

    return isinstance(v, (bool, np.bool_))


def _matching_runs(model, pred, model_matches: bool) -> list:
    """The outermost layers ``pred`` accepts, as runs of adjacent entries of one LayerList / Sequential."""
    if model_matches:
        return [[model]]
    runs = []

    def visit(layer):
        chain = isinstance(layer, (paddle.nn.LayerList, paddle.nn.Sequential))
        current = []
        for child in layer.children():
            ok = pred(child)
            if not _is_bool(ok):
                raise TypeError(f"segment_func must return a bool for every layer, got {type(ok).__name__} for "
                                f"{type(child).__name__}")
            if ok:
                if chain:
                    current.append(child)
                else:
                    runs.append([child])
                continue
            if current:
                runs.append(current)
                current = []
            visit(child)
        if current:
            runs.append(current)

    visit(model)
    return runs


def _nesting() -> None:
    """A user's recompute call around or inside the regions runs its nested part plainly (model_recompute)."""
    from autoparallel.parallel import model_recompute

    model_recompute.install()


def _segments(blocks, n, names=None):
    from autoparallel.parallel.recompute_segments import install_segments

    _nesting()
    names = names or [f"{type(b).__name__}[{i}]" for i, b in enumerate(blocks)]
    install_segments(blocks, names, n, region)


def _attention(block):
    for name, layer in block.named_sublayers():
        if "attn" in name.split(".")[-1] or "attention" in name.split(".")[-1]:
            return layer
    raise ValueError(f"selective recompute looks for an attention sublayer named like '*attn*' in "
                     f"{type(block).__name__}; got {[n for n, _ in block.named_sublayers()]}")


class _CheckpointedRegistry:
    """An attention-function registry (``ALL_ATTENTION_FUNCTIONS[impl]``) whose entries run as recompute regions."""

    def __init__(self, registry):
        self._registry = registry

    def __getitem__(self, key):
        core = self._registry[key]
        return lambda *a, **k: checkpoint(core, *a, **k)

    def __getattr__(self, name):
        return getattr(self._registry, name)


def _selective(block):
    _nesting()
    attn = _attention(block)
    mod = sys.modules[type(attn).__module__]
    name = next((n for n in CORE_NAMES if callable(getattr(mod, n, None))), None)
    if name is None and hasattr(getattr(mod, REGISTRY, None), "__getitem__"):
        name = REGISTRY
    if name is None:
        raise ValueError(f"selective recompute needs the attention core as a module-level function named one of "
                         f"{CORE_NAMES} (or an attention registry {REGISTRY}) in {mod.__name__}; found none")
    forward = attn.forward

    def wrapped(*args, **kwargs):
        if not attn.training:
            return forward(*args, **kwargs)
        core = getattr(mod, name)
        setattr(mod, name, _CheckpointedRegistry(core) if name == REGISTRY
                else (lambda *a, **k: checkpoint(core, *a, **k)))
        try:
            return forward(*args, **kwargs)
        finally:
            setattr(mod, name, core)

    attn.forward = wrapped


class SavedBytes:
    """Bytes autograd saves for backward outside recompute regions plus the inputs every region keeps
    (parameters excluded):
    ``with SavedBytes() as s: loss = f(x)`` then ``s.bytes``.

    Paddle allows one pair of saved-tensor hooks at a time, so while counting, a recompute region's hooks
    replace ours on entry and ours come back on exit (what a region saves is its own placeholder)."""

    def __init__(self):
        self.bytes = 0
        self.count = 0
        self._saved = None

    def _pack(self, t):
        if t is not None and not (t.is_leaf and not t.stop_gradient) and t._is_initialized():
            self.bytes += nbytes(t)
            self.count += 1
        return t

    def add_kept(self, args):
        from autoparallel.dist_tensor import DistTensor

        for a in args:
            for t in (a.locals.values() if isinstance(a, DistTensor) else [a]):
                if isinstance(t, paddle.Tensor) and not (t.is_leaf and not t.stop_gradient):
                    self.bytes += nbytes(t)
                    self.count += 1

    @staticmethod
    def _unpack(t):
        return t

    def __enter__(self):
        from autoparallel import compat

        me = self

        def enter(inner):
            compat.reset_saved_tensors_hooks()
            compat.register_saved_tensors_hooks(inner.pack_hook, inner.unpack_hook)

        def exit_(inner, *exc):
            compat.reset_saved_tensors_hooks()
            compat.register_saved_tensors_hooks(me._pack, me._unpack)

        self._saved = patches.swapped(paddle.autograd.saved_tensors_hooks, {"__enter__": enter, "__exit__": exit_})
        self._saved.__enter__()                         # put back by __exit__ (or by ap.uninstall meanwhile)
        compat.register_saved_tensors_hooks(self._pack, self._unpack)
        _COUNTERS.append(self)
        return self

    def __exit__(self, *exc):
        from autoparallel import compat

        self._saved.__exit__(None, None, None)
        _COUNTERS.remove(self)
        compat.reset_saved_tensors_hooks()
        return False
