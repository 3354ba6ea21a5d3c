"""Layout changes through a checkpoint round-trip (reshard_state, reconfigure) and stable training-state
names: a resumed single-process run continues bit for bit."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel.checkpoint import (CheckpointManager, CheckpointMismatchError, reconfigure, reshard_state,
                                     training_state)
from dist_scripts.ckpt_common import DP2_TP2, MESH_2X4, build_state, check_state, full_tensors

FULL = full_tensors(seed=5)


def test_reshard_state_between_layouts_in_the_simulated_world():
    with ap.simulate(world_size=8):
        src = build_state(ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]), DP2_TP2, FULL)
        dst = build_state(ap.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ["dp", "tp"]), MESH_2X4)
        assert check_state(dst, FULL)
        reshard_state(src, dst)
        assert check_state(dst, FULL) == []
        assert check_state(src, FULL) == []              # the source is untouched


def test_reshard_state_rejects_a_different_model():
    with ap.simulate(world_size=4):
        src = build_state(ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]), DP2_TP2, FULL)
        dst = build_state(ap.ProcessMesh([[0, 1], [2, 3]], ["dp", "tp"]), {"w": "R,S(0)"}, extras=False)
        with pytest.raises(CheckpointMismatchError, match="model/v"):
            reshard_state(src, dst)


class _Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1 = paddle.nn.Linear(6, 8)
        self.fc2 = paddle.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


def _batches():
    rng = np.random.default_rng(0)
    return [(paddle.to_tensor(rng.standard_normal((4, 6)).astype("float32")),
             paddle.to_tensor(rng.standard_normal((4, 3)).astype("float32"))) for _ in range(6)]


def _train(model, opt, batches):
    losses = []
    for x, y in batches:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _fresh(seed):
    paddle.seed(seed)
    model = _Net()
    return model, paddle.optimizer.AdamW(learning_rate=0.05, parameters=model.parameters())


def test_resume_single_process_is_exact(tmp_path):
    data = _batches()
    model, opt = _fresh(1)
    reference = _train(model, opt, data)
    model, opt = _fresh(1)
    first = _train(model, opt, data[:3])
    mgr = CheckpointManager(str(tmp_path), save_interval_steps=3)
    mgr.maybe_save(training_state(model, opt), 3, extra={"batch_index": 3})
    _fresh(99)                                        # shifts paddle's global parameter-name counter
    model2, opt2 = _fresh(2)                          # different initial values, different paddle names
    assert [p.name for p in model2.parameters()] != [p.name for p in model.parameters()]
    info = mgr.restore(training_state(model2, opt2))
    rest = _train(model2, opt2, data[info.extra["batch_index"]:])
    assert first + rest == reference                  # bit for bit


def test_reconfigure_moves_parameters_to_a_new_layout():
    weight = np.arange(24, dtype="float32").reshape(4, 6)

    def build(placements, mesh_ranks, value=None):
        model = paddle.nn.Linear(4, 6)
        if value is not None:
            model.weight.set_value(value)
        mesh = ap.ProcessMesh(mesh_ranks, ["x"])
        model.weight = ap.shard_tensor(model.weight, mesh, placements)
        model.bias = ap.shard_tensor(model.bias, mesh, [ap.Replicate()])
        return model

    with ap.simulate(world_size=4):
        old = build([ap.Shard(1)], [0, 1], weight)
        assert [t.numpy().shape for t in old.weight.locals.values()] == [(4, 3), (4, 3)]
        new, new_opt = reconfigure(old, None, {"layout": "S(0) over 4"},
                                   build=lambda s: (build([ap.Shard(0)], [0, 1, 2, 3]), None))
        assert sorted(new.weight.locals) == [0, 1, 2, 3] and new_opt is None
        for r, t in new.weight.locals.items():
            np.testing.assert_array_equal(t.numpy(), weight[r:r + 1])
        np.testing.assert_array_equal(new.bias.full().numpy(), old.bias.full().numpy())
    with pytest.raises(TypeError, match="build must be a callable"):
        reconfigure(old, None, {}, build="fresh")
    with pytest.raises(TypeError, match=r"Linear has no \.config"):       # no default rebuild for it
        reconfigure(old, None, {})
