"""A plain (not distributed) trainable tensor used next to distributed ones in the simulated world gets the
gradient one rank's copy gets on real ranks -- not that gradient once per simulated rank."""
import numpy as np
import paddle
import pytest

import autoparallel as ap
from autoparallel import dispatch_cache
from autoparallel.parallel.tensor_parallel import ColWiseParallel, RowWiseParallel, apply_tp


class MLP(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 8), paddle.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(paddle.nn.functional.relu(self.up(x))))


def _grads(world_size):
    paddle.seed(0)
    ref, x = MLP(), paddle.randn([4, 8])
    state = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    (ref(x) ** 2).sum().backward()
    want = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    with ap.simulate(world_size=world_size):
        mesh = ap.ProcessMesh(list(range(world_size)), dim_names=["model"])
        m = MLP()
        m.set_state_dict({k: paddle.to_tensor(v) for k, v in state.items()})
        apply_tp(m, mesh, {"up": ColWiseParallel(), "down": RowWiseParallel()})   # bias of down, norm: plain
        (m(x) ** 2).sum().backward()
        got = {n: (p.as_dist().grad.full() if hasattr(p, "as_dist") else p.grad).numpy()
               for n, p in m.named_parameters()}
    return want, got


@pytest.mark.parametrize("world_size", [2, 4])
def test_plain_parameters_get_one_copy_of_their_gradient(world_size):
    want, got = _grads(world_size)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-5, err_msg=n)


def test_negative_control_every_rank_summed_is_wrong(monkeypatch):
    monkeypatch.setattr(dispatch_cache, "_plain_locals", lambda v, held: dict.fromkeys(held, v))
    want, got = _grads(2)
    np.testing.assert_allclose(got["down.bias"], 2 * want["down.bias"], rtol=1e-4, atol=1e-5)
