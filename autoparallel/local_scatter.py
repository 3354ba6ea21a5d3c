"""``sharded_masked_scatter`` (a group op named by the ``masked_scatter`` rule): x and its full-shape mask split
over their dim 0 on one mesh dim, the values replicated. Rank i's positions take the values after the True
positions of the ranks before it, so each rank all-reduces a one-hot vector of its True count over that mesh
dim (one tiny all_reduce) and scatters ``value.flatten()[offset : offset + count]`` into its shard. The
gradient of the replicated values is each rank's slice, summed over the group by the runtime (the op is split
there), so no rank gathers the embeddings."""
from __future__ import annotations

import paddle

from autoparallel.local_ce import mesh_reduce

_NAMES = ["x", "mask", "value", "name"]        # paddle.masked_scatter's order


def sharded_masked_scatter(mesh, calls):
    bound = {}
    for r, (args, kwargs) in calls.items():
        b = dict(zip(_NAMES, args))
        b.update(kwargs)
        bound[r] = b
    d = next(iter(bound.values()))["row_mesh_dim"]
    size = mesh.shape[d]
    with paddle.no_grad():
        onehot = {}
        for r, b in bound.items():
            v = paddle.zeros([size], dtype="float64")
            v[mesh.coords_of(r)[d]] = b["mask"].astype("float64").sum()
            onehot[r] = v
        counts = mesh_reduce(onehot, mesh, (d,))
    out = {}
    for r, b in bound.items():
        c = [int(n) for n in counts[r].numpy()]
        i = mesh.coords_of(r)[d]
        flat = b["value"].reshape([-1])
        if not flat.shape[0]:                   # no values anywhere: no True position on any rank
            out[r] = b["x"] * 1
            continue
        start = min(sum(c[:i]), flat.shape[0] - 1)
        # at least one value even where this shard has no True position: paddle's backward fails on an empty
        # value, and the values' gradient (zeros here) keeps every rank in the group's gradient reduction
        out[r] = b["x"].masked_scatter(b["mask"], flat[start:start + max(c[i], 1)])
    return out
