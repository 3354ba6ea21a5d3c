"""Lazy distributed parameters and their materialisation, shard by shard.

``shard_lazy`` turns a parameter created under ``paddle.LazyGuard`` into a DistParameter whose locals have
shapes but no storage and which remembers the original (``_ap_lazy``). ``materialize(model)`` then fills
every lazy parameter, in creation order, drawing its initial values from the global generator in chunks
and keeping only each held rank's shard (see stream.py): the values equal an eager single-process build
after the same ``paddle.seed``, and no rank allocates more of a parameter than it keeps (plus one chunk).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import paddle

from autoparallel import layer_state
from autoparallel.comm.world import current_world
from autoparallel.compat import EagerParamBase, storage_free_tensor
from autoparallel.dist_tensor import DistParameter, _make_param, _spec_for, is_dist
from autoparallel.rng_agree import agreed_generator
from autoparallel.lazy_init import draw as D
from autoparallel.lazy_init.order import creation_order, stream_advanced, stream_check, stream_key
from autoparallel.lazy_init.stream import Stats, Target, stream
from autoparallel.placement import Partial

DEFAULT_CHUNK = 1 << 20          # elements drawn per call at most


def is_lazy(p) -> bool:
    """True for a parameter created under ``paddle.LazyGuard`` (or sharded from one) not filled yet."""
    if isinstance(p, DistParameter) and hasattr(p, "_ap_spec"):
        return getattr(p, "_ap_lazy", None) is not None
    return isinstance(p, EagerParamBase) and getattr(p, "_init_func", None) is not None \
        and not p._is_initialized()


def has_lazy(model) -> bool:
    return any(is_lazy(p) for p in model.parameters())


def origin_of(p) -> EagerParamBase:
    return p._ap_lazy if is_dist(p) else p


def _empty(shape, dtype, name: str):
    """A tensor with a shape and no storage."""
    return storage_free_tensor(dtype, shape, name)


def shard_lazy(param, mesh, placements) -> DistParameter:
    """A DistParameter laid out like ``ap.shard_tensor(param, mesh, placements)`` whose locals are not
    allocated yet; ``materialize`` (or ``param.initialize()``) fills them."""
    origin = origin_of(param)
    spec = _spec_for(origin.shape, origin.dtype, mesh, placements)
    if any(p.is_block_shard() for p in spec.placements):
        raise NotImplementedError(f"lazy initialisation of a block-sharded parameter ({spec}) is not supported: "
                                  f"its local rows are not one box of the global tensor; build the model outside "
                                  f"paddle.LazyGuard, or give that layer ColWiseParallel(gather_output=True)")
    ranks = current_world().local_ranks(mesh.process_ids)
    locals_ = {r: _empty(spec.local_shape(mesh.coords_of(r)), origin.dtype, f"{origin.name}.r{r}")
               for r in ranks}
    for t in locals_.values():
        t.stop_gradient = param.stop_gradient
    out = _make_param(locals_, spec, param)
    out._ap_lazy = origin
    out.set_init_func(lambda p, _block: materialize_params([p]))     # paddle's ``param.initialize()``
    return out


# ---- targets ----------------------------------------------------------------------------------------------
def _targets(p, flat_ranges: dict) -> list:
    """[(rank or None, local tensor, Target)] for the parts of ``p`` this process holds."""
    if not is_dist(p):
        return [(None, p, Target(tuple((0, n) for n in p.shape)))]
    spec, out = p.spec, []
    for r, t in p._ap_locals.items():
        coords = spec.mesh.coords_of(r)
        box = tuple((s.start, s.stop) for s in spec.local_slices(coords))
        zeros = any(isinstance(pl, Partial) and pl.reduce_type == "sum" and coords[i] != 0
                    for i, pl in enumerate(spec.placements))
        out.append((r, t, Target(box, flat_ranges.get(r), zeros)))
    return out


# ---- report -----------------------------------------------------------------------------------------------
@dataclass
class ParamInit:
    """How one parameter was materialised in this process (sizes in elements)."""
    name: str
    shape: tuple
    how: str                     # "stream", "constant", "array" or "full" (the fallback)
    kept: dict                   # {rank or None: elements kept}
    largest_draw: int            # largest tensor drawn at once
    drawn: int                   # elements drawn in total (== numel for a random initialiser)
    draws: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def largest(self) -> int:
        """Largest tensor allocated for this parameter: a drawn chunk or a kept part."""
        return max([self.largest_draw] + list(self.kept.values()))


@dataclass
class InitReport:
    params: list = field(default_factory=list)
    stream_mismatch: str = None     # why the values differ from an eager build's (None: they are equal)

    def __iter__(self):
        return iter(self.params)

    def by_name(self) -> dict:
        return {e.name: e for e in self.params}

    def full_copies(self) -> list:
        """Parameters some held rank does not own whole but for which a whole-size tensor was allocated."""
        return [e for e in self.params if e.largest >= e.numel > 0
                and (not e.kept or any(k < e.numel for k in e.kept.values()))]

    def __str__(self):
        lines = [f"{'parameter':<36} {'shape':<14} {'how':<8} {'largest drawn':>13} {'kept/rank':>10}"]
        for e in self.params:
            kept = max(e.kept.values(), default=0)
            lines.append(f"{e.name:<36} {str(list(e.shape)):<14} {e.how:<8} {e.largest_draw:>13} {kept:>10}")
        return "\n".join(lines)


class LazyInitStreamWarning(UserWarning):
    """Lazily built parameters cannot reproduce the eager build's values: the generator's stream moved."""


# ---- materialisation -----------------------------------------------------------------------------------------
def _values(origin, targets, limit, stats):
    """(how, [kept 1-d values per target])."""
    d = D.record(origin)
    shape, dtype = tuple(origin.shape), origin.dtype
    if isinstance(d, D.RandomDraw):
        return "stream", stream(d.values, shape, targets, limit, dtype, stats)
    if isinstance(d, D.ConstantDraw):
        return "constant", [paddle.zeros([t.count], dtype) if t.zeros else d.fill(t.count) for t in targets]
    if isinstance(d, D.ArrayDraw):
        return "array", [paddle.zeros([t.count], dtype) if t.zeros else _flat_cut(d.values_at(_index(t)), t)
                         for t in targets]
    warnings.warn(f"parameter {origin.name}: its initializer is initialised whole and then sliced "
                  f"({d.reason})", stacklevel=3)
    full = D.run_full(origin)
    stats.saw(math.prod(shape))
    return "full", [paddle.zeros([t.count], dtype) if t.zeros else _flat_cut(full[_index(t)].reshape([-1]), t)
                    for t in targets]


def _index(t: Target):
    return tuple(slice(lo, hi) for lo, hi in t.box)


def _flat_cut(values, t: Target):
    return values if t.flat is None else values[t.flat[0]:t.flat[0] + t.count]


def padding_rows(model) -> dict:
    """{id(weight): [row]} of the model's ``nn.Embedding`` layers with a ``padding_idx``: an eager build zeroes
    that row after initialising the weight (paddle skips it for a lazy weight), so ``materialize`` does too
    (a bare ``param.initialize()`` sees no layer and leaves it, like paddle's)."""
    rows = {}
    for _, layer in model.named_sublayers(include_self=True):
        idx = getattr(layer, "_padding_idx", None)
        if isinstance(layer, paddle.nn.Embedding) and idx is not None and layer.weight is not None:
            n = layer.weight.global_shape[0] if is_dist(layer.weight) else layer.weight.shape[0]
            rows.setdefault(id(layer.weight), []).append(idx if idx >= 0 else n + idx)
    return rows


def _zero_rows(values, target: Target, rows) -> None:
    """Zero global rows (dim 0) ``rows`` inside a target's kept values."""
    if not rows or target.zeros or not target.box:
        return
    (lo, hi), inner = target.box[0], math.prod(b - a for a, b in target.box[1:])
    start = target.flat[0] if target.flat is not None else 0
    for row in rows:
        if lo <= row < hi:
            s, e = max(0, (row - lo) * inner - start), min(target.count, (row - lo + 1) * inner - start)
            if s < e:
                values[s:e] = 0


def _fill(tensor, values, shape) -> None:
    values.reshape(list(shape))._share_underline_tensor_to(tensor)


def _materialize_one(p, flat_ranges: dict, limit: int, name: str, rows=()):
    origin = origin_of(p)
    parts = _targets(p, flat_ranges)
    stats = Stats()
    with paddle.no_grad():
        how, values = _values(origin, [t for _, _, t in parts], limit, stats)
        for (_, _, target), v in zip(parts, values):
            _zero_rows(v, target, rows)
    chunks = {}
    for (rank, tensor, target), v in zip(parts, values):
        if target.flat is not None:
            chunks[rank] = v
        else:
            _fill(tensor, v, [hi - lo for lo, hi in target.box])
    if is_dist(p):
        p._ap_lazy = None
        p._init_func = None
    origin._init_func = None
    entry = ParamInit(name, tuple(origin.shape), how, {r: t.count for r, _, t in parts}, stats.chunk,
                      stats.drawn, stats.draws)
    return entry, chunks


def parameter_names(model) -> dict:
    """{id(parameter): its first path in ``model``}."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    return names


def lazy_parameters(model) -> list:
    """The model's distinct lazy parameters in creation order."""
    seen, items = set(), []
    for p in model.parameters():
        if id(p) not in seen and is_lazy(p):
            seen.add(id(p))
            items.append((origin_of(p), p))
    return [p for _, p in creation_order(items)]


def materialize_params(params, flat_ranges: dict | None = None, chunk_elements: int = DEFAULT_CHUNK,
                       names: dict | None = None, zero_rows: dict | None = None):
    """Materialise ``params`` in the given order; ``flat_ranges`` {id(param): {rank: (start, stop)}} keeps
    only that range of a rank's local shard (returned, not installed); ``names`` {id(param): name} labels
    the report; ``zero_rows`` {id(param): [row]} zeroes those rows afterwards (``padding_rows``). Returns
    (InitReport, chunks {id(param): {rank: 1-d tensor}})."""
    if not isinstance(chunk_elements, int) or isinstance(chunk_elements, bool) or chunk_elements < 2:
        raise ValueError(f"chunk_elements must be an int >= 2, got {chunk_elements!r}")
    report, chunks = InitReport(), {}
    params = list(params)
    report.stream_mismatch = stream_check([origin_of(p) for p in params if is_lazy(p)])
    if report.stream_mismatch:
        warnings.warn(LazyInitStreamWarning(
            f"lazily built parameters will not equal an eager build after the same paddle.seed: "
            f"{report.stream_mismatch}; build the model eagerly, or move those draws after materialisation"),
            stacklevel=3)
    before = stream_key()
    meshes = [p._ap_spec.mesh for p in params if is_lazy(p) and hasattr(p, "_ap_spec")]
    ranks = sorted({int(r) for m in meshes for r in m.process_ids})
    with agreed_generator(ranks):                  # one initialisation under per-rank seeds (rng_agree)
        for p in params:
            if not is_lazy(p):
                continue
            name = (names or {}).get(id(p), p.name)
            entry, kept = _materialize_one(p, (flat_ranges or {}).get(id(p), {}), chunk_elements, name,
                                           (zero_rows or {}).get(id(p), ()))
            report.params.append(entry)
            if kept:
                chunks[id(p)] = kept
    stream_advanced(before)
    return report, chunks


def materialize(model, chunk_elements: int = DEFAULT_CHUNK) -> InitReport:
    """Allocate and initialise every lazy parameter of ``model`` shard by shard, in creation order.

    Call it after the parameters are laid out (``ap.shard_layer`` / ``ap.shard_tensor``; ``ap.parallelize``
    calls it for you). With the same ``paddle.seed`` the values equal an eager single-process build,
    provided nothing draws from the generator between the build and this call.
    """
    if not isinstance(model, paddle.nn.Layer):
        raise TypeError(f"materialize expects a paddle.nn.Layer, got {type(model).__name__}")
    report, _ = materialize_params(lazy_parameters(model), None, chunk_elements, parameter_names(model),
                                   padding_rows(model))
    layer_state.put(model, "init_report", report)
    return report

