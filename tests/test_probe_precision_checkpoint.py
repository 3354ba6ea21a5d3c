"""Checkpoints of low-precision training. A bfloat16 model under ZeRO-2 with AdamW (float32 masters, or rounded
ones for multi_precision=False) saved after a step, loaded into a fresh run and continued equals the uninterrupted
run bit for bit; the checkpoint holds a master_weight exactly where paddle's state does (multi_precision) and loads
into one process. ``paddle.amp.decorate(save_dtype="float32")``: ``model.state_dict()`` holds float32 copies, which
ap.save_state_dict writes as float32 and ap.load_state_dict writes back into the parameters (it filled the copies
and left the model as it was)."""
import os

import numpy as np
import paddle
import pytest
from paddle import nn

import autoparallel as dist
from autoparallel.checkpoint import load_merged_state_dict, load_state_dict, save_state_dict, training_state
from autoparallel.compat import gpu_place_for_amp_decorate
from autoparallel.testing.precision import BATCHES, full_values, low_model


def zero2(mesh, mp, seed=2):
    m = dist.shard_layer(low_model(seed), mesh)
    opt = paddle.optimizer.AdamW(0.01, parameters=m.parameters(), multi_precision=mp)
    return m, dist.shard_optimizer(opt, dist.ShardingStage2("dp", mesh))


def train(m, opt, mesh, batches):
    for x in batches:
        m(dist.shard_tensor(paddle.to_tensor(x).astype("bfloat16"), mesh, [dist.Shard(0)])).backward()
        opt.step()
        opt.clear_grad()


@pytest.mark.parametrize("mp", [True, False])
def test_zero2_bfloat16_resume_equals_the_uninterrupted_run(tmp_path, mp):
    path = str(tmp_path / "c")
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        m, opt = zero2(mesh, mp)
        train(m, opt, mesh, BATCHES)
        want = full_values(m)
        m, opt = zero2(mesh, mp)
        train(m, opt, mesh, BATCHES[:1])
        save_state_dict(training_state(m, opt), path)
    saved = load_merged_state_dict(path, flat=True)
    assert saved["optimizer/w/moment1"].dtype == np.float32 and saved["model/w"].dtype != np.float32
    assert ("optimizer/w/master_weight" in saved) == mp                  # paddle's state: a master only with mp
    if mp:
        assert saved["optimizer/w/master_weight"].dtype == np.float32
    one = low_model(seed=5)                                              # the same names as one process's state
    load_state_dict(training_state(one, paddle.optimizer.AdamW(0.01, parameters=one.parameters(),
                                                               multi_precision=mp)), path)
    bf16_as_f32 = (saved["model/w"].view(np.uint16).astype(np.uint32) << 16).view(np.float32)   # stored as uint16
    np.testing.assert_array_equal(full_values(one)["w"], bf16_as_f32)
    with dist.simulate(world_size=2):
        mesh = dist.ProcessMesh([0, 1], dim_names=["dp"])
        m, opt = zero2(mesh, mp, seed=9)                          # other initial values
        load_state_dict(training_state(m, opt), path)
        train(m, opt, mesh, BATCHES[1:])
        got = full_values(m)
    for n, v in want.items():
        np.testing.assert_array_equal(got[n], v, err_msg=n)


def decorated(seed, mesh=None):
    paddle.seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    with gpu_place_for_amp_decorate():
        m = paddle.amp.decorate(models=m, level="O2", dtype="bfloat16", save_dtype="float32")
    return m if mesh is None else dist.shard_layer(m, mesh)


@pytest.mark.parametrize("world", [None, 2])
def test_save_dtype_is_saved_and_loads_into_the_parameters(tmp_path, world):
    path = str(tmp_path / "s")

    def run():
        mesh = None if world is None else dist.ProcessMesh([0, 1], dim_names=["dp"])
        src, dst = decorated(1, mesh), decorated(2, mesh)
        save_state_dict(src.state_dict(), path)
        assert {str(v.dtype) for v in load_merged_state_dict(path).values()} == {"float32"}
        assert not np.array_equal(full_values(src)["0.weight"], full_values(dst)["0.weight"])
        load_state_dict(dst.state_dict(), path)
        assert all(p.dtype == paddle.bfloat16 for p in dst.parameters())
        for n, v in full_values(src).items():
            np.testing.assert_array_equal(full_values(dst)[n], v, err_msg=n)

    if world is None:
        run()
    else:
        with dist.simulate(world_size=world):
            run()
