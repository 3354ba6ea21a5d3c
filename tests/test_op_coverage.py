"""Op coverage for what users write: elementwise math, NaN reductions, scans, products and pooling as spmd
rules; losses, nn functions, shape helpers and norms as decompositions into routed ops (spmd_rules.composites).

Every decomposition equals paddle's own function (values and gradients) on plain tensors, and, under
simulated ranks, on distributed inputs laid out R / S(d) / P(sum) over a 2-rank and a 2x2 mesh (full values and
input gradients vs one process). Losses give readable layouts ("(S(0), S(0)) -> P(sum)"); a Linear ->
F.mse_loss regression trained data-parallel equals one process; what still has no rule raises the typed error.
"""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import patches
from autoparallel.mesh import mesh_from_shape
from spmd_rules import get_spmd_rule
from spmd_rules.composites import COMPOSITES
from spmd_rules.composites_more import COMPOSITES as MORE_COMPOSITES
from spmd_rules.composites_shape import COMPOSITES as SHAPE_COMPOSITES
from composite_cases import build, substitute, tensors_of

ALL = {**COMPOSITES, **SHAPE_COMPOSITES, **MORE_COMPOSITES}
CASES = build()
FLOATS = (paddle.float32, paddle.float64)
RTOL, ATOL = 1e-4, 1e-5


def _resolve(path):
    obj = paddle
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def _outs(o):
    return list(o) if isinstance(o, (list, tuple)) else [o]


def _fresh(args, kwargs):
    """The call with every tensor copied; float copies require gradients. Returns (args, kwargs, tensors)."""
    src = tensors_of(args, kwargs)
    copies = {}
    for a in src:
        c = a.detach().clone()
        c.stop_gradient = a.dtype not in FLOATS
        copies[id(a)] = c
    a2, k2 = substitute(args, kwargs, copies)
    return a2, k2, [copies[id(a)] for a in src]


def _reference(fn, args, kwargs):
    """Outputs (numpy) and input gradients (of the sum of float outputs) of ``fn`` on plain tensors."""
    a2, k2, leaves = _fresh(args, kwargs)
    outs = _outs(fn(*a2, **k2))
    floats = [o for o in outs if o.dtype in FLOATS]
    wrt = [t for t in leaves if not t.stop_gradient]
    grads = []
    if floats and wrt:
        total = paddle.add_n([o.sum() for o in floats])
        grads = paddle.grad(total, wrt, allow_unused=True)
    return [o.numpy() for o in outs], [None if g is None else g.numpy() for g in grads]


@pytest.mark.parametrize("path,args,kwargs", CASES, ids=[f"{c[0].rsplit('.', 1)[-1]}-{i}" for i, c in enumerate(CASES)])
def test_decomposition_equals_paddle_on_plain_tensors(path, args, kwargs):
    want, want_g = _reference(_resolve(path).__wrapped__ if hasattr(_resolve(path), "__wrapped__")
                              else _resolve(path), args, kwargs)
    got, got_g = _reference(ALL[path], args, kwargs)
    assert [w.shape for w in want] == [g.shape for g in got]
    if path.endswith("group_norm") and kwargs.get("data_format") == "NHWC":
        want_g = got_g = []          # paddle's NHWC backward is wrong: see the finite-difference test below
    for w, g in zip(want + want_g, got + got_g):
        if w is None or g is None:
            assert not np.any(w if w is not None else g), "a gradient exists on one side only"
            continue
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True)


def test_group_norm_nhwc_gradient_matches_finite_differences():
    """paddle 3.3's own NHWC group_norm backward disagrees with finite differences; the decomposition agrees."""
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((2, 3, 3, 6)), rng.standard_normal((2, 3, 3, 6))

    def loss_and_grad(arr):
        x = paddle.to_tensor(arr, stop_gradient=False)
        loss = (ALL["paddle.nn.functional.group_norm"](x, 2, data_format="NHWC") * paddle.to_tensor(w)).sum()
        return float(loss), paddle.grad(loss, [x])[0].numpy()

    base, grad = loss_and_grad(a)
    for idx in [(0, 1, 2, 3), (1, 0, 0, 5)]:
        b = a.copy()
        b[idx] += 1e-6
        assert grad[idx] == pytest.approx((loss_and_grad(b)[0] - base) / 1e-6, rel=1e-4)


# ---- distributed inputs ----------------------------------------------------------------------------------------------
def _options(a, ndim_mesh):
    opts = [ap.Replicate()] + [ap.Shard(d) for d in range(a.ndim)]
    if a.dtype in FLOATS:
        opts.append(ap.Partial("sum"))
    return opts


def _combos(leaves, mesh_ndim):
    """A handful of layouts per call: all R; all the k-th option; per mesh dim different options (2-d)."""
    out = []
    for k in range(4):
        pl = []
        for a in leaves:
            opts = _options(a, mesh_ndim)
            pl.append([opts[min(k + m, len(opts) - 1)] for m in range(mesh_ndim)])
        out.append(pl)
    last = [[ap.Shard(max(a.ndim - 1, 0)) if a.ndim else ap.Replicate()] * mesh_ndim for a in leaves]
    out.append(last)
    return out


def _dist(a, mesh, placements):
    leaf = a.detach().clone()
    leaf.stop_gradient = a.dtype not in FLOATS
    plain = [ap.Replicate() if isinstance(p, ap.Partial) else p for p in placements]
    d = ap.shard_tensor(leaf, mesh, plain)
    used = ap.reshard(d, mesh, placements) if plain != list(placements) else d
    return d, used


def _check_dist(path, args, kwargs, mesh, combo):
    """Problems of one layout: values and input gradients vs the decomposition on plain tensors (which the
    test above holds equal to paddle's own function)."""
    want, want_g = _reference(ALL[path], args, kwargs)
    src = tensors_of(args, kwargs)
    pairs = [_dist(a, mesh, pl) for a, pl in zip(src, combo)]
    a2, k2 = substitute(args, kwargs, {id(a): used for a, (_, used) in zip(src, pairs)})
    outs = _outs(_resolve(path)(*a2, **k2))
    got = [o.full().numpy() if hasattr(o, "full") else o.numpy() for o in outs]     # numel: a plain scalar
    floats = [o for o in outs if str(o.dtype).endswith(("float32", "float64"))]
    leaves = [leaf for leaf, _ in pairs if not leaf.stop_gradient]
    if floats and leaves:
        paddle.add_n([o.sum() for o in floats]).backward()
    got_g = [None if leaf.grad is None else leaf.grad.full().numpy() for leaf in leaves] if floats else []
    problems = []
    for i, (w, g) in enumerate(zip(want + want_g, got + got_g)):
        if w is None or g is None:
            if not (w is None and g is None) and np.any(w if w is not None else g):
                problems.append(f"output/grad {i}: missing")
            continue
        if w.shape != g.shape or not np.allclose(g, w, rtol=RTOL, atol=ATOL, equal_nan=True):
            problems.append(f"output/grad {i}: got {g.ravel()[:3]} want {w.ravel()[:3]}")
    return problems


def _run_all(mesh_shape, world):
    failures, n = [], 0
    with ap.simulate(world):
        mesh = mesh_from_shape(mesh_shape)
        for path, args, kwargs in CASES:
            for combo in _combos(tensors_of(args, kwargs), len(mesh_shape)):
                n += 1
                try:
                    problems = _check_dist(path, args, kwargs, mesh, combo)
                except Exception as e:                                   # noqa: BLE001  (reported below)
                    problems = [f"{type(e).__name__}: {str(e)[:200]}"]
                failures += [f"{path} {kwargs} {combo}: {p}" for p in problems]
    return failures, n


def test_composites_on_a_2_rank_mesh_equal_one_process():
    failures, n = _run_all([2], 2)
    assert n >= 5 * len(CASES)
    assert failures == [], "\n".join(failures[:20])


def test_composites_on_a_2x2_mesh_equal_one_process():
    failures, n = _run_all([2, 2], 4)
    assert failures == [], "\n".join(failures[:20])


def test_negative_control_a_wrong_decomposition_is_caught(monkeypatch):
    """The checks above see a decomposition that ignores an argument (mse_loss always summing)."""
    from spmd_rules import composites

    wrong = lambda input, label, reduction="mean", name=None: paddle.sum(paddle.square(input - label))  # noqa: E731
    monkeypatch.setitem(ALL, "paddle.nn.functional.mse_loss", wrong)
    x, y = CASES[0][1]
    with pytest.raises(AssertionError):
        test_decomposition_equals_paddle_on_plain_tensors("paddle.nn.functional.mse_loss", (x, y), {})
    assert composites.mse_loss is not wrong


# ---- readable layouts of the losses ----------------------------------------------------------------------------------
def _layout(fn, placements, *arrays, **kwargs):
    mesh = mesh_from_shape([2])
    ins = [ap.shard_tensor(paddle.to_tensor(a), mesh, [p]) for a, p in zip(arrays, placements)]
    out = fn(*ins, **kwargs)
    text = f"({', '.join(str(p) for p in placements)}) -> {', '.join(str(p) for p in out.placements)}"
    return text, float(out.full().numpy().sum())


@pytest.mark.parametrize("name,placements,reduction,want", [
    ("mse_loss", "S(0) S(0)", "sum", "(S(0), S(0)) -> P(sum)"),
    ("mse_loss", "S(0) S(0)", "mean", "(S(0), S(0)) -> P(sum)"),
    ("mse_loss", "S(1) S(1)", "mean", "(S(1), S(1)) -> P(sum)"),
    ("mse_loss", "S(0) S(0)", "none", "(S(0), S(0)) -> S(0)"),
    ("l1_loss", "S(0) R", "mean", "(S(0), R) -> P(sum)"),
    ("smooth_l1_loss", "S(0) S(0)", "sum", "(S(0), S(0)) -> P(sum)"),
    ("binary_cross_entropy_with_logits", "S(0) S(0)", "mean", "(S(0), S(0)) -> P(sum)"),
    ("kl_div", "S(0) S(0)", "batchmean", "(S(0), S(0)) -> P(sum)"),
    ("mse_loss", "R R", "mean", "(R, R) -> R"),
])
def test_loss_layouts_are_readable_and_values_exact(name, placements, reduction, want, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 0.9, (5, 4)).astype("float32")          # 5 rows over 2 ranks: uneven shards
    y = rng.uniform(0.1, 0.9, (5, 4)).astype("float32")
    pls = [ap.Replicate() if p == "R" else ap.Shard(int(p[2])) for p in placements.split()]
    ref = float(getattr(F, name)(paddle.to_tensor(x), paddle.to_tensor(y), reduction=reduction).numpy().sum())
    monkeypatch.setenv("AP_SCALAR_REDUCE", "off")                 # the rule's own layout
    with ap.simulate(2):
        text, value = _layout(getattr(F, name), pls, x, y, reduction=reduction)     # looked up once routed
    assert text == want
    assert value == pytest.approx(ref, rel=1e-5)
    monkeypatch.setenv("AP_SCALAR_REDUCE", "on")                  # default: a one-element result is settled
    with ap.simulate(2):
        text, value = _layout(getattr(F, name), pls, x, y, reduction=reduction)
    assert text == (want.replace("P(sum)", "R") if reduction != "none" else want)
    assert value == pytest.approx(ref, rel=1e-5)


def _rule_str(op, *specs, **attrs):
    return str(get_spmd_rule(op)(*specs, **attrs))


def test_rule_layouts_of_new_rules():
    from autoparallel.core.spec import DistSpec
    from autoparallel.placement import parse_placements

    mesh = mesh_from_shape([2])

    def s(shape, pl, dtype="float32"):
        return DistSpec(mesh, tuple(parse_placements(pl)), tuple(shape), dtype)

    assert _rule_str("nansum", s([4, 6], "S(0)"), axis=0) == "(S(0)) -> P(sum)"
    assert _rule_str("nanmean", s([4, 6], "S(0)"), axis=0) == "(R) -> R"
    assert _rule_str("avg_pool2d", s([2, 3, 6, 6], "P(sum)"), 2) == "(P(sum)) -> P(sum)"
    assert _rule_str("max_pool2d", s([2, 3, 6, 6], "P(sum)"), 2) == "(R) -> R"
    assert _rule_str("max_pool2d", s([2, 3, 6, 6], "S(1)"), 2) == "(S(1)) -> S(1)"
    assert _rule_str("max_pool2d", s([2, 3, 6, 6], "S(2)"), 2) == "(R) -> R"
    assert _rule_str("negative", s([4, 6], "P(sum)")) == "(P(sum)) -> P(sum)"
    assert _rule_str("atan2", s([4, 6], "P(sum)"), s([4, 6], "R")) == "(R, R) -> R"
    assert _rule_str("cumprod", s([4, 6], "S(1)"), dim=1) == "(R) -> R"
    assert _rule_str("cumprod", s([4, 6], "S(0)"), dim=1) == "(S(0)) -> S(0)"
    assert _rule_str("dot", s([6], "S(0)"), s([6], "S(0)")) == "(S(0), S(0)) -> P(sum)"
    assert _rule_str("tensordot", s([3, 4], "S(1)"), s([4, 5], "R"), axes=1) == "(S(1), S(0)) -> P(sum)"


# ---- a user's regression model ---------------------------------------------------------------------------------------
def _data():
    rng = np.random.default_rng(3)
    return rng.standard_normal((5, 4)).astype("float32"), rng.standard_normal((5, 1)).astype("float32")


def _train(dp: bool, steps=3):
    paddle.seed(11)
    model = paddle.nn.Linear(4, 1)
    X, Y = _data()
    x, y = paddle.to_tensor(X), paddle.to_tensor(Y)
    if dp:
        mesh = mesh_from_shape([2], ["data"])
        model = ap.shard_layer(model, mesh)
        x, y = ap.shard_tensor(x, mesh, [ap.Shard(0)]), ap.shard_tensor(y, mesh, [ap.Shard(0)])
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    if dp:
        opt = ap.shard_optimizer(opt)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses, model


def test_regression_model_data_parallel_equals_one_process():
    ref_losses, ref_model = _train(dp=False)
    ref = {n: p.numpy() for n, p in ref_model.named_parameters()}
    with ap.simulate(2):
        losses, model = _train(dp=True)
        from autoparallel.testing.check import check_every_rank

        assert check_every_rank(model, ref, rtol=1e-5, atol=1e-6) == 2 * len(ref)
        x = ap.shard_tensor(paddle.to_tensor(_data()[0]), model.weight.mesh, [ap.Shard(0)])
        y = ap.shard_tensor(paddle.to_tensor(_data()[1]), model.weight.mesh, [ap.Shard(0)])
        out = model(x)
        naive = np.mean([float(F.mse_loss.__wrapped__(out.locals[r], y.locals[r])) for r in (0, 1)])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # negative control: averaging paddle's own per-shard losses (3 rows and 2 rows) is not the global mean
    assert abs(naive - float(F.mse_loss.__wrapped__(ref_model(paddle.to_tensor(_data()[0])),
                                                     paddle.to_tensor(_data()[1])))) > 1e-4


def test_mse_loss_layer_routes_its_c_op_call():
    """paddle.nn.MSELoss.forward calls _C_ops.square itself: it runs as mse_loss on distributed tensors."""
    X, Y = _data()
    ref = float(paddle.nn.MSELoss()(paddle.to_tensor(X), paddle.to_tensor(Y)))
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        got = paddle.nn.MSELoss(reduction="mean")(ap.shard_tensor(paddle.to_tensor(X), mesh, [ap.Shard(0)]),
                                                   ap.shard_tensor(paddle.to_tensor(Y), mesh, [ap.Shard(0)]))
        assert float(got) == pytest.approx(ref, rel=1e-6)


# ---- unsupported arguments and what still has no rule ----------------------------------------------------------------
def test_unsupported_argument_values_raise_typed_errors():
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        x = ap.shard_tensor(paddle.randn([4, 6]), mesh, [ap.Shard(0)])
        with pytest.raises(ValueError, match="reduction"):
            F.mse_loss(x, x, reduction="avg")
        with pytest.raises(NotImplementedError, match="svd"):
            paddle.linalg.matrix_norm(x, p="nuc")
        with pytest.raises(NotImplementedError, match="out="):
            F.normalize(x, out=paddle.zeros([4, 6]))
        with pytest.raises(NotImplementedError, match="python int"):
            paddle.narrow(x, 0, paddle.to_tensor(1.0), 2)     # an integer tensor start is read as its value
        with pytest.raises(ValueError, match="data_format"):
            F.group_norm(ap.shard_tensor(paddle.randn([2, 4, 3]), mesh, [ap.Shard(0)]), 2, data_format="NWC")


GUARDED_F_BOUND = 24          # guarded callables left in paddle.nn.functional (105 before; 26 before diag_embed, pdist)


def _guarded(mod):
    return sorted(a for a in dir(mod) if not a.startswith("_") and getattr(getattr(mod, a), "_ap_guard", False))


def test_guarded_names_fall_below_the_bound_and_still_raise():
    with ap.simulate(2):
        names = _guarded(F)
        assert len(names) <= GUARDED_F_BOUND, names
        for n in ("mse_loss", "max_pool2d", "glu", "nll_loss", "adaptive_avg_pool2d", "hardtanh"):
            assert n not in names
        mesh = mesh_from_shape([2])
        x = ap.shard_tensor(paddle.randn([4, 6]), mesh, [ap.Shard(0)])
        for n in names:
            with pytest.raises(NotImplementedError, match=f"{n}.*register_spmd_rule"):
                getattr(F, n)(x)


# ---- randomness, call forms, uninstall -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,kwargs", [("rand_like", {}), ("randn_like", {}), ("randint_like", {"low": 3, "high": 9}),
                                         ("rand_like", {"dtype": "float64"})])
def test_random_like_equals_the_single_process_draw_in_every_layout(name, kwargs):
    a = paddle.randn([5, 4])
    paddle.seed(5)
    ref = getattr(paddle, name)(a, **kwargs).numpy()
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        for pl in ([ap.Shard(0)], [ap.Shard(1)], [ap.Replicate()], [ap.Partial("sum")]):
            x = ap.reshard(ap.shard_tensor(a, mesh, [ap.Replicate()]), mesh, pl)
            paddle.seed(5)
            out = getattr(paddle, name)(x, **kwargs)
            assert [str(p) for p in out.placements] == ["R" if isinstance(pl[0], ap.Partial) else str(pl[0])]
            np.testing.assert_array_equal(out.full().numpy(), ref)
            paddle.seed(6)                             # negative control: another seed, other values
            assert not np.array_equal(getattr(paddle, name)(x, **kwargs).full().numpy(), ref)


@pytest.mark.parametrize("name,shape,kwargs", [("dropout1d", [4, 6, 3], {}), ("dropout2d", [2, 4, 3, 3], {}),
                                               ("dropout2d", [2, 3, 3, 4], {"data_format": "NHWC"}),
                                               ("dropout3d", [2, 4, 2, 2, 2], {})])
def test_channel_dropout_equals_the_single_process_draw(name, shape, kwargs):
    a = paddle.randn(shape)
    paddle.seed(9)
    ref = getattr(F, name)(a, 0.5, **kwargs).numpy()
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        for d in range(len(shape)):
            paddle.seed(9)
            got = getattr(F, name)(ap.shard_tensor(a, mesh, [ap.Shard(d)]), 0.5, **kwargs)
            np.testing.assert_allclose(got.full().numpy(), ref, rtol=1e-6)
        x = ap.shard_tensor(a, mesh, [ap.Shard(0)])
        assert paddle.empty_like(x).shape == shape and paddle.empty_like(x).placements == x.placements


def test_call_forms_methods_and_uninstall():
    a, b = paddle.randn([4, 6]), paddle.randn([4, 6])
    original = F.mse_loss
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        x, y = ap.shard_tensor(a, mesh, [ap.Shard(0)]), ap.shard_tensor(b, mesh, [ap.Shard(1)])
        assert float(F.mse_loss(input=x, label=y)) == pytest.approx(float(original(a, b)), rel=1e-6)
        assert x.unflatten(1, [3, 2]).shape == [4, 3, 2]                  # a DistTensor method
        assert paddle.moveaxis(x, source=0, destination=1).shape == [6, 4]
        layer = ap.shard_layer(paddle.nn.Linear(6, 4), mesh)
        w = layer.weight                                                  # a DistParameter: paddle.Tensor method
        np.testing.assert_allclose(w.moveaxis(0, 1).full().numpy(), layer.weight.full().numpy().T)
        assert getattr(F.mse_loss, "_ap_composite", None)
        # what uninstall() puts back (the ledger of autoparallel.patches): paddle's own functions
        for owner, name in ((F, "mse_loss"), (paddle, "moveaxis"), (paddle.Tensor, "moveaxis"),
                            (paddle.nn.MSELoss, "forward")):
            assert patches.original(owner, name) is not getattr(owner, name)
            assert not hasattr(patches.original(owner, name), "_ap_composite")
        raw = getattr(original, "__wrapped__", original)                 # paddle's own function
        assert patches.original(F, "mse_loss") is raw
        from autoparallel.dispatch import routed_form

        assert routed_form(raw) is F.mse_loss                            # a loss_fn taken before install


# ---- paddle.nn layers built on these ops -----------------------------------------------------------------------------
def _layer_cases():
    rng = np.random.default_rng(0)

    def t(*s):
        return paddle.to_tensor(rng.standard_normal(s).astype("float32"))

    img, x, y = t(4, 6, 4, 4), t(4, 6), t(4, 6)
    pm = paddle.to_tensor(np.where(rng.random((4, 6)) > 0.5, 1.0, -1.0).astype("float32"))
    nn = paddle.nn
    return [
        (lambda: nn.GroupNorm(3, 6), (img,)), (lambda: nn.InstanceNorm2D(6), (img,)), (lambda: nn.MaxPool2D(2), (img,)),
        (lambda: nn.AvgPool2D(2, 2), (img,)), (lambda: nn.AdaptiveAvgPool2D(1), (img,)),
        (lambda: nn.AdaptiveMaxPool2D(2), (img,)), (lambda: nn.MaxPool1D(2), (t(4, 2, 6),)),
        (lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
        (img,)), (lambda: nn.UpsamplingNearest2D(scale_factor=2), (img,)),
        (lambda: nn.PixelShuffle(2), (t(2, 8, 3, 3),)), (lambda: nn.PixelUnshuffle(2), (img,)),
        (lambda: nn.ChannelShuffle(2), (img,)), (lambda: nn.PReLU(6), (img,)), (lambda: nn.Maxout(3), (img,)),
        (lambda: nn.Hardtanh(), (x,)), (lambda: nn.Swish(), (x,)), (lambda: nn.CELU(), (x,)), (lambda: nn.GLU(), (x,)),
        (lambda: nn.MSELoss(), (x, y)), (lambda: nn.L1Loss(), (x, y)), (lambda: nn.SmoothL1Loss(), (x, y)),
        (lambda: nn.BCEWithLogitsLoss(), (x, (pm + 1) / 2)), (lambda: nn.BCELoss(), (F.sigmoid(x), (pm + 1) / 2)),
        (lambda: nn.KLDivLoss(), (x, F.softmax(y))),
        (lambda: nn.NLLLoss(), (F.log_softmax(x), paddle.to_tensor(np.array([0, 1, 5, 2])))),
        (lambda: nn.CosineSimilarity(), (x, y)), (lambda: nn.PairwiseDistance(), (x, y)),
        (lambda: nn.Unflatten(1, [2, 3]), (x,)), (lambda: nn.HingeEmbeddingLoss(), (x, pm)),
        (lambda: nn.SoftMarginLoss(), (x, pm)), (lambda: nn.MarginRankingLoss(0.1), (x, y, pm)),
        (lambda: nn.TripletMarginLoss(), (x, y, t(4, 6))),
    ]


def test_paddle_nn_layers_run_on_a_sharded_batch_like_one_process():
    bad = []
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        for make, args in _layer_cases():
            layer = make()
            ref = layer(*args).numpy()
            ap.shard_layer(layer, mesh)
            got = layer(*[ap.shard_tensor(a, mesh, [ap.Shard(0)]) for a in args])
            if not np.allclose(got.full().numpy(), ref, rtol=1e-4, atol=1e-5):
                bad.append(type(layer).__name__)
    assert bad == []


def test_tensor_methods_of_the_new_rules_on_distributed_tensors():
    a, b = paddle.randn([4, 6]), paddle.randn([4, 6])
    calls = [("atan2", (b,), {}), ("nansum", (), {"axis": 0}), ("cumprod", (), {"dim": 1}), ("lerp", (b, 0.5), {}),
             ("median", (), {"axis": 0}), ("quantile", (0.5,), {"axis": 1}), ("kthvalue", (2,), {"axis": 1}),
             ("logcumsumexp", (), {"axis": 0}), ("trace", (), {}), ("gt", (b,), {}), ("greater", (b,), {}),
             ("hypot", (b,), {}), ("inner", (b,), {}), ("tensordot", (b.T,), {"axes": 1}), ("frac", (), {}),
             ("count_nonzero", (), {"axis": 1}), ("diff", (), {"axis": 0}), ("cummax", (), {"axis": 1}),
             ("isclose", (b,), {}), ("moveaxis", (0, 1), {}), ("ravel", (), {})]
    bad = []
    with ap.simulate(2):
        mesh = mesh_from_shape([2])
        x = ap.shard_tensor(a, mesh, [ap.Shard(0)])
        for name, args, kw in calls:
            want = _outs(getattr(a, name)(*args, **kw))
            dargs = [ap.shard_tensor(v, mesh, [ap.Shard(1)]) if isinstance(v, paddle.Tensor) else v for v in args]
            got = _outs(getattr(x, name)(*dargs, **kw))
            if not all(np.allclose(g.full().numpy().astype("float64"), w.numpy().astype("float64"), atol=1e-5)
                       for g, w in zip(got, want)):
                bad.append(name)
    assert bad == []


def test_numel_agrees_with_shape_for_dist_tensors_and_dist_parameters():
    """paddle.numel(x) == prod(x.shape): a DistTensor's global shape, a DistParameter's local shard (its .shape);
    PaddleFormers routes Tensor.numel through paddle.numel, so memory counts of parameters stay per rank."""
    with ap.simulate(world_size=2):
        mesh = ap.ProcessMesh([0, 1], dim_names=["x"])
        t = ap.shard_tensor(paddle.ones([8, 4]), mesh, [ap.Shard(0)])
        assert int(paddle.numel(t)) == 32
        layer = paddle.nn.Linear(4, 8)

        def fn(name, sub, m):
            if isinstance(sub, paddle.nn.Linear):
                sub.weight = ap.shard_tensor(sub.weight, m, [ap.Shard(1)])
        ap.shard_layer(layer, mesh, fn)
        w = layer.weight
        assert list(w.shape) == [4, 4] and int(paddle.numel(w)) == int(w.numel()) == 16
