"""paddle's ``LocalLayer`` and ``local_map``: per-rank code on local shards, its outputs declared distributed.

    class MaskedSum(ap.LocalLayer):                      # forward sees this rank's shard, a plain tensor
        def forward(self, x):
            return (x * mask_of(x)).sum()
    layer = MaskedSum(out_dist_attrs=[(mesh, [ap.Partial()])], grad_dist_attrs=[(mesh, [ap.Shard(0)])])
    loss = layer(x_dist)                                 # DistTensor, Partial(sum): float(loss) is the global sum

    f = ap.local_map(fn, out_placements=[[ap.Partial()]], in_placements=[[ap.Shard(0)]], process_mesh=mesh)

The local code runs once per rank this process holds (every rank in ``ap.simulate``), on plain tensors (no
rule is asked), and each output becomes ``dtensor_from_local`` of the ranks' results. Gradients flow through
the shards: a local gradient follows the convention of its input's placement (the slice of the true gradient
for Shard, the whole gradient for Replicate and Partial). So a ``grad_dist_attrs`` entry must be the input's
own layout (or None, meaning that); a gradient layout other than the input's (a Replicate input whose
gradient is declared Partial) cannot be expressed and is refused.
"""
from __future__ import annotations

import paddle

from autoparallel.core.mesh import ProcessMesh, as_mesh
from autoparallel.core.placement import parse_placements

__all__ = ["LocalLayer", "local_map"]


def _layout(entry, what: str):
    """(mesh, placements) of one ``(mesh, placements)`` pair."""
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
        raise TypeError(f"{what}: expected a (ProcessMesh, [placements]) pair, got {entry!r:.80}")
    mesh = as_mesh(entry[0])
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{what}: expected a ProcessMesh first, got {type(entry[0]).__name__}")
    return mesh, tuple(parse_placements(entry[1]))


def _spec_placements(x, mesh, placements):
    from autoparallel.spec import DistSpec

    return DistSpec(mesh, placements, tuple(x.shape), x.spec.dtype).placements


def _held_ranks(dist_inputs, out_meshes):
    from autoparallel.comm.world import current_world

    world = current_world()
    if dist_inputs:
        ranks = [r for r in dist_inputs[0]._locals]
        for x in dist_inputs[1:]:
            ranks = [r for r in ranks if r in x._locals]
        return sorted(ranks)
    out_meshes = [m for m in out_meshes if m is not None]
    return sorted(world.local_ranks(out_meshes[0].process_ids)) if out_meshes else [world.rank]


def run_local(fn, inputs, kwargs, out_layouts, what: str, global_shapes=None):
    """Run ``fn`` per held rank on local shards; outputs wrapped with ``dtensor_from_local`` (``global_shapes``:
    one per output, for shards of uneven size; default: inferred from the local shapes). A None layout (paddle's
    non-tensor output of local_map) returns the output as the first held rank made it."""
    from autoparallel.api_tensor import dtensor_from_local
    from autoparallel.comm.fanout import complete_gradient
    from autoparallel.dist_tensor import as_dist, is_dist
    from autoparallel.local_mode import local_mode

    inputs = [complete_gradient(as_dist(x)) if is_dist(x) else x for x in inputs]   # local gradients are whole
    dist_inputs = [x for x in inputs if is_dist(x)]
    ranks = _held_ranks(dist_inputs, [lay and lay[0] for lay in out_layouts])
    per_rank = {}
    with local_mode():
        for r in ranks:
            local = [x.local_of(r) if is_dist(x) else x for x in inputs]
            per_rank[r] = fn(*local, **kwargs)
    if not per_rank:
        raise ValueError(f"{what}: this process holds no shard of the inputs (its rank is in none of their meshes)")
    structure = next(iter(per_rank.values()))
    flat = {r: paddle.utils.flatten(out) for r, out in per_rank.items()}
    n = len(flat[ranks[0]])
    if n != len(out_layouts):
        raise ValueError(f"{what}: the local code returned {n} output(s) but {len(out_layouts)} output layout(s) "
                         f"were given (one (mesh, placements) per output)")
    outs = []
    for i, layout in enumerate(out_layouts):
        if layout is None:
            outs.append(flat[ranks[0]][i])
            continue
        mesh, placements = layout
        locals_ = {r: flat[r][i] for r in ranks}
        if not all(isinstance(t, paddle.Tensor) for t in locals_.values()):
            raise TypeError(f"{what}: output {i} is not a tensor on every rank; each output is declared "
                            f"distributed by its layout")
        outs.append(dtensor_from_local(locals_ if len(ranks) > 1 or _simulated() else locals_[ranks[0]], mesh,
                                       list(placements), global_shape=global_shapes and global_shapes[i]))
    return paddle.utils.pack_sequence_as(structure, outs)


def _simulated() -> bool:
    from autoparallel.comm.world import current_world

    return current_world().is_simulated


class LocalLayer(paddle.nn.Layer):
    """paddle's ``LocalLayer(out_dist_attrs, grad_dist_attrs)``: ``forward`` runs on local shards."""

    def __init__(self, out_dist_attrs, grad_dist_attrs):
        super().__init__()
        if not isinstance(out_dist_attrs, (list, tuple)) or not isinstance(grad_dist_attrs, (list, tuple)):
            raise TypeError("LocalLayer(out_dist_attrs, grad_dist_attrs): both are lists of (ProcessMesh, "
                            "[placements]) pairs (a grad entry may be None)")
        self.out_dist_attrs = [_layout(e, f"LocalLayer out_dist_attrs[{i}]") for i, e in enumerate(out_dist_attrs)]
        self.grad_dist_attrs = [None if e is None else _layout(e, f"LocalLayer grad_dist_attrs[{i}]")
                                for i, e in enumerate(grad_dist_attrs)]

    def __call__(self, *inputs, **kwargs):
        from autoparallel.dist_tensor import as_dist, is_dist

        if len(inputs) != len(self.grad_dist_attrs):
            raise ValueError(f"LocalLayer: {len(inputs)} inputs but {len(self.grad_dist_attrs)} grad_dist_attrs "
                             f"(one per input, None for the input's own layout)")
        for i, (x, g) in enumerate(zip(inputs, self.grad_dist_attrs)):
            if g is None or not is_dist(x):
                continue
            x = as_dist(x)
            mesh, pl = g
            if mesh != x.mesh or _spec_placements(x, mesh, pl) != x.spec.placements:
                raise NotImplementedError(
                    f"LocalLayer: grad_dist_attrs[{i}] = ({mesh!r}, [{', '.join(map(str, pl))}]) differs from "
                    f"input {i}'s layout ({x.mesh!r}, [{', '.join(map(str, x.placements))}]); a local gradient "
                    f"follows its input's layout here, reshard the input first or give None")
        return run_local(lambda *a, **k: paddle.nn.Layer.__call__(self, *a, **k), inputs, kwargs,
                         self.out_dist_attrs, "LocalLayer")


def _check_map_args(out_placements, in_placements, reshard_inputs) -> None:
    """local_map's placement lists parsed when it is built (a malformed one is refused before any call)."""
    for p in out_placements:
        if p is not None:                      # None: a non-tensor output (paddle's form)
            parse_placements(p)
    if in_placements is not None:
        if isinstance(in_placements, str) or not isinstance(in_placements, (list, tuple)):
            raise TypeError(f"local_map: in_placements is one placement list (or None) per input, got "
                            f"{type(in_placements).__name__} {in_placements!r:.60}")
        for p in in_placements:
            if p is not None:
                parse_placements(p)
    if not isinstance(reshard_inputs, bool):
        raise TypeError(f"local_map: reshard_inputs must be True or False, got {type(reshard_inputs).__name__} "
                        f"{reshard_inputs!r}")


def local_map(func, out_placements, in_placements=None, process_mesh=None, reshard_inputs: bool = False):
    """paddle's ``local_map``: ``func`` on local shards, outputs on ``process_mesh`` (default: the first
    distributed input's) with ``out_placements`` (one list per output). ``in_placements`` (one list per
    input, None for a non-distributed one) are checked, or resharded to with ``reshard_inputs=True``."""
    if not callable(func):
        raise TypeError(f"local_map expects a callable, got {type(func).__name__}")
    if not isinstance(out_placements, (list, tuple)):
        raise TypeError(f"local_map: out_placements is one placement list per output, got {out_placements!r:.80}")
    mesh0 = as_mesh(process_mesh) if process_mesh is not None else None
    if mesh0 is not None and not isinstance(mesh0, ProcessMesh):
        raise TypeError(f"local_map: process_mesh must be a ProcessMesh, got {type(process_mesh).__name__}")
    _check_map_args(out_placements, in_placements, reshard_inputs)

    def wrapped(*args, **kwargs):
        from autoparallel.api_tensor import reshard
        from autoparallel.dist_tensor import as_dist, is_dist

        args = list(args)
        dists = [as_dist(a) for a in args if is_dist(a)]
        mesh = mesh0 or (dists[0].mesh if dists else None)
        if mesh is None and any(p is not None for p in out_placements):
            raise ValueError("local_map: no distributed input to take the mesh from; pass process_mesh")
        if in_placements is not None:
            if len(in_placements) != len(args):
                raise ValueError(f"local_map: {len(args)} inputs but {len(in_placements)} in_placements")
            for i, (a, want) in enumerate(zip(args, in_placements)):
                if want is None or not is_dist(a):
                    continue
                a = as_dist(a)
                want = _spec_placements(a, a.mesh, tuple(parse_placements(want)))
                if want != a.spec.placements:
                    if not reshard_inputs:
                        raise ValueError(f"local_map: input {i} is [{', '.join(map(str, a.placements))}], "
                                         f"in_placements[{i}] says [{', '.join(map(str, want))}]; reshard it or "
                                         f"pass reshard_inputs=True")
                    args[i] = reshard(a, a.mesh, list(want))
        layouts = [None if p is None else (mesh, tuple(parse_placements(p))) for p in out_placements]
        return run_local(func, args, kwargs, layouts, "local_map")

    return wrapped
