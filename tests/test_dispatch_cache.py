"""The dispatch cache: a repeated call signature reuses its plan (no rule evaluation) and gives exactly what an
uncached call gives; a change of any key component plans afresh."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

import autoparallel as ap
from autoparallel import dispatch, dispatch_cache
from autoparallel.mesh import mesh_from_shape
from spmd_rules import get_spmd_rule, register_spmd_rule
from spmd_rules import registry
from spmd_rules.registry import SpmdRule

R, S, P = ap.Replicate(), ap.Shard, ap.Partial


@pytest.fixture
def rule_calls(monkeypatch):
    """Counts rule evaluations by op name."""
    counts = {}
    orig = SpmdRule.__call__

    def counting(self, *args, **kwargs):
        counts[self.name] = counts.get(self.name, 0) + 1
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(SpmdRule, "__call__", counting)
    dispatch.install()          # routing is installed on first use; `paddle.matmul` is read before its arguments
    dispatch_cache.clear()
    return counts


def _arr(shape, seed, dtype="float32"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _act(mesh, shape, placements, seed=0, dtype="float32", grad=True):
    t = paddle.to_tensor(_arr(shape, seed, dtype))
    t.stop_gradient = not grad
    return ap.shard_tensor(t, mesh, placements)


def _param(mesh, shape, placements, seed=1):
    p = paddle.create_parameter(list(shape), "float32",
                                default_initializer=paddle.nn.initializer.Assign(_arr(shape, seed)))
    return ap.shard_tensor(p, mesh, placements)


def _labels(mesh, n, classes, placements):
    y = paddle.to_tensor(np.random.default_rng(5).integers(0, classes, (n,)))
    return ap.shard_tensor(y, mesh, placements)


# op name -> (inputs(mesh) -> dict, call(dict) -> output(s)); placements as in a DP2xTP2 step
CASES = {
    "add_resharded": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)]), "y": _act(m, [8, 12], [S(0), R], 2)},
                      lambda t: t["x"] + t["y"]),
    "radd_scalar": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: 2.0 + t["x"] * 3),
    "matmul_param": (lambda m: {"x": _act(m, [8, 12], [S(0), R]), "w": _param(m, [12, 6], [R, S(1)])},
                     lambda t: paddle.matmul(t["x"], t["w"])),
    "matmul_transpose": (lambda m: {"x": _act(m, [8, 12], [S(0), R]), "w": _param(m, [6, 12], [R, S(0)])},
                         lambda t: paddle.matmul(t["x"], t["w"], transpose_y=True)),
    "linear": (lambda m: {"x": _act(m, [8, 12], [S(0), R]), "w": _param(m, [12, 6], [R, S(1)]),
                          "b": _param(m, [6], [R, S(0)], 3)},
               lambda t: F.linear(t["x"], t["w"], t["b"])),
    "layer_norm": (lambda m: {"x": _act(m, [8, 12], [S(0), R]), "g": _param(m, [12], [R, R]),
                              "b": _param(m, [12], [R, R], 3)},
                   lambda t: F.layer_norm(t["x"], [12], t["g"], t["b"])),
    "softmax": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: F.softmax(t["x"], axis=1)),
    "reshape_uneven": (lambda m: {"x": _act(m, [5, 12], [S(0), R])}, lambda t: t["x"].reshape([5, 3, 4])),
    "getitem": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: t["x"][:, 2:10]),
    "concat_list": (lambda m: {"x": _act(m, [8, 12], [S(0), R]), "y": _act(m, [8, 4], [S(0), R], 2)},
                    lambda t: paddle.concat([t["x"], t["y"]], axis=1)),
    "split_outputs": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: paddle.split(t["x"], 3, axis=1)),
    "sum_kwargs": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])},
                   lambda t: paddle.sum(t["x"], axis=1, keepdim=True)),
    "astype": (lambda m: {"x": _act(m, [8, 12], [S(0), R])}, lambda t: t["x"].astype("float64")),
    "transpose": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: paddle.transpose(t["x"], [1, 0])),
    "vocab_parallel_ce": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)]), "y": _labels(m, 8, 12, [S(0), R])},
                          lambda t: F.cross_entropy(t["x"], t["y"])),
    "embedding": (lambda m: {"ids": _labels(m, 8, 10, [S(0), R]), "w": _param(m, [10, 6], [R, S(0)])},
                  lambda t: F.embedding(t["ids"], t["w"])),
    "dropout": (lambda m: {"x": _act(m, [8, 12], [S(0), S(1)])}, lambda t: F.dropout(t["x"], p=0.5)),
    "plain_next_to_dist": (lambda m: {"x": _act(m, [8, 12], [S(0), R])},
                           lambda t: t["x"] * paddle.full([12], 0.5)),
}


def _outputs(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _run_case(name):
    """Outputs' specs and global values, every rank's local input gradients, parameters' partial dims."""
    build, call = CASES[name]
    paddle.seed(7)
    mesh = mesh_from_shape([2, 2], ["data", "model"])
    inputs = build(mesh)
    outs = _outputs(call(inputs))
    result = {"specs": [o.spec for o in outs], "values": [o.numpy() for o in outs]}
    ts = [t for o in outs if o.spec.dtype.startswith("float") for _, t in sorted(o.locals.items())
          if not t.stop_gradient]
    if ts:
        paddle.autograd.backward(ts, [paddle.ones_like(t) for t in ts])
    for k, v in inputs.items():
        for r, t in sorted(v.locals.items()):
            result[f"grad {k} {r}"] = None if t.grad is None else t.grad.numpy()
        result[f"partial {k}"] = getattr(v, "_ap_partial_dims", None)
    return result


def _assert_same(a, b):
    assert a.keys() == b.keys()
    assert a["specs"] == b["specs"]
    for k in a:
        if k == "specs":
            continue
        if k == "values":
            for x, y in zip(a[k], b[k]):
                np.testing.assert_array_equal(x, y)
        elif isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_call_equals_uncached_and_skips_the_rule(name, rule_calls):
    with ap.simulate(4):
        with dispatch_cache.disabled():
            plain = _run_case(name)
        assert dispatch_cache.size() == 0
        first = _run_case(name)
        n_entries, n_rules = dispatch_cache.size(), sum(rule_calls.values())
        assert n_entries > 0
        again = _run_case(name)
    assert dispatch_cache.size() == n_entries, "the repeated call sites must hit the cache"
    assert sum(rule_calls.values()) == n_rules, "a cache hit must not evaluate any rule"
    _assert_same(plain, first)
    _assert_same(plain, again)


# ---- every key component ----------------------------------------------------------------------------------
def _mesh(names=("data", "model")):
    return mesh_from_shape([2, 2], list(names))


def _x(mesh=None, placements=(S(0), R), shape=(8, 12), dtype="float32"):
    return _act(mesh or _mesh(), list(shape), list(placements), dtype=dtype)


def _w(mesh=None, placements=(R, S(1))):
    return _param(mesh or _mesh(), [12, 12], list(placements))


# the base call is paddle.matmul(x=x, y=w); each variant changes one thing
VARIANTS = {
    "placements": lambda: paddle.matmul(x=_x(placements=(S(0), S(1))), y=_w()),
    "global shape": lambda: paddle.matmul(x=_x(shape=(4, 12)), y=_w()),
    "dtype": lambda: paddle.matmul(x=_x(dtype="float64"), y=_act(_mesh(), [12, 12], [R, S(1)], 1, "float64")),
    "mesh": lambda: paddle.matmul(x=_x(_mesh(("dp", "tp"))), y=_w(_mesh(("dp", "tp")))),
    "attribute": lambda: paddle.matmul(x=_x(), y=_w(), transpose_y=True),
    "activation instead of parameter": lambda: paddle.matmul(x=_x(), y=_act(_mesh(), [12, 12], [R, S(1)], 1)),
    "plain tensor instead of parameter": lambda: paddle.matmul(x=_x(), y=paddle.to_tensor(_arr([12, 12], 1))),
    "dotted path": lambda: paddle.Tensor.matmul(x=_x(), y=_w()),
}


def _base():
    return paddle.matmul(x=_x(), y=_w())


# spellings paddle binds to the same call: one canonical form, so they share the base call's plan
SAME_CALL = {
    "keyword order": lambda: paddle.matmul(y=_w(), x=_x()),
    "positional": lambda: paddle.matmul(_x(), _w()),
    "mixed": lambda: paddle.matmul(_x(), y=_w()),
}


@pytest.mark.parametrize("spelling", sorted(SAME_CALL))
def test_spellings_of_one_call_share_its_plan(spelling, rule_calls):
    with ap.simulate(4):
        want = _base()
        size, evaluated = dispatch_cache.size(), rule_calls.get("matmul", 0)
        got = SAME_CALL[spelling]()
        assert (dispatch_cache.size(), rule_calls.get("matmul", 0)) == (size, evaluated)
        assert got.spec == want.spec
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_changing_one_key_component_misses(variant, rule_calls):
    with ap.simulate(4):
        _base()
        size, evaluated = dispatch_cache.size(), rule_calls.get("matmul", 0)
        _base()
        assert (dispatch_cache.size(), rule_calls.get("matmul", 0)) == (size, evaluated)
        got = VARIANTS[variant]()
        assert dispatch_cache.size() == size + 1 and rule_calls["matmul"] == evaluated + 1
        with dispatch_cache.disabled():
            want = VARIANTS[variant]()
        assert got.spec == want.spec
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_world_cluster_and_rule_are_part_of_the_key(rule_calls):
    def call():
        return _base()

    with ap.simulate(4):
        call()
        size = dispatch_cache.size()
    with ap.simulate(8):                     # another world
        call()
        assert dispatch_cache.size() == size + 1
    with ap.simulate(4):
        ap.set_cluster("1x4:A100-80GB")      # reshards priced on another cluster
        try:
            call()
        finally:
            ap.set_cluster(None)
        assert dispatch_cache.size() == size + 2
        original = get_spmd_rule("matmul")
        seen = []

        def wrapped(*args, **kwargs):
            seen.append(args)
            return original.fn(*args, **kwargs)

        register_spmd_rule("matmul", wrapped, reverse=original.reverse_fn)
        try:
            out = call()
        finally:
            registry._RULES["matmul"] = original
        assert seen and dispatch_cache.size() == size + 3
        assert str(out.placements) == "[S(0), S(1)]"


def test_call_key_tells_types_apart_and_gives_up_on_unhashable_values():
    with ap.simulate(4):
        x = _x()
        keys = [dispatch_cache.call_key((x, v), {}, []) for v in (1, True, 1.0, "1", None, (1,), [1])]
        assert len(set(keys)) == len(keys)
        leaves = []
        key = dispatch_cache.call_key((x, [x, 2]), {"w": x}, leaves)
        assert key is not None and leaves == [x, x, x]
        assert dispatch_cache.call_key((x, np.array([1, 2])), {}, []) is None
        assert dispatch_cache.call_key((x, slice(0, paddle.to_tensor(2))), {}, []) is None
        assert dispatch_cache.call_key((x,), {"axis": {"a": [1, 2]}}, []) is not None


def test_gradient_requirements_are_read_per_call(rule_calls):
    """stop_gradient is not in the key: the same signature with and without gradients gives the right
    gradients both ways (the all_reduce of a replicated input's gradient is added per call)."""
    with ap.simulate(4):
        mesh = _mesh()
        w = _param(mesh, [12, 6], [R, S(1)])
        x0 = _act(mesh, [8, 12], [S(0), R], grad=False)
        paddle.matmul(x0, w)
        x = _act(mesh, [8, 12], [S(0), R])
        out = paddle.matmul(x, w)
        out.backward()
        full_w = _arr([12, 6], 1)
        got = {r: t.grad.numpy() for r, t in x.locals.items()}
        want = np.ones([8, 6], "float32") @ full_w.T
        for r, g in got.items():
            rows = slice(0, 4) if r < 2 else slice(4, 8)
            np.testing.assert_allclose(g, want[rows], rtol=1e-5, atol=1e-6, err_msg=f"rank {r}")
        assert rule_calls["matmul"] == 1


def test_every_parameter_of_a_cached_call_site_is_marked(rule_calls):
    with ap.simulate(4):
        mesh = _mesh()
        ws = [_param(mesh, [12, 6], [R, S(1)], seed) for seed in (1, 2)]
        for w in ws:
            paddle.matmul(_x(mesh), w)
        assert rule_calls["matmul"] == 1
    assert [w._ap_partial_dims for w in ws] == [frozenset({0}), frozenset({0})]


def test_pinned_layouts_override_a_cached_plan(rule_calls):
    with ap.simulate(4):
        mesh = _mesh()
        x, w = _x(mesh), _param(mesh, [12, 6], [R, S(1)])
        by_rule = paddle.matmul(x, w)
        gathered = get_spmd_rule("matmul")(x.spec, w.spec.with_placements([R, R]))
        with dispatch.pinned(["matmul"], [gathered]):
            pinned = paddle.matmul(x, w)
        again = paddle.matmul(x, w)
        assert str(by_rule.placements) == str(again.placements) == "[S(0), S(1)]"
        assert str(pinned.placements) == "[S(0), R]"
        np.testing.assert_allclose(pinned.numpy(), by_rule.numpy(), rtol=1e-6)


def test_errors_still_raised_after_caching(rule_calls):
    with ap.simulate(4):
        x = _x()
        x + x
        other = _act(mesh_from_shape([4], ["all"]), [8, 12], [S(0)])
        with pytest.raises(ValueError, match="one mesh"):
            x + other
        with pytest.raises(ValueError, match="one mesh"):
            x + other


# ---- calls as written ----------------------------------------------------------------------------------------
# spellings whose bound form differs from the written one (keyword -> position, varargs -> list, torch-style
# aliases, reflected operators); each pair: two calls with the same written key but different tensors, then
# a call differing only in a value the binding moves (which must not reuse the first recipe)
WRITTEN = {
    "keyword axis": (lambda x: F.softmax(x, axis=1), lambda x: F.softmax(x, axis=0)),
    "keyword keepdim": (lambda x: paddle.sum(x, axis=1, keepdim=True), lambda x: paddle.sum(x, axis=0, keepdim=True)),
    "varargs reshape": (lambda x: x.reshape(4, 2, 12), lambda x: x.reshape(2, 4, 12)),
    "torch alias dim": (lambda x: paddle.sum(x, dim=1), lambda x: paddle.sum(x, dim=0)),
    "reflected": (lambda x: 2.0 - x, lambda x: 3.0 - x),
    "keyword tensors": (lambda x: paddle.matmul(y=_w(), x=x), lambda x: paddle.matmul(y=_w(), x=x, transpose_y=True)),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_call_as_written_reuses_its_bound_form(name, rule_calls, monkeypatch):
    from autoparallel import shadows

    call, other = WRITTEN[name]
    saved = shadows.SHADOWS[0]
    shadows.SHADOWS[0] = False          # an earlier test's shadowed buffer turns the lookup off for the process
    try:
        _written_case(call, other, monkeypatch, rule_calls)
    finally:
        shadows.SHADOWS[0] = saved


def _written_case(call, other, monkeypatch, rule_calls):
    binds = []
    bind = dispatch._bind
    monkeypatch.setattr(dispatch, "_bind", lambda *a: binds.append(a[1]) or bind(*a))
    with ap.simulate(4):
        x1, x2 = _act(_mesh(), [8, 12], [S(0), R], 1), _act(_mesh(), [8, 12], [S(0), R], 2)
        call(x1)
        n_binds, n_rules = len(binds), sum(rule_calls.values())
        got = call(x2)                                  # same written key, other values: bound from the recipe
        assert (len(binds), sum(rule_calls.values())) == (n_binds, n_rules)
        got_other = other(x2)                           # another value where binding moves it: its own entry
        assert len(binds) > n_binds
        with dispatch_cache.disabled():
            want, want_other = call(x2), other(x2)
        for g, w in ((got, want), (got_other, want_other)):
            assert g.spec == w.spec
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert got.shape != got_other.shape or not np.array_equal(got.numpy(), got_other.numpy())


def test_a_bound_form_holding_a_new_tensor_is_not_remembered():
    x = paddle.ones([2])
    made = paddle.zeros([2])
    assert dispatch_cache.Rebind.of((x,), {}, [x], (x, made), {}, [x, made]) is None
    assert dispatch_cache.Rebind.of((x,), {}, [x], (x, [made]), {}, [x, made]) is None
    r = dispatch_cache.Rebind.of((x,), {"axis": 1}, [x], (x, 1), {}, [x])
    y = paddle.full([2], 3.0)
    a, k, leaves = r.apply((y,), {"axis": 1}, [y])
    assert a[0] is y and a[1] == 1 and k == {} and leaves == [y] and not r.same
    assert dispatch_cache.Rebind.of((x, 2), {}, [x], (x, 2), {}, [x]).same
    pads = [1, 1]                       # one object in two written slots: which one fills a bound slot is unknown
    assert dispatch_cache.Rebind.of((x, pads, pads), {}, [x], (x, pads, pads), {}, [x]) is None


def test_a_repeated_argument_is_not_taken_for_the_next_calls_arguments(rule_calls):
    """``x * x`` and ``y * z`` have the same written key; the recipe must not pass ``y`` twice."""
    with ap.simulate(4):
        x, y, z = (_act(_mesh(), [8, 12], [S(0), R], s) for s in (1, 2, 3))
        x * x
        x * x
        got = y * z
        shape = [4, 24]
        x.reshape(shape)
        shape[1] = 2                                    # the caller changes its list after the call
        got_reshape = y.reshape([4, 24])
        with dispatch_cache.disabled():
            want = y * z
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert got_reshape.shape == [4, 24]
