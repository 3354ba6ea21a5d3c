"""A ZeRO optimizer's state under the names and global shapes of the unsharded run.

ZeRO (parallel/sharding.py) keeps, on rank r, chunk k = ``groups.index(r)`` of the flattened local shard
of every parameter: an fp32 master chunk and the inner optimizer's accumulators of that chunk. A chunk is
a contiguous range of the local box's C-order elements, i.e. a few boxes of the global tensor
(``layout.flat_range_boxes``), so every accumulator is exposed as one global tensor per parameter,
named as ``state.optimizer_state`` names it (``"optimizer/<param>/moment1"``, ...):

* element-wise accumulators (moment1, moment2, velocity, ...): ``ZeroChunks`` over the chunks; among
  ranks holding the same chunk of the same box (replicas over tensor-parallel Replicate dims and HSDP
  replica groups) the lowest rank writes it;
* per-parameter scalars (beta1_pow_acc, beta2_pow_acc): a DistTensor replicated over the mesh;
* ``master_weight`` only for low-precision parameters of a ``multi_precision`` optimizer, as paddle (otherwise
  the master chunk is the parameter's value: fp32 parameters, and rounded chunks without multi_precision);
* the parameter itself: each rank saves its chunk's range of it (stages 1/2 hold it whole and also load
  it whole, then copy their chunk into the master; at stage 3 the fp32 master chunks are the parameter).

A ZeRO checkpoint therefore loads into plain DP/TP runs, one process or another ZeRO stage or degree,
and vice versa; loading scatters into the flat chunks, reading only the boxes each rank holds.
"""
from __future__ import annotations

import numpy as np

from autoparallel.checkpoint.collect import mesh_json, to_numpy
from autoparallel.checkpoint.layout import flat_range_boxes, local_pieces, numel
from autoparallel.checkpoint.leaves import ShardedLeaf

SCALAR_ACCUMULATORS = ("beta1_pow_acc", "beta2_pow_acc")


def zero_training_state(zopt, model=None) -> dict:
    """{"model": {name: leaf}, "optimizer": {name: {accumulator: leaf}}} of ``zopt`` and its model (``model``
    when ``zopt`` was built over parameters of no known model, as ``shard_optimizer`` on ``shard_layer``)."""
    if model is None:
        model = zopt.model
    if model is None:
        raise ValueError("this ZeRO optimizer was built over parameters of no known model; name the model: "
                         "ap.training_state(model, optimizer)")
    managed = {id(p) for p in zopt.params}
    named = {id(p) for _, p in model.named_parameters()}
    lost = [p.name for p in zopt.params if id(p) not in named]
    if lost:
        raise ValueError(f"the ZeRO optimizer steps {len(lost)} parameters the given "
                         f"{type(model).__name__} does not hold ({', '.join(lost[:3])}); pass the model it was "
                         f"built over")
    zopt.sync_trainable()                   # a parameter unfrozen since the last step: its state exists now
    _ensure_accumulators(zopt)
    r0 = zopt.held[0] if zopt.held else None
    params, optimizer = {}, {}
    for name, p in model.named_parameters():
        if id(p) not in managed or (r0 is not None and id(p) not in zopt.master[r0]):   # frozen: no state
            params[name] = p
            continue
        geo = ChunkGeometry(zopt, p, name)
        params[name] = ZeroParam(geo) if zopt.stage < 3 else ZeroChunks(geo, _master(zopt, p), p.spec.dtype,
                                                                        after_assign=lambda r, p=p: zopt.free([p]))
        acc = _accumulators(zopt, p, geo)
        if acc:                             # a frozen stage-3 parameter: its chunk, no state
            optimizer[name] = acc
    return {"model": params, "optimizer": optimizer}


def _ensure_accumulators(zopt) -> None:
    """Create the inner optimizers' accumulators before their first step (so a fresh run can be loaded)."""
    from autoparallel.compat import main_global_block

    for r in zopt.held:
        inner = zopt.inner_opts[r]
        done = getattr(inner, "_already_create_accumulator", set())
        missing = [m for m in zopt.master[r].values() if m.name not in done and not m.stop_gradient]
        if missing:
            inner._create_accumulators(main_global_block(), missing)


def _master(zopt, p):
    return lambda r: zopt.master[r][id(p)]


def _accumulator(zopt, p, acc_name):
    return lambda r: zopt.inner_opts[r]._accumulators[acc_name][zopt.master[r][id(p)].name]


def _accumulators(zopt, p, geo) -> dict:
    from autoparallel.dist_tensor import DistTensor
    from autoparallel.placement import Replicate
    from autoparallel.spec import DistSpec, normalize_dtype

    r0 = zopt.held[0]
    key = zopt.master[r0][id(p)].name
    out = {}
    for acc_name, per_param in zopt.inner_opts[r0]._accumulators.items():
        if key not in per_param:
            continue
        t = per_param[key]
        dtype = normalize_dtype(t.dtype)
        get = _accumulator(zopt, p, acc_name)
        if acc_name in SCALAR_ACCUMULATORS or list(t.shape) != [geo.size(r0)]:
            spec = DistSpec(p.mesh, [Replicate()] * p.mesh.ndim, list(t.shape), dtype)
            out[acc_name] = DistTensor({r: get(r) for r in zopt.held}, spec)
        else:
            out[acc_name] = ZeroChunks(geo, get, dtype)
    if _saves_master(zopt, p):
        out["master_weight"] = ZeroChunks(geo, _master(zopt, p), "float32")
    return out


def _saves_master(zopt, p) -> bool:
    """paddle's state holds a ``master_weight`` for a trainable float16/bfloat16 parameter of a
    ``multi_precision`` optimizer only; a ZeRO run without it rounds its chunk to the parameter's dtype after
    every step (parallel/precision_masters.py), so the parameter carries the whole value."""
    from autoparallel.parallel.precision_masters import keeps_masters

    low = p.spec.dtype in ("float16", "bfloat16")
    return low and keeps_masters(zopt._inner) and not zopt.master[zopt.held[0]][id(p)].stop_gradient


class ChunkGeometry:
    """Where each rank's chunk of parameter ``p`` lies in the global tensor, and which rank writes it."""

    def __init__(self, zopt, p, name: str):
        self.zopt, self.p, self.name = zopt, p, name
        self.spec = p.spec
        self.pieces = {}                       # rank -> (box offsets, box shape, chunk start, chunk size)
        for r in p.mesh.process_ids:
            held = local_pieces(p.spec, r)          # one box, or one per block of a block-sharded dim
            off, shape = held[0][0], tuple(p.spec.local_shape(r))
            layout = zopt._layout([p], r)
            k = zopt.groups.index(r)
            self.pieces[r] = (off, shape, layout.starts[0][k], layout.sizes[0][k])
        first = {}
        for r in sorted(self.pieces):
            first.setdefault(self.pieces[r], r)
        self.owners = set(first.values())
        self._check_cover()

    def _check_cover(self) -> None:
        covered = {}
        for off, shape, start, size in set(self.pieces.values()):
            covered[(off, shape)] = covered.get((off, shape), 0) + size
        bad = [list(off) for (off, shape), n in covered.items() if n != numel(shape)]
        if bad:
            raise NotImplementedError(f"ZeRO checkpoint of {self.name!r} ({self.spec}): the chunks do not tile the "
                                      f"local boxes at offsets {bad}; a parameter sharded over the ZeRO data axis "
                                      f"{self.zopt.groups.dp_dim!r} is not supported")

    def size(self, r) -> int:
        return self.pieces[r][3]

    def boxes(self, r) -> list:
        """[(global offsets, shape, position in the chunk, chunk box shape, part)] of rank r's chunk: the
        chunk's C-order box at ``position`` has ``chunk box shape``; ``part`` ((start, stop) per dim, or None
        for all of it) is the piece of that box lying at the global offsets (a block-sharded local tensor
        splits a box at its block boundaries)."""
        off, shape, start, size = self.pieces[r]
        if size == 0:
            return []
        held = local_pieces(self.spec, r)
        out = []
        for rel, s, f in flat_range_boxes(shape, start, start + size):
            if len(held) == 1:
                out.append((tuple(o + q for o, q in zip(off, rel)), s, f - start, s, None))
                continue
            for goff, _, sl in held:                 # local rows sl of the block piece at goff
                lo = [max(a, x.start) for a, x in zip(rel, sl)]
                hi = [min(a + n, x.stop) for a, n, x in zip(rel, s, sl)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                g = tuple(go + l - x.start for go, l, x in zip(goff, lo, sl))
                part = tuple((l - a, h - a) for l, h, a in zip(lo, hi, rel))
                out.append((g, tuple(h - l for l, h in zip(lo, hi)), f - start, s, part))
        return out

    def layout_json(self) -> dict:
        return {"mesh": mesh_json(self.p.mesh), "placements": [str(x) for x in self.spec.placements],
                "zero": {"stage": self.zopt.stage, "degree": self.zopt.groups.degree,
                         "dp_dim": self.zopt.groups.dp_dim}}


class ZeroChunks(ShardedLeaf):
    """A global tensor whose rank-r part is the 1-D chunk buffer ``get(r)`` (moments, master weights)."""

    def __init__(self, geo: ChunkGeometry, get, dtype: str, after_assign=None):
        self.geo, self.get, self.dtype, self.after_assign = geo, get, dtype, after_assign
        self.shape = tuple(geo.spec.shape)

    def _chunk(self, r) -> np.ndarray:
        t = self.get(r)
        from autoparallel.spec import normalize_dtype

        if normalize_dtype(t.dtype) != self.dtype:
            t = t.astype(self.dtype)
        return to_numpy(t).reshape(-1)

    def _pieces(self, ranks) -> list:
        out = []
        for r in ranks:
            if self.geo.size(r) == 0:
                continue
            data = self._chunk(r)
            out += [(r, off, _box(data, pos, bs, part)) for off, _, pos, bs, part in self.geo.boxes(r)]
        return out

    def saved_boxes(self) -> list:
        return self._pieces([r for r in self.geo.zopt.held if r in self.geo.owners])

    def held_boxes(self) -> list:
        return [(off, a) for _, off, a in self._pieces(self.geo.zopt.held)]

    def wanted_boxes(self) -> list:
        return [((r, pos, bs, part), off, shape) for r in self.geo.zopt.held
                for off, shape, pos, bs, part in self.geo.boxes(r)]

    def assign(self, loaded: list) -> None:
        from autoparallel.checkpoint.format import storage_dtype

        bufs = {r: np.empty(self.geo.size(r), storage_dtype(self.dtype)) for r in self.geo.zopt.held}
        boxes = {}
        for (r, pos, bs, part), array in loaded:
            if part is None:
                bufs[r][pos:pos + array.size] = array.reshape(-1)
            else:                                   # a box assembled from its block pieces
                box = boxes.setdefault((r, pos), np.empty(bs, bufs[r].dtype))
                box[_slices(part)] = array
        for (r, pos), box in boxes.items():
            bufs[r][pos:pos + box.size] = box.reshape(-1)
        for r, buf in bufs.items():
            if buf.size:
                _copy_into(self.get(r), buf, self.dtype)
            if self.after_assign is not None:
                self.after_assign(r)

    def layout_json(self) -> dict:
        return self.geo.layout_json()


class ZeroParam(ShardedLeaf):
    """A stage-1/2 parameter: every rank saves its chunk's range of its whole local shard (the writes are
    spread like the optimizer states'); a load fills the whole local shards and the master chunks."""

    def __init__(self, geo: ChunkGeometry):
        self.geo, self.p = geo, geo.p
        self.shape, self.dtype = tuple(geo.spec.shape), geo.spec.dtype

    def saved_boxes(self) -> list:
        out = []
        for r, local in sorted(self.p.locals.items()):
            if r not in self.geo.owners or self.geo.size(r) == 0:
                continue
            start = self.geo.pieces[r][2]
            data = to_numpy(local).reshape(-1)[start:start + self.geo.size(r)]
            out += [(r, off, _box(data, pos, bs, part)) for off, _, pos, bs, part in self.geo.boxes(r)]
        return out

    def held_boxes(self) -> list:
        return [(off, to_numpy(t)[sl]) for r, t in sorted(self.p.locals.items())
                for off, _, sl in local_pieces(self.geo.spec, r)]

    def wanted_boxes(self) -> list:
        return [((r, sl), off, shape) for r in sorted(self.p.locals) for off, shape, sl in local_pieces(self.geo.spec, r)]

    def assign(self, loaded: list) -> None:
        import paddle

        from autoparallel.checkpoint.load import _write_into
        from autoparallel.local_mode import local_mode

        zopt = self.geo.zopt
        with paddle.no_grad(), local_mode():
            whole = {}
            for (r, sl), array in loaded:             # a block-sharded local arrives in block pieces
                whole.setdefault(r, np.empty(tuple(self.p.locals[r].shape), array.dtype))[sl] = array
            for r, array in whole.items():
                local = self.p.locals[r]
                _write_into(local, array)
                off, shape, start, size = self.geo.pieces[r]
                if size == 0:
                    continue
                chunk = local.reshape([-1]).astype("float32")[start:start + size]
                master = zopt.master[r][id(self.p)]
                paddle.assign(chunk._copy_to(master.place, True) if zopt.offload else chunk, output=master)

    def layout_json(self) -> dict:
        return self.geo.layout_json()


def _slices(part) -> tuple:
    return tuple(slice(a, b) for a, b in part)


def _box(data: np.ndarray, pos: int, shape, part) -> np.ndarray:
    """The chunk's C-order box of ``shape`` at ``pos`` (or its ``part``)."""
    box = data[pos:pos + numel(shape)].reshape(shape)
    return box if part is None else np.require(box[_slices(part)], requirements="C")    # 0-d stays 0-d


def _copy_into(dest, buf: np.ndarray, dtype: str) -> None:
    """Write the flat ``buf`` (stored as ``dtype``) into the 1-D tensor ``dest`` in place, casting as needed."""
    import paddle

    from autoparallel.local_mode import local_mode
    from autoparallel.spec import normalize_dtype

    with paddle.no_grad(), local_mode():
        src = paddle.to_tensor(buf)
        if dtype == "bfloat16":
            src = src.view(paddle.bfloat16)
        if normalize_dtype(dest.dtype) != dtype:
            src = src.astype(dest.dtype)
        if src.place != dest.place:
            src = src._copy_to(dest.place, True)
        paddle.assign(src, output=dest)
