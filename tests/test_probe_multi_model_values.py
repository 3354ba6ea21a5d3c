"""Several models in one program, each parallelized on its own call (simulated ranks), against one process:
a GAN (two optimizers, ``D(G(z).detach())``, a gradient penalty), distillation with a parameter shared by the
teacher and the student, an EMA copy made by ``copy.deepcopy`` of a parallelized model, and an RLHF-style
frozen reference model. Losses and every parameter after 3 steps; negative controls where a check could pass
by accident."""
import copy

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import autoparallel as ap
from autoparallel.parallel.ties import TiedLayoutError

RNG = np.random.default_rng(0)
Z = [RNG.standard_normal((8, 4)).astype("float32") for _ in range(3)]
R = [RNG.standard_normal((8, 6)).astype("float32") for _ in range(3)]
IDS = [RNG.integers(0, 10, (8, 5)).astype("int64") for _ in range(3)]
TP = {"fc1": ap.ColWiseParallel(), "fc2": ap.RowWiseParallel()}


class MLP(nn.Layer):
    def __init__(self, i, h, o):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(i, h), nn.Linear(h, o)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class Net(nn.Layer):
    def __init__(self, h):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(10, 8), nn.Linear(8, h), nn.Linear(h, 10)

    def forward(self, ids):
        return self.fc2(F.relu(self.fc1(self.emb(ids))))


def par(model, opt, mode):
    if mode is None:
        return model, opt
    s = ap.Strategy()
    if mode == "tp":
        s.tensor_parallel.degree = 2
        return ap.parallelize(model, opt, strategy=s, tp_plan=TP)
    s.data_parallel.degree = 2
    if mode == "zero3":
        s.sharding.enable, s.sharding.stage = True, 3
    return ap.parallelize(model, opt, strategy=s)


def values(m):
    return {n: (p.full() if ap.is_dist(p) else p).numpy().copy() for n, p in m.named_parameters()}


def close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def simulated(fn, *args):
    with ap.simulate(world_size=2):
        return fn(*args)


# ---- GAN -------------------------------------------------------------------------------------------------
def gan(gmode, dmode, detach=False):
    paddle.seed(1)
    G, D = MLP(4, 16, 6), MLP(6, 16, 1)
    og = paddle.optimizer.Adam(1e-2, parameters=G.parameters())
    od = paddle.optimizer.Adam(1e-2, parameters=D.parameters())
    (G, og), (D, od) = par(G, og, gmode), par(D, od, dmode if gmode else None)
    losses = []
    for i in range(3):
        z, real = paddle.to_tensor(Z[i]), paddle.to_tensor(R[i], stop_gradient=False)
        out = D(real)
        g = paddle.grad(out.sum(), real, create_graph=True)[0]            # gradient penalty
        ld = F.softplus(-out).mean() + F.softplus(D(onto(G(z), D).detach())).mean() + 0.1 * (g * g).sum(-1).mean()
        ld.backward()
        od.step(), od.clear_grad()
        fake = onto(G(z), D)
        lg = F.softplus(-D(fake.detach() if detach else fake)).mean()   # detach: the negative control
        lg.backward()
        og.step(), og.clear_grad(), od.clear_grad()
        losses.append((float(ld), float(lg)))
    return losses, values(G), values(D)


def onto(x, model):
    """``x`` on ``model``'s mesh, batch-sharded over its data dim: the explicit move between two models' meshes."""
    if not ap.is_dist(x) or x.mesh == ap.mesh_of(model):
        return x
    mesh = ap.mesh_of(model)
    return ap.reshard(x, mesh, [ap.Shard(0) if n == "data" else ap.Replicate() for n in mesh.dim_names])


@pytest.mark.parametrize("gmode, dmode", [("tp", "tp"), ("dp", "zero3"), ("dp", "tp")])
def test_gan_two_models_two_optimizers_equal_one_process(gmode, dmode):
    ref, got = gan(None, dmode), simulated(gan, gmode, dmode)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-6)
    close(got[1], ref[1]), close(got[2], ref[2])


class Both(nn.Layer):
    def __init__(self, G, D):
        super().__init__()
        self.G, self.D = G, D


def gan_one_call(mode):
    """G and D in one wrapper parallelized with G's optimizer; D's optimizer, built before, is left to paddle."""
    paddle.seed(1)
    G, D = MLP(4, 16, 6), MLP(6, 16, 1)
    og = paddle.optimizer.Adam(1e-2, parameters=G.parameters())
    od = paddle.optimizer.Adam(1e-2, parameters=D.parameters())
    if mode:
        both, og = par(Both(G, D), og, mode)
        G, D = both.G, both.D
    for i in range(3):
        z, real = paddle.to_tensor(Z[i]), paddle.to_tensor(R[i])
        (F.softplus(-D(real)).mean() + F.softplus(D(G(z).detach())).mean()).backward()
        od.step(), od.clear_grad()
        F.softplus(-D(G(z))).mean().backward()
        og.step(), og.clear_grad(), od.clear_grad()
    return values(G), values(D)


@pytest.mark.parametrize("mode", ["dp", "zero3"])
def test_a_second_optimizer_built_before_parallelize_follows_the_parameters(mode):
    ref, got = gan_one_call(None), simulated(gan_one_call, mode)
    close(got[0], ref[0]), close(got[1], ref[1])          # D trained by its own optimizer (it stepped the originals)


def test_a_list_of_models_is_a_typed_error_naming_the_forms_that_work():
    with pytest.raises(TypeError, match="takes one model"):
        ap.parallelize([MLP(4, 4, 4), MLP(4, 4, 4)], None, strategy=ap.Strategy())


# ---- distillation: a parameter shared by teacher and student -----------------------------------------------
def distill(tmode, smode, order="student first", tied=True):
    paddle.seed(1)
    teacher, student = Net(32), Net(16)
    if tied:
        teacher.emb.weight = student.emb.weight             # two holders in two models
    teacher.eval()
    for n, p in teacher.named_parameters():
        p.stop_gradient = not (tied and n.startswith("emb"))
    opt = paddle.optimizer.AdamW(1e-2, parameters=student.parameters())
    if order == "teacher first":
        teacher, _ = par(teacher, None, tmode)
    student, opt = par(student, opt, smode)
    if order == "student first":
        teacher, _ = par(teacher, None, tmode)
    start, losses = values(teacher), []
    for ids in map(paddle.to_tensor, IDS):
        with paddle.no_grad():
            t = teacher(ids)
        loss = F.kl_div(F.log_softmax(student(ids), -1), F.softmax(t, -1), reduction="mean")
        loss.backward()
        opt.step(), opt.clear_grad()
        losses.append(float(loss))
    return losses, values(student), values(teacher), start, teacher.emb.weight is student.emb.weight


@pytest.mark.parametrize("tmode, smode, order", [("dp", "dp", "student first"), ("tp", "tp", "teacher first"),
                                                 ("dp", "zero3", "student first")])
def test_a_parameter_shared_by_two_models_stays_one(tmode, smode, order):
    ref, got = distill(None, None), simulated(distill, tmode, smode, order)
    assert got[4], "teacher and student hold one shared parameter"
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-7)
    close(got[1], ref[1]), close(got[2], ref[2])
    for k in got[2]:                                          # the frozen teacher moved only by the shared weight
        assert k == "emb.weight" or np.array_equal(got[2][k], got[3][k]), k
    assert not np.array_equal(got[2]["emb.weight"], got[3]["emb.weight"])


def test_negative_control_untied_teacher_drifts_from_the_tied_reference():
    ref, untied = distill(None, None), simulated(distill, "dp", "dp", "student first", False)
    assert not np.allclose(untied[2]["emb.weight"], ref[2]["emb.weight"], atol=1e-4)


def test_a_shared_parameter_given_another_mesh_is_a_typed_error():
    with ap.simulate(world_size=2):
        a, b = Net(8), Net(8)
        b.emb.weight = a.emb.weight
        par(a, None, "dp")
        with pytest.raises(TiedLayoutError, match="shared with a model parallelized earlier"):
            par(b, None, "tp")           # [data=1, model=2] against the first model's [data=2, model=1]


# ---- EMA: copy.deepcopy of a parallelized model -------------------------------------------------------------
def ema_run(mode, when):
    paddle.seed(1)
    m = MLP(6, 16, 3)
    opt = paddle.optimizer.Adam(1e-2, parameters=m.parameters())
    ema = copy.deepcopy(m) if when == "before" else None
    m, opt = par(m, opt, mode)
    if when == "before":
        ema, _ = par(ema, None, "dp" if mode == "zero3" else mode)
    else:
        ema = copy.deepcopy(m)
    evals = []
    for i in range(3):
        x = paddle.to_tensor(R[i])
        F.mse_loss(m(x), paddle.to_tensor(R[i][:, :3])).backward()
        opt.step(), opt.clear_grad()
        with paddle.no_grad():
            for p, q in zip(ema.parameters(), m.parameters()):
                p.set_value(0.999 * p + 0.001 * q)
            ema.eval()
            e = ema(x)
        evals.append((e.full() if ap.is_dist(e) else e).numpy())
    return evals, values(m), values(ema), ema, m


@pytest.mark.parametrize("mode, when", [("tp", "after"), ("dp", "after"), ("zero3", "before"), ("zero3", "after")])
def test_ema_copy_equals_one_process(mode, when):
    ref, got = ema_run(None, when), simulated(ema_run, mode, when)
    np.testing.assert_allclose(np.stack(got[0]), np.stack(ref[0]), rtol=1e-5, atol=1e-6)
    close(got[1], ref[1]), close(got[2], ref[2])
    for (n, p), q in zip(got[4].named_parameters(), got[3].parameters()):
        assert ap.is_dist(q) and q.placements == p.placements and q.mesh == p.mesh, n
        assert all(q.locals[r] is not p.locals[r] for r in p.locals), n


EMA_FORMS = {"copy_": lambda p, q: p.copy_(0.9 * p + 0.1 * q, False), "lerp_": lambda p, q: p.lerp_(q, 0.1),
             "assign": lambda p, q: paddle.assign(0.9 * p + 0.1 * q, p)}


def ema_form_run(mode, form):
    """EMA updates in paddle's other forms; "state_dict": ``ema.set_state_dict(model.state_dict())``."""
    paddle.seed(1)
    m = MLP(6, 16, 3)
    ema, opt = copy.deepcopy(m), paddle.optimizer.Adam(1e-2, parameters=m.parameters())
    m, opt = par(m, opt, mode)
    ema, _ = par(ema, None, "dp" if mode == "zero3" else mode)
    for i in range(2):
        F.mse_loss(m(paddle.to_tensor(R[i])), paddle.to_tensor(R[i][:, :3])).backward()
        opt.step(), opt.clear_grad()
        with paddle.no_grad():
            if form == "state_dict":
                ema.set_state_dict(m.state_dict())
                continue
            for p, q in zip(ema.parameters(), m.parameters()):
                EMA_FORMS[form](p, q)
    return values(ema)


@pytest.mark.parametrize("mode, form", [("tp", "copy_"), ("zero3", "state_dict"), ("zero3", "lerp_"),
                                        ("zero3", "assign")])
def test_ema_update_forms_equal_one_process(mode, form):
    close(simulated(ema_form_run, mode, form), ema_form_run(None, form))


def test_a_zero2_model_deepcopies_like_a_plain_one():
    with ap.simulate(world_size=2):
        m = MLP(6, 16, 3)
        s = ap.Strategy()
        s.data_parallel.degree, s.sharding.enable, s.sharding.stage = 2, True, 2
        m, opt = ap.parallelize(m, paddle.optimizer.Adam(parameters=m.parameters()), strategy=s)
        x = paddle.to_tensor(R[0])
        F.mse_loss(m(x), paddle.to_tensor(R[0][:, :3])).backward()
        opt.step()
        c = copy.deepcopy(m)
        np.testing.assert_array_equal(c(x).full().numpy(), m(x).full().numpy())


def test_a_deepcopy_owns_its_storage_and_is_known_as_parallelized():
    with ap.simulate(world_size=2):
        m, _ = par(MLP(6, 16, 3), None, "tp")
        c = copy.deepcopy(m)
        before = values(c)
        with paddle.no_grad():
            for p in m.parameters():
                p.set_value(p * 0 + 7.0)                       # a change of the original ...
        close(values(c), before)                               # ... leaves the copy as it was
        assert c.fc1.weight.name != m.fc1.weight.name
        with pytest.raises(ValueError, match="already parallelized"):
            par(c, None, "tp")


def test_a_zero3_copy_is_whole_and_drops_the_originals_gather_hooks():
    from autoparallel.dist_tensor_forms import ZERO3_OWNERS

    with ap.simulate(world_size=2):
        m = MLP(6, 16, 3)
        m, _ = par(m, paddle.optimizer.SGD(parameters=m.parameters()), "zero3")
        c = copy.deepcopy(m)
        assert not any(p in ZERO3_OWNERS for p in c.parameters())
        assert all(t._is_initialized() for p in c.parameters() for t in p.locals.values())
        assert not any(getattr(f, "__module__", "").endswith("zero_params") for f in c.fc1._forward_pre_hooks.values())
        assert any(getattr(f, "__module__", "").endswith("zero_params") for f in m.fc1._forward_pre_hooks.values())


def test_deepcopy_refuses_recompute_rewrites():
    with ap.simulate(world_size=2):
        blocks = Blocks()
        s = ap.Strategy()
        s.data_parallel.degree, s.recompute.enable = 2, True
        blocks, _ = ap.parallelize(blocks, paddle.optimizer.SGD(parameters=blocks.parameters()), strategy=s)
        with pytest.raises(NotImplementedError, match="rewritten on the instance"):
            copy.deepcopy(blocks)


class Blocks(nn.Layer):
    def __init__(self):
        super().__init__()
        self.blocks = nn.LayerList([nn.Linear(6, 6) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = F.relu(b(x))
        return x


# ---- cross-mesh: two models on sub-meshes of the world ---------------------------------------------------
def two_meshes(meshes):
    paddle.seed(0)
    A, B = MLP(4, 8, 6), MLP(6, 8, 1)
    opt = paddle.optimizer.SGD(0.1, parameters=A.parameters() + B.parameters())
    if meshes:
        A, B = ap.shard_layer(A, meshes[0]), ap.shard_layer(B, meshes[1])
        opt = ap.shard_optimizer(opt)
    h = A(paddle.to_tensor(Z[0]))
    loss = B(ap.reshard(h, meshes[1], [ap.Replicate()]) if meshes else h).mean()
    loss.backward()
    opt.step()
    return float(loss), values(A), values(B)


def test_two_models_on_sub_meshes_train_through_a_reshard():
    ref = two_meshes(None)
    got = simulated(lambda: two_meshes((ap.ProcessMesh([0], dim_names=["x"]), ap.ProcessMesh([1], dim_names=["x"]))))
    assert np.isclose(got[0], ref[0], rtol=1e-5)
    close(got[1], ref[1]), close(got[2], ref[2])


def test_a_whole_tensor_between_meshes_of_one_rank_set_stays_on_its_rank():
    from reshard import plan_cross_mesh

    a, b = ap.ProcessMesh([[0, 1]], dim_names=["data", "model"]), ap.ProcessMesh([[0], [1]], dim_names=["data", "model"])
    plan = plan_cross_mesh([8, 6], "float32", a, "S(1),R", b, "R,S(0)")
    send = [p for p in plan.program if p.collective.value == "send_recv"]
    assert [s.calls[0][0] for s in send] == [((0, 0), (1, 1))]          # each rank keeps its own copy
    assert [s.bytes_per_rank for s in plan.steps if s.collective.value == "send_recv"] == [0.0]
    c = ap.ProcessMesh([[2, 3]], dim_names=["data", "model"])
    other = plan_cross_mesh([8, 6], "float32", b, "R,R", c, "R,R")      # other ranks: k receives from k % n
    assert other.program[0].calls[0][0] == ((0, 2), (1, 3)) and other.steps[0].bytes_per_rank > 0


def _has_paddleformers() -> bool:
    from autoparallel.testing import paddleformers_models as pm

    return pm.available()


@pytest.mark.skipif(not _has_paddleformers(), reason="paddleformers not installed (pip install -e .[models])")
def test_a_paddleformers_model_deepcopied_after_tensor_parallel_is_its_own_model():
    from autoparallel.testing import paddleformers_models as pm

    ids, labels = (paddle.to_tensor(a) for a in pm.batch())
    with ap.simulate(world_size=2):
        s = ap.Strategy()
        s.tensor_parallel.degree = 2
        model = pm.build("llama")
        m, opt = ap.parallelize(model, paddle.optimizer.SGD(0.5, parameters=model.parameters()), strategy=s)
        ref = copy.deepcopy(m)
        ref.eval()
        with paddle.no_grad():
            before = float(pm.loss_of(ref(ids, labels=labels)))
        pm.loss_of(m(ids, labels=labels)).backward()
        opt.step()
        with paddle.no_grad():
            assert float(pm.loss_of(ref(ids, labels=labels))) == before          # the copy did not move
            assert float(pm.loss_of(m(ids, labels=labels))) != before            # the original did
        assert all(ap.is_dist(p) for p in ref.parameters())
