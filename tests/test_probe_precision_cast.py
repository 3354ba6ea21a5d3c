"""A model cast to low precision after it is distributed (``Layer.to(dtype=...)``, ``.bfloat16()``, ``.float()``)
holds the parameters one process holds after the same cast, every rank's local in the new dtype and its spec
saying so; before the patch the cast raised (a distributed parameter has no single storage to share into)."""
import numpy as np
import paddle
import pytest
from paddle import nn

import autoparallel as dist


def mlp():
    paddle.seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))


def tp(name, layer, mesh):
    if name == "0":
        layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate(), dist.Shard(1)])
        layer.bias = dist.shard_tensor(layer.bias, mesh, [dist.Replicate(), dist.Shard(0)])


CASTS = {"to": lambda m: m.to(dtype="bfloat16"), "bfloat16": lambda m: m.bfloat16(),
         "to-and-back": lambda m: (m.to(dtype="bfloat16"), m.float())}


@pytest.mark.parametrize("form", sorted(CASTS))
def test_cast_after_shard_layer_equals_one_process(form):
    want = mlp()
    CASTS[form](want)
    with dist.simulate(world_size=4):
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        m = dist.shard_layer(mlp(), mesh, tp)
        CASTS[form](m)
        for (n, p), q in zip(m.named_parameters(), want.parameters()):
            assert str(p.dtype) == str(q.dtype), n
            assert all(t.dtype == q.dtype for t in p.locals.values()), n
            full = p.full() if dist.is_dist(p) else p
            np.testing.assert_array_equal(full.astype("float32").numpy(), q.astype("float32").numpy(), err_msg=n)
        assert str(m[0].weight.spec.dtype) == str(want[0].weight.dtype).replace("paddle.", "")
