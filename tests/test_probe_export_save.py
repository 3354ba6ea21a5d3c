"""After training: exporting a model autoparallel laid out, as users write it, against the one-process model.

``paddle.jit.save`` / ``paddle.jit.to_static`` + ``jit.save`` / ``paddle.save(model.state_dict())`` on a model
whose parameters are whole on the rank (data parallel, ZeRO-1/2, ``auto_mode="full"`` choosing data parallelism)
export the one-process model; where a rank holds only shards (tensor parallel, ``shard_layer`` with a shard_fn,
ZeRO-3) they raise ``ShardedExportError`` (before: a shard pickled under the whole weight's name, which a plain
model skipped with a warning; or paddle's ``Value Wrapper`` TypeError), and ``ap.full_state_dict`` /
``ap.full_model`` export the one-process model. Outputs are read back with ``paddle.load`` / ``paddle.jit.load``
into plain objects, outside the simulated world."""
import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F
import pytest
from paddle.static import InputSpec

import autoparallel as ap
from autoparallel.testing.models import adamw, tp_plan
from examples.models import GPT, GPTConfig

SPEC = [InputSpec([None, 8], "float32")]
X = np.random.default_rng(0).standard_normal((7, 8)).astype("float32")
TP = {"fc1": "col", "fc2": "row"}


class MLP(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def mlp(seed=0):
    paddle.seed(seed)
    return MLP()


def want():
    m = mlp()
    m.eval()
    return m(paddle.to_tensor(X)).numpy()


def strategy(dp=1, tp=1, stage=None, auto=False):
    s = ap.Strategy()
    if auto:                    # the planner chooses the degrees: a degree set here would fix it
        s.auto_mode, s.global_batch_size = "full", 8
        return s
    s.data_parallel.degree, s.tensor_parallel.degree = dp, tp
    if stage:
        s.sharding.enable, s.sharding.stage = True, stage
    return s


def laid_out(form):
    """The model in one of the forms users build, inside the simulated world of 2 ranks."""
    m = mlp()
    opt = paddle.optimizer.SGD(0.1, parameters=m.parameters())
    if form == "shard_layer":
        def shard_fn(name, sub, mesh):
            if name == "fc1":
                sub.weight = ap.shard_tensor(sub.weight, mesh, [ap.Shard(1)])
        return ap.shard_layer(m, ap.ProcessMesh([0, 1], dim_names=["x"]), shard_fn)
    if form == "DataParallel":
        return ap.DataParallel(m, strategy=strategy(dp=2))
    styles = {"col": ap.ColWiseParallel(), "row": ap.RowWiseParallel()}
    kw = {"tp": dict(strategy=strategy(tp=2), tp_plan={k: styles[v] for k, v in TP.items()}),
          "dp": dict(strategy=strategy(dp=2)), "zero2": dict(strategy=strategy(dp=2, stage=2)),
          "zero3": dict(strategy=strategy(dp=2, stage=3)), "full": dict(strategy=strategy(auto=True))}[form]
    return ap.parallelize(m, opt, **kw)[0]


def _loaded(path):
    layer = paddle.jit.load(path)
    layer.eval()
    return layer(paddle.to_tensor(X)).numpy()


@pytest.mark.parametrize("form", ["dp", "zero2", "full", "DataParallel"])
def test_jit_save_and_paddle_save_of_a_whole_model_export_the_one_process_model(form, tmp_path):
    with ap.simulate(world_size=2):
        m = laid_out(form)
        m.eval()
        paddle.jit.save(m, str(tmp_path / "direct"), input_spec=SPEC)
        paddle.jit.save(paddle.jit.to_static(m, input_spec=SPEC, full_graph=True), str(tmp_path / "to_static"))
        paddle.save(m.state_dict(), str(tmp_path / "m.pdparams"))
    plain = mlp(seed=5)                            # other initial weights: a skipped entry would show
    plain.set_state_dict(paddle.load(str(tmp_path / "m.pdparams")))
    plain.eval()
    for got in (_loaded(str(tmp_path / "direct")), _loaded(str(tmp_path / "to_static")),
                plain(paddle.to_tensor(X)).numpy()):
        np.testing.assert_allclose(got, want(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["tp", "zero3", "shard_layer"])
def test_sharded_models_refuse_implicit_saves_and_export_through_full_forms(form, tmp_path):
    with ap.simulate(world_size=2):
        m = laid_out(form)
        m.eval()
        with pytest.raises(ap.ShardedExportError, match=r"full_state_dict.*every rank"):
            paddle.save(m.state_dict(), str(tmp_path / "bad.pdparams"))
        with pytest.raises(ap.ShardedExportError, match=r"ap\.full_model\(model\)"):
            paddle.jit.save(m, str(tmp_path / "bad"), input_spec=SPEC)
        with pytest.raises(ap.ShardedExportError, match="set_state_dict"):
            mlp(seed=5).set_state_dict(m.state_dict())        # was: skipped with a warning, old weights kept
        paddle.save(ap.full_state_dict(m), str(tmp_path / "full.pdparams"))
        plain = ap.full_model(m)
        paddle.jit.save(plain, str(tmp_path / "full"), input_spec=SPEC)
        with paddle.no_grad():
            after = m(paddle.to_tensor(X))               # the parallel model itself is untouched
        np.testing.assert_allclose(np.asarray(after), want(), rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "bad.pdparams").exists()
    assert all(type(p) is not ap.DistParameter for p in plain.parameters())
    fresh = mlp(seed=5)
    fresh.set_state_dict(paddle.load(str(tmp_path / "full.pdparams")))
    fresh.eval()
    for got in (_loaded(str(tmp_path / "full")), fresh(paddle.to_tensor(X)).numpy(), plain(paddle.to_tensor(X)).numpy()):
        np.testing.assert_allclose(got, want(), rtol=1e-5, atol=1e-6)
    control = mlp(seed=5)                           # negative control: the initial weights the loads replaced
    control.eval()
    assert np.abs(control(paddle.to_tensor(X)).numpy() - want()).max() > 1e-2


def gpt(seed=0):
    paddle.seed(seed)
    return GPT(GPTConfig(vocab_size=64, hidden=32, layers=2, heads=4, max_positions=16))


def test_full_model_of_a_dp_tp_gpt_drops_autoparallel_hooks_keeps_the_users(tmp_path):
    """dp2 x tp2 with recompute: the copy holds plain global weights, no input sharding / tensor-parallel /
    recompute wrappers, and keeps a forward hook of the user's; its jit export equals one process. A full state
    dict loads back into a parallel model of other initial weights (global shapes accepted)."""
    ids = np.random.default_rng(1).integers(0, 64, (3, 8))
    ref = gpt()
    ref.register_forward_post_hook(lambda _l, _i, out: out * 2.0)
    ref.eval()
    expect = ref(paddle.to_tensor(ids)).numpy()
    s = strategy(dp=2, tp=2)
    s.recompute.enable = True
    with ap.simulate(world_size=4):
        m = gpt()
        m.register_forward_post_hook(lambda _l, _i, out: out * 2.0)
        m, _ = ap.parallelize(m, None, strategy=s, tp_plan=tp_plan("gpt"))
        m.eval()
        plain = ap.full_model(m)
        state = ap.full_state_dict(m)
        other, _ = ap.parallelize(gpt(seed=3), None, strategy=strategy(dp=2, tp=2), tp_plan=tp_plan("gpt"))
        other.eval()
        other.set_state_dict(state)
        with paddle.no_grad():
            back = np.asarray(other(paddle.to_tensor(ids))) * 2.0
    assert len(plain._forward_post_hooks) == 1 and not plain._forward_pre_hooks
    assert not any("forward" in sub.__dict__ for sub in plain.sublayers())          # recompute segments gone
    paddle.jit.save(plain, str(tmp_path / "gpt"), input_spec=[InputSpec([None, 8], "int64")])
    got = paddle.jit.load(str(tmp_path / "gpt"))(paddle.to_tensor(ids)).numpy()
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(back, expect, rtol=1e-5, atol=1e-5)


def test_a_plain_model_exports_in_a_process_where_autoparallel_ran(tmp_path):
    """paddle.jit.save reads every attribute of a layer: ``Layer.no_sync`` failed in static mode, and paddle's
    translator rewrote autoparallel's routing wrappers (a GPT failed in ``ForToWhileTransformer``)."""
    ids = paddle.to_tensor(np.random.default_rng(2).integers(0, 64, (2, 8)))
    with ap.simulate(world_size=2):
        m, _ = ap.parallelize(gpt(), None, strategy=strategy(dp=2))
        m(ids)
    plain = gpt()
    plain.eval()
    paddle.jit.save(plain, str(tmp_path / "p"), input_spec=[InputSpec([None, 8], "int64")])
    np.testing.assert_allclose(paddle.jit.load(str(tmp_path / "p"))(ids).numpy(), plain(ids).numpy(), rtol=1e-6)


def test_a_pipeline_model_is_refused_by_name():
    s = strategy()
    s.pipeline_parallel.degree, s.pipeline_parallel.micro_batches = 2, 2
    with ap.simulate(world_size=2):
        pipe, _ = ap.parallelize(gpt(), None, strategy=s)
        for call in (ap.full_model, ap.full_state_dict):
            with pytest.raises(NotImplementedError, match="pipeline-parallel"):
                call(pipe)
        with pytest.raises(NotImplementedError, match="pipeline-parallel"):
            paddle.jit.save(pipe, "/nonexistent/never", input_spec=[InputSpec([None, 8], "int64")])


def test_dist_model_evaluates_predicts_and_exports_like_one_process(tmp_path):
    """``ap.to_static``'s DistModel over 7 samples on dp 2: eval mode gives the loss, predict mode the outputs,
    ``paddle.jit.save(dist_model)`` the network's program (paddle refused a DistModel: not a Layer)."""
    rng = np.random.default_rng(4)
    data = [(rng.integers(0, 64, (7, 8)), rng.integers(0, 64, (7, 8)))]
    ids, lab = (paddle.to_tensor(a) for a in data[0])

    def loss_fn(logits, y):
        return F.cross_entropy(logits, y.unsqueeze(-1)).mean()

    ref = gpt()
    ref.eval()
    with paddle.no_grad():
        want_out, want_loss = ref(ids).numpy(), float(loss_fn(ref(ids), lab))
    with ap.simulate(world_size=2):
        m = gpt()
        dm = ap.to_static(m, None, loss_fn, paddle.optimizer.SGD(0.1, parameters=m.parameters()), strategy(dp=2),
                          input_spec=[([7, 8], "int64"), ([7, 8], "int64")])
        dm.eval()
        loss = float(dm(ids, lab))
        dm.predict()
        out = np.asarray(dm(ids))
        paddle.jit.save(dm, str(tmp_path / "dm"), input_spec=[InputSpec([None, 8], "int64")])
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(paddle.jit.load(str(tmp_path / "dm"))(ids).numpy(), want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dp,tp,stage", [(2, 2, 3), (2, 1, 2)], ids=["zero3-dp2xtp2", "zero2-dp2"])
def test_training_goes_on_after_an_export_as_one_process(dp, tp, stage, tmp_path):
    """Train a step, export (``full_state_dict``, ``full_model``, a refused ``paddle.save`` where sharded), switch
    to eval and back, train another step: losses and the final weights equal two one-process steps."""
    rng = np.random.default_rng(6)
    steps = [(rng.integers(0, 64, (4, 8)), rng.integers(0, 64, (4, 8))) for _ in range(2)]

    def run(model, opt, export=None):
        losses = []
        for i, (ids, lab) in enumerate(steps):
            model.train()
            loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(lab).unsqueeze(-1)).mean()
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
            if export and i == 0:
                export(model)
        return losses

    ref = gpt()
    want = run(ref, adamw(ref.parameters()))
    final = {k: v.numpy() for k, v in ref.state_dict().items()}

    def export(model):
        model.eval()
        ap.full_model(model)
        paddle.save(ap.full_state_dict(model), str(tmp_path / "mid.pdparams"))
        try:
            paddle.save(model.state_dict(), str(tmp_path / "raw.pdparams"))
        except ap.ShardedExportError:
            pass

    with ap.simulate(world_size=dp * tp):
        m = gpt()
        opt = adamw(m.parameters())          # epsilon 1e-4: the key bias has a zero gradient (round-off)
        m, opt = ap.parallelize(m, opt, strategy=strategy(dp=dp, tp=tp, stage=stage),
                                tp_plan=tp_plan("gpt") if tp > 1 else None)
        got = run(m, opt, export)
        state = ap.full_state_dict(m)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k, v in final.items():
        np.testing.assert_allclose(state[k].numpy(), v, rtol=1e-4, atol=1e-5, err_msg=k)
