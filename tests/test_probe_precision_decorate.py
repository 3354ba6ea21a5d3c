"""``paddle.amp.decorate(level="O2")`` before or after ``shard_layer`` (then ``shard_optimizer`` with ZeRO-2) gives
the model, master-weight flag and ``save_dtype`` state dict one process gets. On a CPU paddle's decorate returns
its arguments untouched, so these run under a GPU place (compat.gpu_place_for_amp_decorate); the CPU no-op itself
is checked too."""
import numpy as np
import paddle
import pytest
from paddle import nn

import autoparallel as dist
from autoparallel.compat import gpu_place_for_amp_decorate


def mlp():
    paddle.seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def tp(name, layer, mesh):
    if name == "0":
        layer.weight = dist.shard_tensor(layer.weight, mesh, [dist.Replicate(), dist.Shard(1)])


def value(t):
    return (t.full() if dist.is_dist(t) else t).astype("float32").numpy()


def one_process(**kw):
    m = mlp()
    opt = paddle.optimizer.AdamW(parameters=m.parameters())
    with gpu_place_for_amp_decorate():
        m, opt = paddle.amp.decorate(models=m, optimizers=opt, **kw)
    return m, opt


def distributed(where, **kw):
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    m = mlp()
    opt = paddle.optimizer.AdamW(parameters=m.parameters())
    with gpu_place_for_amp_decorate():
        if where == "before":
            m, opt = paddle.amp.decorate(models=m, optimizers=opt, **kw)
        m = dist.shard_layer(m, mesh, tp)
        if where == "after":
            m, opt = paddle.amp.decorate(models=m, optimizers=opt, **kw)
    return m, dist.shard_optimizer(opt, dist.ShardingStage2("dp", mesh)), opt


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("kw", [dict(level="O2", dtype="bfloat16"),
                                dict(level="O2", dtype="float16", master_weight=False, save_dtype="float32")])
def test_decorate_around_shard_layer_equals_one_process(where, kw):
    want, want_opt = one_process(**kw)
    assert want_opt._multi_precision == (kw.get("master_weight") is not False)
    with dist.simulate(world_size=4):
        m, _, inner = distributed(where, **kw)
        assert inner._multi_precision == want_opt._multi_precision
        for (n, p), q in zip(m.named_parameters(), want.parameters()):
            assert p.dtype == q.dtype and all(t.dtype == q.dtype for t in p.locals.values()), n
            np.testing.assert_array_equal(value(p), value(q), err_msg=n)
        got_sd, want_sd = m.state_dict(), want.state_dict()
        assert list(got_sd) == list(want_sd)
        for k, v in want_sd.items():
            assert got_sd[k].dtype == v.dtype, k              # save_dtype honoured (or the model's dtype)
            np.testing.assert_array_equal(value(got_sd[k]), value(v), err_msg=k)


def test_decorate_on_a_cpu_place_is_the_same_no_op():
    m = mlp()
    with dist.simulate(world_size=4):
        d, _, inner = distributed("none")
        d2, opt2 = paddle.amp.decorate(models=d, optimizers=inner, level="O2", dtype="bfloat16")
        assert d2 is d and opt2 is inner and not inner._multi_precision
        assert all(p.dtype == paddle.float32 for p in d.parameters())
        np.testing.assert_array_equal(value(d[0].weight), m[0].weight.numpy())


@pytest.mark.parametrize("gpu", [False, True])
def test_decorate_after_shard_optimizer_says_to_decorate_first(gpu):
    import contextlib

    with dist.simulate(world_size=4):
        m, sharded, inner = distributed("none")
        with gpu_place_for_amp_decorate() if gpu else contextlib.nullcontext():
            with pytest.raises(TypeError, match="got a ZeroOptimizer, an optimizer already sharded .*Decorate the "
                                                "model and the paddle optimizer first"):
                paddle.amp.decorate(models=m, optimizers=sharded, level="O2", dtype="bfloat16")
            with pytest.raises(TypeError, match="already sharded"):
                paddle.amp.decorate(models=m, optimizers=[inner, sharded], level="O2", dtype="bfloat16")
        assert all(p.dtype == paddle.float32 for p in m.parameters())      # nothing was cast
