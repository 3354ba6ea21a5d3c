"""Every call form paddle accepts reaches the rule in one canonical form: each form run on a sharded
DistTensor equals the same form on the plain tensor; aliases, in-place forms and cast spellings route."""
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import dispatch, dispatch_cache
from autoparallel.binding import canonical
from autoparallel.mesh import mesh_from_shape

R, S = ap.Replicate(), ap.Shard

X = np.random.default_rng(0).standard_normal((4, 6, 2, 5)).astype("float32")
Y = np.random.default_rng(1).standard_normal((4, 6, 2, 5)).astype("float32")

# (label, call on x (and y)): each is a spelling paddle 3.3 accepts
FORMS = [
    ("transpose two dims (method)", lambda x, y: x.transpose(1, 2)),
    ("transpose two dims (function)", lambda x, y: paddle.transpose(x, 1, 3)),
    ("transpose dim0/dim1 keywords", lambda x, y: x.transpose(dim0=0, dim1=2)),
    ("transpose perm list", lambda x, y: x.transpose([0, 2, 1, 3])),
    ("transpose perm keyword", lambda x, y: paddle.transpose(x, perm=[3, 1, 2, 0])),
    ("reshape varargs", lambda x, y: x.reshape(4, 6, 10)),
    ("reshape list", lambda x, y: x.reshape([4, 60])),
    ("reshape input= keyword", lambda x, y: paddle.reshape(input=x, shape=[24, 10])),
    ("view varargs", lambda x, y: x.view(4, 6, 10)),
    ("view size=", lambda x, y: x.view(size=[4, 60])),
    ("expand varargs", lambda x, y: x[:, :1].expand(4, 3, 2, 5)),
    ("expand size=", lambda x, y: paddle.expand(x[:, :1], size=[4, 3, 2, 5])),
    ("sum dim=", lambda x, y: x.sum(dim=1)),
    ("sum positional keepdim", lambda x, y: x.sum(1, True)),
    ("sum input=/dim=/keepdim=", lambda x, y: paddle.sum(input=x, dim=-1, keepdim=True)),
    ("mean dim= keepdim", lambda x, y: x.mean(dim=-1, keepdim=True)),
    ("max axis keepdim", lambda x, y: x.max(axis=3, keepdim=True)),
    ("softmax dim=", lambda x, y: F.softmax(x, dim=1)),
    ("softmax method positional", lambda x, y: x.softmax(3)),
    ("concat dim=", lambda x, y: paddle.concat([x, y], dim=1)),
    ("cat (alias) axis=", lambda x, y: paddle.cat((x, y), axis=-1)),
    ("permute varargs", lambda x, y: x.permute(0, 2, 1, 3)),
    ("permute list", lambda x, y: paddle.permute(x, [3, 2, 1, 0])),
    ("unsqueeze/squeeze", lambda x, y: x.unsqueeze(1).squeeze(1)),
    ("flatten start", lambda x, y: x.flatten(1)),
    ("matmul keyword order", lambda x, y: paddle.matmul(y=y.transpose([0, 1, 3, 2]), x=x)),
    ("add other= alpha", lambda x, y: paddle.add(x, y, alpha=2)),
    ("split", lambda x, y: paddle.split(x, 2, axis=1)[1]),
    ("chunk dim", lambda x, y: x.chunk(3, axis=1)[2]),
]


def _run(form, placements):
    plain = form(paddle.to_tensor(X), paddle.to_tensor(Y)).numpy()
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, placements)
        y = ap.shard_tensor(paddle.to_tensor(Y), mesh, [R, R])
        out = form(x, y)
        assert isinstance(out, ap.DistTensor), type(out)
        return plain, out.numpy()


@pytest.mark.parametrize("label,form", FORMS, ids=[f[0] for f in FORMS])
def test_every_call_form_equals_the_plain_call(label, form):
    plain, got = _run(form, [S(0), S(1)])
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-6)


def test_canonical_form_is_a_fixed_point_and_binds_like_paddle():
    x = paddle.to_tensor(X)
    for fn, args, kwargs, want in [
        (paddle.transpose, (x, 1, 2), {}, ((x, [0, 2, 1, 3]), {})),
        (paddle.Tensor.reshape, (x, 4, 60), {}, ((x, [4, 60]), {})),
        (paddle.sum, (x,), {"dim": 1, "keepdim": True}, ((x, 1), {"keepdim": True})),
        (F.softmax, (x,), {"dim": 2}, ((x, 2), {})),
        (paddle.zeros, (2, 3), {}, (([2, 3],), {})),
    ]:
        got = canonical(fn, args, kwargs)
        assert _norm(got) == _norm(want), (fn, got)
        assert _norm(canonical(fn, *got)) == _norm(got)          # already canonical: unchanged


def _norm(call):
    args, kwargs = call
    f = lambda v: ("T", id(v)) if isinstance(v, paddle.Tensor) else v   # noqa: E731
    return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}


def test_a_call_paddle_refuses_is_refused_with_a_type_error():
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0)])
        with pytest.raises(TypeError):
            paddle.transpose(x, [0, 1, 2, 3], bogus=1)
        with pytest.raises(TypeError, match="split"):          # paddle.split has no dim= (paddle.compat does)
            paddle.split(x, 2, dim=1)


# ---- in-place forms --------------------------------------------------------------------------------------------
INPLACE = [
    ("reshape_ method", lambda x, y: x.reshape_([4, 6, 10])),
    ("paddle.reshape_", lambda x, y: paddle.reshape_(x, [24, 10])),
    ("add_", lambda x, y: x.add_(y)),
    ("scale_", lambda x, y: x.scale_(2.0)),
    ("exp_", lambda x, y: x.exp_()),
    ("unsqueeze_", lambda x, y: x.unsqueeze_(0)),
]


@pytest.mark.parametrize("label,form", INPLACE, ids=[f[0] for f in INPLACE])
def test_inplace_forms_update_the_held_tensor(label, form):
    px = paddle.to_tensor(X)
    form(px, paddle.to_tensor(Y))
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0), R])
        y = ap.shard_tensor(paddle.to_tensor(Y), mesh, [S(0), S(1)])
        out = form(x, y)
        assert out is x
        np.testing.assert_allclose(x.numpy(), px.numpy(), rtol=1e-5, atol=1e-6)


def test_inplace_on_a_parameter_keeps_it_a_parameter_and_refuses_a_layout_change():
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        w = paddle.create_parameter([4, 6], "float32")
        w.set_value(paddle.to_tensor(X[0, :, 0, :4].T.copy()))
        ref = w.numpy() * 3.0
        dw = ap.shard_tensor(w, mesh, [S(1)])
        with paddle.no_grad():
            out = dw.scale_(3.0)
        assert out is dw and isinstance(dw, ap.DistParameter)
        np.testing.assert_allclose(dw.full().numpy(), ref, rtol=1e-6)
        with pytest.raises(ValueError, match="requires a gradient"):
            dw.scale_(2.0)
        with paddle.no_grad(), pytest.raises(NotImplementedError, match="keeps its layout"):
            dw.reshape_([24])


def test_inplace_into_a_plain_buffer_with_distributed_values():
    """The MoE pattern: a plain zeros buffer index_add_-ed with distributed expert outputs."""
    idx = np.array([3, 0, 3])
    val = np.random.default_rng(2).standard_normal((3, 5)).astype("float32")
    want = paddle.zeros([4, 5]).index_add_(paddle.to_tensor(idx), 0, paddle.to_tensor(val)).numpy() + 1.0
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        v = ap.shard_tensor(paddle.to_tensor(val), mesh, [S(1)])
        buf = paddle.zeros([4, 5])
        ret = buf.index_add_(index=paddle.to_tensor(idx), axis=0, value=v)
        out = buf + 1.0
        assert isinstance(out, ap.DistTensor) and isinstance(ret, ap.DistTensor)
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(buf.numpy() + 1.0, want, rtol=1e-6)      # read directly: the new value
        np.testing.assert_allclose(ret.numpy() + 1.0, want, rtol=1e-6)


# ---- casts -------------------------------------------------------------------------------------------------------
CASTS = [
    ("float", lambda x, y: x.double().float(), "float32"),
    ("double", lambda x, y: x.double(), "float64"),
    ("half", lambda x, y: x.half(), "float16"),
    ("bfloat16", lambda x, y: x.bfloat16(), "bfloat16"),
    ("int", lambda x, y: x.int(), "int32"),
    ("long", lambda x, y: x.long(), "int64"),
    ("bool", lambda x, y: x.bool(), "bool"),
    ("type_as", lambda x, y: x.type_as(y.astype("float64")), "float64"),
    ("to(dtype)", lambda x, y: x.to("float64"), "float64"),
    ("to(dtype=)", lambda x, y: x.to(dtype=paddle.float16), "float16"),
    ("to(other)", lambda x, y: x.to(y.astype("int64")), "int64"),
    ("astype", lambda x, y: x.astype("float64"), "float64"),
    ("cast", lambda x, y: paddle.cast(x, "float64"), "float64"),
]


@pytest.mark.parametrize("label,form,dtype", CASTS, ids=[c[0] for c in CASTS])
def test_cast_spellings(label, form, dtype):
    plain = form(paddle.to_tensor(X), paddle.to_tensor(Y))
    with ap.simulate(4):
        mesh = mesh_from_shape([2, 2], ["data", "model"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0), S(3)])
        y = ap.shard_tensor(paddle.to_tensor(Y), mesh, [R, R])
        out = form(x, y)
        assert isinstance(out, ap.DistTensor) and out.spec.dtype == dtype
        assert out.placements == [S(0), S(3)]
        got = (out.astype("float32") if dtype == "bfloat16" else out).numpy()
    want = plain.astype("float32").numpy() if dtype == "bfloat16" else plain.numpy()
    np.testing.assert_allclose(got.astype("float64"), want.astype("float64"), rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-6)


def test_to_the_same_dtype_and_device_is_the_tensor_itself():
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0)])
        assert x.to("cpu") is x and x.to("float32") is x


def test_cast_on_a_distributed_parameter():
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        w = ap.shard_tensor(paddle.create_parameter([4, 6], "float32"), mesh, [S(0)])
        out = w.float().double()
        assert isinstance(out, ap.DistTensor) and out.spec.dtype == "float64" and out.placements == [S(0)]


# ---- aliases --------------------------------------------------------------------------------------------------
def test_no_original_of_a_routed_op_is_left_under_another_name():
    """Every name paddle exports for a routed op (any paddle module, paddle.Tensor) is the routed wrapper."""
    from autoparallel import aliases

    from autoparallel.dispatch_install import _STORAGE_METHODS

    dispatch.install()
    # paddle.Tensor's storage methods (numel, clone, ...) stay paddle's on purpose, and a library may keep a copy of
    # one under its own name (PaddleFormers' origin_numel = paddle.Tensor.numel, the function paddle.numel is)
    originals = {id(f): p for p, f in dispatch._ORIG.items() if p.rsplit(".", 1)[-1] not in _STORAGE_METHODS}
    left = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name.split(".", 1)[0] in ("autoparallel", "spmd_rules", "reshard") \
                or name in aliases._OP_NAMESPACES or name.startswith("paddle.base.libpaddle"):
            continue          # our own modules; the C-op namespaces generated functions call through
        for attr, val in list(vars(mod).items()):
            if id(val) in originals and not attr.startswith("__"):
                left.append(f"{name}.{attr} (= {originals[id(val)]})")
    for attr in dir(paddle.Tensor):         # storage methods (numel, clone, ...) act on a shard's storage on purpose
        if not attr.startswith("__") and attr not in _STORAGE_METHODS \
                and id(getattr(paddle.Tensor, attr, None)) in originals:
            left.append(f"paddle.Tensor.{attr}")
    assert left == []
    assert paddle.cat is paddle.concat and getattr(paddle.cat, "_ap_routed", None) == "concat"


def test_repeated_spellings_share_one_cached_plan():
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0)])
        x.transpose(1, 2)
        n = dispatch_cache.size()
        x.transpose(perm=[0, 2, 1, 3])
        x.transpose([0, 2, 1, 3])
        x.transpose(dim0=1, dim1=2)
        assert dispatch_cache.size() == n


def test_negative_control_without_binding_the_two_dim_transpose_is_misread(monkeypatch):
    monkeypatch.setattr(dispatch, "_bind", lambda op, path, args, kwargs: (args, kwargs))
    dispatch_cache.clear()
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X), mesh, [S(0)])
        with pytest.raises(ValueError, match="not a permutation"):
            x.transpose(1, 2)


def test_a_module_that_imported_an_op_by_name_before_install_is_repointed(monkeypatch):
    """``from paddle.nn.functional import swiglu as fused_swiglu`` in a model library imported first."""
    import types

    from autoparallel import aliases

    dispatch.install()
    orig = dispatch._ORIG["paddle.nn.functional.swiglu"]
    mod = types.ModuleType("user_models_lib")
    mod.fused_swiglu = orig
    monkeypatch.setitem(sys.modules, "user_models_lib", mod)
    aliases.patch_aliases({id(orig): paddle.nn.functional.swiglu})
    assert mod.fused_swiglu is paddle.nn.functional.swiglu
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X[:, :, 0, :4]), mesh, [S(0)])
        np.testing.assert_allclose(mod.fused_swiglu(x).numpy(),
                                   orig(paddle.to_tensor(X[:, :, 0, :4])).numpy(), rtol=1e-6)


def test_setitem_on_distributed_tensors_and_parameters():
    full = np.arange(24, dtype="float32").reshape(4, 6)
    want = full.copy()
    want[:, 1:3] = -1
    want[full > 20] = 7
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(full), mesh, [S(1)])
        x[:, 1:3] = -1.0
        x[ap.shard_tensor(paddle.to_tensor(full > 20), mesh, [S(0)])] = 7.0
        np.testing.assert_array_equal(x.numpy(), want)
        rows = ap.shard_tensor(paddle.to_tensor(full), mesh, [S(0)])
        rows[:, 0:2] = ap.shard_tensor(paddle.to_tensor(full[:, 4:]), mesh, [S(0)])   # rows stay where they are
        assert rows.placements == [S(0)]
        np.testing.assert_array_equal(rows.numpy(), np.concatenate([full[:, 4:], full[:, 2:]], axis=1))
        w = ap.shard_tensor(paddle.create_parameter([4, 6], "float32"), mesh, [S(1)])
        before = w.full().numpy()
        with paddle.no_grad():
            w[:, 0] = 3.0
        assert isinstance(w, ap.DistParameter) and w.placements == [S(1)]
        before[:, 0] = 3.0
        np.testing.assert_allclose(w.full().numpy(), before)


def test_c_op_exports_and_ops_held_by_layers_built_before_install_route():
    """``paddle.tensor.matmul`` / ``paddle.linalg.matmul`` are the C op behind ``paddle.matmul``; a layer built
    before dispatch was installed may hold ``getattr(F, "relu")`` as an attribute."""
    from autoparallel import aliases

    dispatch.install()
    assert getattr(sys.modules["paddle.tensor"].matmul, "_ap_routed", None) == "matmul"
    assert getattr(paddle.linalg.matmul, "_ap_routed", None) == "matmul"
    orig = dispatch._ORIG["paddle.nn.functional.relu"]
    layer = paddle.nn.Layer()
    layer.activation = orig
    aliases._repoint_layers({id(orig): paddle.nn.functional.relu})
    assert layer.activation is paddle.nn.functional.relu
    with ap.simulate(2):
        x = ap.shard_tensor(paddle.to_tensor(X), mesh_from_shape([2], ["x"]), [S(0)])
        np.testing.assert_allclose(layer.activation(x).numpy(), np.maximum(X, 0))
        np.testing.assert_allclose(sys.modules["paddle.tensor"].matmul(x, x, transpose_y=True).numpy(),
                                   X @ np.swapaxes(X, -1, -2), rtol=1e-5, atol=1e-5)


def test_every_decorated_routed_function_has_its_whole_wrapper_chain_replayed():
    """Binding replays paddle's own argument wrappers; a wrapper it could not rebuild would silently skip
    one of paddle's call forms, so every routed function's chain must be rebuilt down to its innermost."""
    from autoparallel import binding

    dispatch.install()
    short = []
    for path, fn in dispatch._ORIG.items():
        if not binding.has_signature(fn) or getattr(fn, "__wrapped__", None) is None:
            continue
        inner = fn
        while getattr(inner, "__wrapped__", None) is not None:
            inner = inner.__wrapped__
        b = binding.binder(fn)
        if b.front is None or b.inner is not inner:
            short.append(path)
    assert short == []


def test_a_form_that_reorders_tensor_arguments_binds_without_comparing_tensors():
    """``index_select(x, dim, index)`` (torch order) is moved by paddle's wrapper; binding must never
    compare tensors with ``==`` (an op on a DistTensor)."""
    idx = np.array([3, 0])
    with ap.simulate(2):
        mesh = mesh_from_shape([2], ["x"])
        x = ap.shard_tensor(paddle.to_tensor(X[:, :, 0, 0]), mesh, [S(0)])
        i = ap.shard_tensor(paddle.to_tensor(idx), mesh, [R])
        for _ in range(2):
            got = paddle.index_select(x, 1, i)
            np.testing.assert_allclose(got.numpy(), X[:, :, 0, 0][:, idx])
