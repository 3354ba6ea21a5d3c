"""A hand-written LoRA layer (a frozen Linear plus ``A [in, r]`` / ``B [r, out]``) under tensor parallelism: a plan
naming the wrapper (or the default plan finding it by its name) splits B like the base's output dim
(column-parallel) and A like its input dim (row-parallel); losses and every parameter after 3 AdamW steps equal
one process, the frozen base bit for bit; no all_gather per step (a shard function splitting only the base
weight, the negative control, gathers B's gradient); ``w.set_value(w + delta)`` on a split weight (a LoRA merge)."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.comm.counter import count_collectives
from autoparallel.parallel.tensor_parallel import PlanError
from autoparallel.parallel.tp_adapters import adapter_targets, base_linear, is_adapter_wrapper
from autoparallel.parallel.tp_plans import raw_plan

RNG = np.random.default_rng(0)
XS = [RNG.standard_normal((8, 6, 16)).astype("float32") for _ in range(3)]
YS = [RNG.standard_normal((8, 6, 16)).astype("float32") for _ in range(3)]


class LoRA(nn.Layer):
    def __init__(self, base, r=4, alpha=8):
        super().__init__()
        self.base = base
        n_in, n_out = base.weight.shape
        self.lora_A = self.create_parameter([n_in, r], default_initializer=nn.initializer.Normal(0, 0.2))
        self.lora_B = self.create_parameter([r, n_out], default_initializer=nn.initializer.Normal(0, 0.2))
        self.scale = alpha / r
        for p in base.parameters():
            p.stop_gradient = True

    def forward(self, x):
        return self.base(x) + x @ self.lora_A @ self.lora_B * self.scale


class Block(nn.Layer):
    """LLaMA-style names, so the default plan finds the projections."""
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down_proj(F.gelu(self.up_proj(x)))


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.mlp = Block()
        self.mlp.up_proj, self.mlp.down_proj = LoRA(self.mlp.up_proj), LoRA(self.mlp.down_proj)

    def forward(self, x):
        return self.mlp(x)


PLAN = {"up_proj": ap.ColWiseParallel(), "down_proj": ap.RowWiseParallel()}


def seed_fn(name, layer, mesh):
    """Splits only the base weights (the adapters stay replicated): the same values, more communication."""
    if name.endswith("up_proj.base"):
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(1)])
        layer.bias = ap.shard_tensor(layer.bias, mesh, [ap.Replicate(), ap.Shard(0)])
    if name.endswith("down_proj.base"):
        layer.weight = ap.shard_tensor(layer.weight, mesh, [ap.Replicate(), ap.Shard(0)])


def params(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy() for n, p in m.named_parameters()}


def train(mode=None, plan=PLAN):
    paddle.seed(0)
    m = Net()
    start = params(m)
    opt = paddle.optimizer.AdamW(1e-2, parameters=m.parameters())
    x = paddle.to_tensor
    if mode == "parallelize":
        s = ap.Strategy()
        s.data_parallel.degree, s.tensor_parallel.degree = 2, 2
        m, opt = ap.parallelize(m, opt, strategy=s, tp_plan=plan)
    elif mode == "shard_fn":
        mesh = ap.ProcessMesh([[0, 1], [2, 3]], dim_names=["data", "model"])
        m = ap.shard_layer(m, mesh, seed_fn)
        opt = ap.shard_optimizer(opt)
        x = lambda a: ap.shard_tensor(paddle.to_tensor(a), mesh, [ap.Shard(0), ap.Replicate()])  # noqa: E731
    losses, comm = [], []
    for xs, ys in zip(XS, YS):
        with count_collectives() as calls:
            loss = F.mse_loss(m(x(xs)), paddle.to_tensor(ys))
            loss.backward()
            opt.step()
            opt.clear_grad()
        comm.append(calls.per_group())
        losses.append(float(loss))
    return losses, start, params(m), m, comm


def check(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for n, v in want[2].items():
        np.testing.assert_allclose(got[2][n], v, rtol=1e-4, atol=1e-5, err_msg=n)
        if "lora" not in n:
            np.testing.assert_array_equal(got[2][n], want[1][n], err_msg=f"frozen {n} moved")


def _gathers(comm) -> int:
    return sum(v for c in comm[1:] for (kind, _), v in c.items() if kind == "all_gather")


@pytest.mark.parametrize("plan", [PLAN, None], ids=["plan names the wrappers", "default plan"])
def test_adapter_split_like_its_base_equals_one_process(plan):
    want = train()
    with ap.simulate(world_size=4):
        got = train("parallelize", plan)
        m = got[3]
        assert [str(p) for p in m.mlp.up_proj.lora_B.placements] == ["R", "S(1)"]
        assert [str(p) for p in m.mlp.up_proj.base.weight.placements] == ["R", "S(1)"]
        assert [str(p) for p in m.mlp.up_proj.lora_A.placements] == ["R", "R"]
        assert [str(p) for p in m.mlp.down_proj.lora_A.placements] == ["R", "S(0)"]
        assert [str(p) for p in m.mlp.down_proj.lora_B.placements] == ["R", "R"]
    check(got, want)
    assert _gathers(got[4]) == 0


def test_adapters_left_replicated_by_a_shard_function_gather_b_gradients():
    """Negative control: the same values, but B's gradient gathered in every step."""
    want = train()
    with ap.simulate(world_size=4):
        got = train("shard_fn")
        assert [str(p) for p in got[3].mlp.up_proj.lora_B.placements] == ["R", "R"]
    check(got, want)
    assert _gathers(got[4]) > 0


def test_adapter_detection_by_shape():
    paddle.seed(0)
    net = Net()
    assert is_adapter_wrapper(net.mlp.up_proj) and base_linear(net.mlp.up_proj) is net.mlp.up_proj.base
    assert not is_adapter_wrapper(net.mlp) and base_linear(net.mlp) is None
    assert set(raw_plan(net)) == {"mlp.up_proj", "mlp.down_proj"}         # the wrappers, not their bases
    col = adapter_targets(net.mlp.up_proj, ap.Shard(1), column=True)
    assert [(n, p) for _, n, p in col] == [("lora_B", ap.Shard(1))]
    wrapper = LoRA(nn.Linear(8, 8), r=8)       # A [8, 8] and B [8, 8] both fit either role: left alone
    assert adapter_targets(wrapper, ap.Shard(1), column=True) == []


def test_plan_on_a_layer_with_two_children_still_refused():
    class Two(nn.Layer):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(PlanError, match="attaches to leaf layers"):
        ap.ColWiseParallel().check("two", Two())


def test_set_value_of_a_distributed_value_equals_one_process():
    """``w.set_value(w + a @ b)`` with ``w`` split by columns (a LoRA merge) sets every shard to its part."""
    rng = np.random.default_rng(1)
    w0, a, b = (rng.standard_normal(s).astype("float32") for s in ((6, 8), (6, 2), (2, 8)))
    want = w0 + a @ b
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["model"])
        lin = nn.Linear(6, 8)
        lin.weight.set_value(w0)
        lin.weight = ap.shard_tensor(lin.weight, mesh, [ap.Shard(1)])
        bd = ap.shard_tensor(paddle.to_tensor(b), mesh, [ap.Shard(1)])
        lin.weight.set_value(lin.weight + paddle.to_tensor(a) @ bd)
        np.testing.assert_allclose(lin.weight.full().numpy(), want, rtol=1e-5, atol=1e-6)
        lin.weight.set_value(ap.shard_tensor(paddle.to_tensor(2 * want), mesh, [ap.Replicate()]))   # other layout
        np.testing.assert_allclose(lin.weight.full().numpy(), 2 * want, rtol=1e-5, atol=1e-6)
        assert [str(p) for p in lin.weight.placements] == ["S(1)"]
        with pytest.raises(ValueError, match="global shape"):
            lin.weight.set_value(ap.shard_tensor(paddle.to_tensor(w0[:, :4]), mesh, [ap.Replicate()]))


def test_a_size_split_from_a_local_shape_is_named_in_the_broadcast_error():
    """An adapter sized from a split weight's local ``.shape`` (wrapped after parallelizing) fails at its first add;
    the error says why. A mismatch that is no split of the other size gets no such hint (negative control)."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["mp"])
        out = paddle.randn([4, 8, 64]) @ ap.shard_tensor(paddle.randn([64, 64]), mesh, [ap.Shard(1)])
        with pytest.raises(ValueError, match=r"size 32 is 64 split 2 ways.*before ap.parallelize"):
            out + paddle.randn([4, 8, 32])
        with pytest.raises(ValueError, match="cannot be broadcast") as other:
            out + paddle.randn([4, 8, 24])
        assert "split" not in str(other.value)
